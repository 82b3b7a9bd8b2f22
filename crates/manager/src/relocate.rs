//! Live re-placement (`outboard move DEVICE --server NAME`): a device's driver moves into
//! another driver server while its clients run — the Fluke thesis's configurations (driver
//! alone, drivers sharing a process) changed without stopping anything.
//!
//! A move is two graceful restarts joined: both servers (the one the device leaves and the
//! one it joins, if that one runs) drain — what is in their devices finishes and is
//! answered, nothing new is taken from the rings — then the device's old server is ended and
//! started again without it (or is gone, if it served nothing else), and the server it joins
//! is started again with it (or for the first time). The device is owned by one driver at a
//! time: its new server opens it only after the old one has ended. Clients resume on the new
//! servers with nothing to replay; those of the moved device find its new socket through
//! the manager (`outboard_client`'s `reconnect` asks when the old one no longer serves it).

use std::time::Instant;

use super::*;

/// A move under way.
#[derive(Debug)]
pub(crate) struct Move {
    /// The class device that moves.
    pub device: String,
    /// The driver server it moves into.
    pub to: String,
    /// Devices of the two servers still draining.
    pub waiting: Vec<String>,
    /// When to stop waiting for them (they are then ended anyway; clients replay).
    pub by: Instant,
}

impl Manager {
    /// `outboard move NAME --server TO`: starts the drain, or refuses with the reason.
    pub(crate) fn move_device(&mut self, name: &str, to: &str) -> Reply {
        let invalid = |message: String| refuse(Code::Invalid, message);
        if let Some(m) = &self.moving {
            return refuse(
                Code::Busy,
                format!(
                    "{} is being moved into {:?}; move {name} once that is done",
                    m.device, m.to
                ),
            );
        }
        let Some(d) = self.machine.devices.iter().find(|d| d.name == name) else {
            return refuse(Code::NoSuchDevice, format!("no device named {name:?}"));
        };
        if !d.attached || self.detaching.contains(name) {
            return refuse(Code::DeviceGone, format!("{name} is detached"));
        }
        if d.placement != Placement::Separate {
            return invalid(format!(
                "{name} is colocated: its driver is linked into each client, and a running \
                 client cannot hand its driver to a server (or take one from it) yet; only a \
                 driver in a driver server moves"
            ));
        }
        if !config::valid_name(to) {
            return invalid(format!(
                "server name {to:?}: use 1-32 letters, digits, '-' or '_'"
            ));
        }
        if d.server == to {
            return invalid(format!("{name} runs in driver server {to:?} already"));
        }
        let Some(from) = self.procs.iter().position(|p| p.kind.serves(name)) else {
            return refuse(
                Code::Restarting,
                format!("{name}: no driver server runs for it now; move it once it serves"),
            );
        };
        let into = self.server_named(to);
        for s in std::iter::once(from).chain(into) {
            if let Some(why) = self.not_movable(s) {
                return refuse(
                    Code::Restarting,
                    format!("{name}: {why}; try again once it serves"),
                );
            }
        }
        let mut waiting: Vec<String> = std::iter::once(from)
            .chain(into)
            .flat_map(|s| Self::devices_of(&self.procs[s].kind))
            .filter(|d| !self.suspended.contains(d))
            .collect();
        // Already quiet, or no server to tell: nothing to wait for.
        waiting.retain(|d| self.command(d, control::Command::Quiesce { device: d.clone() }));
        tracing::info!("{name}: moving into driver server {to:?}");
        self.moving = Some(Move {
            device: name.to_string(),
            to: to.to_string(),
            waiting,
            by: Instant::now() + GRACEFUL_DRAIN,
        });
        self.set_state(
            &[name.to_string()],
            (State::Restarting, Detail::Note("outboard move: draining")),
            (State::Restarting, Detail::None),
        );
        // Carried on by [`Manager::advance_move`], after the work loop's batch.
        match self.class_device(name).cloned() {
            Some(node) => Reply::Status { node },
            None => detached(name),
        }
    }

    /// Driver server `to`, if one runs (or is restarting).
    fn server_named(&self, to: &str) -> Option<usize> {
        self.procs
            .iter()
            .position(|p| matches!(&p.kind, supervisor::Kind::Server { name, .. } if name == to))
    }

    /// Why server `s` cannot take part in a move now, if it cannot.
    fn not_movable(&self, s: usize) -> Option<String> {
        let p = &self.procs[s];
        let devices = Self::devices_of(&p.kind);
        if let Some(why) = &p.gave_up {
            Some(format!("{} {why}", p.role))
        } else if p.exited.is_some() || p.down_since.is_some() || !p.served {
            Some(format!("{} is restarting", p.role))
        } else if p.graceful.is_some() {
            Some(format!("{} is being restarted gracefully", p.role))
        } else {
            let d = devices.iter().find(|d| self.detaching.contains(*d))?;
            Some(format!(
                "{d}, which {} also serves, is being detached",
                p.role
            ))
        }
    }

    /// `device` reported it drained; true if a move was waiting for it.
    pub(crate) fn move_drained(&mut self, device: &str) -> bool {
        let Some(m) = self.moving.as_mut() else {
            return false;
        };
        let before = m.waiting.len();
        m.waiting.retain(|d| d != device);
        m.waiting.len() < before
    }

    /// Finishes a move once its servers drained, or once they have had long enough (their
    /// clients then replay what was in the devices). Called between the work loop's
    /// batches: finishing renumbers children, which no handler in the middle of a batch may
    /// see.
    pub(crate) fn advance_move(&mut self, now: Instant, work: &mut WorkLoop<Source>) {
        let Some(m) = &self.moving else {
            return;
        };
        if !m.waiting.is_empty() {
            if now < m.by {
                return;
            }
            tracing::warn!(
                "moving {}: {} did not drain within {GRACEFUL_DRAIN:?}; moving anyway",
                m.device,
                m.waiting.join(", ")
            );
        }
        self.finish_move(work);
    }

    /// Both servers are quiet: the device changes servers.
    fn finish_move(&mut self, work: &mut WorkLoop<Source>) {
        let Some(Move { device, to, .. }) = self.moving.take() else {
            return;
        };
        // Opens and brokered connections go to the new server from now on.
        if let Some(d) = self.machine.devices.iter_mut().find(|d| d.name == device) {
            d.server = to.clone();
        }
        // The old server ends first (the device has one driver at a time), and goes on
        // without the device if it serves others.
        if let Some(from) = self.procs.iter().position(|p| p.kind.serves(&device)) {
            let rest: Vec<String> = Self::devices_of(&self.procs[from].kind)
                .into_iter()
                .filter(|d| *d != device)
                .collect();
            if rest.is_empty() {
                // Dropping it closes its socket and removes the file: its clients ask the
                // manager where the device went.
                self.retire(&[from], work);
            } else {
                self.reseat(from, rest, "a device moved out", work);
                self.start_again(from, work);
            }
        }
        match self.server_named(&to) {
            Some(into) => {
                let mut devices = Self::devices_of(&self.procs[into].kind);
                devices.push(device.clone());
                self.reseat(into, devices, "a device moved in", work);
                self.start_again(into, work);
            }
            None => {
                if let Err(why) = self.start_server(&to, vec![device.clone()], work) {
                    tracing::error!("{device}: cannot start driver server {to:?}: {why}");
                    let why = format!("could not start driver server {to:?} for it: {why}");
                    let failed = (State::GaveUp, Detail::Because(&why));
                    self.set_state(std::slice::from_ref(&device), failed, failed);
                    return;
                }
            }
        }
        tracing::info!("{device}: moved into driver server {to:?}");
    }

    /// Ends driver server `s` and sets it up to start again serving `devices` (its clients
    /// resume on the next incarnation, as after a restart).
    pub(crate) fn reseat(
        &mut self,
        s: usize,
        devices: Vec<String>,
        why: &str,
        work: &mut WorkLoop<Source>,
    ) {
        let supervisor::Kind::Server { name: server, .. } = self.procs[s].kind.clone() else {
            return;
        };
        let machine = self.machine.devices.clone();
        let (args, connect) = self.server_launch(&devices, &machine);
        let p = &mut self.procs[s];
        let _ = work.remove(p.fd());
        if let Some(ev) = p.events.take() {
            let _ = work.remove(ev.as_fd());
        }
        p.heartbeat = None;
        p.stop(Duration::from_secs(5));
        self.retire_counters(s);
        let p = &mut self.procs[s];
        p.set_server(args, connect);
        for n in &devices {
            if self.suspended.contains(n) || self.detaching.contains(n) {
                if let Some(a) = self.procs[s].server.as_mut() {
                    a.set_quiesced(n, true);
                }
            }
        }
        self.procs[s].kind = supervisor::Kind::Server {
            name: server,
            devices: devices.clone(),
        };
        self.procs[s].down_since = Some(Instant::now());
        self.set_state(
            &devices,
            (State::Restarting, Detail::Note(why)),
            (State::Restarting, Detail::None),
        );
    }

    /// Starts a new driver server `name` for `devices` while the machine runs; its `Serving`
    /// event puts them in service.
    fn start_server(
        &mut self,
        name: &str,
        devices: Vec<String>,
        work: &mut WorkLoop<Source>,
    ) -> Result<(), String> {
        let machine = self.machine.devices.clone();
        let p = self
            .spawn_driver_server(name, &devices, &machine)
            .map_err(|e| e.to_string())?;
        self.procs.push(p);
        let i = self.procs.len() - 1;
        let _ = work.add(self.procs[i].fd(), Source::Child(i));
        self.procs[i].watch(work, i);
        self.show_server(i);
        Ok(())
    }

    /// Shows driver server `s` (name, socket, pid) on the drivers it runs.
    pub(crate) fn show_server(&mut self, s: usize) {
        let supervisor::Kind::Server { name, devices } = self.procs[s].kind.clone() else {
            return;
        };
        let sock = self.rt().server_socket(&name).display().to_string();
        let pid = self.procs[s].pid();
        for n in &devices {
            if let Some(drv) = self.driver_of_mut(n) {
                drv.set("server", name.as_str());
                drv.set("server-socket", sock.as_str());
                drv.set("pid", pid);
            }
        }
    }
}
