//! The network class's dispatcher: takes requests out of sessions and validates them (the
//! client is untrusted); sends transmitted frames to the driver under server-chosen tags with
//! the device address of the client's buffer (the device reads the frame where the client
//! wrote it); keeps each session's posted receive buffers, receive mode, multicast groups and
//! packet filter; and offers every received frame to every session, copying it into the
//! oldest posted buffer of each session that takes it (the server must look at a frame to
//! know whose it is, so a frame is copied once per session that takes it).
//!
//! Deadlines: a frame in the transmit queue has one (a NIC sends promptly or has stalled); a
//! posted receive buffer has none — it waits for traffic — and is not in the device: it
//! survives the device failing and being brought back. A failure answers the frames in the
//! device (`timed out`, `restarting`, `device failed`).

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use outboard_env::{AnyDriver, Driver, Failure};
use outboard_net::bpf::Program;
use outboard_net::reception::Reception;
use outboard_net::{
    validate, NetCounters, NetDriver, NetError, NetOp, NetRequest, Sqe, CLASS, RINGS, SQE_SIZE,
};
use outboard_server::session::Session;
use outboard_server::{Code, Ctx, Dispatcher, Fate, HostStats, Outage, Refusal};
use outboard_session::RingShape;

/// The session's inbound ring of requests and outbound ring of completions.
const REQUESTS: usize = 0;
const COMPLETIONS: usize = 0;

/// Most entries taken from one session per round.
pub const BUDGET: usize = 32;

/// A frame in the transmit queue.
struct InFlight {
    session: usize,
    tag: u64,
    since: Instant,
}

/// A piece of a session's buffer area waiting for a frame.
#[derive(Debug, Clone, Copy)]
struct Posted {
    tag: u64,
    offset: u64,
    len: u32,
}

/// What the dispatcher keeps of one session.
#[derive(Default)]
struct PerSession {
    /// Client tags taken and not yet answered: frames in the device and posted buffers.
    tags: HashSet<u64>,
    posted: VecDeque<Posted>,
    /// Its mode, groups and filter.
    reception: Reception,
}

/// One NIC being served.
pub struct NetDispatcher {
    driver: Box<dyn NetDriver>,
    tags: Vec<Option<InFlight>>,
    free_tags: Vec<usize>,
    sessions: Vec<Option<PerSession>>,
    sent: Vec<(u64, Result<u32, NetError>)>,
    counters: NetCounters,
}

fn complete(s: &mut Session, stats: &mut HostStats, tag: u64, result: Result<u32, NetError>) {
    stats.completed += 1;
    s.complete(COMPLETIONS, tag, &result);
}

fn outage_error(o: &Outage) -> NetError {
    match o {
        Outage::Restarting => NetError::Restarting,
        Outage::Failed(why) => NetError::DeviceFailed(why.clone()),
    }
}

/// A transmitted frame's fingerprint for blame: what a replay would send again.
fn fingerprint(r: &NetRequest) -> [u64; 2] {
    [u64::from(r.length), r.buf_offset]
}

/// Reads `len` bytes of a session's buffer area (a filter program, a list of groups).
fn read_buffer(s: &Session, offset: u64, len: u32) -> Result<Vec<u8>, NetError> {
    let mut v = vec![0u8; len as usize];
    s.region
        .buffers
        .read(offset, &mut v)
        .map_err(|_| NetError::BadBuffer)?;
    Ok(v)
}

impl NetDispatcher {
    /// Serves a started NIC driver.
    pub fn new(driver: Box<dyn NetDriver>) -> Self {
        Self {
            driver,
            tags: Vec::new(),
            free_tags: Vec::new(),
            sessions: Vec::new(),
            sent: Vec::new(),
            counters: NetCounters::default(),
        }
    }

    /// Serves a started driver of any class: the network class's entry in a server's
    /// registration of classes.
    pub fn serve(
        driver: Box<dyn AnyDriver>,
    ) -> Result<Box<dyn Dispatcher>, outboard_env::WrongClass> {
        Ok(Box::new(Self::new(outboard_net::unbind(driver)?)))
    }

    /// A NIC driver ready for a driver server (tests and in-process servers).
    pub fn served(
        driver: impl NetDriver + 'static,
        env: outboard_env::DeviceEnv,
    ) -> outboard_server::Served {
        outboard_server::Served::new(Box::new(Self::new(Box::new(driver))), env)
    }

    fn room(&self, cx: &Ctx<'_>) -> bool {
        self.driver.has_room() && cx.may_enter(|| self.driver.in_flight())
    }

    /// Hands a validated frame of session `si` to the device.
    fn transmit(&mut self, si: usize, r: &NetRequest, cx: &mut Ctx<'_>) -> Result<(), Failure> {
        let Some(base) = cx.iova(si) else {
            return Ok(());
        };
        if cx.isolated() {
            cx.entering(si, fingerprint(r));
        }
        let slot = self.free_tags.pop().unwrap_or_else(|| {
            self.tags.push(None);
            self.tags.len() - 1
        });
        match self
            .driver
            .transmit(base + r.buf_offset, r.length, slot as u64)
        {
            Err(e) if !matches!(e, NetError::DeviceFailed(_)) => {
                self.free_tags.push(slot);
                cx.stats.rejected += 1;
                if let Some(s) = cx.sessions[si].as_mut() {
                    complete(s, cx.stats, r.tag, Err(e));
                }
                Ok(())
            }
            // Taken, or the submission revealed the device dead: either way the frame counts
            // as in the device (and fails with it).
            outcome => {
                self.tags[slot] = Some(InFlight {
                    session: si,
                    tag: r.tag,
                    since: Instant::now(),
                });
                if let Some(ps) = self.sessions.get_mut(si).and_then(Option::as_mut) {
                    ps.tags.insert(r.tag);
                }
                self.counters.tx_frames += 1;
                self.counters.tx_bytes += u64::from(r.length);
                match outcome {
                    Err(NetError::DeviceFailed(why)) => Err(Failure::Driver(why)),
                    _ => Ok(()),
                }
            }
        }
    }

    /// Carries out a request that does not reach the device; its answer, if it has one now.
    fn local(
        &mut self,
        si: usize,
        r: &NetRequest,
        cx: &mut Ctx<'_>,
    ) -> Option<Result<u32, NetError>> {
        let s = cx.sessions[si].as_mut()?;
        let ps = self.sessions.get_mut(si)?.as_mut()?;
        match r.op {
            NetOp::Receive => {
                ps.tags.insert(r.tag);
                ps.posted.push_back(Posted {
                    tag: r.tag,
                    offset: r.buf_offset,
                    len: r.length,
                });
                None
            }
            NetOp::Filter if r.length == 0 => {
                ps.reception.filter = None;
                Some(Ok(0))
            }
            NetOp::Filter => Some(
                read_buffer(s, r.buf_offset, r.length)
                    .and_then(|b| Program::parse(&b).map_err(NetError::BadFilter))
                    .map(|p| {
                        ps.reception.filter = Some(p);
                        0
                    }),
            ),
            NetOp::Mode => {
                ps.reception.mode = r.length;
                Some(Ok(0))
            }
            NetOp::Multicast => Some(read_buffer(s, r.buf_offset, r.length).map(|b| {
                ps.reception.set_groups(&b);
                0
            })),
            NetOp::Reclaim => {
                let n = ps.posted.len() as u32;
                for p in ps.posted.drain(..) {
                    ps.tags.remove(&p.tag);
                    complete(s, cx.stats, p.tag, Err(NetError::Cancelled));
                }
                Some(Ok(n))
            }
            NetOp::HoldOff => Some(self.driver.set_hold_off(r.length).map(|()| 0)),
            NetOp::Transmit => None,
        }
    }

    /// Offers a received frame to every session: each that takes it gets it in its oldest
    /// posted buffer.
    fn deliver(
        frame: &[u8],
        mac: &[u8; 6],
        sessions: &mut [Option<PerSession>],
        counters: &mut NetCounters,
        cx: &mut Ctx<'_>,
    ) {
        counters.rx_frames += 1;
        counters.rx_bytes += frame.len() as u64;
        let mut claimed = false;
        for (si, ps) in sessions.iter_mut().enumerate() {
            let Some(ps) = ps.as_mut() else { continue };
            let Some(s) = cx.sessions.get_mut(si).and_then(Option::as_mut) else {
                continue;
            };
            if s.closing() {
                continue;
            }
            let take = ps.reception.takes(frame, mac) as usize;
            if take == 0 {
                continue;
            }
            claimed = true;
            let Some(p) = ps.posted.pop_front() else {
                counters.rx_no_buffer += 1;
                continue;
            };
            ps.tags.remove(&p.tag);
            let n = take.min(p.len as usize);
            let result = match s.region.buffers.write(p.offset, &frame[..n]) {
                Err(e) => Err(NetError::Io(format!("the receive buffer: {e}"))),
                Ok(()) if n < take => {
                    counters.rx_truncated += 1;
                    Err(NetError::Truncated(format!(
                        "a frame of {take} bytes into a buffer of {}",
                        p.len
                    )))
                }
                Ok(()) => {
                    counters.rx_delivered += 1;
                    Ok(n as u32)
                }
            };
            complete(s, cx.stats, p.tag, result);
        }
        if !claimed {
            counters.rx_unclaimed += 1;
        }
    }
}

impl Dispatcher for NetDispatcher {
    fn name(&self) -> &str {
        &self.driver.info().name
    }

    fn class(&self) -> &'static str {
        CLASS
    }

    fn rings(&self) -> &'static [RingShape] {
        &RINGS
    }

    fn status(&self) -> serde_json::Value {
        let mut info = self.driver.info().clone();
        info.counters = NetCounters {
            rx_device_errors: info.counters.rx_device_errors,
            ..self.counters
        };
        serde_json::to_value(info).expect("serialisable")
    }

    fn driver(&self) -> &dyn Driver {
        self.driver.as_ref()
    }

    fn driver_mut(&mut self) -> &mut dyn Driver {
        self.driver.as_mut()
    }

    fn replace(&mut self, driver: Box<dyn AnyDriver>) -> Result<(), outboard_env::WrongClass> {
        self.driver = outboard_net::unbind(driver)?;
        Ok(())
    }

    fn open(&mut self, slot: usize, resumed: Option<&serde_json::Value>) -> Result<(), Refusal> {
        if resumed.is_some_and(|k| !k.is_null()) {
            return Err(Refusal::new(
                Code::Invalid,
                "a net session keeps no state across a restart: its client posts its buffers and filter again",
            ));
        }
        if self.sessions.len() <= slot {
            self.sessions.resize_with(slot + 1, || None);
        }
        self.sessions[slot] = Some(PerSession::default());
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
        let (room, mut cut) = match s.completion_room(COMPLETIONS, BUDGET + outstanding) {
            Ok(free) => (free.saturating_sub(outstanding), false),
            Err(_) => (0, true),
        };
        let buffer_size = s.buffer_size();
        let mut taken = 0;
        let mut lost = Ok(());
        // The outage does not change while requests are taken.
        let out_of_service = cx.outage().map(outage_error);
        while taken < BUDGET.min(room) {
            // A frame to send needs room in the device, and the next entry may be one.
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
            let sqe = Sqe(e);
            let ps = self.sessions[i].as_ref().expect("checked");
            let checked = sqe.decode().and_then(|r| {
                validate(&r, self.driver.info(), buffer_size)?;
                if ps.tags.contains(&r.tag) {
                    return Err(NetError::DuplicateTag);
                }
                Ok(r)
            });
            let checked = match checked {
                Ok(r) if r.op == NetOp::Transmit => match &out_of_service {
                    Some(e) => Err(e.clone()),
                    None if cx.quarantined(i, || fingerprint(&r)) => Err(NetError::Quarantined),
                    None => Ok(r),
                },
                other => other,
            };
            let answer = match checked {
                Ok(r) if r.op == NetOp::Transmit => {
                    lost = self.transmit(i, &r, cx);
                    if lost.is_err() {
                        break;
                    }
                    None
                }
                Ok(r) => self.local(i, &r, cx).map(|a| (r.tag, a)),
                Err(e) => {
                    cx.stats.rejected += 1;
                    Some((sqe.tag(), Err(e)))
                }
            };
            if let (Some((tag, result)), Some(s)) = (answer, cx.sessions[i].as_mut()) {
                complete(s, cx.stats, tag, result);
            }
        }
        if cut {
            let s = cx.sessions[i].as_mut().expect("checked");
            tracing::warn!(
                "session {}: ring indices corrupt, cutting the client off",
                s.id
            );
            cx.stats.cut_off += 1;
            s.cut_off();
        }
        lost.map(|()| taken > 0)
    }

    fn progress(&mut self, cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        if self.driver.in_flight() > 0 {
            self.driver.kick()?;
        }
        self.sent.clear();
        let mac = self.driver.info().mac;
        let Self {
            driver,
            sessions,
            counters,
            sent,
            ..
        } = self;
        let n = driver.poll(sent, &mut |frame| {
            Self::deliver(frame, &mac, sessions, counters, cx)
        })?;
        let sent_any = !self.sent.is_empty();
        let mut done = std::mem::take(&mut self.sent);
        for (slot, result) in done.drain(..) {
            let Some(InFlight { session, tag, .. }) =
                self.tags.get_mut(slot as usize).and_then(Option::take)
            else {
                continue;
            };
            self.free_tags.push(slot as usize);
            if let Some(ps) = self.sessions.get_mut(session).and_then(Option::as_mut) {
                ps.tags.remove(&tag);
            }
            if let Some(s) = cx.sessions[session].as_mut() {
                complete(s, cx.stats, tag, result);
            }
        }
        self.sent = done;
        if sent_any && self.driver.in_flight() == 0 {
            cx.emptied();
        }
        Ok(n > 0)
    }

    fn prepare_sleep(&mut self, _cx: &mut Ctx<'_>) -> Result<bool, Failure> {
        // Receive interrupts stay armed even with nothing to send: frames come when they come.
        Ok(!self.driver.arm()?)
    }

    fn oldest_due(&self) -> Option<Instant> {
        self.tags.iter().flatten().map(|t| t.since).min()
    }

    fn fail_all(&mut self, fate: &Fate, cx: &mut Ctx<'_>) {
        let error = match fate {
            Fate::TimedOut => NetError::Timeout,
            Fate::Out(o) => outage_error(o),
        };
        self.free_tags.clear();
        for t in self.tags.drain(..).flatten() {
            if let Some(ps) = self.sessions.get_mut(t.session).and_then(Option::as_mut) {
                ps.tags.remove(&t.tag);
            }
            if let Some(s) = cx.sessions[t.session].as_mut() {
                complete(s, cx.stats, t.tag, Err(error.clone()));
            }
        }
        // Posted receive buffers are not in the device: they wait for the device to come back.
    }

    fn outstanding(&self, slot: usize) -> usize {
        self.sessions
            .get(slot)
            .and_then(Option::as_ref)
            .map_or(0, |ps| ps.tags.len())
    }

    fn close(&mut self, slot: usize) {
        // The client left: its posted buffers will never be answered, nor need to be.
        if let Some(ps) = self.sessions.get_mut(slot).and_then(Option::as_mut) {
            for p in ps.posted.drain(..) {
                ps.tags.remove(&p.tag);
            }
        }
    }

    fn release(&mut self, slot: usize) {
        if let Some(s) = self.sessions.get_mut(slot) {
            *s = None;
        }
    }
}
