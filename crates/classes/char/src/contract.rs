//! The char class's contract: requests, completions, the line record, status and errors. On
//! the wire (a session's rings) requests are 32-byte entries, completions 16 and line records
//! 32, little-endian, layouts pinned by the tests below.
//!
//! Rings: requests to the server; completions, their reasons ([`RingShape::request_reply`])
//! and line records to the client. Bytes move through the session's buffer area: a `WRITE`
//! names bytes the client put there, a `READ` the place the server puts what it read. A
//! `LINE` request's record is posted ahead of its completion.

use outboard_session::completion::{Completion, WireError, COMPLETION_SIZE};
use outboard_session::{Direction, RingShape};
use serde::{Deserialize, Serialize};
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The class's name, as sessions and personalities name it.
pub const CLASS: &str = "char";

/// What a client can get wrong and what can go wrong in the device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CharError {
    /// The request is malformed (an unknown operation, bytes outside the buffer area, line
    /// settings the device does not take).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The tag is already in flight in this session.
    #[error("the tag is already in flight")]
    DuplicateTag,
    /// No room for another request now.
    #[error("the queue is full")]
    QueueFull,
    /// The driver failed the request; the text says why.
    #[error("I/O error: {0}")]
    Io(String),
    /// The request got no answer in time (the device stopped sending).
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
    /// The driver died with this write in flight: some of its bytes may have been sent, and
    /// they are not sent again (a line's bytes must not be sent twice).
    #[error("interrupted: {0}")]
    Interrupted(String),
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
    "interrupted",
    "no-such-device",
    "busy",
    "unreachable",
    "protocol",
    "refused",
];

impl CharError {
    /// The code a completion carries (0 is success).
    pub fn code(&self) -> i32 {
        match self {
            CharError::Invalid(_) => -1,
            CharError::DuplicateTag => -2,
            CharError::QueueFull => -3,
            CharError::Io(_) => -4,
            CharError::Timeout => -5,
            CharError::Restarting => -6,
            CharError::DeviceFailed(_) => -7,
            CharError::DeviceGone => -8,
            CharError::Quarantined => -9,
            CharError::Interrupted(_) => -10,
            CharError::NoSuchDevice(_) => -11,
            CharError::Busy(_) => -12,
            CharError::Unreachable(_) => -13,
            CharError::Protocol(_) => -14,
            CharError::Refused { .. } => -15,
        }
    }

    /// The words a code alone does not carry.
    pub fn reason(&self) -> Option<&str> {
        match self {
            CharError::Invalid(s)
            | CharError::Io(s)
            | CharError::DeviceFailed(s)
            | CharError::Interrupted(s)
            | CharError::NoSuchDevice(s)
            | CharError::Busy(s)
            | CharError::Unreachable(s)
            | CharError::Protocol(s)
            | CharError::Refused { reason: s, .. } => Some(s),
            _ => None,
        }
    }
}

impl WireError for CharError {
    fn code(&self) -> i32 {
        CharError::code(self)
    }

    fn reason(&self) -> Option<&str> {
        CharError::reason(self)
    }

    fn from_wire(c: i32, reason: Option<String>) -> Self {
        let words = |generic: &str| reason.clone().unwrap_or_else(|| generic.to_string());
        match c {
            -1 => CharError::Invalid(words("refused by the server")),
            -2 => CharError::DuplicateTag,
            -3 => CharError::QueueFull,
            -4 => CharError::Io(words("no reason given")),
            -5 => CharError::Timeout,
            -6 => CharError::Restarting,
            -7 => CharError::DeviceFailed(words("the driver gave the device up")),
            -8 => CharError::DeviceGone,
            -9 => CharError::Quarantined,
            -10 => CharError::Interrupted(words("the driver restarted")),
            -11 => CharError::NoSuchDevice(words("no such device")),
            -12 => CharError::Busy(words("busy")),
            -13 => CharError::Unreachable(words("unreachable")),
            -14 => CharError::Protocol(words("the server broke the protocol")),
            -15 => CharError::Refused {
                code: outboard_session::Code::Unknown,
                reason: words("refused"),
            },
            c => CharError::Protocol(format!("unknown completion code {c}")),
        }
    }
}

/// What becomes of a request a dead server had not answered: it fails as interrupted. A
/// line's bytes must not be sent twice, so a write is never replayed; the client sends its
/// reads and line requests again itself (they are safe to repeat).
pub const POLICY: outboard_session::control::Policy = outboard_session::control::Policy::Fail;

outboard_session::from_refusal!(CharError, |r| CharError::Interrupted(r.reason));

/// Parity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Parity {
    /// No parity bit.
    #[default]
    None,
    /// Odd parity.
    Odd,
    /// Even parity.
    Even,
    /// The parity bit always 1.
    Mark,
    /// The parity bit always 0.
    Space,
}

/// Flow control.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Flow {
    /// None: bytes the driver has no room for are dropped (and counted).
    #[default]
    None,
    /// Hardware: the driver drops RTS when it has no room, and sends only while CTS is on.
    RtsCts,
}

/// A line's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineSettings {
    /// Bits per second.
    pub baud: u32,
    /// Data bits: 5 to 8.
    pub data_bits: u8,
    /// Parity.
    pub parity: Parity,
    /// Stop bits: 1 or 2.
    pub stop_bits: u8,
    /// Flow control.
    pub flow: Flow,
}

impl Default for LineSettings {
    fn default() -> Self {
        Self {
            baud: 115_200,
            data_bits: 8,
            parity: Parity::None,
            stop_bits: 1,
            flow: Flow::None,
        }
    }
}

impl std::fmt::Display for LineSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = match self.parity {
            Parity::None => 'N',
            Parity::Odd => 'O',
            Parity::Even => 'E',
            Parity::Mark => 'M',
            Parity::Space => 'S',
        };
        let flow = match self.flow {
            Flow::None => "no flow control",
            Flow::RtsCts => "RTS/CTS",
        };
        write!(
            f,
            "{} baud {}{}{}, {flow}",
            self.baud, self.data_bits, p, self.stop_bits
        )
    }
}

impl std::str::FromStr for LineSettings {
    type Err = String;

    /// `BAUD[,FRAME][,FLOW]`: e.g. `9600`, `115200,8N1`, `19200,7E2,rtscts`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: String| format!("{s:?}: {why} (e.g. 115200, 9600,8N1, 19200,7E2,rtscts)");
        let mut l = LineSettings::default();
        let mut parts = s.split(',');
        l.baud = parts
            .next()
            .and_then(|b| b.parse().ok())
            .filter(|b| *b > 0)
            .ok_or_else(|| bad("the rate is not a number of bits per second".into()))?;
        for p in parts {
            match p.to_ascii_lowercase().as_str() {
                "rtscts" | "rts-cts" | "crtscts" => l.flow = Flow::RtsCts,
                "none" | "noflow" => l.flow = Flow::None,
                f if f.len() == 3 => {
                    let b = f.as_bytes();
                    l.data_bits = (b[0] as char)
                        .to_digit(10)
                        .filter(|d| (5..=8).contains(d))
                        .ok_or_else(|| bad(format!("{p:?}: data bits are 5 to 8")))?
                        as u8;
                    l.parity = match b[1] {
                        b'n' => Parity::None,
                        b'o' => Parity::Odd,
                        b'e' => Parity::Even,
                        b'm' => Parity::Mark,
                        b's' => Parity::Space,
                        _ => return Err(bad(format!("{p:?}: parity is N, O, E, M or S"))),
                    };
                    l.stop_bits = match b[2] {
                        b'1' => 1,
                        b'2' => 2,
                        _ => return Err(bad(format!("{p:?}: stop bits are 1 or 2"))),
                    };
                }
                _ => return Err(bad(format!("{p:?} is neither a frame nor a flow control"))),
            }
        }
        Ok(l)
    }
}

/// Checks line settings against the device (its fastest rate): the client's early error and
/// the server's safety check. Whether the device makes the rate exactly is the driver's call.
pub fn validate_line(l: &LineSettings, info: &CharInfo) -> Result<(), CharError> {
    if l.baud == 0 || l.baud > info.max_baud {
        return Err(CharError::Invalid(format!(
            "{} baud: the device takes 1 to {}",
            l.baud, info.max_baud
        )));
    }
    if !(5..=8).contains(&l.data_bits) {
        return Err(CharError::Invalid(format!(
            "{} data bits: 5 to 8",
            l.data_bits
        )));
    }
    if !(1..=2).contains(&l.stop_bits) {
        return Err(CharError::Invalid(format!(
            "{} stop bits: 1 or 2",
            l.stop_bits
        )));
    }
    Ok(())
}

/// The class status a client gets when it opens the device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CharInfo {
    /// Class device name.
    pub name: String,
    /// The fastest rate the device makes.
    pub max_baud: u32,
    /// Bytes in the device's transmit and receive FIFOs.
    pub fifo: u32,
}

/// Modem lines, as a line record carries them.
pub mod modem {
    /// Clear to send.
    pub const CTS: u8 = 1 << 0;
    /// Data set ready.
    pub const DSR: u8 = 1 << 1;
    /// Ring indicator.
    pub const RI: u8 = 1 << 2;
    /// Data carrier detect.
    pub const DCD: u8 = 1 << 3;
}

/// What the line has done since the driver started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineCounters {
    /// Bytes the device has sent.
    pub sent: u64,
    /// Bytes the device has received.
    pub received: u64,
    /// Received bytes the driver had no room for (no flow control), dropped.
    pub dropped: u32,
    /// Bytes the device lost to a full receive FIFO.
    pub overruns: u32,
    /// Parity and framing errors and breaks the device reported.
    pub errors: u32,
    /// The modem lines ([`modem`] bits).
    pub modem: u8,
}

/// A line record: the settings and what the line has done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineStatus {
    /// The settings.
    pub line: LineSettings,
    /// The counters.
    pub counters: LineCounters,
}

/// What a request asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CharOp {
    /// Send `len` bytes from `offset` of the buffer area; completes once the device has sent
    /// them all, with `len`.
    Write {
        /// Where they are.
        offset: u64,
        /// How many (at least 1).
        len: u32,
    },
    /// Receive at most `len` bytes into `offset` of the buffer area; completes as soon as at
    /// least one has arrived (it may wait for ever), with how many.
    Read {
        /// Where they go.
        offset: u64,
        /// At most this many (at least 1).
        len: u32,
    },
    /// Post a line record.
    Line,
    /// Apply these settings.
    SetLine(LineSettings),
}

/// A request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CharRequest {
    /// The client's tag, returned in the completion.
    pub tag: u64,
    /// What it asks.
    pub op: CharOp,
}

/// A completion: bytes written or read (0 for line requests), or why it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharCompletion {
    /// The request's tag.
    pub tag: u64,
    /// The value, or the error.
    pub result: Result<u32, CharError>,
}

/// Checks a request against the device and the session's buffer area: the client's early
/// error and the server's safety check are this one function.
pub fn validate(r: &CharRequest, info: &CharInfo, buffer: u64) -> Result<(), CharError> {
    match r.op {
        CharOp::Write { offset, len } | CharOp::Read { offset, len } => {
            if len == 0 {
                return Err(CharError::Invalid("a transfer of 0 bytes".into()));
            }
            if offset
                .checked_add(u64::from(len))
                .is_none_or(|end| end > buffer)
            {
                return Err(CharError::Invalid(format!(
                    "{len} bytes at {offset} lie outside the {buffer}-byte buffer area"
                )));
            }
            Ok(())
        }
        CharOp::Line => Ok(()),
        CharOp::SetLine(l) => validate_line(&l, info),
    }
}

/// Bytes of a request entry.
pub const SQE_SIZE: u32 = 32;
/// Bytes of a completion entry.
pub const CQE_SIZE: u32 = COMPLETION_SIZE;
/// Bytes of a line record.
pub const LINE_SIZE: u32 = 32;

/// The request ring among the rings to the server.
pub const REQUESTS: usize = 0;
/// The completion ring among the rings to the client.
pub const COMPLETIONS: usize = RingShape::COMPLETIONS;
/// The line record ring among the rings to the client.
pub const LINES: usize = 2;

const REPLY: [RingShape; 3] = RingShape::request_reply(SQE_SIZE, CQE_SIZE);

/// The class's rings: requests; completions, reasons and line records.
pub const RINGS: [RingShape; 4] = [
    REPLY[0],
    REPLY[1],
    REPLY[2],
    RingShape {
        direction: Direction::ToClient,
        entry_size: LINE_SIZE,
    },
];

/// Operation codes in a request entry.
pub mod op {
    /// Send bytes.
    pub const WRITE: u32 = 1;
    /// Receive bytes.
    pub const READ: u32 = 2;
    /// Post a line record.
    pub const LINE: u32 = 3;
    /// Apply line settings (in the entry's `line` field).
    pub const SET_LINE: u32 = 4;
}

/// Line settings packed in 8 bytes: rate, data bits, parity (0 none, 1 odd, 2 even, 3 mark,
/// 4 space), stop bits, flow (0 none, 1 RTS/CTS).
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct LineLayout {
    /// Bits per second.
    pub baud: U32,
    /// Data bits.
    pub data_bits: u8,
    /// Parity code.
    pub parity: u8,
    /// Stop bits.
    pub stop_bits: u8,
    /// Flow code.
    pub flow: u8,
}

impl LineLayout {
    /// Packs settings.
    pub fn of(l: &LineSettings) -> Self {
        Self {
            baud: l.baud.into(),
            data_bits: l.data_bits,
            parity: match l.parity {
                Parity::None => 0,
                Parity::Odd => 1,
                Parity::Even => 2,
                Parity::Mark => 3,
                Parity::Space => 4,
            },
            stop_bits: l.stop_bits,
            flow: match l.flow {
                Flow::None => 0,
                Flow::RtsCts => 1,
            },
        }
    }

    /// Unpacks settings, or says which code is unknown.
    pub fn settings(&self) -> Result<LineSettings, CharError> {
        let parity = match self.parity {
            0 => Parity::None,
            1 => Parity::Odd,
            2 => Parity::Even,
            3 => Parity::Mark,
            4 => Parity::Space,
            p => return Err(CharError::Invalid(format!("unknown parity code {p}"))),
        };
        let flow = match self.flow {
            0 => Flow::None,
            1 => Flow::RtsCts,
            f => return Err(CharError::Invalid(format!("unknown flow control code {f}"))),
        };
        Ok(LineSettings {
            baud: self.baud.get(),
            data_bits: self.data_bits,
            parity,
            stop_bits: self.stop_bits,
            flow,
        })
    }
}

/// A request entry as it sits in the ring.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct SqeLayout {
    /// Tag.
    pub tag: U64,
    /// Operation ([`op`]).
    pub op: U32,
    /// Bytes (`WRITE`, `READ`).
    pub len: U32,
    /// Where in the buffer area (`WRITE`, `READ`).
    pub offset: U64,
    /// Settings (`SET_LINE`).
    pub line: LineLayout,
}

/// A request entry's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; SQE_SIZE as usize]);

impl Sqe {
    /// Encodes a request.
    pub fn encode(r: &CharRequest) -> Self {
        let (op, len, offset, line) = match r.op {
            CharOp::Write { offset, len } => (op::WRITE, len, offset, LineLayout::default()),
            CharOp::Read { offset, len } => (op::READ, len, offset, LineLayout::default()),
            CharOp::Line => (op::LINE, 0, 0, LineLayout::default()),
            CharOp::SetLine(l) => (op::SET_LINE, 0, 0, LineLayout::of(&l)),
        };
        let l = SqeLayout {
            tag: r.tag.into(),
            op: op.into(),
            len: len.into(),
            offset: offset.into(),
            line,
        };
        let mut e = [0u8; SQE_SIZE as usize];
        e.copy_from_slice(l.as_bytes());
        Self(e)
    }

    /// Decodes a request: its tag, and the request or why it is not one.
    pub fn decode(&self) -> (u64, Result<CharRequest, CharError>) {
        let l = SqeLayout::read_from_bytes(&self.0).expect("32 bytes");
        let tag = l.tag.get();
        let (len, offset) = (l.len.get(), l.offset.get());
        let op = match l.op.get() {
            op::WRITE => Ok(CharOp::Write { offset, len }),
            op::READ => Ok(CharOp::Read { offset, len }),
            op::LINE => Ok(CharOp::Line),
            op::SET_LINE => l.line.settings().map(CharOp::SetLine),
            o => Err(CharError::Invalid(format!("unknown operation {o}"))),
        };
        (tag, op.map(|op| CharRequest { tag, op }))
    }
}

/// A completion entry's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe(pub [u8; CQE_SIZE as usize]);

impl Cqe {
    /// Encodes a completion (the layout every request/reply class shares).
    pub fn encode(c: &CharCompletion) -> Self {
        Self(Completion::of(c.tag, &c.result).encode())
    }

    /// Decodes a completion (without the reason, which the client's channel adds).
    pub fn decode(&self) -> CharCompletion {
        let c = Completion::decode(&self.0);
        CharCompletion {
            tag: c.tag,
            result: c.result(None),
        }
    }
}

/// A line record as it sits in its ring.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct LineRecordLayout {
    /// The `LINE` request's tag.
    pub tag: U64,
    /// Settings.
    pub line: LineLayout,
    /// Bytes sent, modulo 2^32.
    pub sent: U32,
    /// Bytes received, modulo 2^32.
    pub received: U32,
    /// Bytes dropped.
    pub dropped: U32,
    /// Overruns, errors and modem lines.
    pub tail: LineTail,
}

/// Overruns and errors, 16 bits each (saturating), and the modem lines.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct LineTail {
    /// Overruns.
    pub overruns: zerocopy::little_endian::U16,
    /// Errors (upper byte) and modem lines (lower byte).
    pub errors_modem: zerocopy::little_endian::U16,
}

/// Encodes the line record answering request `tag`.
pub fn encode_line(tag: u64, s: &LineStatus) -> [u8; LINE_SIZE as usize] {
    let c = &s.counters;
    let sat8 = |v: u32| v.min(255) as u16;
    let l = LineRecordLayout {
        tag: tag.into(),
        line: LineLayout::of(&s.line),
        sent: (c.sent as u32).into(),
        received: (c.received as u32).into(),
        dropped: c.dropped.into(),
        tail: LineTail {
            overruns: (c.overruns.min(u32::from(u16::MAX)) as u16).into(),
            errors_modem: ((sat8(c.errors) << 8) | u16::from(c.modem)).into(),
        },
    };
    let mut e = [0u8; LINE_SIZE as usize];
    e.copy_from_slice(l.as_bytes());
    e
}

/// Decodes a line record: the tag it answers and the status (sent and received modulo 2^32,
/// overruns to 65,535 and errors to 255).
pub fn decode_line(e: &[u8; LINE_SIZE as usize]) -> (u64, Result<LineStatus, CharError>) {
    let l = LineRecordLayout::read_from_bytes(e).expect("32 bytes");
    let em = l.tail.errors_modem.get();
    let status = l.line.settings().map(|line| LineStatus {
        line,
        counters: LineCounters {
            sent: u64::from(l.sent.get()),
            received: u64::from(l.received.get()),
            dropped: l.dropped.get(),
            overruns: u32::from(l.tail.overruns.get()),
            errors: u32::from(em >> 8),
            modem: em as u8,
        },
    });
    (l.tag.get(), status)
}

/// What a client uses.
pub trait CharDevice {
    /// Class status.
    fn info(&self) -> &CharInfo;
    /// Sends all of `bytes`; returns once the device has sent them.
    fn write(&mut self, bytes: &[u8]) -> Result<(), CharError>;
    /// Receives at most `buf.len()` bytes: waits until at least one has arrived, or until
    /// `timeout` passes (then `Ok(0)`; the read stays posted for the next call).
    fn read(
        &mut self,
        buf: &mut [u8],
        timeout: Option<std::time::Duration>,
    ) -> Result<usize, CharError>;
    /// The line's settings and counters.
    fn line(&mut self) -> Result<LineStatus, CharError>;
    /// Applies line settings.
    fn set_line(&mut self, line: &LineSettings) -> Result<(), CharError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info() -> CharInfo {
        CharInfo {
            name: "tty0".into(),
            max_baud: 115_200,
            fifo: 16,
        }
    }

    #[test]
    fn entries_have_the_documented_layout() {
        let e = Sqe::encode(&CharRequest {
            tag: 0x0102_0304_0506_0708,
            op: CharOp::Write {
                offset: 4096,
                len: 10,
            },
        });
        assert_eq!(&e.0[..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&e.0[8..12], &op::WRITE.to_le_bytes());
        assert_eq!(&e.0[12..16], &10u32.to_le_bytes());
        assert_eq!(&e.0[16..24], &4096u64.to_le_bytes());
        let e = Sqe::encode(&CharRequest {
            tag: 1,
            op: CharOp::SetLine("9600,7E2,rtscts".parse().unwrap()),
        });
        assert_eq!(&e.0[24..28], &9600u32.to_le_bytes());
        assert_eq!(&e.0[28..], &[7, 2, 2, 1]);
        let s = LineStatus {
            line: LineSettings::default(),
            counters: LineCounters {
                sent: 5,
                received: 6,
                dropped: 7,
                overruns: 8,
                errors: 9,
                modem: modem::CTS | modem::DCD,
            },
        };
        let r = encode_line(3, &s);
        assert_eq!(&r[..8], &3u64.to_le_bytes());
        assert_eq!(&r[8..12], &115_200u32.to_le_bytes());
        assert_eq!(&r[16..20], &5u32.to_le_bytes());
        assert_eq!(&r[28..30], &8u16.to_le_bytes());
        assert_eq!(r[30], modem::CTS | modem::DCD);
        assert_eq!(r[31], 9);
        assert_eq!(decode_line(&r), (3, Ok(s)));
    }

    #[test]
    fn bad_entries_and_settings_are_refused_with_their_tag() {
        let mut e = Sqe::encode(&CharRequest {
            tag: 3,
            op: CharOp::SetLine(LineSettings::default()),
        });
        e.0[29] = 9;
        assert!(matches!(e.decode(), (3, Err(CharError::Invalid(w))) if w.contains("parity")));
        e.0[8] = 77;
        assert!(matches!(e.decode(), (3, Err(CharError::Invalid(w))) if w.contains("unknown")));
        let r = |op| CharRequest { tag: 1, op };
        let e = validate(&r(CharOp::Read { offset: 60, len: 8 }), &info(), 64).unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
        let e = validate(
            &r(CharOp::Write {
                offset: u64::MAX,
                len: 2,
            }),
            &info(),
            64,
        )
        .unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
        assert!(validate(&r(CharOp::Read { offset: 0, len: 0 }), &info(), 64).is_err());
        let fast = LineSettings {
            baud: 230_400,
            ..LineSettings::default()
        };
        let e = validate(&r(CharOp::SetLine(fast)), &info(), 64).unwrap_err();
        assert!(e.to_string().contains("1 to 115200"), "{e}");
    }

    #[test]
    fn settings_parse_as_a_user_writes_them_and_print_back() {
        let l: LineSettings = "19200,7E2,rtscts".parse().unwrap();
        assert_eq!(l.to_string(), "19200 baud 7E2, RTS/CTS");
        assert_eq!(
            "9600".parse::<LineSettings>().unwrap().to_string(),
            "9600 baud 8N1, no flow control"
        );
        for bad in ["", "fast", "9600,9N1", "9600,8X1", "9600,8N3", "9600,xon"] {
            let e = bad.parse::<LineSettings>().unwrap_err();
            assert!(e.contains("e.g."), "{bad}: {e}");
        }
    }

    #[test]
    fn every_code_has_a_kind_name_and_no_name_is_left_over() {
        outboard_session::completion::check_kind_names::<CharError>(ERROR_KINDS).unwrap();
    }

    proptest! {
        #[test]
        fn requests_round_trip(tag: u64, offset: u64, len: u32, which in 0u8..4, baud: u32, d in 5u8..=8, p in 0u8..5, s in 1u8..=2, f in 0u8..2) {
            let line = LineLayout { baud: baud.into(), data_bits: d, parity: p, stop_bits: s, flow: f }.settings().unwrap();
            let op = match which {
                0 => CharOp::Write { offset, len },
                1 => CharOp::Read { offset, len },
                2 => CharOp::Line,
                _ => CharOp::SetLine(line),
            };
            let r = CharRequest { tag, op };
            prop_assert_eq!(Sqe::encode(&r).decode().1.unwrap(), r);
        }

        #[test]
        fn any_entry_decodes_to_a_request_or_an_error(bytes: [u8; 32]) {
            let (_, r) = Sqe(bytes).decode();
            if let Ok(r) = r {
                if validate(&r, &info(), 4096).is_ok() {
                    if let CharOp::Read { offset, len } | CharOp::Write { offset, len } = r.op {
                        prop_assert!(len > 0 && offset + u64::from(len) <= 4096);
                    }
                }
            }
        }
    }
}
