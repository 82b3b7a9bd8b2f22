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

/// A periodic timerfd on the monotonic clock, non-blocking: readable every `period` from now
/// (its 8-byte count says how many periods passed since the last read). `None` makes it
/// disarmed.
pub fn periodic(period: Option<Duration>) -> std::io::Result<OwnedFd> {
    let fd = timerfd_create(
        TimerfdClockId::Monotonic,
        TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK,
    )?;
    set_periodic(fd.as_fd(), period)?;
    Ok(fd)
}

/// Re-arms a periodic timerfd to fire every `period` from now, or disarms it (`None`, or a
/// zero period, which a timerfd takes as "stop").
pub fn set_periodic(fd: BorrowedFd<'_>, period: Option<Duration>) -> std::io::Result<()> {
    let every = timespec(period.unwrap_or(Duration::ZERO));
    let spec = Itimerspec {
        it_interval: every,
        it_value: every,
    };
    timerfd_settime(fd, TimerfdTimerFlags::empty(), &spec)
        .map(|_| ())
        .map_err(Into::into)
}

/// The period of `hz` ticks per second (`hz` > 0).
pub fn period_of(hz: u32) -> Duration {
    Duration::from_nanos(1_000_000_000 / u64::from(hz.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_periodic_timer_fires_repeatedly_and_stops_when_disarmed() {
        let fd = periodic(Some(Duration::from_millis(1))).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let mut b = [0u8; 8];
        rustix::io::read(&fd, &mut b).unwrap();
        assert!(u64::from_le_bytes(b) >= 2, "{}", u64::from_le_bytes(b));
        set_periodic(fd.as_fd(), None).unwrap();
        let _ = rustix::io::read(&fd, &mut b);
        std::thread::sleep(Duration::from_millis(10));
        assert!(rustix::io::read(&fd, &mut b).is_err(), "fired after disarm");
        assert_eq!(period_of(1000), Duration::from_millis(1));
    }
}
