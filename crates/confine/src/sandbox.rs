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

/// Enforces the ruleset on every thread the kernel lets it reach; returns how much of it
/// holds, in words.
pub fn restrict() -> Result<String, ConfineError> {
    let err = |e: landlock::RulesetError| ConfineError::Landlock(e.to_string());
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(ABI_WANTED))
        .map_err(err)?
        .handle_access(AccessNet::from_all(ABI_WANTED))
        .map_err(err)?
        .scope(Scope::from_all(ABI_WANTED))
        .map_err(err)?
        .create()
        .map_err(err)?
        .all_threads(true)
        .map_err(err)?
        .restrict_self()
        .map_err(err)?;
    let how = match status.ruleset {
        RulesetStatus::FullyEnforced => "fully enforced",
        RulesetStatus::PartiallyEnforced => "partly enforced (an older kernel)",
        RulesetStatus::NotEnforced => "not enforced (no Landlock in this kernel)",
    };
    let threads = if status.all_threads {
        "all threads"
    } else {
        "the main thread"
    };
    Ok(format!("{how} on {threads}"))
}
