//! BAR regions with bounds-checked typed accessors.
//!
//! A region is a patchwork the driver never sees: parts may be mmapped (VFIO BARs, vfio-user
//! sparse areas), some offsets may be ioeventfd doorbells (a write is one eventfd write), and
//! the rest is trapped (each access is a backend call, e.g. a vfio-user message). Trapped writes
//! are posted, like PCI memory writes: they are ordered before any later read of the same
//! device, which does wait for its reply.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use outboard_shm::SharedMem;

use crate::{HwError, Result};

/// How the backend reaches trapped parts of a region.
pub trait Trap: Send + Sync {
    /// Reads `buf.len()` bytes at `offset` of BAR `bar`.
    fn read(&self, bar: u8, offset: u64, buf: &mut [u8]) -> Result<()>;
    /// Writes `data` at `offset` of BAR `bar`; `posted` means no acknowledgement is awaited.
    fn write(&self, bar: u8, offset: u64, data: &[u8], posted: bool) -> Result<()>;
}

/// A part of a region that is mmapped.
pub struct MappedArea {
    /// Offset in the region.
    pub offset: u64,
    /// The mapping.
    pub mem: SharedMem,
}

/// An offset whose writes become an eventfd write.
pub struct Doorbell {
    /// Offset in the region.
    pub offset: u64,
    /// Access size that triggers it (0: any).
    pub size: u64,
    /// Only writes of this value trigger it.
    pub datamatch: Option<u64>,
    /// The eventfd.
    pub fd: Arc<OwnedFd>,
}

/// How a part of a region is reached, for probe output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionKind {
    /// mmapped: loads and stores go straight to memory.
    Mapped {
        /// Offset.
        offset: u64,
        /// Size.
        size: u64,
    },
    /// Writes become an eventfd write.
    Doorbell {
        /// Offset.
        offset: u64,
        /// Access size (0: any).
        size: u64,
    },
    /// Everything else is trapped.
    Trapped,
}

struct Inner {
    bar: u8,
    size: u64,
    maps: Vec<MappedArea>,
    doorbells: Vec<Doorbell>,
    trap: Arc<dyn Trap>,
}

/// A BAR of the device.
#[derive(Clone)]
pub struct Region {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("bar", &self.inner.bar)
            .field("size", &self.inner.size)
            .field("layout", &self.layout())
            .finish()
    }
}

macro_rules! accessors {
    ($($read:ident $write:ident $t:ty;)*) => {$(
        #[doc = concat!("Reads a little-endian `", stringify!($t), "` register.")]
        pub fn $read(&self, offset: u64) -> Result<$t> {
            const N: usize = std::mem::size_of::<$t>();
            self.check(offset, N)?;
            if let Some((m, off)) = self.mapped(offset, N) {
                return Ok(<$t>::from_le(m.mem.mmio_read::<$t>(off)?));
            }
            let mut b = [0u8; N];
            self.inner.trap.read(self.inner.bar, offset, &mut b)?;
            Ok(<$t>::from_le_bytes(b))
        }

        #[doc = concat!("Writes a little-endian `", stringify!($t), "` register.")]
        pub fn $write(&self, offset: u64, value: $t) -> Result<()> {
            const N: usize = std::mem::size_of::<$t>();
            self.check(offset, N)?;
            if self.ring(offset, N, value as u64) {
                return Ok(());
            }
            if let Some((m, off)) = self.mapped(offset, N) {
                return Ok(m.mem.mmio_write::<$t>(off, value.to_le())?);
            }
            self.inner.trap.write(self.inner.bar, offset, &value.to_le_bytes(), true)
        }
    )*};
}

impl Region {
    /// Assembles a region (backends only).
    pub fn new(
        bar: u8,
        size: u64,
        maps: Vec<MappedArea>,
        doorbells: Vec<Doorbell>,
        trap: Arc<dyn Trap>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                bar,
                size,
                maps,
                doorbells,
                trap,
            }),
        }
    }

    /// BAR number.
    pub fn bar(&self) -> u8 {
        self.inner.bar
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.size
    }

    /// How each part is reached.
    pub fn layout(&self) -> Vec<RegionKind> {
        let mut v: Vec<RegionKind> = self
            .inner
            .maps
            .iter()
            .map(|m| RegionKind::Mapped {
                offset: m.offset,
                size: m.mem.len() as u64,
            })
            .collect();
        v.extend(self.inner.doorbells.iter().map(|d| RegionKind::Doorbell {
            offset: d.offset,
            size: d.size,
        }));
        v.push(RegionKind::Trapped);
        v
    }

    fn check(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.inner.size => Ok(()),
            _ => Err(HwError::OutOfBounds {
                bar: self.inner.bar,
                offset,
                len: len as u64,
                size: self.inner.size,
            }),
        }
    }

    fn mapped(&self, offset: u64, len: usize) -> Option<(&MappedArea, u64)> {
        self.inner
            .maps
            .iter()
            .find(|m| m.offset <= offset && offset + len as u64 <= m.offset + m.mem.len() as u64)
            .map(|m| (m, offset - m.offset))
    }

    /// Rings a doorbell if one covers this write.
    fn ring(&self, offset: u64, len: usize, value: u64) -> bool {
        let Some(d) = self.inner.doorbells.iter().find(|d| {
            d.offset == offset
                && (d.size == 0 || d.size == len as u64)
                && d.datamatch.is_none_or(|m| m == value)
        }) else {
            return false;
        };
        // An eventfd write only fails if the counter would overflow, which cannot happen with
        // a peer that reads it; the doorbell is level-like, so a coalesced ring is not lost.
        let _ = rustix::io::write(&*d.fd, &1u64.to_ne_bytes());
        true
    }

    accessors! {
        read8 write8 u8;
        read16 write16 u16;
        read32 write32 u32;
        read64 write64 u64;
    }

    /// Reads a block of bytes (configuration structures); trapped parts in one backend call.
    pub fn read_bytes(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len())?;
        if let Some((m, off)) = self.mapped(offset, buf.len()) {
            return Ok(m.mem.read(off, buf)?);
        }
        self.inner.trap.read(self.inner.bar, offset, buf)
    }

    /// Writes and waits for the device to acknowledge (a non-posted write).
    pub fn write32_sync(&self, offset: u64, value: u32) -> Result<()> {
        self.check(offset, 4)?;
        if let Some((m, off)) = self.mapped(offset, 4) {
            return Ok(m.mem.mmio_write::<u32>(off, value.to_le())?);
        }
        self.inner
            .trap
            .write(self.inner.bar, offset, &value.to_le_bytes(), false)
    }
}
