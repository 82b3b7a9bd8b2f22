//! A session's client side, whatever the class: opening, the rings the class declared,
//! doorbells, and the wait logic (adaptive spin, announce sleep, re-check, block on the doorbell or notice the
//! server is gone), written once for every class client.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_session::completion::{Completion, WireError, COMPLETION_SIZE};
use outboard_session::control::{self, Reply, Request};
use outboard_session::doorbell::{announce_sleep, cancel_sleep, peer_sleeping};
use outboard_session::region::ShmRing;
use outboard_session::{
    Code, Consumer, Direction, Doorbell, Geometry, Producer, Refusal, Region, SessionError,
};
use outboard_shm::SharedMem;
use rustix::event::{PollFd, PollFlags};

/// How a client waits for completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitMode {
    /// Announce sleep and block on the doorbell at once.
    Blocking,
    /// Spin for up to this long re-checking the ring, then block.
    Adaptive(Duration),
}

/// A request's tag and its result, as a completion brings them.
pub type Answer<E> = (u64, Result<u32, E>);

/// Why a session call failed, before a class gives it its own meaning.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChannelError {
    /// No server at the socket.
    #[error("{0}")]
    Connect(String),
    /// The server closed the session (it exited, or cut this client off).
    #[error("the session was closed by the server")]
    Gone,
    /// Nothing arrived in time.
    #[error("timed out")]
    Timeout,
    /// The server refused, with its code and reason.
    #[error("{}: {}", .0.code, .0.reason)]
    Refused(Refusal),
    /// The server broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl From<ChannelError> for Refusal {
    /// What a session's failure means to a caller who does not speak its class.
    fn from(e: ChannelError) -> Self {
        match e {
            ChannelError::Gone => {
                Refusal::new(Code::DeviceGone, "the session was closed by the server")
            }
            ChannelError::Timeout => {
                Refusal::new(Code::Timeout, "the server did not answer in time")
            }
            ChannelError::Connect(m) => Refusal::new(Code::Unreachable, m),
            ChannelError::Refused(r) => r,
            ChannelError::Protocol(m) => Refusal::new(Code::Protocol, m),
        }
    }
}

impl From<SessionError> for ChannelError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::Closed => ChannelError::Gone,
            SessionError::Timeout => ChannelError::Timeout,
            SessionError::Connect(m) => ChannelError::Connect(m),
            e => ChannelError::Protocol(e.to_string()),
        }
    }
}

/// An open session.
pub struct Channel {
    sock: OwnedFd,
    region: Region,
    /// The rings to the server, in session order.
    outbound: Vec<Producer<ShmRing>>,
    /// The rings to the client, in session order.
    inbound: Vec<Consumer<ShmRing>>,
    server_bell: Doorbell,
    client_bell: Doorbell,
    mode: WaitMode,
    session: u64,
    /// The server closed the session: every later call fails at once.
    gone: bool,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("session", &self.session)
            .field("geometry", &self.region.geometry)
            .finish()
    }
}

impl Channel {
    /// Opens a session of `class` on `device` at the driver server listening at `server`;
    /// returns it and the device's status as the server sent it.
    pub fn open(
        server: &Path,
        device: &str,
        class: &str,
        geometry: Geometry,
        mode: WaitMode,
        timeout: Duration,
    ) -> Result<(Self, serde_json::Value), ChannelError> {
        let sock = crate::link::connect_trusted(server)?;
        Self::open_on(sock, device, class, geometry, mode, timeout)
    }

    /// As [`Channel::open`], on `sock`, a connection to the driver server made already (by
    /// the manager, for a brokered client: [`crate::Control::connect_server`]).
    pub fn open_on(
        sock: OwnedFd,
        device: &str,
        class: &str,
        geometry: Geometry,
        mode: WaitMode,
        timeout: Duration,
    ) -> Result<(Self, serde_json::Value), ChannelError> {
        let req = Request::Open {
            device: device.into(),
            class: class.into(),
            geometry: geometry.clone(),
        };
        Self::establish(sock, &req, geometry, None, mode, timeout)
    }

    /// Resumes a session with a restarted server on `sock`, a connection to it: a new session
    /// around the buffer area this client kept (so buffers in use stay valid), claiming back
    /// `kept`, the class's own state (opaque here; block: the ranges it held locked), and
    /// saying how many requests it will send again (`replaying`, for the server's counters).
    #[allow(clippy::too_many_arguments)]
    pub fn resume_on(
        sock: OwnedFd,
        device: &str,
        class: &str,
        geometry: Geometry,
        buffers: Arc<SharedMem>,
        kept: serde_json::Value,
        replaying: u32,
        mode: WaitMode,
        timeout: Duration,
    ) -> Result<(Self, serde_json::Value), ChannelError> {
        let req = Request::Resume {
            device: device.into(),
            class: class.into(),
            geometry: geometry.clone(),
            kept,
            replaying,
        };
        Self::establish(sock, &req, geometry, Some(buffers), mode, timeout)
    }

    /// Sends `req` (with the kept buffer area's fd, when resuming) and maps what the server
    /// granted.
    fn establish(
        sock: OwnedFd,
        req: &Request,
        requested: Geometry,
        kept: Option<Arc<SharedMem>>,
        mode: WaitMode,
        timeout: Duration,
    ) -> Result<(Self, serde_json::Value), ChannelError> {
        let pass: Vec<BorrowedFd<'_>> = kept.as_ref().and_then(|b| b.fd()).into_iter().collect();
        control::send(sock.as_fd(), req, &pass)?;
        let (reply, fds) = control::recv(sock.as_fd(), Some(timeout))?;
        let (session, geometry, info) = match reply {
            Reply::Opened {
                session,
                geometry,
                info,
            } => (session, geometry, info),
            Reply::Error { code, message } => {
                return Err(ChannelError::Refused(Refusal::new(code, message)))
            }
            other => {
                return Err(ChannelError::Protocol(format!(
                    "unexpected reply {other:?}"
                )))
            }
        };
        let [control_fd, buffers_fd, server_bell, client_bell]: [OwnedFd; 4] =
            fds.try_into().map_err(|v: Vec<OwnedFd>| {
                ChannelError::Protocol(format!("open reply carried {} fds, not 4", v.len()))
            })?;
        if geometry != requested {
            return Err(ChannelError::Protocol(format!(
                "the server granted {geometry:?}, not the {requested:?} asked for"
            )));
        }
        let region = match kept {
            None => Region::attach(control_fd, buffers_fd, geometry)?,
            // The server's copy of the buffer fd is ours: the mapping we keep is the one the
            // caller's buffers live in.
            Some(buffers) => Region::attach_to(control_fd, buffers, geometry)?,
        };
        let channel = Self {
            outbound: region.producers(Direction::ToServer),
            inbound: region.consumers(Direction::ToClient),
            region,
            sock,
            server_bell: Doorbell::from_fd(server_bell),
            client_bell: Doorbell::from_fd(client_bell),
            mode,
            session,
            gone: false,
        };
        Ok((channel, info))
    }

    /// Asks the server at `server` for `device`'s status without opening a session.
    pub fn status(
        server: &Path,
        device: &str,
        timeout: Duration,
    ) -> Result<serde_json::Value, ChannelError> {
        let sock = control::connect(server)?;
        let req = Request::Status {
            device: device.into(),
        };
        match control::call(sock.as_fd(), &req, timeout)?.0 {
            Reply::Status { info } => Ok(info),
            Reply::Error { code, message } => {
                Err(ChannelError::Refused(Refusal::new(code, message)))
            }
            other => Err(ChannelError::Protocol(format!(
                "unexpected reply {other:?}"
            ))),
        }
    }

    /// The session id the server assigned.
    #[inline]
    pub fn session(&self) -> u64 {
        self.session
    }

    /// The geometry agreed.
    #[inline]
    pub fn geometry(&self) -> &Geometry {
        &self.region.geometry
    }

    /// The buffer area.
    #[inline]
    pub fn buffers(&self) -> &SharedMem {
        &self.region.buffers
    }

    /// The buffer area, to keep across a resumed session.
    pub fn shared_buffers(&self) -> Arc<SharedMem> {
        self.region.buffers.clone()
    }

    /// The wait mode.
    pub fn mode(&self) -> WaitMode {
        self.mode
    }

    /// Whether the server closed the session.
    #[inline]
    pub fn is_gone(&self) -> bool {
        self.gone
    }

    /// Changes how [`Channel::wait`] waits.
    pub fn set_mode(&mut self, mode: WaitMode) {
        self.mode = mode;
    }

    /// Stages an entry on the `ring`-th ring to the server; false if it is full.
    #[inline]
    pub fn stage(&mut self, ring: usize, entry: &[u8]) -> Result<bool, ChannelError> {
        if self.gone {
            return Err(ChannelError::Gone);
        }
        self.outbound[ring]
            .stage(entry)
            .map_err(|e| ChannelError::Protocol(e.to_string()))
    }

    /// Where the next entry staged on ring `ring` to the server goes (see
    /// [`outboard_session::ring::Producer::position`]).
    pub fn position(&self, ring: usize) -> u32 {
        self.outbound[ring].position()
    }

    /// How many entries of ring `ring` the server took — after it died too, read from the
    /// ring it left: a request staged after them never reached it, and may be sent again
    /// under any class's policy.
    pub fn taken(&self, ring: usize) -> u32 {
        self.outbound[ring].taken()
    }

    /// Publishes staged entries on every ring to the server and rings the server only if it
    /// announced sleep.
    #[inline]
    pub fn kick(&mut self) {
        for r in &mut self.outbound {
            r.publish();
        }
        if peer_sleeping(self.region.server_sleeping()) {
            self.server_bell.ring();
        }
    }

    /// Takes the next entry of the `ring`-th ring to the client into `entry`; false if there
    /// is none.
    #[inline]
    pub fn pop(&mut self, ring: usize, entry: &mut [u8]) -> Result<bool, ChannelError> {
        self.inbound[ring]
            .pop(entry)
            .map_err(|e| ChannelError::Protocol(e.to_string()))
    }

    /// Takes the next completion of the `ring`-th ring to the client (an entry of the
    /// [`outboard_session::completion`] layout) with the reason that went ahead of it if it
    /// failed: the request's tag and its result in the class's terms; `None` if there is none.
    #[inline]
    pub fn completion<E: WireError>(
        &mut self,
        ring: usize,
    ) -> Result<Option<Answer<E>>, ChannelError> {
        let mut e = [0u8; COMPLETION_SIZE as usize];
        if !self.pop(ring, &mut e)? {
            return Ok(None);
        }
        let c = Completion::decode(&e);
        let reason = if c.reason_sent() {
            self.reason(c.tag)
        } else {
            None
        };
        Ok(Some((c.tag, c.result(reason))))
    }

    /// Waits for the completion of `tag` on the `ring`-th ring to the client, passing over
    /// the completions of other requests (the caller has given up on them), until `deadline`
    /// ([`ChannelError::Timeout`]).
    pub fn answer<E: WireError>(
        &mut self,
        ring: usize,
        tag: u64,
        deadline: Instant,
    ) -> Result<Result<u32, E>, ChannelError> {
        loop {
            while let Some((t, result)) = self.completion::<E>(ring)? {
                if t == tag {
                    return Ok(result);
                }
            }
            self.wait(deadline)?;
        }
    }

    /// The reason the server sent ahead of a failed completion for `tag`; `None` if there is
    /// none or it is not for that request (a server that breaks the rule loses its words,
    /// nothing else).
    fn reason(&mut self, tag: u64) -> Option<String> {
        let ring = self.inbound.get_mut(outboard_session::RingShape::REASONS)?;
        let mut e = [0u8; outboard_session::reason::REASON_SIZE as usize];
        if !matches!(ring.pop(&mut e), Ok(true)) {
            return None;
        }
        outboard_session::reason::decode(&e)
            .filter(|(t, _)| *t == tag)
            .map(|(_, text)| text)
    }

    /// Whether an entry waits on any ring to the client.
    #[inline]
    fn completions_waiting(&self) -> Result<bool, ChannelError> {
        for r in &self.inbound {
            if r.available()
                .map_err(|e| ChannelError::Protocol(e.to_string()))?
                > 0
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Waits until an entry is on a ring to the client or `deadline` passes: spins first in adaptive
    /// mode, then announces sleep, re-checks the ring (the doorbell rule: a completion posted
    /// between the check and the announcement is not missed), and blocks on the doorbell and
    /// the control socket together — the latter wakes it when the server is gone.
    pub fn wait(&mut self, deadline: Instant) -> Result<(), ChannelError> {
        self.wait_or(deadline, None).map(|_| ())
    }

    /// As [`Channel::wait`], but also wakes when `also` becomes readable; true if it did.
    pub fn wait_or(
        &mut self,
        deadline: Instant,
        also: Option<BorrowedFd<'_>>,
    ) -> Result<bool, ChannelError> {
        loop {
            if self.completions_waiting()? {
                return Ok(false);
            }
            if self.gone {
                return Err(ChannelError::Gone);
            }
            if let WaitMode::Adaptive(spin) = self.mode {
                let until = Instant::now() + spin;
                while Instant::now() < until {
                    if self.completions_waiting()? {
                        return Ok(false);
                    }
                    std::hint::spin_loop();
                }
            }
            let flag = self.region.client_sleeping();
            announce_sleep(flag);
            if self.completions_waiting()? {
                cancel_sleep(flag);
                return Ok(false);
            }
            let now = Instant::now();
            if now >= deadline {
                cancel_sleep(flag);
                return Err(ChannelError::Timeout);
            }
            let r = self.block(deadline - now, also);
            cancel_sleep(self.region.client_sleeping());
            if r? {
                return Ok(true);
            }
        }
    }

    /// Blocks on the doorbell, the control socket (readable: the server is gone) and `also`;
    /// true if `also` is readable.
    fn block(
        &mut self,
        timeout: Duration,
        also: Option<BorrowedFd<'_>>,
    ) -> Result<bool, ChannelError> {
        let ts = rustix::time::Timespec {
            tv_sec: timeout.as_secs() as _,
            tv_nsec: timeout.subsec_nanos() as _,
        };
        let bell = self.client_bell.fd();
        let extra = also.unwrap_or(bell);
        let mut p = [
            PollFd::new(&bell, PollFlags::IN),
            PollFd::new(&self.sock, PollFlags::IN),
            PollFd::new(&extra, PollFlags::IN),
        ];
        let watched = if also.is_some() { 3 } else { 2 };
        match rustix::event::poll(&mut p[..watched], Some(&ts)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(ChannelError::Protocol(format!("poll: {e}"))),
        }
        if !p[1].revents().is_empty() {
            self.gone = true;
            return Err(ChannelError::Gone);
        }
        let also_ready = watched == 3 && !p[2].revents().is_empty();
        self.client_bell.drain();
        Ok(also_ready)
    }
}
