//! Timers as event sources: a timerfd on the monotonic clock, so a sleeping loop wakes exactly
//! when something is due (a request's deadline, a retry, the end of a link flap) instead of
//! polling. Driver servers and device models both use them.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags,
    Timespec,
};

/// A one-shot timer: armed for an instant, it becomes readable when the instant passes.
#[derive(Debug)]
pub struct Timer {
    fd: OwnedFd,
    due: Option<Instant>,
}

fn timespec(d: Duration) -> Timespec {
    Timespec {
        tv_sec: d.as_secs() as _,
        tv_nsec: d.subsec_nanos() as _,
    }
}

impl Timer {
    /// A disarmed timer.
    pub fn new() -> std::io::Result<Self> {
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK,
        )?;
        Ok(Self { fd, due: None })
    }

    /// Fires at `at` (at once if it has passed). Re-arming for the instant already set costs
    /// no system call.
    pub fn arm_at(&mut self, at: Instant) -> std::io::Result<()> {
        if self.due == Some(at) {
            return Ok(());
        }
        // A zero it_value disarms a timerfd, so an instant already past becomes 1 ns.
        let after = at
            .saturating_duration_since(Instant::now())
            .max(Duration::from_nanos(1));
        self.set(after)?;
        self.due = Some(at);
        Ok(())
    }

    /// Stops the timer.
    pub fn disarm(&mut self) -> std::io::Result<()> {
        if self.due.take().is_some() {
            self.set(Duration::ZERO)?;
        }
        Ok(())
    }

    /// When it is due, if armed.
    pub fn due(&self) -> Option<Instant> {
        self.due
    }

    /// Consumes an expiry after the loop reported the timer; the timer is then disarmed.
    pub fn ack(&mut self) {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut buf);
        self.due = None;
    }

    fn set(&self, after: Duration) -> std::io::Result<()> {
        let spec = Itimerspec {
            it_interval: timespec(Duration::ZERO),
            it_value: timespec(after),
        };
        timerfd_settime(&self.fd, TimerfdTimerFlags::empty(), &spec)
            .map(|_| ())
            .map_err(Into::into)
    }

    /// The fd to wait on (a work loop's source, a model's input).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
