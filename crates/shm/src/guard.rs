//! A SIGBUS guard for mappings of files a peer may truncate.
//!
//! A peer that passes a file (a memfd, a tmpfs or disk file) and then shrinks it turns every
//! access to the vanished pages into SIGBUS in *our* process. Memfds are sealed against shrinking
//! where the peer allows it ([`crate::SharedMem::map_peer`]); a file that cannot be sealed is
//! mapped under this guard instead, the technique libwayland-server uses for client buffers:
//!
//! - each guarded mapping is registered in a fixed, lock-free table the signal handler can read;
//! - on SIGBUS at an address inside a registered mapping, the handler maps anonymous zero pages
//!   over the whole mapping (`MAP_FIXED`) and marks it poisoned; the faulting access is retried
//!   and completes on the zero pages;
//! - the copy that faulted returns [`crate::ShmError::PeerTruncated`] when it sees the mark, and
//!   so does every later access of that mapping;
//! - a SIGBUS anywhere else is handed to the handler that was there before (Rust's own, which
//!   reports stack overflows), or to the default action.
//!
//! Everything the handler does is async-signal-safe: atomic loads and stores on a static table,
//! and raw `mmap`/`sigaction` system calls.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::ShmError;

const SLOTS: usize = 1024;

struct Slot {
    claimed: AtomicBool,
    start: AtomicUsize,
    len: AtomicUsize,
    poisoned: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    claimed: AtomicBool::new(false),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    poisoned: AtomicBool::new(false),
};

static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];

/// The disposition SIGBUS had before ours, to hand foreign faults to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// A registered mapping; unregisters on drop.
#[derive(Debug)]
pub(crate) struct Guard(usize);

impl Guard {
    /// Registers `[start, start + len)`, installing the handler on first use.
    pub(crate) fn register(start: usize, len: usize) -> Result<Self, ShmError> {
        install()?;
        for (i, s) in TABLE.iter().enumerate() {
            if s.claimed
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                s.poisoned.store(false, Ordering::Relaxed);
                s.len.store(len, Ordering::Relaxed);
                // Release: the handler's Acquire load of `start` sees `len` (and the cleared mark).
                s.start.store(start, Ordering::Release);
                return Ok(Self(i));
            }
        }
        Err(ShmError::Os {
            op: "guard a peer's mapping (too many at once)",
            errno: rustix::io::Errno::NOSPC,
        })
    }

    /// Whether the peer truncated the file under this mapping.
    pub(crate) fn poisoned(&self) -> bool {
        // Acquire pairs with the handler's Release store.
        TABLE[self.0].poisoned.load(Ordering::Acquire)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let s = &TABLE[self.0];
        s.start.store(0, Ordering::Release);
        s.len.store(0, Ordering::Relaxed);
        s.claimed.store(false, Ordering::Release);
    }
}

fn install() -> Result<(), ShmError> {
    static INSTALLED: OnceLock<Result<(), rustix::io::Errno>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            // SAFETY: zeroed `sigaction` structs are valid (empty masks, no flags); `sigaction`
            // is given valid pointers to them; the handler below is async-signal-safe.
            unsafe {
                let mut new: libc::sigaction = std::mem::zeroed();
                new.sa_sigaction = on_sigbus as *const () as usize;
                new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut new.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(libc::SIGBUS, &new, &mut old) != 0 {
                    return Err(rustix::io::Errno::from_raw_os_error(
                        std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
                    ));
                }
                let _ = PREVIOUS.set(old);
            }
            Ok(())
        })
        .map_err(|errno| ShmError::Os {
            op: "sigaction(SIGBUS)",
            errno,
        })
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for s in &TABLE {
        // Acquire pairs with the Release in `register`: `len` is the registered one.
        let start = s.start.load(Ordering::Acquire);
        let len = s.len.load(Ordering::Relaxed);
        if start != 0 && addr >= start && addr < start + len {
            // SAFETY: replaces exactly the registered mapping, which its owner keeps reserved
            // until it unregisters; anonymous private pages are always safe to access.
            let r = unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if r != libc::MAP_FAILED {
                s.poisoned.store(true, Ordering::Release);
                return;
            }
        }
    }
    // Not ours: whoever handled SIGBUS before decides.
    match PREVIOUS.get() {
        Some(prev)
            if prev.sa_flags & libc::SA_SIGINFO != 0
                && prev.sa_sigaction != libc::SIG_DFL
                && prev.sa_sigaction != libc::SIG_IGN =>
        {
            // SAFETY: a SA_SIGINFO handler has exactly this signature; we pass on what the
            // kernel gave us.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(prev.sa_sigaction) };
            f(sig, info, ctx);
        }
        _ => {
            // SAFETY: restores the default action; returning re-executes the faulting access,
            // which now terminates the process as it would have without us.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            }
        }
    }
}
