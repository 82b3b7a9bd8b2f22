//! How a client reaches the manager and, through it, the driver servers.
//!
//! Any client uses the control socket: a connection per question, and it connects to a driver
//! server's session socket itself. A child the manager starts to serve others (an NBD export)
//! is handed a connection of its own instead — a broker: its questions take turns on it, and
//! the manager makes its connections to driver servers and passes them over. Such a child
//! needs no right to connect anywhere (its seccomp filter refuses `socket` and `connect`), may
//! run as a user who could not reach the runtime directory, and is answered only about the
//! devices the manager gave it.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use outboard_session::{control, Code, Refusal};
use serde::{Deserialize, Serialize};

use crate::api::{Reply, Request};
use crate::channel::ChannelError;
use crate::registry::Node;

/// How long the manager has to answer a brokered question.
const BROKER_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a client's questions to the manager go.
#[derive(Debug, Clone)]
pub enum Control {
    /// The manager's control socket.
    Socket(PathBuf),
    /// A connection the manager handed this process when it started it.
    Broker(Arc<Broker>),
}

impl From<&Path> for Control {
    fn from(p: &Path) -> Self {
        Control::Socket(p.to_owned())
    }
}

impl Control {
    /// Sends one request to the manager.
    pub fn ask(&self, req: &Request) -> Result<Reply, Refusal> {
        match self {
            Control::Socket(p) => crate::manager::ask(p, req),
            Control::Broker(b) => b.ask(req).map(|(reply, _)| reply),
        }
    }

    /// A class device's registry entry.
    pub fn status(&self, name: &str) -> Result<Node, Refusal> {
        crate::manager::node_reply(self.ask(&Request::Status { name: name.into() })?)
    }

    /// A connection to the driver server at `server` that serves `device`, not yet past any
    /// question: made here, or by the manager for a brokered client.
    pub fn connect_server(&self, server: &Path, device: &str) -> Result<OwnedFd, ChannelError> {
        match self {
            Control::Socket(_) => connect_trusted(server),
            Control::Broker(b) => {
                let req = Request::Connect {
                    name: device.into(),
                };
                match b.ask(&req).map_err(ChannelError::Refused)? {
                    (Reply::Connected, fds) => {
                        let [fd]: [OwnedFd; 1] = fds.try_into().map_err(|v: Vec<OwnedFd>| {
                            ChannelError::Protocol(format!(
                                "the manager's connection to {device}'s server came with {} \
                                 descriptors, not 1",
                                v.len()
                            ))
                        })?;
                        Ok(fd)
                    }
                    (Reply::Error { code, message }, _) => {
                        Err(ChannelError::Refused(Refusal::new(code, message)))
                    }
                    (other, _) => Err(ChannelError::Refused(crate::manager::unexpected(&other))),
                }
            }
        }
    }
}

/// A connection to the driver server at `server`, if root or this user serves it (see
/// [`crate::manager`]'s check: the manager binds servers' sockets).
pub fn connect_trusted(server: &Path) -> Result<OwnedFd, ChannelError> {
    let sock = control::connect(server)?;
    crate::manager::manager_is_trusted(sock.as_fd(), server).map_err(ChannelError::Refused)?;
    Ok(sock)
}

/// A question on a broker connection: numbered, so an answer that came too late for the
/// question before is told from this one's.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokeredRequest {
    /// The question's number.
    pub seq: u64,
    /// The question.
    pub request: Request,
}

/// The answer to a [`BrokeredRequest`] (with a connection to a driver server as its
/// descriptor, for [`Request::Connect`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokeredReply {
    /// The question's number.
    pub seq: u64,
    /// The answer.
    pub reply: Reply,
}

/// The child's end of a broker connection.
#[derive(Debug)]
pub struct Broker {
    /// The connection and the last question's number; one question at a time.
    conn: Mutex<(OwnedFd, u64)>,
}

impl Broker {
    /// The broker connection inherited as `fd`.
    pub fn new(fd: OwnedFd) -> Self {
        Self {
            conn: Mutex::new((fd, 0)),
        }
    }

    /// Asks the manager and waits for its answer (and the descriptors it came with).
    pub fn ask(&self, request: &Request) -> Result<(Reply, Vec<OwnedFd>), Refusal> {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        conn.1 += 1;
        let seq = conn.1;
        let fd = conn.0.as_fd();
        let gone = |e: outboard_session::SessionError| match e {
            outboard_session::SessionError::Timeout => Refusal::new(
                Code::Timeout,
                format!("the manager did not answer within {BROKER_TIMEOUT:?}"),
            ),
            e => Refusal::new(Code::Unreachable, format!("the manager: {e}")),
        };
        let msg = BrokeredRequest {
            seq,
            request: request.clone(),
        };
        control::send(fd, &msg, &[]).map_err(gone)?;
        let deadline = Instant::now() + BROKER_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Refusal::new(
                    Code::Timeout,
                    format!("the manager did not answer within {BROKER_TIMEOUT:?}"),
                ));
            }
            let (answer, fds) = control::recv::<BrokeredReply>(fd, Some(left)).map_err(gone)?;
            // An answer to an earlier question that timed out: dropped with its descriptors.
            if answer.seq == seq {
                return Ok((answer.reply, fds));
            }
        }
    }
}
