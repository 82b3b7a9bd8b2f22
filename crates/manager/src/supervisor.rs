//! Launching and supervising the machine's processes: device models and driver servers.
//!
//! Each child runs the `outboard` binary in an internal role, with stdin closed and its log in
//! the runtime directory. A child's exit is seen at once through its pidfd (an event source in
//! the manager's work loop), recorded in the registry, and reported — never waited on blindly.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, PidfdFlags, Signal};

/// A child process the manager owns.
pub struct Process {
    /// What it is, e.g. `device disk0` or `server disk0-server`.
    pub role: String,
    /// The process.
    pub child: Child,
    /// Readable when it exits.
    pub pidfd: OwnedFd,
    /// Its log file.
    pub log: PathBuf,
    /// Exit status, once it exited.
    pub exited: Option<std::process::ExitStatus>,
    /// The manager's end of the child's event channel (driver servers).
    pub events: Option<OwnedFd>,
}

/// The fd number a child finds its event channel on.
pub const EVENT_FD: i32 = 3;

/// Takes ownership of the event channel inherited as fd `n` (see [`EVENT_FD`]).
pub fn inherited_fd(n: i32) -> Result<OwnedFd, String> {
    outboard_sys::process::inherited_socket(n).map_err(|e| format!("--notify-fd: {e}"))
}

impl Process {
    /// Starts `exe args…` with its output in `log`.
    pub fn spawn(
        exe: &Path,
        role: &str,
        args: &[String],
        log: PathBuf,
        verbose: u8,
    ) -> Result<Self, String> {
        Self::spawn_with(exe, role, args, log, verbose, None)
    }

    /// Starts `exe args…` with its output in `log` and an event channel: the child finds its
    /// end as fd [`EVENT_FD`], and the manager's end is kept in [`Process::events`].
    pub fn spawn_with_events(
        exe: &Path,
        role: &str,
        args: &[String],
        log: PathBuf,
        verbose: u8,
    ) -> Result<Self, String> {
        let (ours, theirs) =
            outboard_session::control::pair().map_err(|e| format!("{role}: {e}"))?;
        let mut p = Self::spawn_with(exe, role, args, log, verbose, Some(theirs))?;
        p.events = Some(ours);
        Ok(p)
    }

    fn spawn_with(
        exe: &Path,
        role: &str,
        args: &[String],
        log: PathBuf,
        verbose: u8,
        pass: Option<OwnedFd>,
    ) -> Result<Self, String> {
        let out = File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(exe);
        if verbose > 0 {
            cmd.arg(format!("-{}", "v".repeat(verbose as usize)));
        }
        // Its own process group: a Ctrl-C at the terminal reaches the manager only, which then
        // stops children in order instead of racing them.
        cmd.process_group(0);
        // A manager that dies, even by SIGKILL, takes its children with it: an orphaned device
        // model or driver server would hold its disk and sockets beside the next manager's
        // fresh copies.
        outboard_sys::process::die_with_parent(
            &mut cmd,
            pass.as_ref().map(|fd| (fd.as_fd(), EVENT_FD)),
        );
        let child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("starting {role} ({}): {e}", exe.display()))?;
        // The child has its copy now.
        drop(pass);
        let pid = Pid::from_child(&child);
        let pidfd = rustix::process::pidfd_open(pid, PidfdFlags::empty())
            .map_err(|e| format!("pidfd for {role}: {e}"))?;
        Ok(Self {
            role: role.into(),
            child,
            pidfd,
            log,
            exited: None,
            events: None,
        })
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Records the exit if the process has exited; returns whether it just did.
    pub fn reap(&mut self) -> bool {
        if self.exited.is_some() {
            return false;
        }
        match self.child.try_wait() {
            Ok(Some(status)) => {
                self.exited = Some(status);
                true
            }
            _ => false,
        }
    }

    /// Waits until a server is bound at `path` (a stale socket left there does not count) while
    /// the process is still running, up to `timeout`.
    pub fn wait_for_socket(&mut self, path: &Path, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            if outboard_sys::is_live(path) {
                return Ok(());
            }
            if self.reap() {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                return Err(format!(
                    "{} exited ({}) before it was ready:\n{}",
                    self.role,
                    self.exited.expect("reaped"),
                    log.trim()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{} did not create {} within {timeout:?}",
                    self.role,
                    path.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if self.exited.is_some() {
            return;
        }
        let pid = Pid::from_child(&self.child);
        let _ = rustix::process::kill_process(pid, Signal::TERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.reap() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        self.exited = self.child.wait().ok();
    }

    /// The pidfd, for a work loop.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.pidfd.as_fd()
    }
}
