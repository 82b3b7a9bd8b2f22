//! The device side of a split virtqueue (virtio v1.2 §2.7), over a client's DMA map.
//!
//! Everything here is read from memory the driver controls, so every index, length and flag is
//! validated: an out-of-range descriptor index, a chain longer than the queue (a loop), an
//! indirect table where none was negotiated or nested inside another, a readable descriptor
//! after a writable one, or an available index that runs more than a queue's worth ahead are
//! [`QueueError`]s. The transport answers them by setting DEVICE_NEEDS_RESET; it never panics.
//!
//! Memory ordering (§2.7.13, §2.7.14): the driver publishes descriptors and ring entries, then
//! the available index (a store-release or wmb + store). [`DeviceQueue::pop`] loads that index
//! with Acquire, so the entries it then reads are the published ones. [`DeviceQueue::push`]
//! writes the used element and then stores the used index with Release, pairing with the
//! driver's Acquire load. Re-enabling notifications writes `avail_event` and then re-reads the
//! available index after a SeqCst fence; the driver does the mirror image (store avail idx,
//! fence, read `avail_event`), so one of the two always sees the other: no lost notification.

use std::sync::atomic::{fence, Ordering};

use outboard_spec::virtio::{feature, split};
use outboard_vfio_user::{DmaError, DmaMap};

/// Why a queue could not be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueueError {
    /// Ring memory or a descriptor table is not reachable.
    #[error(transparent)]
    Dma(#[from] DmaError),
    /// Queue size or ring alignment is invalid.
    #[error("invalid queue layout: {0}")]
    Layout(String),
    /// A descriptor index is out of range.
    #[error("descriptor index {index} out of range for a table of {size}")]
    BadIndex {
        /// The index.
        index: u16,
        /// Table size.
        size: u32,
    },
    /// A chain is longer than its table: a loop.
    #[error("descriptor chain from head {0} loops")]
    Loop(u16),
    /// Indirect descriptor misuse.
    #[error("invalid indirect descriptor: {0}")]
    Indirect(&'static str),
    /// A device-readable descriptor follows a device-writable one.
    #[error("readable descriptor after a writable one in chain {0}")]
    Order(u16),
    /// The driver claims more new buffers than the queue holds.
    #[error("available index {avail} is more than a queue ahead of {last}")]
    Runaway {
        /// The driver's index.
        avail: u16,
        /// Ours.
        last: u16,
    },
}

/// One buffer of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Device address.
    pub addr: u64,
    /// Length.
    pub len: u32,
    /// Device-writable.
    pub write: bool,
}

/// A descriptor chain made available by the driver.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Chain {
    /// Head index, returned in the used ring.
    pub head: u16,
    /// Buffers in order (readable ones first).
    pub segments: Vec<Segment>,
}

impl Chain {
    /// Total bytes of readable buffers.
    pub fn readable_len(&self) -> u64 {
        self.segments
            .iter()
            .filter(|s| !s.write)
            .map(|s| s.len as u64)
            .sum()
    }
    /// Total bytes of writable buffers.
    pub fn writable_len(&self) -> u64 {
        self.segments
            .iter()
            .filter(|s| s.write)
            .map(|s| s.len as u64)
            .sum()
    }
}

/// The device's state of one enabled queue.
#[derive(Debug, Clone)]
pub struct DeviceQueue {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    last_avail: u16,
    used_idx: u16,
    event_idx: bool,
    indirect: bool,
    /// An injected fault for the next used entry.
    corrupt: Option<crate::faults::UsedCorruption>,
}

impl DeviceQueue {
    /// A queue of `size` entries at the given ring addresses, with the negotiated features.
    pub fn new(
        size: u16,
        desc: u64,
        avail: u64,
        used: u64,
        features: u64,
    ) -> Result<Self, QueueError> {
        if size == 0 || !size.is_power_of_two() || size > split::MAX_QUEUE_SIZE {
            return Err(QueueError::Layout(format!(
                "size {size} is not a power of two up to 32768"
            )));
        }
        if !desc.is_multiple_of(16) || !avail.is_multiple_of(2) || !used.is_multiple_of(4) {
            return Err(QueueError::Layout("ring addresses are misaligned".into()));
        }
        Ok(Self {
            size,
            desc,
            avail,
            used,
            last_avail: 0,
            used_idx: 0,
            event_idx: features & feature::RING_EVENT_IDX != 0,
            indirect: features & feature::RING_INDIRECT_DESC != 0,
            corrupt: None,
        })
    }

    /// Checks that all three rings are mapped with the rights the device needs.
    pub fn check_rings(&self, dma: &DmaMap) -> Result<(), QueueError> {
        dma.translate(self.desc, split::desc_table_size(self.size), false)?;
        dma.translate(self.avail, split::avail_ring_size(self.size), false)?;
        dma.translate(self.used, split::used_ring_size(self.size), true)?;
        Ok(())
    }

    /// Queue size.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// The used index the device has published.
    pub fn used_idx(&self) -> u16 {
        self.used_idx
    }

    fn avail_idx(&self, dma: &DmaMap) -> Result<u16, QueueError> {
        let (mem, off) = dma.translate(self.avail + split::AVAIL_IDX, 2, false)?;
        // Acquire: pairs with the driver's release of the available index, so the ring entry
        // and descriptors read after this are the ones it published.
        Ok(mem
            .atomic_u16(off)
            .map_err(|_| QueueError::Layout("avail idx".into()))?
            .load(Ordering::Acquire))
    }

    fn read_u16(dma: &DmaMap, addr: u64) -> Result<u16, QueueError> {
        let mut b = [0u8; 2];
        dma.read(addr, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// Takes the next available chain, if any.
    pub fn pop(&mut self, dma: &DmaMap) -> Result<Option<Chain>, QueueError> {
        let mut chain = Chain::default();
        Ok(self.pop_into(dma, &mut chain)?.then_some(chain))
    }

    /// Serves every available chain: reads each into `chain` (its segment list reused, so
    /// nothing is allocated per request), lets `serve` handle it and say how many bytes it
    /// wrote, and returns it to the driver.
    pub fn serve(
        &mut self,
        dma: &DmaMap,
        chain: &mut Chain,
        mut serve: impl FnMut(&Chain) -> u32,
    ) -> Result<(), QueueError> {
        while self.pop_into(dma, chain)? {
            let written = serve(chain);
            self.push(dma, chain.head, written)?;
        }
        Ok(())
    }

    /// Takes the next available chain into `chain` (its segment list reused); false if there
    /// is none.
    pub fn pop_into(&mut self, dma: &DmaMap, chain: &mut Chain) -> Result<bool, QueueError> {
        let avail = self.avail_idx(dma)?;
        if avail == self.last_avail {
            return Ok(false);
        }
        if avail.wrapping_sub(self.last_avail) > self.size {
            return Err(QueueError::Runaway {
                avail,
                last: self.last_avail,
            });
        }
        let head = Self::read_u16(
            dma,
            self.avail + split::avail_entry(self.size, self.last_avail),
        )?;
        self.last_avail = self.last_avail.wrapping_add(1);
        chain.head = head;
        chain.segments.clear();
        self.walk(dma, head, &mut chain.segments).map(|()| true)
    }

    fn walk(&self, dma: &DmaMap, head: u16, segments: &mut Vec<Segment>) -> Result<(), QueueError> {
        let (mut table, mut table_size) = (self.desc, self.size as u32);
        let mut index = head;
        let mut seen = 0u32;
        let mut in_indirect = false;
        let mut writable_seen = false;
        loop {
            if index as u32 >= table_size {
                return Err(QueueError::BadIndex {
                    index,
                    size: table_size,
                });
            }
            seen += 1;
            if seen > table_size {
                return Err(QueueError::Loop(head));
            }
            let mut d = [0u8; split::DESC_SIZE as usize];
            dma.read(table + split::DESC_SIZE * index as u64, &mut d)?;
            let addr = u64::from_le_bytes(d[0..8].try_into().expect("8 bytes"));
            let len = u32::from_le_bytes(d[8..12].try_into().expect("4 bytes"));
            let flags = u16::from_le_bytes([d[12], d[13]]);
            let next = u16::from_le_bytes([d[14], d[15]]);
            if flags & split::DESC_F_INDIRECT != 0 {
                if !self.indirect {
                    return Err(QueueError::Indirect("INDIRECT_DESC was not negotiated"));
                }
                if in_indirect {
                    return Err(QueueError::Indirect("nested indirect table"));
                }
                if flags & split::DESC_F_NEXT != 0 {
                    return Err(QueueError::Indirect("indirect descriptor with NEXT"));
                }
                if len == 0 || len % split::DESC_SIZE as u32 != 0 {
                    return Err(QueueError::Indirect("table length is not a multiple of 16"));
                }
                table = addr;
                table_size = len / split::DESC_SIZE as u32;
                index = 0;
                seen = 0;
                in_indirect = true;
                continue;
            }
            let write = flags & split::DESC_F_WRITE != 0;
            if !write && writable_seen {
                return Err(QueueError::Order(head));
            }
            writable_seen |= write;
            segments.push(Segment { addr, len, write });
            if flags & split::DESC_F_NEXT == 0 {
                break;
            }
            index = next;
        }
        Ok(())
    }

    /// Returns a chain to the driver with `len` bytes written.
    pub fn push(&mut self, dma: &DmaMap, head: u16, len: u32) -> Result<(), QueueError> {
        self.push_all(dma, &[(head, len)])
    }

    /// Returns chains `(head, bytes written)` to the driver together: their entries first,
    /// then one store of the used index, so the driver sees all of them or none (a frame
    /// spread over several receive buffers).
    pub fn push_all(&mut self, dma: &DmaMap, used: &[(u16, u32)]) -> Result<(), QueueError> {
        for &(head, len) in used {
            let (id, len) = match self.corrupt.take() {
                // An id past the end of the table: no driver ever has it in flight.
                Some(crate::faults::UsedCorruption::Id) => (self.size as u32 + 7, len),
                // Claims nothing was written, not even the status byte.
                Some(crate::faults::UsedCorruption::Len) => (head as u32, 0),
                None => (head as u32, len),
            };
            let mut elem = [0u8; split::USED_ELEM_SIZE as usize];
            elem[0..4].copy_from_slice(&id.to_le_bytes());
            elem[4..8].copy_from_slice(&len.to_le_bytes());
            dma.write(
                self.used + split::used_entry(self.size, self.used_idx),
                &elem,
            )?;
            self.used_idx = self.used_idx.wrapping_add(1);
        }
        let (mem, off) = dma.translate(self.used + split::USED_IDX, 2, true)?;
        // Release: the elements written above are visible before the index that publishes them.
        mem.atomic_u16(off)
            .map_err(|_| QueueError::Layout("used idx".into()))?
            .store(self.used_idx, Ordering::Release);
        Ok(())
    }

    /// Where the next chain will be taken from (see [`DeviceQueue::rewind`]).
    pub fn next_avail(&self) -> u16 {
        self.last_avail
    }

    /// Gives back the chains taken since [`DeviceQueue::next_avail`] said `to` and not
    /// returned: the device did not use them (a frame that did not fit in the buffers there
    /// were), and takes them again later.
    pub fn rewind(&mut self, to: u16) {
        self.last_avail = to;
    }

    /// Makes the next used entry lie (fault injection).
    pub fn corrupt_next_used(&mut self, c: crate::faults::UsedCorruption) {
        self.corrupt = Some(c);
    }

    /// Whether the driver wants an interrupt for the entries published since `old_used`.
    pub fn should_notify(&self, dma: &DmaMap, old_used: u16) -> Result<bool, QueueError> {
        // The used index store must be visible before we read the driver's suppression state,
        // or we could skip an interrupt the driver asked for just after our check.
        fence(Ordering::SeqCst);
        if self.event_idx {
            let used_event = Self::read_u16(dma, self.avail + split::used_event(self.size))?;
            Ok(split::need_event(used_event, self.used_idx, old_used))
        } else {
            let flags = Self::read_u16(dma, self.avail + split::AVAIL_FLAGS)?;
            Ok(flags & split::AVAIL_F_NO_INTERRUPT == 0)
        }
    }

    /// Asks the driver to notify when it adds buffers, then re-checks: returns true if buffers
    /// arrived in the meantime (the caller must process them instead of sleeping).
    pub fn enable_notifications(&self, dma: &DmaMap) -> Result<bool, QueueError> {
        if self.event_idx {
            let (mem, off) = dma.translate(self.used + split::avail_event(self.size), 2, true)?;
            mem.atomic_u16(off)
                .map_err(|_| QueueError::Layout("avail event".into()))?
                .store(self.last_avail, Ordering::Relaxed);
        }
        // Pairs with the driver's fence between publishing the available index and reading
        // avail_event (see the module comment): one of us sees the other's store.
        fence(Ordering::SeqCst);
        Ok(self.avail_idx(dma)? != self.last_avail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outboard_shm::SharedMem;
    use outboard_vfio_user::wire;
    use std::time::Duration;

    const SIZE: u16 = 4;
    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const DATA: u64 = 0x4000;

    /// Guest memory of 64 KiB at IOVA 0 and a DMA map over it.
    fn setup() -> (SharedMem, DmaMap) {
        let mem = SharedMem::create("q", 0x10000).unwrap();
        let mut map = DmaMap::new(Duration::from_secs(1));
        let req = wire::DmaMap {
            argsz: 32,
            flags: 3,
            offset: 0,
            addr: 0,
            size: 0x10000,
        };
        map.map(&req, Some(mem.fd().unwrap().try_clone_to_owned().unwrap()))
            .unwrap();
        (mem, map)
    }

    fn desc(mem: &SharedMem, table: u64, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let o = table + 16 * i as u64;
        mem.write_u64(o, addr).unwrap();
        mem.write_u32(o + 8, len).unwrap();
        mem.write_u16(o + 12, flags).unwrap();
        mem.write_u16(o + 14, next).unwrap();
    }

    fn offer(mem: &SharedMem, avail_idx: u16, head: u16) {
        mem.write_u16(AVAIL + split::avail_entry(SIZE, avail_idx), head)
            .unwrap();
        mem.write_u16(AVAIL + split::AVAIL_IDX, avail_idx.wrapping_add(1))
            .unwrap();
    }

    #[test]
    fn pops_chains_and_wraps_indices() {
        let (mem, dma) = setup();
        let mut q = DeviceQueue::new(SIZE, DESC, AVAIL, USED, 0).unwrap();
        desc(&mem, DESC, 0, DATA, 16, split::DESC_F_NEXT, 1);
        desc(&mem, DESC, 1, DATA + 16, 1, split::DESC_F_WRITE, 0);
        // Run the 16-bit indices all the way around.
        for i in 0..70_000u32 {
            let idx = i as u16;
            offer(&mem, idx, 0);
            let c = q.pop(&dma).unwrap().expect("a chain");
            assert_eq!(c.head, 0);
            assert_eq!(c.segments.len(), 2);
            assert!(q.pop(&dma).unwrap().is_none());
            q.push(&dma, c.head, 1).unwrap();
            assert_eq!(
                mem.read_u16(USED + split::USED_IDX).unwrap(),
                idx.wrapping_add(1)
            );
            let e = USED + split::used_entry(SIZE, idx);
            assert_eq!(mem.read_u32(e).unwrap(), 0);
            assert_eq!(mem.read_u32(e + 4).unwrap(), 1);
        }
    }

    #[test]
    fn a_full_queue_is_accepted_and_more_is_a_runaway() {
        let (mem, dma) = setup();
        let mut q = DeviceQueue::new(SIZE, DESC, AVAIL, USED, 0).unwrap();
        for i in 0..SIZE {
            desc(&mem, DESC, i, DATA, 8, 0, 0);
            mem.write_u16(AVAIL + split::avail_entry(SIZE, i), i)
                .unwrap();
        }
        mem.write_u16(AVAIL + split::AVAIL_IDX, SIZE).unwrap();
        for i in 0..SIZE {
            assert_eq!(q.pop(&dma).unwrap().unwrap().head, i);
        }
        assert!(q.pop(&dma).unwrap().is_none());
        mem.write_u16(AVAIL + split::AVAIL_IDX, 2 * SIZE + 1)
            .unwrap();
        assert!(matches!(q.pop(&dma), Err(QueueError::Runaway { .. })));
    }

    #[test]
    fn rejects_hostile_chains() {
        let (mem, dma) = setup();
        // Out-of-range next.
        let mut q = DeviceQueue::new(SIZE, DESC, AVAIL, USED, feature::RING_INDIRECT_DESC).unwrap();
        desc(&mem, DESC, 0, DATA, 8, split::DESC_F_NEXT, 9);
        offer(&mem, 0, 0);
        assert!(matches!(
            q.pop(&dma),
            Err(QueueError::BadIndex { index: 9, .. })
        ));
        // A loop.
        desc(&mem, DESC, 0, DATA, 8, split::DESC_F_NEXT, 1);
        desc(&mem, DESC, 1, DATA, 8, split::DESC_F_NEXT, 0);
        offer(&mem, 1, 0);
        assert_eq!(q.pop(&dma), Err(QueueError::Loop(0)));
        // Readable after writable.
        desc(
            &mem,
            DESC,
            0,
            DATA,
            8,
            split::DESC_F_NEXT | split::DESC_F_WRITE,
            1,
        );
        desc(&mem, DESC, 1, DATA, 8, 0, 0);
        offer(&mem, 2, 0);
        assert_eq!(q.pop(&dma), Err(QueueError::Order(0)));
        // Head index out of range.
        offer(&mem, 3, 77);
        assert!(matches!(
            q.pop(&dma),
            Err(QueueError::BadIndex { index: 77, .. })
        ));
        // Nested indirect.
        desc(&mem, DESC, 0, 0x5000, 32, split::DESC_F_INDIRECT, 0);
        desc(&mem, 0x5000, 0, 0x6000, 16, split::DESC_F_INDIRECT, 0);
        offer(&mem, 4, 0);
        assert!(matches!(q.pop(&dma), Err(QueueError::Indirect(_))));
        // A descriptor table outside the DMA map.
        let mut q2 = DeviceQueue::new(SIZE, 0x20_0000, AVAIL, USED, 0).unwrap();
        mem.write_u16(AVAIL + split::AVAIL_IDX, 0).unwrap();
        offer(&mem, 0, 0);
        assert!(matches!(q2.pop(&dma), Err(QueueError::Dma(_))));
    }

    #[test]
    fn follows_indirect_tables() {
        let (mem, dma) = setup();
        let mut q = DeviceQueue::new(SIZE, DESC, AVAIL, USED, feature::RING_INDIRECT_DESC).unwrap();
        desc(&mem, DESC, 2, 0x5000, 48, split::DESC_F_INDIRECT, 0);
        desc(&mem, 0x5000, 0, DATA, 16, split::DESC_F_NEXT, 1);
        desc(
            &mem,
            0x5000,
            1,
            DATA + 16,
            512,
            split::DESC_F_NEXT | split::DESC_F_WRITE,
            2,
        );
        desc(&mem, 0x5000, 2, DATA + 528, 1, split::DESC_F_WRITE, 0);
        offer(&mem, 0, 2);
        let c = q.pop(&dma).unwrap().unwrap();
        assert_eq!(c.head, 2);
        assert_eq!(c.readable_len(), 16);
        assert_eq!(c.writable_len(), 513);
    }

    #[test]
    fn event_idx_suppresses_and_requests_notifications() {
        let (mem, dma) = setup();
        let mut q = DeviceQueue::new(SIZE, DESC, AVAIL, USED, feature::RING_EVENT_IDX).unwrap();
        desc(&mem, DESC, 0, DATA, 8, 0, 0);
        // Driver wants an interrupt only after used idx passes 1.
        mem.write_u16(AVAIL + split::used_event(SIZE), 1).unwrap();
        offer(&mem, 0, 0);
        let c = q.pop(&dma).unwrap().unwrap();
        q.push(&dma, c.head, 0).unwrap();
        assert!(!q.should_notify(&dma, 0).unwrap());
        offer(&mem, 1, 0);
        let c = q.pop(&dma).unwrap().unwrap();
        q.push(&dma, c.head, 0).unwrap();
        assert!(q.should_notify(&dma, 1).unwrap());
        // Re-enabling publishes avail_event and reports nothing pending.
        assert!(!q.enable_notifications(&dma).unwrap());
        assert_eq!(mem.read_u16(USED + split::avail_event(SIZE)).unwrap(), 2);
        offer(&mem, 2, 0);
        assert!(q.enable_notifications(&dma).unwrap());
    }
}
