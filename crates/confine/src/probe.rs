//! What a compromised driver would try once it runs: each attempt, and whether it worked.

use std::fmt;
use std::path::{Path, PathBuf};

/// What to aim the attempts at.
#[derive(Debug, Clone)]
pub struct Targets {
    /// A file that exists: opening it must fail.
    pub file: PathBuf,
    /// Another device's socket: connecting to it must fail.
    pub socket: PathBuf,
    /// Another process (the supervisor): tracing or signalling it must fail.
    pub pid: u32,
}

/// One attempt and its result: `Err` is how it was refused.
#[derive(Debug)]
pub struct Attempt {
    /// What was tried.
    pub what: String,
    /// `Ok` if it worked (confinement failed), else the error that stopped it.
    pub result: Result<(), std::io::Error>,
}

impl Attempt {
    /// The attempt was refused.
    pub fn denied(&self) -> bool {
        self.result.is_err()
    }
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.result {
            Ok(()) => write!(f, "{}: ALLOWED", self.what),
            Err(e) => write!(f, "{}: denied ({e})", self.what),
        }
    }
}

fn last_error(ret: libc::c_long) -> Result<(), std::io::Error> {
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A call aimed at nothing (descriptor -1): the seccomp filter answers `EPERM` before the
/// kernel looks at the descriptor, so `EPERM` is a refusal; any other answer (`EBADF`) means
/// the call reached the kernel, which on a real descriptor would have acted.
fn filtered(ret: libc::c_long) -> Result<(), std::io::Error> {
    match last_error(ret) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => Err(e),
        _ => Ok(()),
    }
}

/// `ioctl` requests a compromised driver would use on a host object: freeze or flag a file
/// system, take a network interface down, type into a terminal. Aimed at descriptor -1.
pub const DANGEROUS_IOCTLS: &[(&str, libc::c_ulong)] = &[
    ("FIFREEZE", 0xc004_5877),
    ("FS_IOC_SETFLAGS", 0x4008_6602),
    ("SIOCSIFFLAGS", 0x8914),
    ("TIOCSTI", 0x5412),
];

/// `fcntl` commands that reach beyond the descriptor: signals to another process, leases,
/// directory notifications. Aimed at descriptor -1.
pub const DANGEROUS_FCNTLS: &[(&str, libc::c_int)] = &[
    ("F_SETOWN", libc::F_SETOWN),
    // Not in the libc crate; 10 on every Linux architecture.
    ("F_SETSIG", 10),
    ("F_SETLEASE", libc::F_SETLEASE),
    ("F_NOTIFY", libc::F_NOTIFY),
];

/// How many attempts [`attempts`] makes.
pub fn count() -> usize {
    12 + DANGEROUS_IOCTLS.len() + DANGEROUS_FCNTLS.len()
}

/// Makes every attempt, telling `each` the result as it comes (an `execve` that works
/// replaces the process: what came before it is already told). A confined process gets an
/// `Err` for each.
pub fn attempts(t: &Targets, mut each: impl FnMut(&Attempt)) -> Vec<Attempt> {
    let mut out = Vec::new();
    let mut attempt = |what: String, result: Result<(), std::io::Error>| {
        let a = Attempt { what, result };
        each(&a);
        out.push(a);
    };
    attempt(
        format!("open {}", t.file.display()),
        std::fs::File::open(&t.file).map(drop),
    );
    let dir = t.file.parent().unwrap_or(Path::new("/"));
    attempt(
        format!("create a file in {}", dir.display()),
        std::fs::File::create(dir.join("outboard-escape")).map(drop),
    );
    attempt(
        format!("list {}", dir.display()),
        std::fs::read_dir(dir).map(drop),
    );
    attempt(
        format!("connect to {}", t.socket.display()),
        std::os::unix::net::UnixStream::connect(&t.socket).map(drop),
    );
    attempt(
        "create a UNIX socket".into(),
        rustix::net::socket(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            None,
        )
        .map(drop)
        .map_err(Into::into),
    );
    attempt(
        "create a TCP socket".into(),
        std::net::TcpListener::bind("127.0.0.1:0").map(drop),
    );
    attempt(
        format!("ptrace pid {}", t.pid),
        // SAFETY: PTRACE_ATTACH takes no pointers (addr and data are null); on success the
        // tracee merely stops, which the attempt's report makes visible.
        last_error(unsafe {
            libc::ptrace(
                libc::PTRACE_ATTACH,
                t.pid as libc::pid_t,
                std::ptr::null_mut::<libc::c_void>(),
                std::ptr::null_mut::<libc::c_void>(),
            )
        }),
    );
    attempt(
        format!("signal pid {}", t.pid),
        rustix::process::test_kill_process(
            rustix::process::Pid::from_raw(t.pid as i32).expect("a pid"),
        )
        .map_err(Into::into),
    );
    attempt(
        "stat / (learn what exists by path)".into(),
        rustix::fs::stat("/").map(drop).map_err(Into::into),
    );
    for (name, request) in DANGEROUS_IOCTLS {
        attempt(
            format!("ioctl {name} (on fd -1)"),
            filtered(
                // SAFETY: descriptor -1 is no object: the call can only be refused (EPERM by
                // the filter) or fail (EBADF); the null argument is never read.
                unsafe { libc::ioctl(-1, *request, std::ptr::null_mut::<libc::c_void>()) }.into(),
            ),
        );
    }
    for (name, cmd) in DANGEROUS_FCNTLS {
        attempt(
            format!("fcntl {name} (on fd -1)"),
            // SAFETY: descriptor -1 is no object; the integer argument is no pointer.
            filtered(unsafe { libc::fcntl(-1, *cmd, 0) }.into()),
        );
    }
    attempt(
        "start a process (/bin/true)".into(),
        std::process::Command::new("/bin/true").status().map(drop),
    );
    attempt("execve /bin/true".into(), {
        let path = c"/bin/true";
        let argv = [path.as_ptr(), std::ptr::null()];
        // SAFETY: `path` is NUL-terminated and `argv` a NULL-terminated array of such
        // strings, both alive across the call. If it succeeded, this process would become
        // /bin/true, and the missing report lines would show it.
        last_error(unsafe { libc::execv(path.as_ptr(), argv.as_ptr()) }.into())
    });
    attempt("map executable memory".into(), {
        // SAFETY: an anonymous private mapping at an address the kernel picks aliases no
        // existing memory; it is unmapped at once if it is made.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            Err(std::io::Error::last_os_error())
        } else {
            // SAFETY: `p` is the 4096-byte mapping just made, used by nothing.
            unsafe { libc::munmap(p, 4096) };
            Ok(())
        }
    });
    out
}
