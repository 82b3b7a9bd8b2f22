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

use outboard_block::{readable, validate};
use outboard_block::{BlockCompletion, BlockDevice, BlockError, BlockInfo, BlockOp, BlockRequest};
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
    /// `nbds`: TLS, with the certificate authority in this file (`tls-certificates=DIR` names a
    /// directory holding `ca-cert.pem`, as for libnbd and QEMU; else `$OUTBOARD_TLS_CA`).
    pub tls: Option<std::path::PathBuf>,
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
        let (tls, unix, rest) = if let Some(r) = s.strip_prefix("nbd+unix://") {
            (false, true, r)
        } else if let Some(r) = s.strip_prefix("nbds+unix://") {
            (true, true, r)
        } else if let Some(r) = s.strip_prefix("nbd://") {
            (false, false, r)
        } else if let Some(r) = s.strip_prefix("nbds://") {
            (true, false, r)
        } else {
            return Err(format!(
                "{s}: not an NBD URI (nbd[s]://HOST[:PORT]/EXPORT or \
                 nbd[s]+unix:///EXPORT?socket=PATH)"
            ));
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let param = |k: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
                .filter(|v| !v.is_empty())
        };
        let tls = tls
            .then(|| {
                param("tls-certificates")
                    .map(|d| std::path::Path::new(d).join("ca-cert.pem"))
                    .or_else(|| std::env::var_os("OUTBOARD_TLS_CA").map(Into::into))
                    .ok_or_else(|| {
                        format!(
                            "{s}: TLS needs the certificate authority: \
                             ?tls-certificates=DIR (with DIR/ca-cert.pem) or $OUTBOARD_TLS_CA"
                        )
                    })
            })
            .transpose()?;
        if unix {
            let export = rest.strip_prefix('/').unwrap_or(rest).to_string();
            let socket = param("socket").ok_or_else(|| {
                format!("{s}: a +unix URI names its socket: nbd+unix:///EXPORT?socket=PATH")
            })?;
            return Ok(Self {
                address: NbdAddress::Unix(socket.into()),
                export,
                tls,
            });
        }
        {
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
            Ok(Self {
                address: NbdAddress::Tcp(host),
                export: export.to_string(),
                tls,
            })
        }
    }
}

/// Whether `name` is a remote disk's URI rather than a local device's name.
pub fn is_uri(name: &str) -> bool {
    ["nbd://", "nbd+unix://", "nbds://", "nbds+unix://"]
        .iter()
        .any(|p| name.starts_with(p))
}

/// The socket under the connection.
enum Plain {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Plain {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Plain::Tcp(s) => s.as_fd(),
            Plain::Unix(s) => s.as_fd(),
        }
    }
}

impl Read for Plain {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Plain::Tcp(s) => s.read(b),
            Plain::Unix(s) => s.read(b),
        }
    }
}

impl Write for Plain {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Plain::Tcp(s) => s.write(b),
            Plain::Unix(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The connection: plain (data moves without a copy) or TLS (rustls decrypts in between).
enum Stream {
    Plain(Plain),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, Plain>>),
}

impl Stream {
    fn io(&mut self) -> &mut dyn ReadWrite {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.as_mut(),
        }
    }
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Plain(s) => s.fd(),
            Stream::Tls(s) => s.sock.fd(),
        }
    }
    /// Whether a read would not block now (decrypted bytes count).
    fn ready(&mut self, timeout: Duration) -> Result<bool, BlockError> {
        if let Stream::Tls(t) = self {
            let buffered = t
                .conn
                .process_new_packets()
                .map(|s| s.plaintext_bytes_to_read() > 0)
                .unwrap_or(true);
            if buffered {
                return Ok(true);
            }
        }
        readable(self.fd(), timeout)
    }
    /// Reads exactly `len` bytes into `mem` at `offset`.
    fn recv_into(&mut self, mem: &SharedMem, offset: u64, len: usize) -> Result<(), BlockError> {
        let mut done = 0usize;
        while done < len {
            let n = match self {
                Stream::Plain(p) => mem
                    .fill_from_fd(p.fd(), offset + done as u64, len - done)
                    .map_err(|e| BlockError::Protocol(e.to_string()))?,
                Stream::Tls(t) => {
                    let mut tmp = vec![0u8; (len - done).min(256 << 10)];
                    let n = t.read(&mut tmp).map_err(io_err)?;
                    mem.write(offset + done as u64, &tmp[..n])
                        .map_err(|e| BlockError::Protocol(e.to_string()))?;
                    n
                }
            };
            if n == 0 {
                return Err(BlockError::DeviceGone);
            }
            done += n;
        }
        Ok(())
    }
    /// Writes `len` bytes of `mem` at `offset`.
    fn send_from(&mut self, mem: &SharedMem, offset: u64, len: usize) -> Result<(), BlockError> {
        let mut done = 0usize;
        while done < len {
            done += match self {
                Stream::Plain(p) => mem
                    .drain_to_fd(p.fd(), offset + done as u64, len - done)
                    .map_err(|e| BlockError::Protocol(e.to_string()))?,
                Stream::Tls(t) => {
                    let mut tmp = vec![0u8; (len - done).min(256 << 10)];
                    mem.read(offset + done as u64, &mut tmp)
                        .map_err(|e| BlockError::Protocol(e.to_string()))?;
                    t.write_all(&tmp).map_err(io_err)?;
                    tmp.len()
                }
            };
        }
        Ok(())
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// A TLS client configuration trusting the certificate authority in `ca` (PEM).
fn tls_config(ca: &std::path::Path) -> Result<std::sync::Arc<rustls::ClientConfig>, BlockError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let bad = |e: &dyn std::fmt::Display| BlockError::Invalid(format!("{}: {e}", ca.display()));
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).map_err(|e| bad(&e))? {
        roots.add(c.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| BlockError::Invalid(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(std::sync::Arc::new(config))
}

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
        let mut plain = match &u.address {
            NbdAddress::Tcp(a) => {
                let s = TcpStream::connect(a).map_err(unreachable)?;
                let _ = s.set_nodelay(true);
                Plain::Tcp(s)
            }
            NbdAddress::Unix(p) => Plain::Unix(UnixStream::connect(p).map_err(unreachable)?),
        };
        greet(&mut plain)?;
        let mut sock = match &u.tls {
            Some(ca) => start_tls(plain, &u, ca)?,
            None => Stream::Plain(plain),
        };
        let export = go(sock.io(), &u.export)?;
        let buffers = SharedMem::heap(buffer_size)
            .map_err(|e| BlockError::Invalid(format!("buffer area: {e}")))?;
        let (min, _, max) = export.block_sizes.unwrap_or((1, 4096, 32 << 20));
        let block = min.max(512);
        if !block.is_power_of_two() || block > MAX_MIN_BLOCK || export.size % block as u64 != 0 {
            return Err(BlockError::Protocol(format!(
                "export of {} bytes with {min}-byte blocks",
                export.size
            )));
        }
        let area = buffers.len() as u32 / block * block;
        Ok(Self {
            sock,
            info: BlockInfo {
                name: uri.to_string(),
                capacity: export.size / block as u64,
                block_size: block,
                read_only: export.flags & proto::flags::READ_ONLY != 0,
                queue_depth: DEPTH as u32,
                max_transfer: (max / block * block).min(area).max(block),
                supports: outboard_block::Supports {
                    flush: export.flags & proto::flags::SEND_FLUSH != 0,
                    discard: export.flags & proto::flags::SEND_TRIM != 0,
                    write_zeroes: export.flags & proto::flags::SEND_WRITE_ZEROES != 0,
                },
            },
            buffers,
            in_flight: HashMap::new(),
            broken: None,
        })
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
            self.sock
                .recv_into(&self.buffers, r.buf_offset, bytes as usize)?;
        }
        let result = match error {
            0 if r.op.has_data() => Ok(bytes as u32),
            0 => Ok(0),
            proto::errno::EPERM => Err(BlockError::ReadOnly),
            proto::errno::EINVAL => Err(BlockError::Invalid("the NBD server refused it".into())),
            proto::errno::ENOSPC => Err(BlockError::OutOfRange),
            proto::errno::ENOTSUP => Err(BlockError::Unsupported),
            e => Err(BlockError::Io(format!(
                "the NBD server answered {}",
                match e {
                    proto::errno::EIO => "EIO".to_string(),
                    proto::errno::ENOMEM => "ENOMEM".to_string(),
                    proto::errno::EINVAL => "EINVAL".to_string(),
                    proto::errno::ENOSPC => "ENOSPC".to_string(),
                    proto::errno::EOVERFLOW => "EOVERFLOW".to_string(),
                    proto::errno::ESHUTDOWN => "ESHUTDOWN".to_string(),
                    e => format!("error {e}"),
                }
            ))),
        };
        out.push(BlockCompletion { tag: r.tag, result });
        Ok(())
    }
}

/// Reads the server's greeting and answers it: fixed newstyle, no zeroes if offered.
fn greet(io: &mut dyn ReadWrite) -> Result<(), BlockError> {
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
    io.write_all(&cf.to_be_bytes()).map_err(io_err)
}

/// One option reply: its header and data, checked.
fn option_reply(io: &mut dyn ReadWrite) -> Result<(OptionReply, Vec<u8>), BlockError> {
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
    Ok((r, d))
}

/// `NBD_OPT_GO` for `export`, asking for block sizes; what the server says of it.
fn go(io: &mut dyn ReadWrite, export: &str) -> Result<ExportInfo, BlockError> {
    let mut go = (export.len() as u32).to_be_bytes().to_vec();
    go.extend_from_slice(export.as_bytes());
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&proto::info::BLOCK_SIZE.to_be_bytes());
    io.write_all(&proto::option(proto::opt::GO, &go))
        .map_err(io_err)?;
    let mut info = ExportInfo::default();
    loop {
        let (r, d) = option_reply(io)?;
        match r.reply {
            rep::ACK => return Ok(info),
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
}

/// `NBD_OPT_STARTTLS`, then the TLS handshake on `plain`, verifying the server's certificate
/// against `ca` for the URI's host.
fn start_tls(mut plain: Plain, u: &NbdUri, ca: &std::path::Path) -> Result<Stream, BlockError> {
    plain
        .write_all(&proto::option(proto::opt::STARTTLS, &[]))
        .map_err(io_err)?;
    let (r, d) = option_reply(&mut plain)?;
    if r.reply != rep::ACK {
        return Err(BlockError::Unreachable(format!(
            "the NBD server will not start TLS: {}",
            String::from_utf8_lossy(&d)
        )));
    }
    let host = match &u.address {
        NbdAddress::Tcp(a) => a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h),
        NbdAddress::Unix(_) => "localhost",
    };
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let name = rustls::pki_types::ServerName::try_from(host)
        .map_err(|e| BlockError::Invalid(format!("server name: {e}")))?;
    let conn = rustls::ClientConnection::new(tls_config(ca)?, name)
        .map_err(|e| BlockError::Protocol(format!("TLS: {e}")))?;
    let mut tls = rustls::StreamOwned::new(conn, plain);
    while tls.conn.is_handshaking() {
        tls.conn
            .complete_io(&mut tls.sock)
            .map_err(|e| BlockError::Unreachable(format!("TLS handshake: {e}")))?;
    }
    Ok(Stream::Tls(Box::new(tls)))
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
            if let Err(e) = self
                .sock
                .send_from(&self.buffers, r.buf_offset, length as usize)
            {
                return Err(self.fail(e));
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
        while !self.in_flight.is_empty() && self.sock.ready(Duration::ZERO)? {
            if let Err(e) = self.read_reply(out) {
                return Err(self.fail(e));
            }
        }
        Ok(out.len() - before)
    }

    fn block_until(&mut self, deadline: Instant) -> Result<(), BlockError> {
        // A connection that failed answers nothing more: say why rather than time out.
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        self.sock
            .ready(deadline.saturating_duration_since(Instant::now()))?;
        Ok(())
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
        // TLS: the authority comes from tls-certificates=DIR, as libnbd and QEMU name it.
        let u: NbdUri = "nbds://h:99/e?tls-certificates=/etc/pki".parse().unwrap();
        assert_eq!(u.tls, Some("/etc/pki/ca-cert.pem".into()));
        assert_eq!(u.address, NbdAddress::Tcp("h:99".into()));
        let u: NbdUri = "nbds+unix:///e?socket=/s&tls-certificates=/c"
            .parse()
            .unwrap();
        assert_eq!(
            (u.address, u.tls),
            (NbdAddress::Unix("/s".into()), Some("/c/ca-cert.pem".into()))
        );
        assert_eq!("nbd://h/e".parse::<NbdUri>().unwrap().tls, None);
        if std::env::var_os("OUTBOARD_TLS_CA").is_none() {
            assert!("nbds://h/e"
                .parse::<NbdUri>()
                .unwrap_err()
                .contains("certificate authority"));
        }
    }
}
