//! The network class's dispatcher: takes requests out of sessions and validates them (the
//! client is untrusted); sends transmitted frames to the driver under server-chosen tags with
//! the device address of the client's buffer (the device reads the frame where the client
//! wrote it); keeps each session's posted receive buffers, receive mode, multicast groups and
//! packet filter; and offers every received frame to every session, copying it into the
//! oldest posted buffer of each session that takes it (the server must look at a frame to
//! know whose it is, so a frame is copied once per session that takes it).
//!
//! **Owning the receive path** ([`NetOp::Own`]): one session may take the NIC's receive path
//! when no other session receives. Its posted buffers are then lent to the driver, which puts
//! them in the device's receive queue (emptied of the driver's own buffers first), so the
//! device writes each frame where the client reads it — after the device's header, the
//! headroom the answer says. The server reads only what the owner's address rule and filter
//! need (the destination; the whole frame only for a filter); a frame the owner does not take
//! goes back to the device in the same buffer. Other sessions may send, but posting receive
//! buffers is refused (`busy`) while the path is owned. A driver that cannot lend (no queue
//! reset) refuses ownership; if the device is brought back by a driver that cannot, frames
//! are copied into the owner's buffers at the same headroom, so the client reads them alike.
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

/// What is in the device, by the driver tag it went in under (frames being sent, the owner's
/// lent buffers): the tag is an index here, so a frame costs no hashing.
struct Slab<T> {
    slots: Vec<Option<T>>,
    free: Vec<usize>,
    count: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            count: 0,
        }
    }
}

impl<T> Slab<T> {
    /// Keeps `p`; the driver tag it goes in under.
    fn insert(&mut self, p: T) -> u64 {
        let i = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        self.slots[i] = Some(p);
        self.count += 1;
        i as u64
    }

    /// What went in under `key`, no longer kept.
    fn remove(&mut self, key: u64) -> Option<T> {
        let p = self.slots.get_mut(usize::try_from(key).ok()?)?.take()?;
        self.free.push(key as usize);
        self.count -= 1;
        Some(p)
    }

    fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Everything kept, no longer kept.
    fn drain(&mut self) -> Vec<T> {
        self.free.clear();
        self.count = 0;
        self.slots.drain(..).flatten().collect()
    }

    fn iter(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().flatten()
    }
}

/// What the dispatcher keeps of one session.
#[derive(Default)]
struct PerSession {
    /// Client tags taken and not yet answered: frames in the device and posted buffers.
    tags: HashSet<u64>,
    posted: VecDeque<Posted>,
    /// Its mode, groups and filter.
    reception: Reception,
    /// Its buffers lent to the device (it owns the receive path).
    lent: Slab<Posted>,
    /// Where in each of its buffers a frame starts (the device's header before it when it
    /// owns the receive path; 0 otherwise).
    headroom: u32,
}

/// One NIC being served.
pub struct NetDispatcher {
    driver: Box<dyn NetDriver>,
    /// Frames in the transmit queue.
    in_flight: Slab<InFlight>,
    sessions: Vec<Option<PerSession>>,
    sent: Vec<(u64, Result<u32, NetError>)>,
    counters: NetCounters,
    /// The session that owns the receive path, if one does.
    owner: Option<usize>,
    /// Lent buffers the device wrote into, being handled.
    lent_done: Vec<(u64, Result<u32, NetError>)>,
    /// The start of a frame in a lent buffer, read for the owner's address rule and filter.
    peek: Vec<u8>,
    /// Lent buffers still to come that hold the rest of a frame the device spread over
    /// several (not frames of their own): each goes back to the device.
    pieces_left: u16,
    /// The device could not be given back its receive queue (a queue reset failed): it must
    /// be failed, and the owner's lent buffers stay counted until it is reset.
    broken: Option<String>,
    /// The device is out of service (failed, not yet replaced): the driver is not used.
    out: bool,
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
            in_flight: Slab::default(),
            sessions: Vec::new(),
            sent: Vec::new(),
            counters: NetCounters::default(),
            owner: None,
            lent_done: Vec::new(),
            peek: Vec::new(),
            pieces_left: 0,
            broken: None,
            out: false,
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
        cx.entering(si, fingerprint(r));
        let key = self.in_flight.insert(InFlight {
            session: si,
            tag: r.tag,
            since: cx.now(),
        });
        match self.driver.transmit(base + r.buf_offset, r.length, key) {
            Err(e) if !matches!(e, NetError::DeviceFailed(_)) => {
                self.in_flight.remove(key);
                cx.refused();
                cx.stats.rejected += 1;
                if let Some(s) = cx.sessions[si].as_mut() {
                    complete(s, cx.stats, r.tag, Err(e));
                }
                Ok(())
            }
            // Taken, or the submission revealed the device dead: either way the frame counts
            // as in the device (and fails with it).
            outcome => {
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
            NetOp::Receive if self.owner.is_some_and(|o| o != si) => Some(Err(NetError::Busy(
                "another session owns this NIC's receive path".into(),
            ))),
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
                // Lent buffers come out of the device first (it empties its receive queue).
                let mut back = Vec::new();
                if self.owner == Some(si) && !ps.lent.is_empty() && !self.out {
                    if let Err(e) = self.driver.set_lending(true, &mut back) {
                        self.broken = Some(format!("emptying the receive queue: {e}"));
                        return Some(Err(e));
                    }
                }
                let mut n = 0;
                for key in back {
                    if let Some(p) = ps.lent.remove(key) {
                        ps.tags.remove(&p.tag);
                        complete(s, cx.stats, p.tag, Err(NetError::Cancelled));
                        n += 1;
                    }
                }
                for p in ps.posted.drain(..) {
                    ps.tags.remove(&p.tag);
                    complete(s, cx.stats, p.tag, Err(NetError::Cancelled));
                    n += 1;
                }
                Some(Ok(n))
            }
            NetOp::HoldOff => Some(self.driver.set_hold_off(r.length).map(|()| 0)),
            NetOp::Own if r.length == 1 => Some(self.take_ownership(si)),
            NetOp::Own => {
                if self.owner == Some(si) {
                    if let Err(e) = self.give_back(si) {
                        return Some(Err(e));
                    }
                }
                if let Some(ps) = self.sessions.get_mut(si).and_then(Option::as_mut) {
                    ps.headroom = 0;
                }
                Some(Ok(0))
            }
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
            let room = p.len.saturating_sub(ps.headroom) as usize;
            let n = take.min(room);
            let at = p.offset + u64::from(ps.headroom);
            let result = match s.region.buffers.write(at, &frame[..n]) {
                Err(e) => Err(NetError::Io(format!("the receive buffer: {e}"))),
                Ok(()) if n < take => {
                    counters.rx_truncated += 1;
                    Err(NetError::Truncated(format!(
                        "a frame of {take} bytes into a buffer of {room}"
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

impl NetDispatcher {
    /// Session `si` asks for the receive path: granted when no other session receives and
    /// the driver can lend; the answer is the headroom.
    fn take_ownership(&mut self, si: usize) -> Result<u32, NetError> {
        match self.owner {
            Some(o) if o == si => {
                return Ok(self.sessions[si].as_ref().map_or(0, |ps| ps.headroom));
            }
            Some(_) => {
                return Err(NetError::Busy(
                    "another session owns this NIC's receive path".into(),
                ))
            }
            None => {}
        }
        let Some(headroom) = self.driver.lend_headroom() else {
            return Err(NetError::Invalid(
                "this NIC's driver cannot receive into a client's buffers".into(),
            ));
        };
        let others = self
            .sessions
            .iter()
            .enumerate()
            .any(|(i, ps)| i != si && ps.as_ref().is_some_and(|ps| !ps.posted.is_empty()));
        if others {
            return Err(NetError::Busy(
                "other sessions receive on this NIC: its receive path is shared".into(),
            ));
        }
        if self.out {
            return Err(NetError::Restarting);
        }
        // The driver's own buffers leave the device: frames in them not yet taken are
        // dropped, as on a NIC being reconfigured.
        let mut back = Vec::new();
        if let Err(e) = self.driver.set_lending(true, &mut back) {
            self.broken = Some(format!("taking the receive queue for lending: {e}"));
            return Err(e);
        }
        self.owner = Some(si);
        if let Some(ps) = self.sessions[si].as_mut() {
            ps.headroom = headroom;
        }
        Ok(headroom)
    }

    /// Session `o`'s lent buffers are no longer in the device (it failed, or was replaced):
    /// they wait among its posted ones, in the order of their place in the buffer area.
    fn unlend_all(&mut self, o: usize) {
        if let Some(ps) = self.sessions.get_mut(o).and_then(Option::as_mut) {
            let mut lent = ps.lent.drain();
            lent.sort_by_key(|p| p.offset);
            for p in lent.into_iter().rev() {
                ps.posted.push_front(p);
            }
        }
    }

    /// The owner gives the receive path back (or is gone): the device's receive queue gets
    /// the driver's own buffers again; the owner's lent buffers wait among its posted ones.
    /// If the device cannot be made to forget them, it is failed (at the next turn) and they
    /// stay lent — counted as the session's, so its memory stays mapped until the device is
    /// reset.
    fn give_back(&mut self, si: usize) -> Result<(), NetError> {
        // Out of service: the device was reset and the buffers are back among the posted.
        if !self.out {
            let mut back = Vec::new();
            if let Err(e) = self.driver.set_lending(false, &mut back) {
                self.broken = Some(format!(
                    "taking the receive queue back from lent buffers: {e}"
                ));
                return Err(e);
            }
        }
        self.owner = None;
        self.unlend_all(si);
        if let Some(ps) = self.sessions.get_mut(si).and_then(Option::as_mut) {
            ps.headroom = 0;
        }
        Ok(())
    }

    /// Lends the owner's posted buffers to the driver while it has room (one doorbell).
    fn lend_posted(&mut self, cx: &mut Ctx<'_>) -> Result<(), Failure> {
        if let Some(why) = self.broken.take() {
            return Err(Failure::Driver(why));
        }
        if self.out {
            return Ok(());
        }
        let Some(o) = self.owner else { return Ok(()) };
        let Some(base) = cx.iova(o) else {
            return Ok(());
        };
        let Some(ps) = self.sessions.get_mut(o).and_then(Option::as_mut) else {
            return Ok(());
        };
        let mut lent = false;
        while self.driver.can_lend() {
            let Some(p) = ps.posted.pop_front() else {
                break;
            };
            let key = ps.lent.insert(p);
            match self.driver.lend(base + p.offset, p.len, key) {
                Ok(()) => lent = true,
                Err(NetError::DeviceFailed(why)) => {
                    ps.lent.remove(key);
                    ps.posted.push_front(p);
                    return Err(Failure::Driver(why));
                }
                Err(e) => {
                    ps.lent.remove(key);
                    // This buffer cannot be lent (too small): it fails alone.
                    ps.tags.remove(&p.tag);
                    if let Some(s) = cx.sessions[o].as_mut() {
                        complete(s, cx.stats, p.tag, Err(e));
                    }
                }
            }
        }
        if lent {
            self.driver.kick()?;
        }
        Ok(())
    }

    /// Frames the device wrote into the owner's buffers: each completes where it is if the
    /// owner takes it, or its buffer is lent again.
    fn reap_lent(&mut self, cx: &mut Ctx<'_>) {
        self.driver.take_lent(&mut self.lent_done);
        let mac = self.driver.info().mac;
        for (key, result) in self.lent_done.drain(..) {
            let Some(o) = self.owner else { continue };
            let (Some(ps), Some(s)) = (
                self.sessions.get_mut(o).and_then(Option::as_mut),
                cx.sessions.get_mut(o).and_then(Option::as_mut),
            ) else {
                continue;
            };
            // A buffer given back or reclaimed meanwhile is no longer the device's.
            let Some(p) = ps.lent.remove(key) else {
                continue;
            };
            let tag = p.tag;
            // A buffer the device wrote wrongly (counted by the driver), or one holding the
            // rest of a frame it spread over several: not a frame; lent again.
            let Ok(len) = result else {
                ps.posted.push_front(p);
                continue;
            };
            if self.pieces_left > 0 {
                self.pieces_left -= 1;
                ps.posted.push_front(p);
                continue;
            }
            let mut head = [0u8; 64];
            let head = &mut head[..(ps.headroom as usize).min(64)];
            let pieces = match s.region.buffers.read(p.offset, head) {
                Ok(()) => self.driver.lent_pieces(head),
                Err(_) => 1,
            };
            if pieces != 1 {
                // Longer than a buffer holds (past the MTU): dropped whole, as truncated.
                self.counters.rx_truncated += 1;
                self.pieces_left = pieces.saturating_sub(1);
                ps.posted.push_front(p);
                continue;
            }
            self.counters.rx_frames += 1;
            self.counters.rx_bytes += u64::from(len);
            // What the rule and filter need: the destination, or the whole frame for a filter.
            let need = match ps.reception.filter {
                Some(_) => len as usize,
                None => (outboard_net::ETH_HEADER as usize).min(len as usize),
            };
            self.peek.resize(need, 0);
            let at = p.offset + u64::from(ps.headroom);
            let take = match s.region.buffers.read(at, &mut self.peek) {
                Ok(()) if ps.reception.filter.is_some() => ps.reception.takes(&self.peek, &mac),
                Ok(()) => match ps.reception.takes(&self.peek, &mac) {
                    0 => 0,
                    _ => len,
                },
                Err(_) => 0,
            };
            if take == 0 {
                self.counters.rx_unclaimed += 1;
                ps.posted.push_front(p);
                continue;
            }
            ps.tags.remove(&tag);
            self.counters.rx_delivered += 1;
            self.counters.rx_in_place += 1;
            complete(s, cx.stats, tag, Ok(take.min(len)));
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

    fn error_kinds(&self) -> &'static [&'static str] {
        outboard_net::ERROR_KINDS
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
        self.out = false;
        self.broken = None;
        self.pieces_left = 0;
        // The new driver lends the owner's buffers again if it can; if it cannot, frames are
        // copied into them at the same headroom.
        if let Some(o) = self.owner {
            self.unlend_all(o);
            if let Err(e) = self.driver.set_lending(true, &mut Vec::new()) {
                tracing::warn!("net: the driver brought back cannot lend receive buffers: {e}");
                self.owner = None;
            }
        }
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
            cx.cut_off(i);
        }
        // Buffers the owner posted go into the device together: one doorbell.
        lost.and_then(|()| self.lend_posted(cx)).map(|()| taken > 0)
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
        self.reap_lent(cx);
        self.lend_posted(cx)?;
        let sent_any = !self.sent.is_empty();
        let mut done = std::mem::take(&mut self.sent);
        for (slot, result) in done.drain(..) {
            let Some(InFlight { session, tag, .. }) = self.in_flight.remove(slot) else {
                continue;
            };
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
        self.in_flight.iter().map(|t| t.since).min()
    }

    fn fail_all(&mut self, fate: &Fate, cx: &mut Ctx<'_>) {
        let error = match fate {
            Fate::TimedOut => NetError::Timeout,
            Fate::Out(o) => outage_error(o),
        };
        for t in self.in_flight.drain() {
            if let Some(ps) = self.sessions.get_mut(t.session).and_then(Option::as_mut) {
                ps.tags.remove(&t.tag);
            }
            if let Some(s) = cx.sessions[t.session].as_mut() {
                complete(s, cx.stats, t.tag, Err(error.clone()));
            }
        }
        // Posted receive buffers are not in the device: they wait for the device to come back.
        // Lent ones were (the device was reset before this): they wait among the posted ones,
        // to be lent again — or, if their session has left, are forgotten.
        self.out = true;
        self.broken = None;
        self.pieces_left = 0;
        if let Some(o) = self.owner {
            self.unlend_all(o);
            let gone = cx
                .sessions
                .get(o)
                .and_then(Option::as_ref)
                .is_none_or(|s| s.closing());
            if gone {
                self.owner = None;
                if let Some(ps) = self.sessions.get_mut(o).and_then(Option::as_mut) {
                    for p in ps.posted.drain(..) {
                        ps.tags.remove(&p.tag);
                    }
                }
            }
        }
    }

    fn outstanding(&self, slot: usize) -> usize {
        self.sessions
            .get(slot)
            .and_then(Option::as_ref)
            .map_or(0, |ps| ps.tags.len())
    }

    fn close(&mut self, slot: usize) {
        // An owner that left gives the receive path back: the device must not write into its
        // buffers any more.
        if self.owner == Some(slot) && self.give_back(slot).is_err() {
            // The device may still write into the lent buffers: they stay counted (the session
            // is not released, its memory stays mapped) until the device is failed and reset.
            if let Some(ps) = self.sessions.get_mut(slot).and_then(Option::as_mut) {
                for p in ps.posted.drain(..) {
                    ps.tags.remove(&p.tag);
                }
            }
            return;
        }
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
