//! The block class's dispatcher in a driver server: takes block requests out of sessions,
//! validates them, orders overlapping writes and locks ([`crate::ranges`]), hands them to the
//! driver under host-chosen tags, and routes completions back. The server core handles the
//! device's life (deadlines, failure, recovery, buffer mappings); this says what each outcome
//! means to a block client: every request in the device has a deadline, a stall times them
//! out, an outage answers "restarting" or "device failed".
//!
//! Clients are untrusted: every entry is decoded and validated; a bad entry gets an error
//! completion; duplicate tags are refused; each session may have at most as many requests
//! unanswered as its completion ring can hold, so completions always have room; a round takes
//! at most [`BUDGET`] entries per session, so one busy client cannot starve the others.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use outboard_env::{AnyDriver, Driver, Failure};
use outboard_server::session::Session;
use outboard_server::{Code, Ctx, Dispatcher, Fate, HeldBack, HostStats, Outage, Refusal};
use outboard_session::RingShape;

use crate::ranges::{range_of, Decision, Range, RangeLocks};
use outboard_block::BlockDriver;
use outboard_block::{validate, Kept, Sqe, CLASS, RINGS, SQE_SIZE};
use outboard_block::{BlockError, BlockOp, BlockRequest};

/// The block session's inbound ring of submissions (the first of [`RINGS`] to the server).
const SUBMISSIONS: usize = 0;
/// Its outbound ring of completions (the first of [`RINGS`] to the client).
const COMPLETIONS: usize = 0;

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
    /// The same, in the turn clock's nanoseconds (to time it).
    since_ns: u64,
    /// The blocks it changes, if it is a write (a lock waits for it).
    writes: Option<Range>,
}

/// What the dispatcher keeps per session.
#[derive(Default)]
struct PerSession {
    /// Client tags taken and not yet answered.
    tags: HashSet<u64>,
}

/// A request's fingerprint for blame (`outboard_server::blame`): what a replay sends again.
fn fingerprint(r: &BlockRequest) -> [u64; 2] {
    [u64::from(r.op.code()) << 32 | u64::from(r.blocks), r.lba]
}

/// What an outage means to a block client.
fn outage_error(o: &Outage) -> BlockError {
    match o {
        Outage::Restarting => BlockError::Restarting,
        Outage::Failed(why) => BlockError::DeviceFailed(why.clone()),
    }
}

/// One block device being served.
pub struct BlockDispatcher {
    driver: Box<dyn BlockDriver>,
    /// Driver tag → the request it stands for.
    tags: Vec<Option<InFlight>>,
    free_tags: Vec<usize>,
    /// Range locks and the requests waiting on them.
    locks: RangeLocks,
    sessions: Vec<Option<PerSession>>,
    scratch: Vec<(u64, Result<u32, BlockError>)>,
    /// A request named at the last crash, waiting for another to go through the device
    /// first (session slot, request).
    held: HeldBack<BlockRequest>,
}

/// Whether a session other than `si` has a write to `range` in the device, or held back on
/// its way there (a lock granted meanwhile would let that write land inside it).
fn writes_elsewhere(
    tags: &[Option<InFlight>],
    held: &HeldBack<BlockRequest>,
    si: usize,
    range: Range,
) -> bool {
    let overlaps = |w: Range| w.0 < range.1 && range.0 < w.1;
    tags.iter()
        .flatten()
        .any(|t| t.session != si && t.writes.is_some_and(overlaps))
        || held
            .get()
            .is_some_and(|(s, r)| s != si && r.op.modifies() && range_of(r).is_some_and(overlaps))
}

fn complete(s: &mut Session, stats: &mut HostStats, tag: u64, result: Result<u32, BlockError>) {
    stats.completed += 1;
    s.complete(COMPLETIONS, tag, &result);
}

impl BlockDispatcher {
    /// Serves a started block driver.
    pub fn new(driver: Box<dyn BlockDriver>) -> Self {
        Self {
            driver,
            tags: Vec::new(),
            free_tags: Vec::new(),
            locks: RangeLocks::default(),
            sessions: Vec::new(),
            scratch: Vec::new(),
            held: HeldBack::default(),
        }
    }

    /// Serves a started driver of any class: the block class's entry in a server's
    /// registration of classes.
    pub fn serve(
        driver: Box<dyn AnyDriver>,
    ) -> Result<Box<dyn Dispatcher>, outboard_env::WrongClass> {
        Ok(Box::new(Self::new(outboard_block::unbind(driver)?)))
    }

    /// A block driver ready for a driver server (tests and in-process servers; a driver
    /// server started by the manager goes through its registration of classes).
    pub fn served(
        driver: impl BlockDriver + 'static,
        env: outboard_env::DeviceEnv,
    ) -> outboard_server::Served {
        outboard_server::Served::new(Box::new(Self::new(Box::new(driver))), env)
    }

    /// Whether the device may take another request: room in the driver, and nothing in it
    /// while isolated.
    #[inline]
    fn room(&self, cx: &Ctx<'_>) -> bool {
        self.driver.has_room() && cx.may_enter(|| self.driver.in_flight())
    }

    #[inline]
    fn per_session(&mut self, slot: usize) -> Option<&mut PerSession> {
        self.sessions.get_mut(slot).and_then(Option::as_mut)
    }

    /// Sends a validated request of session `si` to the device. An error means submitting
    /// revealed that the device failed: the request then counts as in the device, and fails
    /// with everything else in it.
    fn send_to_device(
        &mut self,
        s: &mut Session,
        si: usize,
        r: &BlockRequest,
        iova: u64,
        stats: &mut HostStats,
        now: (Instant, u64),
    ) -> Result<(), Failure> {
        let Some(ps) = self.sessions.get_mut(si).and_then(Option::as_mut) else {
            return Ok(());
        };
        let slot = self.free_tags.pop().unwrap_or_else(|| {
            self.tags.push(None);
            self.tags.len() - 1
        });
        let (failed, refused) = match self.driver.submit(r, iova, slot as u64) {
            Ok(()) => (None, None),
            Err(BlockError::DeviceFailed(why)) => (Some(why), None),
            Err(e) => (None, Some(e)),
        };
        match refused {
            None => {
                self.tags[slot] = Some(InFlight {
                    session: si,
                    tag: r.tag,
                    since: now.0,
                    since_ns: now.1,
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
        failed.map_or(Ok(()), |why| Err(Failure::Driver(why)))
    }

    /// Names `r` in the blame page (while isolated) and sends it.
    fn enter(&mut self, si: usize, r: &BlockRequest, cx: &mut Ctx<'_>) -> Result<(), Failure> {
        let Some(iova) = cx.iova(si) else {
            return Ok(());
        };
        cx.entering(si, fingerprint(r));
        let now = (cx.now(), cx.now_ns());
        let Some(s) = cx.sessions[si].as_mut() else {
            return Ok(());
        };
        let sent = self.send_to_device(s, si, r, iova, cx.stats, now);
        if self.driver.in_flight() == 0 {
            // Refused (and answered): it is not in the device to blame.
            cx.refused();
        }
        sent
    }

    /// A validated request of session `si` goes on: granted (a lock), parked behind a
    /// conflicting one, or sent to the device.
    fn admit(&mut self, si: usize, r: BlockRequest, cx: &mut Ctx<'_>) -> Result<(), Failure> {
        let tags = &self.tags;
        let held = &self.held;
        let elsewhere = |s: usize, range: Range| writes_elsewhere(tags, held, s, range);
        match self.locks.admit(si, r, &elsewhere) {
            Decision::Granted => {
                if let Some(s) = cx.sessions[si].as_mut() {
                    complete(s, cx.stats, r.tag, Ok(0));
                }
                Ok(())
            }
            Decision::Parked => {
                if let Some(ps) = self.per_session(si) {
                    ps.tags.insert(r.tag);
                }
                Ok(())
            }
            Decision::Submit => self.enter(si, &r, cx),
        }
    }

    /// Lets the held-back request go on once the device can take it alone.
    fn release_held(&mut self, cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        if !self.held.is_holding() {
            return Ok(false);
        }
        let room = self.room(cx);
        let Some((si, r)) = self.held.release(room, self.driver.in_flight(), cx) else {
            return Ok(false);
        };
        if let Some(ps) = self.per_session(si) {
            ps.tags.remove(&r.tag);
        }
        self.admit(si, r, cx)?;
        Ok(true)
    }

    /// Lets parked requests go on as far as their conflicts have ended.
    fn release_parked(&mut self, cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        let mut progress = false;
        let mut out = Vec::new();
        while self.locks.has_parked() {
            out.clear();
            let room = usize::from(self.room(cx));
            let tags = &self.tags;
            self.locks.release(
                room,
                &|si: usize, range: Range| writes_elsewhere(tags, &self.held, si, range),
                &mut out,
            );
            if out.is_empty() {
                break;
            }
            progress = true;
            for (si, r, decision) in out.drain(..) {
                match decision {
                    Decision::Granted => {
                        if let Some(ps) = self.per_session(si) {
                            ps.tags.remove(&r.tag);
                        }
                        if let Some(s) = cx.sessions[si].as_mut() {
                            complete(s, cx.stats, r.tag, Ok(0));
                        }
                    }
                    _ => self.enter(si, &r, cx)?,
                }
            }
        }
        Ok(progress)
    }

    /// Routes the device's completions to their sessions.
    fn reap(&mut self, cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        self.scratch.clear();
        if let Err(f) = self.driver.poll(&mut self.scratch) {
            // The driver cannot tell what its device did: nothing in flight will complete.
            return Err(Failure::Driver(format!(
                "the driver lost track of the device: {f}"
            )));
        }
        let n = self.scratch.len();
        // The scratch vector is taken and put back, keeping its capacity: no allocation per
        // reap.
        let mut done = std::mem::take(&mut self.scratch);
        for (slot, result) in done.drain(..) {
            let Some(InFlight {
                session: si,
                tag,
                since_ns,
                ..
            }) = self.tags.get_mut(slot as usize).and_then(Option::take)
            else {
                continue;
            };
            self.free_tags.push(slot as usize);
            if let Some(ps) = self.per_session(si) {
                ps.tags.remove(&tag);
            }
            if cx.answer_timed(si, COMPLETIONS, tag, &result, since_ns) {
                cx.stats.completed += 1;
            }
        }
        self.scratch = done;
        if n > 0 && self.driver.in_flight() == 0 {
            cx.emptied();
        }
        Ok(n > 0)
    }
}

impl Dispatcher for BlockDispatcher {
    fn name(&self) -> &str {
        &self.driver.info().name
    }

    fn class(&self) -> &'static str {
        CLASS
    }

    fn error_kinds(&self) -> &'static [&'static str] {
        outboard_block::ERROR_KINDS
    }

    fn rings(&self) -> &'static [RingShape] {
        &RINGS
    }

    fn status(&self) -> serde_json::Value {
        let info = self.driver.info();
        let mut status = serde_json::to_value(info).expect("serialisable");
        // For people and programs reading the registry: the size in bytes beside the blocks
        // (a reader of `BlockInfo` ignores it).
        status["capacity_bytes"] = (info.capacity * u64::from(info.block_size)).into();
        status
    }

    fn driver(&self) -> &dyn Driver {
        self.driver.as_ref()
    }

    fn driver_mut(&mut self) -> &mut dyn Driver {
        self.driver.as_mut()
    }

    fn replace(&mut self, driver: Box<dyn AnyDriver>) -> Result<(), outboard_env::WrongClass> {
        self.driver = outboard_block::unbind(driver)?;
        Ok(())
    }

    fn open(&mut self, slot: usize, resumed: Option<&serde_json::Value>) -> Result<(), Refusal> {
        let locks: Vec<(u64, u32)> = match resumed {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(kept) => {
                serde_json::from_value::<Kept>(kept.clone())
                    .map_err(|e| {
                        Refusal::new(
                            Code::Invalid,
                            format!("the block session's kept state: {e}"),
                        )
                    })?
                    .locks
            }
        };
        let ranges: Vec<Range> = locks
            .iter()
            .map(|&(lba, n)| (lba, lba.saturating_add(n as u64)))
            .collect();
        let capacity = self.driver.info().capacity;
        if let Some(r) = ranges.iter().find(|r| r.1 > capacity) {
            return Err(Refusal::new(
                Code::Invalid,
                format!("lock on blocks {}..{} beyond the disk", r.0, r.1),
            ));
        }
        self.locks
            .reclaim(slot, &ranges)
            .map_err(|e| Refusal::new(Code::Invalid, e))?;
        if self.sessions.len() <= slot {
            self.sessions.resize_with(slot + 1, || None);
        }
        self.sessions[slot] = Some(PerSession::default());
        Ok(())
    }

    fn resume_grace(&mut self, grace: Duration) {
        self.locks.start_grace(grace);
    }

    fn take(&mut self, i: usize, cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        let Some(s) = cx.sessions[i].as_mut() else {
            return Ok(false);
        };
        if s.closing() || self.per_session(i).is_none() {
            return Ok(false);
        }
        let mut taken = 0;
        // Every request taken must find room in the completion ring later, so at most as many
        // are taken as the ring has free slots not already promised to requests in the device.
        // Each one taken (answered now or later) uses up one slot: the ring is read once.
        let outstanding = self.outstanding(i);
        let (room, mut cut) = match s.request_room(COMPLETIONS, BUDGET, outstanding) {
            Ok(room) => (room, false),
            Err(_) => (0, true),
        };
        let buffer_size = s.buffer_size();
        let mut lost = Ok(());
        // The outage does not change while requests are taken.
        let out_of_service = cx.outage().map(outage_error);
        while taken < BUDGET.min(room) {
            if out_of_service.is_none() && !self.room(cx) {
                break;
            }
            let mut e = [0u8; SQE_SIZE as usize];
            let s = cx.sessions[i].as_mut().expect("checked");
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
            let info = self.driver.info();
            let in_flight = &self.sessions[i].as_ref().expect("checked").tags;
            let result = sqe.decode().and_then(|r| {
                if let Some(e) = &out_of_service {
                    return Err(e.clone());
                }
                validate(&r, info, buffer_size)?;
                if in_flight.contains(&tag) {
                    return Err(BlockError::DuplicateTag);
                }
                Ok(r)
            });
            let result = match result {
                Ok(r) if cx.quarantined(i, || fingerprint(&r)) => Err(BlockError::Quarantined),
                other => other,
            };
            // Named at the last crash: it waits until another request has been through the
            // device (`outboard_server::blame`).
            let hold = matches!(&result, Ok(r) if self.held.wants(cx, i, || fingerprint(r)));
            let s = cx.sessions[i].as_mut().expect("checked");
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
                Ok(r) if hold => {
                    if let Some(ps) = self.per_session(i) {
                        ps.tags.insert(tag);
                    }
                    self.held.hold(i, r);
                }
                Ok(r) => {
                    lost = self.admit(i, r, cx);
                    if lost.is_err() {
                        break;
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
            cx.cut_off(i);
        }
        lost.map(|()| taken > 0)
    }

    fn progress(&mut self, cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        if self.driver.in_flight() > 0 {
            self.driver.kick().map_err(|f| {
                Failure::Driver(format!("the driver could not notify the device: {f}"))
            })?;
        }
        let reaped = self.reap(cx)?;
        let held = self.release_held(cx)?;
        Ok(self.release_parked(cx)? || reaped || held)
    }

    fn prepare_sleep(&mut self, _cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        if self.held.is_holding() && self.driver.in_flight() == 0 {
            // It goes at the next turn.
            return Ok(false);
        }
        if self.driver.in_flight() == 0 {
            return Ok(true);
        }
        match self.driver.arm() {
            Ok(waiting) => Ok(!waiting),
            Err(f) => Err(Failure::Driver(format!(
                "the driver could not arm its interrupt: {f}"
            ))),
        }
    }

    fn oldest_due(&self) -> Option<Instant> {
        self.tags.iter().flatten().map(|t| t.since).min()
    }

    fn fail_all(&mut self, fate: &Fate, cx: &mut Ctx<'_>) {
        let error = match fate {
            Fate::TimedOut => BlockError::Timeout,
            Fate::Out(o) => outage_error(o),
        };
        let mut stranded: Vec<(usize, u64)> = self
            .tags
            .drain(..)
            .flatten()
            .map(|t| (t.session, t.tag))
            .collect();
        stranded.extend(self.locks.clear().into_iter().map(|(si, r)| (si, r.tag)));
        stranded.extend(self.held.take().map(|(si, r)| (si, r.tag)));
        self.free_tags.clear();
        for (si, tag) in stranded {
            if let Some(ps) = self.per_session(si) {
                ps.tags.remove(&tag);
            }
            if let Some(s) = cx.sessions[si].as_mut() {
                complete(s, cx.stats, tag, Err(error.clone()));
            }
        }
    }

    #[inline]
    fn outstanding(&self, slot: usize) -> usize {
        self.sessions
            .get(slot)
            .and_then(Option::as_ref)
            .map_or(0, |ps| ps.tags.len())
    }

    fn close(&mut self, slot: usize) {
        let mut parked = self.locks.end_session(slot);
        parked.extend(self.held.take_of(slot));
        if let Some(ps) = self.per_session(slot) {
            for r in parked {
                ps.tags.remove(&r.tag);
            }
        }
    }

    fn release(&mut self, slot: usize) {
        if let Some(ps) = self.sessions.get_mut(slot) {
            *ps = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(op: BlockOp, lba: u64, blocks: u32) -> BlockRequest {
        BlockRequest {
            op,
            lba,
            blocks,
            buf_offset: 0,
            tag: 1,
        }
    }

    #[test]
    fn a_write_held_back_counts_as_on_its_way_for_another_sessions_lock() {
        let mut held = HeldBack::default();
        assert!(!writes_elsewhere(&[], &held, 0, (4, 12)));
        // Session 1's write of blocks 0..8, held back after a crash named it.
        held.hold(1, request(BlockOp::Write, 0, 8));
        assert!(writes_elsewhere(&[], &held, 0, (4, 12)), "overlapping");
        assert!(!writes_elsewhere(&[], &held, 0, (8, 16)), "beside it");
        assert!(
            !writes_elsewhere(&[], &held, 1, (4, 12)),
            "its own session's"
        );
        let mut read = HeldBack::default();
        read.hold(1, request(BlockOp::Read, 0, 8));
        assert!(
            !writes_elsewhere(&[], &read, 0, (4, 12)),
            "a read writes nothing"
        );
    }
}
