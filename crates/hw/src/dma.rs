//! The device's DMA address space.
//!
//! Buffers are memfd-backed shared memory, mapped into the device's IOVA space by the backend
//! (`VFIO_IOMMU_MAP_DMA`, or vfio-user DMA_MAP passing the fd). Drivers give devices IOVAs,
//! never host addresses; the device can reach only what is mapped. IOVAs are handed out by a
//! bump allocator from 4 GiB upwards and never reused, so a stale IOVA held by a confused
//! device can never alias a newer buffer.

use std::ops::Deref;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use outboard_shm::SharedMem;

use crate::backend::Backend;
use crate::{HwError, Result};

const PAGE: u64 = 4096;
const IOVA_BASE: u64 = 1 << 32;

/// Hands out DMA buffers for one device.
pub struct DmaSpace {
    backend: Arc<dyn Backend>,
    next: AtomicU64,
}

impl DmaSpace {
    pub(crate) fn new(backend: Arc<dyn Backend>) -> Self {
        Self {
            backend,
            next: AtomicU64::new(IOVA_BASE),
        }
    }

    fn reserve(&self, len: u64) -> Result<u64> {
        let len = len.div_ceil(PAGE) * PAGE;
        let iova = self.next.fetch_add(len + PAGE, Ordering::Relaxed); // a guard page between buffers
        if iova.checked_add(len).is_none_or(|e| e > 1 << 47) {
            return Err(HwError::Backend("IOVA space exhausted".into()));
        }
        Ok(iova)
    }

    /// Allocates a zeroed buffer of at least `len` bytes that the device may read and write.
    pub fn alloc(&self, len: usize) -> Result<DmaBuf> {
        let size = (len as u64).div_ceil(PAGE).max(1) * PAGE;
        let mem = SharedMem::create("outboard-dma", size as usize)?;
        let iova = self.reserve(size)?;
        let fd = mem.fd().expect("created memfd has an fd");
        self.backend.dma_map(iova, size, fd, 0)?;
        Ok(DmaBuf {
            mem: Arc::new(mem),
            iova,
            size,
            backend: self.backend.clone(),
        })
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
        self.backend.dma_map(iova, size, fd, 0)?;
        Ok(DmaBuf {
            mem,
            iova,
            size,
            backend: self.backend.clone(),
        })
    }
}

/// A buffer the device can reach at [`DmaBuf::iova`]. Unmapped from the device on drop.
pub struct DmaBuf {
    mem: Arc<SharedMem>,
    iova: u64,
    size: u64,
    backend: Arc<dyn Backend>,
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
        if let Err(e) = self.backend.dma_unmap(self.iova, self.size) {
            tracing::warn!("unmapping DMA buffer {:#x}: {e}", self.iova);
        }
    }
}
