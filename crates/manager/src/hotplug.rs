//! Hot-plug and power: attaching and detaching devices while the machine runs, quiescing and
//! resuming them.

use super::*;

impl Manager {
    /// Sends `cmd` to the driver server serving class device `name`, and records the state
    /// it leads to; false if no server of this machine serves it now.
    pub(crate) fn command(&mut self, name: &str, cmd: control::Command) -> bool {
        let server = self
            .procs
            .iter()
            .find(|p| p.exited.is_none() && p.kind.serves(name));
        let Some(ev) = server.and_then(|p| p.events.as_ref()) else {
            return false;
        };
        if let Err(e) = control::send(ev.as_fd(), &cmd, &[]) {
            tracing::warn!("{name}: cannot reach its driver server: {e}");
            return false;
        }
        let state = match cmd {
            control::Command::Quiesce { .. } => State::Suspending,
            control::Command::Resume { .. } => State::Serving,
        };
        if let Some(b) = self.class_device_mut(name) {
            b.set_state(state, Detail::None);
        }
        true
    }

    /// Quiesces class device `name` (or puts it back in service): its driver server is told
    /// now, and an incarnation started later (a restart) starts with it quiesced, so it cannot
    /// take a request its clients replay before the command reaches it. The one path suspend
    /// and detach share. False if no server runs now (the restart will apply it).
    pub(crate) fn quiesce(&mut self, name: &str, on: bool) -> bool {
        for p in self.procs.iter_mut().filter(|p| p.kind.serves(name)) {
            if let Some(s) = p.server.as_mut() {
                s.set_quiesced(name, on);
            }
        }
        let device = name.to_string();
        self.command(
            name,
            if on {
                control::Command::Quiesce { device }
            } else {
                control::Command::Resume { device }
            },
        )
    }

    /// `outboard attach`: declared devices by name, or new ones from a description.
    pub(crate) fn attach(
        &mut self,
        name: Option<String>,
        description: Option<String>,
        work: &mut WorkLoop<Source>,
    ) -> Reply {
        let invalid = |message: String| refuse(Code::Invalid, message);
        let devices: Vec<DeviceConfig> = match (name, description) {
            (Some(name), None) => match self.machine.devices.iter().find(|d| d.name == name) {
                None => {
                    return refuse(
                        Code::NoSuchDevice,
                        format!("no device named {name:?}; describe a new one with --file"),
                    )
                }
                Some(d) if d.attached => return invalid(format!("{name} is attached already")),
                Some(d)
                    if d.placement == Placement::Separate
                        && self
                            .machine
                            .devices
                            .iter()
                            .any(|o| o.attached && o.server == d.server) =>
                {
                    return invalid(format!(
                        "{name}: its driver server {:?} runs for other devices; attaching a \
                         device back into a running shared server is not supported yet",
                        d.server
                    ))
                }
                Some(d) => vec![d.clone()],
            },
            (None, Some(text)) => {
                let m = match Machine::parse(&format!("name = \"attach\"\n{text}"), "<attach>") {
                    Ok(m) => m,
                    Err(e) => return invalid(e.to_string()),
                };
                if !m.exports.is_empty() || !m.driver_libraries.is_empty() {
                    return invalid(
                        "attach takes [[device]] tables only ([[driver]] libraries are named \
                         in the machine description)"
                            .into(),
                    );
                }
                if m.devices.is_empty() {
                    return invalid("no [[device]] table to attach".into());
                }
                for d in &m.devices {
                    if self.machine.devices.iter().any(|o| o.name == d.name) {
                        return invalid(format!("a device named {:?} exists already", d.name));
                    }
                    let address = models::pci::address(d);
                    if let Some(o) = self
                        .machine
                        .devices
                        .iter()
                        .find(|o| address.is_some() && models::pci::address(o) == address)
                    {
                        return invalid(format!(
                            "{} is device {} already: `outboard attach {}`",
                            address.unwrap_or_default(),
                            o.name,
                            o.name
                        ));
                    }
                    if d.placement == Placement::Separate
                        && self.machine.devices.iter().any(|o| o.server == d.server)
                    {
                        return invalid(format!(
                            "{}: server {:?} runs already; a device attached at run time gets \
                             a server of its own",
                            d.name, d.server
                        ));
                    }
                }
                for d in &m.devices {
                    self.machine.devices.push(DeviceConfig {
                        attached: false,
                        ..d.clone()
                    });
                }
                m.devices
            }
            _ => return invalid("attach a declared device by name, or describe new ones".into()),
        };
        let mut reply = invalid("nothing attached".into());
        for d in devices {
            reply = self.attach_one(&d, work);
            if matches!(reply, Reply::Error { .. }) {
                break;
            }
        }
        reply
    }

    /// Brings device `d` up as at start-up, in the registry's place of its detached node.
    pub(crate) fn attach_one(&mut self, d: &DeviceConfig, work: &mut WorkLoop<Source>) -> Reply {
        tracing::info!("{}: attaching", d.name);
        self.remove_function_node(&d.name);
        let before = self.procs.len();
        match self.bring_up_devices(std::slice::from_ref(d)) {
            Ok(()) => {
                for i in before..self.procs.len() {
                    let p = &self.procs[i];
                    let _ = work.add(p.fd(), Source::Child(i));
                    p.watch(work, i);
                }
                if let Some(m) = self.machine.devices.iter_mut().find(|m| m.name == d.name) {
                    m.attached = true;
                }
                tracing::info!("{}: attached", d.name);
                match self.class_device(&d.name) {
                    Some(node) => Reply::Status { node: node.clone() },
                    None => refuse(
                        Code::Invalid,
                        format!("{}: attached, but no class device appeared", d.name),
                    ),
                }
            }
            Err(e) => {
                let why = e.to_string();
                tracing::error!("{}: attach failed: {why}", d.name);
                let started: Vec<usize> = (before..self.procs.len()).collect();
                self.retire(&started, work);
                self.remove_function_node(&d.name);
                self.detached_node(d, Some(&why));
                refuse(Code::AttachFailed, format!("{}: {why}", d.name))
            }
        }
    }

    /// Removes device `name`'s function node (and what hangs below it) from its bus.
    pub(crate) fn remove_function_node(&mut self, name: &str) {
        let names = [
            format!("{name}@vfio-user"),
            format!("{name}@virtual"),
            format!("{name}@pci"),
        ];
        for bus in self
            .registry
            .children
            .iter_mut()
            .filter(|b| b.kind == "bus")
        {
            bus.children.retain(|f| !names.contains(&f.name));
        }
        self.registry
            .children
            .retain(|b| b.kind != "bus" || !b.children.is_empty());
    }

    /// Stops children `gone` (driver servers before models) and forgets them; the others
    /// are renumbered in the work loop.
    pub(crate) fn retire(&mut self, gone: &[usize], work: &mut WorkLoop<Source>) {
        self.renumbered = true;
        for p in &self.procs {
            let _ = work.remove(p.fd());
            p.unwatch(work);
        }
        let mut order = gone.to_vec();
        order.sort_by_key(|&i| !matches!(self.procs[i].kind, supervisor::Kind::Server { .. }));
        for &i in &order {
            self.procs[i].stop(Duration::from_secs(5));
        }
        let mut i = 0;
        self.procs.retain(|_| {
            i += 1;
            !gone.contains(&(i - 1))
        });
        for (i, p) in self.procs.iter().enumerate() {
            // One waiting for its restart is added back when it is started again.
            if p.exited.is_none() {
                let _ = work.add(p.fd(), Source::Child(i));
            }
            p.watch(work, i);
        }
    }

    /// `outboard detach NAME`: phase one (stop taking new requests) and two (drain) run in
    /// its driver server; [`Manager::finish_detach`] is phase three.
    pub(crate) fn detach(&mut self, name: &str, work: &mut WorkLoop<Source>) -> Reply {
        let invalid = |message: String| refuse(Code::Invalid, message);
        let Some(d) = self.machine.devices.iter().find(|d| d.name == name) else {
            return refuse(Code::NoSuchDevice, format!("no device named {name:?}"));
        };
        if !d.attached {
            return refuse(Code::DeviceGone, format!("{name} is detached already"));
        }
        if d.placement != Placement::Separate {
            return invalid(format!(
                "{name}: its driver is linked into each client (colocated); only a driver \
                 server's devices can be detached"
            ));
        }
        if self.detaching.insert(name.to_string()) {
            tracing::info!("{name}: detaching");
            if !self.quiesce(name, true) {
                // No server runs (it is restarting): nothing is in flight anywhere.
                self.finish_detach(name, work);
                return detached(name);
            }
        }
        match self.class_device_mut(name) {
            Some(node) => {
                node.set_state(State::Detaching, Detail::None);
                Reply::Status { node: node.clone() }
            }
            None => detached(name),
        }
    }

    /// Phase three of a detach: the device has nothing in flight. Its driver server and
    /// model stop (their sessions hang up; clients see `device gone`), their sockets go, and
    /// the registry shows the device detached.
    pub(crate) fn finish_detach(&mut self, name: &str, work: &mut WorkLoop<Source>) {
        // A shared server goes on without the device; it keeps its place (and socket).
        let shared = self
            .procs
            .iter()
            .position(|p| p.kind.serves(name) && Self::devices_of(&p.kind).len() > 1);
        if let Some(s) = shared {
            self.shed_device(s, name, work);
        }
        let procs: Vec<usize> = (0..self.procs.len())
            .filter(|&i| {
                let kind = &self.procs[i].kind;
                kind.serves(name)
                    || *kind
                        == (supervisor::Kind::Model {
                            device: name.into(),
                        })
            })
            .collect();
        // Dropping them closes the sockets the manager bound for them and removes their files.
        self.retire(&procs, work);
        if let Some(s) = shared {
            // `retire` renumbered the children: only those after the server moved.
            let s = s - procs.iter().filter(|&&i| i < s).count();
            self.start_again(s, work);
        }
        self.remove_function_node(name);
        self.detaching.remove(name);
        self.suspended.remove(name);
        if let Some(d) = self.machine.devices.iter_mut().find(|d| d.name == name) {
            d.attached = false;
            let d = d.clone();
            self.detached_node(&d, None);
        }
        tracing::info!("{name}: detached (its driver server and model stopped)");
    }

    /// Stops driver server `s`, which serves `name` and other devices, and sets it up to
    /// start without `name`; [`Manager::start_again`] starts it once `name`'s model is gone.
    /// Its other devices' clients see their server go and come back: they resume and replay,
    /// as after a crash.
    pub(crate) fn shed_device(&mut self, s: usize, name: &str, work: &mut WorkLoop<Source>) {
        let rest: Vec<String> = Self::devices_of(&self.procs[s].kind)
            .into_iter()
            .filter(|d| d != name)
            .collect();
        self.reseat(s, rest, "a device was detached", work);
    }

    /// Starts stopped driver server `s` again (its `Serving` event completes the restart).
    pub(crate) fn start_again(&mut self, s: usize, work: &mut WorkLoop<Source>) {
        let p = &mut self.procs[s];
        if p.postponed_for_descriptors(ACCEPT_BACKOFF) {
            return;
        }
        if let Err(e) = p.respawn(
            p.exe.clone().as_deref().unwrap_or(&self.opts.exe),
            self.opts.verbose,
        ) {
            tracing::error!("{e}");
            p.exited = None;
            p.restart_at = Some(std::time::Instant::now());
            return;
        }
        let _ = work.add(p.fd(), Source::Child(s));
        p.watch(work, s);
        self.show_server(s);
    }

    /// `outboard power NAME suspend|resume`.
    pub(crate) fn power(&mut self, name: &str, suspend: bool) -> Reply {
        let Some(d) = self.machine.devices.iter().find(|d| d.name == name) else {
            return refuse(Code::NoSuchDevice, format!("no device named {name:?}"));
        };
        if !d.attached {
            return detached(name);
        }
        if d.placement != Placement::Separate {
            return refuse(
                Code::Invalid,
                format!(
                    "{name}: its driver is linked into each client (colocated); only a driver \
                     server's devices can be suspended"
                ),
            );
        }
        // A device given up has no driver to quiesce: suspending it would only be recorded,
        // and bring it back suspended from `outboard restart` later.
        let given_up = self
            .procs
            .iter()
            .filter(|p| {
                p.kind.serves(name)
                    || p.kind
                        == supervisor::Kind::Model {
                            device: name.to_string(),
                        }
            })
            .find_map(|p| p.gave_up.clone());
        if let (true, Some(why)) = (suspend, given_up) {
            return refuse(
                Code::DeviceFailed,
                format!(
                    "{name} cannot be suspended: it is given up ({why}). Bring it back with \
                     `outboard restart {name}` first"
                ),
            );
        }
        let was = self.suspended.contains(name);
        if suspend {
            self.suspended.insert(name.to_string());
        } else {
            self.suspended.remove(name);
        }
        tracing::info!(
            "{name}: {}",
            if suspend { "suspending" } else { "resuming" }
        );
        // A server that is restarting gets the command when it serves again.
        if !self.quiesce(name, suspend) && was != suspend {
            tracing::info!("{name}: its driver server is not running; applied when it serves");
        }
        match self.class_device(name) {
            Some(node) => Reply::Status { node: node.clone() },
            None => refuse(Code::NoSuchDevice, format!("no device named {name:?}")),
        }
    }
}
