//! The device manager (docs/manager.md).
//!
//! Reads a machine description ([`config`]), starts each device model and driver server as a
//! confined process ([`supervisor`]), builds the registry ([`registry`]), answers the control
//! API ([`api`]) on a SEQPACKET socket for its own user only, supervises and restarts what dies
//! (docs/restart.md), attaches and detaches devices at run time, and shuts everything down
//! cleanly. Matching uses the drivers' personalities.
#![deny(missing_docs)]

pub mod config;
pub mod models;
pub mod runtime;
pub mod supervisor;

pub use outboard_client::{api, manager as open, registry};

use crate::config::DeviceConfig;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outboard_drivers::{Probe, Probed};
use outboard_env::WorkLoop;
use outboard_hw::{DeviceSpec, IrqKind, PciFunction};
use outboard_session::{control, Code};

use crate::api::{Reply, Request};
use crate::config::{ExportAddress, Machine, Placement};
use crate::registry::Node;
use crate::supervisor::Process;

/// Where the manager keeps its sockets and logs, and what it runs.
#[derive(Debug, Clone)]
pub struct ManagerOptions {
    /// Directory for sockets and logs (created 0700; the files it creates are removed on exit).
    pub runtime_dir: PathBuf,
    /// The manager's control socket.
    pub control: PathBuf,
    /// The `outboard` executable to run children with.
    pub exe: PathBuf,
    /// Verbosity passed to children.
    pub verbose: u8,
    /// A group whose members may use the control socket too (besides the manager's own user
    /// and root): the socket becomes 0660 and the runtime directory 0710, in that group.
    pub control_group: Option<u32>,
    /// The user device models and driver servers run as (`--user` of each child: a name or
    /// `UID:GID`); `None` keeps the manager's, without capabilities.
    pub child_user: Option<String>,
    /// Children refuse to serve unless every confinement layer holds in full.
    pub require_confinement: bool,
    /// Every emulated device gets a fault socket (`outboard fault`), whatever its
    /// `fault_injection` says.
    pub fault_injection: bool,
}

pub use outboard_client::manager::{default_control, default_runtime_dir};

/// What woke the manager's work loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// A client is connecting to the control socket.
    Listener,
    /// Child process `i` exited.
    Child(usize),
    /// Control connection `i` has a request (or hung up).
    Conn(usize),
    /// Child `i` reported an event.
    Events(usize),
}

/// How long a restarted driver server grants no new range lock: its clients resume within a
/// few milliseconds of it serving (they poll for it every millisecond), this is ample.
const LOCK_GRACE: Duration = Duration::from_millis(250);

/// A running machine.
pub struct Manager {
    machine: Machine,
    opts: ManagerOptions,
    /// Held for the manager's lifetime: the lock that keeps other managers out.
    runtime: Option<runtime::RuntimeDir>,
    listener: Option<(OwnedFd, outboard_sys::SocketPath)>,
    procs: Vec<Process>,
    registry: Node,
    /// Files the manager's children create; removed at shutdown unless they explain a crash.
    created: Vec<PathBuf>,
    conns: Vec<Option<OwnedFd>>,
    /// Slots of `conns` in the order they were accepted: the oldest gives way when the
    /// manager holds as many connections as it may.
    accepted: std::collections::VecDeque<usize>,
    /// Connections from peers the manager does not serve, and why: their first request is
    /// answered with the reason, then they are closed.
    denied: std::collections::HashMap<usize, String>,
    /// `accept` ran out of descriptors: not tried again before this instant.
    accept_paused: Option<std::time::Instant>,
    /// The last time a refused or failed `accept` was logged (once per interval, whatever
    /// the flood).
    accept_logged: Option<std::time::Instant>,
    /// Class devices suspended on request (`outboard power NAME suspend`): a restarted
    /// server is asked to quiesce them again.
    suspended: std::collections::BTreeSet<String>,
    /// Class devices being detached: quiescing, then released.
    detaching: std::collections::BTreeSet<String>,
    /// Children were renumbered (attach, detach): the rest of a batch of ready sources
    /// names old numbers and is dropped (the work loop is level-triggered: they come again).
    renumbered: bool,
}

fn size_text(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

/// Why the manager could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// The runtime directory could not be claimed (another manager holds it, or it is not
    /// usable).
    #[error("{0}")]
    Runtime(String),
    /// The control socket could not be set up.
    #[error("the control socket: {0}")]
    Control(#[from] outboard_session::SessionError),
    /// The work loop failed.
    #[error(transparent)]
    Loop(#[from] outboard_env::LoopError),
    /// A child process (device model, driver server) could not be started or did not come up.
    #[error("{0}")]
    Launch(String),
    /// A device could not be probed.
    #[error("probing {device}: {why}")]
    Probe {
        /// Device name.
        device: String,
        /// Why.
        why: String,
    },
    /// No driver in the catalog matches a device.
    #[error("{device}: no driver matches {what}")]
    NoDriver {
        /// Device name.
        device: String,
        /// What was matched (ids or model).
        what: String,
    },
    /// A driver server started but does not serve a device it should.
    #[error("{device}: {why}")]
    NotServed {
        /// Device name.
        device: String,
        /// What its server answered.
        why: outboard_session::Refusal,
    },
    /// `run` was called on a manager that is not started.
    #[error("the manager is not started")]
    NotStarted,
}

impl Manager {
    /// Starts every device model and driver server of `machine`. On failure, whatever was
    /// started is stopped again.
    pub fn start(machine: Machine, opts: ManagerOptions) -> Result<Self, ManagerError> {
        let runtime =
            runtime::RuntimeDir::claim(&opts.runtime_dir).map_err(ManagerError::Runtime)?;
        let mut m = Self {
            registry: Node::new("machine", &machine.name).with("state", "starting"),
            machine,
            opts,
            runtime: Some(runtime),
            listener: None,
            procs: Vec::new(),
            created: Vec::new(),
            conns: Vec::new(),
            accepted: Default::default(),
            denied: Default::default(),
            accept_paused: None,
            accept_logged: None,
            suspended: Default::default(),
            detaching: Default::default(),
            renumbered: false,
        };
        if let Err(e) = m.bring_up() {
            m.shutdown();
            return Err(e);
        }
        m.registry.set("state", "running");
        m.registry
            .set("control", m.opts.control.display().to_string());
        Ok(m)
    }

    fn rt(&self) -> &runtime::RuntimeDir {
        self.runtime.as_ref().expect("held until shutdown")
    }

    /// Records a file a child will create, for removal at shutdown.
    fn created(&mut self, p: PathBuf) -> PathBuf {
        self.created.push(p.clone());
        p
    }

    fn bring_up(&mut self) -> Result<(), ManagerError> {
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
    fn confine_args(&self, devices: &[&DeviceConfig]) -> Vec<String> {
        let mut args = vec!["--confine".to_string()];
        if let Some(m) = devices.iter().map(|d| d.max_memory).min() {
            args.extend(["--max-memory".into(), m.to_string()]);
        }
        if let Some(n) = devices.iter().map(|d| d.max_files).min() {
            args.extend(["--max-files".into(), n.to_string()]);
        }
        if let Some(u) = &self.opts.child_user {
            args.extend(["--user".into(), u.clone()]);
        }
        if self.opts.require_confinement {
            args.push("--require-confinement".into());
        }
        args
    }

    /// Lets group `gid` reach the control socket: the socket 0660 and, if it lies in the
    /// runtime directory, the directory 0710 (enter, not list or write), both in `gid`.
    fn open_to_group(&self, gid: u32) -> Result<(), String> {
        let gid = rustix::process::Gid::from_raw(gid);
        let control = &self.opts.control;
        let set = |p: &Path, mode: u32| -> Result<(), String> {
            rustix::fs::chownat(
                rustix::fs::CWD,
                p,
                None,
                Some(gid),
                rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
            )
            .and_then(|()| rustix::fs::chmod(p, rustix::fs::Mode::from_raw_mode(mode)))
            .map_err(|e| format!("{}: giving group {} access: {e}", p.display(), gid.as_raw()))
        };
        set(control, 0o660)?;
        if control.parent() == Some(self.rt().dir()) {
            set(self.rt().dir(), 0o710)?;
        }
        Ok(())
    }

    /// How driver server for `names` is started: its arguments, and the models it is
    /// connected to (see [`supervisor::fd_layout`]).
    fn server_launch(
        &mut self,
        names: &[String],
        devices: &[DeviceConfig],
    ) -> (Vec<String>, Vec<PathBuf>) {
        let served: Vec<&DeviceConfig> = names
            .iter()
            .filter_map(|n| devices.iter().find(|d| &d.name == n))
            .collect();
        let connect: Vec<PathBuf> = served
            .iter()
            .filter(|d| d.model().kind == models::Kind::Emulated)
            .map(|d| self.rt().device_socket(&d.name))
            .collect();
        let (keep_fds, conn_fds) = supervisor::fd_layout(true, 1, connect.len());
        let mut args = vec![
            "driver-host".to_string(),
            "--listen-fd".into(),
            keep_fds[0].to_string(),
            "--notify-fd".into(),
            supervisor::EVENT_FD.to_string(),
            "--restartable".into(),
        ];
        args.extend(self.confine_args(&served));
        let mut conn_fds = conn_fds.into_iter();
        let deadline = served
            .iter()
            .map(|d| d.request_deadline)
            .min()
            .unwrap_or(Duration::from_secs(30));
        args.extend(["--deadline-ms".into(), deadline.as_millis().to_string()]);
        for d in &served {
            let spec = if d.model().kind == models::Kind::Virtual {
                (d.model().spec)(d)
            } else {
                format!("vfio-user-fd:{}", conn_fds.next().expect("one per model"))
            };
            args.extend(["--device".into(), format!("{}={spec}", d.name)]);
            // The catalog's choice, as the registry records it: the server starts exactly it.
            if let Some(driver) = self.driver_of_mut(&d.name).map(|drv| drv.name.clone()) {
                args.extend(["--driver".into(), format!("{}={driver}", d.name)]);
            }
        }
        (args, connect)
    }

    /// Adds `bus` to the registry, or its children to the bus already there.
    fn merge_bus(&mut self, bus: Node) {
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
    fn detached_node(&mut self, d: &DeviceConfig, why: Option<&str>) {
        let (bus, kind, name) = if d.model().kind == models::Kind::Virtual {
            ("virtual", "device", format!("{}@virtual", d.name))
        } else {
            ("vfio-user", "pci-function", format!("{}@vfio-user", d.name))
        };
        let mut node = Node::new(kind, &name)
            .with("model", d.model.as_str())
            .with("backing", d.backing.as_str())
            .with("state", "detached");
        if let Some(why) = why {
            node.set("last-error", why);
        }
        self.merge_bus(Node::new("bus", bus).child(node));
    }

    /// Starts `devices`' models, probes them, matches their drivers and starts their driver
    /// servers, adding each to the registry.
    fn bring_up_devices(&mut self, devices: &[DeviceConfig]) -> Result<(), ManagerError> {
        let mut bus = Node::new("bus", "vfio-user");
        let mut virtual_bus = Node::new("bus", "virtual");
        for d in devices
            .iter()
            .filter(|d| d.model().kind == models::Kind::Virtual)
        {
            let Probed { personality, score } =
                outboard_drivers::probe_driver(&Probe::Virtual(&d.model)).map_err(|why| {
                    ManagerError::NoDriver {
                        device: d.name.clone(),
                        what: format!("model {}: {why}", d.model),
                    }
                })?;
            virtual_bus.children.push(
                Node::new("device", &format!("{}@virtual", d.name))
                    .with("model", d.model.as_str())
                    .child(
                        Node::new("driver", personality.driver)
                            .with("probe-score", score)
                            .with("placement", "separate")
                            .with("state", "starting")
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
            let launch = |e: String| ManagerError::Launch(format!("{}: {e}", d.name));
            let launched = (d.model().launch)(d).map_err(launch)?;
            let (listener, sock_path) =
                outboard_sys::bind_listener(&sock, rustix::net::SocketType::STREAM, 8)
                    .map_err(|e| launch(e.to_string()))?;
            let mut keep = vec![listener];
            let mut paths = vec![sock_path];
            // The fault socket exists only where the machine asks for fault injection: it
            // lets whoever reaches it make the device misbehave.
            let faults_socket =
                (d.fault_injection || self.opts.fault_injection).then_some(faults_socket);
            if let Some(path) = &faults_socket {
                let (faults, faults_path) =
                    outboard_sys::bind_listener(path, rustix::net::SocketType::SEQPACKET, 8)
                        .map_err(|e| launch(e.to_string()))?;
                keep.push(faults);
                paths.push(faults_path);
            }
            // The descriptors are passed in `keep`'s order: the listener, the fault socket if
            // any, then the model's own.
            let (fds, _) = supervisor::fd_layout(true, keep.len() + launched.fds.len(), 0);
            let mut args = vec![
                "device".to_string(),
                d.model.clone(),
                "--fd".into(),
                fds[0].to_string(),
                "--notify-fd".into(),
                supervisor::EVENT_FD.to_string(),
            ];
            if faults_socket.is_some() {
                args.extend(["--faults-fd".into(), fds[1].to_string()]);
            }
            args.extend(launched.args);
            for (flag, fd) in launched.fds {
                args.extend([flag.to_string(), format!("fd:{}", fds[keep.len()])]);
                keep.push(fd);
            }
            // Once it listens, it opens nothing: no filesystem, no network, no processes.
            args.extend(self.confine_args(&[d]));
            for f in &d.faults {
                args.extend(["--fault".into(), f.clone()]);
            }
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
                },
            )
            .map_err(ManagerError::Launch)?;
            p.wait_serving(Duration::from_secs(10))
                .map_err(ManagerError::Launch)?;
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
                .with("state", "running");
            if let Some(path) = &faults_socket {
                node.set("faults-socket", path.display().to_string());
            }
            self.procs.push(p);
            // Identity, BARs and IRQs, read the way a driver would.
            let f = PciFunction::open(&DeviceSpec::VfioUser(sock.clone())).map_err(|e| {
                ManagerError::Probe {
                    device: d.name.clone(),
                    why: e.to_string(),
                }
            })?;
            let id = f.identity();
            node.set("ids", format!("{:04x}:{:04x}", id.vendor, id.device));
            node.set(
                "class",
                format!("{:02x}{:02x}{:02x}", id.class, id.subclass, id.prog_if),
            );
            let bars: Vec<String> = f
                .bar_sizes()
                .map_err(|e| ManagerError::Probe {
                    device: d.name.clone(),
                    why: e.to_string(),
                })?
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
            let Probed { personality, score } = outboard_drivers::probe_driver(&Probe::Pci(&f))
                .map_err(|why| ManagerError::NoDriver {
                    device: d.name.clone(),
                    what: format!("{:04x}:{:04x}: {why}", id.vendor, id.device),
                })?;
            drop(f);
            let driver = Node::new("driver", personality.driver)
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
                        Placement::Separate => "starting",
                        Placement::Colocated => "linked into each client",
                    },
                )
                .child(class_device(personality.class, &d.name));
            bus.children.push(node.child(driver));
        }
        self.merge_bus(bus);
        self.merge_bus(virtual_bus);
        // Driver servers: one per server name; devices naming the same server are grouped.
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
            // The manager binds the server's socket and connects it to its devices: the server
            // opens nothing itself, and the socket outlives each incarnation (clients that
            // connect during a restart wait in its backlog instead of being refused).
            let (listener, path) =
                control::listen(&sock).map_err(|e| ManagerError::Launch(e.to_string()))?;
            let (args, connect) = self.server_launch(&names, devices);
            let log = self.created(self.rt().server_log(&server));
            let mut p = Process::spawn_passing(
                &self.opts.exe,
                &format!("driver server {server}"),
                &args,
                log,
                self.opts.verbose,
                supervisor::Passing {
                    events: true,
                    keep: vec![listener],
                    connect,
                    paths: vec![path],
                },
            )
            .map_err(ManagerError::Launch)?;
            let heartbeat = p
                .wait_serving(Duration::from_secs(30))
                .map_err(ManagerError::Launch)?;
            p.kind = supervisor::Kind::Server {
                name: server.clone(),
                devices: names.clone(),
            };
            let pid = p.pid();
            self.procs.push(p);
            self.serving(self.procs.len() - 1, heartbeat);
            for n in &names {
                // Serving means answering for the device: its class's own status record.
                let status = outboard_client::Channel::status(&sock, n, Duration::from_secs(10))
                    .map_err(|e| ManagerError::NotServed {
                        device: n.clone(),
                        why: e.into(),
                    })?;
                let node = match self
                    .registry
                    .find_mut("pci-function", &format!("{n}@vfio-user"))
                {
                    Some(f) => Some(f),
                    None => self.registry.find_mut("device", &format!("{n}@virtual")),
                };
                if let Some(drv) = node.and_then(|f| f.children.first_mut()) {
                    drv.set("server", server.as_str());
                    drv.set("server-socket", sock.display().to_string());
                    drv.set("pid", pid);
                    drv.set("state", "running");
                    drv.set("restarts", 0);
                    if let Some(b) = drv.children.first_mut() {
                        b.set("state", "serving");
                        status_props(b, &status);
                    }
                }
            }
        }
        Ok(())
    }

    /// Starts the machine's `[[export]]`s, each an `outboard export nbd` child with an event
    /// channel (it reports its clients), under the block device it serves in the registry.
    fn start_exports(&mut self) -> Result<(), ManagerError> {
        for (i, e) in self.machine.exports.clone().iter().enumerate() {
            let mut args = vec![
                "--control".to_string(),
                self.opts.control.display().to_string(),
                "export".into(),
                "nbd".into(),
                e.device.clone(),
                "--name".into(),
                e.name.clone(),
                "--notify-fd".into(),
                supervisor::EVENT_FD.to_string(),
            ];
            if e.read_only {
                args.push("--read-only".into());
            }
            if let Some((cert, key)) = &e.tls {
                args.extend(["--tls-cert".into(), cert.display().to_string()]);
                args.extend(["--tls-key".into(), key.display().to_string()]);
            }
            if let Some(psk) = &e.tls_psk {
                args.extend(["--tls-psk".into(), psk.display().to_string()]);
            }
            if let Some(ca) = &e.tls_verify_peer {
                args.extend(["--tls-verify-peer".into(), ca.display().to_string()]);
            }
            if e.insecure {
                args.push("--insecure".into());
            }
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
                    args.extend(["--socket".into(), p.display().to_string()]);
                    format!("nbd{s}+unix:///{}?socket={}", e.name, p.display())
                }
                ExportAddress::Tcp(a) => {
                    args.extend(["--listen".into(), a.to_string()]);
                    format!("nbd{s}://{a}/{}", e.name)
                }
            };
            let log = self.created(self.rt().dir().join(format!("export-{i}.log")));
            let mut p = Process::spawn_with_events(
                &self.opts.exe,
                &format!("export {}", e.name),
                &args,
                log,
                self.opts.verbose,
            )
            .map_err(ManagerError::Launch)?;
            p.kind = supervisor::Kind::Export {
                name: e.name.clone(),
            };
            // Not waited for here: the export opens its device through this manager, which
            // answers only once it runs. It reports itself ready (its first client report),
            // and a crash before that shows in the registry like any other.
            let pid = p.pid();
            self.procs.push(p);
            if let Some(b) = self.class_device_mut(&e.device) {
                b.children.push(
                    Node::new("export", &format!("nbd:{}", e.name))
                        .with("uri", uri)
                        .with("read-only", e.read_only)
                        .with("pid", pid)
                        .with("clients", 0)
                        .with("state", "starting"),
                );
            }
        }
        Ok(())
    }

    /// The registry.
    pub fn registry(&self) -> &Node {
        &self.registry
    }

    /// Serves the control API and supervises children until `stop` is set.
    ///
    /// Nothing here blocks: a control connection is an event source of its own, read only when
    /// it is readable and answered without waiting, so an idle or stuck client cannot delay a
    /// crash report or another client.
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), ManagerError> {
        let mut work: WorkLoop<Source> = WorkLoop::new()?;
        let (listener, _) = self.listener.as_ref().ok_or(ManagerError::NotStarted)?;
        work.add(listener.as_fd(), Source::Listener)?;
        for (i, p) in self.procs.iter().enumerate() {
            if p.exited.is_none() {
                work.add(p.fd(), Source::Child(i))?;
            }
            if let Some(ev) = &p.events {
                work.add(ev.as_fd(), Source::Events(i))?;
            }
        }
        let mut ready = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            ready.clear();
            work.wait(Some(self.next_check()), &mut ready)?;
            self.renumbered = false;
            for &source in &ready {
                if self.renumbered {
                    break;
                }
                match source {
                    Source::Listener => self.accept(&mut work),
                    Source::Child(i) => {
                        if self.procs.get_mut(i).is_some_and(Process::reap) {
                            let _ = work.remove(self.procs[i].fd());
                            self.exited(i, &mut work);
                        }
                    }
                    Source::Conn(i) => self.serve(&mut work, i),
                    Source::Events(i) => self.child_event(&mut work, i),
                }
            }
            self.supervise(&mut work);
            self.resume_accepts(&mut work);
        }
        Ok(())
    }

    /// Takes one event a driver server reported; a channel that closed or sent garbage is
    /// dropped (the pidfd reports the exit itself).
    fn child_event(&mut self, work: &mut WorkLoop<Source>, i: usize) {
        let Some(ev) = self.procs.get(i).and_then(|p| p.events.as_ref()) else {
            return;
        };
        let received = control::recv::<control::Event>(ev.as_fd(), Some(Duration::ZERO));
        if let Ok((event, _)) = &received {
            if !self.procs[i].kind.may_report(event) {
                tracing::warn!(
                    "{} (pid {}) reported {event:?}, about something it was not given: ignored",
                    self.procs[i].role,
                    self.procs[i].pid()
                );
                return;
            }
        }
        match received {
            Ok((
                control::Event::DeviceFailed {
                    device,
                    why,
                    restarting,
                },
                _,
            )) => {
                let state = if restarting {
                    tracing::error!("{device}: failed, its driver is re-opening it: {why}");
                    format!("failed, restarting: {why}")
                } else {
                    tracing::error!("{device}: its driver gave the device up: {why}");
                    format!("failed: {why}")
                };
                if let Some(drv) = self.driver_of_mut(&device) {
                    drv.set("state", state);
                }
            }
            // A model's readiness is waited for where it is started.
            Ok((control::Event::Serving, fds))
                if matches!(self.procs[i].kind, supervisor::Kind::Server { .. }) =>
            {
                self.serving(i, fds)
            }
            Ok((control::Event::Serving, _)) => {}
            Ok((control::Event::ExportClients { export, clients }, _)) => {
                self.procs[i].served = true;
                self.procs[i].restarts.served();
                if let Some(n) = self.registry.find_mut("export", &format!("nbd:{export}")) {
                    n.set("state", "running");
                    n.set("clients", clients.len());
                    n.set("peers", clients.join(", "));
                }
            }
            Ok((control::Event::Quiesced { device }, _)) => {
                if self.detaching.contains(&device) {
                    self.finish_detach(&device, work);
                } else if self.suspended.contains(&device) {
                    tracing::info!("{device}: suspended (quiesced, nothing in flight)");
                    if let Some(b) = self.class_device_mut(&device) {
                        b.set("state", "suspended");
                    }
                }
            }
            Ok((control::Event::DeviceRecovered { device }, _)) => {
                tracing::warn!("{device}: its driver brought the device back");
                if let Some(drv) = self.driver_of_mut(&device) {
                    drv.set("state", "running (recovered)");
                }
            }
            Err(outboard_session::SessionError::Timeout) => {}
            Err(_) => {
                if let Some(ev) = self.procs[i].events.take() {
                    let _ = work.remove(ev.as_fd());
                }
            }
        }
    }

    /// How long the loop may sleep: until the next restart is due, and no longer than the
    /// heartbeat check allows.
    fn next_check(&self) -> Duration {
        let now = std::time::Instant::now();
        let mut wait = Duration::from_millis(100);
        if let Some(t) = self.accept_paused {
            wait = wait.min(t.saturating_duration_since(now));
        }
        for p in &self.procs {
            if let Some(at) = p.restart_at {
                wait = wait.min(at.saturating_duration_since(now));
            }
            if p.heartbeat.is_some() {
                wait = wait.min(Duration::from_millis(50));
            }
        }
        wait
    }

    /// The restart policy of the devices a process serves or models.
    fn policy(&self, kind: &supervisor::Kind) -> supervisor::RestartPolicy {
        let first = match kind {
            supervisor::Kind::Model { device } => Some(device),
            supervisor::Kind::Server { devices, .. } => devices.first(),
            supervisor::Kind::Export { .. } => None,
        };
        first
            .and_then(|n| self.machine.devices.iter().find(|d| &d.name == n))
            .map(|d| d.restart)
            .unwrap_or_default()
    }

    /// The class devices a process serves (a server) or models (a model).
    fn devices_of(kind: &supervisor::Kind) -> Vec<String> {
        match kind {
            supervisor::Kind::Model { device } => vec![device.clone()],
            supervisor::Kind::Server { devices, .. } => devices.clone(),
            supervisor::Kind::Export { .. } => Vec::new(),
        }
    }

    /// Records a state on the driver and the class device node of each of `devices`.
    fn set_state(&mut self, devices: &[String], driver: &str, device: &str) {
        for n in devices {
            if let Some(drv) = self.driver_of_mut(n) {
                drv.set("state", driver);
            }
            if let Some(b) = self.class_device_mut(n) {
                b.set("state", device);
            }
        }
    }

    /// Child `i` exited while the machine runs: a driver server or a model is started again
    /// (at once the first time, with back-off after that) until it crashes more often than
    /// its policy allows; then it is given up and its clients are told so.
    fn exited(&mut self, i: usize, work: &mut WorkLoop<Source>) {
        if let Some(ev) = self.procs[i].events.take() {
            let _ = work.remove(ev.as_fd());
        }
        // Progress, read before the heartbeat page goes: a server whose loop turned after it
        // said it serves; a model that came into service. A restart an operator asked for
        // counts as progress too.
        let p = &self.procs[i];
        let progressed = p.planned
            || match &p.kind {
                supervisor::Kind::Server { .. } => {
                    p.served && p.heartbeat.as_ref().is_some_and(|h| h.turned())
                }
                _ => p.served,
            };
        let death = supervisor::Death::of(p.exited, progressed, p.hung);
        if matches!(p.kind, supervisor::Kind::Server { .. }) {
            let fault = supervisor::is_fault(p.exited, p.hung) || p.model_crashed;
            let blame = p.heartbeat.as_ref().and_then(supervisor::Heartbeat::blame);
            self.weigh_for_quarantine(i, fault, blame, death);
        }
        self.procs[i].heartbeat = None;
        self.procs[i].planned = false;
        let kind = self.procs[i].kind.clone();
        if let supervisor::Kind::Export { name } = &kind {
            self.export_exited(i, name, death);
            return;
        }
        let now = std::time::Instant::now();
        let policy = self.policy(&kind);
        let p = &mut self.procs[i];
        let status = match (p.hung, p.exited) {
            (true, _) => format!("hung: no heartbeat for {:?}, killed", policy.heartbeat),
            (false, Some(s)) => s.to_string(),
            (false, None) => String::new(),
        };
        let (role, pid, log) = (p.role.clone(), p.pid(), p.log.clone());
        p.down_since.get_or_insert(now);
        let delay = p.restarts.crashed(now, &policy, death);
        let total = p.restarts.total;
        // What ended it, and no dead pid shown as current.
        let devices = Self::devices_of(&kind);
        let last_exit = format!("{role} (pid {pid}) {status}");
        match &kind {
            supervisor::Kind::Model { device } => {
                if let Some(f) = self
                    .registry
                    .find_mut("pci-function", &format!("{device}@vfio-user"))
                {
                    f.props.remove("pid");
                    f.set("last-exit", last_exit.clone());
                }
            }
            _ => {
                for n in &devices {
                    if let Some(drv) = self.driver_of_mut(n) {
                        drv.props.remove("pid");
                        drv.set("last-exit", last_exit.clone());
                    }
                }
            }
        }
        // A server whose model was given up has nothing to serve.
        let model_gone = Self::devices_of(&kind).iter().find_map(|n| {
            self.procs.iter().find_map(|m| {
                (m.kind == (supervisor::Kind::Model { device: n.clone() }))
                    .then(|| m.gave_up.clone())
                    .flatten()
            })
        });
        let delay = if model_gone.is_some() { None } else { delay };
        // The log explains the crash: it outlives the machine.
        self.created.retain(|f| f != &log);
        match delay {
            Some(d) => {
                tracing::warn!(
                    "{role} (pid {pid}) exited ({status}); restart {total} in {d:?}; log {}",
                    log.display()
                );
                self.procs[i].restart_at = Some(now + d);
                self.set_state(
                    &devices,
                    &format!("restarting ({role} exited: {status})"),
                    "restarting",
                );
            }
            None => {
                let cause = match &model_gone {
                    Some(_) => format!("{role}: its device model was given up"),
                    None => crash_loop(&role, &status, policy.limit, &log),
                };
                let retry = policy.retry;
                let why = format!(
                    "gave up: {cause}; trying again in {retry:?} (or now: outboard restart {})",
                    devices.first().map(String::as_str).unwrap_or("DEVICE")
                );
                tracing::error!("{why}");
                eprintln!("outboard: {why}");
                self.procs[i].gave_up = Some(why.clone());
                // Given up is not forever: tried again on a slow schedule.
                self.procs[i].restart_at = Some(now + retry);
                self.set_state(&devices, &why, &why);
            }
        }
        // A server that ended because its device failed (a hung or lying model): the model
        // is reset the only way an emulated device can be, by starting it again on its
        // backing. It is reaped here, so the server cannot start before it is back.
        // So is one that hung (most often in a call to a model that stopped answering) or
        // crashed before it served (it could not bring its device up). One killed from
        // outside before it served says nothing about the device.
        let p = &self.procs[i];
        let device_failed = p.exited.and_then(|s| s.code())
            == Some(outboard_server::host::EXIT_DEVICE_FAILED)
            || p.hung
            || (!p.served && death == supervisor::Death::Crash);
        let device_failed = device_failed && matches!(kind, supervisor::Kind::Server { .. });
        if device_failed && delay.is_some() {
            // A model started after this server is a new one already: the failure was the
            // old one's.
            let server_started = self.procs[i].started;
            let models: Vec<usize> = (0..self.procs.len())
                .filter(|&j| {
                    let m = &self.procs[j];
                    m.exited.is_none()
                        && m.started <= server_started
                        && matches!(&m.kind, supervisor::Kind::Model { device } if devices.contains(device))
                })
                .collect();
            for j in models {
                let m = &mut self.procs[j];
                tracing::warn!(
                    "{}: its driver found the device failed; restarting it",
                    m.role
                );
                let _ = m.child.kill();
                m.exited = m.child.wait().ok();
                let _ = work.remove(m.fd());
                self.exited(j, work);
            }
        }
        if let supervisor::Kind::Model { device } = &kind {
            if let Some(f) = self
                .registry
                .find_mut("pci-function", &format!("{device}@vfio-user"))
            {
                f.set(
                    "state",
                    if delay.is_some() {
                        "restarting"
                    } else {
                        "gave up"
                    },
                );
                f.set("restarts", total);
            }
            // Its driver cannot serve without it: end the server now (it would notice at its
            // next request), so it starts again on the new model and its clients replay.
            let model_fault = supervisor::is_fault(self.procs[i].exited, false);
            for p in &mut self.procs {
                if p.kind.serves(device) && p.exited.is_none() {
                    p.model_crashed |= model_fault;
                    let _ = rustix::process::kill_process(
                        rustix::process::Pid::from_child(&p.child),
                        rustix::process::Signal::KILL,
                    );
                }
            }
        }
    }

    /// Weighs the death of driver server `i` for quarantine. A crash of its own (or of its
    /// model) starts the next incarnation isolated, so that another crash names the request
    /// in the device; a request named at `QUARANTINE_AFTER` crashes in a row is failed by the
    /// next incarnation instead of sent again. A death that was no fault ends isolation.
    fn weigh_for_quarantine(
        &mut self,
        i: usize,
        fault: bool,
        blame: Option<outboard_server::blame::Suspect>,
        death: supervisor::Death,
    ) {
        const ISOLATE: Duration = Duration::from_secs(2);
        let p = &mut self.procs[i];
        if !fault {
            if death == supervisor::Death::AfterProgress {
                p.clear_arg("--isolate-ms");
                p.clear_arg("--quarantine");
                p.suspect = None;
            }
            return;
        }
        if let Some(b) = blame {
            // The first crash of a series had it among everything in flight, unnamed.
            let strikes = match p.suspect {
                Some((s, n)) if s == b => n + 1,
                _ => 2,
            };
            if strikes >= control::QUARANTINE_AFTER {
                tracing::error!(
                    "{}: request {b} crashed the driver {strikes} times: the next server fails it",
                    p.role
                );
                p.set_arg("--quarantine", &b.to_string(), true);
                p.suspect = None;
            } else {
                tracing::warn!(
                    "{}: request {b} was in the device at this crash ({strikes})",
                    p.role
                );
                p.suspect = Some((b, strikes));
            }
        }
        p.set_arg("--isolate-ms", &ISOLATE.as_millis().to_string(), true);
    }

    /// Starts what is due to restart, and kills driver servers whose heartbeat stopped.
    fn supervise(&mut self, work: &mut WorkLoop<Source>) {
        let now = std::time::Instant::now();
        for i in 0..self.procs.len() {
            let kind = self.procs[i].kind.clone();
            if let Some(hb) = self.procs[i].heartbeat.as_mut() {
                let still = hb.still_for(now);
                let limit = self.policy(&kind).heartbeat;
                if still > limit && self.procs[i].exited.is_none() {
                    let p = &mut self.procs[i];
                    tracing::error!(
                        "{} (pid {}) is hung: its loop has not turned for {still:?}; killing it",
                        p.role,
                        p.pid()
                    );
                    p.heartbeat = None;
                    p.hung = true;
                    let _ = rustix::process::kill_process(
                        rustix::process::Pid::from_child(&p.child),
                        rustix::process::Signal::KILL,
                    );
                    let devices = Self::devices_of(&kind);
                    for n in &devices {
                        if let Some(drv) = self.driver_of_mut(n) {
                            drv.set(
                                "last-hang",
                                format!("no heartbeat for {} ms", still.as_millis()),
                            );
                        }
                    }
                }
            }
            if self.procs[i].restart_at.is_none_or(|at| at > now) {
                continue;
            }
            // A server starts only once its models run again.
            let models_down = Self::devices_of(&kind).iter().any(|n| {
                self.procs.iter().any(|m| {
                    m.kind == (supervisor::Kind::Model { device: n.clone() })
                        && (m.restart_at.is_some() || m.exited.is_some())
                })
            });
            if matches!(kind, supervisor::Kind::Server { .. }) && models_down {
                continue;
            }
            self.restart(i, work);
        }
    }

    /// Starts child `i` again.
    fn restart(&mut self, i: usize, work: &mut WorkLoop<Source>) {
        self.procs[i].restart_at = None;
        let kind = self.procs[i].kind.clone();
        let p = &mut self.procs[i];
        if matches!(kind, supervisor::Kind::Server { .. }) {
            // The sessions that held range locks claim them back before anyone gets new ones.
            p.set_arg("--lock-grace-ms", &LOCK_GRACE.as_millis().to_string(), true);
        }
        if p.postponed_for_descriptors(ACCEPT_BACKOFF) {
            return;
        }
        if let Err(e) = p.respawn(&self.opts.exe, self.opts.verbose) {
            tracing::error!("{e}");
            // Counted as another crash: back-off, and in the end giving up, apply.
            p.exited = None;
            let now = std::time::Instant::now();
            let policy = self.policy(&kind);
            let p = &mut self.procs[i];
            match p.restarts.crashed(now, &policy, supervisor::Death::Crash) {
                Some(d) => p.restart_at = Some(now + d),
                None => {
                    let why = format!(
                        "gave up: {e}; trying again in {:?} (or now: outboard restart)",
                        policy.retry
                    );
                    p.gave_up = Some(why.clone());
                    p.restart_at = Some(now + policy.retry);
                    self.set_state(&Self::devices_of(&kind), &why, &why);
                }
            }
            return;
        }
        p.gave_up = None;
        let pid = p.pid();
        let _ = work.add(p.fd(), Source::Child(i));
        if let Some(ev) = &p.events {
            let _ = work.add(ev.as_fd(), Source::Events(i));
        }
        let total = p.restarts.total;
        if let supervisor::Kind::Model { device } = &kind {
            // The model is quick to start; its server waits for it.
            let p = &mut self.procs[i];
            if let Err(e) = p.wait_serving(Duration::from_secs(10)) {
                tracing::error!("{e}");
                return;
            }
            p.served = true;
            p.restarts.served();
            let down = p.down_since.take().map(|t| t.elapsed()).unwrap_or_default();
            tracing::warn!("device model for {device} restarted (pid {pid}) in {down:?}");
            if let Some(f) = self
                .registry
                .find_mut("pci-function", &format!("{device}@vfio-user"))
            {
                f.set("state", "running");
                f.set("pid", pid);
                f.set("restarts", total);
            }
        } else if let supervisor::Kind::Export { name } = &kind {
            self.procs[i].served = false;
            if let Some(n) = self.registry.find_mut("export", &format!("nbd:{name}")) {
                n.set("pid", pid);
                n.set("state", "starting");
            }
        } else {
            let devices = Self::devices_of(&kind);
            for n in &devices {
                if let Some(drv) = self.driver_of_mut(n) {
                    drv.set("pid", pid);
                    drv.set("restarts", total);
                }
            }
            self.set_state(&devices, "starting", "restarting");
        }
    }

    /// Driver server `i` serves (first start or a restart): its heartbeat starts counting.
    fn serving(&mut self, i: usize, fds: Vec<OwnedFd>) {
        let p = &mut self.procs[i];
        p.served = true;
        p.restarts.served();
        match fds.into_iter().next().map(supervisor::Heartbeat::new) {
            Some(Ok(hb)) => p.heartbeat = Some(hb),
            Some(Err(e)) => tracing::warn!("{}: {e}", p.role),
            None => tracing::warn!("{}: no heartbeat page", p.role),
        }
        let (role, pid, total) = (p.role.clone(), p.pid(), p.restarts.total);
        let down = p.down_since.take().map(|t| t.elapsed());
        let devices = Self::devices_of(&p.kind.clone());
        if let Some(down) = down {
            tracing::warn!("{role} (pid {pid}) serves again, {down:?} after it went down");
            for n in &devices {
                if let Some(drv) = self.driver_of_mut(n) {
                    drv.set("last-restart-ms", down.as_secs_f64() * 1e3);
                    drv.set("restarts", total);
                }
            }
            self.set_state(
                &devices,
                &format!("running (restarted {total} times)"),
                "serving",
            );
        } else {
            self.set_state(&devices, "running", "serving");
        }
        // A new incarnation started with what was suspended quiesced (`--quiesce`); it
        // reports it drained, which needs the command's reply path: ask again.
        let suspended: Vec<String> = devices
            .into_iter()
            .filter(|n| self.suspended.contains(n) || self.detaching.contains(n))
            .collect();
        for n in suspended {
            self.command(&n, control::Command::Quiesce { device: n.clone() });
        }
    }

    /// Sends `cmd` to the driver server serving class device `name`, and records the state
    /// it leads to; false if no server of this machine serves it now.
    fn command(&mut self, name: &str, cmd: control::Command) -> bool {
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
            control::Command::Quiesce { .. } => "suspending",
            control::Command::Resume { .. } => "serving",
        };
        if let Some(b) = self.class_device_mut(name) {
            b.set("state", state);
        }
        true
    }

    /// Quiesces class device `name` (or puts it back in service): its driver server is told
    /// now, and an incarnation started later (a restart) starts with it quiesced, so it cannot
    /// take a request its clients replay before the command reaches it. The one path suspend
    /// and detach share. False if no server runs now (the restart will apply it).
    fn quiesce(&mut self, name: &str, on: bool) -> bool {
        for p in self.procs.iter_mut().filter(|p| p.kind.serves(name)) {
            p.set_arg("--quiesce", name, on);
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
    fn attach(
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
                if !m.exports.is_empty() {
                    return invalid("attach takes [[device]] tables only".into());
                }
                if m.devices.is_empty() {
                    return invalid("no [[device]] table to attach".into());
                }
                for d in &m.devices {
                    if self.machine.devices.iter().any(|o| o.name == d.name) {
                        return invalid(format!("a device named {:?} exists already", d.name));
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
    fn attach_one(&mut self, d: &DeviceConfig, work: &mut WorkLoop<Source>) -> Reply {
        tracing::info!("{}: attaching", d.name);
        self.remove_function_node(&d.name);
        let before = self.procs.len();
        match self.bring_up_devices(std::slice::from_ref(d)) {
            Ok(()) => {
                for i in before..self.procs.len() {
                    let p = &self.procs[i];
                    let _ = work.add(p.fd(), Source::Child(i));
                    if let Some(ev) = &p.events {
                        let _ = work.add(ev.as_fd(), Source::Events(i));
                    }
                }
                if let Some(m) = self.machine.devices.iter_mut().find(|m| m.name == d.name) {
                    m.attached = true;
                }
                tracing::warn!("{}: attached", d.name);
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
    fn remove_function_node(&mut self, name: &str) {
        let names = [format!("{name}@vfio-user"), format!("{name}@virtual")];
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
    fn retire(&mut self, gone: &[usize], work: &mut WorkLoop<Source>) {
        self.renumbered = true;
        for p in &self.procs {
            let _ = work.remove(p.fd());
            if let Some(ev) = &p.events {
                let _ = work.remove(ev.as_fd());
            }
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
            if let Some(ev) = &p.events {
                let _ = work.add(ev.as_fd(), Source::Events(i));
            }
        }
    }

    /// `outboard detach NAME`: phase one (stop taking new requests) and two (drain) run in
    /// its driver server; [`Manager::finish_detach`] is phase three.
    fn detach(&mut self, name: &str, work: &mut WorkLoop<Source>) -> Reply {
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
                node.set("state", "detaching");
                Reply::Status { node: node.clone() }
            }
            None => detached(name),
        }
    }

    /// Phase three of a detach: the device has nothing in flight. Its driver server and
    /// model stop (their sessions hang up; clients see `device gone`), their sockets go, and
    /// the registry shows the device detached.
    fn finish_detach(&mut self, name: &str, work: &mut WorkLoop<Source>) {
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
        tracing::warn!("{name}: detached (its driver server and model stopped)");
    }

    /// Stops driver server `s`, which serves `name` and other devices, and sets it up to
    /// start without `name`; [`Manager::start_again`] starts it once `name`'s model is gone.
    /// Its other devices' clients see their server go and come back: they resume and replay,
    /// as after a crash.
    fn shed_device(&mut self, s: usize, name: &str, work: &mut WorkLoop<Source>) {
        let supervisor::Kind::Server {
            name: server,
            devices,
        } = self.procs[s].kind.clone()
        else {
            return;
        };
        let rest: Vec<String> = devices.into_iter().filter(|d| d != name).collect();
        let machine = self.machine.devices.clone();
        let (args, connect) = self.server_launch(&rest, &machine);
        let p = &mut self.procs[s];
        let _ = work.remove(p.fd());
        if let Some(ev) = p.events.take() {
            let _ = work.remove(ev.as_fd());
        }
        p.heartbeat = None;
        p.stop(Duration::from_secs(5));
        p.set_launch(args, connect);
        for n in &rest {
            if self.suspended.contains(n) || self.detaching.contains(n) {
                self.procs[s].set_arg("--quiesce", n, true);
            }
        }
        self.procs[s].kind = supervisor::Kind::Server {
            name: server,
            devices: rest.clone(),
        };
        self.procs[s].down_since = Some(std::time::Instant::now());
        self.set_state(&rest, "restarting (a device was detached)", "restarting");
    }

    /// Starts stopped driver server `s` again (its `Serving` event completes the restart).
    fn start_again(&mut self, s: usize, work: &mut WorkLoop<Source>) {
        let p = &mut self.procs[s];
        if p.postponed_for_descriptors(ACCEPT_BACKOFF) {
            return;
        }
        if let Err(e) = p.respawn(&self.opts.exe, self.opts.verbose) {
            tracing::error!("{e}");
            p.exited = None;
            p.restart_at = Some(std::time::Instant::now());
            return;
        }
        let _ = work.add(p.fd(), Source::Child(s));
        if let Some(ev) = &p.events {
            let _ = work.add(ev.as_fd(), Source::Events(s));
        }
    }

    /// `outboard power NAME suspend|resume`.
    fn power(&mut self, name: &str, suspend: bool) -> Reply {
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

    /// Class device `name`'s registry node, whatever its class.
    fn class_device(&self, name: &str) -> Option<&Node> {
        fn find<'a>(n: &'a Node, name: &str) -> Option<&'a Node> {
            if n.kind.ends_with("-device") && n.name == name {
                return Some(n);
            }
            n.children.iter().find_map(|c| find(c, name))
        }
        find(&self.registry, name)
    }

    /// The same, to change.
    fn class_device_mut(&mut self, name: &str) -> Option<&mut Node> {
        fn find<'a>(n: &'a mut Node, name: &str) -> Option<&'a mut Node> {
            if n.kind.ends_with("-device") && n.name == name {
                return Some(n);
            }
            n.children.iter_mut().find_map(|c| find(c, name))
        }
        find(&mut self.registry, name)
    }

    /// The driver node serving class device `name`.
    /// The driver node serving class device `name`.
    fn driver_of(&self, name: &str) -> Option<&Node> {
        fn find<'a>(n: &'a Node, name: &str) -> Option<&'a Node> {
            if n.kind == "driver" && n.children.iter().any(|c| c.name == name) {
                return Some(n);
            }
            n.children.iter().find_map(|c| find(c, name))
        }
        find(&self.registry, name)
    }

    fn driver_of_mut(&mut self, name: &str) -> Option<&mut Node> {
        fn find<'a>(n: &'a mut Node, name: &str) -> Option<&'a mut Node> {
            if n.kind == "driver" && n.children.iter().any(|c| c.name == name) {
                return Some(n);
            }
            n.children.iter_mut().find_map(|c| find(c, name))
        }
        find(&mut self.registry, name)
    }

    fn accept(&mut self, work: &mut WorkLoop<Source>) {
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
                Some(why) => self.denied.insert(slot, why),
                None => self.denied.remove(&slot),
            };
        }
    }

    /// Listens on the control socket again once a pause after a failed accept is over.
    fn resume_accepts(&mut self, work: &mut WorkLoop<Source>) {
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
    fn log_accept(&mut self, now: std::time::Instant, what: &str) {
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

    /// Export `i` (named `name`) exited while the machine runs: the clients it had are gone
    /// with it, and it is started again like a driver server (at once if it had served,
    /// with back-off in a crash loop, given up past its policy's limit).
    fn export_exited(&mut self, i: usize, name: &str, death: supervisor::Death) {
        let now = std::time::Instant::now();
        let policy = supervisor::RestartPolicy::default();
        let p = &mut self.procs[i];
        let status = p.exited.map(|s| s.to_string()).unwrap_or_default();
        let (role, pid, log) = (p.role.clone(), p.pid(), p.log.clone());
        let delay = p.restarts.crashed(now, &policy, death);
        let total = p.restarts.total;
        // The log explains the crash: it outlives the machine.
        self.created.retain(|f| f != &log);
        let state = match delay {
            Some(d) => {
                tracing::warn!(
                    "{role} (pid {pid}) exited ({status}); restart {total} in {d:?}; log {}",
                    log.display()
                );
                self.procs[i].restart_at = Some(now + d);
                format!("restarting ({status})")
            }
            None => {
                let why = format!(
                    "gave up: {}; trying again in {:?}",
                    crash_loop(&role, &status, policy.limit, &log),
                    policy.retry
                );
                tracing::error!("{why}");
                eprintln!("outboard: {why}");
                self.procs[i].gave_up = Some(why.clone());
                self.procs[i].restart_at = Some(now + policy.retry);
                why
            }
        };
        if let Some(n) = self.registry.find_mut("export", &format!("nbd:{name}")) {
            n.set("state", state);
            n.set("clients", 0);
            n.set("peers", "");
            n.set("restarts", total);
            n.props.remove("pid");
        }
    }

    /// Answers one request on control connection `i` without blocking; a connection that
    /// hung up, sent garbage or does not read its replies is closed.
    fn serve(&mut self, work: &mut WorkLoop<Source>, i: usize) {
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

    fn close_conn(&mut self, work: &mut WorkLoop<Source>, i: usize) {
        if let Some(conn) = self.conns.get_mut(i).and_then(Option::take) {
            let _ = work.remove(conn.as_fd());
        }
        self.accepted.retain(|&s| s != i);
        self.denied.remove(&i);
    }

    fn answer(&mut self, req: Request, work: &mut WorkLoop<Source>) -> Reply {
        match req {
            Request::Power { name, suspend } => self.power(&name, suspend),
            Request::Attach { name, description } => self.attach(name, description, work),
            Request::Detach { name } => self.detach(&name, work),
            Request::Restart { name } => self.restart_by_hand(&name),
            Request::List => Reply::Registry {
                tree: self.registry.clone(),
            },
            Request::Open { name } => self.open(&name),
            Request::Status { name } => match self.class_device(&name) {
                Some(node) => Reply::Status { node: node.clone() },
                None if self.machine.devices.iter().any(|d| d.name == name) => detached(&name),
                None => refuse(Code::NoSuchDevice, format!("no device named {name:?}")),
            },
        }
    }

    /// `outboard restart NAME`: a given-up model or server of `name` is started again now, a
    /// running server is ended and started again (its death counts as progress); either way
    /// the crash history is forgiven.
    fn restart_by_hand(&mut self, name: &str) -> Reply {
        let Some(node) = self.class_device(name).cloned() else {
            return match self.machine.devices.iter().any(|d| d.name == name) {
                true => refuse(
                    Code::DeviceGone,
                    format!("{name} is detached: outboard attach {name}"),
                ),
                false => refuse(Code::NoSuchDevice, format!("no device named {name:?}")),
            };
        };
        let now = std::time::Instant::now();
        for p in &mut self.procs {
            let model = matches!(&p.kind, supervisor::Kind::Model { device } if device == name);
            let server = p.kind.serves(name);
            if !(model || server) {
                continue;
            }
            p.restarts.forgive();
            if p.gave_up.is_some() || p.exited.is_some() {
                p.gave_up = None;
                p.restart_at = Some(now);
            } else if server {
                p.planned = true;
                let _ = rustix::process::pidfd_send_signal(&p.pidfd, rustix::process::Signal::KILL);
            }
        }
        tracing::warn!("{name}: restarted by hand");
        self.set_state(
            &[name.to_string()],
            "restarting (outboard restart)",
            "restarting",
        );
        Reply::Status {
            node: self.class_device(name).cloned().unwrap_or(node),
        }
    }

    /// The state of the driver serving `name`, if it is not serving.
    fn failure(&self, name: &str) -> Option<String> {
        fn driver_of<'a>(n: &'a Node, name: &str) -> Option<&'a Node> {
            if n.kind == "driver" && n.children.iter().any(|c| c.name == name) {
                return Some(n);
            }
            n.children.iter().find_map(|c| driver_of(c, name))
        }
        let state = driver_of(&self.registry, name)?
            .props
            .get("state")?
            .as_str()?;
        (state.starts_with("crashed")
            || state.starts_with("failed")
            || state.starts_with("gave up"))
        .then(|| state.to_string())
    }

    fn open(&self, name: &str) -> Reply {
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
        let restarting = self
            .class_device(name)
            .and_then(|b| b.props.get("state"))
            .and_then(|s| s.as_str())
            == Some("restarting");
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

    /// Stops every child (driver servers first, then device models) and removes the files the
    /// manager created.
    pub fn shutdown(&mut self) {
        // First: a client whose server stops asks the manager whether it comes back, and a
        // manager that no longer answers says no.
        self.listener = None;
        let mut crash_logs = Vec::new();
        for p in self.procs.iter_mut().rev() {
            // One that died on its own before we asked: its log explains why.
            if p.reap() {
                eprintln!(
                    "outboard: {} (pid {}) had exited: {}; see {}",
                    p.role,
                    p.pid(),
                    p.exited.map(|s| s.to_string()).unwrap_or_default(),
                    p.log.display()
                );
                crash_logs.push(p.log.clone());
            }
            p.stop(Duration::from_secs(5));
        }
        self.created.retain(|f| !crash_logs.contains(f));
        // Their listening sockets, which the manager bound, go with them.
        self.procs.clear();
        self.conns.clear();
        self.accepted.clear();
        self.listener = None;
        for f in self.created.drain(..) {
            // Children remove their own sockets; one killed leaves a stale socket behind.
            if !outboard_sys::is_live(&f) {
                let _ = std::fs::remove_file(&f);
            }
        }
        // Last: releasing the lock lets another manager in.
        self.runtime = None;
    }

    /// The control socket.
    pub fn control(&self) -> &Path {
        &self.opts.control
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Zero-filled memory for a `mem:SIZE` disk, held by the manager across model restarts.
/// An error reply: a machine-readable `code` and what went wrong.
/// Why a process is given up: the death that went past `limit` crashes in a row without
/// progress (or the only one, with `restarts = 0`), and where its log is.
fn crash_loop(role: &str, status: &str, limit: u32, log: &Path) -> String {
    match limit {
        0 => format!("{role} exited ({status}) and restarts = 0"),
        n => format!(
            "{role} exited ({status}), {n} times in a row without serving; log {}",
            log.display()
        ),
    }
}

/// How long accepting pauses after it failed (out of descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// At most one log line per interval about refused or failed accepts.
const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Most control connections held at once: a quarter of the descriptor limit (at most 256),
/// so that a flood leaves the other three quarters to restarts and children.
fn max_control_connections() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(4096);
    (limit / 4).clamp(4, 256) as usize
}

/// Who may use the control socket: the manager's own user, root, and members of
/// `group` if one is configured (checked with `SO_PEERCRED`, which the kernel fills in at
/// connect time and the peer cannot forge).
fn control_peer_allowed(conn: BorrowedFd<'_>, group: Option<u32>) -> Result<(), String> {
    let cred = rustix::net::sockopt::socket_peercred(conn)
        .map_err(|e| format!("cannot tell who connected: {e}"))?;
    let (uid, gid) = (cred.uid.as_raw(), cred.gid.as_raw());
    let me = rustix::process::geteuid().as_raw();
    if uid == 0 || uid == me || group.is_some_and(|g| g == gid) {
        return Ok(());
    }
    Err(format!(
        "uid {uid} (pid {}) may not use this manager: only uid {me}, root{} may",
        cred.pid.as_raw_nonzero(),
        group.map(|g| format!(" and group {g}")).unwrap_or_default()
    ))
}

/// A class's status record (whatever its class) as registry properties: each scalar field,
/// named in kebab-case; the device's name is the node's own.
fn status_props(node: &mut Node, status: &serde_json::Value) {
    let Some(fields) = status.as_object() else {
        return;
    };
    for (key, value) in fields {
        if key == "name" || value.is_object() || value.is_array() || value.is_null() {
            continue;
        }
        node.set(&key.replace('_', "-"), value.clone());
    }
}

/// A class device's registry node: its kind names its class (`block-device`,
/// `entropy-device`).
fn class_device(class: &str, name: &str) -> Node {
    Node::new(&format!("{class}-device"), name).with("class", class)
}

/// The answer about a device that is detached.
fn detached(name: &str) -> Reply {
    refuse(
        Code::DeviceGone,
        format!("{name} is detached: the device is gone until it is attached again"),
    )
}

fn refuse(code: Code, message: impl Into<String>) -> Reply {
    Reply::Error {
        code,
        message: message.into(),
    }
}
