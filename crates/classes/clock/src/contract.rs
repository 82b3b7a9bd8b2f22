//! The clock class's contract: requests, completions, the time record, status and errors. On
//! the wire (a session's rings) requests and completions are 16-byte entries and time records
//! 32-byte entries, little-endian, layouts pinned by the tests below.
//!
//! Rings: requests to the server; completions, their reasons ([`RingShape::request_reply`])
//! and time records to the client. A `NOW` request's time record is posted ahead of its
//! completion, so a client that sees the completion finds the record already there.

use outboard_session::completion::{Completion, WireError, COMPLETION_SIZE};
use outboard_session::{Direction, RingShape};
use serde::{Deserialize, Serialize};
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The class's name, as sessions and personalities name it.
pub const CLASS: &str = "clock";

/// What a client can get wrong and what can go wrong in the device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClockError {
    /// The request is malformed (an unknown operation, a wait for 0 ticks or for more than
    /// the device takes).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The tag is already in flight in this session.
    #[error("the tag is already in flight")]
    DuplicateTag,
    /// No room for another request now.
    #[error("the queue is full")]
    QueueFull,
    /// The driver could not read the time; the text says why.
    #[error("the clock could not be read: {0}")]
    Io(String),
    /// The request got no answer in time (the device stopped ticking).
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
    /// The driver server or the manager refused for a reason no other variant covers.
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
];

impl ClockError {
    /// The code a completion carries (0 is success).
    pub fn code(&self) -> i32 {
        match self {
            ClockError::Invalid(_) => -1,
            ClockError::DuplicateTag => -2,
            ClockError::QueueFull => -3,
            ClockError::Io(_) => -4,
            ClockError::Timeout => -5,
            ClockError::Restarting => -6,
            ClockError::DeviceFailed(_) => -7,
            ClockError::DeviceGone => -8,
            ClockError::Quarantined => -9,
            ClockError::NoSuchDevice(_) => -10,
            ClockError::Busy(_) => -11,
            ClockError::Unreachable(_) => -12,
            ClockError::Protocol(_) => -13,
            ClockError::Refused { .. } => -14,
        }
    }

    /// The words a code alone does not carry.
    pub fn reason(&self) -> Option<&str> {
        match self {
            ClockError::Invalid(s)
            | ClockError::Io(s)
            | ClockError::DeviceFailed(s)
            | ClockError::NoSuchDevice(s)
            | ClockError::Busy(s)
            | ClockError::Unreachable(s)
            | ClockError::Protocol(s)
            | ClockError::Refused { reason: s, .. } => Some(s),
            _ => None,
        }
    }
}

impl WireError for ClockError {
    fn code(&self) -> i32 {
        ClockError::code(self)
    }

    fn reason(&self) -> Option<&str> {
        ClockError::reason(self)
    }

    fn from_wire(c: i32, reason: Option<String>) -> Self {
        let words = |generic: &str| reason.clone().unwrap_or_else(|| generic.to_string());
        match c {
            -1 => ClockError::Invalid(words("refused by the server")),
            -2 => ClockError::DuplicateTag,
            -3 => ClockError::QueueFull,
            -4 => ClockError::Io(words("no reason given")),
            -5 => ClockError::Timeout,
            -6 => ClockError::Restarting,
            -7 => ClockError::DeviceFailed(words("the driver gave the device up")),
            -8 => ClockError::DeviceGone,
            -9 => ClockError::Quarantined,
            -10 => ClockError::NoSuchDevice(words("no such device")),
            -11 => ClockError::Busy(words("busy")),
            -12 => ClockError::Unreachable(words("unreachable")),
            -13 => ClockError::Protocol(words("the server broke the protocol")),
            -14 => ClockError::Refused {
                code: outboard_session::Code::Unknown,
                reason: words("refused"),
            },
            c => ClockError::Protocol(format!("unknown completion code {c}")),
        }
    }
}

/// What becomes of a request a dead server had not answered: sent again (a wait waits its
/// ticks on the new driver; the time is read again). Ticks are counted, not replayed.
pub const POLICY: outboard_session::control::Policy = outboard_session::control::Policy::Replay;

// A request a dead server may have carried out (the class replays; a failed one is an
// unknown outcome).
outboard_session::from_refusal!(ClockError, |r| ClockError::Io(r.reason));

/// The class status a client gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClockInfo {
    /// Class device name.
    pub name: String,
    /// Ticks per second.
    pub hz: u32,
    /// Most ticks one wait may ask for.
    pub max_wait: u32,
}

/// The time as the clock tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockTime {
    /// Ticks since the driver started.
    pub ticks: u64,
    /// The device's own counter, in nanoseconds; it runs on through a driver restart.
    pub device_ns: u64,
    /// Ticks per second.
    pub hz: u32,
    /// Interrupts the driver has handled since it started, modulo 2^32 (fewer than ticks when
    /// one interrupt brought several).
    pub interrupts: u32,
}

/// What a request asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockOp {
    /// Complete after this many ticks.
    Wait(u32),
    /// Post the time now.
    Now,
}

/// A request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockRequest {
    /// The client's tag, returned in the completion.
    pub tag: u64,
    /// What it asks.
    pub op: ClockOp,
}

/// A completion: for a wait, the ticks that passed while it waited; for `NOW`, 0 (the time is
/// on the time ring); or why it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClockCompletion {
    /// The request's tag.
    pub tag: u64,
    /// The value, or the error.
    pub result: Result<u32, ClockError>,
}

/// Checks a request against the device: the client's early error and the server's safety
/// check are this one function.
pub fn validate(r: &ClockRequest, info: &ClockInfo) -> Result<(), ClockError> {
    match r.op {
        ClockOp::Wait(0) => Err(ClockError::Invalid("a wait for 0 ticks".into())),
        ClockOp::Wait(n) if n > info.max_wait => Err(ClockError::Invalid(format!(
            "a wait for {n} ticks is longer than the device takes ({})",
            info.max_wait
        ))),
        _ => Ok(()),
    }
}

/// Bytes of a request entry.
pub const SQE_SIZE: u32 = 16;
/// Bytes of a completion entry.
pub const CQE_SIZE: u32 = COMPLETION_SIZE;
/// Bytes of a time record.
pub const TIME_SIZE: u32 = 32;

/// The request ring among the rings to the server.
pub const REQUESTS: usize = 0;
/// The completion ring among the rings to the client.
pub const COMPLETIONS: usize = RingShape::COMPLETIONS;
/// The time ring among the rings to the client.
pub const TIMES: usize = 2;

const REPLY: [RingShape; 3] = RingShape::request_reply(SQE_SIZE, CQE_SIZE);

/// The class's rings: requests; completions, reasons and time records.
pub const RINGS: [RingShape; 4] = [
    REPLY[0],
    REPLY[1],
    REPLY[2],
    RingShape {
        direction: Direction::ToClient,
        entry_size: TIME_SIZE,
    },
];

/// Operation codes in a request entry.
pub mod op {
    /// Wait for `arg` ticks.
    pub const WAIT: u32 = 1;
    /// Post the time now (`arg` must be 0).
    pub const NOW: u32 = 2;
}

/// A request entry as it sits in the ring.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct SqeLayout {
    /// Tag.
    pub tag: U64,
    /// Operation ([`op`]).
    pub op: U32,
    /// Its argument.
    pub arg: U32,
}

/// A request entry's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; SQE_SIZE as usize]);

impl Sqe {
    /// Encodes a request.
    pub fn encode(r: &ClockRequest) -> Self {
        let (op, arg) = match r.op {
            ClockOp::Wait(n) => (op::WAIT, n),
            ClockOp::Now => (op::NOW, 0),
        };
        let l = SqeLayout {
            tag: r.tag.into(),
            op: op.into(),
            arg: arg.into(),
        };
        let mut e = [0u8; SQE_SIZE as usize];
        e.copy_from_slice(l.as_bytes());
        Self(e)
    }

    /// Decodes a request: its tag, and the request or why it is not one (the tag is always
    /// there to answer with).
    pub fn decode(&self) -> (u64, Result<ClockRequest, ClockError>) {
        let l = SqeLayout::read_from_bytes(&self.0).expect("16 bytes");
        let tag = l.tag.get();
        let op = match (l.op.get(), l.arg.get()) {
            (op::WAIT, n) => Ok(ClockOp::Wait(n)),
            (op::NOW, 0) => Ok(ClockOp::Now),
            (op::NOW, a) => Err(ClockError::Invalid(format!(
                "a time request with an argument ({a})"
            ))),
            (o, _) => Err(ClockError::Invalid(format!("unknown operation {o}"))),
        };
        (tag, op.map(|op| ClockRequest { tag, op }))
    }
}

/// A completion entry's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe(pub [u8; CQE_SIZE as usize]);

impl Cqe {
    /// Encodes a completion (the layout every request/reply class shares).
    pub fn encode(c: &ClockCompletion) -> Self {
        Self(Completion::of(c.tag, &c.result).encode())
    }

    /// Decodes a completion (without the reason, which the client's channel adds).
    pub fn decode(&self) -> ClockCompletion {
        let c = Completion::decode(&self.0);
        ClockCompletion {
            tag: c.tag,
            result: c.result(None),
        }
    }
}

/// A time record as it sits in the time ring.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct TimeLayout {
    /// The `NOW` request's tag.
    pub tag: U64,
    /// Ticks.
    pub ticks: U64,
    /// The device's nanoseconds.
    pub device_ns: U64,
    /// Ticks per second.
    pub hz: U32,
    /// Interrupts handled, modulo 2^32.
    pub interrupts: U32,
}

/// Encodes the time record answering request `tag`.
pub fn encode_time(tag: u64, t: &ClockTime) -> [u8; TIME_SIZE as usize] {
    let l = TimeLayout {
        tag: tag.into(),
        ticks: t.ticks.into(),
        device_ns: t.device_ns.into(),
        hz: t.hz.into(),
        interrupts: t.interrupts.into(),
    };
    let mut e = [0u8; TIME_SIZE as usize];
    e.copy_from_slice(l.as_bytes());
    e
}

/// Decodes a time record: the tag it answers and the time.
pub fn decode_time(e: &[u8; TIME_SIZE as usize]) -> (u64, ClockTime) {
    let l = TimeLayout::read_from_bytes(e).expect("32 bytes");
    (
        l.tag.get(),
        ClockTime {
            ticks: l.ticks.get(),
            device_ns: l.device_ns.get(),
            hz: l.hz.get(),
            interrupts: l.interrupts.get(),
        },
    )
}

/// What a client uses.
pub trait ClockDevice {
    /// Class status.
    fn info(&self) -> &ClockInfo;
    /// Waits for `ticks` ticks; returns how many passed (at least `ticks`).
    fn wait(&mut self, ticks: u32) -> Result<u32, ClockError>;
    /// The time now.
    fn now(&mut self) -> Result<ClockTime, ClockError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn entries_have_the_documented_layout() {
        let e = Sqe::encode(&ClockRequest {
            tag: 0x0102_0304_0506_0708,
            op: ClockOp::Wait(10),
        });
        assert_eq!(&e.0[..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&e.0[8..12], &op::WAIT.to_le_bytes());
        assert_eq!(&e.0[12..], &10u32.to_le_bytes());
        let t = encode_time(
            5,
            &ClockTime {
                ticks: 7,
                device_ns: 9,
                hz: 1000,
                interrupts: 3,
            },
        );
        assert_eq!(&t[..8], &5u64.to_le_bytes());
        assert_eq!(&t[8..16], &7u64.to_le_bytes());
        assert_eq!(&t[16..24], &9u64.to_le_bytes());
        assert_eq!(&t[24..28], &1000u32.to_le_bytes());
        assert_eq!(&t[28..], &3u32.to_le_bytes());
        let c = Cqe::encode(&ClockCompletion {
            tag: 9,
            result: Err(ClockError::Restarting),
        });
        assert_eq!(&c.0[8..12], &(-6i32).to_le_bytes());
    }

    #[test]
    fn unknown_operations_and_stray_arguments_are_refused_with_their_tag() {
        let mut e = Sqe::encode(&ClockRequest {
            tag: 3,
            op: ClockOp::Now,
        });
        e.0[12] = 1;
        assert!(matches!(e.decode(), (3, Err(ClockError::Invalid(_)))));
        e.0[8] = 9;
        assert!(matches!(e.decode(), (3, Err(ClockError::Invalid(w))) if w.contains("unknown")));
    }

    #[test]
    fn every_code_has_a_kind_name_and_no_name_is_left_over() {
        outboard_session::completion::check_kind_names::<ClockError>(ERROR_KINDS).unwrap();
    }

    proptest! {
        #[test]
        fn requests_and_times_round_trip(tag: u64, n: u32, now: bool, ticks: u64, ns: u64, hz: u32, irqs: u32) {
            let r = ClockRequest { tag, op: if now { ClockOp::Now } else { ClockOp::Wait(n) } };
            prop_assert_eq!(Sqe::encode(&r).decode().1.unwrap(), r);
            let t = ClockTime { ticks, device_ns: ns, hz, interrupts: irqs };
            prop_assert_eq!(decode_time(&encode_time(tag, &t)), (tag, t));
        }

        #[test]
        fn any_entry_decodes_to_a_request_or_an_error(bytes: [u8; 16]) {
            let (_, r) = Sqe(bytes).decode();
            if let Ok(r) = r {
                let info = ClockInfo { name: "c".into(), hz: 100, max_wait: 1000 };
                if validate(&r, &info).is_ok() {
                    if let ClockOp::Wait(n) = r.op {
                        prop_assert!((1..=1000).contains(&n));
                    }
                }
            }
        }
    }
}
