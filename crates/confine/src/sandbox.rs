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
            "Landlock in full, on every thread (those started before confinement restrict \
             themselves on a signal)"
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

/// Enforces the ruleset on every thread; returns how much of it holds, in words, and whether
/// that is all of it on every thread.
///
/// Where the kernel has the all-threads flag (`LANDLOCK_RESTRICT_SELF_TSYNC`, ABI 8, Linux
/// 7.0) it does it; before that, each thread that exists already is asked to restrict itself
/// ([`crate::threads`]), and the calling thread does so last (after that it could not list
/// the others in `/proc`). Threads started later inherit the restriction.
pub fn restrict() -> Result<(String, bool), ConfineError> {
    let err = |e: landlock::RulesetError| ConfineError::Landlock(e.to_string());
    let abi = kernel_abi();
    let tsync = abi >= ABI::V8 as i64;
    let created = Ruleset::default()
        .handle_access(AccessFs::from_all(ABI_WANTED))
        .map_err(err)?
        .handle_access(AccessNet::from_all(ABI_WANTED))
        .map_err(err)?
        .scope(Scope::from_all(ABI_WANTED))
        .map_err(err)?
        .create()
        .map_err(err)?;
    let mut others = 0;
    if !tsync {
        let fd: Option<std::os::fd::OwnedFd> = created
            .try_clone()
            .map_err(|source| ConfineError::Os {
                what: "landlock ruleset",
                source,
            })?
            .into();
        // Without Landlock there is no ruleset, and nothing to ask other threads to do.
        if let Some(fd) = fd {
            others = crate::threads::restrict_others(std::os::fd::AsFd::as_fd(&fd))?;
        }
    }
    let status = created
        .all_threads(tsync)
        .map_err(err)?
        .restrict_self()
        .map_err(err)?;
    let how = match status.ruleset {
        RulesetStatus::FullyEnforced => "fully enforced",
        RulesetStatus::PartiallyEnforced => "partly enforced (an older kernel)",
        RulesetStatus::NotEnforced => "not enforced (no Landlock in this kernel)",
    };
    let on = if status.all_threads {
        format!("on all threads (kernel Landlock ABI {abi})")
    } else {
        format!(
            "on all threads ({others} older threads restricted themselves on a signal; kernel \
             Landlock ABI {abi})"
        )
    };
    let complete = status.ruleset == RulesetStatus::FullyEnforced;
    Ok((format!("{how} {on}"), complete))
}
