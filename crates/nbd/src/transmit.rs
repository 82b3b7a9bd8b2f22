//! The transmission phase of one connection: NBD requests in, block requests to the device,
//! replies out — pipelined, and replied to in completion order (NBD matches replies to requests
//! by cookie).
//!
//! On a plain socket, data moves between the socket and the session's buffer area with no copy
//! in user space: a write's payload is read from the socket straight into the piece of the
//! buffer area the device will read, and a read's data is written to the socket straight from
//! where the device put it ([`Transport`]; over TLS, rustls decrypts and encrypts in between).
//!
//! Every request is checked before it reaches the device: command, flags, alignment to the
//! block size, bounds, length. A bad one gets the protocol's error and the connection goes
//! on; a write's payload is read and dropped first so the stream stays in step. A stream that
//! is not NBD (bad magic) or a write too large to skip ends this connection only.

use std::collections::HashMap;
use std::time::Duration;

use outboard_block::{BlockCompletion, BlockDevice, BlockError, BlockOp, BlockRequest};
use outboard_client::{Buffer, BufferPool};

use crate::negotiate::Export;
use crate::proto::{self, chunk, cmd, cmd_flags, errno, Request};
use crate::transport::Transport;
use crate::NbdError;

/// Largest write payload skipped (read and dropped) to answer an error and stay in step; a
/// longer one ends the connection.
const MAX_SKIP: u32 = 64 << 20;
/// How long a connection waits for its device before declaring it stuck.
const DEVICE_WAIT: Duration = Duration::from_secs(60);

/// Counters of one connection.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ConnStats {
    /// Requests answered successfully.
    pub ok: u64,
    /// Requests answered with an error.
    pub errors: u64,
    /// Payload bytes read from the client and data bytes sent to it.
    pub bytes: u64,
}

/// What a request is doing in the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Its own operation.
    Main,
    /// The flush that makes a FUA request durable before its reply.
    Flush,
}

#[derive(Debug)]
struct Pending {
    req: Request,
    buf: Option<Buffer>,
    stage: Stage,
    /// A write-zeroes request already fell back to writing a buffer of zeroes.
    wrote_zeroes: bool,
}

/// The NBD error number for a block error; `write` tells a write past the end (ENOSPC) from
/// another request past the end (EINVAL).
pub fn errno_of(e: &BlockError, write: bool) -> u32 {
    match e {
        BlockError::OutOfRange if write => errno::ENOSPC,
        BlockError::OutOfRange | BlockError::Invalid(_) | BlockError::BadBuffer => errno::EINVAL,
        BlockError::ReadOnly => errno::EPERM,
        BlockError::Unsupported => errno::ENOTSUP,
        _ => errno::EIO,
    }
}

/// Where a connection's request buffers come from: its own session's whole area, or a share
/// of a session several connections use ([`crate::hub`]).
pub trait Buffers {
    /// Takes `len` bytes; `None` if there is no room now (a completion, of this connection
    /// or another, gives some back).
    fn alloc(&mut self, len: u64) -> Option<Buffer>;
    /// Gives a piece back.
    fn free(&mut self, b: Buffer);
}

impl Buffers for BufferPool {
    fn alloc(&mut self, len: u64) -> Option<Buffer> {
        BufferPool::alloc(self, len)
    }
    fn free(&mut self, b: Buffer) {
        BufferPool::free(self, b);
    }
}

/// One connection in transmission.
pub struct Conn<'a, S> {
    sock: S,
    dev: &'a mut dyn BlockDevice,
    export: &'a Export,
    structured: bool,
    pool: Box<dyn Buffers + 'a>,
    pending: HashMap<u64, Pending>,
    next_tag: u64,
    depth: usize,
    /// A request read but waiting for a buffer (nothing more is read meanwhile).
    stalled: Option<Request>,
    completions: Vec<BlockCompletion>,
    stats: ConnStats,
}

impl<'a, S: Transport> Conn<'a, S> {
    /// A connection on `sock` serving `export` from `dev`, a session of its own (its whole
    /// buffer area is this connection's).
    pub fn new(
        sock: S,
        dev: &'a mut dyn BlockDevice,
        export: &'a Export,
        structured: bool,
    ) -> Self {
        let area = dev.buffers().len() as u64;
        let align = (dev.info().block_size as u64).max(4096);
        Self::with_buffers(
            sock,
            dev,
            export,
            structured,
            Box::new(BufferPool::new(area, align)),
        )
    }

    /// A connection whose buffers come from `pool` (a session shared with others).
    pub fn with_buffers(
        sock: S,
        dev: &'a mut dyn BlockDevice,
        export: &'a Export,
        structured: bool,
        pool: Box<dyn Buffers + 'a>,
    ) -> Self {
        let depth = (dev.info().queue_depth as usize).clamp(1, 64);
        Self {
            sock,
            dev,
            export,
            structured,
            pool,
            pending: HashMap::new(),
            next_tag: 1,
            depth,
            stalled: None,
            completions: Vec::with_capacity(depth),
            stats: ConnStats::default(),
        }
    }

    /// Serves until the client disconnects (`NBD_CMD_DISC` or end of stream) and everything it
    /// sent is answered.
    pub fn run(mut self) -> Result<ConnStats, NbdError> {
        let mut closing = false;
        loop {
            // Take what the client sent, as long as there is room.
            while !closing && self.stalled.is_none() && self.pending.len() < self.depth {
                if !self.pending.is_empty() && !self.sock.ready() {
                    break;
                }
                match self.read_request()? {
                    Some(r) => {
                        if self.start(r)? {
                            closing = true;
                        }
                    }
                    None => closing = true,
                }
            }
            self.dev.kick().map_err(NbdError::Device)?;
            if self.pending.is_empty() && self.stalled.is_none() {
                if closing {
                    return Ok(self.stats);
                }
                continue;
            }
            self.completions.clear();
            if self
                .dev
                .poll(&mut self.completions)
                .map_err(NbdError::Device)?
                == 0
            {
                let may_read =
                    !closing && self.stalled.is_none() && self.pending.len() < self.depth;
                if may_read && self.sock.buffered() {
                    // Requests already decrypted: take them before waiting on anything.
                } else if may_read {
                    self.dev
                        .wait_or_readable(&mut self.completions, DEVICE_WAIT, self.sock.fd())
                        .map_err(NbdError::Device)?;
                } else {
                    self.dev
                        .wait(&mut self.completions, DEVICE_WAIT)
                        .map_err(NbdError::Device)?;
                }
            }
            let done = std::mem::take(&mut self.completions);
            for c in &done {
                self.finish(c)?;
            }
            self.completions = done;
            if let Some(r) = self.stalled.take() {
                self.start(r)?;
            }
        }
    }

    /// Reads one request header; `None` at a clean end of stream.
    fn read_request(&mut self) -> Result<Option<Request>, NbdError> {
        let mut b = [0u8; Request::SIZE];
        match self.sock.read_exact(&mut b) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(NbdError::Io(e.to_string())),
        }
        Request::parse(&b)
            .map(Some)
            .map_err(|e| NbdError::Protocol(e.to_string()))
    }

    /// Checks a request and sends it to the device, or answers it at once. True when the
    /// client asked to disconnect.
    fn start(&mut self, r: Request) -> Result<bool, NbdError> {
        let e = self.export;
        let bs = e.block_size as u64;
        let known_flags =
            cmd_flags::FUA | cmd_flags::NO_HOLE | cmd_flags::DF | cmd_flags::FAST_ZERO;
        let in_bounds = r
            .offset
            .checked_add(r.length as u64)
            .is_some_and(|end| end <= e.size);
        let aligned = r.offset.is_multiple_of(bs) && (r.length as u64).is_multiple_of(bs);
        let check = |writes: bool| -> Result<(), (u32, String)> {
            if r.flags & !known_flags != 0 {
                return Err((
                    errno::EINVAL,
                    format!("unknown command flags {:#x}", r.flags),
                ));
            }
            if writes && e.read_only {
                return Err((errno::EPERM, "the export is read-only".into()));
            }
            if r.length == 0 {
                return Err((errno::EINVAL, "a request of zero bytes".into()));
            }
            if !in_bounds {
                let code = if writes { errno::ENOSPC } else { errno::EINVAL };
                return Err((
                    code,
                    format!("{}+{} lies past the end ({})", r.offset, r.length, e.size),
                ));
            }
            if !aligned {
                return Err((
                    errno::EINVAL,
                    format!(
                        "{}+{} is not aligned to the {bs}-byte block",
                        r.offset, r.length
                    ),
                ));
            }
            Ok(())
        };
        let refused = match r.command {
            cmd::DISC => return Ok(true),
            cmd::READ | cmd::WRITE => check(r.command == cmd::WRITE).and_then(|()| {
                if r.length > e.max_payload {
                    Err((
                        errno::EINVAL,
                        format!(
                            "{} bytes is more than the {}-byte maximum",
                            r.length, e.max_payload
                        ),
                    ))
                } else {
                    Ok(())
                }
            }),
            cmd::TRIM | cmd::WRITE_ZEROES => check(true),
            cmd::CACHE => check(false),
            cmd::FLUSH => Ok(()),
            other => Err((errno::EINVAL, format!("unknown command {other}"))),
        };
        if let Err((code, why)) = refused {
            // The answer goes first: a payload too long to skip then ends the connection.
            self.reply_error(r.cookie, code, &why)?;
            if r.command == cmd::WRITE {
                self.skip_payload(r.length)?;
            }
            return Ok(false);
        }
        // Prefetching has nothing to do: the export keeps no cache of its own.
        if r.command == cmd::CACHE {
            return self.reply_ok(&r, None).map(|()| false);
        }
        let buf = if matches!(r.command, cmd::READ | cmd::WRITE) {
            match self.pool.alloc(r.length as u64) {
                Some(b) => Some(b),
                None => {
                    // Back-pressure: wait for a completion to give a buffer back.
                    self.stalled = Some(r);
                    return Ok(false);
                }
            }
        } else {
            None
        };
        if let (cmd::WRITE, Some(b)) = (r.command, buf) {
            self.read_payload(b, r.length)?;
        }
        let op = match r.command {
            cmd::READ => BlockOp::Read,
            cmd::WRITE => BlockOp::Write,
            cmd::FLUSH => BlockOp::Flush,
            cmd::TRIM => BlockOp::Discard,
            _ => BlockOp::WriteZeroes,
        };
        self.submit(
            Pending {
                req: r,
                buf,
                stage: Stage::Main,
                wrote_zeroes: false,
            },
            op,
        )?;
        Ok(false)
    }

    /// Sends a pending request's next operation to the device.
    fn submit(&mut self, p: Pending, op: BlockOp) -> Result<(), NbdError> {
        let bs = self.export.block_size as u64;
        let (lba, blocks) = match op {
            BlockOp::Flush => (0, 0),
            _ => (p.req.offset / bs, (p.req.length as u64 / bs) as u32),
        };
        let tag = self.next_tag;
        self.next_tag += 1;
        let r = BlockRequest {
            op,
            lba,
            blocks,
            buf_offset: p.buf.map_or(0, |b| b.offset),
            tag,
        };
        match self.dev.submit(&r) {
            Ok(()) => {
                self.pending.insert(tag, p);
                Ok(())
            }
            Err(e) => {
                let write = op.modifies();
                self.release(&p);
                self.reply_error(p.req.cookie, errno_of(&e, write), &e.to_string())
            }
        }
    }

    /// A request's operation completed.
    fn finish(&mut self, c: &BlockCompletion) -> Result<(), NbdError> {
        let Some(mut p) = self.pending.remove(&c.tag) else {
            return Err(NbdError::Protocol(format!(
                "the device completed tag {} it was never given",
                c.tag
            )));
        };
        let command = p.req.command;
        match &c.result {
            Ok(_) => {
                let durable = p.req.flags & cmd_flags::FUA == 0 || command == cmd::READ;
                if p.stage == Stage::Main && !durable {
                    p.stage = Stage::Flush;
                    return self.submit(p, BlockOp::Flush);
                }
                self.reply_ok(&p.req, p.buf)?;
                self.release(&p);
                Ok(())
            }
            // Trimming is advisory: a device that cannot discard has done all it must.
            Err(BlockError::Unsupported) if command == cmd::TRIM && p.stage == Stage::Main => {
                self.reply_ok(&p.req, None)
            }
            // A device without write-zeroes gets a buffer of zeroes written instead — unless
            // the client asked for a fast zero, which must fail rather than be slow.
            Err(BlockError::Unsupported)
                if command == cmd::WRITE_ZEROES
                    && p.stage == Stage::Main
                    && !p.wrote_zeroes
                    && p.req.flags & cmd_flags::FAST_ZERO == 0
                    && p.req.length <= self.export.max_payload =>
            {
                let Some(b) = self.pool.alloc(p.req.length as u64) else {
                    return self.reply_error(p.req.cookie, errno::ENOMEM, "no buffer for zeroes");
                };
                self.dev
                    .buffers()
                    .fill(b.offset, p.req.length as usize, 0)
                    .map_err(|e| NbdError::Io(e.to_string()))?;
                p.buf = Some(b);
                p.wrote_zeroes = true;
                self.submit(p, BlockOp::Write)
            }
            Err(e) => {
                let write = command != cmd::READ;
                self.release(&p);
                self.reply_error(p.req.cookie, errno_of(e, write), &e.to_string())
            }
        }
    }

    fn release(&mut self, p: &Pending) {
        if let Some(b) = p.buf {
            self.pool.free(b);
        }
    }

    /// Reads a write's payload into its buffer, straight from the socket.
    fn read_payload(&mut self, b: Buffer, len: u32) -> Result<(), NbdError> {
        let mut done = 0usize;
        while done < len as usize {
            let n = self
                .sock
                .recv_into(
                    self.dev.buffers(),
                    b.offset + done as u64,
                    len as usize - done,
                )
                .map_err(|e| NbdError::Io(e.to_string()))?;
            if n == 0 {
                return Err(NbdError::Io(
                    "the client left in the middle of a write".into(),
                ));
            }
            done += n;
        }
        self.stats.bytes += len as u64;
        Ok(())
    }

    /// Reads and drops a refused write's payload, so the next request is read in step.
    fn skip_payload(&mut self, len: u32) -> Result<(), NbdError> {
        if len > MAX_SKIP {
            return Err(NbdError::Protocol(format!(
                "a write of {len} bytes: too long to skip, closing"
            )));
        }
        let mut left = len as usize;
        let mut sink = [0u8; 64 << 10];
        while left > 0 {
            let n = self
                .sock
                .read(&mut sink[..left.min(64 << 10)])
                .map_err(|e| NbdError::Io(e.to_string()))?;
            if n == 0 {
                return Err(NbdError::Io(
                    "the client left in the middle of a write".into(),
                ));
            }
            left -= n;
        }
        Ok(())
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), NbdError> {
        self.sock
            .write_all(bytes)
            .map_err(|e| NbdError::Io(e.to_string()))
    }

    /// Answers success; a read's data goes out straight from its buffer.
    fn reply_ok(&mut self, r: &Request, buf: Option<Buffer>) -> Result<(), NbdError> {
        self.stats.ok += 1;
        let data = (r.command == cmd::READ).then_some(buf).flatten();
        match (self.structured, data) {
            (false, _) => self.send(&proto::simple_reply(0, r.cookie))?,
            (true, Some(_)) => {
                let mut h = proto::chunk_header(
                    chunk::FLAG_DONE,
                    chunk::OFFSET_DATA,
                    r.cookie,
                    8 + r.length,
                )
                .to_vec();
                h.extend_from_slice(&r.offset.to_be_bytes());
                self.send(&h)?;
            }
            (true, None) => self.send(&proto::chunk_header(
                chunk::FLAG_DONE,
                chunk::NONE,
                r.cookie,
                0,
            ))?,
        }
        if let Some(b) = data {
            let mut done = 0usize;
            while done < r.length as usize {
                let n = self
                    .sock
                    .send_from(
                        self.dev.buffers(),
                        b.offset + done as u64,
                        r.length as usize - done,
                    )
                    .map_err(|e| NbdError::Io(e.to_string()))?;
                done += n;
            }
            self.stats.bytes += r.length as u64;
        }
        Ok(())
    }

    fn reply_error(&mut self, cookie: u64, code: u32, why: &str) -> Result<(), NbdError> {
        self.stats.errors += 1;
        tracing::debug!("request {cookie:#x}: error {code}: {why}");
        if self.structured {
            self.send(&proto::error_chunk(cookie, code, why))
        } else {
            self.send(&proto::simple_reply(code, cookie))
        }
    }
}
