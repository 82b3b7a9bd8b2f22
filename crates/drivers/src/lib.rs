//! Outboard's drivers.
//!
//! Each driver is split Mach-style into generic code shared by a family ([`virtio`]: the PCI
//! transport and the split virtqueue) and device-specific code ([`virtio_blk`]). Drivers reach
//! hardware only through `outboard-hw`, so the same code drives an Outboard device model over
//! vfio-user, a model in-process, or a real function through VFIO.
//!
//! [`personalities`] is the driver side of matching (I/O Kit): what each driver can drive and
//! how well; the device manager's catalog is built from it.
#![deny(missing_docs)]

pub mod virtio;
pub mod virtio_blk;

use outboard_hw::PciIdentity;

/// What a driver can drive, and how strongly it claims it.
#[derive(Debug, Clone, Copy)]
pub struct Personality {
    /// Driver name.
    pub driver: &'static str,
    /// Class of device it publishes.
    pub class: &'static str,
    /// Probe score: the highest matching score wins.
    pub score: u32,
    /// Passive match on identity.
    pub matches: fn(&PciIdentity) -> bool,
}

/// Every built-in driver's personality.
pub fn personalities() -> &'static [Personality] {
    &[Personality {
        driver: "virtio-blk",
        class: "block",
        score: 1000,
        matches: virtio_blk::matches,
    }]
}

/// The best driver for `id`, if any.
pub fn match_driver(id: &PciIdentity) -> Option<&'static Personality> {
    personalities()
        .iter()
        .filter(|p| (p.matches)(id))
        .max_by_key(|p| p.score)
}
