//! The entropy class's contract: requests, completions, status and errors, whatever the
//! placement. On the wire (a session's rings) requests and completions are 16-byte entries,
//! little-endian, layouts pinned by the tests below.

use outboard_session::completion::{Completion, WireError, COMPLETION_SIZE};
use outboard_session::RingShape;
use serde::{Deserialize, Serialize};
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The class's name, as sessions and personalities name it.
pub const CLASS: &str = "entropy";

/// What a client can get wrong and what can go wrong in the device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntropyError {
    /// The request is malformed (a length of 0, more than the device takes at once).
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
    /// The device returned no bytes, or its driver could not complete the request; the text
    /// says which.
    #[error("the device returned no random bytes: {0}")]
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
];

impl EntropyError {
    /// The code a completion carries (0 is success).
    pub fn code(&self) -> i32 {
        match self {
            EntropyError::Invalid(_) => -1,
            EntropyError::BadBuffer => -2,
            EntropyError::DuplicateTag => -3,
            EntropyError::QueueFull => -4,
            EntropyError::Io(_) => -5,
            EntropyError::Timeout => -6,
            EntropyError::Restarting => -7,
            EntropyError::DeviceFailed(_) => -8,
            EntropyError::DeviceGone => -9,
            EntropyError::Quarantined => -10,
            EntropyError::NoSuchDevice(_) => -11,
            EntropyError::Busy(_) => -12,
            EntropyError::Unreachable(_) => -13,
            EntropyError::Protocol(_) => -14,
            EntropyError::Refused { .. } => -15,
        }
    }

    /// The words a code alone does not carry: what is sent beside a failed completion.
    pub fn reason(&self) -> Option<&str> {
        match self {
            EntropyError::Invalid(s)
            | EntropyError::Io(s)
            | EntropyError::DeviceFailed(s)
            | EntropyError::NoSuchDevice(s)
            | EntropyError::Busy(s)
            | EntropyError::Unreachable(s)
            | EntropyError::Protocol(s)
            | EntropyError::Refused { reason: s, .. } => Some(s),
            _ => None,
        }
    }

    /// The error a completion's code stands for, with the generic words.
    pub fn from_code(c: i32) -> Self {
        Self::from_wire(c, None)
    }
}

impl WireError for EntropyError {
    fn code(&self) -> i32 {
        EntropyError::code(self)
    }

    fn reason(&self) -> Option<&str> {
        EntropyError::reason(self)
    }

    fn from_wire(c: i32, reason: Option<String>) -> Self {
        let words = |generic: &str| reason.clone().unwrap_or_else(|| generic.to_string());
        match c {
            -1 => EntropyError::Invalid(words("refused by the server")),
            -2 => EntropyError::BadBuffer,
            -3 => EntropyError::DuplicateTag,
            -4 => EntropyError::QueueFull,
            -5 => EntropyError::Io(words("no reason given")),
            -6 => EntropyError::Timeout,
            -7 => EntropyError::Restarting,
            -8 => EntropyError::DeviceFailed(words("the driver gave the device up")),
            -9 => EntropyError::DeviceGone,
            -10 => EntropyError::Quarantined,
            -11 => EntropyError::NoSuchDevice(words("no such device")),
            -12 => EntropyError::Busy(words("busy")),
            -13 => EntropyError::Unreachable(words("unreachable")),
            -14 => EntropyError::Protocol(words("the server broke the protocol")),
            // Only the control plane refuses with a code of its own; on the wire it is words.
            -15 => EntropyError::Refused {
                code: outboard_session::Code::Unknown,
                reason: words("refused"),
            },
            c => EntropyError::Protocol(format!("unknown completion code {c}")),
        }
    }
}

/// What becomes of a request a dead server had not answered: sent again (random bytes asked
/// twice are random bytes).
pub const POLICY: outboard_session::control::Policy = outboard_session::control::Policy::Replay;

// A request a dead server may have carried out: random bytes may not have been written.
outboard_session::from_refusal!(EntropyError, |r| EntropyError::Io(r.reason));

/// The class status a client gets: what the device is and the most it gives at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntropyInfo {
    /// Class device name.
    pub name: String,
    /// Most bytes one request may ask for.
    pub max_read: u32,
    /// Most requests in the device at once.
    pub queue_depth: u32,
}

/// A request: `length` random bytes into the buffer area at `buf_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntropyRequest {
    /// The client's tag, returned in the completion.
    pub tag: u64,
    /// Where in the buffer area.
    pub buf_offset: u32,
    /// How many bytes (1 to [`EntropyInfo::max_read`]).
    pub length: u32,
}

/// A completion: the bytes written (at least one), or why none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntropyCompletion {
    /// The request's tag.
    pub tag: u64,
    /// Bytes written, or the error.
    pub result: Result<u32, EntropyError>,
}

/// Checks a request against the device and the buffer area: the client's early error and the
/// server's safety check are this one function.
pub fn validate(
    r: &EntropyRequest,
    info: &EntropyInfo,
    buffer_size: u64,
) -> Result<(), EntropyError> {
    if r.length == 0 {
        return Err(EntropyError::Invalid("a request for 0 bytes".into()));
    }
    if r.length > info.max_read {
        return Err(EntropyError::Invalid(format!(
            "{} bytes is more than the device gives at once ({})",
            r.length, info.max_read
        )));
    }
    if u64::from(r.buf_offset) + u64::from(r.length) > buffer_size {
        return Err(EntropyError::BadBuffer);
    }
    Ok(())
}

/// Bytes of a request entry.
pub const SQE_SIZE: u32 = 16;
/// Bytes of a completion entry.
pub const CQE_SIZE: u32 = COMPLETION_SIZE;

/// The class's rings: requests to the server, completions to the client.
pub const RINGS: [RingShape; 3] = RingShape::request_reply(SQE_SIZE, CQE_SIZE);

/// A request entry as it sits in the ring.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct SqeLayout {
    /// Tag.
    pub tag: U64,
    /// Offset in the buffer area.
    pub buf_offset: U32,
    /// Bytes asked for.
    pub length: U32,
}

/// A request entry's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; SQE_SIZE as usize]);

impl Sqe {
    /// Encodes a request.
    pub fn encode(r: &EntropyRequest) -> Self {
        let l = SqeLayout {
            tag: r.tag.into(),
            buf_offset: r.buf_offset.into(),
            length: r.length.into(),
        };
        let mut e = [0u8; SQE_SIZE as usize];
        e.copy_from_slice(l.as_bytes());
        Self(e)
    }

    /// Decodes a request (every bit pattern is a request; [`validate`] judges it).
    pub fn decode(&self) -> EntropyRequest {
        let l = SqeLayout::read_from_bytes(&self.0).expect("16 bytes");
        EntropyRequest {
            tag: l.tag.get(),
            buf_offset: l.buf_offset.get(),
            length: l.length.get(),
        }
    }
}

/// A completion entry's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe(pub [u8; CQE_SIZE as usize]);

impl Cqe {
    /// Encodes a completion (the layout every request/reply class shares,
    /// [`outboard_session::completion`]; the value is the bytes written).
    pub fn encode(c: &EntropyCompletion) -> Self {
        Self(Completion::of(c.tag, &c.result).encode())
    }

    /// Decodes a completion (without the reason, which the client's channel adds).
    pub fn decode(&self) -> EntropyCompletion {
        let c = Completion::decode(&self.0);
        EntropyCompletion {
            tag: c.tag,
            result: no_bytes_is_an_error(c.result(None)),
        }
    }
}

/// A success of 0 bytes is the device's error, not a success.
pub fn no_bytes_is_an_error(r: Result<u32, EntropyError>) -> Result<u32, EntropyError> {
    match r {
        Ok(0) => Err(EntropyError::Io("the device wrote 0 bytes".into())),
        r => r,
    }
}

/// What a client uses, whatever the placement.
pub trait EntropyDevice {
    /// Class status.
    fn info(&self) -> &EntropyInfo;
    /// Fills `out` with random bytes from the device (as many requests as it takes).
    fn read(&mut self, out: &mut [u8]) -> Result<(), EntropyError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn entries_have_the_documented_layout() {
        let e = Sqe::encode(&EntropyRequest {
            tag: 0x0102_0304_0506_0708,
            buf_offset: 0x1000,
            length: 64,
        });
        assert_eq!(&e.0[..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&e.0[8..12], &0x1000u32.to_le_bytes());
        assert_eq!(&e.0[12..], &64u32.to_le_bytes());
        let c = Cqe::encode(&EntropyCompletion {
            tag: 9,
            result: Err(EntropyError::Restarting),
        });
        assert_eq!(&c.0[8..12], &(-7i32).to_le_bytes());
    }

    proptest! {
        #[test]
        fn completions_round_trip(tag: u64, n in 1u32.., code in -14i32..=-1) {
            let ok = EntropyCompletion { tag, result: Ok(n) };
            prop_assert_eq!(Cqe::encode(&ok).decode(), ok);
            let e = EntropyError::from_code(code);
            prop_assert_eq!(e.code(), code);
            let bad = Cqe::encode(&EntropyCompletion { tag, result: Err(e.clone()) }).decode();
            prop_assert_eq!(bad.result.unwrap_err().code(), code);
        }

        #[test]
        fn validation_keeps_requests_inside_the_buffer_area(
            off: u32, len: u32, size in 0u64..1 << 33, max in 1u32..1 << 20,
        ) {
            let info = EntropyInfo { name: "rng0".into(), max_read: max, queue_depth: 8 };
            let r = EntropyRequest { tag: 1, buf_offset: off, length: len };
            if validate(&r, &info, size).is_ok() {
                prop_assert!(len >= 1 && len <= max);
                prop_assert!(u64::from(off) + u64::from(len) <= size);
            }
        }
    }
}

#[cfg(test)]
mod kind_names {
    use super::*;

    #[test]
    fn every_code_has_a_kind_name_and_no_name_is_left_over() {
        outboard_session::completion::check_kind_names::<EntropyError>(ERROR_KINDS).unwrap();
    }
}
