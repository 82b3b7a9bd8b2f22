//! Doorbells: eventfds rung only when the other side is about to sleep.
//!
//! The rule (sDDF's signalling rule, model-checked in `tests/loom.rs`):
//!
//! - The **waiting** side, finding its ring empty, stores its sleep flag, then a SeqCst fence,
//!   then re-checks the ring. Only if the ring is still empty does it block on its eventfd.
//! - The **notifying** side publishes entries (a Release store of the ring index), then a SeqCst
//!   fence, then loads the peer's sleep flag and rings only if it is set.
//!
//! The two fences order "flag store → ring load" against "ring store → flag load": at least one
//! side sees the other's store, so either the waiter finds the new entry or the notifier finds
//! the flag and rings. No wake-up is lost, and a busy peer is never rung (no system call).
//! Rings between the flag store and the block are counted by the eventfd, not lost.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::event::{EventfdFlags, PollFd, PollFlags};
use rustix::io::Errno;

use crate::sync::{fence, AtomicU32, Ordering};

/// Publishes "I am about to sleep" (WAITER). The caller must re-check its ring afterwards.
pub fn announce_sleep(flag: &AtomicU32) {
    flag.store(1, Ordering::Relaxed);
    // Orders the flag store before the caller's re-check of the ring (see the module rule).
    fence(Ordering::SeqCst);
}

/// Withdraws the announcement (WAITER), after waking or when the re-check found work.
pub fn cancel_sleep(flag: &AtomicU32) {
    flag.store(0, Ordering::Relaxed);
}

/// Whether the peer must be rung after publishing (NOTIFIER).
pub fn peer_sleeping(flag: &AtomicU32) -> bool {
    // Orders the caller's ring publish before reading the peer's flag (see the module rule).
    fence(Ordering::SeqCst);
    flag.load(Ordering::Relaxed) != 0
}

/// An eventfd used as a doorbell.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    /// A new non-blocking eventfd.
    pub fn new() -> Result<Self, Errno> {
        Ok(Self {
            fd: rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
        })
    }

    /// Wraps an eventfd received from the peer (it must be one; a wrong fd fails on use).
    pub fn from_fd(fd: OwnedFd) -> Self {
        Self { fd }
    }

    /// The eventfd, to pass to the peer or register in a work loop.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Rings: one `write`. A full counter (impossible with a reading peer) is ignored: the peer
    /// is awake anyway.
    pub fn ring(&self) {
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Consumes pending rings; returns how many there were.
    pub fn drain(&self) -> u64 {
        let mut b = [0u8; 8];
        match rustix::io::read(&self.fd, &mut b) {
            Ok(8) => u64::from_ne_bytes(b),
            _ => 0,
        }
    }

    /// Blocks until rung or `timeout`; returns whether it was rung.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let ts = timeout.map(|t| rustix::time::Timespec {
            tv_sec: t.as_secs() as _,
            tv_nsec: t.subsec_nanos() as _,
        });
        loop {
            if self.drain() > 0 {
                return true;
            }
            let mut p = [PollFd::new(&self.fd, PollFlags::IN)];
            match rustix::event::poll(&mut p, ts.as_ref()) {
                Ok(0) => return self.drain() > 0,
                Ok(_) => continue,
                Err(Errno::INTR) => continue,
                Err(_) => return false,
            }
        }
    }
}
