//! Launching and supervising the machine's processes: device models and driver servers.
//!
//! Each child runs the `outboard` binary in an internal role, with stdin closed and its log in
//! the runtime directory. A child's exit is seen at once through its pidfd (an event source in
//! the manager's work loop), recorded in the registry, and reported — never waited on blindly.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
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
    /// How it was started, to start it again the same way.
    args: Vec<String>,
    /// What each incarnation is given besides its arguments.
    passing: Passing,
    /// What it is.
    pub kind: Kind,
    /// Its crash history.
    pub restarts: Restarts,
    /// When it died, until it serves again.
    pub down_since: Option<Instant>,
    /// When to start it again.
    pub restart_at: Option<Instant>,
    /// Why it is not started again.
    pub gave_up: Option<String>,
    /// Its heartbeat, once it serves (driver servers).
    pub heartbeat: Option<Heartbeat>,
    /// This incarnation reported that it serves.
    pub served: bool,
    /// This incarnation was killed because its heartbeat stopped.
    pub hung: bool,
    /// When this incarnation started.
    pub started: Instant,
}

/// What a supervised process is, which decides what its death means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// The model of device `device`.
    Model {
        /// Class device name.
        device: String,
    },
    /// Driver server `name`, serving `devices`.
    Server {
        /// Server name.
        name: String,
        /// The class devices it serves.
        devices: Vec<String>,
    },
    /// NBD export `name` (a client of the devices; restarted like the others, so one bad
    /// client that kills it does not end the export for everyone).
    Export {
        /// Export name (its registry node is `nbd:NAME`).
        name: String,
    },
}

impl Kind {
    /// Whether a process of this kind may report `event`: a driver server only about the
    /// devices the manager gave it, an export only about itself. A compromised driver
    /// cannot mark another server's device failed, recovered or quiesced.
    pub fn may_report(&self, event: &outboard_session::control::Event) -> bool {
        use outboard_session::control::Event;
        match event {
            Event::Serving => true,
            Event::DeviceFailed { device, .. }
            | Event::DeviceRecovered { device }
            | Event::Quiesced { device } => self.serves(device),
            Event::ExportClients { export, .. } => {
                matches!(self, Kind::Export { name } if name == export)
            }
        }
    }

    /// Whether this is a driver server serving class device `name`.
    pub fn serves(&self, name: &str) -> bool {
        matches!(self, Kind::Server { devices, .. } if devices.iter().any(|d| d == name))
    }
}

/// When a crashed process is started again, and when the manager stops trying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Most restarts within `window`; one more crash and the process is given up.
    pub limit: u32,
    /// The window restarts are counted in.
    pub window: Duration,
    /// Delay before restarting an incarnation that died before it served; doubling for each
    /// such death in a row.
    pub backoff: Duration,
    /// Longest delay.
    pub max_backoff: Duration,
    /// A driver server whose loop has not turned for this long is hung: it is killed and
    /// restarted.
    pub heartbeat: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            limit: 10,
            window: Duration::from_secs(60),
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_secs(2),
            heartbeat: Duration::from_secs(1),
        }
    }
}

/// A process's crash history.
#[derive(Debug, Default, Clone)]
pub struct Restarts {
    recent: std::collections::VecDeque<Instant>,
    /// Incarnations in a row that died before they served: a crash loop, which back-off
    /// slows down.
    failing: u32,
    /// Restarts since the machine came up.
    pub total: u64,
}

impl Restarts {
    /// A crash at `now` of an incarnation that had (`served`) or had not yet come into
    /// service: how long to wait before starting it again, or `None` to give up (more than
    /// `limit` restarts within the window).
    ///
    /// An incarnation that served is started again at once, however often that happens:
    /// clients are waiting, and the next one is as likely to serve. Back-off is for crash
    /// loops, incarnations that die before serving; each such death in a row doubles the
    /// delay. The give-up limit bounds both.
    pub fn crashed(&mut self, now: Instant, p: &RestartPolicy, served: bool) -> Option<Duration> {
        self.recent
            .retain(|t| now.saturating_duration_since(*t) < p.window);
        if self.recent.len() as u32 >= p.limit {
            return None;
        }
        self.recent.push_back(now);
        self.total += 1;
        if served {
            self.failing = 0;
            return Some(Duration::ZERO);
        }
        self.failing += 1;
        Some(
            p.backoff
                .saturating_mul(1u32 << (self.failing - 1).min(20))
                .min(p.max_backoff),
        )
    }

    /// Restarts within the window that ends at `now`.
    pub fn recent(&self, now: Instant, p: &RestartPolicy) -> usize {
        self.recent
            .iter()
            .filter(|t| now.saturating_duration_since(**t) < p.window)
            .count()
    }
}

/// A driver server's heartbeat: the word its loop bumps each turn, in a page it shared.
#[derive(Debug)]
pub struct Heartbeat {
    page: outboard_shm::SharedMem,
    last: u32,
    moved: Instant,
}

impl Heartbeat {
    /// Maps the page the server sent (sealed, or guarded if it is not: a server cannot fault
    /// the manager by shrinking it).
    pub fn new(fd: OwnedFd) -> Result<Self, String> {
        let page =
            outboard_shm::SharedMem::map_peer_owned(fd, 0, 4096, outboard_shm::Access::ReadOnly)
                .map_err(|e| format!("heartbeat page: {e}"))?;
        Ok(Self {
            page,
            last: 0,
            moved: Instant::now(),
        })
    }

    /// How long the word has not moved, as of `now`.
    pub fn still_for(&mut self, now: Instant) -> Duration {
        let word = self
            .page
            .atomic_u32(0)
            .map(|w| w.load(std::sync::atomic::Ordering::Relaxed));
        if let Ok(w) = word {
            if w != self.last {
                self.last = w;
                self.moved = now;
            }
        }
        now.saturating_duration_since(self.moved)
    }
}

/// The fd number a child finds its event channel on.
pub const EVENT_FD: i32 = 3;

/// What a child is given besides its arguments, the same way each incarnation: from fd 3 on,
/// an event channel (new each time), then `keep`, then a new connection to each socket in
/// `connect`. [`fd_layout`] gives the numbers.
#[derive(Default)]
pub struct Passing {
    /// It reports events (a driver server, a model, an export).
    pub events: bool,
    /// Descriptors that outlive each incarnation: listening sockets, a disk.
    pub keep: Vec<OwnedFd>,
    /// vfio-user sockets connected afresh for each incarnation.
    pub connect: Vec<PathBuf>,
    /// The socket files of `keep`'s listeners: removed when the process is dropped.
    pub paths: Vec<outboard_sys::SocketPath>,
}

impl Passing {
    /// An event channel only.
    pub fn events() -> Self {
        Self {
            events: true,
            ..Self::default()
        }
    }

    /// This incarnation's descriptors, made and spawned with: the manager's end of the event
    /// channel (if any), and what the child gets, in order.
    fn incarnation(&self, role: &str) -> Result<(Option<OwnedFd>, Vec<OwnedFd>), String> {
        let (ours, theirs) = if self.events {
            let (o, t) = outboard_session::control::pair().map_err(|e| format!("{role}: {e}"))?;
            (Some(o), Some(t))
        } else {
            (None, None)
        };
        let conns = self
            .connect
            .iter()
            .map(|p| {
                std::os::unix::net::UnixStream::connect(p)
                    .map(OwnedFd::from)
                    .map_err(|e| format!("{role}: connecting to {}: {e}", p.display()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((ours, theirs.into_iter().chain(conns).collect()))
    }

    /// What the child gets, as numbered by [`fd_layout`]: channel, `keep`, connections.
    fn borrowed<'a>(&'a self, fresh: &'a [OwnedFd]) -> Vec<BorrowedFd<'a>> {
        let (channel, conns) = fresh.split_at(usize::from(self.events));
        channel
            .iter()
            .chain(&self.keep)
            .chain(conns)
            .map(|f| f.as_fd())
            .collect()
    }
}

/// Where a child started with a [`Passing`] finds what it was given: the numbers
/// of its `keep` descriptors, then of its device connections.
pub fn fd_layout(events: bool, keep: usize, connect: usize) -> (Vec<i32>, Vec<i32>) {
    let first = EVENT_FD + i32::from(events);
    let keep_fds = (0..keep as i32).map(|i| first + i).collect();
    let conn_fds = (0..connect as i32)
        .map(|i| first + keep as i32 + i)
        .collect();
    (keep_fds, conn_fds)
}

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
        Self::spawn_passing(exe, role, args, log, verbose, Passing::default())
    }

    /// Starts `exe args…` with what `passing` says passed as descriptors (see [`Passing`]).
    pub fn spawn_passing(
        exe: &Path,
        role: &str,
        args: &[String],
        log: PathBuf,
        verbose: u8,
        passing: Passing,
    ) -> Result<Self, String> {
        let mut p = Self::spawn_with(exe, role, args, log, verbose, &passing, false)?;
        p.passing = passing;
        Ok(p)
    }

    /// How the next incarnation starts: new arguments and device connections (a driver
    /// server that lost a device).
    pub fn set_launch(&mut self, args: Vec<String>, connect: Vec<PathBuf>) {
        self.args = args;
        self.passing.connect = connect;
    }

    /// Adds `flag value` to the arguments the next incarnation starts with, or removes it.
    pub fn set_arg(&mut self, flag: &str, value: &str, on: bool) {
        let at = self
            .args
            .windows(2)
            .position(|w| w[0] == flag && w[1] == value);
        match (at, on) {
            (None, true) => self.args.extend([flag.to_string(), value.to_string()]),
            (Some(i), false) => {
                self.args.drain(i..i + 2);
            }
            _ => {}
        }
    }

    /// Starts the process again as it was started (its log goes on, after the last
    /// incarnation's): a new pid, pidfd and event channel.
    pub fn respawn(&mut self, exe: &Path, verbose: u8) -> Result<(), String> {
        // A fresh event channel and fresh device connections; the same listeners and disk.
        let mut next = Self::spawn_with(
            exe,
            &self.role,
            &self.args,
            self.log.clone(),
            verbose,
            &self.passing,
            true,
        )?;
        next.passing = std::mem::take(&mut self.passing);
        *self = Self {
            kind: self.kind.clone(),
            restarts: std::mem::take(&mut self.restarts),
            down_since: self.down_since,
            ..next
        };
        Ok(())
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
        Self::spawn_passing(exe, role, args, log, verbose, Passing::events())
    }

    fn spawn_with(
        exe: &Path,
        role: &str,
        args: &[String],
        log: PathBuf,
        verbose: u8,
        passing: &Passing,
        append: bool,
    ) -> Result<Self, String> {
        let (events, fresh) = passing.incarnation(role)?;
        let out = crate::runtime::open_log(&log, append)?;
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
        outboard_sys::process::die_with_parent(&mut cmd, &passing.borrowed(&fresh))?;
        let child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("starting {role} ({}): {e}", exe.display()))?;
        let pid = Pid::from_child(&child);
        let pidfd = rustix::process::pidfd_open(pid, PidfdFlags::empty())
            .map_err(|e| format!("pidfd for {role}: {e}"))?;
        Ok(Self {
            role: role.into(),
            child,
            pidfd,
            log,
            exited: None,
            events,
            args: args.to_vec(),
            passing: Passing::default(),
            // The caller says what it is.
            kind: Kind::Export {
                name: String::new(),
            },
            restarts: Restarts::default(),
            down_since: None,
            restart_at: None,
            gave_up: None,
            heartbeat: None,
            served: false,
            hung: false,
            started: Instant::now(),
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

    /// Waits for a child's `Serving` event (start-up is over); returns the descriptors it
    /// came with (a driver server's heartbeat page). One that exits first is reported with its
    /// log.
    pub fn wait_serving(&mut self, timeout: Duration) -> Result<Vec<OwnedFd>, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let Some(ev) = self.events.as_ref() else {
                return Err(format!("{} has no event channel", self.role));
            };
            match outboard_session::control::recv::<outboard_session::control::Event>(
                ev.as_fd(),
                Some(Duration::from_millis(10)),
            ) {
                Ok((outboard_session::control::Event::Serving, fds)) => return Ok(fds),
                Ok(_) | Err(outboard_session::SessionError::Timeout) => {}
                Err(_) => {
                    // The channel closed: it is exiting.
                    let _ = self.child.wait().map(|s| self.exited = Some(s));
                }
            }
            if self.reap() || self.exited.is_some() {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                return Err(format!(
                    "{} exited ({}) before it was ready:\n{}",
                    self.role,
                    self.exited.expect("reaped"),
                    log.trim()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!("{} did not serve within {timeout:?}", self.role));
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_may_report_only_about_what_it_was_given() {
        use outboard_session::control::Event;
        let server = Kind::Server {
            name: "s".into(),
            devices: vec!["disk0".into()],
        };
        let model = Kind::Model {
            device: "disk0".into(),
        };
        let export = Kind::Export {
            name: "disk0".into(),
        };
        let failed = |d: &str| Event::DeviceFailed {
            device: d.into(),
            why: "x".into(),
            restarting: false,
        };
        assert!(server.may_report(&failed("disk0")));
        assert!(!server.may_report(&failed("disk1")));
        assert!(!server.may_report(&Event::Quiesced {
            device: "disk1".into()
        }));
        assert!(!server.may_report(&Event::DeviceRecovered {
            device: "disk1".into()
        }));
        assert!(!model.may_report(&failed("disk0")));
        assert!(!export.may_report(&failed("disk0")));
        let clients = |e: &str| Event::ExportClients {
            export: e.into(),
            clients: vec![],
        };
        assert!(export.may_report(&clients("disk0")));
        assert!(!export.may_report(&clients("golden")));
        assert!(!server.may_report(&clients("disk0")));
        for k in [&server, &model, &export] {
            assert!(k.may_report(&Event::Serving));
        }
    }

    #[test]
    fn restarts_back_off_and_give_up_past_the_limit_within_the_window() {
        let p = RestartPolicy {
            limit: 3,
            window: Duration::from_secs(10),
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(15),
            heartbeat: Duration::from_secs(1),
        };
        let mut r = Restarts::default();
        let t = Instant::now();
        // Incarnations that never served: a crash loop, slowed down.
        assert_eq!(r.crashed(t, &p, false), Some(Duration::from_millis(10)));
        assert_eq!(r.crashed(t, &p, false), Some(Duration::from_millis(15)));
        // One that served is started again at once, and ends the loop.
        assert_eq!(r.crashed(t, &p, true), Some(Duration::ZERO));
        assert_eq!(r.crashed(t, &p, false), None);
        assert_eq!(r.total, 3);
        // Once the window has passed, the count starts again; the loop has not ended.
        let later = t + Duration::from_secs(11);
        assert_eq!(r.recent(later, &p), 0);
        assert_eq!(r.crashed(later, &p, true), Some(Duration::ZERO));
        assert_eq!(r.crashed(later, &p, false), Some(Duration::from_millis(10)));
    }

    #[test]
    fn a_driver_killed_often_while_serving_is_never_delayed() {
        let p = RestartPolicy {
            limit: 1000,
            ..RestartPolicy::default()
        };
        let mut r = Restarts::default();
        let t = Instant::now();
        for k in 0..500 {
            let now = t + Duration::from_millis(10 * k);
            assert_eq!(r.crashed(now, &p, true), Some(Duration::ZERO), "kill {k}");
        }
    }
}
