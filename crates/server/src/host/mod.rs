//! The driver host: a session multiplexer that runs drivers in the environment's loop and
//! hands each class's requests to that class's dispatcher ([`crate::dispatch`]).
//!
//! One thread, one [`WorkLoop`]: the control listener, each client's control socket, each
//! session's doorbell, each device's event sources and the deadline timer are typed event
//! sources ([`Source`]). While there is work the loop runs without system calls beyond the
//! device's own; before sleeping it announces sleep in every session and re-checks every ring
//! (the doorbell rule), so no wake-up is lost, and it arms the deadline timer for the oldest
//! request in any device, so a stalled device is noticed within its deadline.
//!
//! The multiplexer knows no class: opening (with the class's declared entry sizes), limits,
//! sleeping and waking, cutting off a client that breaks the ring protocol, and releasing a
//! session once its dispatcher says nothing of it is left in the device are the same for every
//! class. A client that dies (or is cut off) leaves nothing behind: its session waits for its
//! unanswered requests to finish in the device, then its buffers are unmapped from the device
//! and its memory and fds dropped.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_env::{AnyDriver, DeviceEnv, DeviceEvent, Timer, WorkLoop};
use outboard_session::control::{self, Reply, Request};
use outboard_session::doorbell::{announce_sleep, cancel_sleep};
use outboard_session::{Direction, Doorbell, Geometry, Region, SessionError};
use outboard_sys::SocketPath;

use crate::counters::{Counters, Described};
use crate::device::{Core, Device};
use crate::dispatch::{Code, Dispatcher, Refusal, TurnClock};
use crate::recovery::Reopen;
use crate::session::Session;

mod clients;
mod supervision;

/// What woke the driver host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A client is connecting.
    Listener,
    /// Control connection `i` has a message (or hung up).
    Conn(usize),
    /// Session `i`'s client rang.
    Bell(usize),
    /// Device `d` had an event.
    Device(usize, DeviceEvent),
    /// A request's deadline may have passed.
    Deadline,
    /// The manager sent a command on the event channel.
    Supervisor,
}

/// A device to serve, whatever its class: the dispatcher its class made for its driver, its
/// environment, and how to open it again after a failure.
pub struct Served {
    /// The class's dispatcher, holding the driver.
    pub dispatcher: Box<dyn Dispatcher>,
    /// Its environment.
    pub env: DeviceEnv,
    /// How to open it again, if it can be.
    pub reopen: Option<Reopen<(Box<dyn AnyDriver>, DeviceEnv)>>,
}

impl Served {
    /// Serves a device that cannot be re-opened (tests, in-process devices).
    pub fn new(dispatcher: Box<dyn Dispatcher>, env: DeviceEnv) -> Self {
        Self {
            dispatcher,
            env,
            reopen: None,
        }
    }

    /// Opens the device again with `reopen` after a failure.
    pub fn reopened_by(mut self, reopen: Reopen<(Box<dyn AnyDriver>, DeviceEnv)>) -> Self {
        self.reopen = Some(reopen);
        self
    }
}

/// A busy loop checks request deadlines once in this many rounds (the clock is not free).
const DEADLINE_ROUNDS: u32 = 64;

/// A busy loop looks at the sources only its sleep waits on (new connections and resumes,
/// control messages, the supervisor's commands, a device's own events) once in this many
/// rounds: a loop that always has work never sleeps, and a client resuming after a restart
/// had waited for a lull — seconds under load.
const EVENT_ROUNDS: u32 = 128;

/// How long a request that has a deadline (the class says which) may stay in a device before
/// the device is declared stalled; the class words the fate of what it held.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);

/// What clients may take from one server: memory is created by the server for each session
/// (and mapped into each device's DMA space), so a client must not be able to claim it all.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest buffer area of one session.
    pub session_buffer: u64,
    /// Largest sum of the buffer areas of all live sessions.
    pub total_buffer: u64,
    /// Most sessions open or draining at once.
    pub sessions: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            session_buffer: 64 << 20,
            total_buffer: 1 << 30,
            sessions: 256,
        }
    }
}

/// Counters, for status and tests.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct HostStats {
    /// Sessions opened.
    pub sessions_opened: u64,
    /// Sessions closed and fully released.
    pub sessions_released: u64,
    /// Requests completed.
    pub completed: u64,
    /// Requests refused by validation.
    pub rejected: u64,
    /// Clients cut off for breaking the protocol.
    pub cut_off: u64,
    /// Doorbells rung to clients.
    pub bells_rung: u64,
    /// Devices given up after a failure (lost, stalled past the deadline, driver error).
    pub device_failures: u64,
    /// Failed devices opened again and serving.
    pub device_recoveries: u64,
}

/// A driver server.
pub struct DriverHost {
    listener: OwnedFd,
    path: Option<SocketPath>,
    devices: Vec<Device>,
    conns: Vec<Option<(OwnedFd, Option<usize>)>>,
    sessions: Vec<Option<Session>>,
    work: WorkLoop<Source>,
    /// Wakes a sleeping loop when the oldest request in a device reaches its deadline.
    deadline_timer: Timer,
    next_session: u64,
    stats: HostStats,
    spin: Duration,
    deadline: Duration,
    /// When in-flight requests are next checked against the deadline.
    next_deadline_check: Instant,
    /// Rounds since the deadlines were last looked at: a busy loop reads the clock only every
    /// [`DEADLINE_ROUNDS`] rounds, a sleeping one at every wake-up.
    rounds: u32,
    /// Where to report events (device failures) to the manager, if one started us.
    notify: Option<OwnedFd>,
    /// A supervisor restarts this server and its clients resume: a failed device ends the
    /// process instead of failing the requests in it.
    restartable: bool,
    /// The word the loop bumps each turn, shared with the manager, which declares the server
    /// hung when it stops moving.
    heartbeat: Option<Arc<outboard_shm::SharedMem>>,
    limits: Limits,
    /// Per device: quiescing (its sessions' new requests wait in their rings), and whether
    /// that it has drained was reported.
    quiesce: Vec<Option<Quiesce>>,
    /// Per device and session counts, shared with the manager ([`crate::counters`]).
    counters: Option<Counters>,
    /// The time of the loop's turn, read once a turn if at all.
    clock: TurnClock,
}

/// A device being quiesced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quiesce {
    /// In-flight requests are finishing.
    Draining,
    /// Drained, and reported.
    Quiet,
}

/// The exit status of a restartable server whose device failed: its supervisor resets the
/// device and starts the server again.
pub const EXIT_DEVICE_FAILED: i32 = 75;

/// Why a driver server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// Its socket could not be set up.
    #[error("cannot listen: {0}")]
    Listen(#[from] SessionError),
    /// The work loop or a timer failed.
    #[error(transparent)]
    Loop(#[from] outboard_env::LoopError),
}

/// What device `d` needs from the host (disjoint from the device itself).
macro_rules! core {
    ($self:ident) => {
        Core {
            sessions: &mut $self.sessions,
            stats: &mut $self.stats,
            work: &mut $self.work,
            notify: $self.notify.as_ref().map(|n| n.as_fd()),
            restartable: $self.restartable,
            clock: &$self.clock,
        }
    };
}

impl DriverHost {
    /// Serves `devices` on a SEQPACKET socket at `path`.
    pub fn bind(path: &std::path::Path, devices: Vec<Served>) -> Result<Self, HostError> {
        let (listener, path) = control::listen(path)?;
        let mut h = Self::new(listener, devices)?;
        h.path = Some(path);
        Ok(h)
    }

    /// Serves `devices` on an already listening socket.
    pub fn new(listener: OwnedFd, devices: Vec<Served>) -> Result<Self, HostError> {
        let mut work = WorkLoop::new()?;
        work.add(listener.as_fd(), Source::Listener)?;
        let deadline_timer = Timer::new().map_err(outboard_env::LoopError::from)?;
        work.add(deadline_timer.fd(), Source::Deadline)?;
        let mut h = Self {
            listener,
            path: None,
            devices: devices
                .into_iter()
                .enumerate()
                .map(|(i, s)| Device::new(i, s.dispatcher, s.env, s.reopen))
                .collect(),
            conns: Vec::new(),
            sessions: Vec::new(),
            work,
            deadline_timer,
            next_session: 1,
            stats: HostStats::default(),
            spin: Duration::ZERO,
            deadline: DEFAULT_DEADLINE,
            next_deadline_check: Instant::now(),
            rounds: 0,
            notify: None,
            restartable: false,
            heartbeat: None,
            limits: Limits::default(),
            quiesce: Vec::new(),
            counters: None,
            clock: TurnClock::default(),
        };
        h.quiesce = vec![None; h.devices.len()];
        let described: Vec<Described> = h
            .devices
            .iter()
            .map(|d| Described {
                name: d.class.name().to_string(),
                class: d.class.class().to_string(),
                kinds: d.class.error_kinds().to_vec(),
            })
            .collect();
        h.counters = match Counters::create(&described) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!("counting nothing: {e}");
                None
            }
        };
        for d in 0..h.devices.len() {
            h.with_device(d, |dev, cx| dev.start(cx))?;
        }
        Ok(h)
    }

    /// Runs `f` on device `d` with what it needs from the host (disjoint fields of the host).
    fn with_device<R>(&mut self, d: usize, f: impl FnOnce(&mut Device, &mut Core<'_>) -> R) -> R {
        f(&mut self.devices[d], &mut core!(self))
    }

    /// Keeps no per-device or per-session counts (to measure what keeping them costs):
    /// sessions opened from now on are not counted, and the manager gets no counters page.
    pub fn without_counters(&mut self) {
        self.counters = None;
    }

    /// Counters.
    pub fn stats(&self) -> HostStats {
        self.stats
    }

    /// Sessions open or draining.
    pub fn live_sessions(&self) -> usize {
        self.sessions.iter().flatten().count()
    }

    /// Polls this long for new work before announcing sleep (adaptive mode; zero: block at
    /// once). Spinning trades CPU for the wake-up a sleeping host costs each client request.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// Sets what clients may take.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// Reports events to the manager on `fd` (a SEQPACKET socket).
    /// The manager's commands ([`control::Command`]) arrive on the same socket.
    pub fn set_notify(&mut self, fd: OwnedFd) -> Result<(), HostError> {
        self.work.add(fd.as_fd(), Source::Supervisor)?;
        self.notify = Some(fd);
        Ok(())
    }

    /// Lets a supervisor restart this server: a device that fails ends the process (exit
    /// status [`EXIT_DEVICE_FAILED`]) with its requests unanswered, for the clients to replay
    /// on the next server, instead of failing them.
    pub fn set_restartable(&mut self, restartable: bool) {
        self.restartable = restartable;
    }

    /// How long a request may stay in a device before the device counts as stalled.
    pub fn set_deadline(&mut self, deadline: Duration) {
        self.deadline = deadline;
    }

    /// Serves until `stop` is set.
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), HostError> {
        let mut ready = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            self.beat();
            if self.round() {
                if self.rounds.is_multiple_of(EVENT_ROUNDS) {
                    ready.clear();
                    self.work.wait(Some(Duration::ZERO), &mut ready)?;
                    for source in ready.drain(..) {
                        self.event(source)?;
                    }
                }
                continue;
            }
            if !self.spin.is_zero() {
                let until = Instant::now() + self.spin;
                let mut found = false;
                while Instant::now() < until {
                    if self.round() {
                        found = true;
                        break;
                    }
                    std::hint::spin_loop();
                }
                if found {
                    continue;
                }
            }
            if self.prepare_sleep() {
                ready.clear();
                self.arm_deadline()?;
                // Deadlines have their timer; the timeout bounds how late a stop request or a
                // device's recovery attempt is noticed.
                self.work
                    .wait(Some(Duration::from_millis(100)), &mut ready)?;
                // Time passed while it slept: what it finds next is timed.
                self.clock.slept();
                self.wake();
                self.check_deadlines();
                for source in ready.drain(..) {
                    self.event(source)?;
                }
            } else {
                self.wake();
            }
        }
        Ok(())
    }

    /// Serves on a thread until the returned flag is set (tests, benchmarks).
    pub fn spawn(
        mut self,
    ) -> (
        Arc<AtomicBool>,
        std::thread::JoinHandle<Result<HostStats, HostError>>,
    ) {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let t = std::thread::Builder::new()
            .name("driver-host".into())
            .spawn(move || self.run(&s).map(|()| self.stats))
            .expect("spawn driver host");
        (stop, t)
    }

    /// One pass over all rings and devices; returns whether anything happened.
    fn round(&mut self) -> bool {
        self.clock.turn();
        let mut progress = false;
        // Each round starts at the next session: a device with room for one request only
        // (an isolated one, after a crash) would otherwise always take the first session's,
        // and a request of a later session waited until isolation ended — where its crash
        // named nobody, and the quarantine of a request that kills the driver never came.
        let n = self.sessions.len();
        let first = if n == 0 { 0 } else { self.rounds as usize % n };
        for i in (first..n).chain(0..first) {
            let Some(d) = self.sessions[i]
                .as_ref()
                .filter(|s| !s.closing())
                .map(|s| s.device)
                .filter(|&d| self.quiesce[d].is_none())
            else {
                continue;
            };
            progress |= self.with_device(d, |dev, cx| dev.take(i, cx));
        }
        // Completions are found after the requests of this turn went in: they read the clock
        // anew, when they are timed (`crate::turn_clock`).
        self.clock.completions();
        for d in 0..self.devices.len() {
            progress |= self.with_device(d, |dev, cx| dev.progress(cx));
        }
        self.rounds = self.rounds.wrapping_add(1);
        if self.rounds.is_multiple_of(DEADLINE_ROUNDS) {
            self.check_deadlines();
        }
        for s in self.sessions.iter_mut().flatten() {
            if s.flush() {
                self.stats.bells_rung += 1;
            }
        }
        self.close_cut_sessions();
        self.release_finished();
        self.report_quiesced();
        progress
    }

    /// Closes the sessions a dispatcher cut off.
    fn close_cut_sessions(&mut self) {
        for i in 0..self.sessions.len() {
            if self.sessions[i].as_mut().is_some_and(Session::take_cut) {
                self.close_session(i);
            }
        }
    }

    /// Arms the deadline timer for the oldest request in any device, so a sleeping loop wakes
    /// when it expires.
    ///
    /// The timer may fire early, never late: armed no later than the oldest request's
    /// deadline, it is left as it is while requests come and go (a newer oldest request only
    /// moves the deadline later) and after the last one went (it then fires once for
    /// nothing). When it fires, the check fails what is overdue, and before the next sleep the
    /// timer is armed for the oldest request then. Re-arming for every request cost two `timerfd_settime`
    /// calls per request at queue depth 1 — as much as the device's own read of a small
    /// block.
    fn arm_deadline(&mut self) -> Result<(), HostError> {
        let Some(oldest) = self.devices.iter().filter_map(|d| d.oldest()).min() else {
            return Ok(());
        };
        let due = oldest + self.deadline;
        if self.deadline_timer.due().is_none_or(|at| at > due) {
            self.deadline_timer
                .arm_at(due)
                .map_err(outboard_env::LoopError::from)?;
        }
        Ok(())
    }

    /// Fails the devices whose oldest request has been in the device longer than the deadline.
    fn check_deadlines(&mut self) {
        let now = Instant::now();
        if now < self.next_deadline_check {
            return;
        }
        self.next_deadline_check = now + (self.deadline / 4).min(Duration::from_millis(250));
        let deadline = self.deadline;
        for d in 0..self.devices.len() {
            self.with_device(d, |dev, cx| dev.check_deadline(now, deadline, cx));
        }
    }

    /// Releases sessions whose clients left and whose requests have all finished.
    fn release_finished(&mut self) {
        for i in 0..self.sessions.len() {
            let Some(s) = self.sessions[i].as_ref() else {
                continue;
            };
            if !s.closing() || self.devices[s.device].outstanding(i) > 0 {
                continue;
            }
            let s = self.sessions[i].take().expect("checked");
            self.devices[s.device].release(i);
            let _ = self.work.remove(s.server_bell.fd());
            tracing::info!("session {} released", s.id);
            self.stats.sessions_released += 1;
            // Dropping `s` unmaps the region and closes its memfds and doorbells.
        }
    }

    /// Announces sleep in every session and re-checks; false if work turned up.
    fn prepare_sleep(&mut self) -> bool {
        for s in self.sessions.iter().flatten() {
            announce_sleep(s.region.server_sleeping());
        }
        if self
            .sessions
            .iter()
            .flatten()
            .any(|s| !s.closing() && self.quiesce[s.device].is_none() && s.has_submissions())
        {
            return false;
        }
        for d in 0..self.devices.len() {
            if !self.with_device(d, |dev, cx| dev.prepare_sleep(cx)) {
                return false;
            }
        }
        true
    }

    fn wake(&mut self) {
        for s in self.sessions.iter().flatten() {
            cancel_sleep(s.region.server_sleeping());
        }
    }

    fn event(&mut self, source: Source) -> Result<(), HostError> {
        // An event may come after a sleep: the turn's time is read again.
        self.clock.turn();
        match source {
            Source::Listener => {
                if let Ok(sock) = control::accept(self.listener.as_fd()) {
                    let slot = self
                        .conns
                        .iter()
                        .position(Option::is_none)
                        .unwrap_or_else(|| {
                            self.conns.push(None);
                            self.conns.len() - 1
                        });
                    self.work.add(sock.as_fd(), Source::Conn(slot))?;
                    self.conns[slot] = Some((sock, None));
                }
            }
            Source::Conn(i) => self.control_message(i),
            Source::Bell(i) => {
                if let Some(Some(s)) = self.sessions.get(i) {
                    s.server_bell.drain();
                }
            }
            Source::Deadline => {
                self.deadline_timer.ack();
                self.next_deadline_check = Instant::now();
                self.check_deadlines();
            }
            Source::Device(d, ev) if d < self.devices.len() => {
                self.with_device(d, |dev, cx| dev.event(ev, cx));
                self.close_cut_sessions();
            }
            Source::Device(..) => {}
            Source::Supervisor => self.command(),
        }
        Ok(())
    }
}
