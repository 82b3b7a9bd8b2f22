//! The runtime directory: one manager at a time, and the names of what it holds.
//!
//! A manager takes an exclusive `flock` on `manager.lock` in its runtime directory before it
//! creates anything there, and holds it until it exits (the kernel drops the lock if it is
//! killed). A second manager pointed at the same directory is refused with the first one's pid,
//! instead of replacing its sockets and serving different disks under the same names.
//!
//! Every file a manager creates is named from a validated name (letters, digits, `-`, `_`) and
//! a suffix that says what it is, so a server name can never collide with a device's socket or
//! with the control socket, and no name can reach outside the directory.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{FlockOperation, Mode, OFlags};
use rustix::io::Errno;

/// The lock file's name.
pub const LOCK: &str = "manager.lock";

/// Why the runtime directory (or a file in it) could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A system call on `path` failed (`what`: which, when it is not obvious).
    #[error("{}: {what}{err}", path.display())]
    Os {
        /// The path.
        path: PathBuf,
        /// The call, with its separator (`"chmod 0700: "`), or empty.
        what: &'static str,
        /// What the system said.
        err: std::io::Error,
    },
    /// The directory's name is a symbolic link.
    #[error("{}: is a symbolic link; refusing to use it as the runtime directory", .0.display())]
    Symlink(PathBuf),
    /// Someone other than this user could replace what is in it.
    #[error(
        "{}: {why}; refusing to use it as the runtime directory (anyone who can write there \
         can replace its sockets). Remove it, or give --runtime-dir a directory of your own \
         that only you can write",
        path.display()
    )]
    NotPrivate {
        /// The directory.
        path: PathBuf,
        /// Who else could write it.
        why: NotPrivate,
    },
    /// A directory above it lets another user replace it.
    #[error(
        "{}: the directory {} above it is not safe ({why}); refusing to use it as the runtime \
         directory (whoever else can write there could rename it away and put their own in \
         its place). Give --runtime-dir a directory on a path only you and root can write",
        path.display(),
        above.display()
    )]
    UnsafePath {
        /// The directory.
        path: PathBuf,
        /// The ancestor at fault.
        above: PathBuf,
        /// Who else could write it.
        why: NotPrivate,
    },
    /// Its control socket (or the directory) could not be opened to a group.
    #[error("{}: giving group {gid} access: {err}", path.display())]
    Group {
        /// What was to be opened.
        path: PathBuf,
        /// The group.
        gid: u32,
        /// What the system said.
        err: std::io::Error,
    },
    /// Another manager holds it.
    #[error(
        "{} is in use by another `outboard up` (pid {pid}); stop it, or give this one its own \
         --runtime-dir",
        path.display()
    )]
    InUse {
        /// The directory.
        path: PathBuf,
        /// The holder's pid, as its lock file says.
        pid: String,
    },
}

/// Why a directory is not private to this user.
#[derive(Debug, thiserror::Error)]
pub enum NotPrivate {
    /// Another user owns it.
    #[error("it is owned by uid {owner}, not by you (uid {me})")]
    Owner {
        /// Its owner.
        owner: u32,
        /// This process's effective uid.
        me: u32,
    },
    /// Group or others may write it.
    #[error("it is writable by {who} (mode {mode:o})")]
    Writable {
        /// `its group`, `others`, or both.
        who: &'static str,
        /// Its permission bits.
        mode: u32,
    },
    /// It could not be looked at.
    #[error("{0}")]
    Stat(std::io::Error),
}

/// A failed call on `path`, as a [`RuntimeError`].
fn os<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(Errno) -> RuntimeError + 'a {
    move |e| RuntimeError::Os {
        path: path.to_owned(),
        what,
        err: e.into(),
    }
}

/// A runtime directory this process holds the lock of.
#[derive(Debug)]
pub struct RuntimeDir {
    dir: PathBuf,
    lock: File,
}

impl RuntimeDir {
    /// Creates `dir` (0700) if needed, checks that it is safe to use, and takes its lock.
    ///
    /// Like OpenSSH's `StrictModes`: a directory another user owns, or that group or others
    /// may write, is refused before anything is written in it. Whoever made it first could
    /// otherwise plant a socket where clients look for the control socket, or a symlink where
    /// a log is created (truncating any file the manager, often root, can write).
    pub fn claim(dir: &Path) -> Result<Self, RuntimeError> {
        let dfd = private_dir(dir)?;
        let lock_path = dir.join(LOCK);
        loop {
            let fd = rustix::fs::openat(
                &dfd,
                LOCK,
                OFlags::RDWR | OFlags::CREATE | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                Mode::from_raw_mode(0o600),
            )
            .map_err(os(&lock_path, ""))?;
            let mut lock = File::from(fd);
            match rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => {}
                Err(Errno::WOULDBLOCK) => {
                    let mut pid = String::new();
                    let _ = lock.read_to_string(&mut pid);
                    return Err(RuntimeError::InUse {
                        path: dir.to_owned(),
                        pid: pid.trim().to_string(),
                    });
                }
                Err(e) => return Err(os(&lock_path, "flock: ")(e)),
            }
            // The previous holder may have removed the file between our open and our lock:
            // then we hold a lock nobody else can see. Lock the file that is there instead.
            let ours = rustix::fs::fstat(lock.as_fd()).map_err(os(&lock_path, "fstat: "))?;
            match rustix::fs::statat(&dfd, LOCK, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) if st.st_dev == ours.st_dev && st.st_ino == ours.st_ino => {}
                _ => continue,
            }
            let io = |err| RuntimeError::Os {
                path: lock_path.clone(),
                what: "writing the pid: ",
                err,
            };
            lock.set_len(0).map_err(io)?;
            lock.rewind().map_err(io)?;
            write!(lock, "{}", std::process::id()).map_err(io)?;
            return Ok(Self {
                dir: dir.to_owned(),
                lock,
            });
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The vfio-user socket of device `name`'s model.
    pub fn device_socket(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.vfio-user.sock"))
    }

    /// The log of device `name`'s model.
    pub fn device_log(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.device.log"))
    }

    /// The fault socket of device `name`'s model.
    pub fn faults_socket(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.faults.sock"))
    }

    /// The session socket of driver server `name`.
    pub fn server_socket(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.server.sock"))
    }

    /// The log of driver server `name`.
    pub fn server_log(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.server.log"))
    }
}

/// Creates `dir` (0700) if needed and opens it, refusing it unless it is safe to put sockets
/// and files in: it is no symlink, only this user owns and may write it, and no directory
/// above it lets another user rename it away and put their own in its place (each is owned
/// by root or this user, and is writable by nobody else unless sticky, like `/tmp`).
///
/// This is OpenSSH's `StrictModes` applied to the runtime directory: whoever controls it, or
/// the path to it, could plant a socket where clients look for the control socket, or a
/// symlink where a log is created.
pub fn private_dir(dir: &Path) -> Result<OwnedFd, RuntimeError> {
    let created = match rustix::fs::mkdir(dir, Mode::from_raw_mode(0o700)) {
        Ok(()) => true,
        Err(Errno::EXIST) => false,
        Err(Errno::NOENT) => {
            if let Some(parent) = dir.parent() {
                std::fs::create_dir_all(parent).map_err(|err| RuntimeError::Os {
                    path: dir.to_owned(),
                    what: "",
                    err,
                })?;
            }
            match rustix::fs::mkdir(dir, Mode::from_raw_mode(0o700)) {
                Ok(()) => true,
                Err(Errno::EXIST) => false,
                Err(e) => return Err(os(dir, "")(e)),
            }
        }
        Err(e) => return Err(os(dir, "")(e)),
    };
    // The directory itself, not whatever a symlink at its name points to.
    let dfd = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        Errno::LOOP | Errno::NOTDIR
            if rustix::fs::lstat(dir).is_ok_and(|st| {
                rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink
            }) =>
        {
            RuntimeError::Symlink(dir.to_owned())
        }
        e => os(dir, "")(e),
    })?;
    if created {
        // mkdir's mode went through the umask: set it exactly.
        rustix::fs::fchmod(&dfd, Mode::from_raw_mode(0o700)).map_err(os(dir, "chmod 0700: "))?;
    }
    check_private(&dfd).map_err(|why| RuntimeError::NotPrivate {
        path: dir.to_owned(),
        why,
    })?;
    check_ancestors(dir)?;
    Ok(dfd)
}

/// Refuses a path to the runtime directory that another user could redirect: an ancestor
/// (symlinks resolved, as the kernel walks it) owned by someone other than root or this
/// user, or writable by group or others without the sticky bit.
fn check_ancestors(dir: &Path) -> Result<(), RuntimeError> {
    let real = std::fs::canonicalize(dir).map_err(|err| RuntimeError::Os {
        path: dir.to_owned(),
        what: "",
        err,
    })?;
    let me = rustix::process::geteuid().as_raw();
    for above in real.ancestors().skip(1) {
        let st = rustix::fs::stat(above).map_err(os(above, ""))?;
        let why = if st.st_uid != 0 && st.st_uid != me {
            Some(NotPrivate::Owner {
                owner: st.st_uid,
                me,
            })
        } else if st.st_mode & 0o022 != 0 && st.st_mode & 0o1000 == 0 {
            // Sticky (like /tmp): others may write, but only this user can rename this
            // user's entries.
            Some(NotPrivate::Writable {
                who: if st.st_mode & 0o002 != 0 {
                    "others"
                } else {
                    "its group"
                },
                mode: st.st_mode & 0o7777,
            })
        } else {
            None
        };
        if let Some(why) = why {
            return Err(RuntimeError::UnsafePath {
                path: dir.to_owned(),
                above: above.to_owned(),
                why,
            });
        }
    }
    Ok(())
}

/// Why the directory open as `dfd` is not private to this user: another owner, or write
/// access for group or others.
fn check_private(dfd: &impl AsFd) -> Result<(), NotPrivate> {
    let st = rustix::fs::fstat(dfd).map_err(|e| NotPrivate::Stat(e.into()))?;
    let me = rustix::process::geteuid().as_raw();
    if st.st_uid != me {
        return Err(NotPrivate::Owner {
            owner: st.st_uid,
            me,
        });
    }
    let writable = st.st_mode & 0o022;
    if writable != 0 {
        let who = match (writable & 0o020 != 0, writable & 0o002 != 0) {
            (true, true) => "group and others",
            (true, false) => "its group",
            _ => "others",
        };
        return Err(NotPrivate::Writable {
            who,
            mode: st.st_mode & 0o7777,
        });
    }
    Ok(())
}

/// Opens a child's log for writing: a new, empty file (`append` false: whatever was at the
/// name is removed first) or the existing log of an earlier incarnation (`append`). The last
/// component is never followed if it is a symlink, and a new log is created with `O_EXCL` and
/// mode 0600: nothing planted at the name is truncated or written through.
pub fn open_log(path: &Path, append: bool) -> Result<File, RuntimeError> {
    let exclusive = |path: &Path| {
        rustix::fs::open(
            path,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
    };
    let fresh = |path: &Path| -> Result<File, RuntimeError> {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => {
                return Err(RuntimeError::Os {
                    path: path.to_owned(),
                    what: "",
                    err,
                })
            }
        }
        exclusive(path).map(File::from).map_err(os(path, ""))
    };
    if !append {
        return fresh(path);
    }
    match rustix::fs::open(
        path,
        OFlags::WRONLY | OFlags::APPEND | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => {
            let st = rustix::fs::fstat(&fd).map_err(os(path, ""))?;
            if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile
            {
                Ok(File::from(fd))
            } else {
                fresh(path)
            }
        }
        // Gone, or a symlink planted in its place (ELOOP): start a new one.
        Err(Errno::NOENT | Errno::LOOP) => fresh(path),
        Err(e) => Err(os(path, "")(e)),
    }
}

impl Drop for RuntimeDir {
    fn drop(&mut self) {
        // Removed while still locked, so a waiting manager re-checks and locks a new file.
        let _ = std::fs::remove_file(self.dir.join(LOCK));
        let _ = std::fs::remove_dir(&self.dir);
        let _ = &self.lock;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_manager_is_refused_with_the_first_ones_pid() {
        let dir = tempfile::tempdir().unwrap();
        let rt = dir.path().join("rt");
        let first = RuntimeDir::claim(&rt).unwrap();
        let e = RuntimeDir::claim(&rt).unwrap_err().to_string();
        assert!(e.contains("in use by another"), "{e}");
        assert!(e.contains(&std::process::id().to_string()), "{e}");
        drop(first);
        let _again = RuntimeDir::claim(&rt).unwrap();
    }

    /// Nothing but what the test made is in `dir`.
    fn entries(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn a_directory_another_user_owns_is_refused_and_nothing_is_written_in_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let rt = dir.path().join("rt");
        std::fs::create_dir(&rt).unwrap();
        std::fs::set_permissions(&rt, std::fs::Permissions::from_mode(0o700)).unwrap();
        // `nobody` stands in for the local attacker who made the directory first.
        std::os::unix::fs::chown(&rt, Some(65534), Some(65534)).unwrap();
        let e = RuntimeDir::claim(&rt).unwrap_err().to_string();
        assert!(e.contains("owned by uid 65534"), "{e}");
        assert!(entries(&rt).is_empty(), "{:?}", entries(&rt));
    }

    #[test]
    fn a_directory_others_may_write_is_refused_and_nothing_is_written_in_it() {
        use std::os::unix::fs::PermissionsExt;
        for mode in [0o777, 0o1777, 0o720, 0o702] {
            let dir = tempfile::tempdir().unwrap();
            let rt = dir.path().join("rt");
            std::fs::create_dir(&rt).unwrap();
            std::fs::set_permissions(&rt, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = RuntimeDir::claim(&rt).unwrap_err().to_string();
            assert!(e.contains("writable by"), "{mode:o}: {e}");
            assert!(entries(&rt).is_empty(), "{mode:o}: {:?}", entries(&rt));
        }
    }

    #[test]
    fn a_directory_under_one_another_user_controls_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // Owned by `nobody` (the local attacker): they could rename `rt` away and put theirs.
        let theirs = dir.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let e = RuntimeDir::claim(&theirs.join("rt"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("above it") && e.contains("uid 65534"), "{e}");
        // Writable by anyone and not sticky: the same.
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = RuntimeDir::claim(&open.join("rt")).unwrap_err().to_string();
        assert!(
            e.contains("above it") && e.contains("writable by others"),
            "{e}"
        );
        // Sticky, like /tmp: others cannot rename what is this user's.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        RuntimeDir::claim(&open.join("rt2")).unwrap();
    }

    #[test]
    fn a_symlink_in_place_of_the_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::create_dir(&target).unwrap();
        let rt = dir.path().join("rt");
        std::os::unix::fs::symlink(&target, &rt).unwrap();
        let e = RuntimeDir::claim(&rt).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert!(entries(&target).is_empty());
    }

    #[test]
    fn a_new_directory_is_private_whatever_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let rt_path = dir.path().join("a/b/rt");
        let rt = RuntimeDir::claim(&rt_path).unwrap();
        let mode = std::fs::metadata(rt.dir()).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o700);
    }

    #[test]
    fn a_log_name_planted_as_a_symlink_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let rt = RuntimeDir::claim(&dir.path().join("rt")).unwrap();
        let canary = dir.path().join("canary");
        std::fs::write(&canary, b"precious").unwrap();
        let log = rt.device_log("disk0");
        std::os::unix::fs::symlink(&canary, &log).unwrap();
        let mut f = open_log(&log, false).unwrap();
        std::io::Write::write_all(&mut f, b"log line").unwrap();
        assert_eq!(std::fs::read(&canary).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(&log)
            .unwrap()
            .file_type()
            .is_file());
        assert_eq!(std::fs::read(&log).unwrap(), b"log line");
        // Appending (a restarted child) does not follow one either.
        std::fs::remove_file(&log).unwrap();
        std::os::unix::fs::symlink(&canary, &log).unwrap();
        let mut f = open_log(&log, true).unwrap();
        std::io::Write::write_all(&mut f, b"more").unwrap();
        assert_eq!(std::fs::read(&canary).unwrap(), b"precious");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&log).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn names_cannot_collide() {
        let dir = tempfile::tempdir().unwrap();
        let rt = RuntimeDir::claim(dir.path()).unwrap();
        let all = [
            rt.device_socket("x"),
            rt.device_log("x"),
            rt.server_socket("x"),
            rt.faults_socket("x"),
            rt.server_log("x"),
            rt.dir().join("control.sock"),
            rt.dir().join(LOCK),
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
