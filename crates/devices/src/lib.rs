//! Outboard's emulated hardware.
//!
//! Each device model implements a real specification so that the same drivers also run
//! against other people's implementations of it (QEMU's devices, through VFIO). A model is a
//! [`outboard_vfio_user::DeviceBackend`]: served to another process by
//! [`outboard_vfio_user::Server`], or called in-process by `outboard-hw`'s in-process backend.
//!
//! | device | specification | module |
//! |---|---|---|
//! | virtio-blk | virtio 1.2 §5.2 over PCI §4.1 | [`virtio_blk`] over [`virtio_pci`] |
//! | virtio-rng | virtio 1.2 §5.4 over PCI §4.1 | [`virtio_rng`] over [`virtio_pci`] |
//! | pci-serial (16550A) | PC16550D data sheet, QEMU's `pci-serial` identity | [`serial`] over [`serial_line`] |
//! | timer | Outboard's own (`docs/timer.md`, `outboard_spec::timer`) | [`timer`] |
#![deny(missing_docs)]

pub mod backing;
pub mod faults;
pub mod msix;
pub mod pci_config;
pub mod serial;
pub mod serial_line;
pub mod timer;
pub mod virtio_blk;
pub mod virtio_net;
pub mod virtio_pci;
pub mod virtio_rng;
pub mod virtqueue;

use backing::Backing;
use virtio_blk::{BlkOptions, VirtioBlk};
use virtio_pci::VirtioPci;

/// A virtio-blk PCI function over `backing`, ready to serve.
pub fn virtio_blk(backing: Backing, opts: BlkOptions) -> std::io::Result<VirtioPci<VirtioBlk>> {
    VirtioPci::new(VirtioBlk::new(backing, opts))
}
