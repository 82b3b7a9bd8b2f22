//! Claiming a UNIX socket path.
//!
//! `bind(2)` fails with `EADDRINUSE` when anything exists at the path, so servers habitually
//! unlink the path first. Done blindly that deletes whatever is there: a user's file given by
//! mistake (`--socket machine.toml`), or the live socket of another server, which then keeps
//! running unreachable while the newcomer takes over its name. The rules here:
//!
//! - nothing at the path: bind;
//! - a socket nobody accepts on (`connect` answers `ECONNREFUSED`): stale, left by a process that
//!   died; unlink it and bind;
//! - a socket someone accepts on: refuse ([`SockPathError::InUse`]);
//! - anything else (a regular file, a directory, a symlink, a FIFO): refuse
//!   ([`SockPathError::NotASocket`]), touching nothing.
//!
//! The socket is bound under a private name beside the path and renamed to it once it
//! listens, so whoever sees the path can connect at once.
//!
//! The bound socket's identity (device and inode) is remembered, so [`SocketPath`] removes the
//! path on drop only while it still names *our* socket: a server that lost its path to someone
//! else does not delete theirs.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, Stat};
use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

/// Why a socket path could not be claimed.
#[derive(Debug, thiserror::Error)]
pub enum SockPathError {
    /// Something that is not a socket is at the path; it was left alone.
    #[error("{path}: refusing to replace {kind} with a socket")]
    NotASocket {
        /// The path.
        path: String,
        /// What is there ("a regular file", "a directory", …).
        kind: &'static str,
    },
    /// A live server accepts connections on the path.
    #[error("{path}: already in use by a running server")]
    InUse {
        /// The path.
        path: String,
    },
    /// The system refused an operation.
    #[error("{path}: {op}: {errno}")]
    Os {
        /// The path.
        path: String,
        /// The operation.
        op: &'static str,
        /// Why.
        errno: Errno,
    },
}

fn kind_of(st: &Stat) -> &'static str {
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => "a regular file",
        FileType::Directory => "a directory",
        FileType::Symlink => "a symbolic link",
        FileType::Fifo => "a FIFO",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Socket => "a socket",
        FileType::Unknown => "an unknown kind of file",
    }
}

/// A socket path this process bound; removed on drop if it still names that socket.
#[derive(Debug)]
pub struct SocketPath {
    path: PathBuf,
    /// An `O_PATH` handle on the socket's inode. Holding it keeps the inode allocated, so its
    /// number cannot be reused by a newer socket at the path (file systems reuse freed inode
    /// numbers at once, and change times are too coarse to tell two sockets apart).
    inode: OwnedFd,
}

fn same_file(a: &Stat, b: &Stat) -> bool {
    a.st_dev == b.st_dev && a.st_ino == b.st_ino
}

impl SocketPath {
    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the path still names the socket we bound.
    pub fn still_ours(&self) -> bool {
        rustix::fs::lstat(&self.path)
            .ok()
            .zip(rustix::fs::fstat(&self.inode).ok())
            .is_some_and(|(at_path, ours)| same_file(&at_path, &ours))
    }
}

impl Drop for SocketPath {
    fn drop(&mut self) {
        if self.still_ours() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Whether a process is bound to the socket at `addr`, asked without making a connection: a
/// datagram `connect` to a stream or seqpacket socket answers `EPROTOTYPE` when someone is bound
/// and `ECONNREFUSED` when the socket is stale, and never reaches the server's `accept`.
fn probe(addr: &SocketAddrUnix) -> Result<bool, Errno> {
    let s = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    match rustix::net::connect(&s, addr) {
        Ok(()) | Err(Errno::PROTOTYPE) | Err(Errno::AGAIN) => Ok(true),
        Err(Errno::CONNREFUSED) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether `path` is a socket some process is bound to (a server that is up).
pub fn is_live(path: &Path) -> bool {
    let is_socket = rustix::fs::lstat(path)
        .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Socket);
    is_socket
        && SocketAddrUnix::new(path)
            .ok()
            .is_some_and(|a| probe(&a).unwrap_or(false))
}

/// A non-blocking connection of type `kind` to the UNIX socket at `path`, made without
/// waiting: a listener whose backlog is full answers `EAGAIN` instead of holding the caller.
pub fn connect_now(path: &Path, kind: SocketType) -> rustix::io::Result<OwnedFd> {
    let fd = rustix::net::socket_with(
        rustix::net::AddressFamily::UNIX,
        kind,
        rustix::net::SocketFlags::NONBLOCK | rustix::net::SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::connect(&fd, &SocketAddrUnix::new(path)?)?;
    Ok(fd)
}

/// The mode every socket file is created with: its owner only (the manager and its children
/// run as one user; clients of another user are refused).
pub const SOCKET_MODE: u32 = 0o600;

/// Binds and listens on a UNIX socket of type `kind` at `path`, following the module's rules;
/// the socket file has mode [`SOCKET_MODE`] whatever the umask.
pub fn bind_listener(
    path: &Path,
    kind: SocketType,
    backlog: i32,
) -> Result<(OwnedFd, SocketPath), SockPathError> {
    let shown = || path.display().to_string();
    let os = |op, errno| SockPathError::Os {
        path: shown(),
        op,
        errno,
    };
    let addr = SocketAddrUnix::new(path).map_err(|e| os("address", e))?;
    let socket = || rustix::net::socket_with(AddressFamily::UNIX, kind, SocketFlags::CLOEXEC, None);
    match rustix::fs::lstat(path) {
        Err(Errno::NOENT) => {}
        Err(e) => return Err(os("stat", e)),
        Ok(st) if FileType::from_raw_mode(st.st_mode) != FileType::Socket => {
            return Err(SockPathError::NotASocket {
                path: shown(),
                kind: kind_of(&st),
            })
        }
        Ok(_) => match probe(&addr) {
            // Nobody is bound: the owner died. Only such a socket is ours to replace.
            Ok(false) => std::fs::remove_file(path)
                .map_err(|e| os("unlink", Errno::from_io_error(&e).unwrap_or(Errno::IO)))?,
            Ok(true) => return Err(SockPathError::InUse { path: shown() }),
            Err(e) => return Err(os("connect", e)),
        },
    }
    let fd = socket().map_err(|e| os("socket", e))?;
    // The file bind creates takes its mode from the socket's inode, less the umask: set it
    // here, so the socket is born owner-only whatever the umask, with no window in which
    // another user could connect.
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(SOCKET_MODE)).map_err(|e| os("fchmod", e))?;
    // Bound under a private name and renamed into place once it listens: a client that waits
    // for the path and connects as soon as it is there is never refused (bound at the path
    // itself, a connect between `bind` and `listen` is).
    let private = private_name(path);
    let at = private.as_deref().unwrap_or(path);
    let addr_at = SocketAddrUnix::new(at).map_err(|e| os("address", e))?;
    rustix::net::bind(&fd, &addr_at).map_err(|e| match e {
        // Someone bound it between our check and our bind.
        Errno::ADDRINUSE if private.is_none() => SockPathError::InUse { path: shown() },
        e => os("bind", e),
    })?;
    let published = publish(&fd, at, path, private.is_some(), backlog);
    if published.is_err() && private.is_some() {
        let _ = std::fs::remove_file(at);
    }
    let inode = published.map_err(|(op, e)| match (op, e) {
        // Someone bound the path between our check and our rename.
        ("rename", Errno::EXIST) => SockPathError::InUse { path: shown() },
        (op, e) => os(op, e),
    })?;
    Ok((
        fd,
        SocketPath {
            path: path.to_owned(),
            inode,
        },
    ))
}

/// A name beside `path` for this process to bind before the socket listens, or `None` if
/// none fits in a socket address (the path is then bound directly). The kernel keeps the name
/// bound as the socket's address (`ss -x`, `/proc/net/unix` show it), so it carries the
/// path's own file name where that fits: `.control.sock.1234.0` beside `control.sock`.
fn private_name(path: &Path) -> Option<PathBuf> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let tag = format!(
        "{}.{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let own = path
        .file_name()
        .map(|n| path.with_file_name(format!(".{}.{tag}", n.to_string_lossy())));
    own.into_iter()
        .chain([path.with_file_name(format!(".{tag}"))])
        .find(|p| SocketAddrUnix::new(p).is_ok())
}

/// Holds the inode of the socket bound at `at`, listens, and (if `at` is a private name)
/// renames it to `path`, never over anything there. Returns the inode handle, or the
/// operation that failed.
fn publish(
    fd: &OwnedFd,
    at: &Path,
    path: &Path,
    renamed: bool,
    backlog: i32,
) -> Result<OwnedFd, (&'static str, Errno)> {
    let inode = rustix::fs::open(
        at,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| ("open", e))?;
    rustix::net::listen(fd, backlog).map_err(|e| ("listen", e))?;
    if renamed {
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        match renameat_with(CWD, at, CWD, path, RenameFlags::NOREPLACE) {
            Ok(()) => {}
            // A file system without RENAME_NOREPLACE: a hard link is as atomic, and as
            // unwilling to replace.
            Err(Errno::INVAL) => {
                rustix::fs::link(at, path).map_err(|e| ("rename", e))?;
                let _ = rustix::fs::unlink(at);
            }
            Err(e) => return Err(("rename", e)),
        }
    }
    Ok(inode)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bind(path: &Path) -> Result<(OwnedFd, SocketPath), SockPathError> {
        bind_listener(path, SocketType::SEQPACKET, 4)
    }

    #[test]
    fn a_socket_is_owner_only_whatever_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        // A child process with umask 0 binds: this process's umask is left alone.
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg("umask 000; exec \"$0\" --exact --nocapture sockpath::tests::bind_here_if_asked")
            .arg(std::env::current_exe().unwrap())
            .env("OUTBOARD_TEST_BIND", &path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let mode = std::fs::symlink_metadata(&path)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o600, "{mode:o}");
    }

    /// Binds at `$OUTBOARD_TEST_BIND` when run by the test above (a no-op otherwise).
    #[test]
    fn bind_here_if_asked() {
        if let Some(p) = std::env::var_os("OUTBOARD_TEST_BIND") {
            let (_fd, guard) = bind(Path::new(&p)).unwrap();
            std::mem::forget(guard);
        }
    }

    #[test]
    fn a_regular_file_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("machine.toml");
        std::fs::write(&victim, "precious").unwrap();
        let e = bind(&victim).unwrap_err();
        assert!(
            matches!(
                e,
                SockPathError::NotASocket {
                    kind: "a regular file",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        let d = dir.path().join("sub");
        std::fs::create_dir(&d).unwrap();
        assert!(matches!(
            bind(&d),
            Err(SockPathError::NotASocket {
                kind: "a directory",
                ..
            })
        ));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(matches!(bind(&link), Err(SockPathError::NotASocket { .. })));
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    }

    #[test]
    fn a_live_socket_is_refused_and_a_stale_one_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.sock");
        let (fd, guard) = bind(&p).unwrap();
        assert!(matches!(bind(&p), Err(SockPathError::InUse { .. })));
        // A live socket of another type is still live.
        assert!(matches!(
            bind_listener(&p, SocketType::STREAM, 4),
            Err(SockPathError::InUse { .. })
        ));
        assert!(is_live(&p));
        // The owner dies without cleaning up: the socket is stale and may be replaced.
        std::mem::forget(guard);
        drop(fd);
        assert!(p.exists() && !is_live(&p));
        let (_fd, _guard) = bind(&p).unwrap();
    }

    /// A client that waits for the socket file and connects as soon as it is live is never
    /// refused: the path appears only once the socket listens. (Bound at the path and then
    /// listening, a connect in between was refused: an export's test client met that.)
    #[test]
    fn a_socket_is_listening_once_its_path_is_live() {
        let dir = tempfile::tempdir().unwrap();
        for round in 0..300 {
            let p = dir.path().join(format!("s{round}.sock"));
            std::thread::scope(|s| {
                let watcher = s.spawn(|| {
                    let t = std::time::Instant::now();
                    while !is_live(&p) {
                        assert!(t.elapsed() < std::time::Duration::from_secs(10));
                        std::hint::spin_loop();
                    }
                    std::os::unix::net::UnixStream::connect(&p).map(drop)
                });
                let bound = bind_listener(&p, SocketType::STREAM, 4).unwrap();
                let connected = watcher.join().unwrap();
                assert!(connected.is_ok(), "round {round}: {connected:?}");
                drop(bound);
            });
        }
    }

    #[test]
    fn drop_removes_only_our_own_socket() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.sock");
        let (fd, guard) = bind(&p).unwrap();
        drop(fd);
        // Someone else took the path over (after ours went stale).
        let (_fd2, guard2) = bind(&p).unwrap();
        assert!(!guard.still_ours());
        drop(guard);
        assert!(
            p.exists(),
            "the other server's socket must survive our exit"
        );
        drop(guard2);
        assert!(!p.exists());
    }
}
