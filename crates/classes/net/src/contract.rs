//! The network class's contract: requests, completions, status and errors, whatever the
//! placement. On the wire (a session's rings) a request is a 32-byte entry and a completion the
//! 16-byte entry every request/reply class shares; layouts pinned by the tests below.
//!
//! Request entry (little-endian): opcode u8 at 0, seven reserved bytes (zero), tag u64 at 8,
//! buffer offset u64 at 16, length u32 at 24, four reserved bytes (zero). A completion's value
//! is the bytes sent (transmit), the frame's length (receive), the buffers given back
//! (reclaim), or 0.

use outboard_session::completion::{Completion, WireError, COMPLETION_SIZE};
use outboard_session::RingShape;
use serde::{Deserialize, Serialize};
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The class's name, as sessions and personalities name it.
pub const CLASS: &str = "net";

/// Bytes of an Ethernet header (destination, source, type).
pub const ETH_HEADER: u32 = 14;
/// Most multicast groups one session may join.
pub const MAX_GROUPS: u32 = 64;
/// [`NetOp::Mode`] flag: every frame, whatever its destination.
pub const PROMISCUOUS: u32 = 1;
/// [`NetOp::Mode`] flag: every multicast frame.
pub const ALL_MULTICAST: u32 = 2;

/// What a client can get wrong and what can go wrong in the device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetError {
    /// The request is malformed (a frame shorter than a header or longer than the device
    /// sends, an unknown opcode, reserved bytes set, …).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The buffer is not inside the session's buffer area.
    #[error("the buffer is outside the session's buffer area")]
    BadBuffer,
    /// The tag is already in flight in this session.
    #[error("the tag is already in flight")]
    DuplicateTag,
    /// No room for another request now.
    #[error("the queue is full")]
    QueueFull,
    /// The device could not send the frame, or its driver could not complete the request.
    #[error("I/O error: {0}")]
    Io(String),
    /// The request got no answer in time (the device stalled).
    #[error("timed out")]
    Timeout,
    /// The device is being brought back: retry.
    #[error("the device is restarting; try again")]
    Restarting,
    /// The device failed and was given up.
    #[error("device failed: {0}")]
    DeviceFailed(String),
    /// The device is gone (detached, or its server ended with no supervisor).
    #[error("the device is gone")]
    DeviceGone,
    /// This request crashed the driver every time it was sent; it is not sent again.
    #[error(
        "this request crashed the driver {} times; it is not sent again",
        outboard_session::control::QUARANTINE_AFTER
    )]
    Quarantined,
    /// The packet filter was refused: the words say which instruction and why.
    #[error("bad packet filter: {0}")]
    BadFilter(String),
    /// A received frame was longer than the posted buffer: the buffer holds its first bytes.
    #[error("frame truncated: {0}")]
    Truncated(String),
    /// A posted receive buffer given back unused (the client asked for its buffers back).
    #[error("the receive buffer was given back unused")]
    Cancelled,
    /// A transmitted frame whose server died before it said whether the frame went out: it
    /// is not sent again (a frame is sent at most once), so it may or may not have been sent.
    #[error("the driver restarted before it reported this frame; it may not have been sent")]
    Interrupted,
    /// No device of that name.
    #[error("{0}")]
    NoSuchDevice(String),
    /// Someone else holds the device, or a limit is reached.
    #[error("busy: {0}")]
    Busy(String),
    /// Whoever should answer is not there.
    #[error("{0}")]
    Unreachable(String),
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The driver server or the manager refused for a reason no other variant covers (the
    /// device is of another class, this user may not use it, a code this build does not
    /// know): its code travels with it.
    #[error("{reason}")]
    Refused {
        /// The refusal's code (`wrong-class`, `denied`, …).
        code: outboard_session::Code,
        /// Why, in words.
        reason: String,
    },
}

/// Each error kind's name by its code (code `-k` at `k - 1`), for counters.
pub const ERROR_KINDS: &[&str] = &[
    "invalid",
    "bad-buffer",
    "duplicate-tag",
    "queue-full",
    "io",
    "timeout",
    "restarting",
    "device-failed",
    "device-gone",
    "quarantined",
    "no-such-device",
    "busy",
    "unreachable",
    "protocol",
    "refused",
    "bad-filter",
    "truncated",
    "cancelled",
    "interrupted",
];

impl NetError {
    /// The code a completion carries (0 is success).
    pub fn code(&self) -> i32 {
        match self {
            NetError::Invalid(_) => -1,
            NetError::BadBuffer => -2,
            NetError::DuplicateTag => -3,
            NetError::QueueFull => -4,
            NetError::Io(_) => -5,
            NetError::Timeout => -6,
            NetError::Restarting => -7,
            NetError::DeviceFailed(_) => -8,
            NetError::DeviceGone => -9,
            NetError::Quarantined => -10,
            NetError::NoSuchDevice(_) => -11,
            NetError::Busy(_) => -12,
            NetError::Unreachable(_) => -13,
            NetError::Protocol(_) => -14,
            NetError::Refused { .. } => -15,
            NetError::BadFilter(_) => -16,
            NetError::Truncated(_) => -17,
            NetError::Cancelled => -18,
            NetError::Interrupted => -19,
        }
    }

    /// The words a code alone does not carry: what is sent beside a failed completion.
    pub fn reason(&self) -> Option<&str> {
        match self {
            NetError::Invalid(s)
            | NetError::Io(s)
            | NetError::DeviceFailed(s)
            | NetError::NoSuchDevice(s)
            | NetError::Busy(s)
            | NetError::Unreachable(s)
            | NetError::Protocol(s)
            | NetError::BadFilter(s)
            | NetError::Truncated(s)
            | NetError::Refused { reason: s, .. } => Some(s),
            _ => None,
        }
    }

    /// The error a completion's code stands for, with the generic words.
    pub fn from_code(c: i32) -> Self {
        Self::from_wire(c, None)
    }
}

impl WireError for NetError {
    fn code(&self) -> i32 {
        NetError::code(self)
    }

    fn reason(&self) -> Option<&str> {
        NetError::reason(self)
    }

    fn from_wire(c: i32, reason: Option<String>) -> Self {
        let words = |generic: &str| reason.clone().unwrap_or_else(|| generic.to_string());
        match c {
            -1 => NetError::Invalid(words("refused by the server")),
            -2 => NetError::BadBuffer,
            -3 => NetError::DuplicateTag,
            -4 => NetError::QueueFull,
            -5 => NetError::Io(words("no reason given")),
            -6 => NetError::Timeout,
            -7 => NetError::Restarting,
            -8 => NetError::DeviceFailed(words("the driver gave the device up")),
            -9 => NetError::DeviceGone,
            -10 => NetError::Quarantined,
            -11 => NetError::NoSuchDevice(words("no such device")),
            -12 => NetError::Busy(words("busy")),
            -13 => NetError::Unreachable(words("unreachable")),
            -14 => NetError::Protocol(words("the server broke the protocol")),
            // Only the control plane refuses with a code of its own; on the wire it is words.
            -15 => NetError::Refused {
                code: outboard_session::Code::Unknown,
                reason: words("refused"),
            },
            -16 => NetError::BadFilter(words("refused by the server")),
            -17 => NetError::Truncated(words("longer than the buffer")),
            -18 => NetError::Cancelled,
            -19 => NetError::Interrupted,
            c => NetError::Protocol(format!("unknown completion code {c}")),
        }
    }
}

// A frame a dead server had taken may have gone out: it is not sent again.
outboard_session::from_refusal!(NetError, |r| NetError::Interrupted);

/// The class status a client gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetInfo {
    /// Class device name.
    pub name: String,
    /// The NIC's address (all zero if the device has none); in JSON as text
    /// (`02:00:00:00:00:01`).
    #[serde(with = "mac_as_text")]
    pub mac: [u8; 6],
    /// Largest payload behind the Ethernet header.
    pub mtu: u16,
    /// Whether the link is up, as last read.
    pub link_up: bool,
    /// Most frames in the transmit queue at once.
    pub queue_depth: u32,
    /// What the server saw (zero from a driver alone; the server fills them in).
    #[serde(default)]
    pub counters: NetCounters,
}

/// What happened to the frames of a NIC, as its server counts them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetCounters {
    /// Frames handed to the device to send.
    pub tx_frames: u64,
    /// Bytes in them.
    pub tx_bytes: u64,
    /// Frames the device received.
    pub rx_frames: u64,
    /// Bytes in them.
    pub rx_bytes: u64,
    /// Copies of received frames delivered to sessions (a frame two sessions take counts
    /// twice).
    pub rx_delivered: u64,
    /// Received frames no session took (no filter or address matched): dropped.
    pub rx_unclaimed: u64,
    /// Received frames a session took but had no receive buffer posted for: dropped.
    pub rx_no_buffer: u64,
    /// Received frames longer than the buffer they went into.
    pub rx_truncated: u64,
    /// Received frames the driver dropped because the device wrote something that cannot be
    /// right (a length past its buffer, a chain it never posted): the driver counts these.
    #[serde(default)]
    pub rx_device_errors: u64,
    /// Frames the device wrote straight into a session's buffer (the session owns the
    /// receive path, [`NetOp::Own`]): delivered without a copy in the server.
    #[serde(default)]
    pub rx_in_place: u64,
}

impl NetInfo {
    /// The longest frame the device sends or receives: a header and the MTU.
    pub fn max_frame(&self) -> u32 {
        ETH_HEADER + u32::from(self.mtu)
    }

    /// The address as people write it (`52:54:00:12:34:56`).
    pub fn mac_text(&self) -> String {
        mac_text(&self.mac)
    }
}

/// An address in JSON: as people write it.
mod mac_as_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(mac: &[u8; 6], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::mac_text(mac))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 6], D::Error> {
        let text = String::deserialize(d)?;
        super::parse_mac_text(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("{text:?} is not a MAC address")))
    }
}

/// An address as people write it (`02:00:00:00:00:01`), read back; `None` if it is not one.
pub fn parse_mac_text(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for b in &mut mac {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// An address as people write it.
pub fn mac_text(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// What a request asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetOp {
    /// Send the frame at `[buf_offset, +length)`.
    Transmit,
    /// Post `[buf_offset, +length)` to receive one frame into.
    Receive,
    /// Attach the classic BPF program at `[buf_offset, +length)` (8 bytes an instruction, as
    /// `SO_ATTACH_FILTER` takes it) to this session; a length of 0 removes the filter.
    Filter,
    /// Set this session's receive mode: `length` holds [`PROMISCUOUS`] and [`ALL_MULTICAST`].
    Mode,
    /// Join the multicast groups at `[buf_offset, +length)` (6 bytes each), replacing the
    /// session's list; a length of 0 leaves every group.
    Multicast,
    /// Give back every posted receive buffer of the session (each completes with
    /// [`NetError::Cancelled`]); the value is how many.
    Reclaim,
    /// Ask the NIC to hold receive interrupts back up to `length` microseconds (0: none;
    /// at most [`MAX_HOLD_OFF_US`]) — the device's setting, for every session.
    HoldOff,
    /// Take (`length` 1) or give back (0) the NIC's receive path. The owner's posted buffers
    /// go into the device itself, which writes each frame where the client reads it: no copy
    /// in the server. The value is the headroom: bytes the device writes before the frame in
    /// each buffer (a received frame is at `buf_offset + headroom`). Refused (`busy`) while
    /// another session receives; while it is owned, other sessions may send but not post
    /// receive buffers. The owner's address rule and filter still decide which frames
    /// complete; a frame it does not take leaves its buffer posted.
    Own,
}

/// The longest receive-interrupt hold-off a client may ask for: one second.
pub const MAX_HOLD_OFF_US: u32 = 1_000_000;

impl NetOp {
    /// The wire opcode.
    pub fn code(self) -> u8 {
        match self {
            NetOp::Transmit => 1,
            NetOp::Receive => 2,
            NetOp::Filter => 3,
            NetOp::Mode => 4,
            NetOp::Multicast => 5,
            NetOp::Reclaim => 6,
            NetOp::HoldOff => 7,
            NetOp::Own => 8,
        }
    }

    /// The operation of a wire opcode.
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => NetOp::Transmit,
            2 => NetOp::Receive,
            3 => NetOp::Filter,
            4 => NetOp::Mode,
            5 => NetOp::Multicast,
            6 => NetOp::Reclaim,
            7 => NetOp::HoldOff,
            8 => NetOp::Own,
            _ => return None,
        })
    }
}

/// One request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetRequest {
    /// What it asks.
    pub op: NetOp,
    /// The client's tag, returned in the completion; unique among requests in flight.
    pub tag: u64,
    /// Where in the buffer area (transmit, receive, filter, multicast).
    pub buf_offset: u64,
    /// Bytes there, or the mode's flags.
    pub length: u32,
}

/// One completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetCompletion {
    /// The request's tag.
    pub tag: u64,
    /// The value ([`NetOp`] says what it is), or the error.
    pub result: Result<u32, NetError>,
}

fn in_buffer(r: &NetRequest, buffer_size: u64) -> Result<(), NetError> {
    match r.buf_offset.checked_add(u64::from(r.length)) {
        Some(end) if end <= buffer_size => Ok(()),
        _ => Err(NetError::BadBuffer),
    }
}

/// Checks a request against the device and the buffer area (the server's check; the filter
/// program itself is checked by [`crate::bpf::Program::parse`]).
pub fn validate(r: &NetRequest, info: &NetInfo, buffer_size: u64) -> Result<(), NetError> {
    match r.op {
        NetOp::Transmit => {
            if r.length < ETH_HEADER || r.length > info.max_frame() {
                return Err(NetError::Invalid(format!(
                    "a frame of {} bytes: this NIC sends {ETH_HEADER} to {}",
                    r.length,
                    info.max_frame()
                )));
            }
            in_buffer(r, buffer_size)
        }
        NetOp::Receive => {
            if r.length < ETH_HEADER {
                return Err(NetError::Invalid(format!(
                    "a receive buffer of {} bytes cannot hold an Ethernet header",
                    r.length
                )));
            }
            in_buffer(r, buffer_size)
        }
        NetOp::Filter => {
            if !r.length.is_multiple_of(8) || r.length / 8 > crate::bpf::MAX_INSNS as u32 {
                return Err(NetError::BadFilter(format!(
                    "{} bytes is not a program of 1 to {} 8-byte instructions",
                    r.length,
                    crate::bpf::MAX_INSNS
                )));
            }
            in_buffer(r, buffer_size)
        }
        NetOp::Mode => {
            if r.buf_offset != 0 || r.length & !(PROMISCUOUS | ALL_MULTICAST) != 0 {
                return Err(NetError::Invalid(format!(
                    "unknown receive mode {:#x} (offset {})",
                    r.length, r.buf_offset
                )));
            }
            Ok(())
        }
        NetOp::Multicast => {
            if !r.length.is_multiple_of(6) || r.length / 6 > MAX_GROUPS {
                return Err(NetError::Invalid(format!(
                    "{} bytes is not a list of up to {MAX_GROUPS} 6-byte addresses",
                    r.length
                )));
            }
            in_buffer(r, buffer_size)
        }
        NetOp::Reclaim => {
            if r.buf_offset != 0 || r.length != 0 {
                return Err(NetError::Invalid("reclaim takes no buffer".into()));
            }
            Ok(())
        }
        NetOp::Own => {
            if r.buf_offset != 0 || r.length > 1 {
                return Err(NetError::Invalid(format!(
                    "own takes 1 (take the receive path) or 0 (give it back), not {} (offset {})",
                    r.length, r.buf_offset
                )));
            }
            Ok(())
        }
        NetOp::HoldOff => {
            if r.buf_offset != 0 || r.length > MAX_HOLD_OFF_US {
                return Err(NetError::Invalid(format!(
                    "a hold-off of {} µs (offset {}): 0 to {MAX_HOLD_OFF_US} µs",
                    r.length, r.buf_offset
                )));
            }
            Ok(())
        }
    }
}

/// Bytes of a request entry.
pub const SQE_SIZE: u32 = 32;
/// Bytes of a completion entry.
pub const CQE_SIZE: u32 = COMPLETION_SIZE;

/// The class's rings: requests to the server, completions and their reasons to the client.
pub const RINGS: [RingShape; 3] = RingShape::request_reply(SQE_SIZE, CQE_SIZE);

/// A request entry as it sits in the ring.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct SqeLayout {
    /// Opcode ([`NetOp::code`]).
    pub op: u8,
    /// Zero.
    pub reserved0: [u8; 7],
    /// Tag.
    pub tag: U64,
    /// Offset in the buffer area.
    pub buf_offset: U64,
    /// Bytes, or flags.
    pub length: U32,
    /// Zero.
    pub reserved1: U32,
}

/// A request entry's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; SQE_SIZE as usize]);

impl Sqe {
    /// Encodes a request.
    pub fn encode(r: &NetRequest) -> Self {
        let l = SqeLayout {
            op: r.op.code(),
            reserved0: [0; 7],
            tag: r.tag.into(),
            buf_offset: r.buf_offset.into(),
            length: r.length.into(),
            reserved1: 0.into(),
        };
        let mut e = [0u8; SQE_SIZE as usize];
        e.copy_from_slice(l.as_bytes());
        Self(e)
    }

    /// The tag, whatever else the entry holds (to answer an entry that does not decode).
    pub fn tag(&self) -> u64 {
        u64::from_le_bytes(self.0[8..16].try_into().expect("8 bytes"))
    }

    /// Decodes a request: an unknown opcode or a reserved byte set is refused.
    pub fn decode(&self) -> Result<NetRequest, NetError> {
        let l = SqeLayout::read_from_bytes(&self.0).expect("32 bytes");
        let op = NetOp::from_code(l.op)
            .ok_or_else(|| NetError::Invalid(format!("unknown opcode {}", l.op)))?;
        if l.reserved0 != [0; 7] || l.reserved1.get() != 0 {
            return Err(NetError::Invalid("reserved bytes are set".into()));
        }
        Ok(NetRequest {
            op,
            tag: l.tag.get(),
            buf_offset: l.buf_offset.get(),
            length: l.length.get(),
        })
    }
}

/// A completion entry's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe(pub [u8; CQE_SIZE as usize]);

impl Cqe {
    /// Encodes a completion (the layout every request/reply class shares,
    /// [`outboard_session::completion`]).
    pub fn encode(c: &NetCompletion) -> Self {
        Self(Completion::of(c.tag, &c.result).encode())
    }

    /// Decodes a completion (without the reason, which the client's channel adds).
    pub fn decode(&self) -> NetCompletion {
        let c = Completion::decode(&self.0);
        NetCompletion {
            tag: c.tag,
            result: c.result(None),
        }
    }
}

/// Where a frame is going, as the default rule (no filter) sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    /// To this NIC's own address.
    Own,
    /// To everyone.
    Broadcast,
    /// To a multicast group.
    Multicast([u8; 6]),
    /// To some other station.
    Other,
}

/// Where `frame` is going, for a NIC whose address is `mac` (a frame too short for a header
/// goes nowhere: [`Destination::Other`]).
pub fn destination(frame: &[u8], mac: &[u8; 6]) -> Destination {
    let Some(dst) = frame.get(..6).and_then(|d| <[u8; 6]>::try_from(d).ok()) else {
        return Destination::Other;
    };
    if dst == [0xff; 6] {
        Destination::Broadcast
    } else if dst[0] & 1 != 0 {
        Destination::Multicast(dst)
    } else if &dst == mac {
        Destination::Own
    } else {
        Destination::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info() -> NetInfo {
        NetInfo {
            name: "nic0".into(),
            mac: [0x52, 0x54, 0, 0x12, 0x34, 0x56],
            mtu: 1500,
            link_up: true,
            queue_depth: 256,
            counters: NetCounters::default(),
        }
    }

    #[test]
    fn entries_have_the_documented_layout() {
        let e = Sqe::encode(&NetRequest {
            op: NetOp::Receive,
            tag: 0x0102_0304_0506_0708,
            buf_offset: 0x1000,
            length: 1514,
        });
        assert_eq!(e.0[0], 2);
        assert_eq!(&e.0[1..8], &[0; 7]);
        assert_eq!(&e.0[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&e.0[16..24], &0x1000u64.to_le_bytes());
        assert_eq!(&e.0[24..28], &1514u32.to_le_bytes());
        assert_eq!(&e.0[28..], &[0; 4]);
        assert_eq!(info().mac_text(), "52:54:00:12:34:56");
        let json = serde_json::to_value(info()).unwrap();
        assert_eq!(json["mac"], "52:54:00:12:34:56");
        assert_eq!(serde_json::from_value::<NetInfo>(json).unwrap(), info());
        assert_eq!(parse_mac_text("52:54:00:12:34"), None);
        assert_eq!(parse_mac_text("52:54:00:12:34:56:78"), None);
    }

    #[test]
    fn unknown_opcodes_and_reserved_bytes_are_refused() {
        let good = Sqe::encode(&NetRequest {
            op: NetOp::Transmit,
            tag: 5,
            buf_offset: 0,
            length: 60,
        });
        let mut bad = good;
        bad.0[0] = 0;
        assert!(matches!(bad.decode(), Err(NetError::Invalid(_))));
        bad = good;
        bad.0[3] = 1;
        assert!(matches!(bad.decode(), Err(NetError::Invalid(_))));
        bad = good;
        bad.0[31] = 1;
        assert!(matches!(bad.decode(), Err(NetError::Invalid(_))));
        assert_eq!(bad.tag(), 5);
    }

    #[test]
    fn frames_are_sized_like_ethernet() {
        let r = |op, length| NetRequest {
            op,
            tag: 1,
            buf_offset: 0,
            length,
        };
        let i = info();
        assert!(validate(&r(NetOp::Transmit, 13), &i, 1 << 20).is_err());
        assert!(validate(&r(NetOp::Transmit, 14), &i, 1 << 20).is_ok());
        assert!(validate(&r(NetOp::Transmit, 1514), &i, 1 << 20).is_ok());
        assert!(validate(&r(NetOp::Transmit, 1515), &i, 1 << 20).is_err());
        assert_eq!(
            validate(&r(NetOp::Transmit, 1514), &i, 1000),
            Err(NetError::BadBuffer)
        );
        assert!(validate(&r(NetOp::Filter, 12), &i, 1 << 20).is_err());
        assert!(validate(&r(NetOp::Mode, 4), &i, 1 << 20).is_err());
        assert!(validate(&r(NetOp::Mode, PROMISCUOUS), &i, 1 << 20).is_ok());
        assert!(validate(&r(NetOp::Multicast, 7), &i, 1 << 20).is_err());
    }

    #[test]
    fn the_default_rule_reads_the_destination() {
        let mac = info().mac;
        let mut f = [0u8; 60];
        f[..6].copy_from_slice(&mac);
        assert_eq!(destination(&f, &mac), Destination::Own);
        f[..6].copy_from_slice(&[0xff; 6]);
        assert_eq!(destination(&f, &mac), Destination::Broadcast);
        f[..6].copy_from_slice(&[1, 0, 0x5e, 0, 0, 1]);
        assert_eq!(
            destination(&f, &mac),
            Destination::Multicast([1, 0, 0x5e, 0, 0, 1])
        );
        f[..6].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        assert_eq!(destination(&f, &mac), Destination::Other);
        assert_eq!(destination(&f[..5], &mac), Destination::Other);
    }

    proptest! {
        #[test]
        fn completions_round_trip(tag: u64, n: u32, code in -19i32..=-1) {
            let ok = NetCompletion { tag, result: Ok(n) };
            prop_assert_eq!(Cqe::encode(&ok).decode(), ok);
            let e = NetError::from_code(code);
            prop_assert_eq!(e.code(), code);
            let bad = Cqe::encode(&NetCompletion { tag, result: Err(e.clone()) }).decode();
            prop_assert_eq!(bad.result.unwrap_err().code(), code);
        }

        #[test]
        fn any_entry_decodes_or_is_refused_and_valid_ones_stay_in_the_buffer(
            bytes in proptest::collection::vec(any::<u8>(), 32), size in 0u64..1 << 33,
        ) {
            let e = Sqe(bytes.try_into().unwrap());
            if let Ok(r) = e.decode() {
                prop_assert_eq!(Sqe::encode(&r), e);
                if validate(&r, &info(), size).is_ok()
                    && matches!(r.op, NetOp::Transmit | NetOp::Receive | NetOp::Filter | NetOp::Multicast)
                {
                    prop_assert!(r.buf_offset + u64::from(r.length) <= size);
                }
            }
        }
    }
}

#[cfg(test)]
mod kind_names {
    use super::*;

    #[test]
    fn every_code_has_a_kind_name_and_no_name_is_left_over() {
        outboard_session::completion::check_kind_names::<NetError>(ERROR_KINDS).unwrap();
    }
}
