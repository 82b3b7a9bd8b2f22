//! Backends: the ways a [`crate::PciFunction`] reaches its device.

pub mod in_process;
pub mod vfio;
pub mod vfio_user;

use std::os::fd::BorrowedFd;

use crate::{IrqKind, Region, Result};

/// What a backend provides. Drivers never see this trait; they use [`crate::PciFunction`].
pub trait Backend: Send + Sync {
    /// Reads configuration space.
    fn config_read(&self, offset: u64, buf: &mut [u8]) -> Result<()>;
    /// Writes configuration space (already mediated).
    fn config_write(&self, offset: u64, data: &[u8]) -> Result<()>;
    /// Size of BAR `bar` (0 if absent).
    fn region_size(&self, bar: u8) -> Result<u64>;
    /// BAR `bar`, with its mmapped parts mapped and its doorbells attached.
    fn region(&self, bar: u8) -> Result<Region>;
    /// Number of vectors of `kind`.
    fn irq_count(&self, kind: IrqKind) -> Result<u32>;
    /// Attaches eventfds to vectors `0..fds.len()` of `kind`; empty disables the kind.
    fn set_irqs(&self, kind: IrqKind, fds: &[BorrowedFd<'_>]) -> Result<()>;
    /// Unmasks INTx after its delivery (VFIO masks it as it delivers it, so that a level
    /// does not interrupt without end): raised again if the device still asserts it.
    fn unmask_intx(&self) -> Result<()>;
    /// Maps `size` bytes of `fd` from `offset` at `iova`, read-write for the device.
    fn dma_map(&self, iova: u64, size: u64, fd: BorrowedFd<'_>, offset: u64) -> Result<()>;
    /// Removes a mapping made by `dma_map`.
    fn dma_unmap(&self, iova: u64, size: u64) -> Result<()>;
    /// Resets the device.
    fn reset(&self) -> Result<()>;
    /// Whether the device's DMA goes through an IOMMU that translates the IOVAs drivers hand
    /// out (VFIO). Device models over vfio-user take IOVAs as their own address space.
    fn behind_iommu(&self) -> bool {
        false
    }
    /// A file descriptor that turns readable (or hung up) when the device is lost: the device
    /// model died or the connection to it was given up. `None`: the backend has no such signal.
    fn loss_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// Gives the device up after a failure, without waiting on it: the device must stop
    /// reaching memory through its DMA mappings. Returns whether that is certain now.
    /// Default: a reset, certain once it succeeded.
    fn abandon(&self) -> bool {
        self.reset().is_ok()
    }
}

/// VFIO IRQ index of an interrupt kind.
pub(crate) fn irq_index(kind: IrqKind) -> u32 {
    use outboard_vfio_user::wire::irq;
    match kind {
        IrqKind::Intx => irq::INTX,
        IrqKind::Msi => irq::MSI,
        IrqKind::MsiX => irq::MSIX,
    }
}
