//! The device manager (docs/manager.md).
//!
//! Reads a machine description ([`config`]), starts each device model and driver server as a
//! confined process ([`supervisor`]), builds the registry ([`registry`]), answers the control
//! API ([`api`]) on a SEQPACKET socket for its own user only, supervises and restarts what dies
//! (docs/restart.md), attaches and detaches devices at run time, and shuts everything down
//! cleanly. Matching uses the drivers' personalities. It names no class and knows each model
//! only by its declaration ([`models`]).
//!
//! One `Manager`, its jobs in their own files: bringing the machine up (`launch`), the loop and
//! what happens when a child dies or hangs (`supervise`), hot-plug and power (`hotplug`), the
//! control API (`answer`), and the registry lookups (`nodes`).
#![deny(missing_docs)]

mod answer;
mod broker;
pub mod children;
pub mod config;
mod hardware;
mod hotplug;
mod launch;
mod libraries;
pub mod models;
mod nodes;
pub mod quarantine;
mod relocate;
pub mod restart;
pub mod runtime;
pub mod standby;
mod supervise;
pub mod supervisor;
mod tally;

pub use outboard_client::{api, manager as open, registry};
use registry::{Detail, State};

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
use crate::children::{
    ConfineArgs, DriverHostArgs, ExportNbdArgs, ExportTapArgs, ModelArgs, ModelFaults, ModelListen,
};
use crate::config::{ExportAddress, ExportConfig, ExportProtocol, Machine, Placement};
use crate::registry::Node;
use crate::supervisor::Process;

use crate::answer::{detached, refuse, ACCEPT_BACKOFF, GRACEFUL_DRAIN};
use crate::nodes::class_device;

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
    pub child_user: Option<outboard_confine::privileges::User>,
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
    /// Child `i` (an export) asked a question on its broker connection.
    Broker(usize),
}

/// How long a restarted driver server lets resuming sessions claim back what they kept before
/// it grants anyone else anything (the class's kept state): they resume within a few
/// milliseconds of it serving (they poll for it every millisecond), this is ample.
const RESUME_GRACE: Duration = Duration::from_millis(250);

/// How long a restarted device model has to come into service before it is killed (and the
/// attempt counted as a crash without progress).
const MODEL_START_TIME: Duration = Duration::from_secs(10);

/// How long after a restarted server serves its next standby is started: its clients resume
/// and replay meanwhile (a few ms; the standby's own start-up would take a CPU from them on a
/// small machine). A server that dies again sooner is started afresh.
const STANDBY_AFTER_RESTART: Duration = Duration::from_millis(20);

/// How long after a standby died (killed, or failing at its own start) the next is started.
const STANDBY_RETRY: Duration = Duration::from_secs(1);

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
    /// `outboard down` asked the machine to stop: [`Manager::run`] returns.
    down: bool,
    /// Exports started by hand, by the control connection they registered on: (device,
    /// export name). Each shows in the registry while its connection is open.
    hand_exports: std::collections::HashMap<usize, (String, String)>,
    /// A device being moved into another driver server (`outboard move`).
    moving: Option<relocate::Move>,
    /// Per class device, the counts of driver server incarnations that ended, and the last
    /// description of it a page gave (its class, its error kinds' names).
    carried: std::collections::BTreeMap<
        String,
        (
            outboard_server::counters::Record,
            outboard_server::counters::DeviceCounters,
        ),
    >,
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
    #[error(transparent)]
    Runtime(#[from] runtime::RuntimeError),
    /// The control socket could not be set up.
    #[error("the control socket: {0}")]
    Control(#[from] outboard_session::SessionError),
    /// The work loop failed.
    #[error(transparent)]
    Loop(#[from] outboard_env::LoopError),
    /// A child process (device model, driver server, export) could not be started or did not
    /// come up.
    #[error(transparent)]
    Spawn(#[from] supervisor::SpawnError),
    /// A device's model could not be prepared (its backing).
    #[error("{device}: {why}")]
    Model {
        /// Device name.
        device: String,
        /// Why.
        why: models::ModelError,
    },
    /// An export names a device of a class it does not serve.
    #[error(
        "export of {device}: {device} is of the {class} class; an NBD export serves block \
         devices, a TAP export NICs (the net class)"
    )]
    ExportClass {
        /// The device.
        device: String,
        /// Its class.
        class: String,
    },
    /// An export's own resource (a TAP interface) could not be made.
    #[error("{0}")]
    Export(String),
    /// A socket the manager binds for a child could not be made.
    #[error("{device}: {why}")]
    Socket {
        /// Whose socket (a device or a server).
        device: String,
        /// Why.
        why: String,
    },
    /// A device could not be probed.
    #[error("probing {device}: {why}")]
    Probe {
        /// Device name.
        device: String,
        /// Why.
        why: String,
    },
    /// A device's PCI function cannot be used as it stands (not present, not bound to
    /// vfio-pci, its IOMMU group not viable): what to do is in `why`.
    #[error("{device}: {why}")]
    Function {
        /// Device name.
        device: String,
        /// Why, and what to do.
        why: String,
    },
    /// The machine asks a device's driver for a fault it cannot inject.
    #[error("{device}: {why}")]
    DriverFault {
        /// Device name.
        device: String,
        /// Which fault, and why not.
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
    /// A driver library (`[[driver]] library =`) cannot be used.
    #[error("driver library: {0}")]
    DriverLibrary(String),
    /// `run` was called on a manager that is not started.
    #[error("the manager is not started")]
    NotStarted,
}

impl Manager {
    /// Starts every device model and driver server of `machine`. On failure, whatever was
    /// started is stopped again.
    pub fn start(machine: Machine, opts: ManagerOptions) -> Result<Self, ManagerError> {
        libraries::register_all(&machine.driver_libraries).map_err(ManagerError::DriverLibrary)?;
        let runtime =
            runtime::RuntimeDir::claim(&opts.runtime_dir).map_err(ManagerError::Runtime)?;
        let mut m = Self {
            registry: Node::new("machine", &machine.name).with("state", State::Starting.word()),
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
            down: false,
            hand_exports: std::collections::HashMap::new(),
            moving: None,
            carried: Default::default(),
        };
        if let Err(e) = m.bring_up() {
            m.shutdown();
            return Err(e);
        }
        m.registry.set_state(State::Running, Detail::None);
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

    /// The registry.
    pub fn registry(&self) -> &Node {
        &self.registry
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
                outboard_sys::errln!(
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
