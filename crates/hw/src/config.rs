//! Configuration space: the capability walk and write mediation.
//!
//! Mediation follows Fluke's device server and Linux VFIO: a driver may turn on decoding and
//! bus mastering and program its own capabilities, but it may not move BARs, the ROM, or
//! program MSI/MSI-X directly (interrupts are set up through [`crate::PciFunction::enable_irqs`],
//! which the backend turns into eventfds).

use outboard_spec::pci;

use crate::{HwError, Result};

/// A capability in the standard list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capability {
    /// Capability ID.
    pub id: u8,
    /// Offset in configuration space.
    pub offset: u8,
}

/// Walks the capability list with `read`; at most 48 entries, each in 0x40..0x100 and dword
/// aligned, so a corrupt or looping list ends with an error rather than a hang.
pub(crate) fn walk_capabilities(
    read: impl Fn(u64, &mut [u8]) -> Result<()>,
) -> Result<Vec<Capability>> {
    let mut b = [0u8; 2];
    read(pci::STATUS, &mut b)?;
    if u16::from_le_bytes(b) & pci::STATUS_CAPABILITIES == 0 {
        return Ok(Vec::new());
    }
    let mut p = [0u8; 1];
    read(pci::CAPABILITIES_POINTER, &mut p)?;
    let mut next = p[0] & !3;
    let mut caps = Vec::new();
    while next != 0 {
        if next < 0x40 || caps.len() >= 48 {
            return Err(HwError::Backend(format!(
                "capability list is corrupt at {next:#x}"
            )));
        }
        read(next as u64, &mut b)?;
        caps.push(Capability {
            id: b[0],
            offset: next,
        });
        next = b[1] & !3;
    }
    Ok(caps)
}

/// Which configuration writes a driver may make.
#[derive(Debug, Clone, Default)]
pub struct ConfigPolicy {
    /// Byte ranges `[start, end)` that are refused, with the reason.
    denied: Vec<(u64, u64, &'static str)>,
}

impl ConfigPolicy {
    /// The policy for a function with these capabilities.
    pub fn for_capabilities(caps: &[Capability]) -> Self {
        let mut denied = vec![
            (0x00, 0x04, "identity is read-only"),
            (0x08, 0x0c, "identity is read-only"),
            (
                pci::HEADER_TYPE,
                pci::HEADER_TYPE + 1,
                "header type is read-only",
            ),
            (pci::BAR0, pci::bar(6), "BARs are assigned by the framework"),
            (
                pci::SUBSYSTEM_VENDOR_ID,
                pci::ROM_ADDRESS,
                "identity is read-only",
            ),
            (
                pci::ROM_ADDRESS,
                pci::ROM_ADDRESS + 4,
                "the ROM BAR is assigned by the framework",
            ),
            (
                pci::CAPABILITIES_POINTER,
                pci::CAPABILITIES_POINTER + 1,
                "the capability list is read-only",
            ),
        ];
        for c in caps {
            let (len, why) = match c.id {
                pci::CAP_ID_MSIX => (
                    pci::msix::CAP_LEN as u64,
                    "MSI-X is set up with enable_irqs",
                ),
                pci::CAP_ID_MSI => (24, "MSI is set up with enable_irqs"),
                _ => continue,
            };
            denied.push((c.offset as u64, c.offset as u64 + len, why));
        }
        Self { denied }
    }

    /// Checks a write of `len` bytes at `offset`.
    pub fn check(&self, offset: u64, len: usize) -> Result<()> {
        let end = offset.saturating_add(len as u64);
        if len == 0 || end > 4096 {
            return Err(HwError::ConfigDenied {
                offset,
                len,
                why: "outside configuration space",
            });
        }
        for &(s, e, why) in &self.denied {
            if offset < e && s < end {
                return Err(HwError::ConfigDenied { offset, len, why });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mediation_allows_command_and_refuses_bars_and_msix() {
        let p = ConfigPolicy::for_capabilities(&[Capability {
            id: pci::CAP_ID_MSIX,
            offset: 0x40,
        }]);
        assert!(p.check(pci::COMMAND, 2).is_ok());
        assert!(p.check(pci::bar(0), 4).is_err());
        assert!(p.check(pci::bar(5) + 3, 1).is_err());
        assert!(p.check(0x42, 2).is_err());
        assert!(p.check(0x50, 4).is_ok());
        assert!(p.check(4095, 2).is_err());
    }

    #[test]
    fn capability_walk_stops_on_a_loop() {
        let mut cfg = [0u8; 256];
        cfg[pci::STATUS as usize] = pci::STATUS_CAPABILITIES as u8;
        cfg[pci::CAPABILITIES_POINTER as usize] = 0x40;
        cfg[0x40] = 0x09;
        cfg[0x41] = 0x40; // points at itself
        let r = walk_capabilities(|o, b| {
            b.copy_from_slice(&cfg[o as usize..o as usize + b.len()]);
            Ok(())
        });
        assert!(r.is_err());
    }
}
