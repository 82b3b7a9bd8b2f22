//! A session with a NIC served by a driver server.
//!
//! The buffer area is cut into fixed slots, each holding a whole frame of the NIC's MTU
//! ([`SLOT`] bytes up to an MTU of 2,034, the next power of two above, up to [`MAX_SLOT`]
//! for jumbo frames): the first [`NetOptions::receive_buffers`]
//! are kept posted for receiving, the rest hold frames being sent. A frame is written once,
//! into its slot; the device reads it there. A received frame is read out of its slot, which
//! is then posted again. Requests carry the slot in their tag, so a completion names the
//! slot it frees.
//!
//! **Across a restart of the driver server** (a session opened under the manager's
//! supervision), the session is resumed on the new server and put back as it was: every
//! receive buffer that was posted is posted again, and the filter, receive mode and groups
//! are set again. A frame is sent at most once, and its completion reported once: a frame the
//! dead server had taken may have gone out, so it completes with [`NetError::Interrupted`] and
//! is not sent again; one it had not taken (still in the ring) never reached it, and is sent on
//! the new server. Frames that arrive while no driver runs are lost, as on a NIC being reset.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outboard_client::resume::{reconnect, Resume};
use outboard_client::{Channel, ChannelError, Supervisor, WaitMode};
use outboard_net::bpf::Program;
use outboard_net::{NetError, NetInfo, NetOp, NetRequest, Sqe, CLASS, RINGS};
use outboard_session::Geometry;

/// Bytes of one slot of the buffer area, at least (a frame of a 1500-byte MTU fits).
pub const SLOT: u64 = 2048;
/// Bytes of one slot at most: a frame of a 9000-byte MTU (jumbo frames) fits. A NIC whose
/// frames need more is refused rather than costing each session megabytes.
pub const MAX_SLOT: u64 = 16384;

/// The slot that holds a whole frame of `max_frame` bytes, or why none does.
pub fn slot_for(info: &NetInfo) -> Result<u64, NetError> {
    let slot = u64::from(info.max_frame()).next_power_of_two().max(SLOT);
    if slot > MAX_SLOT {
        return Err(NetError::Protocol(format!(
            "a NIC with an MTU of {}: this client holds frames of up to {MAX_SLOT} bytes",
            info.mtu
        )));
    }
    Ok(slot)
}
/// Tags of receive buffers: the slot.
const RECEIVE: u64 = 0;
/// Tags of frames sent: this bit and the slot.
const TRANSMIT: u64 = 1 << 62;
/// Tags of requests that hold no slot (filter, mode, groups, reclaim): this bit and a count.
const CONTROL: u64 = 1 << 61;

/// How a session is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetOptions {
    /// Slots kept posted for receiving.
    pub receive_buffers: u32,
    /// Slots for frames being sent.
    pub transmit_buffers: u32,
    /// How the client waits.
    pub mode: WaitMode,
    /// How long a call waits for the server before it fails with a timeout.
    pub timeout: Duration,
    /// Take the NIC's receive path ([`NetOp::Own`]): the device writes each frame straight
    /// into this session's buffers, with no copy in the server. Refused (`busy`) while
    /// another session receives on the NIC, and by a driver that cannot lend buffers.
    pub own_receive: bool,
}

impl Default for NetOptions {
    fn default() -> Self {
        Self {
            receive_buffers: 128,
            transmit_buffers: 64,
            mode: WaitMode::Blocking,
            timeout: Duration::from_secs(10),
            own_receive: false,
        }
    }
}

/// The net class's meaning of a session failure.
fn channel_err(e: ChannelError) -> NetError {
    match e {
        ChannelError::Gone => NetError::DeviceGone,
        ChannelError::Timeout => NetError::Timeout,
        ChannelError::Connect(m) => NetError::NoSuchDevice(m),
        ChannelError::Refused(r) => r.into(),
        ChannelError::Protocol(m) => NetError::Protocol(m),
    }
}

/// The device's status from a server, checked before anything relies on it.
pub fn parse_info(v: serde_json::Value) -> Result<NetInfo, NetError> {
    let info: NetInfo =
        serde_json::from_value(v).map_err(|e| NetError::Protocol(format!("device status: {e}")))?;
    slot_for(&info)?;
    Ok(info)
}

/// A frame sent and not yet answered.
#[derive(Debug, Clone, Copy)]
struct Sending {
    /// Its place in the order frames were sent (they are sent again in that order).
    seq: u64,
    /// Where it was staged on the current ring, to tell after the server died whether it
    /// took it; `None` while it is staged on no ring (between two servers).
    position: Option<u32>,
    /// Its length.
    len: u32,
}

/// A session with a NIC served by a driver server.
pub struct NetClient {
    channel: Channel,
    server: PathBuf,
    device: String,
    info: NetInfo,
    opts: NetOptions,
    /// Bytes of each slot of the buffer area.
    slot: u64,
    /// Transmit slots free (slot numbers, after the receive slots).
    tx_free: Vec<u32>,
    /// Received frames not yet read: (slot, where the frame starts in it, length or why not).
    received: VecDeque<(u32, u32, Result<u32, NetError>)>,
    /// Where a frame starts in a receive buffer: the device's header before it while this
    /// session owns the receive path, else 0.
    headroom: u32,
    /// Answers to control requests not yet collected.
    answers: Vec<(u64, Result<u32, NetError>)>,
    /// Frames whose sending failed, not yet reported.
    failed: VecDeque<NetError>,
    next_control: u64,
    /// Frames sent and not yet answered, by slot.
    sending: HashMap<u32, Sending>,
    /// The next frame's place in the order frames are sent.
    next_seq: u64,
    /// Putting the session back on a new server: a server found gone meanwhile is not
    /// resumed from inside (the resume's loop goes again, on the next one).
    restoring: bool,
    /// What the session set, to set again on a new server.
    filter: Option<Vec<u8>>,
    mode: u32,
    groups: Vec<[u8; 6]>,
    hold_off: Option<u32>,
    supervisor: Option<Supervisor>,
    resumes: u64,
}

impl NetClient {
    /// Opens `device` on the driver server at `server` and posts the receive buffers.
    pub fn open(server: &Path, device: &str, opts: NetOptions) -> Result<Self, NetError> {
        let connect = || outboard_client::link::connect_trusted(server).map_err(channel_err);
        Self::open_on(&connect, server, device, opts)
    }

    /// Opens `device` on the driver server at `server`, connected to through `supervisor`'s
    /// manager (a session is not yet resumed when the server restarts: it ends with
    /// [`NetError::DeviceGone`]).
    pub fn open_supervised(
        supervisor: &Supervisor,
        server: &Path,
        device: &str,
        opts: NetOptions,
    ) -> Result<Self, NetError> {
        let connect = || {
            supervisor
                .control
                .connect_server(server, device)
                .map_err(channel_err)
        };
        let mut c = Self::open_on(&connect, server, device, opts)?;
        c.supervisor = Some(supervisor.clone());
        Ok(c)
    }

    /// Opens `device` on a connection `connect` makes to the driver server at `server`. The
    /// slots are sized for the NIC's MTU, which the server says when the session opens: a
    /// NIC whose frames do not fit the smallest slots is opened again, on a new connection,
    /// with slots that hold them.
    fn open_on(
        connect: &dyn Fn() -> Result<OwnedFd, NetError>,
        server: &Path,
        device: &str,
        opts: NetOptions,
    ) -> Result<Self, NetError> {
        let slots = opts.receive_buffers + opts.transmit_buffers;
        if opts.receive_buffers == 0 || opts.transmit_buffers == 0 {
            return Err(NetError::Invalid(
                "a session needs at least one receive and one transmit buffer".into(),
            ));
        }
        // Every slot may have a completion waiting at once, and a control request besides.
        let depth = (slots + 1).next_power_of_two();
        let mut slot = SLOT;
        let (channel, info) = loop {
            let geometry = Geometry::of_class(&RINGS, depth, u64::from(slots) * slot);
            let (channel, info) =
                Channel::open_on(connect()?, device, CLASS, geometry, opts.mode, opts.timeout)
                    .map_err(channel_err)?;
            let info = parse_info(info)?;
            match slot_for(&info)? {
                need if need > slot => slot = need,
                _ => break (channel, info),
            }
        };
        let mut c = Self {
            info,
            slot,
            channel,
            server: server.to_owned(),
            device: device.to_owned(),
            opts,
            tx_free: (opts.receive_buffers..slots).rev().collect(),
            received: VecDeque::new(),
            answers: Vec::new(),
            failed: VecDeque::new(),
            next_control: 0,
            sending: HashMap::new(),
            next_seq: 0,
            restoring: false,
            filter: None,
            mode: 0,
            groups: Vec::new(),
            hold_off: None,
            supervisor: None,
            resumes: 0,
            headroom: 0,
        };
        // Owned before any buffer is posted: every buffer is then the device's own.
        if opts.own_receive {
            c.headroom = c.take_receive_path()?;
        }
        for slot in 0..opts.receive_buffers {
            c.post(slot)?;
        }
        c.channel.kick();
        Ok(c)
    }

    /// Asks for the receive path; the headroom. A slot must hold the headroom and the
    /// longest frame (with an 802.1Q tag): if it cannot, the path is given back.
    fn take_receive_path(&mut self) -> Result<u32, NetError> {
        let headroom = self.control(NetOp::Own, 0, 1)?;
        let need = u64::from(headroom) + u64::from(self.info.max_frame()) + 4;
        if need > self.slot {
            self.control(NetOp::Own, 0, 0)?;
            return Err(NetError::Invalid(format!(
                "receiving in place needs {need}-byte buffers; this session's are {}",
                self.slot
            )));
        }
        Ok(headroom)
    }

    /// Whether the device writes received frames straight into this session's buffers.
    pub fn owns_receive(&self) -> bool {
        self.headroom > 0
    }

    /// The NIC's status as it was when the session opened.
    pub fn info(&self) -> &NetInfo {
        &self.info
    }

    /// The NIC's status and its server's counters now, from the driver server at `server`.
    pub fn status(server: &Path, device: &str) -> Result<NetInfo, NetError> {
        parse_info(Channel::status(server, device, Duration::from_secs(5)).map_err(channel_err)?)
    }

    /// The NIC's status and its server's counters now.
    pub fn status_now(&self) -> Result<NetInfo, NetError> {
        Self::status(&self.server, &self.device)
    }

    /// Stages `r`; where on the ring it went (on the server it reached: after a resume, the
    /// new one's).
    fn stage(&mut self, r: &NetRequest) -> Result<u32, NetError> {
        let position = self.channel.position(0);
        match self.channel.stage(0, &Sqe::encode(r).0) {
            Ok(true) => Ok(position),
            Ok(false) => Err(NetError::QueueFull),
            Err(ChannelError::Gone) => {
                self.gone()?;
                self.stage(r)
            }
            Err(e) => Err(channel_err(e)),
        }
    }

    /// The server is gone: resumed, unless the session is being put back on a new one
    /// already (then that one is gone too, and the resume goes again).
    fn gone(&mut self) -> Result<(), NetError> {
        if self.restoring {
            Err(NetError::DeviceGone)
        } else {
            self.resume()
        }
    }

    /// How often the session was resumed on a new server.
    pub fn resumes(&self) -> u64 {
        self.resumes
    }

    /// The server is gone: resumes the session on its successor and puts it back as it was
    /// (see the module's documentation), or says why the session ends.
    fn resume(&mut self) -> Result<(), NetError> {
        let Some(sup) = self.supervisor.clone() else {
            return Err(NetError::DeviceGone);
        };
        loop {
            // What the dead server answered is still in the old rings: take it first.
            self.reap()?;
            let taken = self.channel.taken(0);
            // Nothing counted as a replay: net sends nothing twice.
            let how = Resume::stateless(
                &self.server,
                &self.device,
                CLASS,
                &self.channel,
                self.opts.timeout,
            );
            let back =
                reconnect(&sup, &how, Instant::now() + sup.patience).map_err(NetError::from)?;
            self.info = parse_info(back.info)?;
            self.channel = back.channel;
            self.server = back.server;
            self.resumes += 1;
            self.restoring = true;
            let restored = self.restore(taken);
            self.restoring = false;
            match restored {
                // Gone again while being put back: what it took is read from its ring.
                Err(NetError::DeviceGone) => continue,
                other => return other,
            }
        }
    }

    /// Puts the session back on a new server: the filter, mode and groups set again; frames
    /// the dead one took are interrupted, the others sent again; every receive buffer not
    /// holding an unread frame posted again.
    fn restore(&mut self, taken: u32) -> Result<(), NetError> {
        // First, before anything is staged on the new ring: frames the dead server took may
        // have gone out, so they are interrupted, never sent again. The others are on no ring
        // until they are staged again below (a server that dies meanwhile took none of them).
        let mut order: Vec<(u64, u32)> = self.sending.iter().map(|(&k, f)| (f.seq, k)).collect();
        order.sort_unstable();
        for &(_, slot) in &order {
            let f = self.sending.get_mut(&slot).expect("listed");
            if f.position
                .is_some_and(|p| outboard_session::ring::was_taken(p, taken))
            {
                self.sending.remove(&slot);
                self.failed.push_back(NetError::Interrupted);
                self.tx_free.push(slot);
            } else {
                f.position = None;
            }
        }
        // The receive path first, before a buffer is posted on the new server. If it is not
        // granted there (another session posted first), frames are copied, as before.
        if self.opts.own_receive {
            self.headroom = match self.take_receive_path() {
                Ok(h) => h,
                Err(e @ (NetError::DeviceGone | NetError::Timeout)) => return Err(e),
                Err(e) => {
                    tracing::warn!("{}: the receive path on the new server: {e}", self.device);
                    0
                }
            };
        }
        // What the session receives, before a buffer is posted: a frame that came between a
        // posted buffer and the filter would reach it unfiltered.
        let (filter, mode, groups) = (self.filter.clone(), self.mode, self.groups.clone());
        if let Some(p) = filter {
            self.control_with(NetOp::Filter, &p)?;
        }
        if mode != 0 {
            self.control(NetOp::Mode, 0, mode)?;
        }
        if !groups.is_empty() {
            let bytes: Vec<u8> = groups.iter().flatten().copied().collect();
            self.control_with(NetOp::Multicast, &bytes)?;
        }
        // The frames the dead server did not take, staged again in the order they were sent.
        for (_, slot) in order {
            if let Some(f) = self.sending.get(&slot).copied() {
                self.stage_frame(slot, f)?;
            }
        }
        let unread: Vec<u32> = self.received.iter().map(|&(slot, _, _)| slot).collect();
        for slot in 0..self.opts.receive_buffers {
            if !unread.contains(&slot) {
                self.post(slot)?;
            }
        }
        self.channel.kick();
        // The device was reset with its driver: a hold-off this session asked for is lost.
        if let Some(usecs) = self.hold_off {
            self.control(NetOp::HoldOff, 0, usecs)?;
        }
        Ok(())
    }

    /// Stages the frame just written into transmit slot `slot`.
    fn transmit(&mut self, slot: u32, len: u32) -> Result<(), NetError> {
        self.next_seq += 1;
        let f = Sending {
            seq: self.next_seq,
            position: None,
            len,
        };
        self.stage_frame(slot, f)
    }

    /// Stages frame `f`, in transmit slot `slot`, and records where it went.
    fn stage_frame(&mut self, slot: u32, mut f: Sending) -> Result<(), NetError> {
        let position = self.stage(&NetRequest {
            op: NetOp::Transmit,
            tag: TRANSMIT | u64::from(slot),
            buf_offset: u64::from(slot) * self.slot,
            length: f.len,
        })?;
        f.position = Some(position);
        self.sending.insert(slot, f);
        Ok(())
    }

    fn post(&mut self, slot: u32) -> Result<(), NetError> {
        self.stage(&NetRequest {
            op: NetOp::Receive,
            tag: RECEIVE | u64::from(slot),
            buf_offset: u64::from(slot) * self.slot,
            length: self.slot as u32,
        })
        .map(drop)
    }

    /// Takes every completion waiting on the current rings (the old ones too, after the
    /// server died: what it answered is there), sorting it by what it answers.
    fn reap(&mut self) -> Result<usize, NetError> {
        let mut n = 0;
        while let Some((tag, result)) = self
            .channel
            .completion::<NetError>(0)
            .map_err(channel_err)?
        {
            n += 1;
            if tag & CONTROL != 0 {
                self.answers.push((tag, result));
            } else if tag & TRANSMIT != 0 {
                let slot = (tag & !TRANSMIT) as u32;
                self.sending.remove(&slot);
                if (self.opts.receive_buffers
                    ..self.opts.receive_buffers + self.opts.transmit_buffers)
                    .contains(&slot)
                    && !self.tx_free.contains(&slot)
                {
                    self.tx_free.push(slot);
                }
                if let Err(e) = result {
                    self.failed.push_back(e);
                }
            } else if tag < u64::from(self.opts.receive_buffers) {
                self.received.push_back((tag as u32, self.headroom, result));
            } else {
                return Err(NetError::Protocol(format!(
                    "a completion for tag {tag:#x}, which this client never used"
                )));
            }
        }
        Ok(n)
    }

    /// Reaps, and waits until something came or `deadline` passed (false then).
    fn wait(&mut self, deadline: Instant) -> Result<bool, NetError> {
        if self.reap()? > 0 {
            return Ok(true);
        }
        match self.channel.wait(deadline) {
            Ok(()) => Ok(self.reap()? > 0),
            Err(ChannelError::Timeout) => Ok(false),
            Err(ChannelError::Gone) => {
                self.gone()?;
                Ok(true)
            }
            Err(e) => Err(channel_err(e)),
        }
    }

    /// Queues `frame` for sending (it is copied once, into its slot, where the device reads
    /// it); waits only for a free slot. A frame the server refused or could not send is
    /// reported by a later call (`send`, [`NetClient::flush`]).
    pub fn send(&mut self, frame: &[u8]) -> Result<(), NetError> {
        if let Some(e) = self.failed.pop_front() {
            return Err(e);
        }
        if frame.len() as u64 > u64::from(self.info.max_frame()).min(self.slot) {
            return Err(NetError::Invalid(format!(
                "a frame of {} bytes: this NIC sends up to {}",
                frame.len(),
                self.info.max_frame()
            )));
        }
        let deadline = Instant::now() + self.opts.timeout;
        let slot = loop {
            if let Some(s) = self.tx_free.pop() {
                break s;
            }
            self.channel.kick();
            if !self.wait(deadline)? && Instant::now() >= deadline {
                return Err(NetError::Timeout);
            }
        };
        let offset = u64::from(slot) * self.slot;
        self.channel
            .buffers()
            .write(offset, frame)
            .map_err(|e| NetError::Protocol(e.to_string()))?;
        let staged = self.transmit(slot, frame.len() as u32);
        if staged.is_err() && !self.sending.contains_key(&slot) {
            self.tx_free.push(slot);
        }
        staged?;
        self.channel.kick();
        Ok(())
    }

    /// Waits until every frame sent so far is answered; the first failure among them, if any.
    pub fn flush(&mut self) -> Result<(), NetError> {
        let deadline = Instant::now() + self.opts.timeout;
        self.channel.kick();
        while self.tx_free.len() < self.opts.transmit_buffers as usize {
            if !self.wait(deadline)? && Instant::now() >= deadline {
                return Err(NetError::Timeout);
            }
        }
        match self.failed.pop_front() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The next frame received, copied into `out` (its length), or `None` if none came
    /// within `timeout`. The buffer it came in is posted again.
    pub fn recv_into(
        &mut self,
        out: &mut [u8],
        timeout: Duration,
    ) -> Result<Option<usize>, NetError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((slot, headroom, result)) = self.received.pop_front() {
                let read = result.and_then(|len| {
                    let n = len as usize;
                    if n > out.len() || u64::from(len) + u64::from(headroom) > self.slot {
                        return Err(NetError::Truncated(format!(
                            "a frame of {n} bytes into {} bytes",
                            out.len()
                        )));
                    }
                    self.channel
                        .buffers()
                        .read(
                            u64::from(slot) * self.slot + u64::from(headroom),
                            &mut out[..n],
                        )
                        .map_err(|e| NetError::Protocol(e.to_string()))?;
                    Ok(n)
                });
                // A buffer given back unused was asked for; any other answer frees it to post.
                if !matches!(read, Err(NetError::Cancelled)) {
                    self.post(slot)?;
                    self.channel.kick();
                }
                return read.map(Some);
            }
            if !self.wait(deadline)? && Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    /// The next frame received, copied into `out` (its length), if one is there now.
    pub fn try_recv_into(&mut self, out: &mut [u8]) -> Result<Option<usize>, NetError> {
        self.reap()?;
        if self.received.is_empty() {
            return Ok(None);
        }
        self.recv_into(out, Duration::ZERO)
    }

    /// Waits until a frame or an answer came, `also` became readable (true then), or
    /// `timeout` passed — for a client that serves the NIC and another descriptor (a TAP
    /// interface, a socket) from one thread.
    pub fn wait_or(
        &mut self,
        also: std::os::fd::BorrowedFd<'_>,
        timeout: Duration,
    ) -> Result<bool, NetError> {
        if self.reap()? > 0 || !self.received.is_empty() {
            return Ok(false);
        }
        match self.channel.wait_or(Instant::now() + timeout, Some(also)) {
            Ok(readable) => {
                self.reap()?;
                Ok(readable)
            }
            Err(ChannelError::Timeout) => Ok(false),
            Err(ChannelError::Gone) => {
                self.gone()?;
                Ok(false)
            }
            Err(e) => Err(channel_err(e)),
        }
    }

    /// Waits until a frame or an answer comes, or `timeout` passes.
    pub fn wait_for(&mut self, timeout: Duration) -> Result<(), NetError> {
        self.wait(Instant::now() + timeout).map(drop)
    }

    /// Sends a request that holds no slot and waits for its answer; sent again on the new
    /// server if the session was resumed before it was answered (every such request sets
    /// state, so sending it twice is sending it once).
    fn control(&mut self, op: NetOp, buf_offset: u64, length: u32) -> Result<u32, NetError> {
        let deadline = Instant::now() + self.opts.timeout;
        'send: loop {
            self.next_control += 1;
            let tag = CONTROL | self.next_control;
            let resumes = self.resumes;
            self.stage(&NetRequest {
                op,
                tag,
                buf_offset,
                length,
            })?;
            self.channel.kick();
            loop {
                if let Some(i) = self.answers.iter().position(|(t, _)| *t == tag) {
                    return self.answers.swap_remove(i).1;
                }
                if self.resumes != resumes {
                    continue 'send;
                }
                if !self.wait(deadline)? && Instant::now() >= deadline {
                    return Err(NetError::Timeout);
                }
            }
        }
    }

    /// Writes `bytes` into a free transmit slot for a control request, runs it, frees the slot.
    fn control_with(&mut self, op: NetOp, bytes: &[u8]) -> Result<u32, NetError> {
        let deadline = Instant::now() + self.opts.timeout;
        let slot = loop {
            if let Some(s) = self.tx_free.pop() {
                break s;
            }
            if !self.wait(deadline)? && Instant::now() >= deadline {
                return Err(NetError::Timeout);
            }
        };
        // A program longer than a slot spans the slots after it: only as many as are free
        // in a row; the server refuses anything past the buffer area.
        let offset = u64::from(slot) * self.slot;
        let written = self
            .channel
            .buffers()
            .write(offset, bytes)
            .map_err(|e| NetError::Protocol(e.to_string()));
        let result = written.and_then(|()| self.control(op, offset, bytes.len() as u32));
        self.tx_free.push(slot);
        result
    }

    /// Attaches `program` as this session's packet filter (`None` removes it); the server's
    /// checker's verdict, with its reason if it refuses.
    pub fn set_filter(&mut self, program: Option<&Program>) -> Result<(), NetError> {
        match program {
            None => {
                self.control(NetOp::Filter, 0, 0)?;
                self.filter = None;
                Ok(())
            }
            Some(p) if p.to_bytes().len() as u64 > self.slot => Err(NetError::BadFilter(format!(
                "{} instructions: this client sends up to {}",
                p.insns().len(),
                self.slot / 8
            ))),
            Some(p) => self.set_filter_bytes(&p.to_bytes()),
        }
    }

    /// Attaches raw program bytes as attached (for clients that have them already; the server
    /// checks them).
    pub fn set_filter_bytes(&mut self, program: &[u8]) -> Result<(), NetError> {
        self.control_with(NetOp::Filter, program)?;
        self.filter = Some(program.to_vec());
        Ok(())
    }

    /// Sets the receive mode ([`outboard_net::PROMISCUOUS`], [`outboard_net::ALL_MULTICAST`]).
    pub fn set_mode(&mut self, flags: u32) -> Result<(), NetError> {
        self.control(NetOp::Mode, 0, flags)?;
        self.mode = flags;
        Ok(())
    }

    /// Asks the NIC to hold receive interrupts back up to `usecs` (0: none). The device's
    /// setting, for every session; set again on a new server after a restart.
    pub fn set_hold_off(&mut self, usecs: u32) -> Result<(), NetError> {
        self.control(NetOp::HoldOff, 0, usecs)?;
        self.hold_off = Some(usecs);
        Ok(())
    }

    /// Joins exactly these multicast groups.
    pub fn set_groups(&mut self, groups: &[[u8; 6]]) -> Result<(), NetError> {
        let bytes: Vec<u8> = groups.iter().flatten().copied().collect();
        if bytes.is_empty() {
            self.control(NetOp::Multicast, 0, 0)?;
        } else {
            self.control_with(NetOp::Multicast, &bytes)?;
        }
        self.groups = groups.to_vec();
        Ok(())
    }

    /// The channel (tests that speak the protocol by hand next to a good client).
    pub fn channel(&mut self) -> &mut Channel {
        &mut self.channel
    }
}

impl crate::NetPort for NetClient {
    fn info(&self) -> &NetInfo {
        NetClient::info(self)
    }

    fn status_now(&mut self) -> Result<NetInfo, NetError> {
        NetClient::status_now(self)
    }

    fn send(&mut self, frame: &[u8]) -> Result<(), NetError> {
        NetClient::send(self, frame)
    }

    fn flush(&mut self) -> Result<(), NetError> {
        NetClient::flush(self)
    }

    fn recv_into(&mut self, out: &mut [u8], timeout: Duration) -> Result<Option<usize>, NetError> {
        NetClient::recv_into(self, out, timeout)
    }

    fn try_recv_into(&mut self, out: &mut [u8]) -> Result<Option<usize>, NetError> {
        NetClient::try_recv_into(self, out)
    }

    fn wait_for(&mut self, timeout: Duration) -> Result<(), NetError> {
        NetClient::wait_for(self, timeout)
    }

    fn wait_or(
        &mut self,
        also: std::os::fd::BorrowedFd<'_>,
        timeout: Duration,
    ) -> Result<bool, NetError> {
        NetClient::wait_or(self, also, timeout)
    }

    fn set_filter(&mut self, program: Option<&Program>) -> Result<(), NetError> {
        NetClient::set_filter(self, program)
    }

    fn set_mode(&mut self, flags: u32) -> Result<(), NetError> {
        NetClient::set_mode(self, flags)
    }

    fn set_groups(&mut self, groups: &[[u8; 6]]) -> Result<(), NetError> {
        NetClient::set_groups(self, groups)
    }

    fn set_hold_off(&mut self, usecs: u32) -> Result<(), NetError> {
        NetClient::set_hold_off(self, usecs)
    }

    fn resumes(&self) -> u64 {
        NetClient::resumes(self)
    }
}
