//! Generic virtio code, shared by every virtio driver (Mach's split between class code and
//! chip code): the PCI transport, the split virtqueue, and a device's bring-up, interrupts and
//! failure events ([`device`]). A virtio driver adds only its device part.

pub mod device;
pub mod queue;
pub mod transport;

pub use device::{Negotiation, VirtioDevice};
pub use queue::{Buf, VirtQueue};
pub use transport::{virtio_caps, Doorbell, Transport, VirtioCap};

use outboard_hw::HwError;

/// What went wrong driving a virtio device.
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    /// The hardware layer failed (device gone, region access refused).
    #[error(transparent)]
    Hw(#[from] HwError),
    /// DMA memory access failed.
    #[error(transparent)]
    Shm(#[from] outboard_hw::ShmError),
    /// The device rejected the features the driver accepted.
    #[error("device rejected features {accepted:#x} (it offered {offered:#x})")]
    Negotiation {
        /// Offered by the device.
        offered: u64,
        /// Accepted by the driver.
        accepted: u64,
    },
    /// The device misbehaved or lacks something the driver needs.
    #[error("device error: {0}")]
    Device(String),
}
