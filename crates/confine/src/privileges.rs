//! Capabilities and identity: a confined process keeps no capability in any set, and runs as
//! an unprivileged user where one is given.
//!
//! Capabilities belong to each thread, so they are dropped first thing, before the process
//! starts a thread: every thread it ever has then starts without them. What a role needed a
//! capability for is arranged before the drop: a driver server that maps DMA through VFIO
//! gets `RLIMIT_MEMLOCK` raised (what `CAP_IPC_LOCK` would have waived).

use crate::ConfineError;

fn os(what: &'static str) -> impl FnOnce(std::io::Error) -> ConfineError {
    move |source| ConfineError::Os { what, source }
}

fn last_error(ret: libc::c_long) -> std::io::Result<()> {
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A user to run as: ids, resolved before any privilege is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct User {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
}

impl std::fmt::Display for User {
    /// `UID:GID`, which [`std::str::FromStr`] reads back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.uid, self.gid)
    }
}

impl std::str::FromStr for User {
    type Err = String;

    /// `UID:GID`, or a user name from /etc/passwd (its primary group).
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some((u, g)) = s.split_once(':') {
            if let (Ok(uid), Ok(gid)) = (u.parse(), g.parse()) {
                return Ok(Self { uid, gid });
            }
        }
        let passwd =
            std::fs::read_to_string("/etc/passwd").map_err(|e| format!("/etc/passwd: {e}"))?;
        passwd
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                Some((
                    *f.first()?,
                    f.get(2)?.parse().ok()?,
                    f.get(3)?.parse().ok()?,
                ))
            })
            .find(|(name, _, _)| *name == s)
            .map(|(_, uid, gid)| Self { uid, gid })
            .ok_or_else(|| format!("no user {s:?} (give a name from /etc/passwd or UID:GID)"))
    }
}

/// What [`drop_privileges`] did, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// The user it now runs as.
    pub uid: u32,
    /// Its `RLIMIT_MEMLOCK`, if raised.
    pub memlock: Option<u64>,
}

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no capabilities (all five sets empty), uid {}", self.uid)?;
        if let Some(m) = self.memlock {
            write!(f, ", memlock {m} bytes")?;
        }
        Ok(())
    }
}

/// Raises `RLIMIT_MEMLOCK` to `memlock` (if given), becomes `user` (if given: supplementary
/// groups cleared, then group, then user), and drops every capability: the bounding and
/// ambient sets for the process's future, the effective, permitted and inheritable sets of
/// the calling thread. Call it before the process starts any thread.
pub fn drop_privileges(user: Option<User>, memlock: Option<u64>) -> Result<Dropped, ConfineError> {
    if let Some(bytes) = memlock {
        let l = rustix::process::Rlimit {
            current: Some(bytes),
            maximum: Some(bytes),
        };
        // Raising needs CAP_SYS_RESOURCE, which is about to go; an unprivileged start keeps
        // what it was given.
        if let Err(e) = rustix::process::setrlimit(rustix::process::Resource::Memlock, l) {
            if rustix::process::geteuid().is_root() {
                return Err(os("RLIMIT_MEMLOCK")(e.into()));
            }
        }
    }
    // Before the user changes: dropping from the bounding set needs CAP_SETPCAP.
    drop_bounding_and_ambient()?;
    if let Some(u) = user {
        // SAFETY: setgroups with a count of 0 reads no memory; setresgid/setresuid take ids.
        unsafe {
            last_error(libc::setgroups(0, std::ptr::null()).into()).map_err(os("setgroups"))?;
            last_error(libc::setresgid(u.gid, u.gid, u.gid).into()).map_err(os("setresgid"))?;
            last_error(libc::setresuid(u.uid, u.uid, u.uid).into()).map_err(os("setresuid"))?;
        }
    }
    drop_capabilities()?;
    Ok(Dropped {
        uid: rustix::process::geteuid().as_raw(),
        memlock,
    })
}

/// Empties the bounding and ambient sets (for the process's future) and the effective,
/// permitted and inheritable sets of the calling thread; checks that none is left.
pub fn drop_capabilities() -> Result<(), ConfineError> {
    drop_bounding_and_ambient()?;
    clear_thread_sets()
}

/// Empties the bounding set (as far as this process may: it needs CAP_SETPCAP) and the
/// ambient set.
fn drop_bounding_and_ambient() -> Result<(), ConfineError> {
    // The bounding set: nothing can come back through an exec of a set-uid or file-capable
    // program (which no_new_privs and the allow-list also stop). Needs CAP_SETPCAP, which a
    // process without it does not have to drop anything with.
    let last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<libc::c_ulong>().ok())
        .unwrap_or(63);
    for cap in 0..=last {
        // SAFETY: PR_CAPBSET_DROP takes a capability number and no pointers.
        let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
        match last_error(r.into()) {
            Ok(()) => {}
            // Past the kernel's last capability.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
            // Without CAP_SETPCAP the set cannot shrink (an unprivileged start, or a second
            // call): nothing in it can be used once the three sets below are empty and
            // no_new_privs is set.
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => break,
            Err(e) => return Err(os("PR_CAPBSET_DROP")(e)),
        }
    }
    // SAFETY: PR_CAP_AMBIENT_CLEAR_ALL takes no pointers.
    let r = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    last_error(r.into()).map_err(os("PR_CAP_AMBIENT_CLEAR_ALL"))?;
    Ok(())
}

/// Empties the calling thread's effective, permitted and inheritable sets, and checks.
fn clear_thread_sets() -> Result<(), ConfineError> {
    let none = rustix::thread::CapabilitySets {
        effective: rustix::thread::CapabilitySet::empty(),
        permitted: rustix::thread::CapabilitySet::empty(),
        inheritable: rustix::thread::CapabilitySet::empty(),
    };
    rustix::thread::set_capabilities(None, none).map_err(|e| os("capset")(e.into()))?;
    let now = rustix::thread::capabilities(None).map_err(|e| os("capget")(e.into()))?;
    if !(now.effective.is_empty() && now.permitted.is_empty() && now.inheritable.is_empty()) {
        return Err(ConfineError::Os {
            what: "capabilities",
            source: std::io::Error::other("a capability survived the drop"),
        });
    }
    Ok(())
}
