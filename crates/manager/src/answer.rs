//! The control API: accepting connections (who may ask, how many), answering requests
//! (`open`, `status`, `power`, `restart`, …) without blocking on any client.

use super::*;

impl Manager {
    pub(crate) fn accept(&mut self, work: &mut WorkLoop<Source>) {
        let now = std::time::Instant::now();
        // At the cap, the oldest connection gives way: a flood of idle connections cannot
        // lock everyone out, and the descriptors beyond the cap stay free for restarts.
        if self.accepted.len() >= max_control_connections() {
            if let Some(oldest) = self.accepted.front().copied() {
                self.close_conn(work, oldest);
            }
        }
        let Some((listener, _)) = &self.listener else {
            return;
        };
        let conn = match control::accept(listener.as_fd()) {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors (EMFILE/ENFILE) or another failure: the listener stays
                // readable, so trying again at once would spin. Pause, and say so once per
                // interval rather than once per attempt.
                let _ = work.remove(listener.as_fd());
                self.accept_paused = Some(now + ACCEPT_BACKOFF);
                self.log_accept(now, &format!("control socket: {e}; pausing accepts"));
                return;
            }
        };
        // A client the manager does not serve is answered its first request with why, then
        // let go. (Answered at accept and closed at once, a request it had already sent would
        // be unread at the close, and the kernel then resets the connection: the client lost
        // the reason.)
        let denied = control_peer_allowed(conn.as_fd(), self.opts.control_group).err();
        if let Some(why) = &denied {
            self.log_accept(now, &format!("control socket: {why}"));
        }
        let slot = match self.conns.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.conns.push(None);
                self.conns.len() - 1
            }
        };
        if work.add(conn.as_fd(), Source::Conn(slot)).is_ok() {
            self.conns[slot] = Some(conn);
            self.accepted.push_back(slot);
            match denied {
                Some(why) => self.denied.insert(slot, why.to_string()),
                None => self.denied.remove(&slot),
            };
        }
    }

    /// Listens on the control socket again once a pause after a failed accept is over.
    pub(crate) fn resume_accepts(&mut self, work: &mut WorkLoop<Source>) {
        if self
            .accept_paused
            .is_some_and(|t| std::time::Instant::now() >= t)
        {
            self.accept_paused = None;
            if let Some((listener, _)) = &self.listener {
                let _ = work.add(listener.as_fd(), Source::Listener);
            }
        }
    }

    /// Logs `what` unless an accept problem was logged within the last interval.
    pub(crate) fn log_accept(&mut self, now: std::time::Instant, what: &str) {
        if self
            .accept_logged
            .is_none_or(|t| now.duration_since(t) >= ACCEPT_LOG_INTERVAL)
        {
            tracing::warn!(
                "{what} (further such messages within {ACCEPT_LOG_INTERVAL:?} are not logged)"
            );
            self.accept_logged = Some(now);
        }
    }

    /// Answers one request on control connection `i` without blocking; a connection that
    /// hung up, sent garbage or does not read its replies is closed.
    pub(crate) fn serve(&mut self, work: &mut WorkLoop<Source>, i: usize) {
        let Some(Some(conn)) = self.conns.get(i) else {
            return;
        };
        let reply = match control::recv::<Request>(conn.as_fd(), Some(Duration::ZERO)) {
            // A client the manager does not serve is told why, and nothing else.
            Ok(_) if self.denied.contains_key(&i) => {
                let why = self.denied.remove(&i).unwrap_or_default();
                let _ = control::try_send(conn.as_fd(), &refuse(Code::Denied, why), &[]);
                self.close_conn(work, i);
                return;
            }
            // Choosing the program a server runs is the manager's user's or root's alone, not a
            // control group's: the manager may be root.
            Ok((Request::Restart { exe: Some(_), .. }, _)) if !own_user(conn.as_fd()) => refuse(
                Code::Denied,
                "only the manager's user or root may choose the program a driver server runs",
            ),
            // Stopping everything is the manager's user's or root's alone, not a control
            // group's, as sending it SIGTERM is.
            Ok((Request::Down, _)) if !own_user(conn.as_fd()) => refuse(
                Code::Denied,
                "only the manager's user or root may stop the machine",
            ),
            Ok((
                Request::ExportUp {
                    name,
                    device,
                    uri,
                    clients,
                },
                _,
            )) => {
                let pid = rustix::net::sockopt::socket_peercred(conn.as_fd())
                    .map(|c| c.pid.as_raw_nonzero().get())
                    .unwrap_or(0);
                self.export_up(i, pid, name, device, uri, clients)
            }
            Ok((req, _)) => self.answer(req, work),
            Err(outboard_session::SessionError::Timeout) => return,
            Err(outboard_session::SessionError::Invalid(m)) => refuse(Code::Invalid, m),
            Err(_) => {
                self.close_conn(work, i);
                return;
            }
        };
        let Some(Some(conn)) = self.conns.get(i) else {
            return;
        };
        if control::try_send(conn.as_fd(), &reply, &[]).is_err() {
            self.close_conn(work, i);
        }
    }

    pub(crate) fn close_conn(&mut self, work: &mut WorkLoop<Source>, i: usize) {
        if let Some(conn) = self.conns.get_mut(i).and_then(Option::take) {
            let _ = work.remove(conn.as_fd());
        }
        // An export started by hand is in the registry for as long as its connection.
        if let Some((device, name)) = self.hand_exports.remove(&i) {
            if let Some(d) = self.class_device_mut(&device) {
                d.children
                    .retain(|c| !(c.kind == "export" && c.name == format!("nbd:{name}")));
            }
            tracing::info!("export {name} (started by hand) left");
        }
        self.accepted.retain(|&s| s != i);
        self.denied.remove(&i);
    }

    /// An export started by hand on control connection `i` (its process `pid`) says it
    /// serves `device` at `uri`, with `clients`: its registry node, made or brought up to
    /// date. The connection is then kept however many others come (it is the export's life
    /// in the registry).
    fn export_up(
        &mut self,
        i: usize,
        pid: i32,
        name: String,
        device: String,
        uri: String,
        clients: Vec<String>,
    ) -> Reply {
        const MOST: usize = 64;
        let node_name = format!("nbd:{name}");
        let ours = self.hand_exports.get(&i) == Some(&(device.clone(), name.clone()));
        if !ours {
            if self.hand_exports.contains_key(&i) {
                return refuse(Code::Invalid, "this connection registered another export");
            }
            if self.hand_exports.len() >= MOST {
                return refuse(
                    Code::Resources,
                    format!("at most {MOST} exports started by hand are registered"),
                );
            }
        }
        let Some(d) = self.class_device_mut(&device) else {
            return refuse(Code::NoSuchDevice, format!("no class device {device}"));
        };
        let existing = d
            .children
            .iter_mut()
            .find(|c| c.kind == "export" && c.name == node_name);
        let node = match existing {
            Some(n) if ours => n,
            Some(_) => {
                return refuse(
                    Code::Invalid,
                    format!("an export named {name} of {device} is registered already"),
                )
            }
            None => {
                d.children.push(Node::new("export", &node_name));
                d.children.last_mut().expect("pushed")
            }
        };
        node.set("uri", uri);
        node.set("pid", pid);
        node.set("started", "by hand");
        node.set("clients", clients.len());
        node.set("peers", clients.join(", "));
        node.set_state(State::Running, Detail::None);
        if !ours {
            tracing::info!("export {name} of {device} (started by hand, pid {pid}) registered");
            self.hand_exports.insert(i, (device, name));
            self.accepted.retain(|&s| s != i);
        }
        Reply::Noted
    }

    pub(crate) fn answer(&mut self, req: Request, work: &mut WorkLoop<Source>) -> Reply {
        match req {
            Request::Power { name, suspend } => self.power(&name, suspend),
            Request::Attach { name, description } => self.attach(name, description, work),
            Request::Detach { name } => self.detach(&name, work),
            Request::Restart {
                name,
                graceful,
                exe,
            } => self.restart_by_hand(&name, graceful, exe),
            Request::Move { name, server } => self.move_device(&name, &server),
            Request::ExportUp { name, .. } => refuse(
                Code::Invalid,
                format!("export {name}: registered on a control connection, not through a child's"),
            ),
            Request::Down => {
                tracing::info!("outboard down: stopping the machine");
                self.down = true;
                Reply::Stopping
            }
            Request::List => Reply::Registry {
                tree: self.registry_with_counts(),
            },
            Request::Open { name } => self.open(&name),
            Request::Connect { name } => refuse(
                Code::Invalid,
                format!(
                    "connect {name}: only a child the manager started asks this, on the \
                     connection it was given"
                ),
            ),
            Request::Status { name } => match self.class_device(&name) {
                Some(node) => Reply::Status { node: node.clone() },
                None if self.machine.devices.iter().any(|d| d.name == name) => detached(&name),
                None => refuse(Code::NoSuchDevice, format!("no device named {name:?}")),
            },
        }
    }

    /// `outboard restart NAME`: a given-up model or server of `name` is started again now, a
    /// running server is ended and started again (its death counts as progress); either way
    /// the crash history is forgiven. `graceful`: a running server drains first (see
    /// [`Manager::drained`]). `exe`: the program it runs from now on.
    pub(crate) fn restart_by_hand(
        &mut self,
        name: &str,
        graceful: bool,
        exe: Option<PathBuf>,
    ) -> Reply {
        let Some(node) = self.class_device(name).cloned() else {
            return match self.machine.devices.iter().any(|d| d.name == name) {
                true => refuse(
                    Code::DeviceGone,
                    format!("{name} is detached: outboard attach {name}"),
                ),
                false => refuse(Code::NoSuchDevice, format!("no device named {name:?}")),
            };
        };
        if let Some(exe) = &exe {
            if let Err(why) = runnable(exe) {
                return refuse(Code::Invalid, format!("--exe {}: {why}", exe.display()));
            }
        }
        let now = std::time::Instant::now();
        let mut draining = Vec::new();
        for (i, p) in self.procs.iter_mut().enumerate() {
            let model = matches!(&p.kind, supervisor::Kind::Model { device } if device == name);
            let server = p.kind.serves(name);
            if !(model || server) {
                continue;
            }
            p.restarts.forgive();
            if server && exe.is_some() {
                p.exe = exe.clone();
                // The program asked for runs next, even from a path whose file was replaced
                // since the standby was started from it.
                p.standby = None;
            }
            if p.gave_up.is_some() || p.exited.is_some() {
                p.gave_up = None;
                p.restart_at = Some(now);
            } else if server && graceful {
                let devices = Self::devices_of(&p.kind);
                p.graceful = Some((devices.clone(), now + GRACEFUL_DRAIN));
                draining.push((i, devices));
            } else if server {
                p.planned = true;
                let _ = rustix::process::pidfd_send_signal(&p.pidfd, rustix::process::Signal::KILL);
            }
        }
        for (i, devices) in draining {
            for d in devices {
                // Already quiesced (suspended by hand): nothing to wait for.
                if self.suspended.contains(&d)
                    || !self.command(&d, control::Command::Quiesce { device: d.clone() })
                {
                    self.drained(i, &d);
                }
            }
        }
        tracing::info!(
            "{name}: restarted by hand{}",
            if graceful { ", gracefully" } else { "" }
        );
        let note = if graceful {
            "outboard restart --graceful: draining"
        } else {
            "outboard restart"
        };
        self.set_state(
            &[name.to_string()],
            (State::Restarting, Detail::Note(note)),
            (State::Restarting, Detail::None),
        );
        Reply::Status {
            node: self.class_device(name).cloned().unwrap_or(node),
        }
    }

    /// `device` of server `i`, under a graceful restart, has nothing in it and takes nothing
    /// more: once all its devices have, the server is ended and started again. Its clients
    /// resume on the new one with nothing to replay (requests they queued meanwhile never
    /// left their rings, and are sent to the new server).
    pub(crate) fn drained(&mut self, i: usize, device: &str) {
        let Some((left, _)) = self.procs[i].graceful.as_mut() else {
            return;
        };
        left.retain(|d| d != device);
        if left.is_empty() {
            tracing::info!("{}: drained; restarting it", self.procs[i].role);
            self.end_for_restart(i);
        }
    }

    /// Ends server `i` for a restart an operator asked for (its death counts as progress).
    pub(crate) fn end_for_restart(&mut self, i: usize) {
        let p = &mut self.procs[i];
        p.graceful = None;
        p.planned = true;
        let _ = rustix::process::pidfd_send_signal(&p.pidfd, rustix::process::Signal::KILL);
    }

    /// The state of the driver serving `name`, if it is not serving.
    pub(crate) fn failure(&self, name: &str) -> Option<String> {
        fn driver_of<'a>(n: &'a Node, name: &str) -> Option<&'a Node> {
            if n.kind == "driver" && n.children.iter().any(|c| c.name == name) {
                return Some(n);
            }
            n.children.iter().find_map(|c| driver_of(c, name))
        }
        let driver = driver_of(&self.registry, name)?;
        driver.state()?.is_down().then(|| {
            driver.props["state"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
    }

    pub(crate) fn open(&self, name: &str) -> Reply {
        let Some(d) = self.machine.devices.iter().find(|d| d.name == name) else {
            let known: Vec<&str> = self
                .machine
                .devices
                .iter()
                .map(|d| d.name.as_str())
                .collect();
            return refuse(
                Code::NoSuchDevice,
                format!(
                    "no device named {name:?} (this machine has: {})",
                    known.join(", ")
                ),
            );
        };
        if !d.attached || self.detaching.contains(name) {
            let how = if d.attached {
                "being detached"
            } else {
                "detached"
            };
            return refuse(
                Code::DeviceGone,
                format!("{name} is {how}: the device is gone until it is attached again"),
            );
        }
        if let Some(state) = self.failure(name) {
            return refuse(
                Code::DeviceFailed,
                format!("{name}: its driver is not serving: {state}"),
            );
        }
        let restarting = self.class_device(name).and_then(Node::state) == Some(State::Restarting);
        if restarting {
            return refuse(
                Code::Restarting,
                format!("{name}: its driver is restarting"),
            );
        }
        let class = self
            .driver_of(name)
            .and_then(|drv| outboard_drivers::by_name(&drv.name))
            .map(|p| p.class.to_string());
        Reply::Open {
            class,
            placement: d.placement,
            server: (d.placement == Placement::Separate)
                .then(|| self.rt().server_socket(&d.server)),
            device: (d.placement == Placement::Colocated).then(|| self.rt().device_socket(&d.name)),
        }
    }
}

/// How long accepting pauses after it failed (out of descriptors).
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// At most one log line per interval about refused or failed accepts.
pub(crate) const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Most control connections held at once: a quarter of the descriptor limit (at most 256),
/// so that a flood leaves the other three quarters to restarts and children.
pub(crate) fn max_control_connections() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(4096);
    (limit / 4).clamp(4, 256) as usize
}

/// Who may use the control socket: the manager's own user, root, and members of
/// `group` if one is configured (checked with `SO_PEERCRED`, which the kernel fills in at
/// connect time and the peer cannot forge).
pub(crate) fn control_peer_allowed(
    conn: BorrowedFd<'_>,
    group: Option<u32>,
) -> Result<(), PeerRefused> {
    let cred = rustix::net::sockopt::socket_peercred(conn).map_err(PeerRefused::Unknown)?;
    let (uid, gid) = (cred.uid.as_raw(), cred.gid.as_raw());
    let me = rustix::process::geteuid().as_raw();
    if uid == 0 || uid == me {
        return Ok(());
    }
    if let Some(g) = group {
        // A member is one whose primary or any supplementary group it is (most members are
        // supplementary: `usermod -aG`).
        if gid == g
            || outboard_sys::process::peer_groups(conn)
                .map_err(PeerRefused::UnknownGroups)?
                .contains(&g)
        {
            return Ok(());
        }
    }
    Err(PeerRefused::NotAllowed {
        uid,
        pid: cred.pid.as_raw_nonzero().get(),
        me,
        group,
    })
}

/// Why a control connection is not served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PeerRefused {
    /// `SO_PEERCRED` failed.
    #[error("cannot tell who connected: {0}")]
    Unknown(rustix::io::Errno),
    /// `SO_PEERGROUPS` failed.
    #[error("cannot tell the groups of who connected: {0}")]
    UnknownGroups(std::io::Error),
    /// Another user, not root and not in the control group.
    #[error(
        "uid {uid} (pid {pid}) may not use this manager: only uid {me}, root{} may",
        group.map(|g| format!(" and group {g}")).unwrap_or_default()
    )]
    NotAllowed {
        uid: u32,
        pid: i32,
        me: u32,
        group: Option<u32>,
    },
}

/// How long a graceful restart waits for its devices to drain before it restarts anyway.
pub(crate) const GRACEFUL_DRAIN: Duration = Duration::from_secs(10);

/// Whether the peer on `conn` is the manager's own user or root.
fn own_user(conn: BorrowedFd<'_>) -> bool {
    rustix::net::sockopt::socket_peercred(conn).is_ok_and(|c| {
        let uid = c.uid.as_raw();
        uid == 0 || uid == rustix::process::geteuid().as_raw()
    })
}

/// Whether `exe` may be run as a driver server: an absolute path to an executable regular
/// file that nobody but its owner — root or the manager's user — may change (OpenSSH's
/// StrictModes, applied to a program the manager will run).
fn runnable(exe: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    if !exe.is_absolute() {
        return Err("give an absolute path".into());
    }
    let m = std::fs::metadata(exe).map_err(|e| e.to_string())?;
    if !m.is_file() {
        return Err("not a regular file".into());
    }
    if m.mode() & 0o111 == 0 {
        return Err("not executable".into());
    }
    let me = rustix::process::geteuid().as_raw();
    if m.uid() != 0 && m.uid() != me {
        return Err(format!(
            "owned by uid {}: only root's or uid {me}'s programs are run",
            m.uid()
        ));
    }
    if m.mode() & 0o022 != 0 {
        return Err(format!(
            "mode {:o}: others may change it; chmod go-w",
            m.mode() & 0o7777
        ));
    }
    Ok(())
}

/// The answer about a device that is detached.
pub(crate) fn detached(name: &str) -> Reply {
    refuse(
        Code::DeviceGone,
        format!("{name} is detached: the device is gone until it is attached again"),
    )
}

pub(crate) fn refuse(code: Code, message: impl Into<String>) -> Reply {
    Reply::Error {
        code,
        message: message.into(),
    }
}
