//! The interrupt thread of a legacy driver: it waits on the driver's interrupt sources (a
//! device's interrupt eventfds, the timerfds behind `osenv_timer_register`) and raises the
//! vector each one stands for on the driver's [`Cpu`], which delivers it uncontested (here,
//! under the process lock) or contested (by stopping the thread in the driver).
//!
//! Sources are attached and detached from any thread while it waits (`epoll_ctl` is safe
//! beside `epoll_wait`), so `osenv_irq_alloc` registers a vector's source before it returns.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use rustix::event::{epoll, eventfd, EventfdFlags};
use rustix::io::Errno;

use super::{Cpu, VECTORS};
use crate::workloop::LoopError;

/// The epoll data word of the thread's own stop eventfd.
const STOP: u64 = u64::MAX;

/// One attached source, to detach it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourceKey(u64);

/// A running interrupt thread; stopping it (drop) joins it.
pub struct InterruptThread {
    shared: Arc<Sources>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The sources an interrupt thread waits on: attach and detach them from any thread. Holds
/// no reference to the CPU, so a CPU's own state may keep it.
pub struct Sources {
    epoll: OwnedFd,
    stop: OwnedFd,
    /// Attached sources by key: the vector each raises and the fd (owned here, so it stays
    /// open while the thread may read it).
    sources: Mutex<HashMap<u64, (u32, Arc<OwnedFd>)>>,
    next: AtomicU64,
}

impl std::fmt::Debug for InterruptThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.shared.sources.lock().map(|s| s.len()).unwrap_or(0);
        f.debug_struct("InterruptThread")
            .field("sources", &n)
            .finish()
    }
}

impl InterruptThread {
    /// Starts the interrupt thread of `cpu`.
    pub fn spawn(cpu: Arc<Cpu>) -> Result<Self, LoopError> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)
            .map_err(|e| LoopError::os("epoll_create", e))?;
        let stop = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| LoopError::os("eventfd", e))?;
        epoll::add(
            &epoll,
            stop.as_fd(),
            epoll::EventData::new_u64(STOP),
            epoll::EventFlags::IN,
        )
        .map_err(|e| LoopError::os("epoll_ctl(add)", e))?;
        let shared = Arc::new(Sources {
            epoll,
            stop,
            sources: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("osenv-intr".into())
            .spawn(move || s.run(&cpu))
            .map_err(|e| LoopError::os("spawn", Errno::from_io_error(&e).unwrap_or(Errno::IO)))?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// The sources it waits on, to attach and detach from elsewhere.
    pub fn sources(&self) -> Arc<Sources> {
        self.shared.clone()
    }

    /// Raises `vector` whenever `fd` becomes readable ([`Sources::attach`]).
    pub fn attach(&self, fd: OwnedFd, vector: u32) -> Result<SourceKey, LoopError> {
        self.shared.attach(fd, vector)
    }

    /// Stops watching a source ([`Sources::detach`]).
    pub fn detach(&self, key: SourceKey) {
        self.shared.detach(key)
    }
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources").finish_non_exhaustive()
    }
}

impl Sources {
    /// Raises `vector` whenever `fd` becomes readable (an eventfd or a timerfd: each wake-up
    /// reads its 8-byte count). Several firings before the thread reads coalesce into one
    /// interrupt, as a CPU's pending bit does.
    pub fn attach(&self, fd: OwnedFd, vector: u32) -> Result<SourceKey, LoopError> {
        if vector >= VECTORS {
            return Err(LoopError::os("attach", Errno::INVAL));
        }
        let key = self.next.fetch_add(1, SeqCst);
        let fd = Arc::new(fd);
        let mut sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        epoll::add(
            &self.epoll,
            fd.as_fd(),
            epoll::EventData::new_u64(key),
            epoll::EventFlags::IN,
        )
        .map_err(|e| LoopError::os("epoll_ctl(add)", e))?;
        sources.insert(key, (vector, fd));
        Ok(SourceKey(key))
    }

    /// Stops watching a source and closes it (once the thread no longer reads it).
    pub fn detach(&self, key: SourceKey) {
        let removed = self
            .sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key.0);
        if let Some((_, fd)) = removed {
            let _ = epoll::delete(&self.epoll, fd.as_fd());
        }
    }
}

impl Sources {
    fn run(&self, cpu: &Cpu) {
        let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 32];
        loop {
            let events = match epoll::wait(&self.epoll, &mut buf, None) {
                Ok((events, _)) => events,
                Err(Errno::INTR) => continue,
                Err(e) => {
                    tracing::error!("legacy interrupt thread: epoll_wait: {e}");
                    return;
                }
            };
            for e in events.iter() {
                let key = e.data.u64();
                if key == STOP {
                    return;
                }
                let source = self
                    .sources
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&key)
                    .cloned();
                let Some((vector, fd)) = source else {
                    continue;
                };
                let mut count = [0u8; 8];
                // A spurious readiness (EAGAIN: nobody else reads it) raises nothing.
                if let Ok(8) = rustix::io::read(fd.as_fd(), &mut count) {
                    cpu.raise(vector);
                }
            }
        }
    }
}

impl Drop for InterruptThread {
    fn drop(&mut self) {
        let _ = rustix::io::write(&self.shared.stop, &1u64.to_ne_bytes());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
