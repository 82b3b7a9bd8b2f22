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
    /// Creates `dir` (0700) if needed and takes its lock.
    pub fn claim(dir: &Path) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let _ = rustix::fs::chmod(dir, Mode::from_raw_mode(0o700));
        let path = dir.join(LOCK);
        loop {
            let fd = rustix::fs::open(
                &path,
                OFlags::RDWR | OFlags::CREATE | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                Mode::from_raw_mode(0o600),
            )
            .map_err(|e| format!("{}: {e}", path.display()))?;
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
                Err(e) => return Err(format!("{}: flock: {e}", path.display())),
            }
            // The previous holder may have removed the file between our open and our lock:
            // then we hold a lock nobody else can see. Lock the file that is there instead.
            let ours = rustix::fs::fstat(lock.as_fd()).map_err(|e| e.to_string())?;
            match rustix::fs::lstat(&path) {
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
