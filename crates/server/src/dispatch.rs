//! What the server core needs from a class: one dispatcher per served device, taking the
//! class's requests out of its sessions and posting completions back.
//!
//! The core ([`crate::host`] and [`crate::device`]) owns sessions, control connections,
//! doorbells, sleeping and waking, limits, each session's buffer mapping in the device, the
//! device's event sources, deadlines, failure, recovery and out-of-service answers; it names no
//! class. A dispatcher owns one device's typed driver and everything class-specific: entry
//! formats, validation, tags, ordering rules, which requests have a deadline, and what each
//! outcome of a failure means to its clients. A new class adds a dispatcher in its own folder
//! and touches nothing here.

use std::time::{Duration, Instant};

use outboard_env::{AnyDriver, Driver, Failure, Mapping};
use outboard_session::completion::WireError;
use outboard_session::RingShape;

use crate::blame::session_key;
use crate::host::HostStats;
use crate::session::Session;
pub use crate::turn_clock::TurnClock;

pub use outboard_session::{Code, Refusal};

/// Why a device is out of service, which decides what new requests and opens get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outage {
    /// It is being opened again: retry later.
    Restarting,
    /// It was given up for good, for this reason.
    Failed(String),
}

/// What the requests a device held at its failure get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// They waited past their deadline.
    TimedOut,
    /// The device went out of service under them.
    Out(Outage),
}

/// What a dispatcher may reach while it works: the sessions (it touches only its own), the
/// counters, each session's buffer area in the device, and what the core decided about the
/// device (out of service, isolated, quarantined requests).
pub struct Ctx<'a> {
    /// Every session slot.
    pub sessions: &'a mut [Option<Session>],
    /// Counters.
    pub stats: &'a mut HostStats,
    pub(crate) maps: &'a [Option<Mapping>],
    pub(crate) outage: Option<&'a Outage>,
    pub(crate) watch: &'a mut crate::blame::Watch,
    pub(crate) clock: &'a TurnClock,
}

impl Ctx<'_> {
    /// Now, as of the loop's current turn (see [`TurnClock`]): when a request entered the
    /// device, when its completion was found.
    #[inline]
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The same, in nanoseconds since the server started: what a class keeps to time a
    /// request ([`Ctx::answer_timed`]).
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// Posts the answer to request `tag` of session `slot` on its outbound ring `ring`, timed
    /// from `since_ns` ([`Ctx::now_ns`] when it entered the device) if the session keeps
    /// counts and the turn is timed ([`TurnClock::completion_ns`]). False if the session is
    /// gone.
    #[inline]
    pub fn answer_timed<E: WireError>(
        &mut self,
        slot: usize,
        ring: usize,
        tag: u64,
        result: &Result<u32, E>,
        since_ns: u64,
    ) -> bool {
        let Some(s) = self.sessions.get_mut(slot).and_then(Option::as_mut) else {
            return false;
        };
        match s.counting().then(|| self.clock.completion_ns()).flatten() {
            Some(now) => s.complete_timed(ring, tag, result, now.saturating_sub(since_ns)),
            None => s.complete(ring, tag, result),
        }
        true
    }

    /// The device address of session `slot`'s buffer area.
    #[inline]
    pub fn iova(&self, slot: usize) -> Option<u64> {
        self.maps.get(slot)?.as_ref().map(Mapping::iova)
    }

    /// Why the device is out of service, if it is: every request taken now gets this answer
    /// at once, without reaching the driver.
    #[inline]
    pub fn outage(&self) -> Option<&Outage> {
        self.outage
    }

    /// Whether requests go into the device one at a time now (a server started after a crash,
    /// finding out which request crashed it: [`crate::blame`]).
    #[inline]
    pub fn isolated(&self) -> bool {
        self.watch.isolated()
    }

    /// Whether another request may enter a device that has room: while isolated, only into an
    /// empty one (`in_flight` is asked only then).
    #[inline]
    pub fn may_enter(&self, in_flight: impl FnOnce() -> usize) -> bool {
        !self.isolated() || in_flight() == 0
    }

    /// Session `slot`'s request `fingerprint` (the class's) is about to enter the device:
    /// named in the blame page while isolated. Called for every request that enters.
    #[inline]
    pub fn entering(&mut self, slot: usize, fingerprint: [u64; 2]) {
        if !self.watch.naming() {
            return;
        }
        if let Some(s) = self.sessions.get(slot).and_then(Option::as_ref) {
            self.watch.entering(s, fingerprint);
        }
    }

    /// The request just named ([`Ctx::entering`]) did not enter after all: the driver
    /// refused it, and it was answered with the error.
    #[inline]
    pub fn refused(&mut self) {
        self.watch.refused();
    }

    /// Cuts session `slot`'s client off: its ring indices are corrupt (a client that broke
    /// the ring protocol loses its session; everyone else goes on).
    pub fn cut_off(&mut self, slot: usize) {
        if let Some(s) = self.sessions.get_mut(slot).and_then(Option::as_mut) {
            tracing::warn!(
                "session {}: ring indices corrupt, cutting the client off",
                s.id
            );
            self.stats.cut_off += 1;
            s.cut_off();
        }
    }

    /// Nothing is in the device any more, after requests completed.
    #[inline]
    pub fn emptied(&mut self) {
        self.watch.emptied();
    }

    /// Whether session `slot`'s request `fingerprint` must wait before it enters the device:
    /// named at the last crash, it goes in only after another request has been through (or
    /// when nothing else is there to go: the class decides that). The session's key is read
    /// only while something is held back.
    #[inline]
    pub fn holds_back(&self, slot: usize, fingerprint: impl FnOnce() -> [u64; 2]) -> bool {
        if !self.watch.holds_any() {
            return false;
        }
        let Some(s) = self.sessions.get(slot).and_then(Option::as_ref) else {
            return false;
        };
        self.watch.holding(|| session_key(s), fingerprint())
    }

    /// Whether the request `fingerprint` of session `slot` crashed the driver too often to be
    /// sent again; true once, and it is then off the list. The fingerprint is computed only
    /// when something is quarantined.
    #[inline]
    pub fn quarantined(&mut self, slot: usize, fingerprint: impl FnOnce() -> [u64; 2]) -> bool {
        // Nearly always empty: the session's key (an fstat) is read only when it is not.
        if !self.watch.quarantining() {
            return false;
        }
        match self.sessions.get(slot).and_then(Option::as_ref) {
            Some(s) => self.watch.take_quarantined(session_key(s), fingerprint()),
            None => false,
        }
    }
}

/// The request a class keeps aside while [`Ctx::holds_back`] says so (one per device: the
/// request its device had in it at the last crash), and when it may go on.
#[derive(Debug)]
pub struct HeldBack<R> {
    held: Option<(usize, R)>,
}

impl<R> Default for HeldBack<R> {
    fn default() -> Self {
        Self { held: None }
    }
}

impl<R> HeldBack<R> {
    /// Whether session `slot`'s request, fingerprinted `fingerprint`, is to be kept aside
    /// (only one is: a second goes on).
    #[inline]
    pub fn wants(&self, cx: &Ctx<'_>, slot: usize, fingerprint: impl FnOnce() -> [u64; 2]) -> bool {
        self.held.is_none() && cx.holds_back(slot, fingerprint)
    }

    /// Keeps session `slot`'s request `r` aside.
    pub fn hold(&mut self, slot: usize, r: R) {
        self.held = Some((slot, r));
    }

    /// Whether a request is kept aside.
    #[inline]
    pub fn is_holding(&self) -> bool {
        self.held.is_some()
    }

    /// The request kept aside, and its session's slot.
    #[inline]
    pub fn get(&self) -> Option<(usize, &R)> {
        self.held.as_ref().map(|(s, r)| (*s, r))
    }

    /// The request to send now, if one is kept and the device can take it: `room` (the class
    /// asked [`Ctx::may_enter`]), with nothing else in it while isolated — after another
    /// request went through, or after a turn in which nothing else came to go first.
    pub fn release(&mut self, room: bool, in_flight: usize, cx: &Ctx<'_>) -> Option<(usize, R)> {
        if self.held.is_none() || !room || in_flight > 0 && cx.isolated() {
            return None;
        }
        self.held.take()
    }

    /// The kept request, whatever the device (its failure, the class failing everything).
    pub fn take(&mut self) -> Option<(usize, R)> {
        self.held.take()
    }

    /// The kept request if it is session `slot`'s (the session closes).
    pub fn take_of(&mut self, slot: usize) -> Option<R> {
        match &self.held {
            Some((s, _)) if *s == slot => self.held.take().map(|(_, r)| r),
            _ => None,
        }
    }
}

/// One served device, by its class.
pub trait Dispatcher: Send {
    /// The class device's name.
    fn name(&self) -> &str;
    /// The class (`block`), as `Open` names it.
    fn class(&self) -> &'static str;
    /// The rings the class declares; a session must have exactly these.
    fn rings(&self) -> &'static [RingShape];
    /// The names of the class's error kinds, for counters: code `-k`'s at `k - 1`.
    fn error_kinds(&self) -> &'static [&'static str] {
        &[]
    }
    /// The class status a client gets on `Status` and `Open`.
    fn status(&self) -> serde_json::Value;
    /// The driver's environment side (event sources, events, abandon).
    fn driver(&self) -> &dyn Driver;
    /// The same, to call.
    fn driver_mut(&mut self) -> &mut dyn Driver;
    /// Swaps in the driver of the device opened again after a failure (the class takes its
    /// typed driver out of `driver`); an error if it is not of this class.
    fn replace(&mut self, driver: Box<dyn AnyDriver>) -> Result<(), outboard_env::WrongClass>;
    /// A session opens at `slot`. `resumed` is the class's own state the client kept from a
    /// previous server (block: the range locks it held), to be granted back or refused.
    fn open(&mut self, slot: usize, resumed: Option<&serde_json::Value>) -> Result<(), Refusal>;
    /// For `grace` from now, sessions of a previous server are still resuming: grant nothing
    /// that could conflict with what they claim back (block: no new lock).
    fn resume_grace(&mut self, _grace: Duration) {}
    /// Takes what it may of session `slot`'s submissions; true if it took any. An error: the
    /// device failed (what was taken counts as in the device).
    fn take(&mut self, slot: usize, cx: &mut Ctx<'_>) -> Result<bool, Failure>;
    /// Moves the device along: publishes, reaps, releases what waited. True if anything
    /// happened.
    fn progress(&mut self, cx: &mut Ctx<'_>) -> Result<bool, Failure>;
    /// Before the loop sleeps: arm the device's interrupts. False if work turned up.
    fn prepare_sleep(&mut self, cx: &mut Ctx<'_>) -> Result<bool, Failure>;
    /// When the oldest request that has a deadline entered the device (the class says which
    /// do: a block request does, a posted receive buffer does not).
    fn oldest_due(&self) -> Option<Instant>;
    /// The device failed and was abandoned: answer every request it held or had waiting
    /// with `fate`, and forget them.
    fn fail_all(&mut self, fate: &Fate, cx: &mut Ctx<'_>);
    /// Requests of session `slot` taken and not yet answered.
    fn outstanding(&self, slot: usize) -> usize;
    /// The client of session `slot` left: what it had waiting never starts.
    fn close(&mut self, slot: usize);
    /// Session `slot` drained: forget it.
    fn release(&mut self, slot: usize);
}
