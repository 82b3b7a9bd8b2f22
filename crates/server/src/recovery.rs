//! Bringing a failed device back: the driver host re-opens it in the background.
//!
//! When the host gives a device up (its model died or stalled past the deadline, it needs a
//! reset, the driver lost track of it), the requests it held fail, and the host then tries to
//! open the device again from scratch: a new connection to the model (which resets the device
//! when the old connection closes), a new driver bring-up. Each attempt runs on a thread of its
//! own, because a model that is still stopped would hold an attempt for the whole vfio-user
//! timeout, and the host's loop must keep serving everyone else meanwhile. Attempts back off
//! from 100 ms to 5 s. When one succeeds, the host swaps the new driver in and maps its live
//! sessions' buffers into the new device: clients keep their sessions.
//!
//! This brings a device back when its model comes back; it does not replay what was in flight
//! (that is the supervisor's restart with replay).

use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::time::{Duration, Instant};

use std::sync::Arc;

/// Opens a device again from scratch; runs on a helper thread.
pub type Reopen<T> = Arc<dyn Fn() -> Result<T, String> + Send + Sync>;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// One failed device's way back.
pub struct Recovery<T> {
    reopen: Reopen<T>,
    next_attempt: Instant,
    backoff: Duration,
    pending: Option<Receiver<Result<T, String>>>,
    /// Attempts made so far.
    pub attempts: u32,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
}

impl<T: Send + 'static> Recovery<T> {
    /// Starts trying to re-open with `reopen`, the first attempt after a short pause (the
    /// model needs a moment to see its old client leave).
    pub fn new(reopen: Reopen<T>) -> Self {
        Self {
            reopen,
            next_attempt: Instant::now() + FIRST_BACKOFF,
            backoff: FIRST_BACKOFF,
            pending: None,
            attempts: 0,
            last_error: None,
        }
    }

    /// Starts an attempt when one is due; returns the device once an attempt succeeded.
    pub fn poll(&mut self) -> Option<T> {
        if let Some(rx) = &self.pending {
            match rx.try_recv() {
                Err(TryRecvError::Empty) => return None,
                Ok(Ok(host)) => {
                    self.pending = None;
                    return Some(host);
                }
                Ok(Err(e)) => self.retry_later(e),
                Err(TryRecvError::Disconnected) => {
                    self.retry_later("the attempt ended without an answer".into())
                }
            }
            return None;
        }
        if Instant::now() < self.next_attempt {
            return None;
        }
        self.attempts += 1;
        let (tx, rx) = channel();
        let reopen = self.reopen.clone();
        let started = std::thread::Builder::new()
            .name("device-reopen".into())
            .spawn(move || {
                let _ = tx.send(reopen());
            });
        match started {
            Ok(_) => self.pending = Some(rx),
            Err(e) => self.retry_later(format!("cannot start an attempt: {e}")),
        }
        None
    }

    fn retry_later(&mut self, why: String) {
        tracing::debug!("re-opening failed: {why}; next try in {:?}", self.backoff);
        self.last_error = Some(why);
        self.pending = None;
        self.next_attempt = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }
}
