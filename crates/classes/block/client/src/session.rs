//! The block class's client over a session (the `separate` placement): block requests in and
//! out of a [`Channel`], which holds the class-independent session logic. When the server
//! restarts, the core resumes the session (`outboard_client::resume`); the block class's
//! policy is [`Policy::Replay`](outboard_client::Policy): every unanswered request is sent
//! again before anything new, writes minus the blocks a later-acknowledged write covered.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outboard_block::{
    BlockCompletion, BlockDevice, BlockError, BlockInfo, BlockRequest, Sqe, RINGS,
};
use outboard_session::{Code, Geometry};

use outboard_client::resume::{reconnect, settle, Resume, Settled};
use outboard_client::{Channel, ChannelError, Supervisor, WaitMode};

use crate::inflight::InFlight;

/// Options for a new session.
#[derive(Debug, Clone, Copy)]
pub struct SessionOptions {
    /// Entries in each ring (a power of two): the most requests in flight.
    pub depth: u32,
    /// Bytes in the buffer area (whole pages).
    pub buffer_size: u64,
    /// How to wait.
    pub mode: WaitMode,
    /// Control round-trip timeout.
    pub timeout: Duration,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            depth: 256,
            buffer_size: 4 << 20,
            mode: WaitMode::Blocking,
            timeout: Duration::from_secs(10),
        }
    }
}

/// The block class's meaning of a session failure.
fn channel_err(e: ChannelError) -> BlockError {
    match e {
        ChannelError::Gone => BlockError::DeviceGone,
        ChannelError::Timeout => BlockError::Timeout,
        ChannelError::Connect(m) => BlockError::NoSuchDevice(m),
        ChannelError::Refused(r) => r.into(),
        ChannelError::Protocol(m) => BlockError::Protocol(m),
    }
}

/// Where the completion ring is among [`RINGS`].
const COMPLETIONS: usize = 1;

/// How a session fared across server restarts.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ResumeStats {
    /// Times the session was resumed on a restarted server.
    pub resumes: u64,
    /// Requests sent again that a server may have taken (parts of a write count once each):
    /// the replay the class's policy is about.
    pub replayed: u64,
    /// Requests sent to the new server that the old one never took (they waited in its ring,
    /// as after a graceful restart): sent for the first time, not replayed.
    pub requeued: u64,
    /// The longest time from noticing the server gone to the replay being answered.
    pub longest: Duration,
}

/// How often a session whose device was given up asks the manager whether it is back.
const ASK_AGAIN: Duration = Duration::from_millis(100);
/// How long a session whose given-up device is coming back waits for its server.
const COMING_BACK: Duration = Duration::from_secs(10);

/// A session with a block device served by a driver server.
pub struct BlockClient {
    channel: Channel,
    info: BlockInfo,
    /// What the server has not answered: enough to send it again to a restarted server.
    pending: InFlight,
    /// Completions already taken (during a resume) and not yet handed to the caller.
    ready: VecDeque<BlockCompletion>,
    /// Most requests in flight: the completion ring's entries.
    depth: usize,
    server: PathBuf,
    device: String,
    timeout: Duration,
    supervisor: Option<Supervisor>,
    /// The session ended: every later call fails with this — unless the device was given up
    /// and has come back since (see [`BlockClient::server_gone`]).
    ended: Option<BlockError>,
    /// It ended because the manager gave the device up (`Code::GivenUp`), which is not
    /// forever: a later call asks whether it is back.
    given_up: bool,
    /// The channel is a replay's that has not been answered whole: its answers are tagged
    /// by their place in the replay, not by slot, and are never taken for the slots'.
    on_replay: bool,
    /// When the manager was last asked whether a given-up device is back.
    asked_again: Option<Instant>,
    resumes: ResumeStats,
    /// Each resume: when the server was found gone, and when the replay was answered.
    resume_log: Vec<(Instant, Instant)>,
}

impl std::fmt::Debug for BlockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockClient")
            .field("session", &self.channel.session())
            .field("info", &self.info)
            .finish()
    }
}

impl BlockClient {
    /// Opens `device` on the driver server listening at `server`.
    pub fn open(server: &Path, device: &str, opts: SessionOptions) -> Result<Self, BlockError> {
        let sock = outboard_client::link::connect_trusted(server).map_err(channel_err)?;
        Self::open_on(sock, server, device, opts)
    }

    /// Opens `device` on the driver server at `server`, connected to through `supervisor`'s
    /// manager (which makes the connection for a brokered client), and resumes the session
    /// under it when the server restarts.
    pub fn open_supervised(
        supervisor: Supervisor,
        server: &Path,
        device: &str,
        opts: SessionOptions,
    ) -> Result<Self, BlockError> {
        let sock = supervisor
            .control
            .connect_server(server, device)
            .map_err(channel_err)?;
        Ok(Self::open_on(sock, server, device, opts)?.supervised(supervisor))
    }

    /// Opens `device` on `sock`, a connection to the driver server at `server`.
    fn open_on(
        sock: std::os::fd::OwnedFd,
        server: &Path,
        device: &str,
        opts: SessionOptions,
    ) -> Result<Self, BlockError> {
        let geometry = Geometry::of_class(&RINGS, opts.depth, opts.buffer_size);
        let (channel, info) = Channel::open_on(
            sock,
            device,
            outboard_block::CLASS,
            geometry,
            opts.mode,
            opts.timeout,
        )
        .map_err(channel_err)?;
        let info = parse_info(info)?;
        let g = channel.geometry();
        let depth = g.rings[COMPLETIONS].entries as usize;
        Ok(Self {
            channel,
            pending: InFlight::new(info.block_size),
            info,
            ready: VecDeque::new(),
            depth,
            server: server.to_owned(),
            device: device.to_owned(),
            timeout: opts.timeout,
            supervisor: None,
            ended: None,
            given_up: false,
            on_replay: false,
            asked_again: None,
            resumes: ResumeStats::default(),
            resume_log: Vec::new(),
        })
    }

    /// Makes the session outlive its server: when the server dies, the client waits for the
    /// supervisor to start it again, resumes the session on the new server with the same
    /// buffer area, and sends again every request that was not answered — before any new
    /// one — so the caller sees a delay, not an error. Without a supervisor a dead server
    /// fails the session with [`BlockError::DeviceGone`].
    pub fn supervised(mut self, supervisor: Supervisor) -> Self {
        self.supervisor = Some(supervisor);
        self
    }

    /// Asks the driver server at `server` for the status of `device`, without opening a session.
    pub fn status(server: &Path, device: &str) -> Result<BlockInfo, BlockError> {
        parse_info(Channel::status(server, device, Duration::from_secs(10)).map_err(channel_err)?)
    }

    /// The session id the server assigned.
    pub fn session(&self) -> u64 {
        self.channel.session()
    }

    /// Changes how [`BlockDevice::wait`] waits.
    pub fn set_mode(&mut self, mode: WaitMode) {
        self.channel.set_mode(mode);
    }

    /// How the session fared across server restarts.
    pub fn resume_stats(&self) -> ResumeStats {
        self.resumes
    }

    /// Each resume: when the server was found gone, and when the replay was answered (the
    /// first completions from the new server).
    pub fn resume_log(&self) -> &[(Instant, Instant)] {
        &self.resume_log
    }

    /// Takes what the server posted into `out`.
    fn reap(&mut self, out: &mut Vec<BlockCompletion>) -> Result<usize, BlockError> {
        if self.on_replay {
            // A replay's answers, its server gone or its session ended: every request they
            // answer is still pending (and is replayed, or ended).
            while self
                .channel
                .completion::<BlockError>(0)
                .is_ok_and(|c| c.is_some())
            {}
            return Ok(0);
        }
        let mut n = 0;
        while let Some((tag, result)) = self.channel.completion(0).map_err(channel_err)? {
            out.push(self.pending.complete(tag, result)?);
            n += 1;
        }
        Ok(n)
    }

    /// The server is gone: resumes the session on its successor if there is a supervisor,
    /// else ends it. On return the session is usable again or has ended for good.
    fn server_gone(&mut self) -> Result<(), BlockError> {
        let r = self.resume_or_end();
        // A resume that failed without ending the session (a server answering a request it
        // was not sent, a replay past its deadline) ends it with that error: left open, its
        // requests would wait for ever, and a replay's channel would be read as the slots'.
        if let Err(e) = &r {
            if self.ended.is_none() {
                let _ = self.end(e.clone());
            }
        }
        r
    }

    fn resume_or_end(&mut self) -> Result<(), BlockError> {
        if let Some(e) = &self.ended {
            // Given up is not forever: the manager retries the device, and an operator may
            // restart it. A later call resumes the session once the manager no longer says
            // it gave up (asking at most every 100 ms; the calls between fail at once).
            // Only a device the manager gave up comes back so (not one that ended the session
            // another way: the restarted driver serving another disk, say).
            let back = self.given_up
                && self.supervisor.as_ref().is_some_and(|sup| {
                    let now = Instant::now();
                    if self
                        .asked_again
                        .is_some_and(|t| now.duration_since(t) < ASK_AGAIN)
                    {
                        return false;
                    }
                    self.asked_again = Some(now);
                    outboard_client::resume::verdict(&sup.control, &self.device).is_none()
                });
            if !back {
                return Err(e.clone());
            }
            self.ended = None;
            self.given_up = false;
        }
        let Some(sup) = self.supervisor.clone() else {
            return self.end(BlockError::DeviceGone);
        };
        let started = Instant::now();
        // Coming back from a give-up, the manager has the device restarting already: a
        // short wait (a caller, or the export's pump, is not held for the full patience).
        let patience = if self.asked_again.is_some() {
            sup.patience.min(COMING_BACK)
        } else {
            sup.patience
        };
        let give_up = started + patience;
        loop {
            // What the old server answered before it died is answered. (Not what a replay's
            // server answered before it died too: `reap` leaves that; every request is still
            // pending and is sent again, and since nothing new was sent meanwhile, a write
            // made twice is the same write.)
            let mut done = Vec::new();
            let reaped = self.reap(&mut done);
            self.ready.extend(done);
            reaped?;
            match self.resume(&sup, give_up)? {
                Resumed::Yes => break,
                // The new server died too while the replay ran: go again.
                Resumed::GoneAgain => {}
            }
        }
        let took = started.elapsed();
        self.asked_again = None;
        self.resume_log.push((started, Instant::now()));
        self.resumes.resumes += 1;
        self.resumes.longest = self.resumes.longest.max(took);
        Ok(())
    }

    /// Ends the session: every request in flight completes with `e`, and so does every later
    /// call.
    fn end(&mut self, e: BlockError) -> Result<(), BlockError> {
        for slot in self.pending.slots() {
            if let Ok(c) = self.pending.complete(slot as u64, Err(e.clone())) {
                self.ready.push_back(c);
            }
        }
        self.ended = Some(e.clone());
        Err(e)
    }

    /// Waits for the supervisor's new server, opens the session on it and replays.
    fn resume(&mut self, sup: &Supervisor, give_up: Instant) -> Result<Resumed, BlockError> {
        let kept = outboard_block::Kept {
            locks: self.pending.locks().to_vec(),
        };
        // What the replay will send, told to the new server for its counters.
        let replaying = self.pending.replay(self.channel.taken(0)).0.len();
        let how = Resume {
            server: &self.server,
            device: &self.device,
            class: outboard_block::CLASS,
            geometry: self.channel.geometry().clone(),
            buffers: self.channel.shared_buffers(),
            kept: serde_json::to_value(kept).expect("serialisable"),
            replaying: u32::try_from(replaying).unwrap_or(u32::MAX),
            mode: self.channel.mode(),
            timeout: self.timeout,
        };
        let back = match reconnect(sup, &how, give_up) {
            Ok(back) => back,
            Err(e) => {
                self.given_up = e.code == Code::GivenUp;
                return self.end(e.into()).map(|_| Resumed::Yes);
            }
        };
        let info = parse_info(back.info)?;
        if info.capacity != self.info.capacity || info.block_size != self.info.block_size {
            let why = format!(
                "the restarted driver serves another disk ({} blocks of {}, was {} of {})",
                info.capacity, info.block_size, self.info.capacity, self.info.block_size
            );
            return self
                .end(BlockError::DeviceFailed(why))
                .map(|_| Resumed::Yes);
        }
        // What the dead server took, read from the ring it left, before it is dropped.
        let taken = self.channel.taken(0);
        self.channel = back.channel;
        self.server = back.server;
        self.on_replay = true;
        let replayed = self.replay(taken);
        if matches!(replayed, Ok(Resumed::Yes)) {
            self.on_replay = false;
        }
        replayed
    }

    /// Sends every unanswered request again, in the order they were submitted, and waits for
    /// all of them: nothing new goes to the device before the replay is answered.
    fn replay(&mut self, taken: u32) -> Result<Resumed, BlockError> {
        let (parts, covered) = self.pending.replay(taken);
        self.pending.resent();
        for slot in covered {
            let bytes = self.pending.request(slot).map_or(0, |r| {
                if r.op == outboard_block::BlockOp::Write {
                    r.blocks * self.info.block_size
                } else {
                    0
                }
            });
            let c = self.pending.complete(slot as u64, Ok(bytes))?;
            self.ready.push_back(c);
        }
        // Parts left per slot, and the first error any part got.
        let mut left: std::collections::HashMap<u32, (usize, Option<BlockError>)> =
            std::collections::HashMap::new();
        for p in &parts {
            left.entry(p.slot).or_insert((0, None)).0 += 1;
        }
        let deadline = Instant::now() + self.timeout.max(Duration::from_secs(60));
        // Each part goes out under its index among the parts (the core's replay).
        let answers = match settle::<BlockError>(
            outboard_block::POLICY,
            &mut self.channel,
            0,
            parts.len(),
            |i| {
                Sqe::encode(&BlockRequest {
                    tag: i,
                    ..parts[i as usize].req
                })
                .0
                .to_vec()
            },
            self.depth,
            deadline,
        )
        .map_err(channel_err)?
        {
            Settled::Answered(answers) => answers,
            Settled::GoneAgain => return Ok(Resumed::GoneAgain),
        };
        let resent = parts.iter().filter(|p| p.taken).count() as u64;
        self.resumes.replayed += resent;
        self.resumes.requeued += parts.len() as u64 - resent;
        for (i, result) in answers {
            let slot = parts[i as usize].slot;
            let entry = left.get_mut(&slot).expect("every part's slot is counted");
            entry.0 -= 1;
            if let Err(err) = result {
                entry.1.get_or_insert(err);
            }
            if entry.0 == 0 {
                let (_, err) = left.remove(&slot).expect("present");
                let full = self.pending.request(slot).map_or(0, |r| {
                    if matches!(
                        r.op,
                        outboard_block::BlockOp::Read | outboard_block::BlockOp::Write
                    ) {
                        r.blocks * self.info.block_size
                    } else {
                        0
                    }
                });
                let c = self
                    .pending
                    .complete(slot as u64, err.map_or(Ok(full), Err))?;
                self.ready.push_back(c);
            }
        }
        Ok(Resumed::Yes)
    }
}

/// Whether a resume attempt succeeded.
enum Resumed {
    /// The session is back and its replay answered.
    Yes,
    /// The new server died during the replay.
    GoneAgain,
}

/// A block device's status from a server, checked before anything relies on it.
fn parse_info(info: serde_json::Value) -> Result<BlockInfo, BlockError> {
    let info: BlockInfo = serde_json::from_value(info)
        .map_err(|e| BlockError::Protocol(format!("device status: {e}")))?;
    if info.block_size < 512 || !info.block_size.is_power_of_two() {
        return Err(BlockError::Protocol(format!(
            "block size {}",
            info.block_size
        )));
    }
    Ok(info)
}

impl BlockClient {
    /// The server hung up while the caller waited. Resumed (the replay's answers are in
    /// `ready`) or ended (so are the errors): either way the next poll hands them over; an
    /// error here only when the session ended with nothing left to hand over.
    fn after_hang_up(&mut self) -> Result<(), BlockError> {
        let _ = self.server_gone();
        match &self.ended {
            Some(e) if self.ready.is_empty() => Err(e.clone()),
            _ => Ok(()),
        }
    }
}

impl BlockDevice for BlockClient {
    fn info(&self) -> &BlockInfo {
        &self.info
    }

    fn buffers(&self) -> &outboard_shm::SharedMem {
        self.channel.buffers()
    }

    fn submit(&mut self, r: &BlockRequest) -> Result<(), BlockError> {
        // An ended session takes nothing new (unless its given-up device is back).
        if self.ended.is_some() || self.channel.is_gone() {
            self.server_gone()?;
        }
        // No check of the request here: the server checks it (it must: the client is not
        // trusted) and answers a bad one with the error and its reason, so the path has one
        // check per side — the caller's early one (`BlockInfo::byte_range`, as `blk read`
        // does before a transfer), the server's, and the device's own.
        if self.pending.len() >= self.depth {
            return Err(BlockError::QueueFull);
        }
        let wire = self.pending.insert(r);
        let position = self.channel.position(0);
        match self.channel.stage(0, &Sqe::encode(&wire).0) {
            Ok(true) => {
                self.pending.staged_at(wire.tag, position);
                Ok(())
            }
            Ok(false) => {
                self.pending.cancel(wire.tag);
                Err(BlockError::QueueFull)
            }
            // Recorded: the resume sends it with the others.
            Err(ChannelError::Gone) => self.server_gone(),
            Err(e) => {
                self.pending.cancel(wire.tag);
                Err(channel_err(e))
            }
        }
    }

    fn kick(&mut self) -> Result<(), BlockError> {
        self.channel.kick();
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<BlockCompletion>) -> Result<usize, BlockError> {
        let early = self.ready.len();
        out.extend(self.ready.drain(..));
        // An ended session's requests were all answered when it ended.
        if self.ended.is_some() {
            return Ok(early);
        }
        Ok(early + self.reap(out)?)
    }

    fn block_until(&mut self, deadline: Instant) -> Result<(), BlockError> {
        match self.channel.wait(deadline) {
            // The caller's loop tells a timeout by the clock.
            Ok(()) | Err(ChannelError::Timeout) => Ok(()),
            Err(ChannelError::Gone) => self.after_hang_up(),
            Err(e) => Err(channel_err(e)),
        }
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
    }

    fn wait_or_readable(
        &mut self,
        out: &mut Vec<BlockCompletion>,
        timeout: Duration,
        also: std::os::fd::BorrowedFd<'_>,
    ) -> Result<bool, BlockError> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.poll(out)? > 0 {
                return Ok(false);
            }
            if self.pending.is_empty() {
                return outboard_block::readable(also, timeout);
            }
            match self.channel.wait_or(deadline, Some(also)) {
                Ok(true) => return Ok(true),
                Ok(false) => {}
                Err(ChannelError::Timeout) => return Ok(false),
                Err(ChannelError::Gone) => self.after_hang_up()?,
                Err(e) => return Err(channel_err(e)),
            }
        }
    }
}
