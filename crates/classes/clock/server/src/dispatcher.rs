//! The clock class's dispatcher: takes requests out of sessions, validates them (the client
//! is untrusted), answers `NOW` at once (the time record, then the completion) and keeps each
//! wait until the driver's tick count reaches its target.
//!
//! A wait's deadline is the moment its last tick is due (`n` periods after it was taken), and
//! with no wait the next tick is due ten periods after the count last moved: a clock that
//! stops ticking is declared stalled the server's deadline after that, waited on or not, and
//! a long wait is not taken for a stall. A session that leaves drops its waits (they hold
//! nothing in the device). Nothing of a session survives a restart: the client sends its waits
//! again and they count the new driver's ticks.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use outboard_clock::{
    encode_time, validate, ClockDriver, ClockError, ClockOp, ClockRequest, Sqe, CLASS, COMPLETIONS,
    REQUESTS, RINGS, SQE_SIZE, TIMES,
};
use outboard_env::{AnyDriver, Driver, Failure};
use outboard_server::session::Session;
use outboard_server::{Code, Ctx, Dispatcher, Fate, HostStats, Outage, Refusal};
use outboard_session::RingShape;

/// Most entries taken from one session per round.
pub const BUDGET: usize = 32;

/// A wait for ticks.
struct Wait {
    session: usize,
    tag: u64,
    /// The tick count when it was taken, and the count that completes it.
    from: u64,
    target: u64,
    /// When its last tick is due.
    due: Instant,
}

/// One clock device being served.
pub struct ClockDispatcher {
    driver: Box<dyn ClockDriver>,
    waits: Vec<Wait>,
    /// Per session: client tags taken and not yet answered.
    sessions: Vec<Option<HashSet<u64>>>,
    /// The tick count last seen, and when it was seen to move: a clock nobody waits on is
    /// still watched (its next tick is due).
    seen: (u64, Instant),
}

fn complete(s: &mut Session, stats: &mut HostStats, tag: u64, result: Result<u32, ClockError>) {
    stats.completed += 1;
    s.complete(COMPLETIONS, tag, &result);
}

fn outage_error(o: &Outage) -> ClockError {
    match o {
        Outage::Restarting => ClockError::Restarting,
        Outage::Failed(why) => ClockError::DeviceFailed(why.clone()),
    }
}

/// A request's fingerprint for blame.
fn fingerprint(op: ClockOp) -> [u64; 2] {
    match op {
        ClockOp::Wait(n) => [1, u64::from(n)],
        ClockOp::Now => [2, 0],
    }
}

impl ClockDispatcher {
    /// Serves a started clock driver.
    pub fn new(driver: Box<dyn ClockDriver>) -> Self {
        Self {
            seen: (driver.ticks(), Instant::now()),
            driver,
            waits: Vec::new(),
            sessions: Vec::new(),
        }
    }

    /// Serves a started driver of any class: the clock class's entry in a server's
    /// registration of classes.
    pub fn serve(
        driver: Box<dyn AnyDriver>,
    ) -> Result<Box<dyn Dispatcher>, outboard_env::WrongClass> {
        Ok(Box::new(Self::new(outboard_clock::unbind(driver)?)))
    }

    /// A clock driver ready for a driver server (tests).
    pub fn served(
        driver: impl ClockDriver + 'static,
        env: outboard_env::DeviceEnv,
    ) -> outboard_server::Served {
        outboard_server::Served::new(Box::new(Self::new(Box::new(driver))), env)
    }

    /// How long the count may stand still before the clock is overdue: ten periods, at
    /// least 100 ms.
    fn idle_grace(&self) -> Duration {
        (self.period() * 10).max(Duration::from_millis(100))
    }

    fn period(&self) -> Duration {
        Duration::from_nanos(1_000_000_000 / u64::from(self.driver.info().hz.max(1)))
    }

    /// Carries out a validated request of session `si`.
    fn enter(&mut self, si: usize, r: ClockRequest, cx: &mut Ctx<'_>) -> Result<(), Failure> {
        match r.op {
            ClockOp::Wait(n) => {
                let from = self.driver.ticks();
                self.waits.push(Wait {
                    session: si,
                    tag: r.tag,
                    from,
                    target: from + u64::from(n),
                    due: cx.now() + self.period() * n,
                });
                if let Some(t) = self.sessions.get_mut(si).and_then(Option::as_mut) {
                    t.insert(r.tag);
                }
                Ok(())
            }
            ClockOp::Now => {
                cx.entering(si, fingerprint(r.op));
                let read = self.driver.now();
                cx.emptied();
                let Some(s) = cx.sessions[si].as_mut() else {
                    return read.map(drop);
                };
                match read {
                    Ok(t) => {
                        s.post(TIMES, &encode_time(r.tag, &t));
                        complete(s, cx.stats, r.tag, Ok(0));
                        Ok(())
                    }
                    Err(f) => {
                        complete(s, cx.stats, r.tag, Err(ClockError::Io(f.to_string())));
                        Err(f)
                    }
                }
            }
        }
    }
}

impl Dispatcher for ClockDispatcher {
    fn name(&self) -> &str {
        &self.driver.info().name
    }

    fn class(&self) -> &'static str {
        CLASS
    }

    fn error_kinds(&self) -> &'static [&'static str] {
        outboard_clock::ERROR_KINDS
    }

    fn rings(&self) -> &'static [RingShape] {
        &RINGS
    }

    fn status(&self) -> serde_json::Value {
        serde_json::to_value(self.driver.info()).expect("serialisable")
    }

    fn driver(&self) -> &dyn Driver {
        self.driver.as_ref()
    }

    fn driver_mut(&mut self) -> &mut dyn Driver {
        self.driver.as_mut()
    }

    fn replace(&mut self, driver: Box<dyn AnyDriver>) -> Result<(), outboard_env::WrongClass> {
        self.driver = outboard_clock::unbind(driver)?;
        self.seen = (self.driver.ticks(), Instant::now());
        Ok(())
    }

    fn open(&mut self, slot: usize, resumed: Option<&serde_json::Value>) -> Result<(), Refusal> {
        if resumed.is_some_and(|k| !k.is_null()) {
            return Err(Refusal::new(
                Code::Invalid,
                "a clock session keeps no state across a restart",
            ));
        }
        if self.sessions.len() <= slot {
            self.sessions.resize_with(slot + 1, || None);
        }
        self.sessions[slot] = Some(HashSet::new());
        Ok(())
    }

    fn take(&mut self, i: usize, cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        let Some(s) = cx.sessions[i].as_mut() else {
            return Ok(false);
        };
        if s.closing() || self.sessions.get(i).and_then(Option::as_ref).is_none() {
            return Ok(false);
        }
        let outstanding = self.outstanding(i);
        // Every request taken may post a completion, and a time record besides.
        let room = s
            .request_room(COMPLETIONS, BUDGET, outstanding)
            .and_then(|c| s.completion_room(TIMES, BUDGET).map(|t| c.min(t)));
        let (room, mut cut) = match room {
            Ok(room) => (room, false),
            Err(_) => (0, true),
        };
        let mut taken = 0;
        let mut lost = Ok(());
        let out_of_service = cx.outage().map(outage_error);
        while taken < BUDGET.min(room) {
            let mut e = [0u8; SQE_SIZE as usize];
            let s = cx.sessions[i].as_mut().expect("checked");
            match s.pop(REQUESTS, &mut e) {
                Ok(true) => {}
                Ok(false) => break,
                Err(_) => {
                    cut = true;
                    break;
                }
            }
            taken += 1;
            let (tag, decoded) = Sqe(e).decode();
            let in_flight = self.sessions[i].as_ref().expect("checked");
            let checked = match &out_of_service {
                Some(e) => Err(e.clone()),
                None => decoded.and_then(|r| {
                    validate(&r, self.driver.info())?;
                    if in_flight.contains(&r.tag) {
                        return Err(ClockError::DuplicateTag);
                    }
                    if cx.quarantined(i, || fingerprint(r.op)) {
                        return Err(ClockError::Quarantined);
                    }
                    Ok(r)
                }),
            };
            match checked {
                Ok(r) => {
                    lost = self.enter(i, r, cx);
                    if lost.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    cx.stats.rejected += 1;
                    let s = cx.sessions[i].as_mut().expect("checked");
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
        let now = self.driver.ticks();
        if now != self.seen.0 {
            self.seen = (now, cx.now());
        }
        if self.waits.is_empty() {
            return Ok(false);
        }
        let before = self.waits.len();
        let sessions = &mut self.sessions;
        self.waits.retain(|w| {
            if w.target > now {
                return true;
            }
            if let Some(t) = sessions.get_mut(w.session).and_then(Option::as_mut) {
                t.remove(&w.tag);
            }
            let passed = u32::try_from(now - w.from).unwrap_or(u32::MAX);
            if let Some(s) = cx.sessions[w.session].as_mut() {
                complete(s, cx.stats, w.tag, Ok(passed));
            }
            false
        });
        Ok(self.waits.len() < before)
    }

    fn prepare_sleep(&mut self, _cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        // The driver's source wakes the loop when the count moves; nothing to arm.
        Ok(true)
    }

    fn oldest_due(&self) -> Option<Instant> {
        // The next tick is due too, waited for or not: a clock that stops is caught.
        let next_tick = self.seen.1 + self.idle_grace();
        Some(
            self.waits
                .iter()
                .map(|w| w.due)
                .fold(next_tick, Instant::min),
        )
    }

    fn fail_all(&mut self, fate: &Fate, cx: &mut Ctx<'_>) {
        let error = match fate {
            Fate::TimedOut => ClockError::Timeout,
            Fate::Out(o) => outage_error(o),
        };
        for w in self.waits.drain(..) {
            if let Some(tags) = self.sessions.get_mut(w.session).and_then(Option::as_mut) {
                tags.remove(&w.tag);
            }
            if let Some(s) = cx.sessions[w.session].as_mut() {
                complete(s, cx.stats, w.tag, Err(error.clone()));
            }
        }
    }

    fn outstanding(&self, slot: usize) -> usize {
        self.sessions
            .get(slot)
            .and_then(Option::as_ref)
            .map_or(0, HashSet::len)
    }

    fn close(&mut self, slot: usize) {
        // Its waits hold nothing in the device: they end with it.
        self.waits.retain(|w| w.session != slot);
        if let Some(Some(tags)) = self.sessions.get_mut(slot) {
            tags.clear();
        }
    }

    fn release(&mut self, slot: usize) {
        if let Some(s) = self.sessions.get_mut(slot) {
            *s = None;
        }
    }
}
