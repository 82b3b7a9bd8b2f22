//! Least privilege for the processes that touch devices: driver servers and device models.
//!
//! Such a process opens what it needs while it starts (its device connection, its listening
//! socket, its backing) and then calls [`confine`]. From then on it holds only the
//! descriptors it has, and:
//!
//! - a seccomp allow-list ([`syscalls`]) answers every other system call with `EPERM`: no
//!   `open`, no `socket`, `connect` or `bind`, no `clone`, no `execve`, no `ptrace`, no
//!   `kill` (a signal only to itself), no executable mappings;
//! - Landlock ([`sandbox`]) leaves it no filesystem access, no TCP, no abstract UNIX socket
//!   outside its domain and no signals outside it, as far as the kernel supports;
//! - `no_new_privs` is set, the process is not dumpable (no core files, no ptrace by peers),
//!   and resource limits cap what it can still create ([`limits`]).
//!
//! [`probe`] tries what a compromised driver would and reports each attempt's result; the
//! tests and `--check-confinement` use it.

pub mod limits;
pub mod privileges;
pub mod probe;
pub mod sandbox;
pub mod syscalls;
pub mod threads;

use std::fmt;

/// Why confinement could not be applied. A process that asked to be confined and gets this
/// must not go on serving.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    /// Setting a resource limit or a process attribute failed.
    #[error("confine: {what}: {source}")]
    Os {
        /// The step.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// Building or loading the seccomp filter failed.
    #[error("confine: seccomp: {0}")]
    Seccomp(String),
    /// Creating or enforcing the Landlock ruleset failed.
    #[error("confine: landlock: {0}")]
    Landlock(String),
}

pub use syscalls::Role;

/// What [`confine`] applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// System calls on the allow-list.
    pub syscalls: usize,
    /// `ioctl` requests allowed.
    pub ioctls: usize,
    /// Whether the kernel enforces all of the Landlock ruleset, on every thread.
    pub landlock_complete: bool,
    /// How much of the Landlock ruleset the kernel enforces.
    pub landlock: String,
    /// The resource limits now in force.
    pub limits: limits::Limits,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "confined: seccomp allow-list of {} system calls (others fail with EPERM; ioctl: \
             {} requests, fcntl: {} commands), landlock {}, no capabilities, no_new_privs, \
             not dumpable, {}",
            self.syscalls,
            self.ioctls,
            syscalls::FCNTLS.len(),
            self.landlock,
            self.limits
        )
    }
}

/// Confines the calling process, all its threads, for good, as `role`.
///
/// Order matters: capabilities, limits and attributes first (they need `prctl`, `capset` and
/// `setrlimit`, which the allow-list then forbids), Landlock next (its own system calls are
/// not on the list), the seccomp filter last. Capabilities are per thread: a process that
/// starts threads before this calls [`privileges::drop_privileges`] first thing.
pub fn confine(role: Role, caps: limits::Caps) -> Result<Report, ConfineError> {
    privileges::drop_capabilities()?;
    let limits = limits::apply(caps, role.starts_threads())?;
    let (landlock, landlock_complete) = sandbox::restrict()?;
    let syscalls = syscalls::install(role)?;
    Ok(Report {
        syscalls,
        ioctls: syscalls::ioctls(role).len(),
        landlock_complete,
        landlock,
        limits,
    })
}
