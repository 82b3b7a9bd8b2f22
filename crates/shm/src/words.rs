//! A window of 64-bit atomics in a shared mapping that keeps the mapping alive: counters one
//! process writes on its hot path and another reads, reached without a bounds check per
//! access (the window was checked once, when it was made).

use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::{Result, SharedMem};

/// `len` consecutive 64-bit words of a [`SharedMem`].
#[derive(Clone)]
pub struct Words {
    /// Keeps the mapping alive as long as the window.
    _mem: Arc<SharedMem>,
    ptr: NonNull<AtomicU64>,
    len: usize,
}

// SAFETY: the window is only reached through `&[AtomicU64]`, which is Send and Sync; the
// mapping it points into is owned by the `Arc` held beside it.
unsafe impl Send for Words {}
// SAFETY: as for `Send`.
unsafe impl Sync for Words {}

impl Words {
    /// The `len` words from byte `offset` of `mem` (in bounds and 8-byte aligned, or an
    /// error).
    pub fn new(mem: Arc<SharedMem>, offset: u64, len: usize) -> Result<Self> {
        let ptr = NonNull::from(mem.atomics_u64(offset, len)?).cast::<AtomicU64>();
        Ok(Self {
            _mem: mem,
            ptr,
            len,
        })
    }

    /// The words. On a read-only mapping, only load from them.
    #[inline]
    pub fn get(&self) -> &[AtomicU64] {
        // SAFETY: `ptr` and `len` came from `atomics_u64`, which checked bounds and alignment;
        // the mapping stays alive while `_mem` does, which is at least as long as `&self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for Words {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Words").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_window_is_checked_once_and_reaches_the_mapping() {
        // Heap memory: the same accessors, and Miri can run it.
        let mem = Arc::new(SharedMem::heap(4096).unwrap());
        let w = Words::new(mem.clone(), 64, 8).unwrap();
        w.get()[7].store(0x1122, Ordering::Relaxed);
        assert_eq!(mem.read_u64(64 + 56).unwrap(), 0x1122);
        assert_eq!(w.get().len(), 8);
        assert!(
            Words::new(mem.clone(), 4096 - 8, 2).is_err(),
            "past the end"
        );
        assert!(Words::new(mem.clone(), 4, 1).is_err(), "misaligned");
        assert!(
            Words::new(mem.clone(), 0, usize::MAX).is_err(),
            "overflowing"
        );
        // The window keeps the mapping alive after its other owners are gone.
        drop(mem);
        assert_eq!(w.get()[7].load(Ordering::Relaxed), 0x1122);
    }
}
