//! The driver host: runs block drivers in one work loop and serves their class devices to any
//! number of sessions.
//!
//! One thread, one [`WorkLoop`]: the control listener, each client's control socket, each
//! session's doorbell and each driver's interrupt are event sources. While there is work the
//! loop runs without system calls beyond the device's own; before sleeping it announces sleep in
//! every session and re-checks every ring (the doorbell rule), so no wake-up is lost.
//!
//! Clients are untrusted: every entry is decoded and validated ([`outboard_class::block`]); a
//! bad entry gets an error completion; duplicate tags are refused; each session may take at
//! most as many requests as its completion ring can hold, so completions always have room; a
//! round serves at most [`BUDGET`] entries per session, so one busy client cannot starve the
//! others; corrupt ring indices cut that client off. A client that dies (or is cut off) leaves
//! nothing behind: its session waits for its in-flight requests to finish in the device, then
//! unmaps its buffers from the device and drops its memory and fds.

use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_class::block::{validate, Cqe, Sqe};
use outboard_class::{
    BlockCompletion, BlockDriver, BlockError, BlockOp, BlockRequest, ClassDriver,
};
use outboard_drivers::{Attachment, StartOptions, Started};
use outboard_env::{DeviceEnv, DeviceEvent, Mapping, Timer, WorkLoop};
use outboard_session::control::{self, Reply, Request};
use outboard_session::doorbell::{announce_sleep, cancel_sleep, peer_sleeping};
use outboard_session::region::ShmRing;
use outboard_session::{Consumer, Doorbell, Producer, Region, SessionError};
use outboard_sys::SocketPath;

use crate::ranges::{range_of, Decision, Range, RangeLocks};
use crate::recovery::{Recovery, Reopen};

/// What woke the driver host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
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
}

/// Adds device `d`'s event sources to the loop.
fn watch(
    work: &mut WorkLoop<Source>,
    driver: &dyn BlockDriver,
    d: usize,
) -> Result<(), outboard_env::LoopError> {
    for (ev, fd) in driver.sources() {
        work.add(fd, Source::Device(d, ev))?;
    }
    Ok(())
}

/// Removes device `d`'s event sources (before its driver is dropped or given up).
fn unwatch(work: &mut WorkLoop<Source>, driver: &dyn BlockDriver) {
    for (_, fd) in driver.sources() {
        let _ = work.remove(fd);
    }
}

/// A block device to serve: a started driver and its environment, and how to start it
/// again after a failure.
pub struct Served {
    /// The driver.
    pub driver: Box<dyn BlockDriver>,
    /// Its environment.
    pub env: DeviceEnv,
    /// How to start it again, if it can be.
    pub reopen: Option<Reopen<(Box<dyn BlockDriver>, DeviceEnv)>>,
}

impl Served {
    /// Serves a driver that cannot be re-opened (tests, in-process devices).
    pub fn new(driver: Box<dyn BlockDriver>, env: DeviceEnv) -> Self {
        Self {
            driver,
            env,
            reopen: None,
        }
    }

    /// Starts the personality `driver` (or the best match) on the device at `at`, and
    /// remembers how, so that a failed device is started again the same way.
    pub fn start(
        at: &Attachment,
        driver: Option<&str>,
        opts: StartOptions,
    ) -> Result<Self, outboard_drivers::StartError> {
        let (block, env, personality) = start_block(at, driver, &opts)?;
        let at = at.clone();
        let reopen: Reopen<(Box<dyn BlockDriver>, DeviceEnv)> = Arc::new(move || {
            start_block(&at, Some(personality), &opts)
                .map(|(d, env, _)| (d, env))
                .map_err(|e| e.to_string())
        });
        Ok(Self {
            driver: block,
            env,
            reopen: Some(reopen),
        })
    }
}

impl From<outboard_drivers::virtio_block::VirtioBlock> for Served {
    fn from(d: outboard_drivers::virtio_block::VirtioBlock) -> Self {
        let env = d.env();
        Self::new(Box::new(d), env)
    }
}

impl From<outboard_drivers::null_blk::NullBlock> for Served {
    fn from(d: outboard_drivers::null_blk::NullBlock) -> Self {
        Self::new(Box::new(d), DeviceEnv::virtual_device())
    }
}

fn start_block(
    at: &Attachment,
    driver: Option<&str>,
    opts: &StartOptions,
) -> Result<(Box<dyn BlockDriver>, DeviceEnv, &'static str), outboard_drivers::StartError> {
    let Started {
        driver,
        env,
        personality,
    } = outboard_drivers::start(at, driver, opts)?;
    match driver {
        ClassDriver::Block(b) => Ok((b, env, personality.driver)),
    }
}

/// Whether a session other than `si` has a write to `range` in the device.
fn writes_elsewhere(tags: &[Option<InFlight>], si: usize, range: Range) -> bool {
    tags.iter()
        .flatten()
        .any(|t| t.session != si && t.writes.is_some_and(|w| w.0 < range.1 && range.0 < w.1))
}

/// A busy loop checks request deadlines once in this many rounds (the clock is not free).
const DEADLINE_ROUNDS: u32 = 64;

/// Most entries taken from one session per round.
pub const BUDGET: usize = 32;

/// How long a request may stay in a device before the device is declared stalled and its
/// requests fail with [`BlockError::DeviceFailed`].
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

/// A request in a device.
struct InFlight {
    /// Session slot.
    session: usize,
    /// The client's tag.
    tag: u64,
    /// When it entered the device (for the deadline).
    since: Instant,
    /// The blocks it changes, if it is a write (a lock waits for it).
    writes: Option<Range>,
}

struct Device {
    host: Box<dyn BlockDriver>,
    env: DeviceEnv,
    reopen: Option<Reopen<(Box<dyn BlockDriver>, DeviceEnv)>>,
    /// Driver tag → the request it stands for.
    tags: Vec<Option<InFlight>>,
    free_tags: Vec<usize>,
    /// Range locks and the requests waiting on them.
    locks: RangeLocks,
    /// Why the device was given up; until it is back, every request fails at once with this.
    failed: Option<String>,
    /// The way back of a device that was given up.
    recovery: Option<Recovery<(Box<dyn BlockDriver>, DeviceEnv)>>,
}

struct Session {
    id: u64,
    device: usize,
    sock: Option<OwnedFd>,
    region: Region,
    sq: Consumer<ShmRing>,
    cq: Producer<ShmRing>,
    server_bell: Doorbell,
    client_bell: Doorbell,
    /// The buffer area in the device's DMA space (dropping it unmaps it).
    dma: Mapping,
    tags: HashSet<u64>,
    dirty: bool,
}

impl Session {
    fn closing(&self) -> bool {
        self.sock.is_none()
    }
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
    scratch: Vec<(u64, Result<u32, BlockError>)>,
    spin: Duration,
    deadline: Duration,
    /// When in-flight requests are next checked against the deadline.
    next_deadline_check: Instant,
    /// Rounds since the deadlines were last looked at: a busy loop reads the clock only every
    /// [`DEADLINE_ROUNDS`] rounds, a sleeping one at every wake-up.
    rounds: u32,
    /// Where to report events (device failures) to the manager, if one started us.
    notify: Option<OwnedFd>,
    limits: Limits,
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl DriverHost {
    /// Serves `devices` on a SEQPACKET socket at `path`.
    pub fn bind(path: &std::path::Path, devices: Vec<Served>) -> Result<Self, String> {
        let (listener, path) = control::listen(path).map_err(err)?;
        let mut h = Self::new(listener, devices)?;
        h.path = Some(path);
        Ok(h)
    }

    /// Serves `devices` on an already listening socket.
    pub fn new(listener: OwnedFd, devices: Vec<Served>) -> Result<Self, String> {
        let mut work = WorkLoop::new().map_err(err)?;
        work.add(listener.as_fd(), Source::Listener).map_err(err)?;
        let deadline_timer = Timer::new().map_err(err)?;
        work.add(deadline_timer.fd(), Source::Deadline)
            .map_err(err)?;
        let devices: Vec<Device> = devices
            .into_iter()
            .map(|s| Device {
                host: s.driver,
                env: s.env,
                reopen: s.reopen,
                tags: Vec::new(),
                free_tags: Vec::new(),
                locks: RangeLocks::default(),
                failed: None,
                recovery: None,
            })
            .collect();
        for (i, d) in devices.iter().enumerate() {
            watch(&mut work, d.host.as_ref(), i).map_err(err)?;
        }
        Ok(Self {
            listener,
            path: None,
            devices,
            conns: Vec::new(),
            sessions: Vec::new(),
            work,
            deadline_timer,
            next_session: 1,
            stats: HostStats::default(),
            scratch: Vec::new(),
            spin: Duration::ZERO,
            deadline: DEFAULT_DEADLINE,
            next_deadline_check: Instant::now(),
            rounds: 0,
            notify: None,
            limits: Limits::default(),
        })
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
    pub fn set_notify(&mut self, fd: OwnedFd) {
        self.notify = Some(fd);
    }

    /// How long a request may stay in a device before the device counts as stalled.
    pub fn set_deadline(&mut self, deadline: Duration) {
        self.deadline = deadline;
    }

    /// Serves until `stop` is set.
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), String> {
        let mut ready = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            if self.round()? {
                continue;
            }
            if !self.spin.is_zero() {
                let until = std::time::Instant::now() + self.spin;
                let mut found = false;
                while std::time::Instant::now() < until {
                    if self.round()? {
                        found = true;
                        break;
                    }
                    std::hint::spin_loop();
                }
                if found {
                    continue;
                }
            }
            if self.prepare_sleep()? {
                ready.clear();
                self.arm_deadline()?;
                // Deadlines have their timer; the timeout bounds how late a stop request or a
                // device's recovery attempt is noticed.
                self.work
                    .wait(Some(Duration::from_millis(100)), &mut ready)
                    .map_err(err)?;
                self.wake();
                self.check_deadlines();
                for t in ready.drain(..) {
                    self.event(t)?;
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
        std::thread::JoinHandle<Result<HostStats, String>>,
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
    fn round(&mut self) -> Result<bool, String> {
        let mut progress = false;
        for i in 0..self.sessions.len() {
            progress |= self.take_requests(i);
        }
        for d in 0..self.devices.len() {
            if self.devices[d].failed.is_some() {
                progress |= self.recover(d);
                continue;
            }
            if self.devices[d].host.in_flight() > 0 {
                if let Err(e) = self.devices[d].host.kick() {
                    self.fail_device(d, format!("the driver could not notify the device: {e}"));
                    continue;
                }
            }
            progress |= self.reap(d);
            progress |= self.release_parked(d);
        }
        self.rounds = self.rounds.wrapping_add(1);
        if self.rounds.is_multiple_of(DEADLINE_ROUNDS) {
            self.check_deadlines();
        }
        for s in self.sessions.iter_mut().flatten() {
            if std::mem::take(&mut s.dirty) {
                s.cq.publish();
                if peer_sleeping(s.region.client_sleeping()) {
                    s.client_bell.ring();
                    self.stats.bells_rung += 1;
                }
            }
        }
        self.release_finished();
        Ok(progress)
    }

    /// Moves up to [`BUDGET`] entries of session `i` into its device.
    fn take_requests(&mut self, i: usize) -> bool {
        let Some(s) = self.sessions[i].as_mut() else {
            return false;
        };
        if s.closing() {
            return false;
        }
        let dev = &mut self.devices[s.device];
        let mut taken = 0;
        let mut cut = false;
        while taken < BUDGET {
            // Every request taken must find room in the completion ring later.
            match s.cq.free() {
                Ok(free) if (free as usize) > s.tags.len() => {}
                Ok(_) => break,
                Err(_) => {
                    cut = true;
                    break;
                }
            }
            if dev.failed.is_none() && !dev.host.has_room() {
                break;
            }
            let mut e = [0u8; 32];
            match s.sq.pop(&mut e) {
                Ok(true) => {}
                Ok(false) => break,
                Err(_) => {
                    cut = true;
                    break;
                }
            }
            taken += 1;
            let sqe = Sqe(e);
            let tag = sqe.tag();
            let result = sqe.decode().and_then(|r| {
                if let Some(why) = &dev.failed {
                    return Err(BlockError::DeviceFailed(why.clone()));
                }
                validate(&r, dev.host.info(), s.region.geometry.buffer_size)?;
                if s.tags.contains(&tag) {
                    return Err(BlockError::DuplicateTag);
                }
                Ok(r)
            });
            match result {
                Ok(r) if r.op == BlockOp::Null => Self::complete(s, &mut self.stats, tag, Ok(0)),
                Ok(r) if r.op == BlockOp::Unlock => {
                    let done = if dev.locks.unlock(i, &r) {
                        Ok(0)
                    } else {
                        Err(BlockError::Invalid(
                            "unlock of a range this session did not lock".into(),
                        ))
                    };
                    Self::complete(s, &mut self.stats, tag, done);
                }
                Ok(r) => {
                    let in_flight =
                        |si: usize, range: Range| writes_elsewhere(&dev.tags, si, range);
                    match dev.locks.admit(i, r, &in_flight) {
                        Decision::Granted => Self::complete(s, &mut self.stats, tag, Ok(0)),
                        Decision::Parked => {
                            s.tags.insert(tag);
                        }
                        Decision::Submit => Self::to_device(dev, s, i, &r, &mut self.stats),
                    }
                }
                Err(BlockError::DuplicateTag) => {
                    // Completing under the duplicated tag would confuse the original request's
                    // completion; report it with the error code and the tag as given.
                    self.stats.rejected += 1;
                    Self::complete(s, &mut self.stats, tag, Err(BlockError::DuplicateTag));
                }
                Err(e) => {
                    self.stats.rejected += 1;
                    Self::complete(s, &mut self.stats, tag, Err(e));
                }
            }
        }
        if cut {
            tracing::warn!(
                "session {}: ring indices corrupt, cutting the client off",
                s.id
            );
            self.stats.cut_off += 1;
            self.close_session(i);
        }
        taken > 0
    }

    /// Sends a validated request of session `si` to its device.
    fn to_device(
        dev: &mut Device,
        s: &mut Session,
        si: usize,
        r: &BlockRequest,
        stats: &mut HostStats,
    ) {
        let slot = dev.free_tags.pop().unwrap_or_else(|| {
            dev.tags.push(None);
            dev.tags.len() - 1
        });
        match dev.host.submit(r, s.dma.iova(), slot as u64) {
            Ok(()) => {
                dev.tags[slot] = Some(InFlight {
                    session: si,
                    tag: r.tag,
                    since: Instant::now(),
                    writes: r.op.modifies().then(|| range_of(r)).flatten(),
                });
                s.tags.insert(r.tag);
            }
            Err(e) => {
                dev.free_tags.push(slot);
                s.tags.remove(&r.tag);
                stats.rejected += 1;
                Self::complete(s, stats, r.tag, Err(e));
            }
        }
    }

    /// Lets device `d`'s parked requests go on as far as their conflicts have ended.
    fn release_parked(&mut self, d: usize) -> bool {
        let mut progress = false;
        let mut out = Vec::new();
        loop {
            let dev = &mut self.devices[d];
            if dev.failed.is_some() || !dev.locks.has_parked() {
                break;
            }
            out.clear();
            let room = usize::from(dev.host.has_room());
            let tags = &dev.tags;
            dev.locks.release(
                room,
                &|si: usize, range: Range| writes_elsewhere(tags, si, range),
                &mut out,
            );
            if out.is_empty() {
                break;
            }
            progress = true;
            for (si, r, decision) in out.drain(..) {
                let Some(s) = self.sessions[si].as_mut() else {
                    continue;
                };
                match decision {
                    Decision::Granted => {
                        s.tags.remove(&r.tag);
                        Self::complete(s, &mut self.stats, r.tag, Ok(0));
                    }
                    _ => Self::to_device(dev, s, si, &r, &mut self.stats),
                }
            }
        }
        progress
    }

    fn complete(s: &mut Session, stats: &mut HostStats, tag: u64, result: Result<u32, BlockError>) {
        stats.completed += 1;
        if s.closing() {
            return;
        }
        // Room was reserved when the request was taken; a full ring here means the client
        // moved its head backwards, which the ring reports as corruption.
        let _ = s.cq.stage(&Cqe::encode(&BlockCompletion { tag, result }).0);
        s.dirty = true;
    }

    /// Routes device `d`'s completions to their sessions.
    fn reap(&mut self, d: usize) -> bool {
        self.scratch.clear();
        let dev = &mut self.devices[d];
        if let Err(e) = dev.host.poll(&mut self.scratch) {
            // The driver cannot tell what its device did: nothing in flight will complete.
            self.fail_device(d, format!("the driver lost track of the device: {e}"));
            return true;
        }
        let n = self.scratch.len();
        for (slot, result) in self.scratch.drain(..) {
            let Some(InFlight {
                session: si, tag, ..
            }) = dev.tags.get_mut(slot as usize).and_then(Option::take)
            else {
                continue;
            };
            dev.free_tags.push(slot as usize);
            if let Some(s) = self.sessions[si].as_mut() {
                s.tags.remove(&tag);
                Self::complete(s, &mut self.stats, tag, result);
            }
        }
        n > 0
    }

    /// Arms the deadline timer for the oldest request in any device, so a sleeping loop wakes
    /// when it expires.
    fn arm_deadline(&mut self) -> Result<(), String> {
        let oldest = self
            .devices
            .iter()
            .filter(|d| d.failed.is_none())
            .flat_map(|d| d.tags.iter().flatten().map(|t| t.since))
            .min();
        match oldest {
            Some(t) => self.deadline_timer.arm_at(t + self.deadline),
            None => self.deadline_timer.disarm(),
        }
        .map_err(err)
    }

    /// Fails the devices whose oldest request has been in the device longer than the deadline.
    fn check_deadlines(&mut self) {
        let now = Instant::now();
        if now < self.next_deadline_check {
            return;
        }
        self.next_deadline_check = now + (self.deadline / 4).min(Duration::from_millis(250));
        for d in 0..self.devices.len() {
            let oldest = self.devices[d].tags.iter().flatten().map(|t| t.since).min();
            if oldest.is_some_and(|t| now.duration_since(t) > self.deadline) {
                let why = format!(
                    "the device stalled: a request got no answer within {:?}",
                    self.deadline
                );
                self.fail_device(d, why);
            }
        }
    }

    /// Gives device `d` up: the device is abandoned (it must stop reaching session memory
    /// before that memory can be reused), every request in it fails with the reason, and
    /// every later request and open fails at once with it. Other devices carry on.
    fn fail_device(&mut self, d: usize, why: String) {
        let dev = &mut self.devices[d];
        if dev.failed.is_some() {
            return;
        }
        tracing::error!("device {}: {why}; giving it up", dev.host.info().name);
        self.stats.device_failures += 1;
        unwatch(&mut self.work, dev.host.as_ref());
        dev.host.abandon();
        dev.failed = Some(why.clone());
        dev.recovery = dev.reopen.clone().map(Recovery::new);
        if let Some(n) = &self.notify {
            let event = control::Event::DeviceFailed {
                device: dev.host.info().name.clone(),
                why: why.clone(),
            };
            if let Err(e) = control::try_send(n.as_fd(), &event, &[]) {
                tracing::warn!("cannot tell the manager: {e}");
            }
        }
        let mut stranded: Vec<(usize, u64)> = dev
            .tags
            .drain(..)
            .flatten()
            .map(|t| (t.session, t.tag))
            .collect();
        stranded.extend(dev.locks.clear().into_iter().map(|(si, r)| (si, r.tag)));
        dev.free_tags.clear();
        for (si, tag) in stranded {
            if let Some(s) = self.sessions[si].as_mut() {
                s.tags.remove(&tag);
                Self::complete(
                    s,
                    &mut self.stats,
                    tag,
                    Err(BlockError::DeviceFailed(why.clone())),
                );
            }
        }
    }

    /// Advances device `d`'s recovery; when the device is open again, swaps the new driver in,
    /// maps every live session's buffers into the new device, and carries on serving.
    fn recover(&mut self, d: usize) -> bool {
        let Some((new, env)) = self.devices[d].recovery.as_mut().and_then(Recovery::poll) else {
            return false;
        };
        if let Err(e) = watch(&mut self.work, new.as_ref(), d) {
            tracing::error!("device {d}: cannot watch the re-opened device: {e}");
            return false;
        }
        let dev = &mut self.devices[d];
        let old = std::mem::replace(&mut dev.host, new);
        dev.env = env;
        let name = dev.host.info().name.clone();
        let attempts = dev.recovery.take().map_or(0, |r| r.attempts);
        dev.failed = None;
        let mut lost = Vec::new();
        for (si, slot) in self.sessions.iter_mut().enumerate() {
            let Some(s) = slot.as_mut().filter(|s| s.device == d && !s.closing()) else {
                continue;
            };
            match dev.env.map(s.region.buffers.clone()) {
                Ok(dma) => {
                    // The old mapping unmaps from the old device, which is gone: that fails
                    // fast.
                    s.dma = dma;
                }
                Err(e) => {
                    tracing::warn!(
                        "session {}: cannot map into the re-opened device: {e}",
                        s.id
                    );
                    lost.push(si);
                }
            }
        }
        drop(old);
        for si in lost {
            self.close_session(si);
        }
        tracing::warn!("device {name}: back after {attempts} attempt(s)");
        self.stats.device_recoveries += 1;
        if let Some(n) = &self.notify {
            let event = control::Event::DeviceRecovered { device: name };
            if let Err(e) = control::try_send(n.as_fd(), &event, &[]) {
                tracing::warn!("cannot tell the manager: {e}");
            }
        }
        true
    }

    /// Releases sessions whose clients left and whose requests have all finished.
    fn release_finished(&mut self) {
        for slot in self.sessions.iter_mut() {
            if slot
                .as_ref()
                .is_some_and(|s| s.closing() && s.tags.is_empty())
            {
                let s = slot.take().expect("checked");
                let _ = self.work.remove(s.server_bell.fd());
                tracing::info!("session {} released", s.id);
                self.stats.sessions_released += 1;
                // Dropping `s` unmaps its buffers from the device (DmaBuf), then unmaps the
                // region and closes its memfds and doorbells.
            }
        }
    }

    /// Announces sleep in every session and re-checks; false if work turned up.
    fn prepare_sleep(&mut self) -> Result<bool, String> {
        for s in self.sessions.iter().flatten() {
            announce_sleep(s.region.server_sleeping());
        }
        for s in self.sessions.iter().flatten() {
            if !s.closing() && s.sq.available().map(|n| n > 0).unwrap_or(true) {
                return Ok(false);
            }
        }
        for d in 0..self.devices.len() {
            let dev = &mut self.devices[d];
            if dev.failed.is_some() || dev.host.in_flight() == 0 {
                continue;
            }
            match dev.host.arm() {
                Ok(true) => return Ok(false),
                Ok(false) => {}
                Err(e) => {
                    self.fail_device(d, format!("the driver could not arm its interrupt: {e}"));
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    fn wake(&mut self) {
        for s in self.sessions.iter().flatten() {
            cancel_sleep(s.region.server_sleeping());
        }
    }

    fn event(&mut self, source: Source) -> Result<(), String> {
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
                    self.work
                        .add(sock.as_fd(), Source::Conn(slot))
                        .map_err(err)?;
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
            Source::Device(d, ev) => {
                let Some(dev) = self.devices.get_mut(d).filter(|dev| dev.failed.is_none()) else {
                    return Ok(());
                };
                if let Err(failure) = dev.host.handle(ev) {
                    self.fail_device(d, failure.to_string());
                }
            }
        }
        Ok(())
    }

    fn control_message(&mut self, conn: usize) {
        let Some(Some((sock, session))) = self.conns.get(conn) else {
            return;
        };
        let session = *session;
        // The socket is readable (that is why we are here): never wait on a client.
        let reply = match control::recv::<Request>(sock.as_fd(), Some(Duration::ZERO)) {
            Ok((req, _fds)) => self.request(conn, req),
            Err(SessionError::Timeout) => return,
            Err(SessionError::Closed) | Err(SessionError::Os(_)) => {
                self.drop_conn(conn, session);
                return;
            }
            Err(e) => Err(("invalid", e.to_string())),
        };
        let Some(Some((sock, _))) = self.conns.get(conn) else {
            return;
        };
        let sent = match reply {
            Ok((reply, fds)) => {
                let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                control::try_send(sock.as_fd(), &reply, &borrowed)
            }
            Err((code, message)) => control::try_send(
                sock.as_fd(),
                &Reply::Error {
                    code: code.into(),
                    message,
                },
                &[],
            ),
        };
        if sent.is_err() {
            let session = self.conns[conn].as_ref().and_then(|c| c.1);
            self.drop_conn(conn, session);
        }
    }

    #[allow(clippy::type_complexity)]
    fn request(
        &mut self,
        conn: usize,
        req: Request,
    ) -> Result<(Reply, Vec<OwnedFd>), (&'static str, String)> {
        match req {
            Request::Status { device } => {
                let d = self.find(&device)?;
                Ok((
                    Reply::Status {
                        info: serde_json::to_value(self.devices[d].host.info())
                            .expect("serialisable"),
                    },
                    vec![],
                ))
            }
            Request::Open {
                device,
                class,
                geometry,
            } => {
                let d = self.find(&device)?;
                if class != "block" {
                    return Err((
                        "wrong-class",
                        format!("{device} is a block device, not a {class:?} device"),
                    ));
                }
                if (geometry.sqe_size, geometry.cqe_size)
                    != (
                        outboard_class::block::SQE_SIZE,
                        outboard_class::block::CQE_SIZE,
                    )
                {
                    return Err((
                        "invalid",
                        format!(
                            "the block class's rings carry {}-byte submissions and {}-byte \
                             completions, not {} and {}",
                            outboard_class::block::SQE_SIZE,
                            outboard_class::block::CQE_SIZE,
                            geometry.sqe_size,
                            geometry.cqe_size
                        ),
                    ));
                }
                if let Some(why) = &self.devices[d].failed {
                    return Err(("device-failed", format!("{device}: {why}")));
                }
                if self.conns[conn].as_ref().is_some_and(|c| c.1.is_some()) {
                    return Err(("busy", "this connection already has a session".into()));
                }
                geometry.check().map_err(|e| ("invalid", e.to_string()))?;
                self.admit(geometry.buffer_size)?;
                let region = Region::create(geometry).map_err(|e| ("resources", e.to_string()))?;
                // Zero copy: the device reaches the client's buffers directly.
                let dma = self.devices[d]
                    .env
                    .map(region.buffers.clone())
                    .map_err(|e| ("resources", e.to_string()))?;
                let (server_bell, client_bell) = (
                    Doorbell::new().map_err(|e| ("resources", e.to_string()))?,
                    Doorbell::new().map_err(|e| ("resources", e.to_string()))?,
                );
                let (cfd, bfd) = region.fds();
                let fds = vec![
                    cfd.try_clone_to_owned()
                        .map_err(|e| ("resources", e.to_string()))?,
                    bfd.try_clone_to_owned()
                        .map_err(|e| ("resources", e.to_string()))?,
                    server_bell
                        .fd()
                        .try_clone_to_owned()
                        .map_err(|e| ("resources", e.to_string()))?,
                    client_bell
                        .fd()
                        .try_clone_to_owned()
                        .map_err(|e| ("resources", e.to_string()))?,
                ];
                let slot = self
                    .sessions
                    .iter()
                    .position(Option::is_none)
                    .unwrap_or_else(|| {
                        self.sessions.push(None);
                        self.sessions.len() - 1
                    });
                self.work
                    .add(server_bell.fd(), Source::Bell(slot))
                    .map_err(|e| ("resources", e.to_string()))?;
                let id = self.next_session;
                self.next_session += 1;
                let sock = self.conns[conn]
                    .as_ref()
                    .map(|c| c.0.try_clone())
                    .transpose()
                    .map_err(|e| ("resources", e.to_string()))?;
                self.sessions[slot] = Some(Session {
                    id,
                    device: d,
                    sock,
                    sq: Consumer::new(region.sq(), geometry.sq_entries),
                    cq: Producer::new(region.cq(), geometry.cq_entries),
                    region,
                    server_bell,
                    client_bell,
                    dma,
                    tags: HashSet::new(),
                    dirty: false,
                });
                if let Some(c) = self.conns[conn].as_mut() {
                    c.1 = Some(slot);
                }
                self.stats.sessions_opened += 1;
                tracing::info!("session {id} opened on {device}");
                Ok((
                    Reply::Opened {
                        session: id,
                        geometry,
                        info: serde_json::to_value(self.devices[d].host.info())
                            .expect("serialisable"),
                    },
                    fds,
                ))
            }
        }
    }

    /// Refuses a session the limits do not allow.
    fn admit(&self, buffer_size: u64) -> Result<(), (&'static str, String)> {
        let l = self.limits;
        if buffer_size > l.session_buffer {
            return Err((
                "invalid",
                format!(
                    "a buffer area of {buffer_size} bytes is more than this server gives one \
                     session ({} bytes)",
                    l.session_buffer
                ),
            ));
        }
        let live = self.sessions.iter().flatten();
        let in_use: u64 = live.clone().map(|s| s.region.geometry.buffer_size).sum();
        if live.count() >= l.sessions || in_use + buffer_size > l.total_buffer {
            return Err((
                "busy",
                format!(
                    "this server is at its limit ({} sessions, {} of {} buffer bytes in use)",
                    self.live_sessions(),
                    in_use,
                    l.total_buffer
                ),
            ));
        }
        Ok(())
    }

    fn find(&self, name: &str) -> Result<usize, (&'static str, String)> {
        self.devices
            .iter()
            .position(|d| d.host.info().name == name)
            .ok_or(("no-such-device", format!("no device named {name:?} here")))
    }

    fn drop_conn(&mut self, conn: usize, session: Option<usize>) {
        if let Some(Some((sock, _))) = self.conns.get(conn) {
            let _ = self.work.remove(sock.as_fd());
        }
        if let Some(c) = self.conns.get_mut(conn) {
            *c = None;
        }
        if let Some(s) = session {
            self.close_session(s);
        }
    }

    /// Stops serving a session; it is released once its in-flight requests finish.
    fn close_session(&mut self, i: usize) {
        if let Some(s) = self.sessions[i].as_mut() {
            // Its locks end with it, and what it had waiting never starts.
            for r in self.devices[s.device].locks.end_session(i) {
                s.tags.remove(&r.tag);
            }
            if let Some(sock) = s.sock.take() {
                tracing::info!(
                    "session {}: client gone, draining {} request(s)",
                    s.id,
                    s.tags.len()
                );
                // Shut the socket down so the client sees the cut even if it holds a dup.
                let _ = rustix::net::shutdown(&sock, rustix::net::Shutdown::Both);
            }
        }
        for c in self.conns.iter_mut() {
            if c.as_ref().is_some_and(|c| c.1 == Some(i)) {
                if let Some((sock, _)) = c.take() {
                    let _ = self.work.remove(sock.as_fd());
                }
            }
        }
    }
}
