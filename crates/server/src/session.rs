//! One client's session as the multiplexer holds it, whatever its class: the shared region,
//! the rings its class declared, the doorbells, and whether the client is still there.
//!
//! Rings are named by their index among the rings of their direction: a dispatcher pops from
//! inbound ring `n` and posts to outbound ring `n` (block: ring 0 of each).

use std::os::fd::OwnedFd;

use crate::counters::Tally;

use outboard_session::completion::{Completion, WireError, REASON_SENT};
use outboard_session::doorbell::peer_sleeping;
use outboard_session::region::ShmRing;
use outboard_session::{Consumer, Direction, Doorbell, Producer, Region, RingError};

/// A session.
pub struct Session {
    /// Id the client was told.
    pub id: u64,
    /// Index of the device it is open on.
    pub device: usize,
    /// The client's control socket; `None` once the client left (the session then drains).
    pub(crate) sock: Option<OwnedFd>,
    /// Header, rings and buffer area.
    pub region: Region,
    inbound: Vec<Consumer<ShmRing>>,
    outbound: Vec<Producer<ShmRing>>,
    pub(crate) server_bell: Doorbell,
    client_bell: Doorbell,
    /// Completions were staged since the last publish.
    dirty: bool,
    /// The client broke the protocol (or its session cannot go on): the multiplexer closes it.
    cut: bool,
    /// Its counts and its device's ([`crate::counters`]), if the server keeps them.
    tally: Option<Tally>,
}

impl Session {
    pub(crate) fn new(
        id: u64,
        device: usize,
        sock: Option<OwnedFd>,
        region: Region,
        server_bell: Doorbell,
        client_bell: Doorbell,
        tally: Option<Tally>,
    ) -> Self {
        Self {
            id,
            device,
            sock,
            inbound: region.consumers(Direction::ToServer),
            outbound: region.producers(Direction::ToClient),
            region,
            server_bell,
            client_bell,
            dirty: false,
            cut: false,
            tally,
        }
    }

    /// Asks the multiplexer to close this session (the client broke the protocol, or the
    /// session cannot go on); its unanswered requests still drain.
    pub fn cut_off(&mut self) {
        self.cut = true;
    }

    pub(crate) fn take_cut(&mut self) -> bool {
        std::mem::take(&mut self.cut)
    }

    /// Whether the client left.
    #[inline]
    pub fn closing(&self) -> bool {
        self.sock.is_none()
    }

    /// Free slots in outbound ring `ring`, published or not — at least `want` if it has
    /// that many (the client's index is read only when fewer were seen free). An error means
    /// the client corrupted the ring's indices.
    #[inline]
    pub fn completion_room(&mut self, ring: usize, want: usize) -> Result<usize, RingError> {
        let want = u32::try_from(want).unwrap_or(u32::MAX);
        Ok(self.outbound[ring].room(want)? as usize)
    }

    /// How many more requests outbound ring `ring` has room to answer: its free slots beyond
    /// the completions the session's `outstanding` requests will post (its client's index is
    /// read only when fewer than `budget` more were seen free). An error means the client
    /// corrupted the ring's indices.
    #[inline]
    pub fn request_room(
        &mut self,
        ring: usize,
        budget: usize,
        outstanding: usize,
    ) -> Result<usize, RingError> {
        self.completion_room(ring, budget + outstanding)
            .map(|free| free.saturating_sub(outstanding))
    }

    /// Takes the next entry of inbound ring `ring` into `e`; false if there is none.
    #[inline]
    pub fn pop(&mut self, ring: usize, e: &mut [u8]) -> Result<bool, RingError> {
        let popped = self.inbound[ring].pop(e)?;
        if popped {
            if let Some(t) = &self.tally {
                t.taken();
            }
        }
        Ok(popped)
    }

    /// Whether entries wait in any inbound ring (a corrupt ring counts as waiting, so it is
    /// looked at).
    #[inline]
    pub fn has_submissions(&self) -> bool {
        self.inbound
            .iter()
            .any(|r| r.available().map(|n| n > 0).unwrap_or(true))
    }

    /// Stages an entry on outbound ring `ring`; it is published at the end of the round. Room
    /// was reserved when the request was taken; a full ring here means the client moved its
    /// head backwards, which the ring reports as corruption, and the entry is dropped.
    #[inline]
    pub fn post(&mut self, ring: usize, e: &[u8]) {
        if self.closing() {
            return;
        }
        let _ = self.outbound[ring].stage(e);
        self.dirty = true;
    }

    /// Stages the reason request `tag` failed on the reasons ring of the
    /// [`RingShape::request_reply`](outboard_session::RingShape::request_reply) shape, ahead of
    /// its completion; false if it was not sent (the client left, the ring is full because
    /// the client does not read it, or the class has no such ring), and the completion must
    /// then go without its flag.
    fn post_reason(&mut self, tag: u64, text: &str) -> bool {
        if self.closing() {
            return false;
        }
        let Some(ring) = self.outbound.get_mut(outboard_session::RingShape::REASONS) else {
            return false;
        };
        let sent = matches!(
            ring.stage(&outboard_session::reason::encode(tag, text)),
            Ok(true)
        );
        self.dirty |= sent;
        sent
    }

    /// Posts request `tag`'s completion on outbound ring `ring` (an entry of the
    /// [`outboard_session::completion`] layout); a failure's reason goes ahead of it on the
    /// reasons ring, so that the client gets the words and not only the code.
    #[inline]
    pub fn complete<E: WireError>(&mut self, ring: usize, tag: u64, result: &Result<u32, E>) {
        self.answer(ring, tag, result, None);
    }

    /// Whether the server keeps this session's counts: a class times its requests for
    /// [`Session::complete_timed`] only then.
    #[inline]
    pub fn counting(&self) -> bool {
        self.tally.is_some()
    }

    /// [`Session::complete`] for a request the class timed: `latency_ns` since it entered
    /// the device.
    #[inline]
    pub fn complete_timed<E: WireError>(
        &mut self,
        ring: usize,
        tag: u64,
        result: &Result<u32, E>,
        latency_ns: u64,
    ) {
        self.answer(ring, tag, result, Some(latency_ns));
    }

    #[inline]
    fn answer<E: WireError>(
        &mut self,
        ring: usize,
        tag: u64,
        result: &Result<u32, E>,
        latency_ns: Option<u64>,
    ) {
        let mut c = Completion::of(tag, result);
        if let Some(t) = &self.tally {
            t.answered(c.status, c.value, latency_ns);
        }
        if let Err(e) = result {
            if e.reason().is_some_and(|why| self.post_reason(tag, why)) {
                c.value = REASON_SENT;
            }
        }
        self.post(ring, &c.encode());
    }

    /// The buffer area's size.
    #[inline]
    pub fn buffer_size(&self) -> u64 {
        self.region.geometry.buffer_size
    }

    /// Publishes staged completions and rings the client if it sleeps; true if it was rung.
    pub(crate) fn flush(&mut self) -> bool {
        if !std::mem::take(&mut self.dirty) {
            return false;
        }
        for r in &mut self.outbound {
            r.publish();
        }
        if peer_sleeping(self.region.client_sleeping()) {
            self.client_bell.ring();
            return true;
        }
        false
    }
}
