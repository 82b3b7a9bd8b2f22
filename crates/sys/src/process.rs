//! Process plumbing: children that die with their parent, descriptors passed across exec,
//! the default SIGPIPE action. The `unsafe` that such plumbing needs lives here, each block with
//! the reason it is sound.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use rustix::io::{Errno, FdFlags};
use rustix::process::Signal;

/// Makes the child of `cmd` die (SIGKILL) when this process dies, even by SIGKILL, and, if
/// `pass` is given, find that descriptor as fd `at` (without close-on-exec). No other
/// descriptor of this process reaches the child beyond its standard three. The caller keeps
/// `pass` open until the child is spawned.
pub fn die_with_parent(cmd: &mut Command, pass: Option<(BorrowedFd<'_>, i32)>) {
    let parent = rustix::process::getpid();
    let pass = pass.map(|(fd, at)| (fd.as_raw_fd(), at));
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-
    // safe calls are allowed; it makes raw system calls only (prctl, getppid, dup2 or fcntl on
    // a descriptor the caller keeps open until after the spawn, close_range) and allocates
    // nothing.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
            // The parent may have died before the line above took effect.
            if rustix::process::getppid() != Some(parent) {
                return Err(Errno::SRCH.into());
            }
            if let Some((raw, at)) = pass {
                let fd = BorrowedFd::borrow_raw(raw);
                if raw == at {
                    // Already there: only close-on-exec must go.
                    rustix::io::fcntl_setfd(fd, FdFlags::empty())?;
                } else {
                    // A duplicate made by dup2 does not inherit close-on-exec.
                    if libc::dup2(raw, at) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
            }
            // Everything else this process holds stays here: descriptors inherited from
            // whoever started the manager, other children's channels, disks. Marked
            // close-on-exec rather than closed, so the exec-error pipe still works.
            let first = pass.map_or(3, |(_, at)| at + 1) as libc::c_uint;
            if libc::syscall(
                libc::SYS_close_range,
                first,
                libc::c_uint::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            ) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Takes ownership of fd `n` inherited from the parent, after checking that it is an open
/// socket (what a parent passes for a channel).
pub fn inherited_socket(n: i32) -> Result<OwnedFd, String> {
    inherited(n, rustix::fs::FileType::Socket, "a socket")
}

/// Takes ownership of fd `n` inherited from the parent, after checking that it is an open
/// regular file or memfd (what a parent passes as a disk's backing).
pub fn inherited_file(n: i32) -> Result<OwnedFd, String> {
    inherited(n, rustix::fs::FileType::RegularFile, "a file")
}

fn inherited(n: i32, kind: rustix::fs::FileType, what: &str) -> Result<OwnedFd, String> {
    if n <= 2 {
        return Err(format!("fd {n}: not a descriptor a parent passes"));
    }
    // SAFETY: only borrowed for the checks below; nothing is closed through it.
    let borrowed = unsafe { BorrowedFd::borrow_raw(n) };
    rustix::io::fcntl_getfd(borrowed).map_err(|e| format!("fd {n}: {e}"))?;
    let st = rustix::fs::fstat(borrowed).map_err(|e| format!("fd {n}: {e}"))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != kind {
        return Err(format!("fd {n}: not {what}"));
    }
    // SAFETY: the fd is open (checked above) and was inherited across exec to be owned here:
    // no other owner exists in this process; callers take it once, at start-up.
    let fd = unsafe { OwnedFd::from_raw_fd(n) };
    // Not handed on to anything this process starts.
    rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)
        .map_err(|e| format!("fd {n}: {e}"))?;
    Ok(fd)
}

/// Restores SIGPIPE's default action. Rust starts programs with it ignored, so a command-line
/// tool writing into a closed pipe (`outboard … | head -1`) would panic in `println!`; a Unix
/// filter ends quietly instead. Call it first thing in `main`, before any thread exists.
pub fn restore_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_DFL installs no handler code, so nothing
    // can run in signal context; done before other threads exist.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
