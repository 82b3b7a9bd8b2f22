//! One single-producer single-consumer ring protocol, for every queue in a session.
//!
//! Rules (after sDDF's `queue.h`):
//! - The PRODUCER owns `tail`, the CONSUMER owns `head`; each only ever stores its own index and
//!   only loads the other's.
//! - Indices are free-running u32; entry `i` lives in slot `i % capacity`; capacity is a power of
//!   two kept in the private handle ([`Producer`], [`Consumer`]), never read back from shared
//!   memory, so a hostile peer cannot change it.
//! - The peer's index is untrusted: a `tail` more than `capacity` ahead of `head` (or a `head`
//!   beyond `tail`) is a [`RingError::Corrupt`], and the session is cut off.
//! - Publishing: the producer writes the entry, then stores `tail` with Release; the consumer
//!   loads `tail` with Acquire before reading entries (Acquire pairs with that Release). The
//!   consumer reads the entry, then stores `head` with Release; the producer's Acquire load of
//!   `head` pairs with it before reusing the slot.
//!
//! Sleeping and waking (the doorbell rule) are in [`crate::doorbell`].

use crate::sync::{AtomicU32, Ordering};

/// What a ring's shared memory must provide.
pub trait RingStorage {
    /// The consumer's index.
    fn head(&self) -> &AtomicU32;
    /// The producer's index.
    fn tail(&self) -> &AtomicU32;
    /// Writes entry `slot` (PRODUCER only, slot not visible to the consumer).
    fn write_slot(&self, slot: u32, entry: &[u8]);
    /// Reads entry `slot` (CONSUMER only, slot published).
    fn read_slot(&self, slot: u32, entry: &mut [u8]);
}

/// The peer broke the ring protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// Indices that no correct peer could produce.
    #[error("ring indices are corrupt (head {head}, tail {tail}, capacity {capacity})")]
    Corrupt {
        /// Consumer index seen.
        head: u32,
        /// Producer index seen.
        tail: u32,
        /// Ring capacity.
        capacity: u32,
    },
}

fn check(head: u32, tail: u32, capacity: u32) -> Result<u32, RingError> {
    let used = tail.wrapping_sub(head);
    if used > capacity {
        return Err(RingError::Corrupt {
            head,
            tail,
            capacity,
        });
    }
    Ok(used)
}

/// The producing end of a ring.
#[derive(Debug)]
pub struct Producer<S> {
    storage: S,
    capacity: u32,
    tail: u32,
    /// The tail last stored: a publish with nothing new stores nothing, so the line the
    /// consumer reads is not taken from it for no entry (a ring that is rarely used — a
    /// session's reasons — costs its consumer nothing).
    published: u32,
    /// The consumer's `head` as last loaded: while it shows room, `stage` does not load it
    /// again, so the line the consumer writes on every pop is read only when the ring looks
    /// full (a load per entry would pull that line across cores once per request).
    head_seen: u32,
}

impl<S: RingStorage> Producer<S> {
    /// Attaches to a ring of `capacity` entries (a power of two). Takes up from the shared
    /// `tail`, so a producer can be re-created over a live ring.
    pub fn new(storage: S, capacity: u32) -> Self {
        assert!(
            capacity.is_power_of_two(),
            "ring capacity must be a power of two"
        );
        // Relaxed: only this side stores `tail`.
        let tail = storage.tail().load(Ordering::Relaxed);
        Self {
            storage,
            capacity,
            tail,
            published: tail,
            // As if full: the first `stage` loads the real `head`.
            head_seen: tail.wrapping_sub(capacity),
        }
    }

    /// Free slots (PRODUCER).
    pub fn free(&self) -> Result<u32, RingError> {
        // Acquire: pairs with the consumer's Release of `head`, so the slots it freed are no
        // longer being read when we overwrite them.
        let head = self.storage.head().load(Ordering::Acquire);
        Ok(self.capacity - check(head, self.tail, self.capacity)?)
    }

    /// Free slots, at least `want` of them if the ring has that many free (PRODUCER): the
    /// consumer's `head` is loaded only when the room last seen is less, so a producer that
    /// asks before each batch does not pull the consumer's line across while there is room.
    pub fn room(&mut self, want: u32) -> Result<u32, RingError> {
        let seen = self.capacity - self.tail.wrapping_sub(self.head_seen).min(self.capacity);
        if seen >= want {
            return Ok(seen);
        }
        // Acquire: as in `free`.
        let head = self.storage.head().load(Ordering::Acquire);
        let used = check(head, self.tail, self.capacity)?;
        self.head_seen = head;
        Ok(self.capacity - used)
    }

    /// Writes one entry without publishing it; false if the ring is full (PRODUCER).
    pub fn stage(&mut self, entry: &[u8]) -> Result<bool, RingError> {
        // The consumer only ever frees slots, so room seen earlier is still there.
        if self.tail.wrapping_sub(self.head_seen) >= self.capacity {
            // Acquire: as in `free`.
            let head = self.storage.head().load(Ordering::Acquire);
            if check(head, self.tail, self.capacity)? == self.capacity {
                return Ok(false);
            }
            self.head_seen = head;
        }
        self.storage.write_slot(self.tail % self.capacity, entry);
        self.tail = self.tail.wrapping_add(1);
        Ok(true)
    }

    /// Publishes every staged entry (PRODUCER).
    pub fn publish(&mut self) {
        if self.published == self.tail {
            return;
        }
        // Release: the entries written in `stage` are visible before the new tail.
        self.storage.tail().store(self.tail, Ordering::Release);
        self.published = self.tail;
    }

    /// Stages and publishes one entry.
    pub fn push(&mut self, entry: &[u8]) -> Result<bool, RingError> {
        let ok = self.stage(entry)?;
        if ok {
            self.publish();
        }
        Ok(ok)
    }

    /// The storage (to reach doorbell flags next to it).
    pub fn storage(&self) -> &S {
        &self.storage
    }

    /// Where the next staged entry goes: entries are numbered from the ring's start, wrapping
    /// (PRODUCER).
    pub fn position(&self) -> u32 {
        self.tail
    }

    /// How many entries the consumer has taken, numbered as [`Producer::position`] numbers
    /// them: an entry staged at `p` was taken if `p` is before this (wrapping).
    pub fn taken(&self) -> u32 {
        // Acquire: what the consumer did before it moved `head` happened.
        self.storage.head().load(Ordering::Acquire)
    }
}

/// Whether an entry staged at `position` was taken by a consumer that has taken `taken`
/// (both as [`Producer::position`] numbers them; at most a ring's capacity apart).
pub fn was_taken(position: u32, taken: u32) -> bool {
    (position.wrapping_sub(taken) as i32) < 0
}

/// The consuming end of a ring.
#[derive(Debug)]
pub struct Consumer<S> {
    storage: S,
    capacity: u32,
    head: u32,
    /// The producer's `tail` as last loaded (checked then): entries below it are published,
    /// so `pop` loads `tail` again only when it has taken them all.
    tail_seen: u32,
}

impl<S: RingStorage> Consumer<S> {
    /// Attaches to a ring of `capacity` entries, taking up from the shared `head`.
    pub fn new(storage: S, capacity: u32) -> Self {
        assert!(
            capacity.is_power_of_two(),
            "ring capacity must be a power of two"
        );
        // Relaxed: only this side stores `head`.
        let head = storage.head().load(Ordering::Relaxed);
        Self {
            storage,
            capacity,
            head,
            tail_seen: head,
        }
    }

    /// Entries waiting (CONSUMER).
    pub fn available(&self) -> Result<u32, RingError> {
        // Acquire: pairs with the producer's Release of `tail`; entries below it are written.
        let tail = self.storage.tail().load(Ordering::Acquire);
        check(self.head, tail, self.capacity)
    }

    /// Copies the next entry out and frees its slot; false if the ring is empty (CONSUMER).
    pub fn pop(&mut self, entry: &mut [u8]) -> Result<bool, RingError> {
        if self.head == self.tail_seen {
            // Acquire: as in `available`.
            let tail = self.storage.tail().load(Ordering::Acquire);
            if check(self.head, tail, self.capacity)? == 0 {
                return Ok(false);
            }
            self.tail_seen = tail;
        }
        self.storage.read_slot(self.head % self.capacity, entry);
        self.head = self.head.wrapping_add(1);
        // Release: our read of the slot happens before the producer may reuse it.
        self.storage.head().store(self.head, Ordering::Release);
        Ok(true)
    }

    /// The storage.
    pub fn storage(&self) -> &S {
        &self.storage
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::sync::atomic::AtomicU32;

    struct Mem {
        head: AtomicU32,
        tail: AtomicU32,
        slots: RefCell<Vec<[u8; 4]>>,
    }
    impl RingStorage for &Mem {
        fn head(&self) -> &AtomicU32 {
            &self.head
        }
        fn tail(&self) -> &AtomicU32 {
            &self.tail
        }
        fn write_slot(&self, slot: u32, e: &[u8]) {
            self.slots.borrow_mut()[slot as usize].copy_from_slice(e);
        }
        fn read_slot(&self, slot: u32, e: &mut [u8]) {
            e.copy_from_slice(&self.slots.borrow()[slot as usize]);
        }
    }

    fn mem(start: u32) -> Mem {
        Mem {
            head: AtomicU32::new(start),
            tail: AtomicU32::new(start),
            slots: RefCell::new(vec![[0; 4]; 8]),
        }
    }

    #[test]
    fn fills_drains_and_wraps() {
        let m = mem(u32::MAX - 5);
        let mut p = Producer::new(&m, 8);
        let mut c = Consumer::new(&m, 8);
        let mut next_in = 0u32;
        let mut next_out = 0u32;
        for round in 0..50 {
            while p.stage(&next_in.to_le_bytes()).unwrap() {
                next_in += 1;
            }
            assert_eq!(p.free().unwrap(), 0, "full at round {round}");
            p.publish();
            let mut e = [0u8; 4];
            for _ in 0..(round % 8 + 1) {
                assert!(c.pop(&mut e).unwrap());
                assert_eq!(u32::from_le_bytes(e), next_out);
                next_out += 1;
            }
        }
    }

    proptest::proptest! {
        /// Any interleaving of pushes, pops and re-attached ends (a producer or consumer
        /// made again over the live ring, as after a restart) behaves like a bounded FIFO
        /// queue: each end's view of the other's index is only ever a cache.
        #[test]
        fn behaves_like_a_bounded_fifo(ops in proptest::collection::vec(0u8..8, 0..400), start in proptest::num::u32::ANY) {
            let m = mem(start);
            let mut p = Producer::new(&m, 8);
            let mut c = Consumer::new(&m, 8);
            let mut model = std::collections::VecDeque::new();
            let mut next = 0u32;
            for op in ops {
                match op {
                    0..=2 => {
                        let ok = p.push(&next.to_le_bytes()).unwrap();
                        proptest::prop_assert_eq!(ok, model.len() < 8);
                        if ok {
                            model.push_back(next);
                        }
                        next += 1;
                    }
                    3..=5 => {
                        let mut e = [0u8; 4];
                        let ok = c.pop(&mut e).unwrap();
                        proptest::prop_assert_eq!(ok, !model.is_empty());
                        if ok {
                            proptest::prop_assert_eq!(Some(u32::from_le_bytes(e)), model.pop_front());
                        }
                    }
                    6 => p = Producer::new(&m, 8),
                    _ => c = Consumer::new(&m, 8),
                }
                proptest::prop_assert_eq!(c.available().unwrap() as usize, model.len());
                proptest::prop_assert_eq!(p.free().unwrap() as usize, 8 - model.len());
            }
        }
    }

    #[test]
    fn corrupt_peer_indices_are_errors() {
        let m = mem(0);
        let mut c = Consumer::new(&m, 8);
        m.tail.store(9, std::sync::atomic::Ordering::Relaxed);
        assert!(matches!(c.pop(&mut [0; 4]), Err(RingError::Corrupt { .. })));
        let m = mem(10);
        let p = Producer::new(&m, 8);
        m.head.store(11, std::sync::atomic::Ordering::Relaxed);
        assert!(matches!(p.free(), Err(RingError::Corrupt { .. })));
    }
}
