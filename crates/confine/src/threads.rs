//! Landlock on threads that already exist, on kernels that cannot do it for them.
//!
//! A Landlock restriction belongs to each thread, and before Linux 7.0 (Landlock ABI 8's
//! `LANDLOCK_RESTRICT_SELF_TSYNC`) only a thread can restrict itself. A child that started
//! threads before it confined itself (a device model's fault socket, a driver server's
//! vfio-user twin socket) would leave them unrestricted. So each of those threads is asked to
//! do it: a real-time signal, whose handler sets `no_new_privs` and calls
//! `landlock_restrict_self` with the ruleset's descriptor — the way glibc makes `setuid` hold
//! for every thread, and libpsx does for capabilities. Both calls are plain system calls, safe
//! in a signal handler.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, PollFd, PollFlags};

use crate::ConfineError;

/// The ruleset the handler applies (-1: none).
static RULESET: AtomicI32 = AtomicI32::new(-1);
/// Threads that failed to restrict themselves.
static FAILED: AtomicUsize = AtomicUsize::new(0);
/// One broadcast at a time.
static ONE: Mutex<()> = Mutex::new(());
/// What the handler writes to once it has counted itself, so the asking thread sleeps until
/// an answer comes instead of checking every millisecond (a restarted driver server's
/// confinement is on the way to its first completion). Created once and never closed: a
/// handler that runs late writes to it, never to a number reused for something else.
static WAKE: OnceLock<OwnedFd> = OnceLock::new();
/// `WAKE`'s number, for the handler (-1: none).
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);

/// How long the other threads get to answer.
const ANSWER_TIME: Duration = Duration::from_secs(2);
/// How often the asking thread looks for threads that ended without answering (a thread that
/// blocked the signal and then exited never runs the handler: it holds nothing any more, and
/// must not keep the process waiting its whole answer time, then fail).
const ENDED_CHECK: Duration = Duration::from_millis(10);

/// The threads that answered, by id, as the handler records them (the first
/// `RECORDED` of them), and how many answered (with more than that, answers are only counted).
const RECORDED: usize = 256;
static ANSWERED: [AtomicI32; RECORDED] = [const { AtomicI32::new(0) }; RECORDED];
static ANSWERS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn restrict_this_thread(_: libc::c_int) {
    // SAFETY: __errno_location returns this thread's errno slot, valid for its lifetime; it is
    // saved and restored so the interrupted code sees its own errno.
    let errno = unsafe { *libc::__errno_location() };
    let fd = RULESET.load(Ordering::SeqCst);
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS) and landlock_restrict_self take integers only; both
    // are single system calls, async-signal-safe.
    let ok = unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            && libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32) == 0
    };
    // Counted and recorded before the eventfd is written (the asker may see the count a moment
    // before the id, and then looks again on its next wake-up).
    // SAFETY: gettid takes nothing and cannot fail; async-signal-safe.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as i32;
    let slot = ANSWERS.fetch_add(1, Ordering::SeqCst);
    if let Some(a) = ANSWERED.get(slot) {
        a.store(tid, Ordering::SeqCst);
    }
    if !ok {
        FAILED.fetch_add(1, Ordering::SeqCst);
    }
    let wake = WAKE_FD.load(Ordering::SeqCst);
    if wake >= 0 {
        let one = 1u64.to_ne_bytes();
        // SAFETY: write(2) on an eventfd that is never closed (`WAKE`), from a buffer on this
        // stack; async-signal-safe. A full counter (EAGAIN) still leaves it readable.
        unsafe { libc::write(wake, one.as_ptr().cast(), one.len()) };
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// The process's threads other than the calling one.
pub fn other_threads() -> Result<Vec<i32>, ConfineError> {
    let me = rustix::thread::gettid().as_raw_nonzero().get();
    let tasks = std::fs::read_dir("/proc/self/task").map_err(|source| ConfineError::Os {
        what: "/proc/self/task",
        source,
    })?;
    Ok(tasks
        .flatten()
        .filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&t| t != me)
        .collect())
}

/// Has every other thread of the process restrict itself with `ruleset`; returns how many
/// did (a thread that ended meanwhile counts as done: it holds nothing). Threads are listed
/// again after each round, as glibc does for `setuid`, until a listing shows none that was
/// not asked: one started meanwhile by a thread not yet restricted is asked too. An error if
/// one refused or did not answer in time.
pub fn restrict_others(ruleset: BorrowedFd<'_>) -> Result<usize, ConfineError> {
    let mut asked: Vec<i32> = Vec::new();
    loop {
        let new: Vec<i32> = other_threads()?
            .into_iter()
            .filter(|t| !asked.contains(t))
            .collect();
        if new.is_empty() {
            return Ok(asked.len());
        }
        restrict_these(ruleset, &new)?;
        asked.extend(new);
    }
}

/// The eventfd the handler wakes the asking thread with, created on first use; `None` if it
/// cannot be (the asking thread then looks every millisecond, as it used to).
fn wake_fd() -> Option<BorrowedFd<'static>> {
    if WAKE.get().is_none() {
        let fd = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).ok()?;
        // Under `ONE`: nobody else sets it meanwhile.
        let _ = WAKE.set(fd);
    }
    let fd = WAKE.get()?.as_fd();
    WAKE_FD.store(fd.as_raw_fd(), Ordering::SeqCst);
    Some(fd)
}

/// Has each thread in `threads` restrict itself with `ruleset`.
fn restrict_these(ruleset: BorrowedFd<'_>, threads: &[i32]) -> Result<usize, ConfineError> {
    if threads.is_empty() {
        return Ok(0);
    }
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let wake = wake_fd();
    RULESET.store(ruleset.as_raw_fd(), Ordering::SeqCst);
    FAILED.store(0, Ordering::SeqCst);
    ANSWERS.store(0, Ordering::SeqCst);
    let sig = libc::SIGRTMIN();
    let os = |what| move |source| ConfineError::Os { what, source };
    // SAFETY: sigaction with a zeroed struct plus a handler that only makes system calls and
    // touches atomics.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = restrict_this_thread as extern "C" fn(libc::c_int) as usize;
        act.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut act.sa_mask);
        if libc::sigaction(sig, &act, std::ptr::null_mut()) != 0 {
            return Err(os("sigaction")(std::io::Error::last_os_error()));
        }
    }
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    let mut signalled = Vec::with_capacity(threads.len());
    for &tid in threads {
        // SAFETY: tgkill takes integers; the thread group is this process, so the signal can
        // only reach one of its own threads.
        let r = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, sig) };
        if r == 0 {
            signalled.push(tid);
        }
        // ESRCH: the thread ended; it holds nothing any more.
    }
    let asked = signalled.len();
    let start = Instant::now();
    // The handler counts itself before it writes: an answer between the check and the poll
    // leaves the eventfd readable.
    while unanswered(&signalled) > 0 {
        let Some(left) = ANSWER_TIME.checked_sub(start.elapsed()) else {
            break;
        };
        let left = left.min(ENDED_CHECK);
        let ts = rustix::time::Timespec {
            tv_sec: left.as_secs() as _,
            tv_nsec: left.subsec_nanos() as _,
        };
        match wake {
            Some(wake) => {
                let mut p = [PollFd::new(&wake, PollFlags::IN)];
                let _ = rustix::event::poll(&mut p, Some(&ts));
                let mut drained = [0u8; 8];
                let _ = rustix::io::read(wake, &mut drained);
            }
            // No eventfd (the process is at its descriptor limit): look again shortly.
            None => std::thread::sleep(Duration::from_millis(1).min(left)),
        }
    }
    let (missing, failed) = (unanswered(&signalled), FAILED.load(Ordering::SeqCst));
    // Ignored from now on, not reset: a late signal still pending would otherwise take the
    // default action of a real-time signal, which ends the process.
    // SAFETY: SIG_IGN needs no handler.
    unsafe { libc::signal(sig, libc::SIG_IGN) };
    if failed > 0 || missing > 0 {
        return Err(ConfineError::Landlock(format!(
            "{missing} of {asked} older threads did not restrict themselves ({failed} refused)"
        )));
    }
    Ok(threads.len())
}

/// How many of the `signalled` threads have neither answered nor ended. With more threads
/// than the handler records, answers are counted instead (an ended thread then still counts
/// as unanswered).
fn unanswered(signalled: &[i32]) -> usize {
    let answers = ANSWERS.load(Ordering::SeqCst);
    if answers > RECORDED || signalled.len() > RECORDED {
        return signalled.len().saturating_sub(answers);
    }
    let answered: Vec<i32> = ANSWERED[..answers]
        .iter()
        .map(|a| a.load(Ordering::SeqCst))
        .collect();
    signalled
        .iter()
        .filter(|t| !answered.contains(t))
        .filter(|t| std::path::Path::new(&format!("/proc/self/task/{t}")).exists())
        .count()
}
