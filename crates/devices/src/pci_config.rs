//! An emulated PCI type-0 configuration space.
//!
//! Bytes plus a write mask: only bits a real device implements as writable change. BARs
//! answer the sizing protocol (write all ones, read back the size mask), the command register
//! keeps its implemented bits, and capabilities are laid out by [`ConfigBuilder`]. The status
//! register's capability bit and the capability pointer are filled in automatically.

use outboard_spec::pci;

/// A BAR declaration.
#[derive(Debug, Clone, Copy)]
pub struct Bar {
    /// BAR number.
    pub index: u8,
    /// Size (a power of two, at least 16).
    pub size: u64,
}

/// Builds a configuration space.
pub struct ConfigBuilder {
    space: ConfigSpace,
    next_cap: u8,
    last_cap: Option<u8>,
}

/// Identity fields of a function.
#[derive(Debug, Clone, Copy)]
pub struct Ids {
    /// Vendor.
    pub vendor: u16,
    /// Device.
    pub device: u16,
    /// Subsystem vendor.
    pub subsystem_vendor: u16,
    /// Subsystem.
    pub subsystem: u16,
    /// Class code: base << 16 | sub << 8 | prog-if.
    pub class: u32,
    /// Revision.
    pub revision: u8,
}

impl ConfigBuilder {
    /// A header with these ids.
    pub fn new(ids: Ids) -> Self {
        let mut s = ConfigSpace {
            bytes: [0; pci::CONFIG_SPACE_SIZE],
            wmask: [0; pci::CONFIG_SPACE_SIZE],
            bars: [0; 6],
            io_bars: 0,
        };
        s.put16(pci::VENDOR_ID, ids.vendor);
        s.put16(pci::DEVICE_ID, ids.device);
        s.bytes[pci::REVISION_ID as usize] = ids.revision;
        s.bytes[pci::CLASS_PROG_IF as usize] = ids.class as u8;
        s.bytes[pci::CLASS_SUB as usize] = (ids.class >> 8) as u8;
        s.bytes[pci::CLASS_BASE as usize] = (ids.class >> 16) as u8;
        s.put16(pci::SUBSYSTEM_VENDOR_ID, ids.subsystem_vendor);
        s.put16(pci::SUBSYSTEM_ID, ids.subsystem);
        s.bytes[pci::INTERRUPT_PIN as usize] = 1; // INTA#
        let cmd_bits = pci::COMMAND_MEMORY | pci::COMMAND_BUS_MASTER | pci::COMMAND_INTX_DISABLE;
        s.wmask[pci::COMMAND as usize..pci::COMMAND as usize + 2]
            .copy_from_slice(&cmd_bits.to_le_bytes());
        s.wmask[pci::INTERRUPT_LINE as usize] = 0xff;
        Self {
            space: s,
            next_cap: 0x40,
            last_cap: None,
        }
    }

    /// Declares a 32-bit non-prefetchable memory BAR.
    pub fn bar(mut self, bar: Bar) -> Self {
        assert!(
            bar.size.is_power_of_two() && bar.size >= 16 && bar.index < 6,
            "invalid BAR"
        );
        self.space.bars[bar.index as usize] = bar.size;
        let off = pci::bar(bar.index) as usize;
        let mask = !(bar.size as u32 - 1);
        self.space.wmask[off..off + 4].copy_from_slice(&mask.to_le_bytes());
        self
    }

    /// Declares an I/O BAR (its register's bit 0 set), and makes the command register's I/O
    /// decode bit writable.
    pub fn io_bar(mut self, bar: Bar) -> Self {
        assert!(
            bar.size.is_power_of_two() && bar.size >= 4 && bar.size <= 256 && bar.index < 6,
            "invalid I/O BAR"
        );
        let s = &mut self.space;
        s.bars[bar.index as usize] = bar.size;
        s.io_bars |= 1 << bar.index;
        let off = pci::bar(bar.index) as usize;
        let mask = !(bar.size as u32 - 1) & !0x3;
        s.wmask[off..off + 4].copy_from_slice(&mask.to_le_bytes());
        s.bytes[off] = 1;
        s.wmask[pci::COMMAND as usize] |= pci::COMMAND_IO as u8;
        self
    }

    /// Appends a capability with body `body` (bytes after the id/next pair); `writable` marks
    /// writable bytes within the body. Returns the builder and the capability's offset.
    pub fn capability(mut self, id: u8, body: &[u8], writable: &[(usize, u8)]) -> (Self, u8) {
        let off = self.next_cap;
        let len = 2 + body.len();
        assert!(
            off as usize + len <= pci::CONFIG_SPACE_SIZE,
            "capabilities overflow config space"
        );
        let s = &mut self.space;
        s.bytes[off as usize] = id;
        s.bytes[off as usize + 2..off as usize + len].copy_from_slice(body);
        for &(i, mask) in writable {
            s.wmask[off as usize + 2 + i] = mask;
        }
        match self.last_cap {
            Some(prev) => s.bytes[prev as usize + 1] = off,
            None => {
                s.bytes[pci::CAPABILITIES_POINTER as usize] = off;
                let st = s.get16(pci::STATUS) | pci::STATUS_CAPABILITIES;
                s.put16(pci::STATUS, st);
            }
        }
        self.last_cap = Some(off);
        self.next_cap = (off + len as u8 + 3) & !3;
        (self, off)
    }

    /// The finished configuration space.
    pub fn build(self) -> ConfigSpace {
        self.space
    }
}

/// An emulated configuration space.
#[derive(Clone)]
pub struct ConfigSpace {
    bytes: [u8; pci::CONFIG_SPACE_SIZE],
    wmask: [u8; pci::CONFIG_SPACE_SIZE],
    bars: [u64; 6],
    /// Bit i: BAR i is an I/O BAR.
    io_bars: u8,
}

impl ConfigSpace {
    fn get16(&self, off: u64) -> u16 {
        u16::from_le_bytes([self.bytes[off as usize], self.bytes[off as usize + 1]])
    }
    fn put16(&mut self, off: u64, v: u16) {
        self.bytes[off as usize..off as usize + 2].copy_from_slice(&v.to_le_bytes());
    }

    /// Size of BAR `i` (0 if absent).
    pub fn bar_size(&self, i: u8) -> u64 {
        self.bars.get(i as usize).copied().unwrap_or(0)
    }

    /// Reads bytes; beyond the 256-byte space reads as zero (no extended capabilities).
    pub fn read(&self, offset: u64, buf: &mut [u8]) {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = self.bytes.get(offset as usize + i).copied().unwrap_or(0);
        }
    }

    /// Writes bytes through the write mask; read-only bits keep their value.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        for (i, &v) in data.iter().enumerate() {
            let o = offset as usize + i;
            if o >= pci::CONFIG_SPACE_SIZE {
                break;
            }
            let m = self.wmask[o];
            self.bytes[o] = (self.bytes[o] & !m) | (v & m);
        }
    }

    /// The command register.
    pub fn command(&self) -> u16 {
        self.get16(pci::COMMAND)
    }

    /// Reads a 16-bit field (for capability state such as MSI-X control).
    pub fn read16(&self, offset: u64) -> u16 {
        self.get16(offset)
    }

    /// Reads a 32-bit field.
    pub fn read32(&self, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        self.read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    /// Sets bytes regardless of the write mask (device-side updates).
    pub fn set(&mut self, offset: u64, data: &[u8]) {
        self.bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }

    /// Returns to the power-on state: command cleared, BARs unassigned.
    pub fn reset(&mut self) {
        self.put16(pci::COMMAND, 0);
        for i in 0..6u8 {
            let o = pci::bar(i) as usize;
            self.bytes[o..o + 4].fill(0);
            self.bytes[o] = (self.io_bars >> i) & 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> Ids {
        Ids {
            vendor: 0x1af4,
            device: 0x1042,
            subsystem_vendor: 0x1af4,
            subsystem: 0x1100,
            class: 0x018000,
            revision: 1,
        }
    }

    #[test]
    fn bar_sizing_and_read_only_fields() {
        let mut c = ConfigBuilder::new(ids())
            .bar(Bar {
                index: 0,
                size: 0x4000,
            })
            .build();
        c.write(pci::bar(0), &u32::MAX.to_le_bytes());
        assert_eq!(c.read32(pci::bar(0)), !(0x4000u32 - 1));
        c.write(pci::VENDOR_ID, &[0, 0]);
        assert_eq!(c.read16(pci::VENDOR_ID), 0x1af4);
        c.write(pci::COMMAND, &0xffffu16.to_le_bytes());
        assert_eq!(
            c.command(),
            pci::COMMAND_MEMORY | pci::COMMAND_BUS_MASTER | pci::COMMAND_INTX_DISABLE
        );
    }

    #[test]
    fn capabilities_are_chained() {
        let (b, first) = ConfigBuilder::new(ids()).capability(0x11, &[0; 10], &[]);
        let (b, second) = b.capability(0x09, &[14, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]);
        let c = b.build();
        assert_eq!(first, 0x40);
        assert_eq!(second, 0x4c);
        let mut p = [0u8; 1];
        c.read(pci::CAPABILITIES_POINTER, &mut p);
        assert_eq!(p[0], 0x40);
        c.read(0x41, &mut p);
        assert_eq!(p[0], 0x4c);
        assert_ne!(c.read16(pci::STATUS) & pci::STATUS_CAPABILITIES, 0);
    }
}
