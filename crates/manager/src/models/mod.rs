//! The device models a machine description may name, each with its own keys: what the manager
//! knows about a model is here and nowhere else. The rest of the manager sees a model's name,
//! whether it is emulated (a device model process reached over vfio-user, whose PCI function
//! the catalog matches) or virtual (no device: its driver server answers for it), what backs
//! it (one line for people), and the settings the model checked.
//!
//! A model declares its keys; a key of another model in its `[[device]]` table is an error that
//! names the model's own keys. Adding a model adds its entry to [`MODELS`] (and its key, if new,
//! to the description's table layout in `config.rs`).

mod disk;
pub mod pci;
mod serial;
mod timer;
mod virtio_net;
mod virtio_rng;

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

use crate::children::ModelOwn;
use crate::config::DeviceConfig;

/// How a model exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A device model process the manager starts, reached over vfio-user.
    Emulated,
    /// No device: the driver server answers for it (measures the session path alone).
    Virtual,
    /// A PCI function of this machine bound to `vfio-pci`: no process to start, the driver
    /// server opens it through VFIO.
    Hardware,
}

/// A model's key as the description gave it: its value as text, and where it is.
#[derive(Debug, Clone)]
pub struct Given {
    /// The value (a string as written; a number or boolean in its TOML form).
    pub value: String,
    /// Byte offset in the description, for errors.
    pub at: usize,
}

/// A model's keys in one `[[device]]` table.
pub type Keys = BTreeMap<&'static str, Given>;

/// What a model made of its keys.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Settled {
    /// What backs the device, for people (`mem:64M`, `null:1073741824`, `getrandom`).
    pub backing: String,
    /// The checked settings, by key, as text.
    pub settings: BTreeMap<String, String>,
}

/// A model's error in its keys: where, and what is wrong.
pub type KeyError = (usize, String);

/// Why a model's process could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Its backing could not be opened or created.
    #[error(transparent)]
    Backing(#[from] outboard_devices::backing::BackingError),
    /// A memory disk's size does not parse (the description's check should have caught it).
    #[error("backing mem:{0}: not a size")]
    Size(String),
    /// A system call failed (`what`: which).
    #[error("{what}: {err}")]
    Os {
        /// The call.
        what: &'static str,
        /// What the system said.
        err: std::io::Error,
    },
    /// A fault in its `faults` list does not parse.
    #[error("fault {fault:?}: {why}")]
    Fault {
        /// As written.
        fault: String,
        /// Why it does not parse.
        why: String,
    },
    /// The model has no process (a virtual device): nothing to start.
    #[error("{0} is not a device model process")]
    NoProcess(String),
    /// The NIC's cable (a wire, a TAP interface) could not be given to it.
    #[error("cable: {0}")]
    Cable(String),
}

/// How the manager starts an emulated model: `outboard device MODEL` with its own arguments,
/// and these descriptors handed over in order from the number the launch was given, which
/// the arguments name as `fd:N` (the manager opens files, the confined model opens nothing).
#[derive(Debug)]
pub struct Launch {
    /// The model and its own arguments.
    pub own: ModelOwn,
    /// Descriptors to pass.
    pub fds: Vec<OwnedFd>,
}

/// A device model.
pub struct Model {
    /// Its name in a `[[device]]` table.
    pub name: &'static str,
    /// Emulated or virtual.
    pub kind: Kind,
    /// Its own keys.
    pub keys: &'static [&'static str],
    /// Whether its driver may run in the client (colocated).
    pub colocated: bool,
    /// Why not, when it may not: for the error that refuses `placement = "colocated"`.
    pub not_colocated: &'static str,
    /// Checks its keys (`others`: the devices declared before it).
    pub settle: fn(&Keys, dev_at: usize, others: &[DeviceConfig]) -> Result<Settled, KeyError>,
    /// Emulated: how to start it, its descriptors passed from the number given. Virtual:
    /// unused.
    pub launch: fn(&DeviceConfig, i32) -> Result<Launch, ModelError>,
    /// Virtual or hardware: the driver server's `--device NAME=SPEC` spec. Emulated: unused.
    pub spec: fn(&DeviceConfig) -> String,
}

/// Every model this build knows.
pub static MODELS: &[Model] = &[
    Model {
        name: "virtio-blk",
        kind: Kind::Emulated,
        keys: &["backing", "create", "read_only", "queues"],
        colocated: true,
        not_colocated: "",
        settle: disk::settle,
        launch: disk::launch,
        spec: no_spec,
    },
    Model {
        name: "null-blk",
        kind: Kind::Virtual,
        keys: &["size"],
        colocated: false,
        not_colocated: NO_HARDWARE,
        settle: disk::null_settle,
        launch: no_launch,
        spec: disk::null_spec,
    },
    Model {
        name: "virtio-rng",
        kind: Kind::Emulated,
        keys: &["seed"],
        colocated: true,
        not_colocated: "",
        settle: virtio_rng::settle,
        launch: virtio_rng::launch,
        spec: no_spec,
    },
    Model {
        name: "virtio-net",
        kind: Kind::Emulated,
        keys: &[
            "mac",
            "mtu",
            "link",
            "wire",
            "stream",
            "tap",
            "stream_listen",
        ],
        colocated: true,
        not_colocated: "",
        settle: virtio_net::settle,
        launch: virtio_net::launch,
        spec: no_spec,
    },
    Model {
        name: "timer",
        kind: Kind::Emulated,
        keys: &["hz"],
        colocated: false,
        not_colocated: LEGACY_DRIVER,
        settle: timer::settle,
        launch: timer::launch,
        spec: no_spec,
    },
    Model {
        name: "serial",
        kind: Kind::Emulated,
        keys: &["line"],
        colocated: false,
        not_colocated: LEGACY_DRIVER,
        settle: serial::settle,
        launch: serial::launch,
        spec: no_spec,
    },
    Model {
        name: pci::NAME,
        kind: Kind::Hardware,
        keys: &["pci"],
        colocated: false,
        not_colocated: NO_HARDWARE,
        settle: pci::settle,
        launch: no_launch,
        spec: pci::spec,
    },
];

/// Why a device driven by a C driver does not run in a client.
const LEGACY_DRIVER: &str = "its C driver runs in the legacy execution model, whose interrupt \
                             thread needs a process of its own: it runs \"separate\" or \
                             \"grouped\"";

/// Why a virtual device's driver does not run in a client.
const NO_HARDWARE: &str = "it has no hardware for a client to drive: it runs only \"separate\"";

/// The model named `name`.
pub fn model(name: &str) -> Option<&'static Model> {
    MODELS.iter().find(|m| m.name == name)
}

/// The known models' names, for errors (a PCI function is named by `pci`, not `model`).
pub fn names() -> String {
    MODELS
        .iter()
        .filter(|m| m.kind != Kind::Hardware)
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) fn no_launch(d: &DeviceConfig, _: i32) -> Result<Launch, ModelError> {
    Err(ModelError::NoProcess(d.model.clone()))
}

pub(crate) fn no_spec(d: &DeviceConfig) -> String {
    format!("{} has a device model", d.model)
}
