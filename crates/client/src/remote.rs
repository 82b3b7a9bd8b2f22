//! Remote disks (Mach's location transparency): a block device exported over NBD — by
//! Outboard on another machine, or by any NBD server — opened by URI and used through the same
//! [`BlockDevice`] API as a local one.
//!
//! `nbd://HOST[:PORT]/EXPORT` (TCP, port 10809 by default) and
//! `nbd+unix:///EXPORT?socket=PATH`. The client negotiates fixed newstyle with `NBD_OPT_GO`,
//! asking for block sizes, and uses simple replies; requests are pipelined, and a read's data
//! goes from the socket straight into the buffer area, a write's from the buffer area onto the
//! socket. Everything the server sends is checked: magic numbers, cookies it was never given,
//! sizes and block sizes that make no sense.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use outboard_class::block::{readable, validate};
use outboard_class::{BlockCompletion, BlockDevice, BlockError, BlockInfo, BlockOp, BlockRequest};
use outboard_shm::SharedMem;
use outboard_spec::nbd::{self as proto, cmd, rep, ExportInfo, OptionReply};

/// Requests in flight at most.
const DEPTH: usize = 64;
/// Largest block size a server may announce (the protocol's limit is 64 KiB).
const MAX_MIN_BLOCK: u32 = 64 << 10;

/// Where a remote disk is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// `host:port` for TCP, or the socket path.
    pub address: NbdAddress,
    /// The export's name.
    pub export: String,
}

/// How to reach the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdAddress {
    /// TCP `host:port`.
    Tcp(String),
    /// A UNIX socket.
    Unix(std::path::PathBuf),
}

impl std::str::FromStr for NbdUri {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("nbd+unix://") {
            let (path, query) = rest.split_once('?').ok_or_else(|| {
                format!("{s}: a nbd+unix URI names its socket: nbd+unix:///EXPORT?socket=PATH")
            })?;
            let export = path.strip_prefix('/').unwrap_or(path).to_string();
            let socket = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("socket="))
                .filter(|p| !p.is_empty())
                .ok_or_else(|| format!("{s}: no socket= in the query"))?;
            return Ok(Self {
                address: NbdAddress::Unix(socket.into()),
                export,
            });
        }
        if let Some(rest) = s.strip_prefix("nbd://") {
            let (host, export) = rest.split_once('/').unwrap_or((rest, ""));
            if host.is_empty() {
                return Err(format!("{s}: no host"));
            }
            let host = if host
                .rsplit_once(':')
                .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
                && !host.ends_with(']')
            {
                host.to_string()
            } else {
                format!("{host}:10809")
            };
            return Ok(Self {
                address: NbdAddress::Tcp(host),
                export: export.to_string(),
            });
        }
        Err(format!(
            "{s}: not an NBD URI (nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH)"
        ))
    }
}

/// Whether `name` is a remote disk's URI rather than a local device's name.
pub fn is_uri(name: &str) -> bool {
    name.starts_with("nbd://") || name.starts_with("nbd+unix://")
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn io(&mut self) -> &mut dyn ReadWrite {
        match self {
            Stream::Tcp(s) => s,
            Stream::Unix(s) => s,
        }
    }
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// A remote disk over NBD.
pub struct NbdClient {
    sock: Stream,
    info: BlockInfo,
    buffers: SharedMem,
    /// Cookie (the request's tag) → the request.
    in_flight: HashMap<u64, BlockRequest>,
    /// The server broke the protocol or hung up: every later call fails.
    broken: Option<BlockError>,
}

impl std::fmt::Debug for NbdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdClient")
            .field("info", &self.info)
            .finish()
    }
}

fn io_err(e: std::io::Error) -> BlockError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => BlockError::DeviceGone,
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => BlockError::Timeout,
        _ => BlockError::Protocol(e.to_string()),
    }
}

fn proto_err(e: proto::ProtoError) -> BlockError {
    BlockError::Protocol(format!("NBD server: {e}"))
}

impl NbdClient {
    /// Connects to the disk at `uri` with a buffer area of `buffer_size` bytes.
    pub fn open(uri: &str, buffer_size: usize) -> Result<Self, BlockError> {
        let u: NbdUri = uri.parse().map_err(BlockError::Invalid)?;
        let unreachable = |e: std::io::Error| BlockError::Unreachable(format!("{uri}: {e}"));
        let sock = match &u.address {
            NbdAddress::Tcp(a) => {
                let s = TcpStream::connect(a).map_err(unreachable)?;
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
            NbdAddress::Unix(p) => Stream::Unix(UnixStream::connect(p).map_err(unreachable)?),
        };
        let mut c = Self {
            sock,
            info: BlockInfo {
                name: uri.to_string(),
                capacity: 0,
                block_size: 512,
                read_only: false,
                queue_depth: DEPTH as u32,
                max_transfer: 0,
            },
            buffers: SharedMem::heap(buffer_size)
                .map_err(|e| BlockError::Invalid(format!("buffer area: {e}")))?,
            in_flight: HashMap::new(),
            broken: None,
        };
        c.negotiate(&u.export)?;
        Ok(c)
    }

    fn negotiate(&mut self, export: &str) -> Result<(), BlockError> {
        let io = self.sock.io();
        let mut g = [0u8; 18];
        io.read_exact(&mut g).map_err(io_err)?;
        if g[..8] != proto::NBD_MAGIC.to_be_bytes() || g[8..16] != proto::IHAVEOPT.to_be_bytes() {
            return Err(BlockError::Protocol(
                "not a newstyle NBD server (bad greeting)".into(),
            ));
        }
        let flags = u16::from_be_bytes([g[16], g[17]]);
        if flags & proto::handshake::FIXED_NEWSTYLE == 0 {
            return Err(BlockError::Protocol(
                "the server does not speak fixed newstyle".into(),
            ));
        }
        let mut cf = proto::client_flags::FIXED_NEWSTYLE;
        if flags & proto::handshake::NO_ZEROES != 0 {
            cf |= proto::client_flags::NO_ZEROES;
        }
        io.write_all(&cf.to_be_bytes()).map_err(io_err)?;
        let mut go = (export.len() as u32).to_be_bytes().to_vec();
        go.extend_from_slice(export.as_bytes());
        go.extend_from_slice(&1u16.to_be_bytes());
        go.extend_from_slice(&proto::info::BLOCK_SIZE.to_be_bytes());
        io.write_all(&proto::option(proto::opt::GO, &go))
            .map_err(io_err)?;
        let mut info = ExportInfo::default();
        loop {
            let mut h = [0u8; OptionReply::SIZE];
            io.read_exact(&mut h).map_err(io_err)?;
            let r = OptionReply::parse(&h).map_err(proto_err)?;
            if r.length > proto::MAX_OPTION {
                return Err(BlockError::Protocol(format!(
                    "an option reply of {} bytes",
                    r.length
                )));
            }
            let mut d = vec![0u8; r.length as usize];
            io.read_exact(&mut d).map_err(io_err)?;
            match r.reply {
                rep::ACK => break,
                rep::INFO => info.absorb(&d).map_err(proto_err)?,
                rep::ERR_UNKNOWN => {
                    return Err(BlockError::NoSuchDevice(format!(
                        "no export {export:?}: {}",
                        String::from_utf8_lossy(&d)
                    )))
                }
                e if e & (1 << 31) != 0 => {
                    return Err(BlockError::DeviceFailed(format!(
                        "the NBD server refused export {export:?}: {}",
                        String::from_utf8_lossy(&d)
                    )))
                }
                other => {
                    return Err(BlockError::Protocol(format!(
                        "unexpected option reply {other}"
                    )))
                }
            }
        }
        let (min, _, max) = info.block_sizes.unwrap_or((1, 4096, 32 << 20));
        let block = min.max(512);
        if !block.is_power_of_two() || block > MAX_MIN_BLOCK || info.size % block as u64 != 0 {
            return Err(BlockError::Protocol(format!(
                "export of {} bytes with {min}-byte blocks",
                info.size
            )));
        }
        self.info.block_size = block;
        self.info.capacity = info.size / block as u64;
        self.info.read_only = info.flags & proto::flags::READ_ONLY != 0;
        let area = self.buffers.len() as u32 / block * block;
        self.info.max_transfer = (max / block * block).min(area).max(block);
        Ok(())
    }

    fn fail(&mut self, e: BlockError) -> BlockError {
        self.broken = Some(e.clone());
        e
    }

    /// Reads one reply, and a read's data straight into its buffer.
    fn read_reply(&mut self, out: &mut Vec<BlockCompletion>) -> Result<(), BlockError> {
        let mut h = [0u8; 16];
        self.sock.io().read_exact(&mut h).map_err(io_err)?;
        let (error, cookie) = proto::parse_simple_reply(&h).map_err(proto_err)?;
        let r = self.in_flight.remove(&cookie).ok_or_else(|| {
            BlockError::Protocol(format!("a reply to cookie {cookie}, never sent"))
        })?;
        let bytes = r.blocks as u64 * self.info.block_size as u64;
        if error == 0 && r.op == BlockOp::Read {
            let mut done = 0u64;
            while done < bytes {
                let n = self
                    .buffers
                    .fill_from_fd(self.sock.fd(), r.buf_offset + done, (bytes - done) as usize)
                    .map_err(|e| BlockError::Protocol(e.to_string()))?;
                if n == 0 {
                    return Err(BlockError::DeviceGone);
                }
                done += n as u64;
            }
        }
        let result = match error {
            0 if r.op.has_data() => Ok(bytes as u32),
            0 => Ok(0),
            proto::errno::EPERM => Err(BlockError::ReadOnly),
            proto::errno::EINVAL => Err(BlockError::Invalid("the NBD server refused it".into())),
            proto::errno::ENOSPC => Err(BlockError::OutOfRange),
            proto::errno::ENOTSUP => Err(BlockError::Unsupported),
            _ => Err(BlockError::Io),
        };
        out.push(BlockCompletion { tag: r.tag, result });
        Ok(())
    }
}

impl BlockDevice for NbdClient {
    fn info(&self) -> &BlockInfo {
        &self.info
    }

    fn buffers(&self) -> &SharedMem {
        &self.buffers
    }

    fn submit(&mut self, r: &BlockRequest) -> Result<(), BlockError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        validate(r, &self.info, self.buffers.len() as u64)?;
        if self.in_flight.len() >= DEPTH {
            return Err(BlockError::QueueFull);
        }
        if self.in_flight.contains_key(&r.tag) {
            return Err(BlockError::DuplicateTag);
        }
        let bs = self.info.block_size as u64;
        let command = match r.op {
            BlockOp::Read => cmd::READ,
            BlockOp::Write => cmd::WRITE,
            BlockOp::Flush => cmd::FLUSH,
            BlockOp::Discard => cmd::TRIM,
            BlockOp::WriteZeroes => cmd::WRITE_ZEROES,
            BlockOp::Null | BlockOp::Lock | BlockOp::Unlock => return Err(BlockError::Unsupported),
        };
        let (offset, length) = match r.op {
            BlockOp::Flush => (0, 0),
            _ => (r.lba * bs, (r.blocks as u64 * bs) as u32),
        };
        let header = proto::Request {
            flags: 0,
            command,
            cookie: r.tag,
            offset,
            length,
        }
        .encode();
        let sent = self.sock.io().write_all(&header).map_err(io_err);
        if let Err(e) = sent {
            return Err(self.fail(e));
        }
        if r.op == BlockOp::Write {
            let mut done = 0usize;
            while done < length as usize {
                match self.buffers.drain_to_fd(
                    self.sock.fd(),
                    r.buf_offset + done as u64,
                    length as usize - done,
                ) {
                    Ok(n) => done += n,
                    Err(e) => return Err(self.fail(BlockError::Protocol(e.to_string()))),
                }
            }
        }
        self.in_flight.insert(r.tag, *r);
        Ok(())
    }

    fn kick(&mut self) -> Result<(), BlockError> {
        // Requests go out as they are submitted.
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<BlockCompletion>) -> Result<usize, BlockError> {
        let before = out.len();
        while !self.in_flight.is_empty() && readable(self.sock.fd(), Duration::ZERO)? {
            if let Err(e) = self.read_reply(out) {
                return Err(self.fail(e));
            }
        }
        Ok(out.len() - before)
    }

    fn wait(
        &mut self,
        out: &mut Vec<BlockCompletion>,
        timeout: Duration,
    ) -> Result<usize, BlockError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.poll(out)?;
            if n > 0 || self.in_flight.is_empty() {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(BlockError::Timeout);
            }
            readable(self.sock.fd(), deadline - now)?;
        }
    }

    fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_and_bad_ones_say_why() {
        let u: NbdUri = "nbd://10.0.0.1/disk0".parse().unwrap();
        assert_eq!(u.address, NbdAddress::Tcp("10.0.0.1:10809".into()));
        assert_eq!(u.export, "disk0");
        let u: NbdUri = "nbd://host:2000/".parse().unwrap();
        assert_eq!(u.address, NbdAddress::Tcp("host:2000".into()));
        assert_eq!(u.export, "");
        let u: NbdUri = "nbd+unix:///d?socket=/run/x.sock".parse().unwrap();
        assert_eq!(u.address, NbdAddress::Unix("/run/x.sock".into()));
        assert_eq!(u.export, "d");
        for bad in [
            "nbd+unix:///d",
            "nbd:///d",
            "http://x/y",
            "nbd+unix:///d?socket=",
        ] {
            assert!(bad.parse::<NbdUri>().is_err(), "{bad}");
        }
        assert!(is_uri("nbd://h/e") && is_uri("nbd+unix:///e?socket=/s") && !is_uri("disk0"));
    }
}
