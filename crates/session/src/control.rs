//! The control channel: small JSON messages over a `SOCK_SEQPACKET` UNIX socket, fds as
//! `SCM_RIGHTS`.
//!
//! SEQPACKET keeps message boundaries, so a message is one `sendmsg` and one `recvmsg`; a
//! message larger than [`MAX_MESSAGE`] is truncated by the kernel, detected, and rejected. The
//! JSON is parsed into typed messages: anything else is an error, and the peer gets an error
//! reply or is cut off.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use outboard_sys::SocketPath;

use crate::region::Geometry;
use crate::SessionError;

/// Largest control message.
pub const MAX_MESSAGE: usize = 64 << 10;
/// Most fds with one message.
pub const MAX_FDS: usize = 8;

/// A client's request to a driver server (or the manager).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// Open a session on a class device.
    Open {
        /// Device name, e.g. `disk0`.
        device: String,
        /// The class the client speaks (`block`): it must be the device's, and the requested
        /// rings must be the ones it declares.
        class: String,
        /// Requested geometry.
        geometry: Geometry,
    },
    /// Re-open a session after its server was restarted: as `Open`, but the client passes
    /// the buffer area it already has (one fd: the memfd the previous server created, sealed
    /// against resizing), so the buffers its in-flight requests point at stay where they are.
    /// `kept` is the class's own state that must survive the restart, opaque to the session
    /// protocol (block: the ranges the session held locked); the new server's class grants it
    /// back, or refuses the resume, before it serves anything.
    Resume {
        /// Device name.
        device: String,
        /// The class the client speaks.
        class: String,
        /// The geometry of the session being resumed; its buffer size must be the memfd's.
        geometry: Geometry,
        /// The class's kept state (`null` if it keeps none).
        #[serde(default)]
        kept: serde_json::Value,
        /// How many requests the client is about to send again (its class's replay), for the
        /// server's counters.
        #[serde(default)]
        replaying: u32,
    },
    /// Status of a device.
    Status {
        /// Device name.
        device: String,
    },
}

/// A server's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Reply {
    /// The session is open; fds: control memfd, buffer memfd, server doorbell, client doorbell.
    Opened {
        /// Session id (for logs).
        session: u64,
        /// Geometry granted.
        geometry: Geometry,
        /// Class-specific device status.
        info: serde_json::Value,
    },
    /// Device status.
    Status {
        /// Class-specific device status.
        info: serde_json::Value,
    },
    /// The request failed.
    Error {
        /// Machine-readable code.
        code: crate::Code,
        /// What went wrong.
        message: String,
    },
}

/// What a driver server or an export tells its manager, unasked, over the socket the manager
/// gave it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Event {
    /// The server took a device out of service; requests to it fail until it is back.
    DeviceFailed {
        /// Class device name.
        device: String,
        /// Why.
        why: String,
        /// Whether the server is re-opening it (false: given up for good).
        #[serde(default)]
        restarting: bool,
    },
    /// A device given up earlier was opened again and serves.
    DeviceRecovered {
        /// Class device name.
        device: String,
    },
    /// The server is listening and serves every device it was given (sent once, after
    /// start-up): the manager counts a restart as finished from here. `startup` says when
    /// each step of its start-up ended (`CLOCK_MONOTONIC` nanoseconds, [`monotonic_ns`]), in
    /// order, so that a restart's cost can be split into its phases.
    Serving {
        /// (step, when it ended).
        #[serde(default)]
        startup: Vec<(String, u64)>,
    },
    /// A device asked to quiesce ([`Command::Quiesce`]) has nothing left in flight.
    Quiesced {
        /// Class device name.
        device: String,
    },
    /// An export's clients changed: those connected now (their addresses).
    ExportClients {
        /// The export's name.
        export: String,
        /// One entry per connection in transmission.
        clients: Vec<String>,
    },
}

/// What the manager asks of a driver server, over the same channel the server reports on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Command {
    /// Stop taking new requests from the device's sessions (they wait in their rings), finish
    /// those in flight, then report [`Event::Quiesced`]. The first phase of a suspend, a
    /// detach, or a planned restart.
    Quiesce {
        /// Class device name.
        device: String,
    },
    /// Take requests again.
    Resume {
        /// Class device name.
        device: String,
    },
}

/// Crashes of a driver server with the same request in its device (named by the server's
/// blame record) after which the supervisor hands that request to the next server as
/// quarantined: it is failed alone, with its class's error, instead of sent again.
pub const QUARANTINE_AFTER: u32 = 3;

/// Now on `CLOCK_MONOTONIC`, in nanoseconds: one clock for every process on the machine, so
/// that stamps taken in the manager, a driver server and a client can be compared.
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// What a class's client does with the requests a dead server had not answered, once the
/// session is resumed on its successor (each class states its own; the client core carries it
/// out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Send them again on the new server, before anything new (safe when sending a request
    /// twice has the effect of sending it once: block reads and writes, random bytes).
    Replay,
    /// Answer them with [`crate::Code::Interrupted`] — they may have taken effect — and go on
    /// (a class whose requests must not be repeated: a serial port's transmitted bytes).
    Fail,
}

/// A connected pair of SEQPACKET sockets (close-on-exec), e.g. for a child's event channel.
pub fn pair() -> Result<(OwnedFd, OwnedFd), SessionError> {
    rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| SessionError::Os(format!("socketpair: {e}")))
}

fn seqpacket() -> Result<OwnedFd, Errno> {
    rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
}

/// Creates a listening SEQPACKET socket at `path`. Only a stale socket there is replaced
/// ([`outboard_sys::sockpath`]); the returned guard removes the path when dropped, if it is
/// still ours.
pub fn listen(path: &Path) -> Result<(OwnedFd, SocketPath), SessionError> {
    outboard_sys::bind_listener(path, SocketType::SEQPACKET, 64)
        .map_err(|e| SessionError::Os(e.to_string()))
}

/// Connects to a SEQPACKET socket.
pub fn connect(path: &Path) -> Result<OwnedFd, SessionError> {
    let os = |e: Errno| SessionError::Connect(format!("{}: {e}", path.display()));
    let addr = SocketAddrUnix::new(path).map_err(os)?;
    let fd = seqpacket().map_err(os)?;
    rustix::net::connect(&fd, &addr).map_err(os)?;
    Ok(fd)
}

/// Accepts a connection (non-blocking accept is the caller's choice via poll).
pub fn accept(listener: BorrowedFd<'_>) -> Result<OwnedFd, SessionError> {
    rustix::net::accept_with(listener, SocketFlags::CLOEXEC)
        .map_err(|e| SessionError::Os(format!("accept: {e}")))
}

/// Sends one message with fds, waiting for room if the peer's queue is full (clients).
pub fn send<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
) -> Result<(), SessionError> {
    send_with(sock, msg, fds, SendFlags::NOSIGNAL)
}

/// Sends one message with fds without ever waiting (servers): a peer that does not read its
/// replies gets [`SessionError::Timeout`] once its queue is full, and the server cuts it off
/// instead of stalling every other client behind it.
pub fn try_send<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
) -> Result<(), SessionError> {
    send_with(sock, msg, fds, SendFlags::NOSIGNAL | SendFlags::DONTWAIT)
}

fn send_with<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
    flags: SendFlags,
) -> Result<(), SessionError> {
    let bytes = serde_json::to_vec(msg).map_err(|e| SessionError::Invalid(e.to_string()))?;
    if bytes.len() > MAX_MESSAGE || fds.len() > MAX_FDS {
        return Err(SessionError::Invalid("control message too large".into()));
    }
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !cmsg.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(SessionError::Invalid("too many fds".into()));
    }
    match rustix::net::sendmsg(sock, &[IoSlice::new(&bytes)], &mut cmsg, flags) {
        Ok(_) => Ok(()),
        Err(Errno::AGAIN) => Err(SessionError::Timeout),
        Err(Errno::PIPE) | Err(Errno::CONNRESET) => Err(SessionError::Closed),
        Err(e) => Err(SessionError::Os(format!("sendmsg: {e}"))),
    }
}

/// Receives one message, waiting at most `timeout` (forever if `None`). `Closed` on EOF.
pub fn recv<T: DeserializeOwned>(
    sock: BorrowedFd<'_>,
    timeout: Option<Duration>,
) -> Result<(T, Vec<OwnedFd>), SessionError> {
    let ts = timeout.map(|t| rustix::time::Timespec {
        tv_sec: t.as_secs() as _,
        tv_nsec: t.subsec_nanos() as _,
    });
    loop {
        let mut p = [PollFd::new(&sock, PollFlags::IN)];
        match rustix::event::poll(&mut p, ts.as_ref()) {
            Ok(0) => return Err(SessionError::Timeout),
            Ok(_) => break,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(SessionError::Os(format!("poll: {e}"))),
        }
    }
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let r = loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match rustix::net::recvmsg(
            sock,
            &mut iov,
            &mut cmsg,
            RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
        ) {
            Ok(r) => break r,
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => return Err(SessionError::Timeout),
            Err(Errno::CONNRESET) => return Err(SessionError::Closed),
            Err(e) => return Err(SessionError::Os(format!("recvmsg: {e}"))),
        }
    };
    let mut fds = Vec::new();
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(f) = m {
            fds.extend(f);
        }
    }
    if r.bytes == 0 && fds.is_empty() {
        return Err(SessionError::Closed);
    }
    if r.flags.contains(ReturnFlags::TRUNC) || r.flags.contains(ReturnFlags::CTRUNC) {
        return Err(SessionError::Invalid(
            "control message truncated (too large or too many fds)".into(),
        ));
    }
    let msg = serde_json::from_slice(&buf[..r.bytes])
        .map_err(|e| SessionError::Invalid(format!("malformed control message: {e}")))?;
    Ok((msg, fds))
}

/// Sends a request and waits for the reply.
pub fn call(
    sock: BorrowedFd<'_>,
    req: &Request,
    timeout: Duration,
) -> Result<(Reply, Vec<OwnedFd>), SessionError> {
    send(sock, req, &[])?;
    recv(sock, Some(timeout))
}

/// Keeps `AsFd` in scope for callers that pass `&OwnedFd`.
pub fn borrow(fd: &OwnedFd) -> BorrowedFd<'_> {
    fd.as_fd()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot make sockets")]
    fn messages_round_trip_with_fds_and_garbage_is_refused() {
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let req = Request::Open {
            device: "disk0".into(),
            class: "block".into(),
            geometry: Geometry::of_class(
                &[crate::region::RingShape {
                    direction: crate::region::Direction::ToServer,
                    entry_size: 32,
                }],
                64,
                1 << 20,
            ),
        };
        let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::empty()).unwrap();
        send(a.as_fd(), &req, &[efd.as_fd()]).unwrap();
        let (got, fds): (Request, _) = recv(b.as_fd(), Some(Duration::from_secs(1))).unwrap();
        assert_eq!(got, req);
        assert_eq!(fds.len(), 1);
        rustix::net::send(&a, b"{\"op\":\"open\",\"device\":7}", SendFlags::empty()).unwrap();
        assert!(matches!(
            recv::<Request>(b.as_fd(), Some(Duration::from_secs(1))),
            Err(SessionError::Invalid(_))
        ));
        rustix::net::send(&a, b"{\"op\":\"format-disk\"}", SendFlags::empty()).unwrap();
        assert!(recv::<Request>(b.as_fd(), Some(Duration::from_secs(1))).is_err());
        drop(a);
        assert!(matches!(
            recv::<Request>(b.as_fd(), Some(Duration::from_secs(1))),
            Err(SessionError::Closed)
        ));
    }
}
