//! Model checks of the ring protocol and the doorbell rule with loom.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p outboard-session --test loom --release`
//! (`test.sh` does). Loom explores every interleaving and memory-ordering outcome the C11 model
//! allows, so these assert properties over all executions, not one lucky run.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU32;
use loom::sync::{Arc, Notify};
use loom::thread;
use outboard_session::doorbell::{announce_sleep, cancel_sleep, peer_sleeping};
use outboard_session::{Consumer, Producer, RingStorage};

struct Ring {
    head: AtomicU32,
    tail: AtomicU32,
    slots: Vec<UnsafeCell<u32>>,
}

#[derive(Clone)]
struct Shared(Arc<Ring>);

impl RingStorage for Shared {
    fn head(&self) -> &AtomicU32 {
        &self.0.head
    }
    fn tail(&self) -> &AtomicU32 {
        &self.0.tail
    }
    fn write_slot(&self, slot: u32, e: &[u8]) {
        let v = u32::from_le_bytes(e.try_into().unwrap());
        // SAFETY: loom's UnsafeCell checks exactly this: that no read of the slot races with
        // this write. The ring protocol is what makes it so; a violation fails the model.
        self.0.slots[slot as usize].with_mut(|p| unsafe { *p = v });
    }
    fn read_slot(&self, slot: u32, e: &mut [u8]) {
        // SAFETY: as for `write_slot`; loom reports a racing access.
        let v = self.0.slots[slot as usize].with(|p| unsafe { *p });
        e.copy_from_slice(&v.to_le_bytes());
    }
}

fn ring(capacity: u32) -> Shared {
    Shared(Arc::new(Ring {
        head: AtomicU32::new(0),
        tail: AtomicU32::new(0),
        slots: (0..capacity).map(|_| UnsafeCell::new(0)).collect(),
    }))
}

/// Every entry arrives exactly once, in order, with no data race on a slot, even when the
/// producer laps a ring smaller than the number of entries.
#[test]
fn no_lost_or_duplicated_entries() {
    loom::model(|| {
        let r = ring(2);
        let mut p = Producer::new(r.clone(), 2);
        let t = thread::spawn(move || {
            for v in 1..=3u32 {
                while !p.push(&v.to_le_bytes()).unwrap() {
                    thread::yield_now();
                }
            }
        });
        let mut c = Consumer::new(r, 2);
        let mut got = Vec::new();
        while got.len() < 3 {
            let mut e = [0u8; 4];
            if c.pop(&mut e).unwrap() {
                got.push(u32::from_le_bytes(e));
            } else {
                thread::yield_now();
            }
        }
        t.join().unwrap();
        assert_eq!(got, vec![1, 2, 3]);
    });
}

/// The sleeping consumer is always woken: if it blocks, the producer saw its flag and rang.
/// A lost wake-up would leave the consumer blocked forever, which loom reports as a deadlock.
#[test]
fn no_lost_wake_up() {
    loom::model(|| {
        let r = ring(4);
        let flag = Arc::new(AtomicU32::new(0));
        let bell = Arc::new(Notify::new());
        let (pf, pb) = (flag.clone(), bell.clone());
        let mut p = Producer::new(r.clone(), 4);
        let t = thread::spawn(move || {
            for v in 1..=2u32 {
                assert!(p.push(&v.to_le_bytes()).unwrap());
                if peer_sleeping(&pf) {
                    pb.notify();
                }
            }
        });
        let mut c = Consumer::new(r, 4);
        let mut got = 0;
        while got < 2 {
            let mut e = [0u8; 4];
            if c.pop(&mut e).unwrap() {
                got += 1;
                continue;
            }
            announce_sleep(&flag);
            if c.available().unwrap() > 0 {
                cancel_sleep(&flag);
                continue;
            }
            bell.wait();
            cancel_sleep(&flag);
        }
        t.join().unwrap();
    });
}
