//! The crate's `Hal`, over a device's DMA space: the one module of the hosted driver that
//! touches raw memory.
//!
//! The crate's `Hal` has no receiver: its calls cannot say which device they are for. The
//! adapter names the device's [`Context`] for the duration of each call it makes into the
//! crate ([`within`], a scoped thread-local), and the `Hal` finds it there; a call from
//! anywhere else panics rather than guess.
//!
//! - `dma_alloc`: a buffer of the device's DMA space (zeroed, mapped for the device), kept
//!   here by its IOVA until `dma_dealloc`.
//! - `share`: a buffer inside the adapter's own data pool (a DMA buffer) is shared as it is, at
//!   its IOVA; anything else (the request header and status byte the crate keeps in its own
//!   memory) is bounced through a slot of a small DMA area, copied in before and out after as
//!   the direction says.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use outboard_hw::{DmaBuf, DmaSpace};
use virtio_drivers::{BufferDirection, Hal, PhysAddr};

const PAGE: usize = 4096;
/// Bytes of one bounce slot: a request header is 16 bytes, a status byte 1.
const SLOT: usize = 64;
/// Bounce slots: three buffers a request, well over the queue's depth.
const SLOTS: usize = 256;

/// What the `Hal` needs of one device.
pub struct Context {
    dma: DmaSpace,
    /// What the crate allocated (its virtqueue), by IOVA.
    allocated: Mutex<HashMap<u64, DmaBuf>>,
    /// The adapter's data pool: shared with the device as it is.
    pool: DmaBuf,
    bounce: DmaBuf,
    /// Free bounce slots, and the ones in use by the IOVA handed out.
    free: Mutex<Vec<usize>>,
    bounced: Mutex<HashMap<u64, (usize, usize)>>,
}

impl Context {
    /// A context on `dma` with a data pool of `pool` bytes.
    pub fn new(dma: DmaSpace, pool: usize) -> outboard_hw::Result<Self> {
        Ok(Self {
            pool: dma.alloc(pool)?,
            bounce: dma.alloc(SLOT * SLOTS)?,
            dma,
            allocated: Mutex::new(HashMap::new()),
            free: Mutex::new((0..SLOTS).rev().collect()),
            bounced: Mutex::new(HashMap::new()),
        })
    }

    /// The data pool.
    pub fn pool(&self) -> &DmaBuf {
        &self.pool
    }

    /// `len` bytes of the data pool at `offset`, as the crate takes a request's buffer.
    ///
    /// # Safety
    /// No other slice of that range is alive: the caller gives each range of the pool to one
    /// request at a time, and touches it otherwise only through [`Context::pool`]'s copying
    /// accessors while no request holds it.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn pool_slice(&self, offset: usize, len: usize) -> Option<&mut [u8]> {
        let p = self.pool.io_ptr(offset as u64, len).ok()?;
        // SAFETY: io_ptr checked offset..offset+len lies inside the pool's mapping, which
        // lives as long as self; the pool is the adapter's own memory (no other process maps
        // it, only the device reaches it); the caller promises the range is not aliased.
        Some(unsafe { std::slice::from_raw_parts_mut(p, len) })
    }

    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<Context>>> = const { RefCell::new(None) };
}

/// Runs `f` (a call into the crate) with `cx` as the device the `Hal` serves.
pub fn within<R>(cx: &Arc<Context>, f: impl FnOnce() -> R) -> R {
    let before = CURRENT.with(|c| c.borrow_mut().replace(cx.clone()));
    let r = f();
    CURRENT.with(|c| *c.borrow_mut() = before);
    r
}

fn current() -> Arc<Context> {
    CURRENT
        .with(|c| c.borrow().clone())
        .expect("virtio-drivers called its Hal outside Outboard's adapter")
}

/// Outboard's `Hal` for the crate.
pub struct OutboardHal;

// SAFETY: dma_alloc returns zeroed memory mapped for the device at the returned IOVA, alive
// until dma_dealloc; share returns an IOVA at which the device reaches the buffer's bytes (the
// buffer itself in the pool, or a bounce copy) until unshare, which copies a bounce back.
unsafe impl Hal for OutboardHal {
    fn dma_alloc(pages: usize, _direction: BufferDirection) -> (PhysAddr, NonNull<u8>) {
        let cx = current();
        let buf = cx
            .dma
            .alloc(pages * PAGE)
            .unwrap_or_else(|e| panic!("virtio-drivers: DMA memory: {e}"));
        let iova = buf.iova();
        let ptr = NonNull::new(buf.as_ptr()).expect("a mapping is never at 0");
        Context::lock(&cx.allocated).insert(iova, buf);
        (iova, ptr)
    }

    unsafe fn dma_dealloc(paddr: PhysAddr, _vaddr: NonNull<u8>, _pages: usize) -> i32 {
        match Context::lock(&current().allocated).remove(&paddr) {
            Some(_) => 0,
            None => -1,
        }
    }

    unsafe fn mmio_phys_to_virt(_paddr: PhysAddr, _size: usize) -> NonNull<u8> {
        unreachable!("Outboard's transport reaches the device's registers through its regions")
    }

    unsafe fn share(buffer: NonNull<[u8]>, direction: BufferDirection) -> PhysAddr {
        let cx = current();
        let addr = buffer.as_ptr() as *mut u8 as usize;
        let len = buffer.len();
        let base = cx.pool.as_ptr() as usize;
        if addr >= base && addr + len <= base + cx.pool.len() {
            return cx.pool.iova() + (addr - base) as u64;
        }
        assert!(
            len <= SLOT,
            "virtio-drivers shared {len} bytes outside the data pool"
        );
        let slot = Context::lock(&cx.free)
            .pop()
            .expect("bounce slots exhausted");
        let at = (slot * SLOT) as u64;
        if direction != BufferDirection::DeviceToDriver {
            // SAFETY: the crate's buffer is valid for len bytes of reads (Hal::share's contract).
            let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
            cx.bounce.write(at, bytes).expect("inside the bounce area");
        }
        let iova = cx.bounce.iova() + at;
        Context::lock(&cx.bounced).insert(iova, (slot, len));
        iova
    }

    unsafe fn unshare(paddr: PhysAddr, buffer: NonNull<[u8]>, direction: BufferDirection) {
        let cx = current();
        let Some((slot, len)) = Context::lock(&cx.bounced).remove(&paddr) else {
            return; // in the pool: shared as it was
        };
        if direction != BufferDirection::DriverToDevice {
            // SAFETY: the crate's buffer is valid for len bytes of writes (Hal::unshare's
            // contract: the same buffer share was given).
            let out = unsafe { std::slice::from_raw_parts_mut(buffer.as_ptr() as *mut u8, len) };
            cx.bounce
                .read((slot * SLOT) as u64, out)
                .expect("inside the bounce area");
        }
        Context::lock(&cx.free).push(slot);
    }
}
