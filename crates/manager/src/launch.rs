//! Bringing the machine up: device models launched as their models say, probed, matched to
//! drivers, driver servers started for them (grouped by server name), and the exports.

use super::*;

impl Manager {
    pub(crate) fn bring_up(&mut self) -> Result<(), ManagerError> {
        self.listener = Some(control::listen(&self.opts.control)?);
        if let Some(gid) = self.opts.control_group {
            self.open_to_group(gid).map_err(ManagerError::Runtime)?;
        }
        let (attached, detached): (Vec<DeviceConfig>, Vec<DeviceConfig>) = self
            .machine
            .devices
            .iter()
            .cloned()
            .partition(|d| d.attached);
        self.bring_up_devices(&attached)?;
        for d in &detached {
            self.detached_node(d, None);
        }
        self.start_exports()
    }

    /// How every device model and driver server is confined: `--confine`, and the user and
    /// strictness this manager was given, and the smallest of `devices`' resource caps.
    pub(crate) fn confinement(&self, devices: &[&DeviceConfig]) -> ConfineArgs {
        ConfineArgs {
            confine: true,
            check_confinement: None,
            user: self.opts.child_user,
            require_confinement: self.opts.require_confinement,
            max_files: devices
                .iter()
                .map(|d| d.max_files)
                .min()
                .unwrap_or(outboard_confine::limits::MAX_FILES),
            max_memory: devices.iter().map(|d| d.max_memory).min(),
        }
    }

    /// Lets group `gid` reach the control socket: the socket 0660 and, if it lies in the
    /// runtime directory, the directory 0710 (enter, not list or write), both in `gid`.
    pub(crate) fn open_to_group(&self, gid: u32) -> Result<(), runtime::RuntimeError> {
        let gid = rustix::process::Gid::from_raw(gid);
        let control = &self.opts.control;
        let set = |p: &Path, mode: u32| -> Result<(), runtime::RuntimeError> {
            rustix::fs::chownat(
                rustix::fs::CWD,
                p,
                None,
                Some(gid),
                rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
            )
            .and_then(|()| rustix::fs::chmod(p, rustix::fs::Mode::from_raw_mode(mode)))
            .map_err(|e| runtime::RuntimeError::Group {
                path: p.to_owned(),
                gid: gid.as_raw(),
                err: e.into(),
            })
        };
        set(control, 0o660)?;
        if control.parent() == Some(self.rt().dir()) {
            set(self.rt().dir(), 0o710)?;
        }
        Ok(())
    }

    /// How driver server for `names` is started: its arguments, and the models it is
    /// connected to (see [`supervisor::fd_layout`]).
    pub(crate) fn server_launch(
        &mut self,
        names: &[String],
        devices: &[DeviceConfig],
    ) -> (DriverHostArgs, Vec<supervisor::Fresh>) {
        use supervisor::Fresh;
        let served: Vec<&DeviceConfig> = names
            .iter()
            .filter_map(|n| devices.iter().find(|d| &d.name == n))
            .collect();
        // Per device, in order: a connection to its model, or its function's VFIO container
        // and IOMMU group (the server opens no path).
        let fresh_of = |d: &DeviceConfig| -> Vec<Fresh> {
            match d.model().kind {
                models::Kind::Emulated => vec![Fresh::Connect(self.rt().device_socket(&d.name))],
                models::Kind::Hardware => vec![
                    Fresh::Open("/dev/vfio/vfio".into()),
                    Fresh::Open(format!("/dev/vfio/{}", self.iommu_group(d)).into()),
                ],
                models::Kind::Virtual => Vec::new(),
            }
        };
        let connect: Vec<Fresh> = served.iter().flat_map(|d| fresh_of(d)).collect();
        let (keep_fds, conn_fds) = supervisor::fd_layout(true, 1, connect.len());
        let mut args = DriverHostArgs::on_fd(keep_fds[0], self.confinement(&served));
        args.notify_fd = Some(supervisor::EVENT_FD);
        args.restartable = true;
        let mut conn_fds = conn_fds.into_iter();
        let deadline = served
            .iter()
            .map(|d| d.request_deadline)
            .min()
            .unwrap_or(Duration::from_secs(30));
        args.deadline_ms = deadline.as_millis() as u64;
        for d in &served {
            let spec = match d.model().kind {
                models::Kind::Emulated => {
                    format!("vfio-user-fd:{}", conn_fds.next().expect("one per model"))
                }
                models::Kind::Hardware => {
                    let container = conn_fds.next().expect("a container per function");
                    let group = conn_fds.next().expect("a group per function");
                    format!(
                        "vfio-fd:{container},{group}:{}",
                        models::pci::address(d).unwrap_or_default()
                    )
                }
                models::Kind::Virtual => (d.model().spec)(d),
            };
            args.devices.push(format!("{}={spec}", d.name));
            if let Some(sector) = d.driver_abort_on {
                args.driver_abort_on.push(format!("{}={sector}", d.name));
            }
            // The catalog's choice, as the registry records it: the server starts exactly it.
            if let Some(driver) = self.driver_of(&d.name).map(|drv| drv.name.clone()) {
                // A C driver from a library: its server loads the library first.
                let library = outboard_drivers::by_name(&driver)
                    .and_then(|p| p.library)
                    .map(|l| l.described.library.clone());
                if let Some(l) = library.filter(|l| !args.driver_libs.contains(l)) {
                    args.driver_libs.push(l);
                }
                args.drivers.push(format!("{}={driver}", d.name));
            }
        }
        (args, connect)
    }

    /// Binds driver server `name`'s socket and starts the server for `names` (of `devices`).
    /// The manager binds the socket and connects it to its devices: the server opens nothing
    /// itself, and the socket outlives each incarnation (clients that connect during a
    /// restart wait in its backlog instead of being refused).
    pub(crate) fn spawn_driver_server(
        &mut self,
        name: &str,
        names: &[String],
        devices: &[DeviceConfig],
    ) -> Result<Process, ManagerError> {
        let sock = self.rt().server_socket(name);
        let (listener, path) = control::listen(&sock).map_err(|e| ManagerError::Socket {
            device: name.to_string(),
            why: e.to_string(),
        })?;
        let (args, connect) = self.server_launch(names, devices);
        let log = self.created(self.rt().server_log(name));
        let mut p = Process::spawn_server(
            &self.opts.exe,
            &format!("driver server {name}"),
            args,
            log,
            self.opts.verbose,
            supervisor::Passing {
                events: true,
                keep: vec![listener],
                connect,
                paths: vec![path],
                broker: false,
            },
        )?;
        p.kind = supervisor::Kind::Server {
            name: name.to_string(),
            devices: names.to_vec(),
        };
        Ok(p)
    }

    /// Adds `bus` to the registry, or its children to the bus already there.
    pub(crate) fn merge_bus(&mut self, bus: Node) {
        if bus.children.is_empty() {
            return;
        }
        match self
            .registry
            .children
            .iter_mut()
            .find(|b| b.kind == "bus" && b.name == bus.name)
        {
            Some(b) => b.children.extend(bus.children),
            None => self.registry.children.push(bus),
        }
    }

    /// Shows device `d` as declared but not attached (`why`: the last attach's failure).
    pub(crate) fn detached_node(&mut self, d: &DeviceConfig, why: Option<&str>) {
        let (kind, name) = function_node(d);
        let mut node = Node::new(kind, &name)
            .with("model", d.model.as_str())
            .with("backing", d.backing.as_str())
            .with("state", State::Detached.word());
        if let Some(bdf) = models::pci::address(d) {
            node.set("address", bdf);
        }
        if let Some(why) = why {
            node.set("last-error", why);
        }
        self.merge_bus(Node::new("bus", bus_of(d)).child(node));
    }

    /// Starts `devices`' models, probes them, matches their drivers and starts their driver
    /// servers, adding each to the registry.
    pub(crate) fn bring_up_devices(
        &mut self,
        devices: &[DeviceConfig],
    ) -> Result<(), ManagerError> {
        let mut bus = Node::new("bus", "vfio-user");
        let mut virtual_bus = Node::new("bus", "virtual");
        for d in devices
            .iter()
            .filter(|d| d.model().kind == models::Kind::Virtual)
        {
            let Probed {
                personality, score, ..
            } = outboard_drivers::probe_driver(&Probe::Virtual(&d.model)).map_err(|why| {
                ManagerError::NoDriver {
                    device: d.name.clone(),
                    what: format!("model {}: {why}", d.model),
                }
            })?;
            refuses_fault(d, personality)?;
            virtual_bus.children.push(
                Node::new("device", &function_node(d).1)
                    .with("model", d.model.as_str())
                    .child(
                        Node::new("driver", personality.driver)
                            .with("probe-score", score)
                            .with("placement", "separate")
                            .with("state", State::Starting.word())
                            .child(class_device(personality.class, &d.name)),
                    ),
            );
        }
        for d in devices
            .iter()
            .filter(|d| d.model().kind == models::Kind::Emulated)
        {
            let sock = self.rt().device_socket(&d.name);
            let faults_socket = self.rt().faults_socket(&d.name);
            // The manager opens the disk and binds the model's sockets, and passes them: the
            // model opens no path. They outlive each incarnation: a restarted model finds what
            // its predecessor acknowledged, at the same sockets.
            let socket = |why: String| ManagerError::Socket {
                device: d.name.clone(),
                why,
            };
            // The fault socket exists only where the machine asks for fault injection: it
            // lets whoever reaches it make the device misbehave.
            let faults_socket =
                (d.fault_injection || self.opts.fault_injection).then_some(faults_socket);
            // The descriptors are passed in this order: the listener, the fault socket if
            // any, then the model's own.
            let sockets = 1 + usize::from(faults_socket.is_some());
            let first_own = supervisor::fd_layout(true, sockets + 1, 0).0[sockets];
            let launched = (d.model().launch)(d, first_own).map_err(|why| ManagerError::Model {
                device: d.name.clone(),
                why,
            })?;
            let (listener, sock_path) =
                outboard_sys::bind_listener(&sock, rustix::net::SocketType::STREAM, 8)
                    .map_err(|e| socket(e.to_string()))?;
            let mut keep = vec![listener];
            let mut paths = vec![sock_path];
            if let Some(path) = &faults_socket {
                let (faults, faults_path) =
                    outboard_sys::bind_listener(path, rustix::net::SocketType::SEQPACKET, 8)
                        .map_err(|e| socket(e.to_string()))?;
                keep.push(faults);
                paths.push(faults_path);
            }
            let (fds, _) = supervisor::fd_layout(true, keep.len() + launched.fds.len(), 0);
            debug_assert_eq!(fds.get(keep.len()).copied().unwrap_or(first_own), first_own);
            keep.extend(launched.fds);
            let faults = d
                .faults
                .iter()
                .map(|f| {
                    f.parse().map_err(|why| ManagerError::Model {
                        device: d.name.clone(),
                        why: models::ModelError::Fault {
                            fault: f.clone(),
                            why,
                        },
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let model = ModelArgs {
                listen: ModelListen {
                    socket: None,
                    fd: Some(fds[0]),
                    notify_fd: Some(supervisor::EVENT_FD),
                },
                faults: ModelFaults {
                    faults,
                    faults_socket: None,
                    faults_fd: if faults_socket.is_some() {
                        Some(fds[1])
                    } else {
                        None
                    },
                },
                own: launched.own,
                // Once it listens, it opens nothing: no filesystem, no network, no processes.
                confine: self.confinement(&[d]),
            };
            let args = model.command_line();
            let log = self.created(self.rt().device_log(&d.name));
            let role = format!("device model for {}", d.name);
            let mut p = Process::spawn_passing(
                &self.opts.exe,
                &role,
                &args,
                log,
                self.opts.verbose,
                supervisor::Passing {
                    events: true,
                    keep,
                    connect: Vec::new(),
                    paths,
                    broker: false,
                },
            )?;
            p.wait_serving(Duration::from_secs(10))?;
            p.kind = supervisor::Kind::Model {
                device: d.name.clone(),
            };
            // A model serves once it said so.
            p.served = true;
            let mut node = Node::new("pci-function", &format!("{}@vfio-user", d.name))
                .with("model", d.model.as_str())
                .with("socket", sock.display().to_string())
                .with("pid", p.pid())
                .with("backing", d.backing.as_str())
                .with("state", State::Running.word());
            if let Some(path) = &faults_socket {
                node.set("faults-socket", path.display().to_string());
            }
            self.procs.push(p);
            let driver = probe_function(d, &DeviceSpec::VfioUser(sock.clone()), &mut node)?;
            bus.children.push(node.child(driver));
        }
        self.merge_bus(bus);
        self.merge_bus(virtual_bus);
        self.claim_functions(devices)?;
        self.start_driver_servers(devices)
    }

    /// Starts the driver servers of `devices`: one per server name; devices naming the same
    /// server are grouped.
    fn start_driver_servers(&mut self, devices: &[DeviceConfig]) -> Result<(), ManagerError> {
        let mut servers: Vec<(String, Vec<String>)> = Vec::new();
        for d in devices
            .iter()
            .filter(|d| d.placement == Placement::Separate)
        {
            match servers.iter_mut().find(|s| s.0 == d.server) {
                Some(s) => s.1.push(d.name.clone()),
                None => servers.push((d.server.clone(), vec![d.name.clone()])),
            }
        }
        for (server, names) in servers {
            let sock = self.rt().server_socket(&server);
            let mut p = self.spawn_driver_server(&server, &names, devices)?;
            let heartbeat = p.wait_serving(Duration::from_secs(30))?;
            let pid = p.pid();
            self.procs.push(p);
            self.serving(self.procs.len() - 1, heartbeat, Vec::new());
            for n in &names {
                // Serving means answering for the device: its class's own status record.
                let status = outboard_client::Channel::status(&sock, n, Duration::from_secs(10))
                    .map_err(|e| ManagerError::NotServed {
                        device: n.clone(),
                        why: e.into(),
                    })?;
                let Some(d) = devices.iter().find(|d| &d.name == n) else {
                    continue;
                };
                let (kind, name) = function_node(d);
                if let Some(drv) = self
                    .registry
                    .find_mut(kind, &name)
                    .and_then(|f| f.children.first_mut())
                {
                    drv.set("server", server.as_str());
                    drv.set("server-socket", sock.display().to_string());
                    drv.set("pid", pid);
                    drv.set_state(State::Running, Detail::None);
                    drv.set("restarts", 0);
                    if let Some(b) = drv.children.first_mut() {
                        b.set_state(State::Serving, Detail::None);
                        b.set_status(&status);
                    }
                }
            }
        }
        Ok(())
    }

    /// Starts the machine's `[[export]]`s, each an `outboard export nbd` child with an event
    /// channel (it reports its clients), under the block device it serves in the registry.
    pub(crate) fn start_exports(&mut self) -> Result<(), ManagerError> {
        for (i, e) in self.machine.exports.clone().iter().enumerate() {
            // Checked here, where the device's class is known (from the driver its
            // personality matched): started anyway, the export would fail and be restarted
            // in a loop.
            let class = self
                .driver_of(&e.device)
                .and_then(|drv| outboard_drivers::by_name(&drv.name))
                .map(|p| p.class.to_string());
            let wants = match &e.protocol {
                ExportProtocol::Nbd => ExportNbdArgs::CLASS,
                ExportProtocol::Tap { .. } => TAP_CLASS,
            };
            if let Some(class) = class.filter(|c| c != wants) {
                return Err(ManagerError::ExportClass {
                    device: e.device.clone(),
                    class,
                });
            }
            if let ExportProtocol::Tap { interface, own } = &e.protocol {
                self.start_tap_export(e, interface, *own)?;
                continue;
            }
            let mut export = ExportNbdArgs::of(vec![e.device.clone()]);
            export.name = Some(e.name.clone());
            export.notify_fd = Some(supervisor::EVENT_FD);
            export.read_only = e.read_only;
            if let Some((cert, key)) = &e.tls {
                export.tls_cert = Some(cert.clone());
                export.tls_key = Some(key.clone());
            }
            export.tls_psk = e.tls_psk.clone();
            export.tls_verify_peer = e.tls_verify_peer.clone();
            export.insecure = e.insecure;
            export.max_connections = e.max_connections;
            export.handshake_timeout = e.handshake_timeout;
            export.idle_timeout = e.idle_timeout;
            export.write_timeout = e.write_timeout;
            export.max_files = e.max_files;
            export.max_memory = Some(e.max_memory);
            export.user = self.opts.child_user;
            export.require_confinement = self.opts.require_confinement;
            let s = if e.tls.is_some() || e.tls_psk.is_some() {
                "s"
            } else {
                ""
            };
            let uri = match &e.address {
                ExportAddress::Socket(p) => {
                    let p = p
                        .clone()
                        .unwrap_or_else(|| self.rt().dir().join(format!("export-{i}.nbd")));
                    let p = self.created(p);
                    let uri = format!("nbd{s}+unix:///{}?socket={}", e.name, p.display());
                    export.socket = Some(p);
                    uri
                }
                ExportAddress::Tcp(a) => {
                    export.listen = Some(*a);
                    format!("nbd{s}://{a}/{}", e.name)
                }
            };
            // Its questions and its connections to driver servers go through a connection of
            // its own: it needs no way into the runtime directory (it may run as another user)
            // and connects nowhere itself.
            let passing = supervisor::Passing {
                events: true,
                broker: true,
                ..Default::default()
            };
            export.broker_fd = Some(passing.broker_fd());
            let log = self.created(self.rt().dir().join(format!("export-{i}.log")));
            // Not waited for here: the export opens its device through this manager, which
            // answers only once it runs. It reports itself ready (its first client report),
            // and a crash before that shows in the registry like any other.
            let pid = self.spawn_export(&e.name, &export.command_line(), log, passing)?;
            if let Some(b) = self.class_device_mut(&e.device) {
                b.children.push(
                    Node::new("export", &format!("nbd:{}", e.name))
                        .with("uri", uri)
                        .with("read-only", e.read_only)
                        .with("pid", pid)
                        .with("clients", 0)
                        .with("state", State::Starting.word()),
                );
            }
        }
        Ok(())
    }
}

/// The class a TAP export carries (a NIC's frames).
const TAP_CLASS: &str = "net";

impl Manager {
    /// Starts export `name`'s child (supervised: started again if it dies); its pid.
    fn spawn_export(
        &mut self,
        name: &str,
        args: &[String],
        log: PathBuf,
        passing: supervisor::Passing,
    ) -> Result<u32, ManagerError> {
        let mut p = Process::spawn_passing(
            &self.opts.exe,
            &format!("export {name}"),
            args,
            log,
            self.opts.verbose,
            passing,
        )?;
        p.kind = supervisor::Kind::Export { name: name.into() };
        let pid = p.pid();
        self.procs.push(p);
        Ok(pid)
    }

    /// Starts a TAP export: the manager makes the interface (it has the privilege; the export
    /// does not) and keeps it for as long as it runs, so an export started again after a
    /// crash finds the same interface, addresses and routes the host gave it; the export
    /// joins it to the NIC through a session it asks the manager for.
    fn start_tap_export(
        &mut self,
        e: &ExportConfig,
        interface: &str,
        own: bool,
    ) -> Result<(), ManagerError> {
        let failed = |why: String| {
            ManagerError::Export(format!("export {} (TAP {interface}): {why}", e.name))
        };
        let (tap, made) = outboard_sys::tap::open(interface).map_err(failed)?;
        // The interface carries the NIC's frames whole: a jumbo NIC's MTU, not 1500.
        let mtu = self
            .machine
            .devices
            .iter()
            .find(|d| d.name == e.device)
            .and_then(|d| d.settings.get("mtu"))
            .and_then(|m| m.parse::<u16>().ok());
        if let Some(mtu) = mtu.filter(|&m| m != 1500) {
            outboard_sys::tap::set_mtu(&made, mtu).map_err(failed)?;
        }
        let passing = supervisor::Passing {
            keep: vec![tap],
            broker: true,
            ..Default::default()
        };
        let args = ExportTapArgs {
            nic: e.device.clone(),
            name: made.clone(),
            tap_fd: Some(supervisor::EVENT_FD),
            broker_fd: Some(passing.broker_fd()),
            own,
            no_confine: false,
            require_confinement: self.opts.require_confinement,
        };
        let log = self.created(self.rt().dir().join(format!("export-tap-{made}.log")));
        let pid = self.spawn_export(&e.name, &args.command_line(), log, passing)?;
        if let Some(b) = self.class_device_mut(&e.device) {
            b.children.push(
                Node::new("export", &format!("tap:{made}"))
                    .with("interface", made.as_str())
                    .with("pid", pid)
                    .with("state", State::Running.word()),
            );
        }
        Ok(())
    }
}

/// A driver fault the machine asks of a driver that cannot inject it is refused at `up` (it
/// would be ignored, and a test relying on it would pass without it).
fn refuses_fault(
    d: &DeviceConfig,
    personality: &outboard_drivers::Personality,
) -> Result<(), ManagerError> {
    let opts = outboard_drivers::StartOptions {
        abort_on: d.driver_abort_on,
        ..Default::default()
    };
    match personality.refuses(&opts) {
        Some(why) => Err(ManagerError::DriverFault {
            device: d.name.clone(),
            why,
        }),
        None => Ok(()),
    }
}

/// A device's node in the registry: its kind and name (`disk0@vfio-user` for a model's PCI
/// function, `disk0@pci` for one of this machine, `null0@virtual` for a virtual device).
pub(crate) fn function_node(d: &DeviceConfig) -> (&'static str, String) {
    let kind = match d.model().kind {
        models::Kind::Virtual => "device",
        models::Kind::Emulated | models::Kind::Hardware => "pci-function",
    };
    (kind, format!("{}@{}", d.name, bus_of(d)))
}

/// The bus a device's node hangs on.
fn bus_of(d: &DeviceConfig) -> &'static str {
    match d.model().kind {
        models::Kind::Virtual => "virtual",
        models::Kind::Emulated => "vfio-user",
        models::Kind::Hardware => "pci",
    }
}

/// Opens device `d`'s PCI function at `spec` the way its driver will, records its identity,
/// BARs and interrupts on `node`, and matches its driver (I/O Kit's probe, highest score
/// wins): the driver's node, with the class device below it.
pub(crate) fn probe_function(
    d: &DeviceConfig,
    spec: &DeviceSpec,
    node: &mut Node,
) -> Result<Node, ManagerError> {
    let probe_err = |why: String| ManagerError::Probe {
        device: d.name.clone(),
        why,
    };
    let f = PciFunction::open(spec).map_err(|e| probe_err(e.to_string()))?;
    let id = f.identity();
    node.set("ids", format!("{:04x}:{:04x}", id.vendor, id.device));
    node.set(
        "class",
        format!("{:02x}{:02x}{:02x}", id.class, id.subclass, id.prog_if),
    );
    let bars: Vec<String> = f
        .bar_sizes()
        .map_err(|e| probe_err(e.to_string()))?
        .iter()
        .enumerate()
        .filter(|(_, s)| **s > 0)
        .map(|(i, s)| format!("BAR{i} {}", size_text(*s)))
        .collect();
    node.set("bars", bars.join(", "));
    let irqs: Vec<String> = IrqKind::ALL
        .iter()
        .filter_map(|k| {
            f.irq_count(*k)
                .ok()
                .filter(|n| *n > 0)
                .map(|n| format!("{k} {n}"))
        })
        .collect();
    node.set("irqs", irqs.join(", "));
    let Probed {
        personality,
        score,
        declined,
    } = outboard_drivers::probe_driver(&Probe::Pci(&f)).map_err(|why| {
        let ids = format!(
            "{:04x}:{:04x} (class {:02x}{:02x}{:02x})",
            id.vendor, id.device, id.class, id.subclass, id.prog_if
        );
        ManagerError::NoDriver {
            device: d.name.clone(),
            // Either no personality's match takes it, or each that did declined: why.
            what: if why == outboard_drivers::NO_MATCH {
                ids
            } else {
                format!("{ids}: {why}")
            },
        }
    })?;
    refuses_fault(d, personality)?;
    let mut node = Node::new("driver", personality.driver);
    if let Some(l) = personality.library {
        node.set("library", l.described.library.display().to_string());
    }
    if !declined.is_empty() {
        node.set("declined", declined.join("; "));
    }
    Ok(node
        .with("probe-score", score)
        .with(
            "placement",
            match d.placement {
                Placement::Separate => "separate",
                Placement::Colocated => "colocated",
            },
        )
        .with(
            "state",
            match d.placement {
                Placement::Separate => State::Starting.word(),
                Placement::Colocated => State::Linked.word(),
            },
        )
        .child(class_device(personality.class, &d.name)))
}
