//! The device's DMA address space.
//!
//! Buffers are memfd-backed shared memory, mapped into the device's IOVA space by the backend
//! (`VFIO_IOMMU_MAP_DMA`, or vfio-user DMA_MAP passing the fd). Drivers give devices IOVAs,
//! never host addresses; the device can reach only what is mapped.
//!
//! IOVAs come from [`IovaSpace`]: fresh space from 4 GiB upwards, with an unmapped guard page
//! after each buffer; a range is reused only once its buffer was unmapped from the device, and
//! only after a quarantine of later frees, so a stale IOVA a confused device still holds hits
//! nothing for as long as possible. A long-running server whose clients come and go therefore
//! never runs out of IOVA space (it did when IOVAs were never reused).

use std::collections::{BTreeMap, VecDeque};
use std::ops::Deref;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, Weak};

use outboard_shm::SharedMem;

use crate::backend::Backend;
use crate::{HwError, Result};

const PAGE: u64 = 4096;
const IOVA_BASE: u64 = 1 << 32;
/// The top of the IOVA space: 47 bits, what every IOMMU Outboard meets can address.
const IOVA_END: u64 = 1 << 47;
/// Freed ranges wait behind this many later frees before they are reused.
const QUARANTINE: usize = 64;

/// An allocator of device addresses.
#[derive(Debug)]
pub struct IovaSpace {
    /// Start of never-used space.
    fresh: u64,
    /// Freed ranges, oldest first, each `(iova, len)` with `len` including its guard page.
    freed: VecDeque<(u64, u64)>,
}

impl Default for IovaSpace {
    fn default() -> Self {
        Self {
            fresh: IOVA_BASE,
            freed: VecDeque::new(),
        }
    }
}

impl IovaSpace {
    /// Reserves `len` bytes (rounded up to pages) followed by an unmapped guard page.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let need = len
            .div_ceil(PAGE)
            .max(1)
            .checked_mul(PAGE)?
            .checked_add(PAGE)?;
        // Reuse the oldest freed range that fits, once enough later frees are queued behind it.
        let ripe = self.freed.len().saturating_sub(QUARANTINE);
        if let Some(i) = (0..ripe).find(|&i| self.freed[i].1 >= need) {
            let (iova, have) = self.freed.remove(i).expect("index in range");
            if have > need {
                self.freed.push_back((iova + need, have - need));
            }
            return Some(iova);
        }
        let iova = self.fresh;
        let end = iova.checked_add(need).filter(|e| *e <= IOVA_END)?;
        self.fresh = end;
        Some(iova)
    }

    /// Returns a range whose buffer the device can no longer reach (it was unmapped).
    pub fn free(&mut self, iova: u64, len: u64) {
        let need = len.div_ceil(PAGE).max(1) * PAGE + PAGE;
        self.freed.push_back((iova, need));
    }
}

/// The buffers mapped in a device's space, by IOVA: what each maps (weakly: a buffer's owner
/// decides how long it lives).
type Mapped = Arc<Mutex<BTreeMap<u64, (u64, Weak<SharedMem>)>>>;

/// Hands out DMA buffers for one device. Clones share the device and its IOVA allocator.
#[derive(Clone)]
pub struct DmaSpace {
    backend: Arc<dyn Backend>,
    space: Arc<Mutex<IovaSpace>>,
    mapped: Mapped,
}

impl DmaSpace {
    pub(crate) fn new(backend: Arc<dyn Backend>) -> Self {
        Self {
            backend,
            space: Arc::default(),
            mapped: Arc::default(),
        }
    }

    /// The memory mapped at `iova..iova + len`, if one buffer maps all of it: the memory and
    /// the offset of `iova` in it. For a driver that moves a request's bytes itself (one that
    /// copies them to or from the device) where another gives the device the address.
    pub fn memory_at(&self, iova: u64, len: u64) -> Option<(Arc<SharedMem>, u64)> {
        let mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        let (&start, (size, mem)) = mapped.range(..=iova).next_back()?;
        let end = iova.checked_add(len)?;
        (end <= start + size)
            .then(|| mem.upgrade())
            .flatten()
            .map(|m| (m, iova - start))
    }

    fn track(&self, buf: &DmaBuf) {
        self.mapped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(buf.iova, (buf.size, Arc::downgrade(&buf.mem)));
    }

    fn reserve(&self, len: u64) -> Result<u64> {
        self.space
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .alloc(len)
            .ok_or_else(|| HwError::Backend("IOVA space exhausted".into()))
    }

    /// Allocates a zeroed buffer of at least `len` bytes that the device may read and write.
    pub fn alloc(&self, len: usize) -> Result<DmaBuf> {
        let size = (len as u64).div_ceil(PAGE).max(1) * PAGE;
        let mem = SharedMem::create("outboard-dma", size as usize)?;
        let iova = self.reserve(size)?;
        let fd = mem.fd().expect("created memfd has an fd");
        self.map_or_release(iova, size, fd)?;
        let buf = DmaBuf {
            mem: Arc::new(mem),
            iova,
            size,
            backend: self.backend.clone(),
            space: self.space.clone(),
            mapped: self.mapped.clone(),
        };
        self.track(&buf);
        Ok(buf)
    }

    /// Maps existing shared memory (e.g. a client's session buffers) into the device's space,
    /// so the device moves data straight to and from it.
    pub fn map_shared(&self, mem: Arc<SharedMem>) -> Result<DmaBuf> {
        let size = mem.len() as u64;
        if !size.is_multiple_of(PAGE) {
            return Err(HwError::Backend(format!(
                "shared memory of {size} bytes is not page-sized"
            )));
        }
        let fd: BorrowedFd<'_> = mem.fd().ok_or_else(|| {
            HwError::Backend("shared memory without an fd cannot be mapped for DMA".into())
        })?;
        let iova = self.reserve(size)?;
        self.map_or_release(iova, size, fd)?;
        let buf = DmaBuf {
            mem,
            iova,
            size,
            backend: self.backend.clone(),
            space: self.space.clone(),
            mapped: self.mapped.clone(),
        };
        self.track(&buf);
        Ok(buf)
    }
}

impl DmaSpace {
    fn map_or_release(&self, iova: u64, size: u64, fd: BorrowedFd<'_>) -> Result<()> {
        self.backend.dma_map(iova, size, fd, 0).inspect_err(|_| {
            // Never mapped: the device cannot hold this address.
            self.space
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .free(iova, size)
        })
    }
}

/// A buffer the device can reach at [`DmaBuf::iova`]. Unmapped from the device on drop.
pub struct DmaBuf {
    mem: Arc<SharedMem>,
    iova: u64,
    size: u64,
    backend: Arc<dyn Backend>,
    space: Arc<Mutex<IovaSpace>>,
    mapped: Mapped,
}

impl std::fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DmaBuf {{ iova: {:#x}, size: {:#x} }}",
            self.iova, self.size
        )
    }
}

impl DmaBuf {
    /// Device address of the first byte.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// Size in bytes (page-rounded).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Device address of byte `offset`, checking it is inside the buffer.
    pub fn iova_at(&self, offset: u64, len: u64) -> Result<u64> {
        self.mem.check(offset, len as usize)?;
        Ok(self.iova + offset)
    }
}

impl Deref for DmaBuf {
    type Target = SharedMem;
    fn deref(&self) -> &SharedMem {
        &self.mem
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        self.mapped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.iova);
        match self.backend.dma_unmap(self.iova, self.size) {
            // Only an address the device can no longer reach is reused.
            Ok(()) => self
                .space
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .free(self.iova, self.size),
            Err(e) => tracing::warn!(
                "unmapping DMA buffer {:#x}: {e}; its addresses stay reserved",
                self.iova
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_running_space_never_runs_out_when_buffers_come_and_go() {
        let mut s = IovaSpace::default();
        // 1 TiB buffers: without reuse the 47-bit space is gone after about 128 of them.
        let mut live = VecDeque::new();
        for _ in 0..10_000 {
            let iova = s.alloc(1 << 40).expect("space reused");
            live.push_back(iova);
            if live.len() > 8 {
                s.free(live.pop_front().unwrap(), 1 << 40);
            }
        }
    }

    #[test]
    fn freed_ranges_are_quarantined_and_never_overlap_live_ones() {
        let mut s = IovaSpace::default();
        let a = s.alloc(4096).unwrap();
        s.free(a, 4096);
        // Not reused at once: later frees must queue behind it first.
        let b = s.alloc(4096).unwrap();
        assert_ne!(a, b);
        let mut live = vec![(b, 8192u64)];
        for i in 0..2000u64 {
            let len = (i % 7 + 1) * 4096;
            let iova = s.alloc(len).unwrap();
            for &(o, l) in &live {
                assert!(iova + len + PAGE <= o || o + l <= iova, "overlap");
            }
            live.push((iova, len + PAGE));
            if i % 3 == 0 {
                let (o, l) = live.remove(0);
                s.free(o, l - PAGE);
            }
        }
        assert!(s.fresh < IOVA_BASE + (1 << 30), "space was reused");
    }
}
