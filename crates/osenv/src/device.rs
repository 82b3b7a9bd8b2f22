//! The one device a legacy driver has, as its `osenv` calls see it: configuration space
//! (mediated: reads of the function's own, absent elsewhere; writes through the function's
//! configuration policy; BARs virtualised), I/O ports and BAR registers.
//!
//! **Ports.** A process has no port space, and a function's I/O BAR may be reached over
//! vfio-user: each I/O BAR `i` is presented at ports `0x1000·(i+1)` (the value a
//! configuration read of the BAR returns), and the driver reaches them through the
//! `osenv_io_*` accessors, within ranges it allocated.
//! **BAR sizing.** A driver that writes all ones to a BAR and reads it back gets the BAR's
//! size mask, as on real hardware; the BAR itself is never reprogrammed.
//! **Probing.** A driver's active probe sees a [`ConfigSnapshot`] instead of the device: its
//! configuration space reads (and BAR sizing) work, everything that would reach or change the
//! device (configuration writes, ports, BAR registers) is refused.

use std::sync::Mutex;

use outboard_hw::{ConfigSnapshot, PciFunction, Region};

/// Offset of BAR 0 in configuration space.
const BAR0: u32 = 0x10;
/// Ports of I/O BAR `i` start at `PORT_STRIDE·(i+1)`.
pub const PORT_STRIDE: u32 = 0x1000;

/// What a driver's device looks like through `osenv`.
pub(crate) struct Device {
    backing: Backing,
    /// Per BAR: its size, whether it is an I/O BAR, and its flags (low bits of the register).
    bars: [Bar; 6],
    /// Regions, opened when first used.
    regions: Mutex<[Option<Region>; 6]>,
    /// BARs a driver wrote all ones to (it reads the size mask next).
    sizing: Mutex<[bool; 6]>,
    /// Port ranges the driver allocated: (first port, length).
    ports: Mutex<Vec<(u32, u32)>>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Bar {
    size: u64,
    io: bool,
    flags: u32,
    /// The upper half of the 64-bit memory BAR before it.
    upper_half: bool,
}

/// What a driver's configuration and register accesses reach.
enum Backing {
    /// The device itself.
    Live(PciFunction),
    /// A probe's view: configuration space as it was, no registers.
    Snapshot(ConfigSnapshot),
}

/// A memory BAR's type bits saying it is 64 bits wide (two registers).
const MEM_64: u32 = 0x4;

impl Device {
    /// The function itself (none for a probe).
    pub fn function(&self) -> Option<&PciFunction> {
        match &self.backing {
            Backing::Live(f) => Some(f),
            Backing::Snapshot(_) => None,
        }
    }

    pub fn new(function: PciFunction) -> Self {
        // A device whose BARs cannot be sized shows none (its accessors then fail).
        let snapshot = function.snapshot().unwrap_or_else(|_| {
            let mut header = Box::new([0; ConfigSnapshot::SIZE]);
            let _ = function.config_read_at_open(0, &mut header[..]);
            ConfigSnapshot {
                header,
                bar_sizes: [0; 6],
            }
        });
        Self::build(&snapshot, Backing::Live(function))
    }

    /// What a probe sees: `snapshot` and nothing of the device.
    pub fn looking(snapshot: ConfigSnapshot) -> Self {
        let view = snapshot.clone();
        Self::build(&view, Backing::Snapshot(snapshot))
    }

    fn build(snapshot: &ConfigSnapshot, backing: Backing) -> Self {
        let sizes = snapshot.bar_sizes;
        let mut bars = [Bar::default(); 6];
        for (i, bar) in bars.iter_mut().enumerate() {
            let reg = snapshot.dword(u64::from(BAR0) + 4 * i as u64).unwrap_or(0);
            let io = reg & 1 == 1;
            *bar = Bar {
                size: sizes[i],
                io,
                flags: if io { 1 } else { reg & 0xf },
                upper_half: false,
            };
        }
        for i in 1..6 {
            let lower = bars[i - 1];
            if !lower.io && !lower.upper_half && lower.flags & 0x6 == MEM_64 {
                bars[i] = Bar {
                    size: lower.size,
                    io: false,
                    flags: 0,
                    upper_half: true,
                };
            }
        }
        Self {
            backing,
            bars,
            regions: Mutex::new(Default::default()),
            sizing: Mutex::new([false; 6]),
            ports: Mutex::new(Vec::new()),
        }
    }

    /// The BAR a dword-aligned configuration offset names, if any.
    fn bar_at(offset: u32) -> Option<usize> {
        (BAR0..BAR0 + 24)
            .contains(&offset)
            .then(|| ((offset - BAR0) / 4) as usize)
    }

    /// A configuration dword at `offset` (4-aligned, below 4096), BARs as presented.
    pub fn config_read(&self, offset: u32) -> Option<u32> {
        if let Some(i) = Self::bar_at(offset) {
            let bar = self.bars[i];
            let sizing = self.sizing.lock().unwrap_or_else(|p| p.into_inner())[i];
            // The size mask of the whole BAR (both registers of a 64-bit one).
            let mask = !bar.size.wrapping_sub(1);
            return Some(match (bar.size, bar.io, sizing) {
                (0, _, _) => 0,
                (_, _, true) if bar.upper_half => (mask >> 32) as u32,
                (_, _, true) => mask as u32 | bar.flags,
                (_, true, false) => (PORT_STRIDE * (i as u32 + 1)) | 1,
                (_, false, false) => self.config_dword(offset)?,
            });
        }
        self.config_dword(offset)
    }

    fn config_dword(&self, offset: u32) -> Option<u32> {
        match &self.backing {
            Backing::Live(f) => f.config_read32(offset.into()).ok(),
            Backing::Snapshot(s) => s.dword(offset.into()),
        }
    }

    /// Writes a configuration dword: a BAR write only starts or ends sizing; anything else goes
    /// through the function's configuration policy.
    pub fn config_write(&self, offset: u32, value: u32) -> bool {
        if let Some(i) = Self::bar_at(offset) {
            self.sizing.lock().unwrap_or_else(|p| p.into_inner())[i] = value == u32::MAX;
            return true;
        }
        match &self.backing {
            Backing::Live(f) => f.config_write(offset.into(), &value.to_le_bytes()).is_ok(),
            Backing::Snapshot(_) => {
                tracing::warn!("a probe wrote configuration space at {offset:#x}: refused");
                false
            }
        }
    }

    /// The I/O BAR and offset of port range `[port, port+len)`, if it lies in one.
    fn io_bar(&self, port: u32, len: u32) -> Option<(usize, u64)> {
        let i = (port / PORT_STRIDE).checked_sub(1)? as usize;
        let bar = self.bars.get(i)?;
        let offset = u64::from(port % PORT_STRIDE);
        (bar.io && offset + u64::from(len) <= bar.size.min(u64::from(PORT_STRIDE)))
            .then_some((i, offset))
    }

    fn overlaps(ports: &[(u32, u32)], port: u32, len: u32) -> bool {
        ports
            .iter()
            .any(|&(p, l)| port < p.saturating_add(l) && p < port.saturating_add(len))
    }

    /// `osenv_io_avail`: the range is in an I/O BAR and not allocated.
    pub fn io_avail(&self, port: u32, len: u32) -> bool {
        len > 0
            && self.io_bar(port, len).is_some()
            && !Self::overlaps(
                &self.ports.lock().unwrap_or_else(|p| p.into_inner()),
                port,
                len,
            )
    }

    /// `osenv_io_alloc`.
    pub fn io_alloc(&self, port: u32, len: u32) -> bool {
        let mut ports = self.ports.lock().unwrap_or_else(|p| p.into_inner());
        if len == 0 || self.io_bar(port, len).is_none() || Self::overlaps(&ports, port, len) {
            return false;
        }
        ports.push((port, len));
        true
    }

    /// `osenv_io_free`: only a range the driver allocated, as allocated.
    pub fn io_free(&self, port: u32, len: u32) -> bool {
        let mut ports = self.ports.lock().unwrap_or_else(|p| p.into_inner());
        let before = ports.len();
        ports.retain(|&r| r != (port, len));
        ports.len() != before
    }

    fn region(&self, bar: usize) -> Option<Region> {
        let mut regions = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        if regions[bar].is_none() {
            let Backing::Live(f) = &self.backing else {
                tracing::warn!("a probe reached for BAR {bar}'s registers: refused");
                return None;
            };
            regions[bar] = f.region(bar as u8).ok();
        }
        regions[bar].clone()
    }

    /// The region and offset behind an access of `len` bytes at `port`, if the driver
    /// allocated the port.
    pub fn port(&self, port: u32, len: u32) -> Option<(Region, u64)> {
        let ports = self.ports.lock().unwrap_or_else(|p| p.into_inner());
        let owned = ports
            .iter()
            .any(|&(p, l)| port >= p && port.saturating_add(len) <= p.saturating_add(l));
        drop(ports);
        let (bar, offset) = self.io_bar(port, len).filter(|_| owned)?;
        Some((self.region(bar)?, offset))
    }

    /// The region of memory BAR `bar`, for its accessors (an I/O BAR is reached through the
    /// ports the driver allocated, the upper half of a 64-bit BAR not at all).
    pub fn bar(&self, bar: u32) -> Option<Region> {
        let b = self.bars.get(bar as usize)?;
        (b.size > 0 && !b.io && !b.upper_half)
            .then(|| self.region(bar as usize))
            .flatten()
    }
}
