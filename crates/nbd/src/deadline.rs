//! One deadline for a connection's whole negotiation.
//!
//! A socket's receive time-out bounds each read, not the negotiation: a client that sends a
//! byte just inside every time-out would hold its connection (and its thread) for ever. A
//! watcher thread shuts down the socket of every negotiation still running at its deadline;
//! the connection's thread then sees its reads and writes fail, and ends.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::NbdError;

/// How often the watcher looks.
const TICK: Duration = Duration::from_millis(100);

struct Entry {
    id: u64,
    due: Instant,
    within: Duration,
    /// A second descriptor of the connection's socket, to shut it down with.
    socket: OwnedFd,
    expired: bool,
}

/// The negotiations running now, with their deadlines.
#[derive(Default)]
pub struct Deadlines {
    entries: Mutex<(u64, Vec<Entry>)>,
}

impl Deadlines {
    fn lock(&self) -> MutexGuard<'_, (u64, Vec<Entry>)> {
        // Every change is a whole push, retain or flag: a poisoned lock's data is still right.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the clock on a negotiation over `socket`; it must end ([`Armed::done`])
    /// within `within`.
    pub fn arm(
        self: &Arc<Self>,
        socket: BorrowedFd<'_>,
        within: Duration,
    ) -> Result<Armed, NbdError> {
        let socket = socket
            .try_clone_to_owned()
            .map_err(|e| NbdError::Setup(format!("negotiation deadline: {e}")))?;
        let mut g = self.lock();
        g.0 += 1;
        let id = g.0;
        g.1.push(Entry {
            id,
            due: Instant::now() + within,
            within,
            socket,
            expired: false,
        });
        Ok(Armed {
            deadlines: self.clone(),
            id,
        })
    }

    /// Shuts down the sockets of negotiations past their deadline, until `stop` is set.
    pub fn watch(&self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(TICK);
            let now = Instant::now();
            for e in self
                .lock()
                .1
                .iter_mut()
                .filter(|e| !e.expired && e.due <= now)
            {
                e.expired = true;
                let _ = rustix::net::shutdown(e.socket.as_fd(), rustix::net::Shutdown::Both);
            }
        }
    }
}

/// A negotiation on the clock; dropping it stops the clock.
pub struct Armed {
    deadlines: Arc<Deadlines>,
    id: u64,
}

impl Armed {
    /// The negotiation ended: an error if it ended too late (its socket was shut down).
    pub fn done(self) -> Result<(), NbdError> {
        // Taken off the list under the same lock that reads it: the watcher cannot shut the
        // socket of a negotiation that ended in time.
        let mut g = self.deadlines.lock();
        let at = g.1.iter().position(|e| e.id == self.id);
        match at.map(|i| g.1.remove(i)) {
            Some(e) if e.expired => Err(NbdError::Protocol(format!(
                "negotiation did not end within {:?}",
                e.within
            ))),
            _ => Ok(()),
        }
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        self.deadlines.lock().1.retain(|e| e.id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_negotiation_past_its_deadline_has_its_socket_shut_down() {
        let d = Arc::new(Deadlines::default());
        let stop = AtomicBool::new(false);
        let (mut ours, _theirs) = UnixStream::pair().unwrap();
        std::thread::scope(|s| {
            s.spawn(|| d.watch(&stop));
            let armed = d.arm(ours.as_fd(), Duration::from_millis(200)).unwrap();
            let t = Instant::now();
            // The peer never writes: only the shutdown ends this read.
            assert_eq!(ours.read(&mut [0u8; 8]).unwrap(), 0);
            assert!(t.elapsed() < Duration::from_secs(5));
            assert!(armed.done().is_err());
            stop.store(true, Ordering::Relaxed);
        });
    }

    #[test]
    fn a_negotiation_that_ends_in_time_is_left_alone() {
        let d = Arc::new(Deadlines::default());
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let armed = d.arm(ours.as_fd(), Duration::from_secs(60)).unwrap();
        assert!(armed.done().is_ok());
        assert!(d.lock().1.is_empty());
    }
}
