//! Bringing a failed device back: the driver host re-opens it in the background.
//!
//! When the host gives a device up (its model died or stalled past the deadline, it needs a
//! reset, the driver lost track of it), the requests it held fail, and the host then tries to
//! open the device again from scratch: a new connection to the model (which resets the device
//! when the old connection closes), a new driver bring-up. Each attempt runs on a thread of its
//! own, because a model that is still stopped would hold an attempt for the whole vfio-user
//! timeout, and the host's loop must keep serving everyone else meanwhile. Attempts back off
//! from 100 ms to 5 s; after [`MAX_ATTEMPTS`] (about 40 s) the host gives the device up for good.
//! While attempts go on, requests fail at once with "restarting" (retry later); once given up,
//! with "device failed". When one succeeds, the host swaps the new driver in and maps its live
//! sessions' buffers into the new device: clients keep their sessions.
//!
//! This brings a device back when its model comes back; it does not replay what was in flight
//! (that is the supervisor's restart with replay).

use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::time::{Duration, Instant};

use std::sync::Arc;

/// Why an attempt to re-open failed: the opener's own error (the driver layer's `StartError`),
/// kept whole.
pub type ReopenError = Box<dyn std::error::Error + Send + Sync>;

/// Opens a device again from scratch; runs on a helper thread.
pub type Reopen<T> = Arc<dyn Fn() -> Result<T, ReopenError> + Send + Sync>;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Attempts before the device is given up for good: 100 ms doubling to 5 s makes about 40 s.
pub const MAX_ATTEMPTS: u32 = 12;

/// Where a recovery stands.
#[derive(Debug)]
pub enum Progress<T> {
    /// Still trying (or waiting to try again).
    Trying,
    /// An attempt succeeded: the device, open again.
    Back(T),
    /// Every attempt failed: the last one's error.
    GaveUp(String),
}

/// One failed device's way back.
pub struct Recovery<T> {
    reopen: Reopen<T>,
    next_attempt: Instant,
    backoff: Duration,
    pending: Option<Receiver<Result<T, ReopenError>>>,
    /// Attempts made so far.
    pub attempts: u32,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    max_attempts: u32,
}

impl<T: Send + 'static> Recovery<T> {
    /// Starts trying to re-open with `reopen`, the first attempt after a short pause (the
    /// model needs a moment to see its old client leave).
    pub fn new(reopen: Reopen<T>) -> Self {
        Self::with_limit(reopen, MAX_ATTEMPTS)
    }

    /// As [`Recovery::new`], giving up after `max_attempts`.
    pub fn with_limit(reopen: Reopen<T>, max_attempts: u32) -> Self {
        Self {
            max_attempts,
            reopen,
            next_attempt: Instant::now() + FIRST_BACKOFF,
            backoff: FIRST_BACKOFF,
            pending: None,
            attempts: 0,
            last_error: None,
        }
    }

    /// Starts an attempt when one is due; says when the device is back or given up.
    pub fn poll(&mut self) -> Progress<T> {
        if let Some(rx) = &self.pending {
            match rx.try_recv() {
                Err(TryRecvError::Empty) => return Progress::Trying,
                Ok(Ok(host)) => {
                    self.pending = None;
                    return Progress::Back(host);
                }
                Ok(Err(e)) => self.retry_later(e.to_string()),
                Err(TryRecvError::Disconnected) => {
                    self.retry_later("the attempt ended without an answer".into())
                }
            }
            return Progress::Trying;
        }
        if self.attempts >= self.max_attempts {
            let why = self.last_error.clone().unwrap_or_default();
            return Progress::GaveUp(format!(
                "{} attempts to re-open failed: {why}",
                self.attempts
            ));
        }
        if Instant::now() < self.next_attempt {
            return Progress::Trying;
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
        Progress::Trying
    }

    fn retry_later(&mut self, why: String) {
        tracing::debug!("re-opening failed: {why}; next try in {:?}", self.backoff);
        self.last_error = Some(why);
        self.pending = None;
        self.next_attempt = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn run<T: Send + 'static>(r: &mut Recovery<T>) -> Progress<T> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match r.poll() {
                Progress::Trying => {}
                done => return done,
            }
            assert!(Instant::now() < deadline, "recovery never ended");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_device_that_comes_back_is_returned() {
        let tries = Arc::new(AtomicU32::new(0));
        let t = tries.clone();
        let mut r = Recovery::new(Arc::new(move || {
            if t.fetch_add(1, Ordering::SeqCst) < 2 {
                Err("not yet".into())
            } else {
                Ok(7)
            }
        }));
        assert!(matches!(run(&mut r), Progress::Back(7)));
        assert_eq!(r.attempts, 3);
    }

    #[test]
    fn a_device_that_never_comes_back_is_given_up_with_the_last_reason() {
        let mut r: Recovery<u32> =
            Recovery::with_limit(Arc::new(|| Err("model is gone".into())), 3);
        match run(&mut r) {
            Progress::GaveUp(why) => {
                assert!(why.contains("3 attempts"), "{why}");
                assert!(why.contains("model is gone"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(r.attempts, 3);
    }
}
