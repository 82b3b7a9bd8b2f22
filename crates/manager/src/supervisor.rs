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

pub use crate::restart::{is_fault, Death, RestartPolicy, Restarts};

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
    /// The manager's end of its broker connection (an export's questions; see
    /// [`Passing::broker`]).
    pub broker: Option<OwnedFd>,
    /// How it was started, to start it again the same way.
    args: Vec<String>,
    /// A driver server's arguments, typed: what the next incarnation starts with (a restart
    /// changes them: isolation, quarantine, quiesced devices, the resume grace).
    pub server: Option<crate::children::DriverHostArgs>,
    /// What each incarnation is given besides its arguments.
    passing: Passing,
    /// What it is.
    pub kind: Kind,
    /// Its crash history.
    pub restarts: Restarts,
    /// When it died, until it serves again.
    pub down_since: Option<Instant>,
    /// The steps of the restart under way, each with when it ended (`CLOCK_MONOTONIC` ns):
    /// `down` (its death noticed), `respawn` (its restart began); the new process's own
    /// start-up steps and `serving` follow when it serves. Each step causes the next, so the
    /// stamps are in order.
    pub timeline: Vec<(String, u64)>,
    /// When to start it again.
    pub restart_at: Option<Instant>,
    /// Why it is not started again.
    pub gave_up: Option<String>,
    /// Its heartbeat, once it serves (driver servers).
    pub heartbeat: Option<Heartbeat>,
    /// Its counters page, once it serves (driver servers; `outboard_server::counters`).
    pub counters: Option<outboard_server::counters::Reader>,
    /// This incarnation reported that it serves.
    pub served: bool,
    /// This incarnation was killed because its heartbeat stopped (a driver server), or because
    /// it did not come into service in time (a restarted device model).
    pub hung: bool,
    /// A restarted device model not yet in service: killed if it is not by then.
    pub serve_by: Option<Instant>,
    /// This incarnation was ended on an operator's request (`outboard restart`): its death
    /// counts as progress.
    pub planned: bool,
    /// This incarnation was ended because its device model crashed under it.
    pub model_crashed: bool,
    /// Why this incarnation last reported its device failed (shown as the cause of its
    /// death, rather than its exit status).
    pub device_failed: Option<String>,
    /// What its last crashes had in their devices ([`crate::quarantine`]).
    pub suspect: crate::quarantine::Series,
    /// Requests it decided to quarantine, over all its incarnations (each is failed when its
    /// client sends it again).
    pub quarantined: u64,
    /// When this incarnation started.
    pub started: Instant,
    /// The program it runs instead of the manager's own (`outboard restart --exe`, a live
    /// upgrade), for this and every later incarnation.
    pub exe: Option<PathBuf>,
    /// A graceful restart under way: the devices still draining, and when to stop waiting
    /// for them.
    pub graceful: Option<(Vec<String>, Instant)>,
    /// A driver server's standby, waiting to take its place at its death
    /// ([`crate::standby`]).
    pub standby: Option<crate::standby::Standby>,
    /// When to start its next standby (after a restart, once its clients are back).
    pub standby_at: Option<Instant>,
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
            Event::Serving { .. } => true,
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

/// A driver server's heartbeat: the word its loop bumps each turn, in a page it shared.
#[derive(Debug)]
pub struct Heartbeat {
    page: outboard_shm::SharedMem,
    last: u32,
    moved: Instant,
    /// The word when the server said it serves.
    first: Option<u32>,
}

/// Why a child could not be started, or did not come up.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// Its log could not be opened.
    #[error(transparent)]
    Log(#[from] crate::runtime::RuntimeError),
    /// A descriptor it is to be given could not be made (`what` says which).
    #[error("{role}: {what}: {err}")]
    Descriptor {
        /// The child's role (`driver server disk0`).
        role: String,
        /// Which descriptor.
        what: String,
        /// What the system said.
        err: std::io::Error,
    },
    /// The program could not be started.
    #[error("starting {role} ({}): {err}", exe.display())]
    Exec {
        /// The child's role.
        role: String,
        /// The program.
        exe: PathBuf,
        /// What the system said.
        err: std::io::Error,
    },
    /// It exited before it said it serves.
    #[error("{role} exited ({status}) before it was ready:\n{log}")]
    ExitedEarly {
        /// The child's role.
        role: String,
        /// How it ended.
        status: std::process::ExitStatus,
        /// Its log.
        log: String,
    },
    /// It did not say it serves in time.
    #[error("{role} did not serve within {timeout:?}")]
    NotServing {
        /// The child's role.
        role: String,
        /// How long it was given.
        timeout: Duration,
    },
    /// It was started without an event channel to say so on.
    #[error("{0} has no event channel")]
    NoEvents(String),
}

impl Heartbeat {
    /// Maps the page the server sent (sealed, or guarded if it is not: a server cannot fault
    /// the manager by shrinking it).
    pub fn new(fd: OwnedFd) -> Result<Self, outboard_shm::ShmError> {
        let page =
            outboard_shm::SharedMem::map_peer_owned(fd, 0, 4096, outboard_shm::Access::ReadOnly)?;
        let mut hb = Self {
            page,
            last: 0,
            moved: Instant::now(),
            first: None,
        };
        hb.first = hb.word();
        hb.last = hb.first.unwrap_or(0);
        Ok(hb)
    }

    fn word(&self) -> Option<u32> {
        self.page
            .atomic_u32(0)
            .ok()
            .map(|w| w.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// The page itself.
    pub fn page(&self) -> &outboard_shm::SharedMem {
        &self.page
    }

    /// What the server's devices had in them, as it named them (read at its death).
    pub fn verdict(&self) -> outboard_server::blame::Verdict {
        outboard_server::blame::Verdict::read(&self.page)
    }

    /// Whether the loop turned since the server said it serves: progress.
    pub fn turned(&self) -> bool {
        self.word() != self.first
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

/// Descriptors a restart waits for: an event channel pair, a pidfd, a log, its model
/// connections, and what `exec` briefly needs.
const RESTART_RESERVE: u64 = 16;

/// Descriptors this process may still open (0 if it cannot even look).
fn free_descriptors() -> u64 {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    match std::fs::read_dir("/proc/self/fd") {
        Ok(d) => limit.saturating_sub(d.count() as u64),
        Err(_) => 0,
    }
}

/// The fd number a child finds its event channel on.
pub const EVENT_FD: i32 = 3;

/// A descriptor made afresh for each incarnation of a child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fresh {
    /// A new connection to a device model's vfio-user socket.
    Connect(PathBuf),
    /// A device file opened anew (read-write): a VFIO container or IOMMU group. Opened for
    /// each incarnation and never kept by the manager, so that a dead server's claim on the
    /// function (its DMA mappings, its container) ends with it.
    Open(PathBuf),
}

/// What a child is given besides its arguments, the same way each incarnation: from fd 3 on,
/// an event channel (new each time), then `keep`, then each descriptor of `connect` made
/// afresh, then a broker connection (new each time). [`fd_layout`] and
/// [`Passing::broker_fd`] give the numbers.
#[derive(Default)]
pub struct Passing {
    /// It reports events (a driver server, a model, an export).
    pub events: bool,
    /// Descriptors that outlive each incarnation: listening sockets, a disk.
    pub keep: Vec<OwnedFd>,
    /// Device connections and device files made afresh for each incarnation.
    pub connect: Vec<Fresh>,
    /// The socket files of `keep`'s listeners: removed when the process is dropped.
    pub paths: Vec<outboard_sys::SocketPath>,
    /// It asks the manager questions and has it connect to driver servers on a connection
    /// of its own (an export: see `outboard_client::link`).
    pub broker: bool,
}

impl Passing {
    /// An event channel only.
    pub fn events() -> Self {
        Self {
            events: true,
            ..Self::default()
        }
    }

    /// The fd number the child finds its broker connection on.
    pub fn broker_fd(&self) -> i32 {
        EVENT_FD + i32::from(self.events) + (self.keep.len() + self.connect.len()) as i32
    }

    /// This incarnation's descriptors, made and spawned with: the manager's ends of the event
    /// channel and broker connection (if any), and what the child gets, in order.
    fn incarnation(&self, role: &str) -> Result<Incarnation, SpawnError> {
        let pair = |wanted: bool,
                    what: &str|
         -> Result<(Option<OwnedFd>, Option<OwnedFd>), SpawnError> {
            if !wanted {
                return Ok((None, None));
            }
            let (o, t) = outboard_session::control::pair().map_err(|e| SpawnError::Descriptor {
                role: role.into(),
                what: what.into(),
                err: std::io::Error::other(e.to_string()),
            })?;
            Ok((Some(o), Some(t)))
        };
        let (ours, theirs) = pair(self.events, "its event channel")?;
        let (broker, child_broker) = pair(self.broker, "its broker connection")?;
        let conns = self.connections(role)?;
        Ok(Incarnation {
            events: ours,
            broker,
            fresh: theirs
                .into_iter()
                .chain(conns)
                .chain(child_broker)
                .collect(),
        })
    }

    /// Each descriptor of `connect`, made afresh: a connection to each device model, each
    /// device file opened.
    fn connections(&self, role: &str) -> Result<Vec<OwnedFd>, SpawnError> {
        self.connect
            .iter()
            .map(|f| {
                let (made, what) = match f {
                    Fresh::Connect(p) => (
                        std::os::unix::net::UnixStream::connect(p).map(OwnedFd::from),
                        format!("connecting to {}", p.display()),
                    ),
                    Fresh::Open(p) => (
                        std::fs::OpenOptions::new()
                            .read(true)
                            .write(true)
                            .open(p)
                            .map(OwnedFd::from),
                        format!("opening {}", p.display()),
                    ),
                };
                made.map_err(|err| SpawnError::Descriptor {
                    role: role.into(),
                    what,
                    err,
                })
            })
            .collect()
    }

    /// What the child gets, as numbered by [`fd_layout`]: channel, `keep`, connections,
    /// broker.
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

/// One incarnation's descriptors: the manager's ends, and what the child gets.
struct Incarnation {
    events: Option<OwnedFd>,
    broker: Option<OwnedFd>,
    fresh: Vec<OwnedFd>,
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
pub fn inherited_fd(n: i32) -> Result<OwnedFd, std::io::Error> {
    outboard_sys::process::inherited_socket(n)
        .map_err(|e| std::io::Error::other(format!("--notify-fd: {e}")))
}

impl Process {
    /// Watches its channels to the manager in `work` as child `i`: its events, and an
    /// export's questions.
    pub(crate) fn watch(&self, work: &mut outboard_env::WorkLoop<crate::Source>, i: usize) {
        if let Some(ev) = &self.events {
            let _ = work.add(ev.as_fd(), crate::Source::Events(i));
        }
        if let Some(b) = &self.broker {
            let _ = work.add(b.as_fd(), crate::Source::Broker(i));
        }
    }

    /// Stops watching its channels (see [`Process::watch`]).
    pub(crate) fn unwatch(&self, work: &mut outboard_env::WorkLoop<crate::Source>) {
        for fd in self.events.iter().chain(&self.broker) {
            let _ = work.remove(fd.as_fd());
        }
    }

    /// Starts `exe args…` with its output in `log`.
    pub fn spawn(
        exe: &Path,
        role: &str,
        args: &[String],
        log: PathBuf,
        verbose: u8,
    ) -> Result<Self, SpawnError> {
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
    ) -> Result<Self, SpawnError> {
        let mut p = Self::spawn_with(exe, role, args, log, verbose, &passing, false)?;
        p.passing = passing;
        Ok(p)
    }

    /// A driver server started from `args`, its typed command line.
    pub fn spawn_server(
        exe: &Path,
        role: &str,
        args: crate::children::DriverHostArgs,
        log: PathBuf,
        verbose: u8,
        passing: Passing,
    ) -> Result<Self, SpawnError> {
        let mut p = Self::spawn_passing(exe, role, &args.command_line(), log, verbose, passing)?;
        p.server = Some(args);
        Ok(p)
    }

    /// How the next incarnation of a driver server starts: new arguments and device
    /// connections (a server that lost a device).
    pub fn set_server(&mut self, args: crate::children::DriverHostArgs, connect: Vec<Fresh>) {
        self.server = Some(args);
        self.passing.connect = connect;
    }

    /// A restart needs descriptors (an event channel, a pidfd, a log, connections to its
    /// models). A manager short of them postpones it by `wait`, without counting it against
    /// the device: being flooded must never give a device up. True if postponed.
    pub fn postponed_for_descriptors(&mut self, wait: Duration) -> bool {
        if free_descriptors() >= RESTART_RESERVE {
            return false;
        }
        tracing::warn!(
            "{}: fewer than {RESTART_RESERVE} descriptors free; restart postponed",
            self.role
        );
        self.restart_at = Some(Instant::now() + wait);
        true
    }

    /// Starts the process again as it was started (its log goes on, after the last
    /// incarnation's): a new pid, pidfd and event channel.
    pub fn respawn(&mut self, exe: &Path, verbose: u8) -> Result<(), SpawnError> {
        // A fresh event channel and fresh device connections; the same listeners and disk.
        if let Some(server) = &self.server {
            self.args = server.command_line();
        }
        let next = Self::spawn_with(
            exe,
            &self.role,
            &self.args,
            self.log.clone(),
            verbose,
            &self.passing,
            true,
        )?;
        self.succeed(next);
        Ok(())
    }

    /// A driver server's next incarnation is its standby, handed this one's place: its
    /// arguments, listener and fresh connections to its models, at the numbers a restarted
    /// server would have found them.
    pub fn take_over(&mut self, standby: crate::standby::Standby) -> Result<(), SpawnError> {
        let Some(server) = &self.server else {
            return Err(SpawnError::NoEvents(self.role.clone()));
        };
        let conns = self.passing.connections(&self.role)?;
        let (keep_slots, conn_slots) = fd_layout(true, self.passing.keep.len(), conns.len());
        let fds: Vec<(i32, BorrowedFd<'_>)> =
            (keep_slots.into_iter().zip(self.passing.keep.iter()))
                .chain(conn_slots.into_iter().zip(conns.iter()))
                .map(|(slot, fd)| (slot, fd.as_fd()))
                .collect();
        let mut next = standby.take(server, &fds)?;
        drop(fds);
        next.role = self.role.clone();
        // This incarnation starts now, with the place: what happened to its device before (a
        // model started since the standby was) is not its doing.
        next.started = Instant::now();
        self.succeed(next);
        // Its arguments are the line it serves by, not the standby's own.
        if let Some(server) = &self.server {
            self.args = server.command_line();
        }
        Ok(())
    }

    /// Whether its standby can take its place at the next restart, run by `exe` (and drops a
    /// standby that cannot: another program, other arguments, or dead).
    pub fn standby_suits(&mut self, exe: &Path) -> bool {
        let fds = self.passing.keep.len() + self.passing.connect.len();
        let suits = match (&mut self.standby, &self.server) {
            (Some(s), Some(args)) => s.suits(exe, args, fds),
            _ => false,
        };
        if !suits {
            self.standby = None;
        }
        suits
    }

    /// `next` is its new incarnation: what the supervisor knows of it carries over.
    fn succeed(&mut self, mut next: Process) {
        next.passing = std::mem::take(&mut self.passing);
        *self = Self {
            kind: self.kind.clone(),
            restarts: std::mem::take(&mut self.restarts),
            down_since: self.down_since,
            timeline: std::mem::take(&mut self.timeline),
            suspect: std::mem::take(&mut self.suspect),
            quarantined: self.quarantined,
            server: self.server.take(),
            exe: self.exe.take(),
            standby: self.standby.take(),
            log: self.log.clone(),
            ..next
        };
    }

    /// Starts `exe args…` as [`Process::spawn_passing`] does, its output appended to `log`
    /// (a standby writes into its server's log).
    pub(crate) fn spawn_appending(
        exe: &Path,
        role: &str,
        args: &[String],
        log: PathBuf,
        verbose: u8,
        passing: &Passing,
    ) -> Result<Self, SpawnError> {
        Self::spawn_with(exe, role, args, log, verbose, passing, true)
    }

    /// Starts `exe args…` with its output in `log` and an event channel: the child finds its
    /// end as fd [`EVENT_FD`], and the manager's end is kept in [`Process::events`].
    pub fn spawn_with_events(
        exe: &Path,
        role: &str,
        args: &[String],
        log: PathBuf,
        verbose: u8,
    ) -> Result<Self, SpawnError> {
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
    ) -> Result<Self, SpawnError> {
        let Incarnation {
            events,
            broker,
            fresh,
        } = passing.incarnation(role)?;
        let out = crate::runtime::open_log(&log, append)?;
        let err = out.try_clone().map_err(|err| SpawnError::Descriptor {
            role: role.into(),
            what: "its log".into(),
            err,
        })?;
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
        outboard_sys::process::die_with_parent(&mut cmd, &passing.borrowed(&fresh)).map_err(
            |e| SpawnError::Descriptor {
                role: role.into(),
                what: "its descriptors".into(),
                err: std::io::Error::other(e),
            },
        )?;
        let child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|err| SpawnError::Exec {
                role: role.into(),
                exe: exe.to_owned(),
                err,
            })?;
        let pid = Pid::from_child(&child);
        let pidfd = rustix::process::pidfd_open(pid, PidfdFlags::empty()).map_err(|e| {
            SpawnError::Descriptor {
                role: role.into(),
                what: "its pidfd".into(),
                err: e.into(),
            }
        })?;
        Ok(Self {
            role: role.into(),
            child,
            pidfd,
            log,
            exited: None,
            events,
            broker,
            args: args.to_vec(),
            server: None,
            passing: Passing::default(),
            // The caller says what it is.
            kind: Kind::Export {
                name: String::new(),
            },
            restarts: Restarts::default(),
            down_since: None,
            timeline: Vec::new(),
            restart_at: None,
            gave_up: None,
            heartbeat: None,
            counters: None,
            served: false,
            hung: false,
            serve_by: None,
            planned: false,
            model_crashed: false,
            device_failed: None,
            suspect: Default::default(),
            quarantined: 0,
            started: Instant::now(),
            exe: None,
            graceful: None,
            standby: None,
            standby_at: None,
        })
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills it for not answering (`why`: what it failed to do); its death is weighed as a
    /// hang, a fault of its own.
    pub fn kill_as_hung(&mut self, why: &str) {
        tracing::error!("{} (pid {}) {why}; killing it", self.role, self.pid());
        self.hung = true;
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::KILL,
        );
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
    pub fn wait_serving(&mut self, timeout: Duration) -> Result<Vec<OwnedFd>, SpawnError> {
        let deadline = Instant::now() + timeout;
        loop {
            let Some(ev) = self.events.as_ref() else {
                return Err(SpawnError::NoEvents(self.role.clone()));
            };
            match outboard_session::control::recv::<outboard_session::control::Event>(
                ev.as_fd(),
                Some(Duration::from_millis(10)),
            ) {
                Ok((outboard_session::control::Event::Serving { .. }, fds)) => return Ok(fds),
                Ok(_) | Err(outboard_session::SessionError::Timeout) => {}
                Err(_) => {
                    // The channel closed: it is exiting.
                    let _ = self.child.wait().map(|s| self.exited = Some(s));
                }
            }
            if self.reap() || self.exited.is_some() {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                return Err(SpawnError::ExitedEarly {
                    role: self.role.clone(),
                    status: self.exited.expect("reaped"),
                    log: log.trim().to_string(),
                });
            }
            if Instant::now() > deadline {
                return Err(SpawnError::NotServing {
                    role: self.role.clone(),
                    timeout,
                });
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
            assert!(k.may_report(&Event::Serving {
                startup: Vec::new()
            }));
        }
    }
}
