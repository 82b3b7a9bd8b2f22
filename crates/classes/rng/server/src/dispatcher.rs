//! The entropy class's dispatcher: takes requests out of sessions, validates them (the client
//! is untrusted), hands them to the driver under server-chosen tags with the device address
//! of the client's buffer, and routes completions back. Every request in the device has a
//! deadline (a source of random bytes answers promptly or has stalled); what a failure means
//! to an entropy client: a stall times the requests out, an outage answers "restarting" or
//! "device failed". A session keeps no state across a restart.

use std::collections::HashSet;
use std::time::Instant;

use outboard_env::{AnyDriver, Driver, Failure};
use outboard_rng::{validate, EntropyDriver, EntropyError, Sqe, CLASS, RINGS, SQE_SIZE};
use outboard_server::session::Session;
use outboard_server::{Code, Ctx, Dispatcher, Fate, HostStats, Outage, Refusal};
use outboard_session::RingShape;

/// The session's inbound ring of requests and outbound ring of completions.
const REQUESTS: usize = 0;
const COMPLETIONS: usize = 0;

/// Most entries taken from one session per round.
pub const BUDGET: usize = 32;

/// A request in the device.
struct InFlight {
    session: usize,
    tag: u64,
    since: Instant,
    /// The same, in the turn clock's nanoseconds (to time it).
    since_ns: u64,
}

/// One entropy device being served.
pub struct EntropyDispatcher {
    driver: Box<dyn EntropyDriver>,
    tags: Vec<Option<InFlight>>,
    free_tags: Vec<usize>,
    /// Per session: client tags taken and not yet answered.
    sessions: Vec<Option<HashSet<u64>>>,
    scratch: Vec<(u64, Result<u32, EntropyError>)>,
}

fn complete(s: &mut Session, stats: &mut HostStats, tag: u64, result: Result<u32, EntropyError>) {
    stats.completed += 1;
    s.complete(COMPLETIONS, tag, &result);
}

fn outage_error(o: &Outage) -> EntropyError {
    match o {
        Outage::Restarting => EntropyError::Restarting,
        Outage::Failed(why) => EntropyError::DeviceFailed(why.clone()),
    }
}

/// A request's fingerprint for blame: what a replay sends again.
fn fingerprint(offset: u32, length: u32) -> [u64; 2] {
    [u64::from(length), u64::from(offset)]
}

impl EntropyDispatcher {
    /// Serves a started entropy driver.
    pub fn new(driver: Box<dyn EntropyDriver>) -> Self {
        Self {
            driver,
            tags: Vec::new(),
            free_tags: Vec::new(),
            sessions: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Serves a started driver of any class: the entropy class's entry in a server's
    /// registration of classes.
    pub fn serve(
        driver: Box<dyn AnyDriver>,
    ) -> Result<Box<dyn Dispatcher>, outboard_env::WrongClass> {
        Ok(Box::new(Self::new(outboard_rng::unbind(driver)?)))
    }

    /// An entropy driver ready for a driver server (tests).
    pub fn served(
        driver: impl EntropyDriver + 'static,
        env: outboard_env::DeviceEnv,
    ) -> outboard_server::Served {
        outboard_server::Served::new(Box::new(Self::new(Box::new(driver))), env)
    }

    fn room(&self, cx: &Ctx<'_>) -> bool {
        self.driver.has_room() && cx.may_enter(|| self.driver.in_flight())
    }

    /// Sends a validated request of session `si` into the device.
    fn enter(
        &mut self,
        si: usize,
        tag: u64,
        offset: u32,
        length: u32,
        cx: &mut Ctx<'_>,
    ) -> Result<(), Failure> {
        let Some(base) = cx.iova(si) else {
            return Ok(());
        };
        cx.entering(si, fingerprint(offset, length));
        let slot = self.free_tags.pop().unwrap_or_else(|| {
            self.tags.push(None);
            self.tags.len() - 1
        });
        let submitted = self
            .driver
            .submit(base + u64::from(offset), length, slot as u64);
        match submitted {
            Err(e) if !matches!(e, EntropyError::DeviceFailed(_)) => {
                self.free_tags.push(slot);
                cx.refused();
                cx.stats.rejected += 1;
                if let Some(s) = cx.sessions[si].as_mut() {
                    complete(s, cx.stats, tag, Err(e));
                }
                Ok(())
            }
            // Taken, or the submission revealed the device dead: either way the request
            // counts as in the device (and fails with it).
            r => {
                self.tags[slot] = Some(InFlight {
                    session: si,
                    tag,
                    since: cx.now(),
                    since_ns: cx.now_ns(),
                });
                if let Some(t) = self.sessions.get_mut(si).and_then(Option::as_mut) {
                    t.insert(tag);
                }
                match r {
                    Err(EntropyError::DeviceFailed(why)) => Err(Failure::Driver(why)),
                    _ => Ok(()),
                }
            }
        }
    }
}

impl Dispatcher for EntropyDispatcher {
    fn name(&self) -> &str {
        &self.driver.info().name
    }

    fn class(&self) -> &'static str {
        CLASS
    }

    fn error_kinds(&self) -> &'static [&'static str] {
        outboard_rng::ERROR_KINDS
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
        self.driver = outboard_rng::unbind(driver)?;
        Ok(())
    }

    fn open(&mut self, slot: usize, resumed: Option<&serde_json::Value>) -> Result<(), Refusal> {
        if resumed.is_some_and(|k| !k.is_null()) {
            return Err(Refusal::new(
                Code::Invalid,
                "an entropy session keeps no state across a restart",
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
        let (room, mut cut) = match s.request_room(COMPLETIONS, BUDGET, outstanding) {
            Ok(room) => (room, false),
            Err(_) => (0, true),
        };
        let buffer_size = s.buffer_size();
        let mut taken = 0;
        let mut lost = Ok(());
        // The outage does not change while requests are taken.
        let out_of_service = cx.outage().map(outage_error);
        while taken < BUDGET.min(room) {
            if out_of_service.is_none() && !self.room(cx) {
                break;
            }
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
            let r = Sqe(e).decode();
            let in_flight = self.sessions[i].as_ref().expect("checked");
            let checked = match &out_of_service {
                Some(e) => Err(e.clone()),
                None => validate(&r, self.driver.info(), buffer_size).and_then(|()| {
                    if in_flight.contains(&r.tag) {
                        Err(EntropyError::DuplicateTag)
                    } else {
                        Ok(())
                    }
                }),
            };
            let checked = match checked {
                Ok(()) if cx.quarantined(i, || fingerprint(r.buf_offset, r.length)) => {
                    Err(EntropyError::Quarantined)
                }
                other => other,
            };
            match checked {
                Ok(()) => {
                    lost = self.enter(i, r.tag, r.buf_offset, r.length, cx);
                    if lost.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    cx.stats.rejected += 1;
                    let s = cx.sessions[i].as_mut().expect("checked");
                    complete(s, cx.stats, r.tag, Err(e));
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
            self.driver.kick()?;
        }
        self.scratch.clear();
        self.driver.poll(&mut self.scratch)?;
        let n = self.scratch.len();
        let mut done = std::mem::take(&mut self.scratch);
        for (slot, result) in done.drain(..) {
            let Some(InFlight {
                session,
                tag,
                since_ns,
                ..
            }) = self.tags.get_mut(slot as usize).and_then(Option::take)
            else {
                continue;
            };
            self.free_tags.push(slot as usize);
            if let Some(t) = self.sessions.get_mut(session).and_then(Option::as_mut) {
                t.remove(&tag);
            }
            if cx.answer_timed(session, COMPLETIONS, tag, &result, since_ns) {
                cx.stats.completed += 1;
            }
        }
        self.scratch = done;
        if n > 0 && self.driver.in_flight() == 0 {
            cx.emptied();
        }
        Ok(n > 0)
    }

    fn prepare_sleep(&mut self, _cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        if self.driver.in_flight() == 0 {
            return Ok(true);
        }
        Ok(!self.driver.arm()?)
    }

    fn oldest_due(&self) -> Option<Instant> {
        self.tags.iter().flatten().map(|t| t.since).min()
    }

    fn fail_all(&mut self, fate: &Fate, cx: &mut Ctx<'_>) {
        let error = match fate {
            Fate::TimedOut => EntropyError::Timeout,
            Fate::Out(o) => outage_error(o),
        };
        self.free_tags.clear();
        for t in self.tags.drain(..).flatten() {
            if let Some(tags) = self.sessions.get_mut(t.session).and_then(Option::as_mut) {
                tags.remove(&t.tag);
            }
            if let Some(s) = cx.sessions[t.session].as_mut() {
                complete(s, cx.stats, t.tag, Err(error.clone()));
            }
        }
    }

    fn outstanding(&self, slot: usize) -> usize {
        self.sessions
            .get(slot)
            .and_then(Option::as_ref)
            .map_or(0, HashSet::len)
    }

    fn close(&mut self, _slot: usize) {}

    fn release(&mut self, slot: usize) {
        if let Some(s) = self.sessions.get_mut(slot) {
            *s = None;
        }
    }
}
