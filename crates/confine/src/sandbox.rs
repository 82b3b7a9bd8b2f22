//! Landlock: no filesystem access at all, no TCP, no abstract UNIX sockets and no signals
//! beyond the process's own domain.
//!
//! The ruleset handles every access right the kernel knows and grants none. On a kernel
//! without some of them the rest still applies (best effort), and the report says how much
//! holds; the seccomp allow-list forbids the same operations independently.

use landlock::{
    Access, AccessFs, AccessNet, RestrictSelfAttr, Ruleset, RulesetAttr, RulesetStatus, Scope, ABI,
};

use crate::ConfineError;

/// The newest Landlock ABI this code asks for.
const ABI_WANTED: ABI = ABI::V8;

/// What Landlock on this kernel can enforce, in words, and whether that is all of it (ABI 8:
/// every right Outboard asks for, on every thread).
pub fn kernel_support() -> (i64, &'static str) {
    let abi = kernel_abi();
    let what = match abi {
        0 => "no Landlock: children rely on the seccomp filter alone",
        1..=3 => "Landlock without network or scope rules: filesystem only",
        4 | 5 => "Landlock without abstract-socket and signal scopes",
        6 | 7 => {
            "Landlock in full, but only on threads a child starts after confining itself \
                  (older threads get the seccomp filter only)"
        }
        _ => "Landlock in full, on every thread",
    };
    (abi, what)
}

/// The Landlock ABI the running kernel offers (0: none).
pub fn kernel_abi() -> i64 {
    // SAFETY: the version query (flag 1, LANDLOCK_CREATE_RULESET_VERSION) takes a null
    // attribute pointer and size 0; no memory is read or written.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32,
        )
    };
    v.max(0)
}

/// Enforces the ruleset on every thread the kernel lets it reach; returns how much of it
/// holds, in words, and whether that is all of it on every thread.
///
/// The all-threads flag (`LANDLOCK_RESTRICT_SELF_TSYNC`) is asked for only where the kernel
/// has it (ABI 8, Linux 7.0): asked for on an older kernel, the crate drops it and reports
/// the whole ruleset as partly enforced although every right in it holds. Without it, the
/// calling thread and the threads it starts later are restricted, and threads that exist
/// already are not (the seccomp filter, installed on all threads, still forbids them every
/// call that reaches a file or the network).
pub fn restrict() -> Result<(String, bool), ConfineError> {
    let err = |e: landlock::RulesetError| ConfineError::Landlock(e.to_string());
    let abi = kernel_abi();
    let tsync = abi >= ABI::V8 as i64;
    // Counted before restricting: /proc cannot be read afterwards.
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(ABI_WANTED))
        .map_err(err)?
        .handle_access(AccessNet::from_all(ABI_WANTED))
        .map_err(err)?
        .scope(Scope::from_all(ABI_WANTED))
        .map_err(err)?
        .create()
        .map_err(err)?
        .all_threads(tsync)
        .map_err(err)?
        .restrict_self()
        .map_err(err)?;
    let how = match status.ruleset {
        RulesetStatus::FullyEnforced => "fully enforced",
        RulesetStatus::PartiallyEnforced => "partly enforced (an older kernel)",
        RulesetStatus::NotEnforced => "not enforced (no Landlock in this kernel)",
    };
    let all_threads = status.all_threads || threads <= 1;
    let on = if all_threads {
        format!("on all threads (kernel Landlock ABI {abi})")
    } else {
        format!(
            "on this thread and those it starts ({} older threads have the seccomp filter \
             only: kernel Landlock ABI {abi}, all-threads needs ABI 8)",
            threads - 1
        )
    };
    let complete = status.ruleset == RulesetStatus::FullyEnforced && all_threads;
    Ok((format!("{how} {on}"), complete))
}
