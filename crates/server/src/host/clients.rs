//! The driver server's clients: control connections, `Open` and `Resume` (class and rings
//! checked against the device's dispatcher, limits, region and doorbells made), and closing a
//! session whose client left.

use super::*;

impl DriverHost {
    pub(super) fn control_message(&mut self, conn: usize) {
        let Some(Some((sock, session))) = self.conns.get(conn) else {
            return;
        };
        let session = *session;
        // The socket is readable (that is why we are here): never wait on a client.
        let reply = match control::recv::<Request>(sock.as_fd(), Some(Duration::ZERO)) {
            Ok((req, fds)) => self.request(conn, req, fds),
            Err(SessionError::Timeout) => return,
            Err(SessionError::Closed) | Err(SessionError::Os(_)) => {
                self.drop_conn(conn, session);
                return;
            }
            Err(e) => Err(Refusal::new(Code::Invalid, e.to_string())),
        };
        let Some(Some((sock, _))) = self.conns.get(conn) else {
            return;
        };
        let sent = match reply {
            Ok((reply, fds)) => {
                let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                control::try_send(sock.as_fd(), &reply, &borrowed)
            }
            Err(Refusal { code, reason }) => control::try_send(
                sock.as_fd(),
                &Reply::Error {
                    code,
                    message: reason,
                },
                &[],
            ),
        };
        if sent.is_err() {
            let session = self.conns[conn].as_ref().and_then(|c| c.1);
            self.drop_conn(conn, session);
        }
    }

    #[allow(clippy::type_complexity)]
    pub(super) fn request(
        &mut self,
        conn: usize,
        req: Request,
        fds: Vec<OwnedFd>,
    ) -> Result<(Reply, Vec<OwnedFd>), Refusal> {
        match req {
            Request::Status { device } => {
                let d = self.find(&device)?;
                Ok((
                    Reply::Status {
                        info: self.devices[d].class.status(),
                    },
                    vec![],
                ))
            }
            Request::Open {
                device,
                class,
                geometry,
            } => self.open_session(conn, &device, &class, geometry, None),
            Request::Resume {
                device,
                class,
                geometry,
                kept,
                replaying,
            } => {
                let [buffers]: [OwnedFd; 1] = fds.try_into().map_err(|v: Vec<OwnedFd>| {
                    Refusal::new(
                        Code::Invalid,
                        format!("resume carries the buffer area: 1 fd, not {}", v.len()),
                    )
                })?;
                self.open_session(
                    conn,
                    &device,
                    &class,
                    geometry,
                    Some((buffers, kept, replaying)),
                )
            }
        }
    }

    /// Opens a session: a new one, or (`resumed`: the client's buffer area, the class's state
    /// it kept, and how many requests it will send again) one the client had with a previous
    /// server.
    #[allow(clippy::type_complexity)]
    pub(super) fn open_session(
        &mut self,
        conn: usize,
        device: &str,
        class: &str,
        geometry: Geometry,
        resumed: Option<(OwnedFd, serde_json::Value, u32)>,
    ) -> Result<(Reply, Vec<OwnedFd>), Refusal> {
        let d = self.find(device)?;
        let dev = &self.devices[d].class;
        if class != dev.class() {
            return Err(Refusal::new(
                Code::WrongClass,
                format!(
                    "{device} is of the {} class, not the {class:?} class",
                    dev.class()
                ),
            ));
        }
        if !geometry.has_shapes(dev.rings()) {
            return Err(Refusal::new(
                Code::Invalid,
                format!(
                    "the {class} class's rings are {}, not {}",
                    describe(dev.rings().iter().map(|r| (r.direction, r.entry_size))),
                    describe(geometry.rings.iter().map(|r| (r.direction, r.entry_size)))
                ),
            ));
        }
        if let Some(refusal) = self.devices[d].refuses() {
            return Err(refusal);
        }
        if self.conns[conn].as_ref().is_some_and(|c| c.1.is_some()) {
            return Err(Refusal::new(
                Code::Busy,
                "this connection already has a session",
            ));
        }
        geometry
            .check()
            .map_err(|e| Refusal::new(Code::Invalid, e.to_string()))?;
        self.admit(geometry.buffer_size)?;
        let resources = |e: &dyn std::fmt::Display| Refusal::new(Code::Resources, e.to_string());
        let resuming = resumed.is_some();
        let replaying = resumed.as_ref().map_or(0, |r| r.2);
        let (region, kept) = match resumed {
            None => (
                Region::create(geometry.clone()).map_err(|e| resources(&e))?,
                None,
            ),
            Some((buffers, kept, _)) => (
                Region::resume(geometry.clone(), buffers).map_err(|e| match e {
                    SessionError::Invalid(m) => Refusal::new(Code::Invalid, m),
                    e => resources(&e),
                })?,
                Some(kept),
            ),
        };
        let server_bell = Doorbell::new().map_err(|e| resources(&e))?;
        let client_bell = Doorbell::new().map_err(|e| resources(&e))?;
        let (cfd, bfd) = region.fds();
        let fds = [cfd, bfd, server_bell.fd(), client_bell.fd()]
            .iter()
            .map(|f| f.try_clone_to_owned())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| resources(&e))?;
        let sock = self.conns[conn]
            .as_ref()
            .map(|c| c.0.try_clone())
            .transpose()
            .map_err(|e| resources(&e))?;
        let slot = self
            .sessions
            .iter()
            .position(Option::is_none)
            .unwrap_or_else(|| {
                self.sessions.push(None);
                self.sessions.len() - 1
            });
        self.devices[d].open(slot, region.buffers.clone(), kept.as_ref())?;
        if let Err(e) = self.work.add(server_bell.fd(), Source::Bell(slot)) {
            self.devices[d].close(slot);
            self.devices[d].release(slot);
            return Err(resources(&e));
        }
        let id = self.next_session;
        self.next_session += 1;
        let tally = self.counters.as_ref().and_then(|c| {
            let pid = self.conns[conn]
                .as_ref()
                .and_then(|c| rustix::net::sockopt::socket_peercred(&c.0).ok())
                .map_or(0, |cred| cred.pid.as_raw_nonzero().get() as u32);
            let t = c.open(d, id, pid)?;
            if resuming {
                t.resumed(replaying);
            }
            Some(t)
        });
        self.sessions[slot] = Some(Session::new(
            id,
            d,
            sock,
            region,
            server_bell,
            client_bell,
            tally,
        ));
        if let Some(c) = self.conns[conn].as_mut() {
            c.1 = Some(slot);
        }
        self.stats.sessions_opened += 1;
        if !resuming {
            tracing::info!("session {id} opened on {device}");
        } else {
            tracing::info!("session {id} resumed on {device}");
        }
        Ok((
            Reply::Opened {
                session: id,
                geometry,
                info: self.devices[d].class.status(),
            },
            fds,
        ))
    }

    /// Refuses a session the limits do not allow.
    pub(super) fn admit(&self, buffer_size: u64) -> Result<(), Refusal> {
        let l = self.limits;
        if buffer_size > l.session_buffer {
            return Err(Refusal::new(
                Code::Invalid,
                format!(
                    "a buffer area of {buffer_size} bytes is more than this server gives one \
                     session ({} bytes)",
                    l.session_buffer
                ),
            ));
        }
        let live = self.sessions.iter().flatten();
        let in_use: u64 = live.clone().map(|s| s.buffer_size()).sum();
        if live.count() >= l.sessions || in_use + buffer_size > l.total_buffer {
            return Err(Refusal::new(
                Code::Busy,
                format!(
                    "this server is at its limit ({} sessions, {} of {} buffer bytes in use)",
                    self.live_sessions(),
                    in_use,
                    l.total_buffer
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn find(&self, name: &str) -> Result<usize, Refusal> {
        self.devices
            .iter()
            .position(|d| d.name() == name)
            .ok_or(Refusal::new(
                Code::NoSuchDevice,
                format!("no device named {name:?} here"),
            ))
    }

    pub(super) fn drop_conn(&mut self, conn: usize, session: Option<usize>) {
        if let Some(Some((sock, _))) = self.conns.get(conn) {
            let _ = self.work.remove(sock.as_fd());
        }
        if let Some(c) = self.conns.get_mut(conn) {
            *c = None;
        }
        if let Some(s) = session {
            self.close_session(s);
        }
    }

    /// Stops serving a session; it is released once its unanswered requests finish.
    pub(super) fn close_session(&mut self, i: usize) {
        if let Some(s) = self.sessions[i].as_mut() {
            // Its locks end with it, and what it had waiting never starts.
            self.devices[s.device].close(i);
            if let Some(sock) = s.sock.take() {
                tracing::info!(
                    "session {}: client gone, draining {} request(s)",
                    s.id,
                    self.devices[s.device].outstanding(i)
                );
                // Shut the socket down so the client sees the cut even if it holds a dup.
                let _ = rustix::net::shutdown(&sock, rustix::net::Shutdown::Both);
            }
        }
        for c in self.conns.iter_mut() {
            if c.as_ref().is_some_and(|c| c.1 == Some(i)) {
                if let Some((sock, _)) = c.take() {
                    let _ = self.work.remove(sock.as_fd());
                }
            }
        }
    }
}

/// Rings as a person reads them: "32-byte entries to the server, 16-byte entries to the client".
pub(super) fn describe(rings: impl Iterator<Item = (Direction, u32)>) -> String {
    let parts: Vec<String> = rings
        .map(|(d, size)| {
            let to = match d {
                Direction::ToServer => "server",
                Direction::ToClient => "client",
            };
            format!("{size}-byte entries to the {to}")
        })
        .collect();
    if parts.is_empty() {
        "no rings".into()
    } else {
        parts.join(", ")
    }
}
