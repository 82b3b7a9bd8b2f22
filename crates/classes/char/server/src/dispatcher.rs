//! The char class's dispatcher: takes requests out of sessions, validates them (the client
//! is untrusted), copies the bytes of writes out of the sessions' buffer areas into the
//! driver in the order the writes came (one write's bytes are never interleaved with
//! another's), completes a write once the device has sent its last byte, and fills reads in
//! the order they came as bytes arrive.
//!
//! **Deadlines.** A read has none: it waits for bytes as long as it takes. A write has one
//! while it is not moving and flow control is not holding it: a device that stops sending is
//! stalled, a far end that holds CTS off is not.
//! **Restart.** Nothing of a session survives one ([`outboard_char::POLICY`]).

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use outboard_char::{
    encode_line, validate, CharDriver, CharError, CharOp, CharRequest, LineStatus, Sqe, CLASS,
    COMPLETIONS, LINES, REQUESTS, RINGS, SQE_SIZE,
};
use outboard_env::{AnyDriver, Driver, Failure};
use outboard_server::session::Session;
use outboard_server::{Code, Ctx, Dispatcher, Fate, HostStats, Outage, Refusal};
use outboard_session::RingShape;

/// Most entries taken from one session per round.
pub const BUDGET: usize = 32;
/// Bytes moved between a session's buffer area and the driver at a time.
const CHUNK: usize = 4096;

/// A write being sent.
struct Write {
    session: usize,
    tag: u64,
    offset: u64,
    len: u32,
    /// Bytes the driver has taken.
    taken: u32,
    /// The driver's byte count at which its last byte is sent (once all are taken).
    end: Option<u64>,
    /// Its session left: it is sent as far as the driver took it, and answered to nobody.
    orphan: bool,
}

/// A read waiting for bytes.
struct Read {
    session: usize,
    tag: u64,
    offset: u64,
    len: u32,
}

/// One serial line being served.
pub struct CharDispatcher {
    driver: Box<dyn CharDriver>,
    writes: VecDeque<Write>,
    reads: VecDeque<Read>,
    /// Per session: client tags taken and not yet answered.
    sessions: Vec<Option<HashSet<u64>>>,
    /// Bytes the driver has taken since it started.
    taken: u64,
    /// When sending last moved (a write was taken, or the device sent bytes), and the sent
    /// count then.
    moved: (Instant, u64),
    scratch: Vec<u8>,
}

fn complete(s: &mut Session, stats: &mut HostStats, tag: u64, result: Result<u32, CharError>) {
    stats.completed += 1;
    s.complete(COMPLETIONS, tag, &result);
}

fn outage_error(o: &Outage) -> CharError {
    match o {
        Outage::Restarting => CharError::Restarting,
        Outage::Failed(why) => CharError::DeviceFailed(why.clone()),
    }
}

/// A request's fingerprint for blame.
fn fingerprint(op: &CharOp) -> [u64; 2] {
    match *op {
        CharOp::Write { offset, len } => [1 << 32 | u64::from(len), offset],
        CharOp::Read { offset, len } => [2 << 32 | u64::from(len), offset],
        CharOp::Line => [3 << 32, 0],
        CharOp::SetLine(l) => [4 << 32 | u64::from(l.baud), 0],
    }
}

impl CharDispatcher {
    /// Serves a started char driver.
    pub fn new(driver: Box<dyn CharDriver>) -> Self {
        Self {
            moved: (Instant::now(), driver.counters().sent),
            driver,
            writes: VecDeque::new(),
            reads: VecDeque::new(),
            sessions: Vec::new(),
            taken: 0,
            scratch: vec![0; CHUNK],
        }
    }

    /// Serves a started driver of any class: the char class's entry in a server's
    /// registration of classes.
    pub fn serve(
        driver: Box<dyn AnyDriver>,
    ) -> Result<Box<dyn Dispatcher>, outboard_env::WrongClass> {
        Ok(Box::new(Self::new(outboard_char::unbind(driver)?)))
    }

    /// A char driver ready for a driver server (tests).
    pub fn served(
        driver: impl CharDriver + 'static,
        env: outboard_env::DeviceEnv,
    ) -> outboard_server::Served {
        outboard_server::Served::new(Box::new(Self::new(Box::new(driver))), env)
    }

    fn forget(&mut self, session: usize, tag: u64) {
        if let Some(t) = self.sessions.get_mut(session).and_then(Option::as_mut) {
            t.remove(&tag);
        }
    }

    /// Carries out a validated request of session `si`.
    fn enter(&mut self, si: usize, r: CharRequest, cx: &mut Ctx<'_>) -> Result<(), Failure> {
        if let Some(t) = self.sessions.get_mut(si).and_then(Option::as_mut) {
            t.insert(r.tag);
        }
        match r.op {
            CharOp::Write { offset, len } => {
                if self.writes.is_empty() {
                    self.moved = (cx.now(), self.driver.counters().sent);
                }
                self.writes.push_back(Write {
                    session: si,
                    tag: r.tag,
                    offset,
                    len,
                    taken: 0,
                    end: None,
                    orphan: false,
                });
                Ok(())
            }
            CharOp::Read { offset, len } => {
                self.reads.push_back(Read {
                    session: si,
                    tag: r.tag,
                    offset,
                    len,
                });
                Ok(())
            }
            CharOp::Line => {
                let status = LineStatus {
                    line: self.driver.line(),
                    counters: self.driver.counters(),
                };
                self.forget(si, r.tag);
                if let Some(s) = cx.sessions[si].as_mut() {
                    s.post(LINES, &encode_line(r.tag, &status));
                    complete(s, cx.stats, r.tag, Ok(0));
                }
                Ok(())
            }
            CharOp::SetLine(l) => {
                cx.entering(si, fingerprint(&r.op));
                let set = self.driver.set_line(&l);
                cx.emptied();
                self.forget(si, r.tag);
                let result = match &set {
                    Ok(Ok(())) => Ok(0),
                    Ok(Err(why)) => Err(CharError::Invalid(why.clone())),
                    Err(f) => Err(CharError::Io(f.to_string())),
                };
                if let Some(s) = cx.sessions[si].as_mut() {
                    complete(s, cx.stats, r.tag, result);
                }
                set.map(drop)
            }
        }
    }

    /// Hands the driver the bytes of the writes in order, as far as it takes them.
    fn feed(&mut self, cx: &mut Ctx<'_>) -> Result<(), Failure> {
        for w in self.writes.iter_mut().filter(|w| w.end.is_none()) {
            while w.taken < w.len {
                let n = ((w.len - w.taken) as usize).min(CHUNK);
                let Some(s) = cx.sessions[w.session].as_ref().filter(|_| !w.orphan) else {
                    // Its session left: the rest is not sent.
                    w.len = w.taken;
                    break;
                };
                let buf = &mut self.scratch[..n];
                if s.region
                    .buffers
                    .read(w.offset + u64::from(w.taken), buf)
                    .is_err()
                {
                    w.len = w.taken;
                    break;
                }
                cx.entering(
                    w.session,
                    fingerprint(&CharOp::Write {
                        offset: w.offset,
                        len: w.len,
                    }),
                );
                let took = self.driver.write(buf);
                cx.emptied();
                let took = took?.min(n);
                w.taken += took as u32;
                self.taken += took as u64;
                if took > 0 {
                    self.moved.0 = cx.now();
                }
                if took < n {
                    // The driver is full: asking again before it moved would only find it so
                    // (each call enters the driver and waits for its interrupts).
                    return Ok(());
                }
            }
            w.end = Some(self.taken);
        }
        Ok(())
    }

    /// Completes the writes whose last byte the device has sent.
    fn finish_writes(&mut self, cx: &mut Ctx<'_>) -> bool {
        // Until the first write is all in the driver none can finish: the count of bytes sent
        // (which enters the driver, and waits for its interrupts) is not asked; the feed
        // itself says the device moves.
        if self.writes.front().is_none_or(|w| w.end.is_none()) {
            return false;
        }
        let sent = self.driver.counters().sent;
        if sent != self.moved.1 {
            self.moved = (cx.now(), sent);
        }
        let mut any = false;
        while let Some(w) = self.writes.front() {
            match w.end {
                Some(end) if end <= sent => {}
                _ => break,
            }
            let w = self.writes.pop_front().expect("checked");
            if w.orphan {
                continue;
            }
            self.forget(w.session, w.tag);
            if let Some(s) = cx.sessions[w.session].as_mut() {
                complete(s, cx.stats, w.tag, Ok(w.len));
            }
            any = true;
        }
        any
    }

    /// Fills the reads in order with what has arrived.
    fn fill_reads(&mut self, cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        let mut any = false;
        while let Some(r) = self.reads.front() {
            let want = (r.len as usize).min(CHUNK);
            let n = self.driver.read(&mut self.scratch[..want])?.min(want);
            if n == 0 {
                break;
            }
            let r = self.reads.pop_front().expect("checked");
            self.forget(r.session, r.tag);
            if let Some(s) = cx.sessions[r.session].as_mut() {
                let result = match s.region.buffers.write(r.offset, &self.scratch[..n]) {
                    Ok(()) => Ok(n as u32),
                    Err(e) => Err(CharError::Invalid(format!("the buffer area: {e}"))),
                };
                complete(s, cx.stats, r.tag, result);
            }
            any = true;
        }
        Ok(any)
    }
}

impl Dispatcher for CharDispatcher {
    fn name(&self) -> &str {
        &self.driver.info().name
    }

    fn class(&self) -> &'static str {
        CLASS
    }

    fn error_kinds(&self) -> &'static [&'static str] {
        outboard_char::ERROR_KINDS
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
        self.driver = outboard_char::unbind(driver)?;
        // The core failed every request before the device was recovered (`fail_all`): no
        // write is left to be sent twice. The new driver counts from zero.
        debug_assert!(self.writes.is_empty(), "writes survived a recovery");
        self.writes.clear();
        self.taken = 0;
        self.moved = (Instant::now(), 0);
        Ok(())
    }

    fn open(&mut self, slot: usize, resumed: Option<&serde_json::Value>) -> Result<(), Refusal> {
        if resumed.is_some_and(|k| !k.is_null()) {
            return Err(Refusal::new(
                Code::Invalid,
                "a char session keeps no state across a restart",
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
        let buffer = s.buffer_size();
        // Every request taken may post a completion, and a line record besides.
        let room = s
            .request_room(COMPLETIONS, BUDGET, outstanding)
            .and_then(|c| s.completion_room(LINES, BUDGET).map(|t| c.min(t)));
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
                    validate(&r, self.driver.info(), buffer)?;
                    if in_flight.contains(&r.tag) {
                        return Err(CharError::DuplicateTag);
                    }
                    if cx.quarantined(i, || fingerprint(&r.op)) {
                        return Err(CharError::Quarantined);
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
        lost?;
        self.feed(cx)?;
        Ok(taken > 0)
    }

    fn progress(&mut self, cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        self.feed(cx)?;
        let wrote = self.finish_writes(cx);
        let read = self.fill_reads(cx)?;
        Ok(wrote || read)
    }

    fn prepare_sleep(&mut self, _cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        // The driver's source wakes the loop when anything moves; nothing to arm.
        Ok(true)
    }

    fn oldest_due(&self) -> Option<Instant> {
        // Only sending has a deadline, and only while flow control does not hold it.
        (!self.writes.is_empty() && !self.driver.held()).then_some(self.moved.0)
    }

    fn fail_all(&mut self, fate: &Fate, cx: &mut Ctx<'_>) {
        let error = match fate {
            Fate::TimedOut => CharError::Timeout,
            Fate::Out(o) => outage_error(o),
        };
        // A write may have been partly sent: it fails as interrupted, saying how far it got,
        // never as something to try again.
        let writes = self.writes.drain(..).filter(|w| !w.orphan).map(|w| {
            let why = format!(
                "{error}: {} of its {} bytes had been handed to the driver; they are not \
                     sent again",
                w.taken, w.len
            );
            (w.session, w.tag, CharError::Interrupted(why))
        });
        let reads = self
            .reads
            .drain(..)
            .map(|r| (r.session, r.tag, error.clone()));
        for (session, tag, e) in writes.chain(reads).collect::<Vec<_>>() {
            self.forget(session, tag);
            if let Some(s) = cx.sessions[session].as_mut() {
                complete(s, cx.stats, tag, Err(e));
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
        // Its reads end with it; the bytes of its writes the driver took are sent anyway,
        // the rest are not.
        self.reads.retain(|r| r.session != slot);
        for w in self.writes.iter_mut().filter(|w| w.session == slot) {
            w.orphan = true;
            if w.end.is_none() {
                w.len = w.taken;
            }
        }
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
