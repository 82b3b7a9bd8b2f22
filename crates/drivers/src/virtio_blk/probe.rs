//! Whether this driver can drive a function, from its identity and configuration space.

use outboard_hw::PciIdentity;
use outboard_spec::virtio;

/// Whether this driver can drive `id` (modern virtio-blk, or transitional with subsystem 2).
pub fn matches(id: &PciIdentity) -> bool {
    id.vendor == virtio::PCI_VENDOR_ID
        && (id.device == virtio::PCI_DEVICE_ID_BASE + virtio::DEVICE_ID_BLOCK
            || (id.device == 0x1001 && id.subsystem == 2))
}

/// The active probe (I/O Kit's `probe`), from configuration space and BAR sizes only — it
/// changes nothing on the device. This driver speaks the modern virtio-pci interface (§4.1.4),
/// so the common, notify, ISR and device-configuration structures must each be there, inside
/// a BAR the function has. A modern device (1042) is claimed with `initial`; a transitional one
/// (1001) that also offers the modern interface with 100 less, so that a driver for the legacy
/// interface could outbid it.
pub fn probe_score(
    id: &PciIdentity,
    caps: &[crate::virtio::transport::VirtioCap],
    bar_sizes: &[u64; 6],
    initial: u32,
) -> Result<u32, String> {
    use outboard_spec::virtio::cap;
    crate::virtio::device::modern_structures(
        caps,
        bar_sizes,
        &[
            cap::COMMON_CFG,
            cap::NOTIFY_CFG,
            cap::ISR_CFG,
            cap::DEVICE_CFG,
        ],
    )?;
    Ok(if id.device == 0x1001 {
        initial.saturating_sub(100)
    } else {
        initial
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::transport::VirtioCap;
    use outboard_spec::virtio::cap;

    fn id(device: u16) -> PciIdentity {
        PciIdentity {
            vendor: virtio::PCI_VENDOR_ID,
            device,
            subsystem_vendor: virtio::PCI_VENDOR_ID,
            subsystem: 2,
            class: 1,
            subclass: 0,
            prog_if: 0,
            revision: 1,
        }
    }

    fn structure(cfg_type: u8, offset: u32) -> VirtioCap {
        VirtioCap {
            at: 0x40 + cfg_type * 0x10,
            cfg_type,
            bar: 4,
            offset,
            length: 0x1000,
            multiplier: 4,
        }
    }

    /// The four structures QEMU places in BAR 4 (16 KiB).
    fn modern() -> (Vec<VirtioCap>, [u64; 6]) {
        let caps = [
            cap::COMMON_CFG,
            cap::ISR_CFG,
            cap::DEVICE_CFG,
            cap::NOTIFY_CFG,
        ]
        .iter()
        .enumerate()
        .map(|(i, &t)| structure(t, i as u32 * 0x1000))
        .collect();
        (caps, [0x1000, 0, 0, 0, 0x4000, 0])
    }

    #[test]
    fn a_modern_device_is_claimed_and_a_transitional_one_with_less() {
        let (caps, bars) = modern();
        assert_eq!(probe_score(&id(0x1042), &caps, &bars, 1000), Ok(1000));
        assert_eq!(probe_score(&id(0x1001), &caps, &bars, 1000), Ok(900));
    }

    #[test]
    fn a_device_without_the_modern_interface_is_declined_with_the_reason() {
        // Legacy only: no virtio capabilities at all.
        let why = probe_score(&id(0x1001), &[], &[0x40, 0, 0, 0, 0, 0], 1000).unwrap_err();
        assert!(why.contains("common"), "{why}");
        assert!(why.contains("modern virtio-pci"), "{why}");
        let (caps, bars) = modern();
        for missing in [
            cap::COMMON_CFG,
            cap::NOTIFY_CFG,
            cap::ISR_CFG,
            cap::DEVICE_CFG,
        ] {
            let some: Vec<VirtioCap> = caps
                .iter()
                .copied()
                .filter(|c| c.cfg_type != missing)
                .collect();
            let why = probe_score(&id(0x1042), &some, &bars, 1000).unwrap_err();
            assert!(why.contains(cap::name(missing)), "{why}");
        }
    }

    #[test]
    fn a_structure_outside_its_bar_does_not_count() {
        let (mut caps, bars) = modern();
        // The notify structure runs past the end of BAR 4.
        caps[3].offset = 0x3800;
        assert!(probe_score(&id(0x1042), &caps, &bars, 1000).is_err());
        // In a BAR the function does not have.
        let (mut caps, bars) = modern();
        caps[0].bar = 2;
        assert!(probe_score(&id(0x1042), &caps, &bars, 1000).is_err());
        // A BAR index past the six.
        let (mut caps, bars) = modern();
        caps[1].bar = 9;
        assert!(probe_score(&id(0x1042), &caps, &bars, 1000).is_err());
        // Offset and length that overflow.
        let (mut caps, bars) = modern();
        caps[2].offset = u32::MAX;
        caps[2].length = u32::MAX;
        assert!(probe_score(&id(0x1042), &caps, &bars, 1000).is_err());
    }
}
