//! The device manager (DESIGN.md §2.6), version 1.
//!
//! Reads a machine description ([`config`]), starts each device model and driver server as a
//! process ([`supervisor`]), builds the registry ([`registry`]), answers the control API
//! ([`api`]) on a SEQPACKET socket, reports a crashed process instead of hanging, and shuts
//! everything down cleanly. Matching uses the drivers' personalities; restart, hot-plug and
//! confinement come later.
#![deny(missing_docs)]

pub mod api;
pub mod config;
pub mod open;
pub mod registry;
pub mod supervisor;

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outboard_env::WorkLoop;
use outboard_hw::{DeviceSpec, IrqKind, PciFunction};
use outboard_session::control;

use crate::api::{Reply, Request};
use crate::config::{Machine, Placement};
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
}

/// The default control socket: `$OUTBOARD_CONTROL`, else `$XDG_RUNTIME_DIR/outboard/control.sock`,
/// else `/tmp/outboard-$UID/control.sock`.
pub fn default_control() -> PathBuf {
    if let Some(p) = std::env::var_os("OUTBOARD_CONTROL") {
        return PathBuf::from(p);
    }
    default_runtime_dir().join("control.sock")
}

/// The default runtime directory.
pub fn default_runtime_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("outboard"),
        None => PathBuf::from(format!(
            "/tmp/outboard-{}",
            rustix::process::getuid().as_raw()
        )),
    }
}

const LISTENER: u64 = u64::MAX;

/// A running machine.
pub struct Manager {
    machine: Machine,
    opts: ManagerOptions,
    listener: Option<OwnedFd>,
    procs: Vec<Process>,
    registry: Node,
    created: Vec<PathBuf>,
}

fn size_text(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

impl Manager {
    /// Starts every device model and driver server of `machine`. On failure, whatever was
    /// started is stopped again.
    pub fn start(machine: Machine, opts: ManagerOptions) -> Result<Self, String> {
        std::fs::create_dir_all(&opts.runtime_dir)
            .map_err(|e| format!("{}: {e}", opts.runtime_dir.display()))?;
        let _ = rustix::fs::chmod(&opts.runtime_dir, rustix::fs::Mode::from_raw_mode(0o700));
        let mut m = Self {
            registry: Node::new("machine", &machine.name).with("state", "starting"),
            machine,
            opts,
            listener: None,
            procs: Vec::new(),
            created: Vec::new(),
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

    fn path(&mut self, name: &str) -> PathBuf {
        let p = self.opts.runtime_dir.join(name);
        self.created.push(p.clone());
        p
    }

    fn bring_up(&mut self) -> Result<(), String> {
        let listener = control::listen(&self.opts.control).map_err(|e| e.to_string())?;
        self.created.push(self.opts.control.clone());
        self.listener = Some(listener);
        let mut bus = Node::new("bus", "vfio-user");
        let mut virtual_bus = Node::new("bus", "virtual");
        let devices = self.machine.devices.clone();
        for d in devices.iter().filter(|d| d.model == "null-blk") {
            virtual_bus.children.push(
                Node::new("device", &format!("{}@virtual", d.name))
                    .with("model", "null-blk")
                    .child(
                        Node::new("driver", "null-blk")
                            .with("placement", "separate")
                            .with("state", "starting")
                            .child(Node::new("block-device", &d.name)),
                    ),
            );
        }
        for d in devices.iter().filter(|d| d.model != "null-blk") {
            let sock = self.path(&format!("{}.vfio-user.sock", d.name));
            let _ = std::fs::remove_file(&sock);
            let mut args = vec![
                "device".to_string(),
                d.model.clone(),
                "--socket".into(),
                sock.display().to_string(),
                "--backing".into(),
                d.backing.clone(),
                "--queues".into(),
                d.queues.to_string(),
            ];
            if let Some(c) = d.create {
                args.extend(["--create".into(), c.to_string()]);
            }
            if d.read_only {
                args.push("--read-only".into());
            }
            let log = self.path(&format!("{}.device.log", d.name));
            let mut p = Process::spawn(
                &self.opts.exe,
                &format!("device model for {}", d.name),
                &args,
                log,
                self.opts.verbose,
            )?;
            p.wait_for_socket(&sock, Duration::from_secs(10))?;
            let mut node = Node::new("pci-function", &format!("{}@vfio-user", d.name))
                .with("model", d.model.as_str())
                .with("socket", sock.display().to_string())
                .with("pid", p.pid())
                .with("backing", d.backing.as_str())
                .with("state", "running");
            self.procs.push(p);
            // Identity, BARs and IRQs, read the way a driver would.
            let f = PciFunction::open(&DeviceSpec::VfioUser(sock.clone()))
                .map_err(|e| format!("probing {}: {e}", d.name))?;
            let id = f.identity();
            node.set("ids", format!("{:04x}:{:04x}", id.vendor, id.device));
            node.set(
                "class",
                format!("{:02x}{:02x}{:02x}", id.class, id.subclass, id.prog_if),
            );
            let bars: Vec<String> = f
                .bar_sizes()
                .map_err(|e| e.to_string())?
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
            let personality = outboard_drivers::match_driver(&id).ok_or_else(|| {
                format!(
                    "{}: no driver matches {:04x}:{:04x}",
                    d.name, id.vendor, id.device
                )
            })?;
            drop(f);
            let driver = Node::new("driver", personality.driver)
                .with("probe-score", personality.score)
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
                .child(Node::new("block-device", &d.name));
            bus.children.push(node.child(driver));
        }
        if !bus.children.is_empty() {
            self.registry.children.push(bus);
        }
        if !virtual_bus.children.is_empty() {
            self.registry.children.push(virtual_bus);
        }
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
            let sock = self.path(&format!("{server}.sock"));
            let _ = std::fs::remove_file(&sock);
            let mut args = vec![
                "driver-host".to_string(),
                "--listen".into(),
                sock.display().to_string(),
            ];
            for n in &names {
                let d = devices.iter().find(|d| &d.name == n).expect("named above");
                let spec = if d.model == "null-blk" {
                    d.backing.clone()
                } else {
                    format!(
                        "vfio-user:{}",
                        self.opts
                            .runtime_dir
                            .join(format!("{n}.vfio-user.sock"))
                            .display()
                    )
                };
                args.extend(["--device".into(), format!("{n}={spec}")]);
            }
            let log = self.path(&format!("{server}.log"));
            let mut p = Process::spawn(
                &self.opts.exe,
                &format!("driver server {server}"),
                &args,
                log,
                self.opts.verbose,
            )?;
            p.wait_for_socket(&sock, Duration::from_secs(30))?;
            let pid = p.pid();
            self.procs.push(p);
            for n in &names {
                let info = outboard_class::BlockClient::status(&sock, n)
                    .map_err(|e| format!("{n}: {e}"))?;
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
                    if let Some(b) = drv.children.first_mut() {
                        b.set("capacity", size_text(info.bytes()));
                        b.set("block-size", info.block_size);
                        b.set("read-only", info.read_only);
                        b.set("queue-depth", info.queue_depth);
                    }
                }
            }
        }
        Ok(())
    }

    /// The registry.
    pub fn registry(&self) -> &Node {
        &self.registry
    }

    /// Serves the control API and supervises children until `stop` is set.
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), String> {
        let work = WorkLoop::new().map_err(|e| e.to_string())?;
        let listener = self.listener.take().ok_or("the manager is not started")?;
        work.add(listener.as_fd(), LISTENER)
            .map_err(|e| e.to_string())?;
        for (i, p) in self.procs.iter().enumerate() {
            work.add(p.fd(), i as u64).map_err(|e| e.to_string())?;
        }
        let mut ready = Vec::new();
        let mut work = work;
        while !stop.load(Ordering::Relaxed) {
            ready.clear();
            work.wait(Some(Duration::from_millis(100)), &mut ready)
                .map_err(|e| e.to_string())?;
            for &t in &ready {
                if t == LISTENER {
                    if let Ok(conn) = control::accept(listener.as_fd()) {
                        self.serve(conn);
                    }
                } else if let Some(p) = self.procs.get_mut(t as usize) {
                    if p.reap() {
                        let _ = work.remove(p.fd());
                        self.crashed(t as usize);
                    }
                }
            }
        }
        self.listener = Some(listener);
        Ok(())
    }

    /// Records and reports a child that exited while the machine was running.
    fn crashed(&mut self, i: usize) {
        let p = &self.procs[i];
        let status = p.exited.map(|s| s.to_string()).unwrap_or_default();
        tracing::error!(
            "{} (pid {}) exited: {status}; log: {}",
            p.role,
            p.pid(),
            p.log.display()
        );
        eprintln!(
            "outboard: {} (pid {}) exited: {status}; see {}",
            p.role,
            p.pid(),
            p.log.display()
        );
        let pid = serde_json::Value::from(p.pid());
        fn mark(n: &mut Node, pid: &serde_json::Value, state: &str) {
            if n.props.get("pid") == Some(pid) {
                n.set("state", state);
            }
            n.children.iter_mut().for_each(|c| mark(c, pid, state));
        }
        mark(&mut self.registry, &pid, &format!("crashed ({status})"));
    }

    /// Answers one client connection (one request, one reply).
    fn serve(&mut self, conn: OwnedFd) {
        let reply = match control::recv::<Request>(conn.as_fd(), Some(Duration::from_secs(1))) {
            Ok((Request::List, _)) => Reply::Registry {
                tree: self.registry.clone(),
            },
            Ok((Request::Open { name }, _)) => self.open(&name),
            Ok((Request::Status { name }, _)) => match self.registry.find("block-device", &name) {
                Some(node) => Reply::Status { node: node.clone() },
                None => Reply::Error {
                    code: "no-such-device".into(),
                    message: format!("no device named {name:?}"),
                },
            },
            Err(e) => Reply::Error {
                code: "invalid".into(),
                message: e.to_string(),
            },
        };
        let _ = control::send(conn.as_fd(), &reply, &[]);
    }

    fn open(&self, name: &str) -> Reply {
        let Some(d) = self.machine.devices.iter().find(|d| d.name == name) else {
            let known: Vec<&str> = self
                .machine
                .devices
                .iter()
                .map(|d| d.name.as_str())
                .collect();
            return Reply::Error {
                code: "no-such-device".into(),
                message: format!(
                    "no device named {name:?} (this machine has: {})",
                    known.join(", ")
                ),
            };
        };
        Reply::Open {
            placement: d.placement,
            server: (d.placement == Placement::Separate)
                .then(|| self.opts.runtime_dir.join(format!("{}.sock", d.server))),
            device: (d.placement == Placement::Colocated).then(|| {
                self.opts
                    .runtime_dir
                    .join(format!("{}.vfio-user.sock", d.name))
            }),
        }
    }

    /// Stops every child (driver servers first, then device models) and removes the files the
    /// manager created.
    pub fn shutdown(&mut self) {
        for p in self.procs.iter_mut().rev() {
            p.stop(Duration::from_secs(5));
        }
        self.listener = None;
        for f in self.created.drain(..) {
            let _ = std::fs::remove_file(&f);
        }
        let _ = std::fs::remove_dir(&self.opts.runtime_dir);
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
