//! One client's session as the multiplexer holds it, whatever its class: the shared region,
//! its two rings, the doorbells, and whether the client is still there.

use std::os::fd::OwnedFd;

use outboard_session::doorbell::peer_sleeping;
use outboard_session::region::ShmRing;
use outboard_session::{Consumer, Doorbell, Producer, Region, RingError};

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
    sq: Consumer<ShmRing>,
    cq: Producer<ShmRing>,
    pub(crate) server_bell: Doorbell,
    client_bell: Doorbell,
    /// Completions were staged since the last publish.
    dirty: bool,
    /// The client broke the protocol (or its session cannot go on): the multiplexer closes it.
    cut: bool,
}

impl Session {
    pub(crate) fn new(
        id: u64,
        device: usize,
        sock: Option<OwnedFd>,
        region: Region,
        server_bell: Doorbell,
        client_bell: Doorbell,
    ) -> Self {
        let g = region.geometry;
        Self {
            id,
            device,
            sock,
            sq: Consumer::new(region.sq(), g.sq_entries),
            cq: Producer::new(region.cq(), g.cq_entries),
            region,
            server_bell,
            client_bell,
            dirty: false,
            cut: false,
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

    /// Whether one more request may be taken while `outstanding` are unanswered: every request
    /// taken must find room in the completion ring later. An error means the client corrupted
    /// the ring's indices.
    #[inline]
    pub fn room_for_another(&self, outstanding: usize) -> Result<bool, RingError> {
        Ok(self.cq.free()? as usize > outstanding)
    }

    /// Takes the next submission entry into `e`; false if there is none.
    #[inline]
    pub fn pop(&mut self, e: &mut [u8]) -> Result<bool, RingError> {
        self.sq.pop(e)
    }

    /// Whether submissions are waiting (a corrupt ring counts as waiting, so it is looked at).
    #[inline]
    pub fn has_submissions(&self) -> bool {
        self.sq.available().map(|n| n > 0).unwrap_or(true)
    }

    /// Stages a completion entry; it is published at the end of the round. Room was reserved
    /// when the request was taken; a full ring here means the client moved its head
    /// backwards, which the ring reports as corruption, and the entry is dropped.
    #[inline]
    pub fn post(&mut self, e: &[u8]) {
        if self.closing() {
            return;
        }
        let _ = self.cq.stage(e);
        self.dirty = true;
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
        self.cq.publish();
        if peer_sleeping(self.region.client_sleeping()) {
            self.client_bell.ring();
            return true;
        }
        false
    }
}
