//! Virtio network device model (virtio v1.2 §5.1), behind [`crate::virtio_pci::VirtioPci`].
//!
//! One receive and one transmit queue (§5.1.2), the modern interface only. Offered features:
//! `MAC`, `STATUS` (link up or down, with a configuration interrupt when it changes), `MTU`,
//! and `MRG_RXBUF` (a frame may span several receive buffers; without it each buffer must hold
//! a whole frame). No checksum or segmentation offload: frames cross whole, as sent.
//!
//! Frames leave and arrive through a [`Wire`]: a datagram-preserving socket (`SOCK_SEQPACKET`
//! or `SOCK_DGRAM`) on which each message is one Ethernet frame without its check sequence,
//! a stream socket in QEMU's `-netdev stream` framing (a 4-byte big-endian length before
//! each frame), or a host TAP interface (one frame a `read`/`write`), whose other end is the
//! host's network stack.
//! Two models joined by a socket pair are two NICs on one cable. The wire is non-blocking and
//! polled by the model's server ([`VirtioDevice::input_fds`]): arriving frames wait in a
//! bounded backlog until the driver posts receive buffers, and are dropped (and counted) when
//! the backlog is full, the link is down, or a frame is longer than the MTU allows.
//!
//! Everything the driver wrote is checked: a transmit chain shorter than its header or with a
//! frame shorter than an Ethernet header or longer than the MTU allows is dropped and
//! counted; a receive chain with device-readable buffers is returned unused.
//!
//! With `CTRL_VQ` there is a control queue (index 2); its one command class is notification
//! coalescing (`NOTF_COAL`, §5.1.6.5.9): the driver sets, for receive and for transmit, how
//! many used buffers or microseconds a used-buffer notification may wait, and the transport
//! holds notifications accordingly. Any other command is answered `ERR`.
//!
//! Besides the transport's faults (interrupts, the used ring, stalls, needs-reset, crash), a
//! NIC has two of its own: `link-flap=DURATION` (at the next notification the link goes down,
//! and comes back that long after, each change with a configuration interrupt; a timer among
//! the model's inputs ends it) and `long-frame=N` (the next N frames received are reported
//! one byte longer than the buffers they were put in — a device error the driver must catch).

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use outboard_sys::timer::Timer;

use outboard_spec::virtio::{self, net};
use outboard_vfio_user::DmaMap;

use crate::faults::{lock, FaultHandle, Faults};
use crate::virtio_pci::{Arrived, Coalescing, VirtioDevice};
use crate::virtqueue::{Chain, DeviceQueue, QueueError, Segment};

/// Largest queue the device offers.
pub const QUEUE_SIZE: u16 = 256;
/// Frames waiting for receive buffers at most; more are dropped.
pub const BACKLOG: usize = 256;
/// Frames taken from the wire per readiness, so transmit and the other sources get a turn.
const INPUT_BUDGET: usize = 64;
/// An 802.1Q tag a frame may carry beyond the MTU's payload.
const VLAN_TAG: usize = 4;

/// How a NIC is configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetOptions {
    /// Its MAC address.
    pub mac: [u8; 6],
    /// Largest payload of a frame (the IP packet), 68..=65535.
    pub mtu: u16,
    /// The link is up at power-on.
    pub link_up: bool,
}

impl Default for NetOptions {
    fn default() -> Self {
        Self {
            // A locally administered unicast address.
            mac: [0x02, 0x00, 0x00, 0x00, 0x00, 0x01],
            mtu: 1500,
            link_up: true,
        }
    }
}

impl NetOptions {
    /// The longest frame it sends or takes: the MTU's payload, an Ethernet header and a VLAN
    /// tag.
    pub fn max_frame(&self) -> usize {
        self.mtu as usize + net::ETH_HEADER + VLAN_TAG
    }
}

/// Where a NIC's frames go and come from.
///
/// - A socket that keeps message boundaries (`SOCK_SEQPACKET` or `SOCK_DGRAM`): one frame a
///   message ([`Wire::new`], [`Wire::pair`]).
/// - A stream socket speaking QEMU's `-netdev stream` (and `-netdev socket`) framing: each
///   frame behind its length as a 4-byte big-endian number ([`Wire::stream`]), so a QEMU VM's
///   NIC and an Outboard NIC can be joined.
/// - A TAP interface's descriptor (`IFF_TAP | IFF_NO_PI`): one frame a `read` or `write`
///   ([`Wire::tap`]); the frames go to and come from the host's network stack.
#[derive(Debug)]
pub struct Wire {
    fd: OwnedFd,
    framing: Framing,
}

#[derive(Debug)]
enum Framing {
    Messages,
    /// A TAP interface: not a socket, so `read`/`write`; a read longer than the buffer is
    /// cut short without saying so (the caller's buffer is one byte longer than any frame it
    /// takes, so a cut frame shows as too long).
    Tap,
    /// Bytes read and not yet a whole frame; bytes of frames not yet written.
    Stream {
        inbound: Vec<u8>,
        outbound: Vec<u8>,
    },
}

/// The most bytes a stream wire holds back for a peer that does not read: past this a frame
/// is dropped (as a full link would).
const STREAM_BACKLOG: usize = 256 << 10;
/// The longest frame a stream peer may announce (QEMU's `NET_BUFSIZE` is 68 KiB): a longer
/// length means the stream is corrupt, and the wire is given up.
const STREAM_MAX_FRAME: usize = 69632;

fn nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(fd)?;
    rustix::fs::fcntl_setfl(fd, flags | rustix::fs::OFlags::NONBLOCK)?;
    Ok(())
}

/// What became of a frame handed to the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    Taken,
    /// The peer is behind: nothing more fits for now.
    Full,
    /// The wire refused this frame alone (a TAP interface that is down drops what is
    /// written to it): it is lost, the wire stays.
    Refused,
    Gone,
}

/// How long a frame waits for a full wire (as a real link's pause would) before it is dropped.
const WIRE_PAUSE: Duration = Duration::from_millis(5);

impl Wire {
    /// A wire over `fd` (a `SOCK_SEQPACKET` or `SOCK_DGRAM` socket); made non-blocking.
    pub fn new(fd: OwnedFd) -> std::io::Result<Self> {
        nonblocking(&fd)?;
        Ok(Self {
            fd,
            framing: Framing::Messages,
        })
    }

    /// A wire over a connected stream socket in QEMU's `-netdev stream` framing; made
    /// non-blocking.
    pub fn stream(fd: OwnedFd) -> std::io::Result<Self> {
        nonblocking(&fd)?;
        Ok(Self {
            fd,
            framing: Framing::Stream {
                inbound: Vec::new(),
                outbound: Vec::new(),
            },
        })
    }

    /// A wire over a TAP interface's descriptor (see [`outboard_sys::tap::open`]); made
    /// non-blocking.
    pub fn tap(fd: OwnedFd) -> std::io::Result<Self> {
        nonblocking(&fd)?;
        Ok(Self {
            fd,
            framing: Framing::Tap,
        })
    }

    /// Two wires joined to each other: two NICs on one cable.
    pub fn pair() -> std::io::Result<(Self, Self)> {
        let (a, b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )?;
        Ok((Self::new(a)?, Self::new(b)?))
    }

    /// Sends one frame without waiting: whether the wire took it, is full for now (the peer
    /// is behind), or is gone.
    fn send(&mut self, frame: &[u8]) -> Sent {
        use rustix::net::SendFlags;
        let flags = SendFlags::NOSIGNAL | SendFlags::DONTWAIT;
        match &mut self.framing {
            Framing::Messages => loop {
                match rustix::net::send(&self.fd, frame, flags) {
                    Ok(_) => return Sent::Taken,
                    Err(rustix::io::Errno::AGAIN) => return Sent::Full,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(_) => return Sent::Gone,
                }
            },
            Framing::Tap => loop {
                match rustix::io::write(&self.fd, frame) {
                    Ok(_) => return Sent::Taken,
                    Err(rustix::io::Errno::AGAIN) => return Sent::Full,
                    Err(rustix::io::Errno::INTR) => {}
                    // The interface is down, or the frame is not one it takes.
                    Err(rustix::io::Errno::IO | rustix::io::Errno::INVAL) => return Sent::Refused,
                    Err(_) => return Sent::Gone,
                }
            },
            Framing::Stream { outbound, .. } => {
                if !Self::flush(&self.fd, outbound) {
                    return Sent::Gone;
                }
                if outbound.len() + 4 + frame.len() > STREAM_BACKLOG {
                    return Sent::Full;
                }
                outbound.extend_from_slice(&(frame.len() as u32).to_be_bytes());
                outbound.extend_from_slice(frame);
                match Self::flush(&self.fd, outbound) {
                    true => Sent::Taken,
                    false => Sent::Gone,
                }
            }
        }
    }

    /// Waits up to `timeout` until the wire can take more or has something to read:
    /// (writable, readable).
    fn wait(&self, timeout: Duration) -> (bool, bool) {
        use rustix::event::{PollFd, PollFlags};
        let mut p = [PollFd::new(&self.fd, PollFlags::OUT | PollFlags::IN)];
        let ts = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: timeout.as_nanos().min(999_999_999) as _,
        };
        match rustix::event::poll(&mut p, Some(&ts)) {
            Ok(_) => {
                let r = p[0].revents();
                (
                    r.intersects(PollFlags::OUT | PollFlags::ERR | PollFlags::HUP),
                    r.intersects(PollFlags::IN | PollFlags::HUP),
                )
            }
            Err(_) => (true, false),
        }
    }

    /// Writes what it can of `outbound`; false if the stream is gone.
    fn flush(fd: &OwnedFd, outbound: &mut Vec<u8>) -> bool {
        use rustix::net::SendFlags;
        while !outbound.is_empty() {
            match rustix::net::send(fd, outbound, SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
                Ok(n) => {
                    outbound.drain(..n);
                }
                Err(rustix::io::Errno::AGAIN) => return true,
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => return false,
            }
        }
        true
    }

    /// Takes the next frame into `buf`: its length, `Ok(None)` if none waits, or an error if
    /// the wire is gone (or, on a stream, corrupt). A frame longer than `buf` comes back with
    /// its whole length (it was cut short: the caller drops it).
    fn recv(&mut self, buf: &mut [u8]) -> std::io::Result<Option<usize>> {
        use rustix::net::RecvFlags;
        match &mut self.framing {
            Framing::Messages => loop {
                match rustix::net::recv(&self.fd, &mut *buf, RecvFlags::DONTWAIT | RecvFlags::TRUNC)
                {
                    Ok((_, 0)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    Ok((_, n)) => return Ok(Some(n)),
                    Err(rustix::io::Errno::AGAIN) => return Ok(None),
                    Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
            },
            Framing::Tap => loop {
                match rustix::io::read(&self.fd, &mut *buf) {
                    Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => return Ok(Some(n)),
                    Err(rustix::io::Errno::AGAIN) => return Ok(None),
                    Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
            },
            Framing::Stream { inbound, outbound } => {
                // Bytes held back for the peer go first: it is reading again if it writes.
                if !Self::flush(&self.fd, outbound) {
                    return Err(std::io::ErrorKind::BrokenPipe.into());
                }
                loop {
                    if inbound.len() >= 4 {
                        let len = u32::from_be_bytes(inbound[..4].try_into().expect("4")) as usize;
                        if len > STREAM_MAX_FRAME {
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::InvalidData,
                                format!("the stream announces a frame of {len} bytes"),
                            ));
                        }
                        if inbound.len() >= 4 + len {
                            let n = len.min(buf.len());
                            buf[..n].copy_from_slice(&inbound[4..4 + n]);
                            inbound.drain(..4 + len);
                            return Ok(Some(len));
                        }
                    }
                    let mut chunk = [0u8; 16384];
                    match rustix::net::recv(&self.fd, &mut chunk, RecvFlags::DONTWAIT) {
                        Ok((_, 0)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                        Ok((_, n)) => inbound.extend_from_slice(&chunk[..n]),
                        Err(rustix::io::Errno::AGAIN) => return Ok(None),
                        Err(rustix::io::Errno::INTR) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
    }
}

/// Counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetStats {
    /// Frames sent on the wire.
    pub tx_frames: u64,
    /// Their bytes.
    pub tx_bytes: u64,
    /// Transmit chains dropped: malformed, too short or too long, link down, wire full.
    pub tx_dropped: u64,
    /// Frames written into receive buffers.
    pub rx_frames: u64,
    /// Their bytes.
    pub rx_bytes: u64,
    /// Frames from the wire dropped: backlog full, too long, link down, or no buffer they
    /// fit in.
    pub rx_dropped: u64,
    /// Receive chains returned unused (they had device-readable buffers).
    pub rx_bad_buffers: u64,
}

/// The network device model.
#[derive(Debug)]
pub struct VirtioNet {
    opts: NetOptions,
    wire: Option<Wire>,
    /// A listening UNIX stream socket: while no wire is plugged in, the first peer to connect
    /// becomes the wire (QEMU's `-netdev stream,server=off` plugging into this NIC).
    listener: Option<OwnedFd>,
    link_up: bool,
    mergeable: bool,
    backlog: VecDeque<Vec<u8>>,
    faults: FaultHandle,
    stats: NetStats,
    /// A transmitted frame is read here (reused).
    scratch: Vec<u8>,
    chain: Chain,
    /// Receive chains taken for the frame being placed (reused).
    pool: Vec<Chain>,
    used: Vec<(u16, u32)>,
    /// Frame buffers given back by the receive path, for the next frames from the wire.
    spare: Vec<Vec<u8>>,
    /// A link flap in progress: its timer, and how long the link stays down.
    flap: Flap,
    /// Coalescing the driver asked for: receive, transmit.
    coalescing: [Coalescing; 2],
    /// Work found while serving a queue, for the transport ([`VirtioDevice::deferred`]).
    deferred: Arrived,
}

/// What an input descriptor of the model is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Input {
    Wire,
    Listener,
    Flap,
}

/// Where an injected link flap is.
#[derive(Debug, Default)]
struct Flap {
    /// Fires when the link is to go down (at once) and then up again.
    timer: Option<Timer>,
    /// Down for this long once it goes down; `None` while it is down.
    down_for: Option<Duration>,
    /// The link before the flap, to come back to.
    was_up: bool,
}

impl VirtioNet {
    /// A NIC with `opts`, on `wire` (none: a cable that is not plugged in, whose frames go
    /// nowhere).
    pub fn new(opts: NetOptions, wire: Option<Wire>) -> Self {
        Self {
            link_up: opts.link_up && wire.is_some(),
            opts,
            wire,
            listener: None,
            mergeable: false,
            backlog: VecDeque::new(),
            faults: std::sync::Arc::new(std::sync::Mutex::new(Faults {
                nic_faults: true,
                ..Faults::default()
            })),
            stats: NetStats::default(),
            scratch: Vec::new(),
            chain: Chain::default(),
            pool: Vec::new(),
            used: Vec::new(),
            spare: Vec::new(),
            flap: Flap::default(),
            coalescing: [Coalescing::default(); 2],
            deferred: Arrived::default(),
        }
    }

    /// A NIC whose cable is plugged in from the other end: `listener` (a listening UNIX stream
    /// socket) is polled while no wire is plugged in, and the first peer to connect becomes
    /// the wire, in QEMU's stream framing — the link goes up (with a configuration
    /// interrupt). When that peer goes, the link goes down and the next peer is taken.
    pub fn listening(opts: NetOptions, listener: OwnedFd) -> std::io::Result<Self> {
        nonblocking(&listener)?;
        let mut nic = Self::new(opts, None);
        nic.listener = Some(listener);
        Ok(nic)
    }

    /// The inputs polled now, in the order [`VirtioDevice::input_fds`] gives them.
    fn inputs(&self) -> Vec<(Input, BorrowedFd<'_>)> {
        let wire = self.wire.as_ref().map(|w| (Input::Wire, w.fd.as_fd()));
        let listener = match wire {
            Some(_) => None,
            None => self.listener.as_ref().map(|l| (Input::Listener, l.as_fd())),
        };
        let timer = self
            .flap
            .timer
            .as_ref()
            .map(|t| (Input::Flap, Timer::fd(t)));
        wire.into_iter().chain(listener).chain(timer).collect()
    }

    /// A peer connected to the listener: it is the wire now, and the link comes up.
    fn plug_in(&mut self) -> bool {
        let Some(l) = self.listener.as_ref() else {
            return false;
        };
        use rustix::net::SocketFlags;
        match rustix::net::accept_with(l, SocketFlags::CLOEXEC) {
            Ok(fd) => match Wire::stream(fd) {
                Ok(w) => {
                    tracing::info!("virtio-net: a peer plugged into the listening cable");
                    self.wire = Some(w);
                    self.opts.link_up && self.set_link(true)
                }
                Err(e) => {
                    tracing::warn!("virtio-net: a peer that connected: {e}");
                    false
                }
            },
            Err(e) => {
                tracing::debug!("virtio-net: accept on the listening cable: {e}");
                false
            }
        }
    }

    /// Carries out one control-queue command (§5.1.6.5); the bytes written (the ack).
    fn control(&mut self, c: &Chain, dma: &DmaMap) -> u32 {
        /// Longest command this device knows, with room to spare.
        const LONGEST: usize = 64;
        let n = c.readable_len() as usize;
        let mut cmd = [0u8; LONGEST];
        let ack = if !(2..=LONGEST).contains(&n) || gather(dma, &c.segments, &mut cmd[..n]).is_err()
        {
            net::ctrl::ERR
        } else {
            self.command(cmd[0], cmd[1], &cmd[2..n])
        };
        scatter(dma, &c.segments, &[ack]).0
    }

    /// A command's ack: `OK` if done, `ERR` if unknown or malformed.
    fn command(&mut self, class: u8, command: u8, data: &[u8]) -> u8 {
        use net::ctrl;
        let which = match (class, command) {
            (ctrl::CLASS_NOTF_COAL, ctrl::NOTF_COAL_RX_SET) => 0,
            (ctrl::CLASS_NOTF_COAL, ctrl::NOTF_COAL_TX_SET) => 1,
            _ => return ctrl::ERR,
        };
        let Ok(&[p0, p1, p2, p3, u0, u1, u2, u3]) = <&[u8; ctrl::COAL_SIZE]>::try_from(data) else {
            return ctrl::ERR;
        };
        self.coalescing[which] = Coalescing {
            max_packets: u32::from_le_bytes([p0, p1, p2, p3]),
            usecs: u32::from_le_bytes([u0, u1, u2, u3]),
        };
        tracing::debug!(queue = which, coalescing = ?self.coalescing[which], "virtio-net: coalescing set");
        ctrl::OK
    }

    /// Starts a link flap armed by fault injection: its timer fires at once (the link goes
    /// down from the model's input path, which can raise the configuration interrupt), then
    /// after `down_for` (it comes back).
    fn start_flap(&mut self) {
        let Some(down_for) = lock(&self.faults).link_flap.take() else {
            return;
        };
        let timer = match Timer::new() {
            Ok(mut t) => t.arm_at(Instant::now()).map(|()| t),
            Err(e) => Err(e),
        };
        match timer {
            Ok(t) => {
                tracing::warn!("fault injection: the link flaps for {down_for:?}");
                self.flap = Flap {
                    timer: Some(t),
                    down_for: Some(down_for),
                    was_up: self.link_up,
                };
            }
            Err(e) => tracing::warn!("link-flap: no timer: {e}"),
        }
    }

    /// The flap's timer fired: the link goes down, or comes back; whether it changed.
    fn flap_step(&mut self) -> bool {
        let Some(t) = self.flap.timer.as_mut() else {
            return false;
        };
        // Only when due: another input that took the timer's place in a round is not it.
        if t.due().is_some_and(|d| Instant::now() < d) {
            return false;
        }
        t.ack();
        match self.flap.down_for.take() {
            Some(d) => {
                if t.arm_at(Instant::now() + d).is_err() {
                    self.flap.timer = None;
                }
                self.set_link(false)
            }
            None => {
                self.flap.timer = None;
                let up = self.flap.was_up;
                self.set_link(up)
            }
        }
    }

    /// Counters.
    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// Sets the link up or down; true if that changed it (the driver is then told).
    pub fn set_link(&mut self, up: bool) -> bool {
        let up = up && self.wire.is_some();
        let changed = up != self.link_up;
        self.link_up = up;
        if !up {
            self.stats.rx_dropped += self.backlog.len() as u64;
            self.backlog.clear();
        }
        changed
    }

    /// Sends one transmit chain's frame (after its header) on the wire.
    fn transmit(&mut self, chain: &Chain, dma: &DmaMap) {
        let total = chain.readable_len() as usize;
        let frame_len = total.saturating_sub(net::HDR_SIZE);
        if total < net::HDR_SIZE
            || frame_len < net::ETH_HEADER
            || frame_len > self.opts.max_frame()
            || !self.link_up
        {
            self.stats.tx_dropped += 1;
            return;
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(total, 0);
        if gather(dma, &chain.segments, &mut scratch).is_ok() {
            self.put_on_wire(&scratch[net::HDR_SIZE..]);
        } else {
            self.stats.tx_dropped += 1;
        }
        self.scratch = scratch;
    }

    /// Sends `frame`; while the wire is full, takes what the peer sends meanwhile (so two
    /// NICs each waiting to send to the other never wait on each other), for up to
    /// [`WIRE_PAUSE`] before the frame is dropped.
    fn put_on_wire(&mut self, frame: &[u8]) {
        let mut until = None;
        loop {
            let Some(w) = self.wire.as_mut() else {
                self.stats.tx_dropped += 1;
                return;
            };
            match w.send(frame) {
                Sent::Taken => {
                    self.stats.tx_frames += 1;
                    self.stats.tx_bytes += frame.len() as u64;
                    return;
                }
                Sent::Gone | Sent::Refused => {
                    self.stats.tx_dropped += 1;
                    return;
                }
                Sent::Full => {
                    let now = Instant::now();
                    let until = *until.get_or_insert(now + WIRE_PAUSE);
                    if now >= until {
                        self.stats.tx_dropped += 1;
                        return;
                    }
                    let (_, readable) = w.wait(until - now);
                    if readable {
                        let gone = self.take_from_wire();
                        self.note_deferred(gone);
                    }
                }
            }
        }
    }

    /// Takes what waits on the wire into the backlog (up to a budget, so the other sources
    /// get a turn); whether the wire's other end is gone.
    fn take_from_wire(&mut self) -> bool {
        let max = self.opts.max_frame();
        let mut gone = false;
        for _ in 0..INPUT_BUDGET {
            let Some(w) = self.wire.as_mut() else { break };
            // Each frame is read behind room for its header, which the receive path fills in
            // place: a frame is copied once, from the wire, and DMAed once.
            let mut buf = self.spare.pop().unwrap_or_default();
            buf.clear();
            buf.resize(net::HDR_SIZE + max + 1, 0);
            match w.recv(&mut buf[net::HDR_SIZE..]) {
                Ok(Some(n)) if n > max || n < net::ETH_HEADER || !self.link_up => {
                    self.stats.rx_dropped += 1;
                    self.spare.push(buf);
                }
                Ok(Some(_)) if self.backlog.len() >= BACKLOG => {
                    self.stats.rx_dropped += 1;
                    self.spare.push(buf);
                }
                Ok(Some(n)) => {
                    buf.truncate(net::HDR_SIZE + n);
                    buf[..net::HDR_SIZE].fill(0);
                    buf[net::HDR_GSO_TYPE] = net::GSO_NONE;
                    self.backlog.push_back(buf);
                }
                Ok(None) => {
                    self.spare.push(buf);
                    break;
                }
                Err(_) => {
                    gone = true;
                    break;
                }
            }
        }
        gone
    }

    /// Records what reading the wire outside `input` found, for the transport to act on.
    fn note_deferred(&mut self, gone: bool) {
        if gone {
            tracing::warn!("virtio-net: the wire's other end is gone; link down");
            self.wire = None;
            self.deferred.config_changed |= self.set_link(false);
        }
        if !self.backlog.is_empty() && !self.deferred.queues.contains(&net::RECEIVEQ) {
            self.deferred.queues.push(net::RECEIVEQ);
        }
    }

    /// Places waiting frames into the receive buffers the driver posted, until either runs
    /// out. A frame goes whole or waits: with mergeable buffers over as many chains as it
    /// needs (all published at once, `num_buffers` saying how many), else into one chain (a
    /// chain too small for it is returned empty and the frame dropped).
    fn receive(&mut self, queue: &mut DeviceQueue, dma: &DmaMap) -> Result<(), QueueError> {
        while let Some(frame) = self.backlog.front() {
            let need = frame.len() as u64;
            let start = queue.next_avail();
            let (mut n, mut room, mut bad) = (0usize, 0u64, false);
            while room < need && (self.mergeable || n == 0) {
                if self.pool.len() == n {
                    self.pool.push(Chain::default());
                }
                if !queue.pop_into(dma, &mut self.pool[n])? {
                    break;
                }
                n += 1;
                if self.pool[n - 1].readable_len() > 0 {
                    bad = true;
                    break;
                }
                room += self.pool[n - 1].writable_len();
            }
            self.used.clear();
            if bad {
                // A receive chain the device may not write into whole: every chain taken for
                // this frame goes back unused, and the frame waits for the next ones.
                self.stats.rx_bad_buffers += 1;
                self.used.extend(self.pool[..n].iter().map(|c| (c.head, 0)));
                queue.push_all(dma, &self.used)?;
                continue;
            }
            if room < need {
                if self.mergeable || n == 0 {
                    // Not enough buffers yet: they go back, the frame waits for more.
                    queue.rewind(start);
                    return Ok(());
                }
                self.stats.rx_dropped += 1;
                self.backlog.pop_front();
                self.used.push((self.pool[0].head, 0));
                queue.push_all(dma, &self.used)?;
                continue;
            }
            let mut frame = self.backlog.pop_front().expect("looked at");
            frame[net::HDR_NUM_BUFFERS..net::HDR_NUM_BUFFERS + 2]
                .copy_from_slice(&(n as u16).to_le_bytes());
            let mut at = 0usize;
            let mut reached = true;
            for c in &self.pool[..n] {
                let (written, ok) = scatter(dma, &c.segments, &frame[at..]);
                reached &= ok;
                at += written as usize;
                self.used.push((c.head, written));
            }
            if Faults::spend(&mut lock(&self.faults).long_frames) {
                // The fault: the last buffer claims one byte more than it holds.
                let last = self.used.len() - 1;
                self.used[last].1 = self.pool[last].writable_len() as u32 + 1;
                reached = false;
            }
            if reached {
                self.stats.rx_frames += 1;
                self.stats.rx_bytes += (frame.len() - net::HDR_SIZE) as u64;
            } else {
                self.stats.rx_dropped += 1;
            }
            queue.push_all(dma, &self.used)?;
            self.spare.push(frame);
        }
        Ok(())
    }
}

/// Reads a chain's device-readable bytes into `out` (exactly its length).
fn gather(dma: &DmaMap, segs: &[Segment], out: &mut [u8]) -> Result<(), QueueError> {
    let mut at = 0;
    for s in segs.iter().filter(|s| !s.write) {
        let n = (s.len as usize).min(out.len() - at);
        dma.read(s.addr, &mut out[at..at + n])?;
        at += n;
    }
    Ok(())
}

/// Writes the start of `data` into a chain's writable buffers, in order, until they are full
/// or it is all written: the bytes written, and false if a buffer was not reachable.
fn scatter(dma: &DmaMap, segs: &[Segment], data: &[u8]) -> (u32, bool) {
    let mut at = 0usize;
    for s in segs.iter().filter(|s| s.write) {
        if at == data.len() {
            break;
        }
        let n = (s.len as usize).min(data.len() - at);
        if dma.write(s.addr, &data[at..at + n]).is_err() {
            return (at as u32, false);
        }
        at += n;
    }
    (at as u32, true)
}

impl VirtioDevice for VirtioNet {
    fn device_id(&self) -> u16 {
        virtio::DEVICE_ID_NET
    }

    fn faults(&self) -> FaultHandle {
        self.faults.clone()
    }

    fn class(&self) -> u32 {
        0x02_00_00 // network controller, Ethernet
    }

    fn features(&self) -> u64 {
        net::feature::MAC
            | net::feature::STATUS
            | net::feature::MTU
            | net::feature::MRG_RXBUF
            | net::feature::CTRL_VQ
            | net::feature::NOTF_COAL
    }

    fn num_queues(&self) -> u16 {
        // Receive, transmit, control (used only if the driver takes CTRL_VQ).
        3
    }

    fn max_queue_size(&self) -> u16 {
        QUEUE_SIZE
    }

    fn config(&self) -> Vec<u8> {
        let mut c = vec![0u8; net::config::SIZE];
        c[net::config::MAC..net::config::MAC + 6].copy_from_slice(&self.opts.mac);
        let status = if self.link_up { net::S_LINK_UP } else { 0 };
        c[net::config::STATUS..net::config::STATUS + 2].copy_from_slice(&status.to_le_bytes());
        c[net::config::MAX_VIRTQUEUE_PAIRS..net::config::MAX_VIRTQUEUE_PAIRS + 2]
            .copy_from_slice(&1u16.to_le_bytes());
        c[net::config::MTU..net::config::MTU + 2].copy_from_slice(&self.opts.mtu.to_le_bytes());
        c
    }

    fn activate(&mut self, features: u64) {
        self.mergeable = features & net::feature::MRG_RXBUF != 0;
    }

    fn reset(&mut self) {
        self.mergeable = false;
        self.backlog.clear();
        self.coalescing = [Coalescing::default(); 2];
    }

    fn deferred(&mut self) -> Arrived {
        std::mem::take(&mut self.deferred)
    }

    fn ring_reset(&self) -> bool {
        // Receive and transmit take a chain, serve it and give it back in one call; control
        // commands too. Nothing of a queue is held between calls.
        true
    }

    fn coalescing(&self, q: u16) -> Coalescing {
        match q {
            net::RECEIVEQ => self.coalescing[0],
            net::TRANSMITQ => self.coalescing[1],
            _ => Coalescing::default(),
        }
    }

    fn process(
        &mut self,
        index: u16,
        queue: &mut DeviceQueue,
        dma: &DmaMap,
    ) -> Result<(), QueueError> {
        self.start_flap();
        match index {
            net::RECEIVEQ => self.receive(queue, dma),
            net::TRANSMITQ => {
                let mut chain = std::mem::take(&mut self.chain);
                let served = queue.serve(dma, &mut chain, |c| {
                    self.transmit(c, dma);
                    0
                });
                self.chain = chain;
                served
            }
            net::CONTROLQ => {
                let mut chain = std::mem::take(&mut self.chain);
                let served = queue.serve(dma, &mut chain, |c| self.control(c, dma));
                self.chain = chain;
                served
            }
            _ => Ok(()),
        }
    }

    fn input_fds(&self) -> Vec<BorrowedFd<'_>> {
        // The wire (or, while none is plugged in, the listener), then a link flap's timer.
        self.inputs().into_iter().map(|(_, fd)| fd).collect()
    }

    fn input(&mut self, id: usize) -> Arrived {
        match self.inputs().get(id).map(|(kind, _)| *kind) {
            Some(Input::Wire) => {}
            Some(Input::Listener) => {
                return Arrived {
                    config_changed: self.plug_in(),
                    ..Arrived::default()
                }
            }
            Some(Input::Flap) | None => {
                return Arrived {
                    config_changed: self.flap_step(),
                    ..Arrived::default()
                }
            }
        }
        let gone = self.take_from_wire();
        let mut arrived = Arrived::default();
        if gone {
            // The other end of the cable is gone: the link goes down and stays down (until a
            // new peer plugs in, if the cable listens).
            tracing::warn!("virtio-net: the wire's other end is gone; link down");
            self.wire = None;
            arrived.config_changed = self.set_link(false);
        }
        if !self.backlog.is_empty() {
            arrived.queues.push(net::RECEIVEQ);
        }
        arrived
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outboard_shm::SharedMem;
    use outboard_spec::virtio::split;
    use std::time::Duration;

    const SIZE: u16 = 16;

    /// A driver's side of one queue, in guest memory of its own: descriptors, available and
    /// used rings at fixed places, buffers after them.
    struct Guest {
        mem: SharedMem,
        dma: DmaMap,
        queue: DeviceQueue,
        next_desc: u16,
        avail_idx: u16,
        seen_used: u16,
        next_buf: u64,
    }

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const BUFS: u64 = 0x10000;

    impl Guest {
        fn new() -> Self {
            let mem = SharedMem::create("net", 1 << 20).unwrap();
            let mut dma = DmaMap::new(Duration::from_secs(1));
            let req = outboard_vfio_user::wire::DmaMap {
                argsz: 32,
                flags: 3,
                offset: 0,
                addr: 0,
                size: 1 << 20,
            };
            dma.map(&req, Some(mem.fd().unwrap().try_clone_to_owned().unwrap()))
                .unwrap();
            let queue = DeviceQueue::new(SIZE, DESC, AVAIL, USED, 0).unwrap();
            Self {
                mem,
                dma,
                queue,
                next_desc: 0,
                avail_idx: 0,
                seen_used: 0,
                next_buf: BUFS,
            }
        }

        /// Posts one chain of buffers (`(bytes to put in it, writable)` each); its head.
        fn post(&mut self, bufs: &[(Vec<u8>, bool)]) -> u16 {
            let head = self.next_desc;
            for (i, (data, write)) in bufs.iter().enumerate() {
                let d = self.next_desc;
                self.next_desc = (self.next_desc + 1) % SIZE;
                let addr = self.next_buf;
                self.next_buf += data.len().max(1) as u64;
                self.mem.write(addr, data).unwrap();
                let o = DESC + 16 * u64::from(d);
                let last = i + 1 == bufs.len();
                let mut flags = if *write { split::DESC_F_WRITE } else { 0 };
                if !last {
                    flags |= split::DESC_F_NEXT;
                }
                self.mem.write_u64(o, addr).unwrap();
                self.mem.write_u32(o + 8, data.len() as u32).unwrap();
                self.mem.write_u16(o + 12, flags).unwrap();
                self.mem.write_u16(o + 14, self.next_desc).unwrap();
            }
            self.mem
                .write_u16(AVAIL + split::avail_entry(SIZE, self.avail_idx), head)
                .unwrap();
            self.avail_idx = self.avail_idx.wrapping_add(1);
            self.mem
                .write_u16(AVAIL + split::AVAIL_IDX, self.avail_idx)
                .unwrap();
            head
        }

        /// A receive chain of one writable buffer of `len` bytes.
        fn post_rx(&mut self, len: usize) -> u16 {
            self.post(&[(vec![0xee; len], true)])
        }

        /// A transmit chain: the header, then `frame` split in two buffers.
        fn post_tx(&mut self, frame: &[u8]) -> u16 {
            let (a, b) = frame.split_at(frame.len() / 2);
            self.post(&[
                (vec![0; net::HDR_SIZE], false),
                (a.to_vec(), false),
                (b.to_vec(), false),
            ])
        }

        /// Used entries published since the last call: (head, length).
        fn used(&mut self) -> Vec<(u16, u32)> {
            let idx = self.mem.read_u16(USED + split::USED_IDX).unwrap();
            let mut v = Vec::new();
            while self.seen_used != idx {
                let o = USED + split::used_entry(SIZE, self.seen_used);
                let id = self.mem.read_u32(o).unwrap() as u16;
                let len = self.mem.read_u32(o + 4).unwrap();
                v.push((id, len));
                self.seen_used = self.seen_used.wrapping_add(1);
            }
            v
        }

        /// The bytes of the first `len` bytes written into chain `head`'s buffers.
        fn written(&self, head: u16, len: u32) -> Vec<u8> {
            let mut out = Vec::new();
            let mut d = head;
            while (out.len() as u32) < len {
                let o = DESC + 16 * u64::from(d);
                let addr = self.mem.read_u64(o).unwrap();
                let blen = self.mem.read_u32(o + 8).unwrap();
                let n = blen.min(len - out.len() as u32) as usize;
                let mut b = vec![0; n];
                self.mem.read(addr, &mut b).unwrap();
                out.extend(b);
                d = self.mem.read_u16(o + 14).unwrap();
            }
            out
        }
    }

    fn frame(len: usize, seed: u8) -> Vec<u8> {
        let mut f: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect();
        f[..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 2]);
        f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
        f
    }

    fn nics(mergeable: bool) -> (VirtioNet, VirtioNet) {
        let (a, b) = Wire::pair().unwrap();
        let mut x = VirtioNet::new(NetOptions::default(), Some(a));
        let mut y = VirtioNet::new(NetOptions::default(), Some(b));
        let f = if mergeable {
            net::feature::MRG_RXBUF
        } else {
            0
        };
        x.activate(f);
        y.activate(f);
        (x, y)
    }

    /// One frame from `tx`'s transmit queue into `rx`'s receive queue.
    fn send(tx: &mut VirtioNet, txq: &mut Guest, rx: &mut VirtioNet, f: &[u8]) -> Arrived {
        let head = txq.post_tx(f);
        tx.process(net::TRANSMITQ, &mut txq.queue, &txq.dma)
            .unwrap();
        assert_eq!(txq.used(), vec![(head, 0)], "the transmit chain comes back");
        rx.input(0)
    }

    #[test]
    fn frames_of_every_size_cross_a_wire_intact_and_in_order() {
        let (mut a, mut b) = nics(false);
        let (mut txq, mut rxq) = (Guest::new(), Guest::new());
        for (i, len) in [60usize, 61, 64, 128, 512, 1000, 1513, 1514]
            .into_iter()
            .enumerate()
        {
            let f = frame(len, i as u8);
            let arrived = send(&mut a, &mut txq, &mut b, &f);
            assert_eq!(arrived.queues, vec![net::RECEIVEQ]);
            let head = rxq.post_rx(net::HDR_SIZE + 1514);
            b.process(net::RECEIVEQ, &mut rxq.queue, &rxq.dma).unwrap();
            let used = rxq.used();
            assert_eq!(used, vec![(head, (net::HDR_SIZE + len) as u32)], "{len}");
            let got = rxq.written(head, used[0].1);
            assert_eq!(
                &got[net::HDR_NUM_BUFFERS..net::HDR_SIZE],
                &1u16.to_le_bytes()
            );
            assert!(
                got[net::HDR_SIZE..] == f[..],
                "frame of {len} bytes differs"
            );
        }
        assert_eq!(a.stats().tx_frames, 8);
        assert_eq!(b.stats().rx_frames, 8);
        assert_eq!(b.stats().rx_dropped + a.stats().tx_dropped, 0);
    }

    #[test]
    fn a_frame_spreads_over_mergeable_buffers_and_waits_until_there_are_enough() {
        let (mut a, mut b) = nics(true);
        let (mut txq, mut rxq) = (Guest::new(), Guest::new());
        let f = frame(1514, 9);
        send(&mut a, &mut txq, &mut b, &f);
        // 1526 bytes with the header: two 512-byte buffers are not enough; it waits.
        let first = [rxq.post_rx(512), rxq.post_rx(512)];
        b.process(net::RECEIVEQ, &mut rxq.queue, &rxq.dma).unwrap();
        assert!(rxq.used().is_empty());
        let third = rxq.post_rx(512);
        b.process(net::RECEIVEQ, &mut rxq.queue, &rxq.dma).unwrap();
        let used = rxq.used();
        assert_eq!(
            used,
            vec![(first[0], 512), (first[1], 512), (third, 1526 - 1024)]
        );
        let mut got = Vec::new();
        for &(h, len) in &used {
            got.extend(rxq.written(h, len));
        }
        assert_eq!(
            &got[net::HDR_NUM_BUFFERS..net::HDR_SIZE],
            &3u16.to_le_bytes()
        );
        assert!(got[net::HDR_SIZE..] == f[..]);
    }

    #[test]
    fn a_buffer_too_small_without_mergeable_buffers_drops_the_frame_only() {
        let (mut a, mut b) = nics(false);
        let (mut txq, mut rxq) = (Guest::new(), Guest::new());
        send(&mut a, &mut txq, &mut b, &frame(1000, 1));
        send(&mut a, &mut txq, &mut b, &frame(100, 2));
        let small = rxq.post_rx(512);
        let big = rxq.post_rx(2048);
        b.process(net::RECEIVEQ, &mut rxq.queue, &rxq.dma).unwrap();
        assert_eq!(
            rxq.used(),
            vec![(small, 0), (big, (net::HDR_SIZE + 100) as u32)]
        );
        assert_eq!(b.stats().rx_dropped, 1);
        assert_eq!(b.stats().rx_frames, 1);
    }

    #[test]
    fn malformed_chains_are_refused_and_counted_and_the_rest_flows() {
        let (mut a, mut b) = nics(false);
        let (mut txq, mut rxq) = (Guest::new(), Guest::new());
        // Transmit: shorter than its header; a frame shorter than an Ethernet header; one
        // longer than the MTU allows. None reaches the wire.
        txq.post(&[(vec![0; 5], false)]);
        txq.post(&[(vec![0; net::HDR_SIZE + 10], false)]);
        txq.post(&[(vec![0; net::HDR_SIZE + 1600], false)]);
        a.process(net::TRANSMITQ, &mut txq.queue, &txq.dma).unwrap();
        assert_eq!(txq.used().len(), 3);
        assert_eq!(a.stats().tx_dropped, 3);
        assert!(b.input(0).queues.is_empty(), "nothing crossed the wire");
        // Receive: a chain with a device-readable buffer is handed back unused; the frame
        // goes into the next good one.
        send(&mut a, &mut txq, &mut b, &frame(200, 3));
        let bad = rxq.post(&[(vec![0; 16], false), (vec![0; 2048], true)]);
        b.process(net::RECEIVEQ, &mut rxq.queue, &rxq.dma).unwrap();
        assert_eq!(rxq.used(), vec![(bad, 0)]);
        let good = rxq.post_rx(2048);
        b.process(net::RECEIVEQ, &mut rxq.queue, &rxq.dma).unwrap();
        assert_eq!(rxq.used(), vec![(good, (net::HDR_SIZE + 200) as u32)]);
        assert_eq!(b.stats().rx_bad_buffers, 1);
    }

    #[test]
    fn the_link_goes_down_when_the_other_end_of_the_wire_is_gone() {
        let (a, mut b) = nics(false);
        assert_eq!(
            u16::from_le_bytes([b.config()[net::config::STATUS], b.config()[7]]),
            net::S_LINK_UP
        );
        drop(a);
        let arrived = b.input(0);
        assert!(arrived.config_changed);
        assert_eq!(
            u16::from_le_bytes([b.config()[net::config::STATUS], b.config()[7]]),
            0
        );
        assert!(
            b.input_fds().is_empty(),
            "the dead wire is no longer polled"
        );
        let c = b.config();
        assert_eq!(&c[..6], &NetOptions::default().mac);
        assert_eq!(u16::from_le_bytes([c[10], c[11]]), 1500);
    }

    fn link(n: &VirtioNet) -> bool {
        let c = n.config();
        u16::from_le_bytes([c[net::config::STATUS], c[net::config::STATUS + 1]]) == net::S_LINK_UP
    }

    #[test]
    fn a_link_flap_takes_the_link_down_then_back_each_with_a_configuration_change() {
        let (mut a, mut b) = nics(false);
        let (mut txq, mut rxq) = (Guest::new(), Guest::new());
        let fault: crate::faults::Fault = "link-flap=50ms".parse().unwrap();
        lock(&b.faults()).check(&fault).unwrap();
        lock(&b.faults()).arm(fault);
        assert_eq!(b.input_fds().len(), 1, "no timer before the notification");
        rxq.post_rx(2048);
        b.process(net::RECEIVEQ, &mut rxq.queue, &rxq.dma).unwrap();
        assert_eq!(b.input_fds().len(), 2, "the flap's timer is an input now");
        // Down at once (the timer's first expiry), with a configuration change.
        let down =
            outboard_sys::wait::eventually(Duration::from_secs(5), || b.input(1).config_changed);
        assert!(down && !link(&b));
        // Frames that reach a NIC whose link is down are dropped.
        send(&mut a, &mut txq, &mut b, &frame(100, 1));
        assert_eq!(b.stats().rx_dropped, 1);
        // Up again after the flap's length, not before.
        let t0 = std::time::Instant::now();
        let up =
            outboard_sys::wait::eventually(Duration::from_secs(5), || b.input(1).config_changed);
        assert!(up && link(&b));
        assert!(
            t0.elapsed() >= Duration::from_millis(40),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(b.input_fds().len(), 1, "the timer is gone");
        // And frames flow again.
        send(&mut a, &mut txq, &mut b, &frame(100, 2));
        b.process(net::RECEIVEQ, &mut rxq.queue, &rxq.dma).unwrap();
        assert_eq!(rxq.used().len(), 1);
    }

    #[test]
    fn a_long_frame_fault_claims_more_than_the_buffer_holds_once() {
        let (mut a, mut b) = nics(false);
        let (mut txq, mut rxq) = (Guest::new(), Guest::new());
        lock(&b.faults()).arm("long-frame=1".parse().unwrap());
        let heads = [rxq.post_rx(2048), rxq.post_rx(2048)];
        send(&mut a, &mut txq, &mut b, &frame(100, 1));
        send(&mut a, &mut txq, &mut b, &frame(100, 2));
        b.process(net::RECEIVEQ, &mut rxq.queue, &rxq.dma).unwrap();
        let used = rxq.used();
        assert_eq!(
            used,
            vec![(heads[0], 2049), (heads[1], (net::HDR_SIZE + 100) as u32)]
        );
        assert_eq!(b.stats().rx_frames, 1);
    }

    #[test]
    fn a_nic_waiting_on_a_full_wire_takes_what_its_peer_sends_meanwhile() {
        let (mut a, mut b) = nics(false);
        // The peer has frames for us waiting in the cable.
        for i in 0..10 {
            b.put_on_wire(&frame(200, i));
        }
        // Our direction fills up (the peer reads nothing).
        let f = frame(1514, 99);
        let mut sent = 0;
        while a.stats().tx_dropped == 0 {
            a.put_on_wire(&f);
            sent += 1;
            assert!(sent < 10_000, "the wire never filled");
        }
        // Waiting to send, it took the peer's frames: two NICs each waiting on the other
        // would otherwise both stall.
        let d = a.deferred();
        assert_eq!(d.queues, vec![net::RECEIVEQ]);
        assert_eq!(a.backlog.len(), 10);
        assert_eq!(a.deferred(), Arrived::default(), "reported once");
        // And once the peer reads, frames go again.
        b.take_from_wire();
        a.put_on_wire(&f);
        assert_eq!(a.stats().tx_frames, sent);
    }

    #[test]
    fn a_full_backlog_drops_and_counts_what_does_not_fit() {
        let (mut a, mut b) = nics(false);
        let mut txq = Guest::new();
        let total = BACKLOG + 10;
        for i in 0..total {
            txq.post_tx(&frame(60, i as u8));
            a.process(net::TRANSMITQ, &mut txq.queue, &txq.dma).unwrap();
            txq.used();
            // Buffers are reused: the queue has 16 entries, the memory is not endless.
            txq.next_buf = BUFS;
            if i % 16 == 15 {
                b.input(0);
            }
        }
        for _ in 0..10 {
            b.input(0);
        }
        assert_eq!(a.stats().tx_frames, total as u64);
        assert_eq!(b.backlog.len(), BACKLOG);
        assert_eq!(b.stats().rx_dropped, 10);
    }

    /// A NIC on a stream cable, and the peer's end of it.
    fn on_a_stream() -> (VirtioNet, OwnedFd) {
        let (ours, theirs) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let nic = VirtioNet::new(NetOptions::default(), Some(Wire::stream(ours).unwrap()));
        (nic, theirs)
    }

    fn framed(frame: &[u8]) -> Vec<u8> {
        let mut v = (frame.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(frame);
        v
    }

    #[test]
    fn a_stream_frame_split_across_reads_arrives_whole() {
        let (mut nic, peer) = on_a_stream();
        let f = frame(300, 7);
        let bytes = framed(&f);
        // The length's first two bytes, then the rest of it and part of the frame, then the
        // end: nothing until the frame is whole.
        for piece in [&bytes[..2], &bytes[2..100]] {
            rustix::io::write(&peer, piece).unwrap();
            nic.input(0);
            assert!(nic.backlog.is_empty());
        }
        rustix::io::write(&peer, &bytes[100..]).unwrap();
        nic.input(0);
        assert_eq!(nic.backlog.len(), 1);
        assert_eq!(&nic.backlog[0][net::HDR_SIZE..], &f[..]);
    }

    #[test]
    fn stream_frames_too_short_or_too_long_for_the_link_are_dropped_and_counted() {
        let (mut nic, peer) = on_a_stream();
        let mut bytes = framed(&[]);
        bytes.extend(framed(&[0u8; 13]));
        bytes.extend(framed(&vec![0u8; 1515 + 4 + 1]));
        bytes.extend(framed(&frame(60, 1)));
        rustix::io::write(&peer, &bytes).unwrap();
        nic.input(0);
        assert_eq!(nic.stats().rx_dropped, 3);
        assert_eq!(nic.backlog.len(), 1, "the frame after them still arrives");
        assert!(link(&nic));
    }

    #[test]
    fn a_stream_announcing_a_frame_no_link_carries_takes_the_link_down() {
        let (mut nic, peer) = on_a_stream();
        let mut bytes = framed(&frame(60, 1));
        bytes.extend_from_slice(&(STREAM_MAX_FRAME as u32 + 1).to_be_bytes());
        bytes.extend_from_slice(&[0u8; 64]);
        rustix::io::write(&peer, &bytes).unwrap();
        let arrived = nic.input(0);
        // The stream cannot be followed past a length no link carries: the cable is
        // unplugged, and the frame read before it goes with the link (as a NIC whose link
        // goes down drops what it holds), counted.
        assert!(arrived.config_changed && !link(&nic));
        assert!(nic.backlog.is_empty());
        assert_eq!(nic.stats().rx_dropped, 1);
        assert!(nic.input_fds().is_empty(), "the cable is unplugged");
    }
}
