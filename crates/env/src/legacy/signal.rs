//! The stop signal: how an interrupt reaches a thread that is in a legacy driver (contested
//! delivery). The interrupt thread sends it to the process-lock holder with `tgkill`; the
//! handler finds the CPU the thread is in (a thread-local pointer) and takes the interrupt
//! there, on the thread's own stack, as a CPU would between two instructions.
//!
//! This is one of the few modules with `unsafe`: installing a signal handler and sending a
//! signal to one thread are C calls, and the handler reads a raw pointer.

use std::cell::Cell;
use std::sync::Once;

use super::Cpu;

/// The signal that stops a thread in a legacy driver to run an interrupt: SIGRTMIN + 5, past
/// the real-time signals glibc keeps for itself and those Outboard uses elsewhere.
pub static STOP_SIGNAL: std::sync::LazyLock<i32> =
    std::sync::LazyLock::new(|| libc::SIGRTMIN() + 5);

thread_local! {
    /// The CPU this thread has entered or is entering (null: none). A plain pointer in a
    /// const-initialised cell: reading it in a signal handler touches no lock and no lazy
    /// initialisation.
    static CURRENT: Cell<*const Cpu> = const { Cell::new(std::ptr::null()) };
}

/// Records the CPU the calling thread enters (null when it has left). The pointer must stay
/// valid until it is cleared: [`super::Inside`] holds the `Arc` that owns it.
pub(super) fn set_current(cpu: *const Cpu) {
    CURRENT.with(|c| c.set(cpu));
}

/// Makes `cpu` the thread's current CPU, returning the one before (to put back).
pub(super) fn swap_current(cpu: *const Cpu) -> *const Cpu {
    CURRENT.with(|c| c.replace(cpu))
}

/// The CPU the thread has entered, if any.
pub(super) fn current<'a>() -> Option<&'a Cpu> {
    let cpu = CURRENT.with(Cell::get);
    // SAFETY: a non-null CURRENT points at a CPU kept alive by an `Arc` for as long as it is
    // set (see `set_current`; the interrupt thread sets it only around a call that borrows the
    // CPU). The reference is used by the caller within that span: `with_current` hands it to
    // a closure and drops it.
    (!cpu.is_null()).then(|| unsafe { &*cpu })
}

static INSTALL: Once = Once::new();

/// Installs the stop signal's handler for the process (once).
pub(super) fn install() {
    INSTALL.call_once(|| {
        // SAFETY: `sigaction` is given a zeroed (valid, empty) action whose handler is an
        // `extern "C" fn(c_int)` with the signature SA_SIGINFO-less handlers have; the mask
        // set is initialised by `sigemptyset` before use. SA_RESTART resumes the calls that
        // can be resumed (a read or write without a time-out); others return EINTR.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_stop as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            let rc = libc::sigaction(*STOP_SIGNAL, &action, std::ptr::null_mut());
            assert_eq!(
                rc,
                0,
                "installing the legacy model's stop signal: {}",
                std::io::Error::last_os_error()
            );
        }
    });
}

/// Unblocks the stop signal in the calling thread (a thread that blocked it, even after an
/// earlier entry, would never take a contested interrupt). One system call per entry.
pub(super) fn unblock() {
    // SAFETY: the set is initialised by `sigemptyset` before `sigaddset` and the call;
    // `pthread_sigmask` changes only the calling thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, *STOP_SIGNAL);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }
}

/// Sends the stop signal to thread `tid` of this process. Fails if there is no such thread.
pub(super) fn stop(tid: u32) -> std::io::Result<()> {
    // SAFETY: tgkill takes plain integers; the thread group is this process, so the signal can
    // only reach one of our own threads (a tid recycled by another process is not ours).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_tgkill,
            libc::getpid(),
            tid as libc::pid_t,
            *STOP_SIGNAL,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

extern "C" fn on_stop(_signal: libc::c_int) {
    // The handler may make system calls (a wakeup's futex): the interrupted code's errno is
    // put back as it was.
    // SAFETY: `__errno_location` returns this thread's errno slot, valid for its lifetime.
    let errno = unsafe { *libc::__errno_location() };
    let cpu = CURRENT.with(Cell::get);
    if !cpu.is_null() {
        // SAFETY: a non-null CURRENT points at a CPU the thread's `Inside` guard (or the
        // caller of `enter`, for the moment before the guard exists) keeps alive through an
        // `Arc`; it is cleared before that `Arc` is dropped.
        unsafe { &*cpu }.interrupted();
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}
