//! Questions a child asks on its broker connection (an export's: see `outboard_client::link`),
//! answered about the devices the manager gave it only, and the connections to driver servers
//! (or, for a colocated device, to its model) the manager makes for it. The child so needs no
//! right to reach the runtime directory or to connect anywhere.

use rustix::net::SocketType;

use outboard_client::link::{BrokeredReply, BrokeredRequest};

use super::*;

impl Manager {
    /// Answers one question on child `i`'s broker connection without blocking; a child that
    /// hung up or sent garbage loses the connection (its exit comes through its pidfd).
    pub(crate) fn serve_broker(&mut self, work: &mut WorkLoop<Source>, i: usize) {
        let Some(b) = self.procs.get(i).and_then(|p| p.broker.as_ref()) else {
            return;
        };
        let msg = match control::recv::<BrokeredRequest>(b.as_fd(), Some(Duration::ZERO)) {
            Ok((m, _)) => m,
            Err(outboard_session::SessionError::Timeout) => return,
            Err(e) => {
                let p = &mut self.procs[i];
                tracing::warn!("{} (pid {}): broker connection: {e}", p.role, p.pid());
                if let Some(b) = p.broker.take() {
                    let _ = work.remove(b.as_fd());
                }
                return;
            }
        };
        let (reply, fd) = self.brokered(i, msg.request, work);
        let answer = BrokeredReply {
            seq: msg.seq,
            reply,
        };
        let p = &mut self.procs[i];
        let Some(b) = p.broker.as_ref() else {
            return;
        };
        let pass: Vec<BorrowedFd<'_>> = fd.iter().map(|f| f.as_fd()).collect();
        if control::try_send(b.as_fd(), &answer, &pass).is_err() {
            tracing::warn!("{} (pid {}): does not read its answers", p.role, p.pid());
            if let Some(b) = p.broker.take() {
                let _ = work.remove(b.as_fd());
            }
        }
    }

    /// The answer to `req` from child `i`, and the connection that goes with it.
    fn brokered(
        &mut self,
        i: usize,
        req: Request,
        work: &mut WorkLoop<Source>,
    ) -> (Reply, Option<OwnedFd>) {
        let given = self.given_to(i);
        if let Err(why) = may_ask(&given, &req, &self.procs[i].role) {
            return (refuse(Code::Denied, why), None);
        }
        match req {
            Request::Connect { name } => self.connect_for_child(&name),
            req => (self.answer(req, work), None),
        }
    }

    /// The class devices child `i` serves others from (an export's device).
    fn given_to(&self, i: usize) -> Vec<String> {
        match &self.procs[i].kind {
            supervisor::Kind::Export { name } => self
                .machine
                .exports
                .iter()
                .filter(|e| &e.name == name)
                .map(|e| e.device.clone())
                .collect(),
            _ => Vec::new(),
        }
    }

    /// A connection to where `name` is served — its driver server's session socket, or a
    /// colocated device's model — made now, without waiting: a server whose backlog is full,
    /// or that is not there, is answered as restarting (the child asks again).
    fn connect_for_child(&self, name: &str) -> (Reply, Option<OwnedFd>) {
        let (path, kind) = match self.open(name) {
            Reply::Open {
                server: Some(p), ..
            } => (p, SocketType::SEQPACKET),
            Reply::Open {
                device: Some(p), ..
            } => (p, SocketType::STREAM),
            other => return (other, None),
        };
        match connect_now(&path, kind) {
            Ok(fd) => (Reply::Connected, Some(fd)),
            Err(e) => (
                refuse(
                    Code::Restarting,
                    format!("{name}: its server takes no connection now ({e})"),
                ),
                None,
            ),
        }
    }
}

/// Whether a child given `given` may ask `req`: only where its own devices are served, how
/// they are, and for a connection to their servers; `Err` says why not.
fn may_ask(given: &[String], req: &Request, role: &str) -> Result<(), String> {
    match req {
        Request::Open { name } | Request::Status { name } | Request::Connect { name } => {
            if given.contains(name) {
                Ok(())
            } else {
                Err(format!("{name} is not a device this {role} was given"))
            }
        }
        other => Err(format!(
            "a child may ask only about the devices it was given, not {other:?}"
        )),
    }
}

/// Connects to the UNIX socket at `path` without blocking the manager (a full backlog is
/// `EAGAIN`, not a wait); the connection is handed over blocking, as a client expects it.
fn connect_now(path: &Path, kind: SocketType) -> rustix::io::Result<OwnedFd> {
    let fd = outboard_sys::connect_now(path, kind)?;
    rustix::fs::fcntl_setfl(&fd, rustix::fs::OFlags::empty())?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_asks_only_about_its_own_devices() {
        let given = vec!["disk0".to_string()];
        let ask = |req: Request| may_ask(&given, &req, "export disk0");
        let name = || "disk0".to_string();
        assert!(ask(Request::Open { name: name() }).is_ok());
        assert!(ask(Request::Status { name: name() }).is_ok());
        assert!(ask(Request::Connect { name: name() }).is_ok());
        let other = ask(Request::Connect {
            name: "disk1".into(),
        })
        .unwrap_err();
        assert!(other.contains("disk1 is not a device this export disk0 was given"));
        for req in [
            Request::List,
            Request::Detach {
                name: "disk0".into(),
            },
            Request::Power {
                name: "disk0".into(),
                suspend: true,
            },
            Request::Restart {
                name: "disk0".into(),
                graceful: false,
                exe: Some("/tmp/x".into()),
            },
            Request::Move {
                name: "disk0".into(),
                server: "s".into(),
            },
        ] {
            assert!(ask(req).is_err());
        }
    }
}
