//! The block class's dispatcher: takes block requests out of sessions, validates them, orders
//! overlapping writes and locks ([`crate::ranges`]), hands them to the driver under host-chosen
//! tags, routes completions back, and handles the device's failure and recovery.
//!
//! Clients are untrusted: every entry is decoded and validated; a bad entry gets an error
//! completion; duplicate tags are refused; each session may have at most as many requests
//! unanswered as its completion ring can hold, so completions always have room; a round takes
//! at most [`BUDGET`] entries per session, so one busy client cannot starve the others.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_class::block::{validate, Cqe, Sqe, RINGS, SQE_SIZE};
use outboard_class::{
    BlockCompletion, BlockDriver, BlockError, BlockOp, BlockRequest, ClassDriver,
};
use outboard_env::{DeviceEnv, DeviceEvent, LoopError, Mapping};
use outboard_session::{control, RingShape};
use outboard_shm::SharedMem;

use crate::dispatch::{Ctx, Dispatcher, Refusal};
use crate::ranges::{range_of, Decision, Range, RangeLocks};
use crate::recovery::{Progress, Recovery, Reopen};
use crate::session::Session;

/// The block session's inbound ring of submissions (the first of [`RINGS`] to the server).
const SUBMISSIONS: usize = 0;
/// Its outbound ring of completions (the first of [`RINGS`] to the client).
const COMPLETIONS: usize = 0;

/// What failed a device, which decides what the requests in it get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// A request passed its deadline: the requests in the device timed out.
    Stalled,
    /// The device stopped working otherwise.
    Failed,
}

/// Most entries taken from one session per round.
pub const BUDGET: usize = 32;

/// A request in the device.
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

/// What the dispatcher keeps per session.
struct PerSession {
    /// Client tags taken and not yet answered.
    tags: HashSet<u64>,
    /// The buffer area in the device's DMA space.
    dma: Mapping,
}

/// What a recovery brings back: a started driver (of this class, for a personality of this
/// class) and its environment.
type Device = (ClassDriver, DeviceEnv);

/// One block device being served.
pub struct BlockDispatcher {
    driver: Box<dyn BlockDriver>,
    env: DeviceEnv,
    reopen: Option<Reopen<Device>>,
    /// Driver tag → the request it stands for.
    tags: Vec<Option<InFlight>>,
    free_tags: Vec<usize>,
    /// Range locks and the requests waiting on them.
    locks: RangeLocks,
    /// Why the device was given up; until it is back, every request fails at once with this.
    failed: Option<String>,
    /// The way back of a device that was given up.
    recovery: Option<Recovery<Device>>,
    sessions: Vec<Option<PerSession>>,
    scratch: Vec<(u64, Result<u32, BlockError>)>,
    /// Until then, one request at a time goes into the device, named in `blame` first (a
    /// server started after a crash: see [`crate::blame`]).
    isolated_until: Option<Instant>,
    blame: Option<Arc<SharedMem>>,
    /// Requests that crashed the driver too often: completed with an error, not sent.
    quarantine: Vec<crate::blame::Suspect>,
}

/// Whether a session other than `si` has a write to `range` in the device.
fn writes_elsewhere(tags: &[Option<InFlight>], si: usize, range: Range) -> bool {
    tags.iter()
        .flatten()
        .any(|t| t.session != si && t.writes.is_some_and(|w| w.0 < range.1 && range.0 < w.1))
}

fn complete(
    s: &mut Session,
    stats: &mut crate::HostStats,
    tag: u64,
    result: Result<u32, BlockError>,
) {
    stats.completed += 1;
    s.post(
        COMPLETIONS,
        &Cqe::encode(&BlockCompletion { tag, result }).0,
    );
}

impl BlockDispatcher {
    /// Serves a started block driver.
    pub fn new(
        driver: Box<dyn BlockDriver>,
        env: DeviceEnv,
        reopen: Option<Reopen<Device>>,
    ) -> Self {
        Self {
            driver,
            env,
            reopen,
            tags: Vec::new(),
            free_tags: Vec::new(),
            locks: RangeLocks::default(),
            failed: None,
            recovery: None,
            sessions: Vec::new(),
            scratch: Vec::new(),
            isolated_until: None,
            blame: None,
            quarantine: Vec::new(),
        }
    }

    /// Whether requests go into the device one at a time now.
    #[inline]
    fn isolated(&self) -> bool {
        self.isolated_until.is_some_and(|t| Instant::now() < t)
    }

    /// Whether the device may take another request: room in the driver, and nothing in it
    /// while isolated.
    #[inline]
    fn room(&self) -> bool {
        self.driver.has_room() && !(self.driver.in_flight() > 0 && self.isolated())
    }

    /// Whether `r` of session `s` is quarantined (and takes it off the list: one failure).
    fn quarantined(&mut self, s: &Session, r: &BlockRequest) -> bool {
        if self.quarantine.is_empty() {
            return false;
        }
        let key = crate::blame::session_key(s);
        match self.quarantine.iter().position(|q| q.matches(key, r)) {
            Some(i) => {
                let q = self.quarantine.remove(i);
                tracing::error!(
                    "session {}: request {q} crashed the driver {} times: failed, not sent again",
                    s.id,
                    outboard_class::block::QUARANTINE_AFTER
                );
                true
            }
            None => false,
        }
    }

    #[inline]
    fn per_session(&mut self, slot: usize) -> Option<&mut PerSession> {
        self.sessions.get_mut(slot).and_then(Option::as_mut)
    }

    /// Sends a validated request of session `si` to the device. Returns why the device
    /// failed, if submitting revealed that it did: the request then counts as in the device,
    /// and fails with it when the caller gives the device up.
    #[must_use]
    fn send_to_device(
        &mut self,
        s: &mut Session,
        si: usize,
        r: &BlockRequest,
        stats: &mut crate::HostStats,
    ) -> Option<String> {
        if let (Some(page), true) = (&self.blame, self.isolated()) {
            crate::blame::Suspect::of(crate::blame::session_key(s), r).write(page);
        }
        let ps = self.sessions.get_mut(si).and_then(Option::as_mut)?;
        let slot = self.free_tags.pop().unwrap_or_else(|| {
            self.tags.push(None);
            self.tags.len() - 1
        });
        let (failed, refused) = match self.driver.submit(r, ps.dma.iova(), slot as u64) {
            Ok(()) => (None, None),
            Err(BlockError::DeviceFailed(why)) => (Some(why), None),
            Err(e) => (None, Some(e)),
        };
        match refused {
            None => {
                self.tags[slot] = Some(InFlight {
                    session: si,
                    tag: r.tag,
                    since: Instant::now(),
                    writes: r.op.modifies().then(|| range_of(r)).flatten(),
                });
                ps.tags.insert(r.tag);
            }
            Some(e) => {
                self.free_tags.push(slot);
                ps.tags.remove(&r.tag);
                stats.rejected += 1;
                complete(s, stats, r.tag, Err(e));
            }
        }
        failed
    }

    /// Lets parked requests go on as far as their conflicts have ended.
    fn release_parked(&mut self, cx: &mut Ctx<'_>) -> bool {
        let mut progress = false;
        let mut out = Vec::new();
        loop {
            if self.failed.is_some() || !self.locks.has_parked() {
                break;
            }
            out.clear();
            let room = usize::from(self.room());
            let tags = &self.tags;
            self.locks.release(
                room,
                &|si: usize, range: Range| writes_elsewhere(tags, si, range),
                &mut out,
            );
            if out.is_empty() {
                break;
            }
            progress = true;
            for (si, r, decision) in out.drain(..) {
                let Some(s) = cx.sessions[si].as_mut() else {
                    continue;
                };
                match decision {
                    Decision::Granted => {
                        if let Some(ps) = self.sessions.get_mut(si).and_then(Option::as_mut) {
                            ps.tags.remove(&r.tag);
                        }
                        complete(s, cx.stats, r.tag, Ok(0));
                    }
                    _ => {
                        if let Some(why) = self.send_to_device(s, si, &r, cx.stats) {
                            self.fail(why, Cause::Failed, cx);
                            return true;
                        }
                    }
                }
            }
        }
        progress
    }

    /// Routes the device's completions to their sessions.
    fn reap(&mut self, cx: &mut Ctx<'_>) -> bool {
        self.scratch.clear();
        if let Err(f) = self.driver.poll(&mut self.scratch) {
            // The driver cannot tell what its device did: nothing in flight will complete.
            let why = format!("the driver lost track of the device: {f}");
            self.fail(why, Cause::Failed, cx);
            return true;
        }
        let n = self.scratch.len();
        // The scratch vector is taken and put back, keeping its capacity: no allocation per
        // reap.
        let mut done = std::mem::take(&mut self.scratch);
        for (slot, result) in done.drain(..) {
            let Some(InFlight {
                session: si, tag, ..
            }) = self.tags.get_mut(slot as usize).and_then(Option::take)
            else {
                continue;
            };
            self.free_tags.push(slot as usize);
            if let Some(ps) = self.sessions.get_mut(si).and_then(Option::as_mut) {
                ps.tags.remove(&tag);
            }
            if let Some(s) = cx.sessions[si].as_mut() {
                complete(s, cx.stats, tag, result);
            }
        }
        self.scratch = done;
        if n > 0 && self.driver.in_flight() == 0 {
            if let Some(page) = &self.blame {
                crate::blame::Suspect::clear(page);
            }
        }
        n > 0
    }

    /// What a request gets while the device is out of service: "restarting" while it is being
    /// re-opened (retry later), "device failed" with the reason once it is given up for good.
    fn out_of_service(&self) -> BlockError {
        match (&self.failed, &self.recovery) {
            (_, Some(_)) => BlockError::Restarting,
            (Some(why), None) => BlockError::DeviceFailed(why.clone()),
            (None, None) => BlockError::DeviceFailed("the device is not in service".into()),
        }
    }

    /// Gives the device up: it is abandoned (it must stop reaching session memory before
    /// that memory can be reused), and every request in it fails — "timed out" if the device
    /// stalled, else as [`BlockDispatcher::out_of_service`] says. Every later request and open
    /// fails at once the same way until the device is back.
    fn fail(&mut self, why: String, cause: Cause, cx: &mut Ctx<'_>) {
        if self.failed.is_some() {
            return;
        }
        if cx.restartable && cause == Cause::Failed {
            cx.end_for_restart(&self.driver.info().name, &why);
        }
        tracing::error!("device {}: {why}; giving it up", self.driver.info().name);
        cx.stats.device_failures += 1;
        cx.unwatch(self.driver.as_ref());
        self.driver.abandon();
        self.failed = Some(why.clone());
        self.recovery = self.reopen.clone().map(Recovery::new);
        cx.notify(&control::Event::DeviceFailed {
            device: self.driver.info().name.clone(),
            why: why.clone(),
            restarting: self.recovery.is_some(),
        });
        let mut stranded: Vec<(usize, u64)> = self
            .tags
            .drain(..)
            .flatten()
            .map(|t| (t.session, t.tag))
            .collect();
        stranded.extend(self.locks.clear().into_iter().map(|(si, r)| (si, r.tag)));
        self.free_tags.clear();
        let error = match cause {
            Cause::Stalled => BlockError::Timeout,
            Cause::Failed => self.out_of_service(),
        };
        for (si, tag) in stranded {
            if let Some(ps) = self.per_session(si) {
                ps.tags.remove(&tag);
            }
            if let Some(s) = cx.sessions[si].as_mut() {
                complete(s, cx.stats, tag, Err(error.clone()));
            }
        }
        if cx.restartable {
            // A stalled device's requests have their answer (they waited past their deadline);
            // everything else is served by the next server, on a reset device.
            for s in cx.sessions.iter_mut().flatten() {
                s.flush();
            }
            cx.end_for_restart(&self.driver.info().name, &why);
        }
    }

    /// Advances the recovery; when the device is open again, swaps the new driver in and maps
    /// every live session's buffers into the new device.
    fn recover(&mut self, cx: &mut Ctx<'_>) -> bool {
        let Some(recovery) = self.recovery.as_mut() else {
            return false;
        };
        let (new, env) = match recovery.poll() {
            Progress::Trying => return false,
            Progress::Back(device) => device,
            Progress::GaveUp(why) => {
                let name = self.driver.info().name.clone();
                tracing::error!("device {name}: {why}; given up for good");
                let why = format!("{}; {why}", self.failed.take().unwrap_or_default());
                self.failed = Some(why.clone());
                self.recovery = None;
                cx.notify(&control::Event::DeviceFailed {
                    device: name,
                    why,
                    restarting: false,
                });
                return true;
            }
        };
        let ClassDriver::Block(new) = new;
        if let Err(e) = cx.watch(new.as_ref()) {
            tracing::error!(
                "device {}: cannot watch the re-opened device: {e}",
                self.driver.info().name
            );
            return false;
        }
        let old = std::mem::replace(&mut self.driver, new);
        self.env = env;
        let attempts = self.recovery.take().map_or(0, |r| r.attempts);
        self.failed = None;
        for (si, ps) in self.sessions.iter_mut().enumerate() {
            let Some(ps) = ps.as_mut() else { continue };
            let Some(s) = cx.sessions[si].as_mut().filter(|s| !s.closing()) else {
                continue;
            };
            match self.env.map(s.region.buffers.clone()) {
                // The old mapping unmaps from the old device, which is gone: that fails fast.
                Ok(dma) => ps.dma = dma,
                Err(e) => {
                    tracing::warn!(
                        "session {}: cannot map into the re-opened device: {e}",
                        s.id
                    );
                    s.cut_off();
                }
            }
        }
        drop(old);
        tracing::warn!(
            "device {}: back after {attempts} attempt(s)",
            self.driver.info().name
        );
        cx.stats.device_recoveries += 1;
        cx.notify(&control::Event::DeviceRecovered {
            device: self.driver.info().name.clone(),
        });
        true
    }
}

impl Dispatcher for BlockDispatcher {
    fn name(&self) -> &str {
        &self.driver.info().name
    }

    fn class(&self) -> &'static str {
        "block"
    }

    fn rings(&self) -> &'static [RingShape] {
        &RINGS
    }

    fn status(&self) -> serde_json::Value {
        serde_json::to_value(self.driver.info()).expect("serialisable")
    }

    fn refuses(&self) -> Option<Refusal> {
        self.failed.as_ref()?;
        Some(match self.out_of_service() {
            BlockError::Restarting => (
                "restarting",
                format!("{} is being re-opened; try again", self.name()),
            ),
            e => ("device-failed", format!("{}: {e}", self.name())),
        })
    }

    fn start(&mut self, cx: &mut Ctx<'_>) -> Result<(), LoopError> {
        cx.watch(self.driver.as_ref())
    }

    fn open(&mut self, slot: usize, buffers: Arc<SharedMem>) -> Result<(), Refusal> {
        // Zero copy: the device reaches the client's buffers directly.
        let dma = self.env.map(buffers).map_err(|e| match e {
            // The device died under this server, which ends for its supervisor to bring it
            // back: the client waits for the next server, as for any restart.
            outboard_env::EnvError::Dma(outboard_hw::HwError::Gone(_)) => {
                ("restarting", e.to_string())
            }
            e => ("resources", e.to_string()),
        })?;
        if self.sessions.len() <= slot {
            self.sessions.resize_with(slot + 1, || None);
        }
        self.sessions[slot] = Some(PerSession {
            tags: HashSet::new(),
            dma,
        });
        Ok(())
    }

    fn take(&mut self, i: usize, cx: &mut Ctx<'_>) -> bool {
        let Some(s) = cx.sessions[i].as_mut() else {
            return false;
        };
        if s.closing() || self.per_session(i).is_none() {
            return false;
        }
        let mut taken = 0;
        // Every request taken must find room in the completion ring later, so at most as many
        // are taken as the ring has free slots not already promised to requests in the device.
        // Each one taken (answered now or later) uses up one slot: the ring is read once.
        let (room, mut cut) = match s.completion_room(COMPLETIONS) {
            Ok(free) => (free.saturating_sub(self.outstanding(i)), false),
            Err(_) => (0, true),
        };
        let mut lost = None;
        while taken < BUDGET.min(room) {
            if self.failed.is_none() && !self.room() {
                break;
            }
            let mut e = [0u8; SQE_SIZE as usize];
            match s.pop(SUBMISSIONS, &mut e) {
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
            let buffer_size = s.buffer_size();
            let out_of_service = self.failed.is_some().then(|| self.out_of_service());
            let info = self.driver.info();
            let in_flight = &self.sessions[i].as_ref().expect("checked").tags;
            let result = sqe.decode().and_then(|r| {
                if let Some(e) = out_of_service {
                    return Err(e);
                }
                validate(&r, info, buffer_size)?;
                if in_flight.contains(&tag) {
                    return Err(BlockError::DuplicateTag);
                }
                Ok(r)
            });
            let result = match result {
                Ok(r) if self.quarantined(s, &r) => Err(BlockError::Quarantined),
                other => other,
            };
            match result {
                Ok(r) if r.op == BlockOp::Null => complete(s, cx.stats, tag, Ok(0)),
                Ok(r) if r.op == BlockOp::Unlock => {
                    let done = if self.locks.unlock(i, &r) {
                        Ok(0)
                    } else {
                        Err(BlockError::Invalid(
                            "unlock of a range this session did not lock".into(),
                        ))
                    };
                    complete(s, cx.stats, tag, done);
                }
                Ok(r) => {
                    let tags = &self.tags;
                    let elsewhere = |si: usize, range: Range| writes_elsewhere(tags, si, range);
                    match self.locks.admit(i, r, &elsewhere) {
                        Decision::Granted => complete(s, cx.stats, tag, Ok(0)),
                        Decision::Parked => {
                            if let Some(ps) = self.per_session(i) {
                                ps.tags.insert(tag);
                            }
                        }
                        Decision::Submit => {
                            lost = self.send_to_device(s, i, &r, cx.stats);
                            if lost.is_some() {
                                break;
                            }
                        }
                    }
                }
                // Completing under the duplicated tag would confuse the original request's
                // completion; it is reported with the error code and the tag as given.
                Err(e) => {
                    cx.stats.rejected += 1;
                    complete(s, cx.stats, tag, Err(e));
                }
            }
        }
        if cut {
            tracing::warn!(
                "session {}: ring indices corrupt, cutting the client off",
                s.id
            );
            cx.stats.cut_off += 1;
            s.cut_off();
        }
        if let Some(why) = lost {
            self.fail(why, Cause::Failed, cx);
        }
        taken > 0
    }

    fn progress(&mut self, cx: &mut Ctx<'_>) -> bool {
        if self.failed.is_some() {
            return self.recover(cx);
        }
        if self.driver.in_flight() > 0 {
            if let Err(f) = self.driver.kick() {
                let why = format!("the driver could not notify the device: {f}");
                self.fail(why, Cause::Failed, cx);
                return true;
            }
        }
        let mut progress = self.reap(cx);
        progress |= self.release_parked(cx);
        progress
    }

    fn prepare_sleep(&mut self, cx: &mut Ctx<'_>) -> bool {
        if self.failed.is_some() || self.driver.in_flight() == 0 {
            return true;
        }
        match self.driver.arm() {
            Ok(false) => true,
            Ok(true) => false,
            Err(f) => {
                let why = format!("the driver could not arm its interrupt: {f}");
                self.fail(why, Cause::Failed, cx);
                false
            }
        }
    }

    fn event(&mut self, ev: DeviceEvent, cx: &mut Ctx<'_>) {
        if self.failed.is_some() {
            return;
        }
        if let Err(failure) = self.driver.handle(ev) {
            self.fail(failure.to_string(), Cause::Failed, cx);
        }
    }

    fn oldest(&self) -> Option<Instant> {
        if self.failed.is_some() {
            return None;
        }
        self.tags.iter().flatten().map(|t| t.since).min()
    }

    fn check_deadline(&mut self, now: Instant, deadline: Duration, cx: &mut Ctx<'_>) {
        if self
            .oldest()
            .is_some_and(|t| now.duration_since(t) > deadline)
        {
            let why = format!("the device stalled: a request got no answer within {deadline:?}");
            self.fail(why, Cause::Stalled, cx);
        }
    }

    #[inline]
    fn outstanding(&self, slot: usize) -> usize {
        self.sessions
            .get(slot)
            .and_then(Option::as_ref)
            .map_or(0, |ps| ps.tags.len())
    }

    fn isolate(&mut self, blame: Arc<SharedMem>, until: Instant) {
        self.blame = Some(blame);
        self.isolated_until = Some(until);
    }

    fn quarantine(&mut self, suspect: crate::blame::Suspect) {
        self.quarantine.push(suspect);
    }

    fn lock_grace(&mut self, grace: std::time::Duration) {
        self.locks.start_grace(grace);
    }

    fn reclaim(&mut self, slot: usize, locks: &[(u64, u32)]) -> Result<(), Refusal> {
        let ranges: Vec<Range> = locks
            .iter()
            .map(|&(lba, n)| (lba, lba.saturating_add(n as u64)))
            .collect();
        let capacity = self.driver.info().capacity;
        if let Some(r) = ranges.iter().find(|r| r.1 > capacity) {
            return Err((
                "invalid",
                format!("lock on blocks {}..{} beyond the disk", r.0, r.1),
            ));
        }
        self.locks
            .reclaim(slot, &ranges)
            .map_err(|e| ("invalid", e))
    }

    fn close(&mut self, slot: usize) {
        let parked = self.locks.end_session(slot);
        if let Some(ps) = self.per_session(slot) {
            for r in parked {
                ps.tags.remove(&r.tag);
            }
        }
    }

    fn release(&mut self, slot: usize) {
        // Dropping the mapping unmaps the buffers from the device.
        if let Some(ps) = self.sessions.get_mut(slot) {
            *ps = None;
        }
    }
}
