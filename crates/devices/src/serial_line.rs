//! The far end of the serial model's line: what the UART's transmitter writes to and its
//! receiver reads from, on the host. As QEMU's character devices: a pseudo-terminal, a Unix
//! stream socket (connected to, or listened on), or a file that takes what is sent; and, as a
//! loopback plug joining TX to RX, the line looped back in the model itself.
//!
//! Everything is non-blocking: a far end that takes no more holds the transmitter (the model
//! keeps the bytes in its FIFO and drops CTS), and the receiver only reads what its FIFO has
//! room for, so the rest waits in the host's buffers rather than being lost.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

/// What turned readable at the far end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// Bytes to receive (or the peer hung up).
    Bytes,
    /// A peer waits to connect to a listening line.
    Peer,
}

/// Where the line goes, as the model's `--line` option spells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LineSpec {
    /// A new pseudo-terminal; its other end's path is logged and kept in [`Line::describe`].
    Pty,
    /// A Unix stream socket to connect to.
    Connect(PathBuf),
    /// A Unix stream socket to listen on; one peer at a time, the newest wins.
    Listen(PathBuf),
    /// A file that takes what is sent (created or appended to); nothing is received.
    File(PathBuf),
    /// Nothing: what is sent is dropped, nothing is received.
    Null,
    /// Looped back: what is sent is received (as a plug joining TX to RX), up to 64 KiB on
    /// the way; RTS holds it back as it holds any far end.
    Loopback,
}

impl LineSpec {
    /// Parses `pty`, `socket:PATH`, `listen:PATH`, `file:PATH`, `loopback` or `null`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let path = |p: &str| -> Result<PathBuf, String> {
            if p.is_empty() {
                Err(format!(
                    "{s:?}: the path is missing (a line is pty, socket:PATH, listen:PATH, \
                     file:PATH, loopback or null)"
                ))
            } else {
                Ok(PathBuf::from(p))
            }
        };
        match s.split_once(':') {
            None if s == "pty" => Ok(Self::Pty),
            None if s == "null" => Ok(Self::Null),
            None if s == "loopback" => Ok(Self::Loopback),
            Some(("socket", p)) => Ok(Self::Connect(path(p)?)),
            Some(("listen", p)) => Ok(Self::Listen(path(p)?)),
            Some(("file", p)) => Ok(Self::File(path(p)?)),
            _ => Err(format!(
                "{s:?} is not a line: pty, socket:PATH, listen:PATH, file:PATH, loopback or null"
            )),
        }
    }
}

impl std::fmt::Display for LineSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Pty => write!(f, "pty"),
            Self::Connect(p) => write!(f, "socket:{}", p.display()),
            Self::Listen(p) => write!(f, "listen:{}", p.display()),
            Self::File(p) => write!(f, "file:{}", p.display()),
            Self::Null => write!(f, "null"),
            Self::Loopback => write!(f, "loopback"),
        }
    }
}

enum Far {
    /// A pseudo-terminal's master; the slave is held open so the line never hangs up.
    Pty {
        master: OwnedFd,
        _slave: OwnedFd,
        path: PathBuf,
    },
    /// A connected stream (a socket connected to, or handed in); `None` once the peer left.
    Stream(Option<OwnedFd>),
    /// A listening socket and its current peer.
    Listen {
        listener: OwnedFd,
        peer: Option<OwnedFd>,
        _guard: outboard_sys::sockpath::SocketPath,
    },
    File(OwnedFd),
    Null,
    /// Bytes sent and not yet received; the bell is readable while there are any.
    Loopback {
        queue: std::collections::VecDeque<u8>,
        bell: OwnedFd,
    },
}

/// Bytes a looped-back line holds on the way before it takes no more (and CTS goes off).
const LOOPBACK_HOLDS: usize = 64 << 10;

/// The far end of the line.
pub struct Line {
    far: Far,
    spec: String,
}

fn nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(fd)?;
    rustix::fs::fcntl_setfl(fd, flags | OFlags::NONBLOCK)?;
    Ok(())
}

/// Whether `e` means "later", not "gone".
fn would_block(e: Errno) -> bool {
    e == Errno::AGAIN || e == Errno::INTR
}

impl Line {
    /// Opens the far end `spec` describes.
    pub fn open(spec: &LineSpec) -> std::io::Result<Self> {
        let far = match spec {
            LineSpec::Pty => {
                let master = rustix::pty::openpt(
                    rustix::pty::OpenptFlags::RDWR
                        | rustix::pty::OpenptFlags::NOCTTY
                        | rustix::pty::OpenptFlags::CLOEXEC,
                )?;
                rustix::pty::grantpt(&master)?;
                rustix::pty::unlockpt(&master)?;
                let name = rustix::pty::ptsname(&master, Vec::new())?;
                let path = PathBuf::from(name.to_string_lossy().into_owned());
                let slave = rustix::fs::open(
                    &path,
                    OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
                // Raw: bytes pass as they are, no echo, no line editing.
                let mut t = rustix::termios::tcgetattr(&slave)?;
                t.make_raw();
                rustix::termios::tcsetattr(&slave, rustix::termios::OptionalActions::Now, &t)?;
                nonblocking(&master)?;
                Far::Pty {
                    master,
                    _slave: slave,
                    path,
                }
            }
            LineSpec::Connect(p) => {
                let fd = rustix::net::socket_with(
                    AddressFamily::UNIX,
                    SocketType::STREAM,
                    SocketFlags::CLOEXEC,
                    None,
                )?;
                rustix::net::connect(&fd, &SocketAddrUnix::new(p.as_path())?)?;
                nonblocking(&fd)?;
                Far::Stream(Some(fd))
            }
            LineSpec::Listen(p) => {
                let (listener, guard) = outboard_sys::bind_listener(p, SocketType::STREAM, 4)
                    .map_err(|e| {
                        std::io::Error::other(format!("listen on {}: {e}", p.display()))
                    })?;
                nonblocking(&listener)?;
                Far::Listen {
                    listener,
                    peer: None,
                    _guard: guard,
                }
            }
            LineSpec::File(p) => Far::File(rustix::fs::open(
                p.as_path(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::APPEND | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )?),
            LineSpec::Null => Far::Null,
            LineSpec::Loopback => Far::Loopback {
                queue: std::collections::VecDeque::new(),
                bell: rustix::event::eventfd(
                    0,
                    rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
                )?,
            },
        };
        let spec = match &far {
            Far::Pty { path, .. } => format!("pty {}", path.display()),
            _ => spec.to_string(),
        };
        Ok(Self { far, spec })
    }

    /// A line to an already connected stream (a socket pair's end in tests).
    pub fn stream(fd: OwnedFd) -> std::io::Result<Self> {
        nonblocking(&fd)?;
        Ok(Self {
            far: Far::Stream(Some(fd)),
            spec: "stream".into(),
        })
    }

    /// What the line is, for logs (a pty names its terminal's path).
    pub fn describe(&self) -> &str {
        &self.spec
    }

    /// The pseudo-terminal's path, for a pty line.
    pub fn pty_path(&self) -> Option<&Path> {
        match &self.far {
            Far::Pty { path, .. } => Some(path),
            _ => None,
        }
    }

    /// Whether someone is at the far end (the model's carrier detect and data set ready).
    pub fn connected(&self) -> bool {
        match &self.far {
            Far::Pty { .. } | Far::File(_) | Far::Loopback { .. } => true,
            Far::Stream(s) => s.is_some(),
            Far::Listen { peer, .. } => peer.is_some(),
            Far::Null => false,
        }
    }

    /// What to wait on: the far end's bytes (when `want_bytes`: the receiver has room), and a
    /// listening line's next peer (always). A readable one is handed to [`Line::ready`].
    pub fn sources(&self, want_bytes: bool) -> Vec<(Ready, BorrowedFd<'_>)> {
        let mut v = Vec::new();
        if want_bytes {
            let bytes = match &self.far {
                Far::Pty { master, .. } => Some(master.as_fd()),
                Far::Stream(Some(s)) | Far::Listen { peer: Some(s), .. } => Some(s.as_fd()),
                Far::Loopback { bell, .. } => Some(bell.as_fd()),
                _ => None,
            };
            v.extend(bytes.map(|fd| (Ready::Bytes, fd)));
        }
        if let Far::Listen { listener, .. } = &self.far {
            v.push((Ready::Peer, listener.as_fd()));
        }
        v
    }

    /// Source `what` turned readable: a waiting peer is accepted (the newest wins: the one
    /// before is hung up), or at most `buf.len()` bytes are read. Returns how many were read.
    pub fn ready(&mut self, what: Ready, buf: &mut [u8]) -> usize {
        match what {
            Ready::Peer => {
                if let Far::Listen { listener, peer, .. } = &mut self.far {
                    match rustix::net::accept_with(&*listener, SocketFlags::CLOEXEC) {
                        Ok(p) if nonblocking(&p).is_ok() => {
                            tracing::info!("serial line: a peer connected");
                            *peer = Some(p);
                        }
                        Ok(_) => {}
                        Err(e) if would_block(e) => {}
                        Err(e) => tracing::warn!("serial line: accept: {e}"),
                    }
                }
                0
            }
            Ready::Bytes => self.receive(buf),
        }
    }

    /// Reads at most `buf.len()` bytes from the far end. Returns how many were read.
    pub fn receive(&mut self, buf: &mut [u8]) -> usize {
        if buf.is_empty() {
            return 0;
        }
        if let Far::Loopback { queue, bell } = &mut self.far {
            let n = buf.len().min(queue.len());
            for (to, b) in buf.iter_mut().zip(queue.drain(..n)) {
                *to = b;
            }
            if queue.is_empty() {
                // Quiet the bell until the next byte is sent (it may be quiet already).
                let _ = rustix::io::read(&*bell, &mut [0u8; 8]);
            }
            return n;
        }
        let fd = match &self.far {
            Far::Pty { master, .. } => master,
            Far::Stream(Some(s)) | Far::Listen { peer: Some(s), .. } => s,
            _ => return 0,
        };
        match rustix::io::read(fd, buf) {
            Ok(0) => {
                self.hang_up();
                0
            }
            Ok(n) => n,
            Err(e) if would_block(e) => 0,
            Err(e) => {
                tracing::warn!("serial line: read: {e}");
                self.hang_up();
                0
            }
        }
    }

    /// Sends what the far end takes of `bytes` now. Returns how many it took; bytes to a far
    /// end that is not there are dropped, as on a line with nothing attached.
    pub fn send(&mut self, bytes: &[u8]) -> usize {
        if let Far::Loopback { queue, bell } = &mut self.far {
            let n = bytes.len().min(LOOPBACK_HOLDS - queue.len());
            queue.extend(&bytes[..n]);
            if n > 0 {
                // Adding to an eventfd's count never blocks short of 2^64 - 1.
                let _ = rustix::io::write(&*bell, &1u64.to_ne_bytes());
            }
            return n;
        }
        let fd = match &self.far {
            Far::Pty { master, .. } => master,
            Far::Stream(Some(s)) | Far::Listen { peer: Some(s), .. } => s,
            Far::File(f) => f,
            _ => return bytes.len(),
        };
        match rustix::io::write(fd, bytes) {
            Ok(n) => n,
            Err(e) if would_block(e) => 0,
            Err(e) => {
                tracing::warn!("serial line: write: {e}");
                self.hang_up();
                bytes.len()
            }
        }
    }

    /// The peer left: a stream stays down; a listener waits for the next peer.
    fn hang_up(&mut self) {
        let peer = match &mut self.far {
            Far::Stream(s) => s.take(),
            Far::Listen { peer, .. } => peer.take(),
            _ => None,
        };
        if peer.is_some() {
            tracing::info!("serial line: the peer hung up");
        }
    }
}

/// Whether `e` means the other end went away (a socket closed with bytes unread, a pty whose
/// other side closed).
fn hung_up(e: Errno) -> bool {
    e == Errno::CONNRESET || e == Errno::PIPE || e == Errno::IO
}

/// Bytes [`echo`] holds for a line that does not take them yet before it stops reading.
const ECHO_HOLDS: usize = 1 << 20;

/// A far end that loops a line back and keeps up: sends back whatever comes on `far`, holding
/// what the line does not take yet (a UART whose driver holds RTS off takes nothing) so that it
/// keeps reading, up to 1 MiB; until `far` hangs up or `stop` is set (it looks every 100 ms).
/// For tests and self-tests at the host side of a line: QEMU's chardev socket, a socket pair's
/// end, a pseudo-terminal.
pub fn echo(far: &OwnedFd, stop: &std::sync::atomic::AtomicBool) -> std::io::Result<()> {
    nonblocking(far)?;
    let mut held = std::collections::VecDeque::new();
    let mut buf = [0u8; 4096];
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        let mut flags = rustix::event::PollFlags::empty();
        if held.len() < ECHO_HOLDS {
            flags |= rustix::event::PollFlags::IN;
        }
        if !held.is_empty() {
            flags |= rustix::event::PollFlags::OUT;
        }
        let mut p = [rustix::event::PollFd::new(far, flags)];
        let tick = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 100_000_000,
        };
        match rustix::event::poll(&mut p, Some(&tick)) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(e) if would_block(e) => continue,
            Err(e) => return Err(e.into()),
        }
        if held.len() < ECHO_HOLDS {
            let room = (ECHO_HOLDS - held.len()).min(buf.len());
            match rustix::io::read(far, &mut buf[..room]) {
                Ok(0) => return Ok(()),
                Ok(n) => held.extend(&buf[..n]),
                Err(e) if would_block(e) => {}
                Err(e) if hung_up(e) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
        let (front, _) = held.as_slices();
        if !front.is_empty() {
            match rustix::io::write(far, front) {
                Ok(k) => drop(held.drain(..k)),
                Err(e) if would_block(e) => {}
                Err(e) if hung_up(e) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print_back() {
        for s in [
            "pty",
            "null",
            "loopback",
            "socket:/a/b",
            "listen:/c",
            "file:out.txt",
        ] {
            assert_eq!(LineSpec::parse(s).unwrap().to_string(), s);
        }
        for bad in ["", "tty", "socket:", "udp:1.2.3.4", "file"] {
            let e = LineSpec::parse(bad).unwrap_err();
            assert!(e.contains("pty, socket:PATH"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_pty_passes_bytes_raw_both_ways() {
        let mut l = Line::open(&LineSpec::Pty).unwrap();
        let path = l.pty_path().unwrap().to_owned();
        let user = rustix::fs::open(
            &path,
            OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap();
        // A carriage return and a ^C pass untranslated.
        assert_eq!(l.send(b"a\r\x03"), 3);
        let mut b = [0u8; 8];
        let n = rustix::io::read(&user, &mut b).unwrap();
        assert_eq!(&b[..n], b"a\r\x03");
        rustix::io::write(&user, b"\nz").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut got = Vec::new();
        while got.len() < 2 && std::time::Instant::now() < deadline {
            let n = l.receive(&mut b);
            got.extend_from_slice(&b[..n]);
        }
        assert_eq!(got, b"\nz");
    }

    /// Whether the line's byte source is readable now.
    fn rings(l: &Line) -> bool {
        let fds = l.sources(true);
        let mut p: Vec<_> = fds
            .iter()
            .map(|(_, fd)| rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN))
            .collect();
        rustix::event::poll(&mut p, Some(&rustix::time::Timespec::default())).unwrap() > 0
    }

    #[test]
    fn a_loopback_receives_what_it_sends_in_order_and_holds_at_most_64_kib() {
        let mut l = Line::open(&LineSpec::Loopback).unwrap();
        assert!(l.connected());
        assert!(!rings(&l), "the bell rings with nothing sent");
        let bytes: Vec<u8> = (0..70_000u32).map(|i| (i % 253) as u8).collect();
        assert_eq!(l.send(&bytes), LOOPBACK_HOLDS);
        assert_eq!(
            l.send(&bytes[LOOPBACK_HOLDS..]),
            0,
            "took more than it holds"
        );
        assert!(rings(&l));
        let mut got = vec![0u8; 1000];
        assert_eq!(l.ready(Ready::Bytes, &mut got), 1000);
        assert_eq!(got, bytes[..1000]);
        assert!(rings(&l), "bytes wait and the bell is quiet");
        let mut rest = vec![0u8; LOOPBACK_HOLDS];
        assert_eq!(l.receive(&mut rest), LOOPBACK_HOLDS - 1000);
        assert_eq!(rest[..LOOPBACK_HOLDS - 1000], bytes[1000..LOOPBACK_HOLDS]);
        assert!(!rings(&l), "the bell rings with nothing left");
        assert_eq!(l.send(b"again"), 5);
        assert!(rings(&l));
    }

    #[test]
    fn a_stream_that_hangs_up_is_down_and_sends_are_dropped() {
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let mut l = Line::stream(a).unwrap();
        assert!(l.connected());
        drop(b);
        let mut buf = [0u8; 4];
        assert_eq!(l.ready(Ready::Bytes, &mut buf), 0);
        assert!(!l.connected());
        assert_eq!(l.send(b"xy"), 2);
    }
}

#[cfg(test)]
mod listen_tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn a_listening_line_takes_the_newest_peer_without_losing_the_old_ones_bytes_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sock");
        let mut l = Line::open(&LineSpec::Listen(path.clone())).unwrap();
        assert!(!l.connected());
        let mut a = std::os::unix::net::UnixStream::connect(&path).unwrap();
        l.ready(Ready::Peer, &mut []);
        assert!(l.connected());
        a.write_all(b"from a").unwrap();
        // The listener is watched while a peer is connected, and the bytes apart from it.
        let kinds: Vec<Ready> = l.sources(true).iter().map(|(k, _)| *k).collect();
        assert_eq!(kinds, vec![Ready::Bytes, Ready::Peer]);
        let mut buf = [0u8; 16];
        let n = l.ready(Ready::Bytes, &mut buf);
        assert_eq!(&buf[..n], b"from a");
        let mut b = std::os::unix::net::UnixStream::connect(&path).unwrap();
        l.ready(Ready::Peer, &mut []);
        assert_eq!(l.send(b"to b"), 4);
        let mut got = [0u8; 4];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"to b");
        // The old peer was hung up.
        a.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        assert_eq!(a.read(&mut got).unwrap(), 0);
    }
}
