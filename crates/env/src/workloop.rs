//! The work loop: one thread waits on many event sources and learns which fired, as typed
//! values rather than packed integers.

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

impl LoopError {
    pub(crate) fn os(op: &'static str, errno: Errno) -> Self {
        Self { op, errno }
    }
}

impl From<std::io::Error> for LoopError {
    /// A timer's failure, as the loop reports it.
    fn from(e: std::io::Error) -> Self {
        Self::os("timer", Errno::from_io_error(&e).unwrap_or(Errno::IO))
    }
}

/// An epoll-based work loop whose sources are described by values of type `S` (usually an
/// enum naming what fired: an interrupt of a device, a session's doorbell, a timer).
///
/// epoll carries one `u64` per fd; the loop keeps the `S` in a slab and stores only the slab
/// index in the kernel, so `S` can be any `Copy` type and no caller packs bits.
pub struct WorkLoop<S> {
    epoll: OwnedFd,
    sources: Vec<Option<(S, i32)>>,
    free: Vec<usize>,
}

impl<S> std::fmt::Debug for WorkLoop<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkLoop")
            .field("sources", &(self.sources.len() - self.free.len()))
            .finish()
    }
}

impl<S: Copy + PartialEq> WorkLoop<S> {
    /// A loop with no sources.
    pub fn new() -> Result<Self, LoopError> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)
            .map_err(|e| LoopError::os("epoll_create", e))?;
        Ok(Self {
            epoll,
            sources: Vec::new(),
            free: Vec::new(),
        })
    }

    /// Adds an event source: when `fd` becomes readable (or hangs up), `wait` reports `what`.
    pub fn add(&mut self, fd: BorrowedFd<'_>, what: S) -> Result<(), LoopError> {
        self.add_for(fd, what, epoll::EventFlags::IN)
    }

    /// Adds a source that is reported only when `fd` hangs up or fails (its peer closed the
    /// connection), not when it is readable: a device's loss, watched on a connection that
    /// also carries replies another thread is about to read.
    pub fn add_hangup(&mut self, fd: BorrowedFd<'_>, what: S) -> Result<(), LoopError> {
        // EPOLLHUP and EPOLLERR are always reported; RDHUP adds the peer's shutdown.
        self.add_for(fd, what, epoll::EventFlags::RDHUP)
    }

    /// Adds one of a driver's sources ([`crate::Driver::sources`]) as `what`: its loss by
    /// [`WorkLoop::add_hangup`], the rest by [`WorkLoop::add`].
    pub fn add_device(
        &mut self,
        fd: BorrowedFd<'_>,
        event: crate::DeviceEvent,
        what: S,
    ) -> Result<(), LoopError> {
        if event == crate::DeviceEvent::Lost {
            self.add_hangup(fd, what)
        } else {
            self.add(fd, what)
        }
    }

    fn add_for(
        &mut self,
        fd: BorrowedFd<'_>,
        what: S,
        flags: epoll::EventFlags,
    ) -> Result<(), LoopError> {
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let slot = match self.free.pop() {
            Some(i) => i,
            None => {
                self.sources.push(None);
                self.sources.len() - 1
            }
        };
        match epoll::add(
            &self.epoll,
            fd,
            epoll::EventData::new_u64(slot as u64),
            flags,
        ) {
            Ok(()) => {
                self.sources[slot] = Some((what, raw));
                Ok(())
            }
            Err(e) => {
                self.free.push(slot);
                Err(LoopError::os("epoll_ctl(add)", e))
            }
        }
    }

    /// Removes the source registered for `fd`.
    pub fn remove(&mut self, fd: BorrowedFd<'_>) -> Result<(), LoopError> {
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        if let Some(i) = self
            .sources
            .iter()
            .position(|s| s.is_some_and(|(_, f)| f == raw))
        {
            self.sources[i] = None;
            self.free.push(i);
        }
        epoll::delete(&self.epoll, fd).map_err(|e| LoopError::os("epoll_ctl(del)", e))
    }

    /// Waits up to `timeout` (forever if `None`) and appends what fired to `ready`. Returns
    /// how many were added (0 on timeout or a signal).
    pub fn wait(
        &mut self,
        timeout: Option<Duration>,
        ready: &mut Vec<S>,
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
            Err(e) => return Err(LoopError::os("epoll_wait", e)),
        };
        let before = ready.len();
        for e in events.iter() {
            if let Some(Some((what, _))) = self.sources.get(e.data.u64() as usize) {
                ready.push(*what);
            }
        }
        Ok(ready.len() - before)
    }

    /// The epoll fd, so a loop can itself be a source in an outer loop.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}
