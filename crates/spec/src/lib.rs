//! Register maps and wire layouts from public specifications.
//!
//! Both sides of every interface in Outboard — the device models in `outboard-devices` and the
//! drivers in `outboard-drivers` — read their offsets and bits from here, so a layout is written
//! once, next to the section of the specification it comes from. Nothing here has behaviour.
#![deny(missing_docs)]

pub mod nbd;
pub mod pci;
pub mod timer;
pub mod uart;
pub mod virtio;
pub mod virtio_blk;
