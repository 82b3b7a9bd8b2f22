//! The block class: requests, completions, status and errors — the contract between clients
//! and block drivers, whatever the placement.
//!
//! A request names a record (block) number, a block count and an offset in the client's buffer
//! area. On the wire (a session's rings) requests are 32-byte [`Sqe`]s and completions 16-byte
//! [`Cqe`]s, little-endian, layouts pinned by the tests below.

use outboard_session::completion::{Completion, WireError, COMPLETION_SIZE};
use outboard_session::RingShape;
use std::time::Duration;
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use serde::{Deserialize, Serialize};

/// The class's name, as sessions and personalities name it.
pub const CLASS: &str = "block";

/// What a block session keeps across a restart of its server: the ranges it held locked
/// (`Lock` acknowledged, no `Unlock` yet), as (first block, blocks).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kept {
    /// Locked ranges.
    pub locks: Vec<(u64, u32)>,
}

/// Block operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BlockOp {
    /// Read `blocks` blocks into the buffer.
    Read,
    /// Write `blocks` blocks from the buffer.
    Write,
    /// Make completed writes durable.
    Flush,
    /// Deallocate `blocks` blocks.
    Discard,
    /// Zero `blocks` blocks.
    WriteZeroes,
    /// Do nothing: measures the path to the driver and back.
    Null,
    /// Lock `blocks` blocks for this session's read-modify-write: completes once granted; until
    /// `Unlock`, other sessions' writes and locks that overlap the range wait. A session's locks
    /// end with it. Clients that write partial blocks use this, so that two of them sharing a
    /// block cannot each write back the other's stale copy.
    Lock,
    /// Release a lock taken with `Lock` (the same `lba` and `blocks`).
    Unlock,
}

impl BlockOp {
    /// Wire opcode.
    pub fn code(self) -> u8 {
        match self {
            BlockOp::Read => 1,
            BlockOp::Write => 2,
            BlockOp::Flush => 3,
            BlockOp::Discard => 4,
            BlockOp::WriteZeroes => 5,
            BlockOp::Null => 6,
            BlockOp::Lock => 7,
            BlockOp::Unlock => 8,
        }
    }
    /// Operation from a wire opcode.
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => BlockOp::Read,
            2 => BlockOp::Write,
            3 => BlockOp::Flush,
            4 => BlockOp::Discard,
            5 => BlockOp::WriteZeroes,
            6 => BlockOp::Null,
            7 => BlockOp::Lock,
            8 => BlockOp::Unlock,
            _ => return None,
        })
    }
    /// Whether the operation moves data through the buffer area.
    pub fn has_data(self) -> bool {
        matches!(self, BlockOp::Read | BlockOp::Write)
    }
    /// Whether whoever serves the session answers it itself, without the device.
    pub fn served_by_host(self) -> bool {
        matches!(self, BlockOp::Null | BlockOp::Lock | BlockOp::Unlock)
    }
    /// Whether the operation changes the disk.
    pub fn modifies(self) -> bool {
        matches!(
            self,
            BlockOp::Write | BlockOp::Discard | BlockOp::WriteZeroes
        )
    }
}

/// Why a block request failed. Specific, never a panic, never a silent truncation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum BlockError {
    /// The request is malformed (bad opcode, reserved fields set, zero length, …).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Blocks beyond the end of the disk.
    #[error("blocks beyond the end of the disk")]
    OutOfRange,
    /// The disk is read-only.
    #[error("the disk is read-only")]
    ReadOnly,
    /// The device reported an I/O error; the text is what it (or its driver) said.
    #[error("the device reported an I/O error: {0}")]
    Io(String),
    /// The device does not support the operation.
    #[error("the device does not support this operation")]
    Unsupported,
    /// The device or its driver is gone.
    #[error("the device is gone")]
    DeviceGone,
    /// The device failed and its driver is bringing it back: this request did not complete;
    /// retry later.
    #[error("the device is restarting; retry later")]
    Restarting,
    /// A request with the same tag is already in flight.
    #[error("a request with this tag is already in flight")]
    DuplicateTag,
    /// The buffer range lies outside the buffer area.
    #[error("the buffer lies outside the session's buffer area")]
    BadBuffer,
    /// No room to submit; reap completions first.
    #[error("the submission ring is full")]
    QueueFull,
    /// Waited too long: the client gave up waiting, or the device stalled past its deadline.
    #[error("timed out waiting for the device")]
    Timeout,
    /// The peer broke the session protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// No device by that name.
    #[error("no such device: {0}")]
    NoSuchDevice(String),
    /// The device or its driver failed and was given up; the message says why.
    #[error("device failed: {0}")]
    DeviceFailed(String),
    /// The device is in use by another client that holds it exclusively.
    #[error("device busy: {0}")]
    Busy(String),
    /// The manager (or server) that would answer is not running.
    #[error("not reachable: {0}")]
    Unreachable(String),
    /// This request crashed its driver (or device model) every time it was sent, as often as
    /// the restart policy allows (3): it is failed, alone, and not sent again.
    #[error("this request crashed the driver {QUARANTINE_AFTER} times; it is not sent again")]
    Quarantined,
    /// The driver server or the manager refused for a reason no other variant covers (the
    /// device is of another class, this user may not use it, a code this build does not
    /// know): its code travels with it, for a program to tell them apart.
    #[error("{reason}")]
    Refused {
        /// The refusal's code (`wrong-class`, `denied`, …).
        code: outboard_session::Code,
        /// Why, in words.
        reason: String,
    },
}

// Block replays; were a request failed instead, its outcome is unknown: an I/O error, as
// the kernel reports one.
outboard_session::from_refusal!(BlockError, |r| BlockError::Io(r.reason));

/// What becomes of the requests a dead server had not answered: sent again (reads, and
/// writes minus the blocks a later-acknowledged write covered: writing the same data twice
/// leaves the disk as writing it once).
pub const POLICY: outboard_session::control::Policy = outboard_session::control::Policy::Replay;

/// Crashes of a driver with the same request in its device after which that request is
/// failed instead of sent again ([`BlockError::Quarantined`]); the restart protocol's.
pub use outboard_session::control::QUARANTINE_AFTER;

/// Each error kind's name by its code (code `-k` at `k - 1`), for counters.
pub const ERROR_KINDS: &[&str] = &[
    "invalid",
    "out-of-range",
    "read-only",
    "io",
    "unsupported",
    "device-gone",
    "restarting",
    "duplicate-tag",
    "bad-buffer",
    "queue-full",
    "timeout",
    "protocol",
    "no-such-device",
    "device-failed",
    "busy",
    "unreachable",
    "quarantined",
    "refused",
];

impl BlockError {
    /// Wire status code (negative; 0 is success).
    pub fn code(&self) -> i32 {
        match self {
            BlockError::Invalid(_) => -1,
            BlockError::OutOfRange => -2,
            BlockError::ReadOnly => -3,
            BlockError::Io(_) => -4,
            BlockError::Unsupported => -5,
            BlockError::DeviceGone => -6,
            BlockError::Restarting => -7,
            BlockError::DuplicateTag => -8,
            BlockError::BadBuffer => -9,
            BlockError::QueueFull => -10,
            BlockError::Timeout => -11,
            BlockError::Protocol(_) => -12,
            BlockError::NoSuchDevice(_) => -13,
            BlockError::DeviceFailed(_) => -14,
            BlockError::Busy(_) => -15,
            BlockError::Unreachable(_) => -16,
            BlockError::Quarantined => -17,
            BlockError::Refused { .. } => -18,
        }
    }
    /// The words a code alone does not carry: what is sent beside a failed completion.
    pub fn reason(&self) -> Option<&str> {
        match self {
            BlockError::Invalid(s)
            | BlockError::Io(s)
            | BlockError::Protocol(s)
            | BlockError::NoSuchDevice(s)
            | BlockError::DeviceFailed(s)
            | BlockError::Busy(s)
            | BlockError::Unreachable(s)
            | BlockError::Refused { reason: s, .. } => Some(s),
            _ => None,
        }
    }

    /// Error from a wire status code alone (the generic words where the reason did not come).
    pub fn from_code(c: i32) -> Self {
        Self::from_wire(c, None)
    }
}

impl WireError for BlockError {
    fn code(&self) -> i32 {
        BlockError::code(self)
    }

    fn reason(&self) -> Option<&str> {
        BlockError::reason(self)
    }

    fn from_wire(c: i32, reason: Option<String>) -> Self {
        let words = |generic: &str| reason.clone().unwrap_or_else(|| generic.to_string());
        match c {
            -1 => BlockError::Invalid(words("rejected by the server")),
            -2 => BlockError::OutOfRange,
            -3 => BlockError::ReadOnly,
            -4 => BlockError::Io(words("no reason given")),
            -5 => BlockError::Unsupported,
            -6 => BlockError::DeviceGone,
            -7 => BlockError::Restarting,
            -8 => BlockError::DuplicateTag,
            -9 => BlockError::BadBuffer,
            -10 => BlockError::QueueFull,
            -11 => BlockError::Timeout,
            -12 => BlockError::Protocol(words("the server broke the protocol")),
            -13 => BlockError::NoSuchDevice(words("no such device")),
            -14 => BlockError::DeviceFailed(words("the driver gave the device up")),
            -15 => BlockError::Busy(words("in use")),
            -16 => BlockError::Unreachable(words("the server")),
            -17 => BlockError::Quarantined,
            // Only the control plane refuses with a code of its own; on the wire it is words.
            -18 => BlockError::Refused {
                code: outboard_session::Code::Unknown,
                reason: words("refused"),
            },
            c => BlockError::Protocol(format!("unknown status {c}")),
        }
    }
}

/// Status of a block device (Mach `get_status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockInfo {
    /// Device name.
    pub name: String,
    /// Capacity in blocks.
    pub capacity: u64,
    /// Block size in bytes.
    pub block_size: u32,
    /// Writes are refused.
    pub read_only: bool,
    /// Requests the driver keeps in flight.
    pub queue_depth: u32,
    /// Largest transfer of one request, in bytes (whole blocks); 0: no limit but the buffer
    /// area's.
    #[serde(default)]
    pub max_transfer: u32,
    /// The optional operations the device takes.
    #[serde(default)]
    pub supports: Supports,
}

/// Bytes `offset..end` of a disk, checked against its size once, where a caller asks for them
/// ([`BlockInfo::byte_range`]): the early error of a byte-level read, before anything (an
/// output file, say) is touched. The requests it becomes are checked again by the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    offset: u64,
    end: u64,
}

impl ByteRange {
    /// Where it starts.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// How many bytes.
    pub fn len(&self) -> u64 {
        self.end - self.offset
    }

    /// No bytes.
    pub fn is_empty(&self) -> bool {
        self.end == self.offset
    }
}

impl BlockInfo {
    /// Capacity in bytes.
    pub fn bytes(&self) -> u64 {
        self.capacity * u64::from(self.block_size)
    }

    /// `len` bytes from byte `offset`, if the disk has them ([`BlockError::OutOfRange`] if
    /// they run past its end).
    pub fn byte_range(&self, offset: u64, len: u64) -> Result<ByteRange, BlockError> {
        offset
            .checked_add(len)
            .filter(|&end| end <= self.bytes())
            .map(|end| ByteRange { offset, end })
            .ok_or(BlockError::OutOfRange)
    }
}

/// The optional operations of a block device (what its driver negotiated with it): a request
/// for one it does not take fails with [`BlockError::Unsupported`] at the server's check,
/// before it reaches the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Supports {
    /// Flush (the device has a write cache to flush).
    pub flush: bool,
    /// Discard.
    pub discard: bool,
    /// Write zeroes.
    pub write_zeroes: bool,
}

impl Default for Supports {
    /// Everything: a device that does not say otherwise (a null disk, a file) takes them all.
    fn default() -> Self {
        Self {
            flush: true,
            discard: true,
            write_zeroes: true,
        }
    }
}

impl Supports {
    /// Whether the device takes `op`.
    pub fn takes(&self, op: BlockOp) -> bool {
        match op {
            BlockOp::Flush => self.flush,
            BlockOp::Discard => self.discard,
            BlockOp::WriteZeroes => self.write_zeroes,
            _ => true,
        }
    }
}

/// One request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRequest {
    /// Operation.
    pub op: BlockOp,
    /// First block.
    pub lba: u64,
    /// Number of blocks.
    pub blocks: u32,
    /// Offset of the data in the buffer area (data operations).
    pub buf_offset: u64,
    /// The client's tag, returned in the completion; unique among requests in flight.
    pub tag: u64,
}

/// One completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockCompletion {
    /// The request's tag.
    pub tag: u64,
    /// Bytes transferred, or why it failed.
    pub result: Result<u32, BlockError>,
}

/// Checks a request against the device and the buffer area: the server's one check of a
/// client's request (the safety check; the driver below trusts it), and the client's early
/// one (the same rules, so that a bad request fails before it is sent).
pub fn validate(r: &BlockRequest, info: &BlockInfo, buffer_size: u64) -> Result<(), BlockError> {
    // A null request touches nothing and every device takes it: nothing below can refuse it.
    if r.op == BlockOp::Null {
        return Ok(());
    }
    if (r.op.modifies() || r.op == BlockOp::Lock) && info.read_only {
        return Err(BlockError::ReadOnly);
    }
    if !info.supports.takes(r.op) {
        return Err(BlockError::Unsupported);
    }
    if r.op == BlockOp::Flush {
        return Ok(());
    }
    if r.blocks == 0 {
        return Err(BlockError::Invalid("zero blocks".into()));
    }
    let end = r
        .lba
        .checked_add(r.blocks as u64)
        .ok_or(BlockError::OutOfRange)?;
    if end > info.capacity {
        return Err(BlockError::OutOfRange);
    }
    if r.op.has_data() {
        let len = r.blocks as u64 * info.block_size as u64;
        if info.max_transfer != 0 && len > info.max_transfer as u64 {
            return Err(BlockError::Invalid(format!(
                "{len} bytes in one request: the device takes at most {}",
                info.max_transfer
            )));
        }
        if r.buf_offset
            .checked_add(len)
            .is_none_or(|e| e > buffer_size)
        {
            return Err(BlockError::BadBuffer);
        }
    }
    Ok(())
}

/// Whether `fd` is readable (or hung up) within `timeout`.
pub fn readable(fd: std::os::fd::BorrowedFd<'_>, timeout: Duration) -> Result<bool, BlockError> {
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    let mut p = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    match rustix::event::poll(&mut p, Some(&ts)) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(BlockError::Protocol(format!("poll: {e}"))),
    }
}

/// Bytes per submission entry.
pub const SQE_SIZE: u32 = 32;
/// Bytes per completion entry.
pub const CQE_SIZE: u32 = COMPLETION_SIZE;

/// The block class's rings: ring 0 carries submissions to the server, ring 1 completions to
/// the client. A block session has exactly these; the server refuses any other shape.
pub const RINGS: [RingShape; 3] = RingShape::request_reply(SQE_SIZE, CQE_SIZE);

/// A submission entry's layout in the ring (little-endian, pinned by a test).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct SqeLayout {
    /// [`BlockOp`] code.
    pub op: u8,
    /// Must be zero.
    pub reserved: [u8; 7],
    /// The client's tag.
    pub tag: U64,
    /// First block.
    pub lba: U64,
    /// Number of blocks.
    pub blocks: U32,
    /// Offset of the data in the buffer area.
    pub buf_offset: U32,
}

/// A submission entry as it sits in the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; SQE_SIZE as usize]);

impl Sqe {
    /// Encodes a request. Buffer offsets fit in 32 bits: buffer areas are at most 1 GiB.
    pub fn encode(r: &BlockRequest) -> Self {
        let e = SqeLayout {
            op: r.op.code(),
            reserved: [0; 7],
            tag: r.tag.into(),
            lba: r.lba.into(),
            blocks: r.blocks.into(),
            buf_offset: (r.buf_offset as u32).into(),
        };
        Sqe(zerocopy::transmute!(e))
    }

    fn layout(&self) -> SqeLayout {
        zerocopy::transmute!(self.0)
    }

    /// The tag, readable even when the rest is garbage (to address the error completion).
    pub fn tag(&self) -> u64 {
        self.layout().tag.get()
    }

    /// Decodes untrusted bytes: unknown opcodes and non-zero reserved bytes are refused.
    pub fn decode(&self) -> Result<BlockRequest, BlockError> {
        let e = self.layout();
        let op = BlockOp::from_code(e.op)
            .ok_or_else(|| BlockError::Invalid(format!("unknown opcode {}", e.op)))?;
        if e.reserved != [0; 7] {
            return Err(BlockError::Invalid("reserved bytes are not zero".into()));
        }
        Ok(BlockRequest {
            op,
            tag: e.tag.get(),
            lba: e.lba.get(),
            blocks: e.blocks.get(),
            buf_offset: e.buf_offset.get() as u64,
        })
    }
}

/// A completion entry as it sits in the ring: the layout every request/reply class shares
/// ([`outboard_session::completion`]), the value being the bytes transferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe(pub [u8; CQE_SIZE as usize]);

impl Cqe {
    /// Encodes a completion.
    pub fn encode(c: &BlockCompletion) -> Self {
        Cqe(Completion::of(c.tag, &c.result).encode())
    }

    /// Decodes (without the reason, which the client's channel adds when it takes the entry).
    pub fn decode(&self) -> BlockCompletion {
        let c = Completion::decode(&self.0);
        BlockCompletion {
            tag: c.tag,
            result: c.result(None),
        }
    }
}

/// A block device, as any client sees it: asynchronous submit/complete plus a synchronous
/// convenience API. Implemented by the session client (driver in a server) and by the
/// colocated placement (driver in this process) alike.
pub trait BlockDevice {
    /// Status.
    fn info(&self) -> &BlockInfo;
    /// The buffer area requests refer to (zero copy: the device moves data to and from it).
    fn buffers(&self) -> &outboard_shm::SharedMem;
    /// Queues a request; [`BlockError::QueueFull`] when there is no room.
    fn submit(&mut self, r: &BlockRequest) -> Result<(), BlockError>;
    /// Makes submitted requests visible to the driver (batching: submit many, kick once).
    fn kick(&mut self) -> Result<(), BlockError>;
    /// Reaps completions without blocking.
    fn poll(&mut self, out: &mut Vec<BlockCompletion>) -> Result<usize, BlockError>;
    /// Waits up to `timeout` for at least one completion ([`BlockError::Timeout`] if none
    /// came); returns at once with 0 when nothing is in flight.
    fn wait(
        &mut self,
        out: &mut Vec<BlockCompletion>,
        timeout: Duration,
    ) -> Result<usize, BlockError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let n = self.poll(out)?;
            if n > 0 || self.in_flight() == 0 {
                return Ok(n);
            }
            if std::time::Instant::now() >= deadline {
                return Err(BlockError::Timeout);
            }
            self.block_until(deadline)?;
        }
    }
    /// Sleeps until something may have completed (a spurious return is fine: [`Self::wait`]
    /// polls again) or `deadline` passes: on the device's own doorbell, socket or ring.
    fn block_until(&mut self, deadline: std::time::Instant) -> Result<(), BlockError>;
    /// Requests submitted and not yet completed.
    fn in_flight(&self) -> usize;

    /// Waits until completions arrive (appended to `out`), `also` becomes readable, or
    /// `timeout` passes — for a client that serves a socket and a device from one thread.
    /// Returns whether `also` is readable. This default looks at `also` between waits of at
    /// most a millisecond; a client with its own doorbell waits on both at once.
    fn wait_or_readable(
        &mut self,
        out: &mut Vec<BlockCompletion>,
        timeout: Duration,
        also: std::os::fd::BorrowedFd<'_>,
    ) -> Result<bool, BlockError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let now = std::time::Instant::now();
            let slice = if self.in_flight() == 0 {
                deadline.saturating_duration_since(now)
            } else {
                Duration::ZERO
            };
            if readable(also, slice)? {
                return Ok(true);
            }
            if self.in_flight() == 0 || now >= deadline {
                return Ok(false);
            }
            let step = deadline
                .saturating_duration_since(now)
                .min(Duration::from_millis(1));
            match self.wait(out, step) {
                Ok(0) | Err(BlockError::Timeout) => {}
                Ok(_) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits until no request of the helpers below is in flight: one that timed out is
    /// still in the device, which may yet read the buffer area or write into it, so neither
    /// the next request nor the caller may touch the area before it is answered.
    fn settle(&mut self) -> Result<(), BlockError> {
        let mut out = Vec::with_capacity(1);
        while self.in_flight() != 0 {
            out.clear();
            self.wait(&mut out, Duration::from_secs(30))?;
            if out.iter().any(|c| c.tag != SYNC_TAG) {
                return Err(BlockError::Invalid(
                    "execute needs an idle device handle: asynchronous requests were in flight"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// Runs one request to completion (needs nothing else in flight).
    ///
    /// A synchronous call that failed (timed out, device gone) may leave its request in
    /// flight; the next call first waits for it, so it answers with the same error while the
    /// cause lasts (never "handle busy"), and recovers once the request completes.
    fn execute(&mut self, r: &BlockRequest) -> Result<u32, BlockError> {
        self.settle()?;
        let mut out = Vec::with_capacity(1);
        self.submit(r)?;
        self.kick()?;
        while out.is_empty() {
            self.wait(&mut out, Duration::from_secs(30))?;
        }
        let c = out.pop().expect("one completion");
        if c.tag != r.tag {
            return Err(BlockError::Protocol(format!(
                "completion for tag {} while waiting for {}",
                c.tag, r.tag
            )));
        }
        c.result
    }

    /// Reads whole blocks starting at `lba` into `data` (copied out of the buffer area).
    fn read_blocks(&mut self, lba: u64, data: &mut [u8]) -> Result<(), BlockError> {
        let (bs, chunk) = chunking(self.info(), self.buffers(), data.len())?;
        for (i, part) in data.chunks_mut(chunk).enumerate() {
            let at = lba + (i * chunk / bs) as u64;
            self.execute(&staged(BlockOp::Read, at, part.len() / bs))?;
            self.buffers()
                .read(0, part)
                .map_err(|e| BlockError::Protocol(e.to_string()))?;
        }
        Ok(())
    }

    /// Reads `range` of the disk (checked by [`BlockInfo::byte_range`]) and writes it to `fd`
    /// straight from the buffer area (the device put it there; this process copies nothing):
    /// what a tool that prints a disk's bytes wants. The range is read in whole blocks, as
    /// large as the buffer area and the device allow.
    fn read_out(
        &mut self,
        range: ByteRange,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<(), BlockError> {
        let info = self.info().clone();
        let bs = u64::from(info.block_size);
        let (offset, end) = (range.offset, range.end);
        let (_, chunk) = chunking(&info, self.buffers(), 0)?;
        let chunk = chunk as u64;
        let mut at = offset;
        while at < end {
            let first = at / bs;
            let skip = at - first * bs;
            let blocks = ((end - first * bs).min(chunk)).div_ceil(bs);
            self.execute(&staged(BlockOp::Read, first, blocks as usize))?;
            let n = (blocks * bs - skip).min(end - at);
            self.buffers()
                .write_out(skip, n as usize, fd)
                .map_err(|e| BlockError::Protocol(e.to_string()))?;
            at += n;
        }
        Ok(())
    }

    /// Writes whole blocks starting at `lba` from `data` (copied into the buffer area).
    fn write_blocks(&mut self, lba: u64, data: &[u8]) -> Result<(), BlockError> {
        let (bs, chunk) = chunking(self.info(), self.buffers(), data.len())?;
        for (i, part) in data.chunks(chunk).enumerate() {
            let at = lba + (i * chunk / bs) as u64;
            self.settle()?;
            self.buffers()
                .write(0, part)
                .map_err(|e| BlockError::Protocol(e.to_string()))?;
            self.execute(&staged(BlockOp::Write, at, part.len() / bs))?;
        }
        Ok(())
    }

    /// Locks blocks `lba..lba + blocks` against other sessions' writes (see [`BlockOp::Lock`]).
    fn lock_blocks(&mut self, lba: u64, blocks: u32) -> Result<(), BlockError> {
        self.execute(&BlockRequest {
            op: BlockOp::Lock,
            lba,
            blocks,
            buf_offset: 0,
            tag: SYNC_TAG,
        })
        .map(|_| ())
    }

    /// Releases a lock taken with [`BlockDevice::lock_blocks`].
    fn unlock_blocks(&mut self, lba: u64, blocks: u32) -> Result<(), BlockError> {
        self.execute(&BlockRequest {
            op: BlockOp::Unlock,
            lba,
            blocks,
            buf_offset: 0,
            tag: SYNC_TAG,
        })
        .map(|_| ())
    }

    /// Makes completed writes durable.
    fn flush(&mut self) -> Result<(), BlockError> {
        self.execute(&BlockRequest {
            op: BlockOp::Flush,
            lba: 0,
            blocks: 0,
            buf_offset: 0,
            tag: SYNC_TAG,
        })
        .map(|_| ())
    }
}

/// The tag of requests the synchronous API makes; asynchronous users pick any other.
pub const SYNC_TAG: u64 = u64::MAX;

/// Block size and the largest chunk (whole blocks, at most 1 MiB) the buffer area holds.
fn chunking(
    info: &BlockInfo,
    buffers: &outboard_shm::SharedMem,
    len: usize,
) -> Result<(usize, usize), BlockError> {
    let bs = info.block_size as usize;
    if !len.is_multiple_of(bs) {
        return Err(BlockError::Invalid(format!(
            "{len} bytes is not whole {bs}-byte blocks"
        )));
    }
    let limit = match info.max_transfer {
        0 => usize::MAX,
        m => m as usize,
    };
    let chunk = (buffers.len() / bs * bs).min(limit).min(1 << 20);
    if chunk == 0 {
        return Err(BlockError::BadBuffer);
    }
    Ok((bs, chunk))
}

/// A request whose data sits at the start of the buffer area.
fn staged(op: BlockOp, lba: u64, blocks: usize) -> BlockRequest {
    BlockRequest {
        op,
        lba,
        blocks: blocks as u32,
        buf_offset: 0,
        tag: SYNC_TAG,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info() -> BlockInfo {
        BlockInfo {
            name: "disk0".into(),
            capacity: 100,
            block_size: 512,
            read_only: false,
            queue_depth: 64,
            max_transfer: 0,
            supports: Default::default(),
        }
    }

    /// A device whose requests complete only at the second wait after their submission: the
    /// first wait of a synchronous helper times out with the request still in the device.
    struct Slow {
        info: BlockInfo,
        buffers: outboard_shm::SharedMem,
        pending: Option<(BlockRequest, u32)>,
        /// What each write carried when the device carried it out.
        carried: Vec<Vec<u8>>,
    }

    impl BlockDevice for Slow {
        fn info(&self) -> &BlockInfo {
            &self.info
        }
        fn buffers(&self) -> &outboard_shm::SharedMem {
            &self.buffers
        }
        fn submit(&mut self, r: &BlockRequest) -> Result<(), BlockError> {
            self.pending = Some((*r, 0));
            Ok(())
        }
        fn kick(&mut self) -> Result<(), BlockError> {
            Ok(())
        }
        fn poll(&mut self, _: &mut Vec<BlockCompletion>) -> Result<usize, BlockError> {
            Ok(0)
        }
        fn wait(
            &mut self,
            out: &mut Vec<BlockCompletion>,
            _: Duration,
        ) -> Result<usize, BlockError> {
            let Some((r, waits)) = self.pending.as_mut() else {
                return Ok(0);
            };
            *waits += 1;
            if *waits < 2 {
                return Err(BlockError::Timeout);
            }
            let mut data = vec![0u8; r.blocks as usize * 512];
            self.buffers.read(r.buf_offset, &mut data).unwrap();
            self.carried.push(data);
            out.push(BlockCompletion {
                tag: r.tag,
                result: Ok(r.blocks * 512),
            });
            self.pending = None;
            Ok(1)
        }
        fn block_until(&mut self, _: std::time::Instant) -> Result<(), BlockError> {
            Ok(())
        }
        fn in_flight(&self) -> usize {
            usize::from(self.pending.is_some())
        }
    }

    /// A write that timed out is still in the device: the next write's bytes wait until it
    /// is answered, so the device carries out each write with its own bytes.
    #[test]
    fn a_helper_write_never_overwrites_the_bytes_of_one_still_in_the_device() {
        let mut d = Slow {
            info: info(),
            buffers: outboard_shm::SharedMem::create("slow", 4096).unwrap(),
            pending: None,
            carried: Vec::new(),
        };
        let (first, second) = (vec![1u8; 512], vec![2u8; 512]);
        assert_eq!(d.write_blocks(0, &first), Err(BlockError::Timeout));
        assert_eq!(d.write_blocks(0, &second), Err(BlockError::Timeout));
        d.settle().unwrap();
        let firsts: Vec<u8> = d.carried.iter().map(|c| c[0]).collect();
        assert_eq!(firsts, [1, 2], "the bytes each write carried");
        assert!(d.carried == [first, second]);
    }

    #[test]
    fn entries_round_trip_and_layout_is_pinned() {
        let r = BlockRequest {
            op: BlockOp::Write,
            lba: 0x1122_3344_5566,
            blocks: 8,
            buf_offset: 0x4000,
            tag: 77,
        };
        let e = Sqe::encode(&r);
        assert_eq!(e.0[0], 2);
        assert_eq!(&e.0[8..16], &77u64.to_le_bytes());
        assert_eq!(e.decode().unwrap(), r);
        let c = BlockCompletion {
            tag: 5,
            result: Err(BlockError::OutOfRange),
        };
        assert_eq!(Cqe::encode(&c).decode(), c);
        let ok = BlockCompletion {
            tag: 6,
            result: Ok(4096),
        };
        assert_eq!(Cqe::encode(&ok).decode(), ok);
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<SqeLayout>(), SQE_SIZE as usize);
        assert_eq!(offset_of!(SqeLayout, tag), 8);
        assert_eq!(offset_of!(SqeLayout, lba), 16);
        assert_eq!(offset_of!(SqeLayout, blocks), 24);
        assert_eq!(offset_of!(SqeLayout, buf_offset), 28);
        assert_eq!(&e.0[16..24], &0x1122_3344_5566u64.to_le_bytes());
        assert_eq!(&e.0[28..32], &0x4000u32.to_le_bytes());
        assert_eq!(&Cqe::encode(&c).0[8..12], &(-2i32).to_le_bytes());
    }

    #[test]
    fn validation_is_specific() {
        let i = info();
        let r = |op, lba, blocks, buf_offset| BlockRequest {
            op,
            lba,
            blocks,
            buf_offset,
            tag: 0,
        };
        assert_eq!(
            validate(&r(BlockOp::Read, 99, 2, 0), &i, 4096),
            Err(BlockError::OutOfRange)
        );
        assert_eq!(
            validate(&r(BlockOp::Read, u64::MAX, 2, 0), &i, 4096),
            Err(BlockError::OutOfRange)
        );
        assert_eq!(
            validate(&r(BlockOp::Read, 0, 9, 0), &i, 4096),
            Err(BlockError::BadBuffer)
        );
        assert_eq!(
            validate(&r(BlockOp::Read, 0, 1, 4000), &i, 4096),
            Err(BlockError::BadBuffer)
        );
        assert!(matches!(
            validate(&r(BlockOp::Write, 0, 0, 0), &i, 4096),
            Err(BlockError::Invalid(_))
        ));
        assert!(validate(&r(BlockOp::Write, 0, 8, 0), &i, 4096).is_ok());
        let ro = BlockInfo {
            read_only: true,
            ..info()
        };
        assert_eq!(
            validate(&r(BlockOp::Write, 0, 1, 0), &ro, 4096),
            Err(BlockError::ReadOnly)
        );
        // An operation the device did not negotiate fails at the check, not in the driver.
        let plain = BlockInfo {
            supports: Supports {
                flush: false,
                discard: false,
                write_zeroes: true,
            },
            ..info()
        };
        for op in [BlockOp::Flush, BlockOp::Discard] {
            assert_eq!(
                validate(&r(op, 0, 1, 0), &plain, 4096),
                Err(BlockError::Unsupported)
            );
        }
        assert!(validate(&r(BlockOp::WriteZeroes, 0, 1, 0), &plain, 4096).is_ok());
        assert_eq!(
            validate(&r(BlockOp::Discard, 0, 1, 0), &ro, 4096),
            Err(BlockError::ReadOnly)
        );
    }

    proptest! {
        /// Any 32 bytes a client writes decode to a request or an error, and a decoded request
        /// either validates or gets a specific error; nothing panics.
        #[test]
        fn garbage_entries_never_panic(bytes in proptest::array::uniform32(any::<u8>())) {
            if let Ok(r) = Sqe(bytes).decode() {
                let _ = validate(&r, &info(), 1 << 20);
            }
            let _ = Cqe(bytes[..16].try_into().unwrap()).decode();
        }
    }
}

#[cfg(test)]
mod kind_names {
    use super::*;

    #[test]
    fn every_code_has_a_kind_name_and_no_name_is_left_over() {
        outboard_session::completion::check_kind_names::<BlockError>(ERROR_KINDS).unwrap();
    }
}
