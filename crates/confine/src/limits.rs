//! Resource limits and process attributes set before the allow-list forbids changing them.

use std::fmt;

use crate::ConfineError;

/// Most descriptors a confined process may hold: its sessions' sockets, eventfds and memory
/// areas fit many times over; a leak stops here instead of at the system's limit.
pub const MAX_FILES: u64 = 4096;

/// What a confined process may hold, as asked for (each only ever lowered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Most descriptors (`RLIMIT_NOFILE`), at most [`MAX_FILES`].
    pub files: u64,
    /// Most bytes of address space (`RLIMIT_AS`); `None` leaves it as it is.
    pub memory: Option<u64>,
}

impl Default for Caps {
    fn default() -> Self {
        Self {
            files: MAX_FILES,
            memory: None,
        }
    }
}

/// The limits in force after [`apply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `RLIMIT_NOFILE`.
    pub files: u64,
    /// `RLIMIT_AS`, if limited.
    pub memory: Option<u64>,
    /// Whether `RLIMIT_NPROC` is 0 (not for a role that starts threads: a thread counts).
    pub no_processes: bool,
}

impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rlimits nofile={}", self.files)?;
        if let Some(m) = self.memory {
            write!(f, " as={m}")?;
        }
        if self.no_processes {
            write!(f, " nproc=0")?;
        }
        write!(f, " core=0")
    }
}

fn os(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> ConfineError {
    move |e| ConfineError::Os {
        what,
        source: e.into(),
    }
}

/// Lowers the limits (never raises them) and sets `no_new_privs` and not-dumpable.
///
/// `nproc = 0` stops `fork` for an unprivileged user (the allow-list stops it for root),
/// unless the process must still start threads (`threads`: the kernel counts them too, and
/// the allow-list then admits only `clone` of a thread);
/// `core = 0` and not-dumpable keep a crashed driver's memory (client data) out of core
/// files and away from `ptrace` by processes of the same user.
pub fn apply(caps: Caps, threads: bool) -> Result<Limits, ConfineError> {
    use rustix::process::Resource;
    let files = lower(Resource::Nofile, caps.files.min(MAX_FILES), "RLIMIT_NOFILE")?;
    let memory = caps
        .memory
        .map(|m| lower(Resource::As, m, "RLIMIT_AS"))
        .transpose()?;
    let limits = Limits {
        files,
        memory,
        no_processes: false,
    };
    let limits = if threads {
        limits
    } else {
        no_processes(limits)?
    };
    lower(Resource::Core, 0, "RLIMIT_CORE")?;
    rustix::thread::set_no_new_privs(true).map_err(os("PR_SET_NO_NEW_PRIVS"))?;
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(os("PR_SET_DUMPABLE"))?;
    Ok(limits)
}

/// `RLIMIT_NPROC` to 0: no more processes, and no more threads for an unprivileged user
/// (what [`apply`] does for a role that starts no threads; an early confinement does it when
/// it finishes, once its threads are started).
pub fn no_processes(limits: Limits) -> Result<Limits, ConfineError> {
    lower(rustix::process::Resource::Nproc, 0, "RLIMIT_NPROC")?;
    Ok(Limits {
        no_processes: true,
        ..limits
    })
}

/// Lowers limit `r` to `to` (soft and hard), never raising it; returns the soft limit now.
fn lower(r: rustix::process::Resource, to: u64, what: &'static str) -> Result<u64, ConfineError> {
    use rustix::process::{getrlimit, setrlimit, Rlimit};
    let now = getrlimit(r);
    let cap = |v: Option<u64>| Some(v.map_or(to, |v| v.min(to)));
    let new = Rlimit {
        current: cap(now.current),
        maximum: cap(now.maximum),
    };
    setrlimit(r, new).map_err(os(what))?;
    Ok(new.current.unwrap_or(to))
}
