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
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use rustix::fs::{FlockOperation, Mode, OFlags};
use rustix::io::Errno;

/// The lock file's name.
pub const LOCK: &str = "manager.lock";

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
    pub fn claim(dir: &Path) -> Result<Self, String> {
        let shown = dir.display();
        let created = match rustix::fs::mkdir(dir, Mode::from_raw_mode(0o700)) {
            Ok(()) => true,
            Err(Errno::EXIST) => false,
            Err(Errno::NOENT) => {
                if let Some(parent) = dir.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| format!("{shown}: {e}"))?;
                }
                match rustix::fs::mkdir(dir, Mode::from_raw_mode(0o700)) {
                    Ok(()) => true,
                    Err(Errno::EXIST) => false,
                    Err(e) => return Err(format!("{shown}: {e}")),
                }
            }
            Err(e) => return Err(format!("{shown}: {e}")),
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
                format!("{shown}: is a symbolic link; refusing to use it as the runtime directory")
            }
            e => format!("{shown}: {e}"),
        })?;
        if created {
            // mkdir's mode went through the umask: set it exactly.
            rustix::fs::fchmod(&dfd, Mode::from_raw_mode(0o700))
                .map_err(|e| format!("{shown}: chmod 0700: {e}"))?;
        }
        check_private(&dfd).map_err(|why| {
            format!(
                "{shown}: {why}; refusing to use it as the runtime directory (anyone who can \
                 write there can replace its sockets). Remove it, or give --runtime-dir a \
                 directory of your own that only you can write"
            )
        })?;
        loop {
            let fd = rustix::fs::openat(
                &dfd,
                LOCK,
                OFlags::RDWR | OFlags::CREATE | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                Mode::from_raw_mode(0o600),
            )
            .map_err(|e| format!("{}: {e}", dir.join(LOCK).display()))?;
            let mut lock = File::from(fd);
            match rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => {}
                Err(Errno::WOULDBLOCK) => {
                    let mut pid = String::new();
                    let _ = lock.read_to_string(&mut pid);
                    return Err(format!(
                        "{} is in use by another `outboard up` (pid {}); stop it, or give this \
                         one its own --runtime-dir",
                        dir.display(),
                        pid.trim()
                    ));
                }
                Err(e) => return Err(format!("{}: flock: {e}", dir.join(LOCK).display())),
            }
            // The previous holder may have removed the file between our open and our lock:
            // then we hold a lock nobody else can see. Lock the file that is there instead.
            let ours = rustix::fs::fstat(lock.as_fd()).map_err(|e| e.to_string())?;
            match rustix::fs::statat(&dfd, LOCK, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) if st.st_dev == ours.st_dev && st.st_ino == ours.st_ino => {}
                _ => continue,
            }
            lock.set_len(0).map_err(|e| e.to_string())?;
            lock.rewind().map_err(|e| e.to_string())?;
            write!(lock, "{}", std::process::id()).map_err(|e| e.to_string())?;
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

/// Why the directory open as `dfd` is not private to this user: another owner, or write
/// access for group or others.
fn check_private(dfd: &impl AsFd) -> Result<(), String> {
    let st = rustix::fs::fstat(dfd).map_err(|e| e.to_string())?;
    let me = rustix::process::geteuid().as_raw();
    if st.st_uid != me {
        return Err(format!(
            "it is owned by uid {}, not by you (uid {me})",
            st.st_uid
        ));
    }
    let writable = st.st_mode & 0o022;
    if writable != 0 {
        let who = match (writable & 0o020 != 0, writable & 0o002 != 0) {
            (true, true) => "group and others",
            (true, false) => "its group",
            _ => "others",
        };
        return Err(format!(
            "it is writable by {who} (mode {:o})",
            st.st_mode & 0o7777
        ));
    }
    Ok(())
}

/// Opens a child's log for writing: a new, empty file (`append` false: whatever was at the
/// name is removed first) or the existing log of an earlier incarnation (`append`). The last
/// component is never followed if it is a symlink, and a new log is created with `O_EXCL` and
/// mode 0600: nothing planted at the name is truncated or written through.
pub fn open_log(path: &Path, append: bool) -> Result<File, String> {
    let shown = || path.display().to_string();
    let exclusive = |path: &Path| {
        rustix::fs::open(
            path,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
    };
    let fresh = |path: &Path| -> Result<File, String> {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{}: {e}", shown())),
        }
        exclusive(path)
            .map(File::from)
            .map_err(|e| format!("{}: {e}", shown()))
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
            let st = rustix::fs::fstat(&fd).map_err(|e| format!("{}: {e}", shown()))?;
            if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile
            {
                Ok(File::from(fd))
            } else {
                fresh(path)
            }
        }
        // Gone, or a symlink planted in its place (ELOOP): start a new one.
        Err(Errno::NOENT | Errno::LOOP) => fresh(path),
        Err(e) => Err(format!("{}: {e}", shown())),
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
        let e = RuntimeDir::claim(&rt).unwrap_err();
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
        let e = RuntimeDir::claim(&rt).unwrap_err();
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
            let e = RuntimeDir::claim(&rt).unwrap_err();
            assert!(e.contains("writable by"), "{mode:o}: {e}");
            assert!(entries(&rt).is_empty(), "{mode:o}: {:?}", entries(&rt));
        }
    }

    #[test]
    fn a_symlink_in_place_of_the_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::create_dir(&target).unwrap();
        let rt = dir.path().join("rt");
        std::os::unix::fs::symlink(&target, &rt).unwrap();
        let e = RuntimeDir::claim(&rt).unwrap_err();
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
