//! The driver execution environment.
//!
//! This crate holds the **native work-loop model** (I/O Kit work loops, sDDF event handlers):
//! a driver runs on one thread that waits on its event sources — interrupt eventfds, timerfds,
//! doorbells — and handles them one at a time, so nothing inside a driver needs a lock. The
//! `osenv` legacy model (Fluke) is a later addition; it will share these event sources.
#![deny(missing_docs)]

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::event::epoll;
use rustix::io::Errno;

/// Why the work loop failed.
#[derive(Debug, thiserror::Error)]
#[error("work loop: {op}: {errno}")]
pub struct LoopError {
    op: &'static str,
    errno: Errno,
}

/// An epoll-based work loop: register fds with a token, wait, get back the tokens that fired.
pub struct WorkLoop {
    epoll: OwnedFd,
}

impl std::fmt::Debug for WorkLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkLoop")
    }
}

impl WorkLoop {
    /// A loop with no sources.
    pub fn new() -> Result<Self, LoopError> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|errno| LoopError {
            op: "epoll_create",
            errno,
        })?;
        Ok(Self { epoll })
    }

    /// Adds an event source: when `fd` becomes readable, `wait` reports `token`.
    pub fn add(&self, fd: BorrowedFd<'_>, token: u64) -> Result<(), LoopError> {
        epoll::add(
            &self.epoll,
            fd,
            epoll::EventData::new_u64(token),
            epoll::EventFlags::IN,
        )
        .map_err(|errno| LoopError {
            op: "epoll_ctl(add)",
            errno,
        })
    }

    /// Removes a source.
    pub fn remove(&self, fd: BorrowedFd<'_>) -> Result<(), LoopError> {
        epoll::delete(&self.epoll, fd).map_err(|errno| LoopError {
            op: "epoll_ctl(del)",
            errno,
        })
    }

    /// Waits up to `timeout` (forever if `None`) and appends the tokens of ready sources to
    /// `ready`. Returns how many were added (0 on timeout or a signal).
    pub fn wait(
        &mut self,
        timeout: Option<Duration>,
        ready: &mut Vec<u64>,
    ) -> Result<usize, LoopError> {
        let ts = timeout.map(|t| rustix::time::Timespec {
            tv_sec: t.as_secs() as _,
            tv_nsec: t.subsec_nanos() as _,
        });
        // A stack buffer per call keeps the loop `Send` (epoll events hold a pointer union).
        let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 64];
        let events = match epoll::wait(&self.epoll, &mut buf, ts.as_ref()) {
            Ok((events, _)) => events,
            Err(Errno::INTR) => return Ok(0),
            Err(errno) => {
                return Err(LoopError {
                    op: "epoll_wait",
                    errno,
                })
            }
        };
        ready.extend(events.iter().map(|e| e.data.u64()));
        Ok(events.len())
    }

    /// The epoll fd, so a loop can itself be a source in an outer loop.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::event::{eventfd, EventfdFlags};

    #[test]
    fn reports_the_token_of_the_source_that_fired() {
        let mut wl = WorkLoop::new().unwrap();
        let a = eventfd(0, EventfdFlags::NONBLOCK).unwrap();
        let b = eventfd(0, EventfdFlags::NONBLOCK).unwrap();
        wl.add(a.as_fd(), 1).unwrap();
        wl.add(b.as_fd(), 2).unwrap();
        let mut ready = Vec::new();
        assert_eq!(
            wl.wait(Some(Duration::from_millis(1)), &mut ready).unwrap(),
            0
        );
        rustix::io::write(&b, &1u64.to_ne_bytes()).unwrap();
        wl.wait(Some(Duration::from_secs(1)), &mut ready).unwrap();
        assert_eq!(ready, vec![2]);
    }
}
