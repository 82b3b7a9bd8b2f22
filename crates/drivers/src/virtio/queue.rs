//! The driver side of a split virtqueue (virtio v1.2 §2.7).
//!
//! Rules, as in sDDF's queue headers:
//! - The descriptor table and available ring are ours (PRODUCER); the used ring is the
//!   device's. We never read back anything we wrote that the device could have changed: free
//!   lists and chain lengths live in private shadow arrays, so a hostile device can only give us
//!   a bad used element, which [`VirtQueue::pop_used`] rejects.
//! - Indices are free-running u16; slots are `index % size`, size a power of two.
//! - Publishing: descriptors and ring entries are written first, then the available index with
//!   Release (pairs with the device's Acquire). Completion: the used index is loaded with
//!   Acquire (pairs with the device's Release) before the used element is read.
//! - Notification suppression (EVENT_IDX): after publishing, a SeqCst fence, then read
//!   `avail_event`; the device writes `avail_event`, fences, and re-reads our index. Whichever
//!   side moves second sees the other: no lost kick. Symmetrically for interrupts with
//!   `used_event` in [`VirtQueue::enable_interrupts`], which returns whether completions
//!   arrived meanwhile so the caller re-polls instead of sleeping.

use std::sync::atomic::{fence, Ordering};

use outboard_hw::{DmaBuf, DmaSpace};
use outboard_spec::virtio::{feature, split};

use super::transport::Doorbell;
use super::VirtioError;

/// Most buffers in one indirect table.
pub const MAX_INDIRECT: usize = 32;

/// One buffer of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buf {
    /// Device address.
    pub iova: u64,
    /// Length.
    pub len: u32,
    /// The device writes it (otherwise reads it).
    pub write: bool,
}

/// A split virtqueue owned by a driver.
#[derive(Debug)]
pub struct VirtQueue {
    index: u16,
    size: u16,
    ring: DmaBuf,
    avail_off: u64,
    used_off: u64,
    indirect: Option<DmaBuf>,
    free: Vec<u16>,
    next: Vec<u16>,
    chain_len: Vec<u16>,
    avail_shadow: u16,
    published: u16,
    last_used: u16,
    event_idx: bool,
    doorbell: Option<Doorbell>,
}

const fn align(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

impl VirtQueue {
    /// Allocates the rings of queue `index` with `size` entries in the device's DMA space.
    pub fn new(dma: &DmaSpace, index: u16, size: u16, features: u64) -> Result<Self, VirtioError> {
        if size == 0 || !size.is_power_of_two() {
            return Err(VirtioError::Device(format!(
                "queue size {size} is not a power of two"
            )));
        }
        let avail_off = split::desc_table_size(size);
        let used_off = align(avail_off + split::avail_ring_size(size), 4096);
        let ring = dma.alloc((used_off + split::used_ring_size(size)) as usize)?;
        let indirect = if features & feature::RING_INDIRECT_DESC != 0 {
            Some(dma.alloc(size as usize * MAX_INDIRECT * split::DESC_SIZE as usize)?)
        } else {
            None
        };
        Ok(Self {
            index,
            size,
            ring,
            avail_off,
            used_off,
            indirect,
            // Pop from the end: descriptor 0 is used first.
            free: (0..size).rev().collect(),
            next: vec![0; size as usize],
            chain_len: vec![0; size as usize],
            avail_shadow: 0,
            published: 0,
            last_used: 0,
            event_idx: features & feature::RING_EVENT_IDX != 0,
            doorbell: None,
        })
    }

    /// Forgets every request and zeroes the rings, as a queue just made: after the device
    /// reset this queue alone (`VIRTIO_F_RING_RESET`), before it is enabled again.
    pub fn clear(&mut self) -> Result<(), VirtioError> {
        let len = self.used_off + split::used_ring_size(self.size);
        self.ring.fill(0, len as usize, 0)?;
        self.free = (0..self.size).rev().collect();
        self.next.fill(0);
        self.chain_len.fill(0);
        self.avail_shadow = 0;
        self.published = 0;
        self.last_used = 0;
        Ok(())
    }

    /// Device addresses of the descriptor table, available ring and used ring.
    pub fn addresses(&self) -> (u64, u64, u64) {
        let base = self.ring.iova();
        (base, base + self.avail_off, base + self.used_off)
    }

    /// Attaches the doorbell returned by queue set-up.
    pub fn set_doorbell(&mut self, d: Doorbell) {
        self.doorbell = Some(d);
    }

    /// Queue index.
    pub fn index(&self) -> u16 {
        self.index
    }

    /// Queue size.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Requests in flight (made available and not yet used).
    pub fn in_flight(&self) -> usize {
        self.chain_len.iter().filter(|&&n| n > 0).count()
    }

    /// Descriptors needed for a request of `n` buffers.
    fn cost(&self, n: usize) -> usize {
        if self.indirect.is_some() && n > 1 && n <= MAX_INDIRECT {
            1
        } else {
            n
        }
    }

    /// Whether a request of `n` buffers fits now.
    pub fn can_add(&self, n: usize) -> bool {
        n > 0 && self.cost(n) <= self.free.len()
    }

    /// The head index the next [`VirtQueue::add`] will return (to key per-request state).
    pub fn next_head(&self) -> Option<u16> {
        self.free.last().copied()
    }

    fn write_desc(
        mem: &DmaBuf,
        at: u64,
        b: &Buf,
        flags: u16,
        next: u16,
    ) -> Result<(), VirtioError> {
        let mut d = [0u8; split::DESC_SIZE as usize];
        d[0..8].copy_from_slice(&b.iova.to_le_bytes());
        d[8..12].copy_from_slice(&b.len.to_le_bytes());
        d[12..14].copy_from_slice(
            &(flags | if b.write { split::DESC_F_WRITE } else { 0 }).to_le_bytes(),
        );
        d[14..16].copy_from_slice(&next.to_le_bytes());
        mem.write(at, &d)?;
        Ok(())
    }

    /// Makes a request available (not yet visible: see [`VirtQueue::publish`]). Readable buffers
    /// must come before writable ones. Returns the head index, or `None` if the queue is full.
    pub fn add(&mut self, bufs: &[Buf]) -> Result<Option<u16>, VirtioError> {
        if bufs.is_empty() {
            return Err(VirtioError::Device("empty request".into()));
        }
        if !self.can_add(bufs.len()) {
            return Ok(None);
        }
        let head = *self.free.last().expect("can_add checked");
        if self.cost(bufs.len()) == 1 && bufs.len() > 1 {
            let table = self.indirect.as_ref().expect("cost 1 implies indirect");
            let base = head as u64 * (MAX_INDIRECT as u64 * split::DESC_SIZE);
            for (i, b) in bufs.iter().enumerate() {
                let last = i + 1 == bufs.len();
                let flags = if last { 0 } else { split::DESC_F_NEXT };
                Self::write_desc(
                    table,
                    base + i as u64 * split::DESC_SIZE,
                    b,
                    flags,
                    (i + 1) as u16,
                )?;
            }
            let desc = Buf {
                iova: table.iova() + base,
                len: (bufs.len() as u64 * split::DESC_SIZE) as u32,
                write: false,
            };
            self.free.pop();
            Self::write_desc(
                &self.ring,
                head as u64 * split::DESC_SIZE,
                &desc,
                split::DESC_F_INDIRECT,
                0,
            )?;
            self.chain_len[head as usize] = 1;
        } else {
            // The descriptors of the chain: on the stack for the usual short chain (no
            // allocation per request), on the heap for a long one.
            let mut short = [0u16; 8];
            let mut long = Vec::new();
            let ids: &mut [u16] = if bufs.len() <= short.len() {
                &mut short[..bufs.len()]
            } else {
                long.resize(bufs.len(), 0);
                &mut long
            };
            for id in ids.iter_mut() {
                *id = self.free.pop().expect("can_add checked");
            }
            for (i, b) in bufs.iter().enumerate() {
                let next = ids.get(i + 1).copied();
                let flags = if next.is_some() {
                    split::DESC_F_NEXT
                } else {
                    0
                };
                Self::write_desc(
                    &self.ring,
                    ids[i] as u64 * split::DESC_SIZE,
                    b,
                    flags,
                    next.unwrap_or(0),
                )?;
                self.next[ids[i] as usize] = next.unwrap_or(0);
            }
            self.chain_len[head as usize] = bufs.len() as u16;
        }
        self.ring.write_u16(
            self.avail_off + split::avail_entry(self.size, self.avail_shadow),
            head,
        )?;
        self.avail_shadow = self.avail_shadow.wrapping_add(1);
        Ok(Some(head))
    }

    /// Publishes every request added since the last publish and notifies the device if it
    /// asked to be. Returns whether a notification was sent (batching: one per publish).
    pub fn publish(&mut self) -> Result<bool, VirtioError> {
        let (old, new) = (self.published, self.avail_shadow);
        if old == new {
            return Ok(false);
        }
        // Release: descriptors and ring entries written in `add` are visible before the index.
        self.ring
            .atomic_u16(self.avail_off + split::AVAIL_IDX)?
            .store(new, Ordering::Release);
        self.published = new;
        // Our index store must be visible before we read the device's suppression state.
        fence(Ordering::SeqCst);
        let kick = if self.event_idx {
            let avail_event = self
                .ring
                .atomic_u16(self.used_off + split::avail_event(self.size))?
                .load(Ordering::Relaxed);
            split::need_event(avail_event, new, old)
        } else {
            self.ring.read_u16(self.used_off + split::USED_FLAGS)? & split::USED_F_NO_NOTIFY == 0
        };
        if kick {
            self.doorbell
                .as_ref()
                .ok_or_else(|| VirtioError::Device("queue has no doorbell".into()))?
                .ring()?;
        }
        Ok(kick)
    }

    /// Notifies the device unconditionally (a spurious notification is harmless: the device
    /// finds nothing new). Used to measure the doorbell's cost.
    pub fn notify(&self) -> Result<(), VirtioError> {
        self.doorbell
            .as_ref()
            .ok_or_else(|| VirtioError::Device("queue has no doorbell".into()))?
            .ring()
    }

    /// Takes the next completed request: `(head, bytes written by the device)`.
    pub fn pop_used(&mut self) -> Result<Option<(u16, u32)>, VirtioError> {
        // Acquire: pairs with the device's Release of the used index.
        let used = self
            .ring
            .atomic_u16(self.used_off + split::USED_IDX)?
            .load(Ordering::Acquire);
        if used == self.last_used {
            return Ok(None);
        }
        if used.wrapping_sub(self.last_used) > self.size {
            return Err(VirtioError::Device(format!(
                "queue {}: used index {used} ran ahead of {}",
                self.index, self.last_used
            )));
        }
        let at = self.used_off + split::used_entry(self.size, self.last_used);
        let id = self.ring.read_u32(at)?;
        let len = self.ring.read_u32(at + 4)?;
        let head = u16::try_from(id)
            .ok()
            .filter(|&h| h < self.size && self.chain_len[h as usize] > 0);
        let Some(head) = head else {
            return Err(VirtioError::Device(format!(
                "queue {}: device returned descriptor {id}, which is not in flight",
                self.index
            )));
        };
        self.last_used = self.last_used.wrapping_add(1);
        let mut d = head;
        for _ in 0..self.chain_len[head as usize] {
            self.free.push(d);
            d = self.next[d as usize];
        }
        self.chain_len[head as usize] = 0;
        Ok(Some((head, len)))
    }

    /// Asks for an interrupt at the next completion, then re-checks: returns true if
    /// completions are already waiting (poll again instead of sleeping).
    pub fn enable_interrupts(&mut self) -> Result<bool, VirtioError> {
        if self.event_idx {
            self.ring
                .atomic_u16(self.avail_off + split::used_event(self.size))?
                .store(self.last_used, Ordering::Relaxed);
        } else {
            self.ring
                .write_u16(self.avail_off + split::AVAIL_FLAGS, 0)?;
        }
        // Pairs with the device's fence between publishing used idx and reading used_event.
        fence(Ordering::SeqCst);
        let used = self
            .ring
            .atomic_u16(self.used_off + split::USED_IDX)?
            .load(Ordering::Acquire);
        Ok(used != self.last_used)
    }

    /// Asks the device not to interrupt (a hint; with EVENT_IDX it is implicit until
    /// [`VirtQueue::enable_interrupts`] moves `used_event`).
    pub fn disable_interrupts(&mut self) -> Result<(), VirtioError> {
        if !self.event_idx {
            self.ring.write_u16(
                self.avail_off + split::AVAIL_FLAGS,
                split::AVAIL_F_NO_INTERRUPT,
            )?;
        }
        Ok(())
    }
}
