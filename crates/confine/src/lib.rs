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
//! A process may also be confined early ([`confine_early`]), before it opens its device, and
//! finish once it has ([`Early::finish`]): a standby driver server pays for its confinement
//! while it waits, not on a restart's path.
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

impl Report {
    fn of(
        role: Role,
        syscalls: usize,
        landlock: String,
        landlock_complete: bool,
        limits: limits::Limits,
    ) -> Self {
        Self {
            syscalls,
            ioctls: syscalls::ioctls(role).len(),
            landlock_complete,
            landlock,
            limits,
        }
    }
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
    Ok(Report::of(
        role,
        syscalls,
        landlock,
        landlock_complete,
        limits,
    ))
}

/// A process confined early as its role, waiting to [`Early::finish`].
#[derive(Debug)]
#[must_use = "an early confinement still lets the process start threads until it finishes"]
pub struct Early {
    role: Role,
    limits: limits::Limits,
    landlock: String,
    landlock_complete: bool,
}

/// Confines the calling process as `role` ahead of need — before it has opened its device —
/// so that what it costs (Landlock, the kernel compiling the allow-list) is off the path of
/// a restart: a standby driver server does it while it waits. Until [`Early::finish`] the
/// process may also start threads, name them and lower its own limits
/// ([`syscalls::early_extras`]); everything else is as [`confine`] leaves it. Only for a role
/// whose own list has none of those calls (not an export).
pub fn confine_early(role: Role, caps: limits::Caps) -> Result<Early, ConfineError> {
    privileges::drop_capabilities()?;
    let limits = limits::apply(caps, true)?;
    let (landlock, landlock_complete) = sandbox::restrict()?;
    syscalls::install_early(role)?;
    Ok(Early {
        role,
        limits,
        landlock,
        landlock_complete,
    })
}

impl Early {
    /// Ends what the early confinement still allowed: `RLIMIT_NPROC` to 0 and a second filter
    /// of a few instructions that refuses the extra calls. From here the process is held as
    /// [`confine`] would hold it.
    pub fn finish(self) -> Result<Report, ConfineError> {
        // No role that starts threads once confined gets here (`early_program` refuses
        // them), so processes and threads end for every one that does.
        let limits = limits::no_processes(self.limits)?;
        let syscalls = syscalls::install_finish(self.role)?;
        Ok(Report::of(
            self.role,
            syscalls,
            self.landlock,
            self.landlock_complete,
            limits,
        ))
    }
}
