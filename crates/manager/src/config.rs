//! The machine description: which devices exist, what backs them, where their drivers run.
//!
//! ```toml
//! name = "default"
//!
//! [[device]]
//! name = "disk0"          # the class device clients open
//! model = "virtio-blk"    # the emulated device model
//! backing = "mem:64M"     # or a file path (virtio-blk)
//! create = "1G"           # create the file sparse with this size if missing (optional)
//! read_only = false
//! queues = 1
//! placement = "separate"  # "separate": driver in a server; "grouped": in one shared with
//!                         # the devices naming the same server; "colocated": in the client
//! server = "blk0"         # devices naming the same server share it
//! request_deadline = "30s" # a request still in the device after this fails the device
//! restarts = 5            # crashes in a row without serving (over at least 5 s) before it is
//!                         # given up (0: no automatic restart); one that serves between
//!                         # crashes restarts for ever
//! restart_window = "60s"  # crashes without serving older than this are forgotten
//! retry_after_give_up = "60s" # a given-up device is tried again after 1 s, 2 s, … up to this
//! heartbeat = "1s"        # a driver server whose loop stops this long is hung: restarted
//! standby = true          # a standby driver server waits, started and its privileges
//!                         # dropped, to take the place of one that dies (false: one process
//!                         # fewer, a slower restart)
//! fault_injection = false # true: a fault socket for `outboard fault`
//! driver_abort_on = 8192  # the driver aborts its server when a request touches this sector
//!                         # (virtio-blk; refused for a driver that cannot)
//! max_memory = "16G"      # address space of its model and driver server (RLIMIT_AS)
//! max_files = 4096        # descriptors of each (RLIMIT_NOFILE)
//! faults = ["drop-irq=2"] # fault injection armed from the start (see `outboard fault`)
//! attached = true         # false: declared, started later by `outboard attach disk0`
//!
//! [[device]]
//! name = "null0"
//! model = "null-blk"      # completes requests without a device: measures the session path
//! size = "1G"
//! ```
//!
//! `backing`, `create`, `read_only` and `queues` are virtio-blk's own keys and `size` is
//! null-blk's: each model declares its keys (`crate::models`), and a key of another model is
//! an error that lists the model's own. The rest are every device's.
//!
//! Every error names the file, the line and the problem. `docs/machine.md` is the reference
//! for every key (a test holds it to the parser).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

/// The machine `outboard up` runs when given no description, as `outboard up --print-default`
/// prints it: every key a disk takes is there, commented out at its default where it has one
/// (docs/machine.md lists every key of every model and of exports).
pub const DEFAULT_MACHINE: &str = r#"# Outboard's embedded default machine: one emulated disk, its driver in its own server.
# A key commented out shows its default; docs/machine.md lists every key of every model.
name = "default"

[[device]]
name = "disk0"                # the name clients open: outboard blk read disk0
model = "virtio-blk"          # also null-blk, virtio-rng, virtio-net, timer, serial (each has keys of its own)
backing = "mem:64M"           # a memory disk, or a file's path
# create = "1G"               # create the file, sparse, with this size if it is missing
# read_only = false
# queues = 1                  # request queues, 1 to 16
placement = "separate"        # its driver in a server process of its own; "grouped" (with
                              # server = NAME) shares one; "colocated" links it into each client
# server = "disk0-server"     # devices naming the same server share its process
# request_deadline = "30s"    # a request in the device longer than this: its model and server
                              # are restarted, and clients send the request again
# restarts = 5                # crashes in a row without serving before it is given up
# restart_window = "60s"      # crashes without serving older than this are forgotten
# retry_after_give_up = "60s" # a given-up device is tried again, at most this far apart
# heartbeat = "1s"            # a driver server whose loop stops this long is hung: restarted
# standby = true              # a standby driver server waits to take the place of one that dies
# attached = true             # false: declared only, started by outboard attach disk0
# fault_injection = false     # true: a fault socket, for outboard fault disk0 stall=2s
# faults = []                 # faults armed from the start, e.g. ["drop-irq=2"]
# driver_abort_on = 8192      # the driver aborts when a request touches this sector (a test)
# max_memory = "16G"          # address space of its model and of its driver server
# max_files = 4096            # descriptors of each

# Export it over NBD while the machine is up (nbdcopy, qemu-img, nbd-client):
# [[export]]
# device = "disk0"
# socket = "/run/outboard/disk0.nbd"  # default: export-0.nbd in the runtime directory
"#;

/// A configuration error, located.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {message}")]
pub struct ConfigError {
    /// The file (or `<embedded default>`).
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

pub use outboard_client::api::Placement;

/// A validated device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Class device name.
    pub name: String,
    /// Device model ([`crate::models`]).
    pub model: String,
    /// What backs it, for people, as its model says (`mem:64M`, a path, `null:SIZE`).
    pub backing: String,
    /// The model's own settings, checked by the model, by key.
    pub settings: std::collections::BTreeMap<String, String>,
    /// Placement.
    pub placement: Placement,
    /// Driver server name (separate placement).
    pub server: String,
    /// How long a request may stay in the device before the device counts as stalled.
    pub request_deadline: std::time::Duration,
    /// Faults armed in the device model from the start.
    pub faults: Vec<String>,
    /// When its driver server and model are restarted after a crash, and when given up.
    pub restart: crate::supervisor::RestartPolicy,
    /// Started with the machine (false: it waits for `outboard attach`).
    pub attached: bool,
    /// Its model listens for `outboard fault` (a socket in the runtime directory).
    pub fault_injection: bool,
    /// Fault injection in the driver: it aborts its server whenever a request touches this
    /// sector (`driver_abort_on = 8192`).
    pub driver_abort_on: Option<u64>,
    /// Most bytes of address space its model and driver server may map (`RLIMIT_AS`).
    pub max_memory: u64,
    /// Most descriptors its model and driver server may hold (`RLIMIT_NOFILE`).
    pub max_files: u64,
}

/// Address space a device model or driver server may map unless its `[[device]]` says
/// otherwise: its sessions' buffer areas (at most 1 GiB in all), rings, BARs and code, many
/// times over, but not the machine's memory.
pub const DEFAULT_MAX_MEMORY: u64 = 16 << 30;

/// Where an export listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportAddress {
    /// A UNIX socket (default: `export-N.nbd` in the runtime directory, N counting the
    /// `[[export]]` tables from 0).
    Socket(Option<std::path::PathBuf>),
    /// TCP.
    Tcp(std::net::SocketAddr),
}

/// Connections an export serves at once unless its `[[export]]` says otherwise.
pub const DEFAULT_MAX_CONNECTIONS: u64 = 64;
/// How long a connection may take to negotiate, by default.
pub const DEFAULT_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a client may take no reply data before its connection is closed, by default.
pub const DEFAULT_WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// What an export speaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportProtocol {
    /// A block device served over NBD (`protocol = "nbd"`, the default).
    Nbd,
    /// A NIC made a host network interface (`protocol = "tap"`): the interface's name.
    Tap {
        /// The interface's name (`interface`; default: the device's).
        interface: String,
        /// The export takes the NIC's receive path (`own = true`): frames are written
        /// straight into its buffers.
        own: bool,
    },
}

/// A validated `[[export]]`: a block device served over NBD, or a NIC made a host interface,
/// while the machine is up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportConfig {
    /// The export's name (default: the device's).
    pub name: String,
    /// The device.
    pub device: String,
    /// NBD or TAP (the NBD keys below are an NBD export's only).
    pub protocol: ExportProtocol,
    /// Where it listens.
    pub address: ExportAddress,
    /// Writes are refused.
    pub read_only: bool,
    /// TLS required, with this certificate chain and key (PEM).
    pub tls: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// Clients must present a certificate signed by one of these authorities (PEM).
    pub tls_verify_peer: Option<std::path::PathBuf>,
    /// TLS required, with pre-shared keys from this file (`identity:hexkey` lines).
    pub tls_psk: Option<std::path::PathBuf>,
    /// A TCP address other than loopback is served without TLS.
    pub insecure: bool,
    /// Most connections served at once.
    pub max_connections: u64,
    /// A connection that has not finished negotiating within this is closed.
    pub handshake_timeout: std::time::Duration,
    /// A connection that sends no request for this long is closed (`None`: never).
    pub idle_timeout: Option<std::time::Duration>,
    /// A connection whose client takes no reply data for this long is closed.
    pub write_timeout: std::time::Duration,
    /// Most bytes of address space the export may map (`RLIMIT_AS`).
    pub max_memory: u64,
    /// Most descriptors it may hold (`RLIMIT_NOFILE`).
    pub max_files: u64,
}

/// A validated machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// Machine name.
    pub name: String,
    /// Devices.
    pub devices: Vec<DeviceConfig>,
    /// Exports started with the machine.
    pub exports: Vec<ExportConfig>,
    /// Driver libraries (`[[driver]] library = PATH`): C drivers built outside Outboard,
    /// added to the catalog before any device is matched. A relative path is relative to the
    /// description's directory.
    pub driver_libraries: Vec<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMachine {
    name: Option<String>,
    #[serde(default)]
    device: Vec<Spanned<RawDevice>>,
    #[serde(default)]
    export: Vec<Spanned<RawExport>>,
    #[serde(default)]
    driver: Vec<Spanned<RawDriverLibrary>>,
}

/// A `[[driver]]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDriverLibrary {
    library: Spanned<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExport {
    device: Spanned<String>,
    name: Option<Spanned<String>>,
    protocol: Option<Spanned<String>>,
    interface: Option<Spanned<String>>,
    own: Option<Spanned<bool>>,
    socket: Option<Spanned<String>>,
    listen: Option<Spanned<String>>,
    #[serde(default)]
    read_only: bool,
    tls_cert: Option<Spanned<String>>,
    tls_key: Option<Spanned<String>>,
    tls_verify_peer: Option<Spanned<String>>,
    tls_psk: Option<Spanned<String>>,
    #[serde(default)]
    insecure: bool,
    max_connections: Option<Spanned<i64>>,
    handshake_timeout: Option<Spanned<String>>,
    idle_timeout: Option<Spanned<String>>,
    write_timeout: Option<Spanned<String>>,
    max_memory: Option<Spanned<String>>,
    max_files: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    name: Spanned<String>,
    model: Option<Spanned<String>>,
    // A PCI function instead of a model (the `pci` model's one key).
    pci: Option<Spanned<String>>,
    // The models' own keys (each model says which are its: `crate::models`).
    backing: Option<Spanned<String>>,
    size: Option<Spanned<String>>,
    create: Option<Spanned<String>>,
    read_only: Option<Spanned<bool>>,
    queues: Option<Spanned<i64>>,
    seed: Option<Spanned<i64>>,
    hz: Option<Spanned<i64>>,
    line: Option<Spanned<String>>,
    mac: Option<Spanned<String>>,
    mtu: Option<Spanned<i64>>,
    link: Option<Spanned<String>>,
    wire: Option<Spanned<String>>,
    stream: Option<Spanned<String>>,
    tap: Option<Spanned<String>>,
    stream_listen: Option<Spanned<String>>,
    placement: Option<Spanned<String>>,
    server: Option<Spanned<String>>,
    request_deadline: Option<Spanned<String>>,
    restarts: Option<Spanned<i64>>,
    restart_window: Option<Spanned<String>>,
    retry_after_give_up: Option<Spanned<String>>,
    heartbeat: Option<Spanned<String>>,
    standby: Option<bool>,
    #[serde(default)]
    faults: Vec<Spanned<String>>,
    attached: Option<bool>,
    #[serde(default)]
    fault_injection: bool,
    driver_abort_on: Option<Spanned<i64>>,
    max_memory: Option<Spanned<String>>,
    max_files: Option<Spanned<i64>>,
}

/// The keys every `[[device]]` may have, whatever its model.
const COMMON_KEYS: &[&str] = &[
    "name",
    "model",
    "placement",
    "server",
    "request_deadline",
    "restarts",
    "restart_window",
    "retry_after_give_up",
    "heartbeat",
    "standby",
    "faults",
    "attached",
    "fault_injection",
    "driver_abort_on",
    "max_memory",
    "max_files",
];

/// Each `[[device]]` table's keys, located (the rest of the description is read after).
#[derive(Deserialize)]
struct DeviceKeys {
    #[serde(default)]
    device: Vec<std::collections::BTreeMap<Spanned<String>, toml::Value>>,
}

impl RawDevice {
    /// The models' keys this table gives, as text, located.
    fn model_keys(&self) -> crate::models::Keys {
        let mut k = crate::models::Keys::new();
        let mut put = |key: &'static str, value: String, at: usize| {
            k.insert(key, crate::models::Given { value, at });
        };
        if let Some(v) = &self.backing {
            put("backing", v.get_ref().clone(), v.span().start);
        }
        if let Some(v) = &self.size {
            put("size", v.get_ref().clone(), v.span().start);
        }
        if let Some(v) = &self.create {
            put("create", v.get_ref().clone(), v.span().start);
        }
        if let Some(v) = &self.read_only {
            put("read_only", v.get_ref().to_string(), v.span().start);
        }
        if let Some(v) = &self.queues {
            put("queues", v.get_ref().to_string(), v.span().start);
        }
        if let Some(v) = &self.seed {
            put("seed", v.get_ref().to_string(), v.span().start);
        }
        if let Some(v) = &self.hz {
            put("hz", v.get_ref().to_string(), v.span().start);
        }
        if let Some(v) = &self.line {
            put("line", v.get_ref().clone(), v.span().start);
        }
        if let Some(v) = &self.pci {
            put("pci", v.get_ref().clone(), v.span().start);
        }
        if let Some(v) = &self.mac {
            put("mac", v.get_ref().clone(), v.span().start);
        }
        if let Some(v) = &self.mtu {
            put("mtu", v.get_ref().to_string(), v.span().start);
        }
        if let Some(v) = &self.link {
            put("link", v.get_ref().clone(), v.span().start);
        }
        if let Some(v) = &self.wire {
            put("wire", v.get_ref().clone(), v.span().start);
        }
        if let Some(v) = &self.stream {
            put("stream", v.get_ref().clone(), v.span().start);
        }
        if let Some(v) = &self.tap {
            put("tap", v.get_ref().clone(), v.span().start);
        }
        if let Some(v) = &self.stream_listen {
            put("stream_listen", v.get_ref().clone(), v.span().start);
        }
        k
    }
}

impl DeviceConfig {
    /// A model setting, or `default`.
    pub fn setting<'a>(&'a self, key: &str, default: &'a str) -> &'a str {
        self.settings.get(key).map_or(default, String::as_str)
    }

    /// A model setting that is a flag (absent: false).
    pub fn flag(&self, key: &str) -> bool {
        self.settings.get(key).is_some_and(|v| v == "true")
    }

    /// Its model.
    pub fn model(&self) -> &'static crate::models::Model {
        crate::models::model(&self.model).expect("validated when the description was read")
    }
}

impl Machine {
    /// The embedded default machine.
    pub fn default_machine() -> Self {
        Self::parse(DEFAULT_MACHINE, "<embedded default>").expect("the embedded default is valid")
    }

    /// Reads and validates a machine description file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.display().to_string(),
            line: 0,
            message: e.to_string(),
        })?;
        let mut m = Self::parse(&text, &path.display().to_string())?;
        let dir = path.parent().unwrap_or(Path::new("."));
        for l in &mut m.driver_libraries {
            // Absolute: the driver servers and the describer run elsewhere, and dlopen takes
            // a bare name for one to search for.
            let joined = if l.is_relative() {
                dir.join(&*l)
            } else {
                l.clone()
            };
            *l = std::path::absolute(&joined).unwrap_or(joined);
        }
        Ok(m)
    }

    /// Parses and validates a description; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Self, ConfigError> {
        let line_of = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
        let err = |offset: usize, message: String| ConfigError {
            file: file.into(),
            line: line_of(offset),
            message,
        };
        let toml_err = |e: toml::de::Error| {
            let at = e.span().map(|s| s.start).unwrap_or(0);
            err(at, e.message().to_string())
        };
        let duration =
            |key: &str, v: &Option<Spanned<String>>, default: std::time::Duration| match v {
                None => Ok(default),
                Some(s) => match parse_duration(s.get_ref()) {
                    Some(t) if !t.is_zero() => Ok(t),
                    _ => Err(err(
                        s.span().start,
                        format!(
                            "{key} = {:?}: a duration such as \"500ms\" or \"30s\"",
                            s.get_ref()
                        ),
                    )),
                },
            };
        // Limits of a child (a device's model and server, an export).
        let memory_limit = |v: &Option<Spanned<String>>| match v {
            None => Ok(DEFAULT_MAX_MEMORY),
            Some(m) => outboard_devices::backing::parse_size(m.get_ref())
                .filter(|n| *n >= 64 << 20)
                .ok_or_else(|| {
                    err(
                        m.span().start,
                        format!(
                            "max_memory = {:?}: a size of at least 64M, e.g. \"4G\"",
                            m.get_ref()
                        ),
                    )
                }),
        };
        let files_limit = |v: &Option<Spanned<i64>>| match v {
            None => Ok(outboard_confine::limits::MAX_FILES),
            Some(n) => u64::try_from(*n.get_ref())
                .ok()
                .filter(|n| (32..=outboard_confine::limits::MAX_FILES).contains(n))
                .ok_or_else(|| {
                    err(
                        n.span().start,
                        format!(
                            "max_files = {}: from 32 to {}",
                            n.get_ref(),
                            outboard_confine::limits::MAX_FILES
                        ),
                    )
                }),
        };
        // Keys first, by each device's model: a key no model has is named with the keys this
        // device's model takes, not every key of every model.
        let keys: DeviceKeys = toml::from_str(text).map_err(toml_err)?;
        for d in &keys.device {
            let named = d
                .iter()
                .find(|(k, _)| k.get_ref() == "model")
                .and_then(|(_, v)| v.as_str());
            // A table with `pci` and no `model` is a PCI function.
            let is_function = named.is_none() && d.iter().any(|(k, _)| k.get_ref() == "pci");
            let model = if is_function {
                crate::models::model(crate::models::pci::NAME)
            } else {
                named.and_then(crate::models::model)
            };
            let Some(model) = model else { continue };
            if let Some((k, _)) = d.iter().find(|(k, _)| {
                !COMMON_KEYS.contains(&k.get_ref().as_str())
                    && !model.keys.contains(&k.get_ref().as_str())
            }) {
                return Err(err(
                    k.span().start,
                    format!(
                        "{} is not a key of a {} device (its keys: {}; every device's: {})",
                        k.get_ref(),
                        model.name,
                        model.keys.join(", "),
                        COMMON_KEYS.join(", ")
                    ),
                ));
            }
        }
        let raw: RawMachine = toml::from_str(text).map_err(toml_err)?;
        if raw.device.is_empty() {
            return Err(err(text.len(), "the machine has no [[device]]".into()));
        }
        let mut devices: Vec<DeviceConfig> = Vec::new();
        for d in raw.device {
            let d = d.into_inner();
            let name = d.name.get_ref();
            if !valid_name(name) {
                return Err(err(
                    d.name.span().start,
                    format!("device name {name:?}: use 1-32 letters, digits, '-' or '_'"),
                ));
            }
            if devices.iter().any(|o| &o.name == name) {
                return Err(err(
                    d.name.span().start,
                    format!("device name {name:?} is used twice"),
                ));
            }
            let dev_at = d.name.span().start;
            let (model_name, model_at) = match (&d.model, &d.pci) {
                (Some(m), Some(_)) => {
                    return Err(err(
                        m.span().start,
                        format!(
                            "device {name:?} names both a model and a PCI function: a device \
                             is either model = \"MODEL\" (emulated) or pci = \"ADDRESS\" (a \
                             function bound to vfio-pci)"
                        ),
                    ))
                }
                (Some(m), None) => (m.get_ref().clone(), m.span().start),
                (None, Some(p)) => (crate::models::pci::NAME.to_string(), p.span().start),
                (None, None) => {
                    return Err(err(
                        dev_at,
                        format!(
                            "device {name:?} needs model = \"MODEL\" (an emulated device: {}) \
                             or pci = \"ADDRESS\" (a function of this machine bound to \
                             vfio-pci)",
                            crate::models::names()
                        ),
                    ))
                }
            };
            let model = match crate::models::model(&model_name) {
                Some(m) if d.model.is_none() || m.kind != crate::models::Kind::Hardware => m,
                _ => {
                    return Err(err(
                        model_at,
                        format!(
                            "unknown model {model_name:?} (known: {}; a function bound to \
                             vfio-pci is pci = \"ADDRESS\")",
                            crate::models::names()
                        ),
                    ))
                }
            };
            let keys = d.model_keys();
            if let Some((key, given)) = keys.iter().find(|(k, _)| !model.keys.contains(k)) {
                return Err(err(
                    given.at,
                    format!(
                        "{key} is not a key of a {} device (its keys: {})",
                        model.name,
                        model.keys.join(", ")
                    ),
                ));
            }
            let settled = (model.settle)(&keys, dev_at, &devices).map_err(|(at, m)| err(at, m))?;
            let placement = match d
                .placement
                .as_ref()
                .map(|p| (p.get_ref().as_str(), p.span().start))
            {
                None | Some(("separate", _)) => Placement::Separate,
                Some(("colocated", _)) => Placement::Colocated,
                // Separate, in a server other devices name too: it says which.
                Some(("grouped", at)) if d.server.is_none() => {
                    return Err(err(
                        at,
                        "placement \"grouped\" needs server = NAME: the devices that name the \
                         same server share its process"
                            .into(),
                    ))
                }
                Some(("grouped", _)) => Placement::Separate,
                Some((other, at)) => {
                    return Err(err(
                        at,
                        format!(
                            "placement {other:?}: use \"separate\", \"grouped\" (with server = \
                             NAME) or \"colocated\""
                        ),
                    ))
                }
            };
            if !model.colocated && placement == Placement::Colocated {
                let why = if model.kind == crate::models::Kind::Hardware {
                    "a PCI function is driven only in a driver server (\"separate\" or \
                     \"grouped\"): a client does not open its VFIO group"
                        .to_string()
                } else {
                    format!("a {} device: {}", model.name, model.not_colocated)
                };
                return Err(err(
                    d.placement.as_ref().map_or(dev_at, |p| p.span().start),
                    why,
                ));
            }
            let server =
                match (&d.server, placement) {
                    (None, _) => format!("{name}-server"),
                    (Some(s), Placement::Colocated) => return Err(err(
                        s.span().start,
                        "server names a driver server, but this device is colocated (its driver \
                         runs in each client): drop server or use placement = \"separate\""
                            .into(),
                    )),
                    // A server name becomes a socket file name in the runtime directory.
                    (Some(s), Placement::Separate) if !valid_name(s.get_ref()) => {
                        return Err(err(
                            s.span().start,
                            format!(
                                "server name {:?}: use 1-32 letters, digits, '-' or '_'",
                                s.get_ref()
                            ),
                        ))
                    }
                    (Some(s), Placement::Separate) => s.get_ref().clone(),
                };
            let request_deadline = duration(
                "request_deadline",
                &d.request_deadline,
                std::time::Duration::from_secs(30),
            )?;
            let mut restart = crate::supervisor::RestartPolicy::default();
            restart.window = duration("restart_window", &d.restart_window, restart.window)?;
            restart.heartbeat = duration("heartbeat", &d.heartbeat, restart.heartbeat)?;
            restart.retry = duration("retry_after_give_up", &d.retry_after_give_up, restart.retry)?;
            restart.standby = d.standby.unwrap_or(restart.standby);
            if let Some(n) = &d.restarts {
                restart.limit = u32::try_from(*n.get_ref()).map_err(|_| {
                    err(
                        n.span().start,
                        format!(
                            "restarts = {}: a count from 0 (never restart) up",
                            n.get_ref()
                        ),
                    )
                })?;
            }
            let mut faults = Vec::new();
            // Faults are the device model's: a virtual device has no hardware, a PCI function
            // no model (a fault of real hardware is not on demand).
            let no_faults = match model.kind {
                crate::models::Kind::Emulated => None,
                crate::models::Kind::Virtual => {
                    Some(format!("a {} device has no hardware to fault", model.name))
                }
                crate::models::Kind::Hardware => {
                    Some("a PCI function has no device model to inject faults into".to_string())
                }
            };
            for f in &d.faults {
                if let Some(why) = &no_faults {
                    return Err(err(f.span().start, why.clone()));
                }
                f.get_ref()
                    .parse::<outboard_devices::faults::Fault>()
                    .map_err(|e| err(f.span().start, format!("faults: {e}")))?;
                faults.push(f.get_ref().clone());
            }
            if let Some(why) = no_faults.filter(|_| d.fault_injection) {
                return Err(err(model_at, why));
            }
            let driver_abort_on = match &d.driver_abort_on {
                None => None,
                Some(n) => Some(u64::try_from(*n.get_ref()).map_err(|_| {
                    err(
                        n.span().start,
                        format!("driver_abort_on = {}: a sector number", n.get_ref()),
                    )
                })?),
            };
            let max_memory = memory_limit(&d.max_memory)?;
            let max_files = files_limit(&d.max_files)?;
            devices.push(DeviceConfig {
                name: name.clone(),
                model: model.name.to_string(),
                backing: settled.backing,
                settings: settled.settings,
                placement,
                server,
                request_deadline,
                faults,
                restart,
                attached: d.attached.unwrap_or(true),
                fault_injection: d.fault_injection,
                driver_abort_on,
                max_memory,
                max_files,
            });
        }
        let mut exports: Vec<ExportConfig> = Vec::new();
        for e in raw.export {
            let at = e.span().start;
            let e = e.into_inner();
            let device = e.device.get_ref();
            match devices.iter().find(|d| &d.name == device) {
                None => {
                    return Err(err(
                        e.device.span().start,
                        format!("export of {device:?}: the machine has no such device"),
                    ))
                }
                Some(d) if !d.attached => {
                    return Err(err(
                        e.device.span().start,
                        format!("export of {device:?}: the device starts detached"),
                    ))
                }
                Some(_) => {}
            }
            let protocol = match e
                .protocol
                .as_ref()
                .map(|p| (p.get_ref().as_str(), p.span()))
            {
                None | Some(("nbd", _)) => ExportProtocol::Nbd,
                Some(("tap", _)) => ExportProtocol::Tap {
                    interface: tap_interface(&e, device).map_err(|(at, m)| err(at, m))?,
                    own: e.own.as_ref().is_some_and(|o| *o.get_ref()),
                },
                Some((other, at)) => {
                    return Err(err(
                        at.start,
                        format!("protocol {other:?}: exports speak \"nbd\" or \"tap\""),
                    ))
                }
            };
            if let (ExportProtocol::Nbd, Some(o)) = (&protocol, &e.own) {
                return Err(err(
                    o.span().start,
                    "own is a TAP export's (protocol = \"tap\")".into(),
                ));
            }
            if let (ExportProtocol::Nbd, Some(i)) = (&protocol, &e.interface) {
                return Err(err(
                    i.span().start,
                    "interface is a TAP export's (protocol = \"tap\")".into(),
                ));
            }
            let name = e.name.as_ref().map_or(device, |n| n.get_ref()).clone();
            if name.is_empty() || name.len() > 256 || name.contains('\0') {
                return Err(err(at, format!("export name {name:?}: 1-256 characters")));
            }
            if exports.iter().any(|o| o.name == name) {
                return Err(err(at, format!("two exports are named {name:?}")));
            }
            let address = match (&e.socket, &e.listen) {
                (Some(_), Some(l)) => {
                    return Err(err(
                        l.span().start,
                        "an export listens on a socket or on TCP, not both".into(),
                    ))
                }
                (None, Some(l)) => ExportAddress::Tcp(l.get_ref().parse().map_err(|_| {
                    err(
                        l.span().start,
                        format!(
                            "listen = {:?}: an address and port, e.g. \"127.0.0.1:10809\"",
                            l.get_ref()
                        ),
                    )
                })?),
                (Some(p), None) if p.get_ref().is_empty() => {
                    return Err(err(p.span().start, "socket = \"\": give a path".into()))
                }
                (Some(p), None) => ExportAddress::Socket(Some(p.get_ref().into())),
                (None, None) => ExportAddress::Socket(None),
            };
            let tls = match (&e.tls_cert, &e.tls_key) {
                (Some(c), Some(k)) => Some((c.get_ref().into(), k.get_ref().into())),
                (None, None) => None,
                (Some(c), None) => {
                    return Err(err(c.span().start, "tls_cert needs tls_key".into()))
                }
                (None, Some(k)) => {
                    return Err(err(k.span().start, "tls_key needs tls_cert".into()))
                }
            };
            if let (Some(v), None) = (&e.tls_verify_peer, &tls) {
                return Err(err(
                    v.span().start,
                    "tls_verify_peer needs tls_cert and tls_key".into(),
                ));
            }
            if let (Some(p), Some(_)) = (&e.tls_psk, &tls) {
                return Err(err(
                    p.span().start,
                    "tls_psk or tls_cert and tls_key, not both".into(),
                ));
            }
            let secured = tls.is_some() || e.tls_psk.is_some();
            if let (ExportAddress::Tcp(a), false, false) = (&address, secured, e.insecure) {
                if !a.ip().is_loopback() {
                    let at = e.listen.as_ref().map_or(at, |l| l.span().start);
                    return Err(err(
                        at,
                        format!(
                            "listen = \"{a}\" without TLS: anyone who can reach it could read \
                             and write the disk; add tls_cert and tls_key (or tls_psk), listen on \
                             127.0.0.1, or set insecure = true on a network you trust"
                        ),
                    ));
                }
            }
            let max_connections = match &e.max_connections {
                None => DEFAULT_MAX_CONNECTIONS,
                Some(n) => u64::try_from(*n.get_ref())
                    .ok()
                    .filter(|n| (1..=4096).contains(n))
                    .ok_or_else(|| {
                        err(
                            n.span().start,
                            format!("max_connections = {}: from 1 to 4096", n.get_ref()),
                        )
                    })?,
            };
            let idle_timeout = match &e.idle_timeout {
                None => None,
                v => Some(duration("idle_timeout", v, std::time::Duration::ZERO)?),
            };
            exports.push(ExportConfig {
                name,
                device: device.clone(),
                protocol,
                address,
                read_only: e.read_only,
                tls,
                tls_verify_peer: e.tls_verify_peer.as_ref().map(|v| v.get_ref().into()),
                tls_psk: e.tls_psk.as_ref().map(|v| v.get_ref().into()),
                insecure: e.insecure,
                max_connections,
                handshake_timeout: duration(
                    "handshake_timeout",
                    &e.handshake_timeout,
                    DEFAULT_HANDSHAKE_TIMEOUT,
                )?,
                idle_timeout,
                write_timeout: duration("write_timeout", &e.write_timeout, DEFAULT_WRITE_TIMEOUT)?,
                max_memory: memory_limit(&e.max_memory)?,
                max_files: files_limit(&e.max_files)?,
            });
        }
        let mut driver_libraries: Vec<PathBuf> = Vec::new();
        for l in raw.driver {
            let l = l.into_inner().library;
            let path = PathBuf::from(l.get_ref());
            if l.get_ref().is_empty() {
                return Err(err(
                    l.span().start,
                    "library = \"\": name a shared object".into(),
                ));
            }
            if driver_libraries.contains(&path) {
                return Err(err(
                    l.span().start,
                    format!("library {:?} is named twice", l.get_ref()),
                ));
            }
            driver_libraries.push(path);
        }
        Ok(Machine {
            name: raw.name.unwrap_or_else(|| "machine".into()),
            devices,
            exports,
            driver_libraries,
        })
    }
}

/// `500ms`, `30s` or `2m`.
pub fn parse_duration(s: &str) -> Option<std::time::Duration> {
    let i = s.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = s.split_at(i);
    let n: u64 = n.parse().ok()?;
    match unit {
        "ms" => Some(std::time::Duration::from_millis(n)),
        "s" => Some(std::time::Duration::from_secs(n)),
        "m" => Some(std::time::Duration::from_secs(n.checked_mul(60)?)),
        _ => None,
    }
}

/// A name that is safe as part of a file name: 1-32 letters, digits, `-` or `_`.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// A TAP export's interface name, checked; the keys only an NBD export has are refused.
/// An error is where (an offset into the text) and what.
fn tap_interface(e: &RawExport, device: &str) -> Result<String, (usize, String)> {
    let nbd_only: [(&str, Option<usize>); 11] = [
        ("socket", e.socket.as_ref().map(|v| v.span().start)),
        ("listen", e.listen.as_ref().map(|v| v.span().start)),
        ("tls_cert", e.tls_cert.as_ref().map(|v| v.span().start)),
        ("tls_key", e.tls_key.as_ref().map(|v| v.span().start)),
        (
            "tls_verify_peer",
            e.tls_verify_peer.as_ref().map(|v| v.span().start),
        ),
        ("tls_psk", e.tls_psk.as_ref().map(|v| v.span().start)),
        (
            "max_connections",
            e.max_connections.as_ref().map(|v| v.span().start),
        ),
        (
            "handshake_timeout",
            e.handshake_timeout.as_ref().map(|v| v.span().start),
        ),
        (
            "idle_timeout",
            e.idle_timeout.as_ref().map(|v| v.span().start),
        ),
        (
            "write_timeout",
            e.write_timeout.as_ref().map(|v| v.span().start),
        ),
        ("read_only", e.read_only.then_some(e.device.span().start)),
    ];
    if let Some((key, at)) = nbd_only.iter().find_map(|(k, at)| at.map(|a| (k, a))) {
        return Err((
            at,
            format!("{key} is an NBD export's; a TAP export takes interface (and name)"),
        ));
    }
    let (name, at) = match &e.interface {
        Some(i) => (i.get_ref().clone(), i.span().start),
        None => (device.to_string(), e.device.span().start),
    };
    check_interface(&name).map_err(|why| (at, format!("interface {why}")))?;
    Ok(name)
}

/// A host network interface's name as the manager makes one (a TAP export's, a NIC's TAP
/// cable): 1 to 15 letters, digits, '-', '_' or '.'.
pub(crate) fn check_interface(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() < 16
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    match ok {
        true => Ok(()),
        false => Err(format!(
            "{name:?}: 1 to 15 letters, digits, '-', '_' or '.'"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_key_of_another_model_is_refused_with_the_models_own_keys() {
        let text = "[[device]]\nname = \"n\"\nmodel = \"null-blk\"\nsize = \"1M\"\nqueues = 2\n";
        let e = Machine::parse(text, "m.toml").unwrap_err();
        assert_eq!(e.line, 5, "{e}");
        assert!(
            e.message
                .contains("queues is not a key of a null-blk device"),
            "{e}"
        );
        assert!(e.message.contains("its keys: size"), "{e}");
        // A key no model has: named with this model's keys, not every model's.
        let text = "[[device]]\nname = \"r\"\nmodel = \"virtio-rng\"\ncolour = \"red\"\n";
        let e = Machine::parse(text, "m.toml").unwrap_err();
        assert_eq!(e.line, 4, "{e}");
        assert!(
            e.message
                .contains("colour is not a key of a virtio-rng device (its keys: seed;"),
            "{e}"
        );
        assert!(!e.message.contains("backing"), "{e}");
        let m = Machine::parse(
            "[[device]]\nname = \"d\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\nqueues = 2\nread_only = true\n",
            "m.toml",
        )
        .unwrap();
        assert_eq!(m.devices[0].setting("queues", "1"), "2");
        assert!(m.devices[0].flag("read_only"));
    }

    #[test]
    fn a_pci_function_is_a_device_by_its_address_and_what_it_cannot_be_is_refused() {
        let m = Machine::parse(
            "[[device]]\nname = \"disk0\"\npci = \"00:04.0\"\nrestarts = 7\n",
            "m.toml",
        )
        .unwrap();
        let d = &m.devices[0];
        assert_eq!(d.model, "pci");
        assert_eq!(d.model().kind, crate::models::Kind::Hardware);
        assert_eq!(crate::models::pci::address(d), Some("0000:00:04.0"));
        assert_eq!(d.backing, "pci:0000:00:04.0");
        assert_eq!((d.model().spec)(d), "vfio:0000:00:04.0");
        for (text, line, why) in [
            (
                "pci = \"0000:00:04.0\"\nmodel = \"virtio-blk\"\n",
                3,
                "pci is not a key of a virtio-blk device",
            ),
            ("restarts = 1\n", 2, "needs model = \"MODEL\""),
            ("pci = \"0000:00:04\"\n", 3, "is not a PCI address"),
            ("pci = \"../../x\"\n", 3, "is not a PCI address"),
            ("model = \"pci\"\n", 3, "unknown model \"pci\""),
            (
                "pci = \"00:04.0\"\nfaults = [\"drop-irq=1\"]\n",
                4,
                "no device model to inject faults into",
            ),
            (
                "pci = \"00:04.0\"\nfault_injection = true\n",
                3,
                "no device model to inject faults into",
            ),
            (
                "pci = \"00:04.0\"\nplacement = \"colocated\"\n",
                4,
                "driven only in a driver server",
            ),
            (
                "pci = \"00:04.0\"\nbacking = \"mem:1M\"\n",
                4,
                "backing is not a key of a pci device (its keys: pci;",
            ),
            (
                "pci = \"00:04.0\"\n[[device]]\nname = \"b\"\npci = \"0000:00:04.0\"\n",
                6,
                "device a already has this function",
            ),
        ] {
            let e =
                Machine::parse(&format!("[[device]]\nname = \"a\"\n{text}"), "m.toml").unwrap_err();
            assert!(e.message.contains(why), "{text:?}: {e}");
            assert_eq!(e.line, line, "{text:?}: {e}");
        }
    }

    #[test]
    fn devices_may_start_detached_but_are_not_exported_then() {
        let base = "name = \"m\"\n[[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\n";
        let m = Machine::parse(&format!("{base}attached = false\n"), "m.toml").unwrap();
        assert!(!m.devices[0].attached);
        assert!(Machine::parse(base, "m.toml").unwrap().devices[0].attached);
        let e = Machine::parse(
            &format!("{base}attached = false\n[[export]]\ndevice = \"disk0\"\n"),
            "m.toml",
        )
        .unwrap_err();
        assert!(e.to_string().contains("starts detached"), "{e}");
    }

    #[test]
    fn exports_are_checked_and_located() {
        let base = "[[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\n";
        let ok = format!(
            "{base}[[export]]\ndevice = \"disk0\"\n[[export]]\ndevice = \"disk0\"\nname = \"ro\"\nlisten = \"127.0.0.1:10809\"\nread_only = true\n"
        );
        let m = Machine::parse(&ok, "m.toml").unwrap();
        assert_eq!(m.exports.len(), 2);
        assert_eq!(m.exports[0].name, "disk0");
        assert_eq!(m.exports[0].address, ExportAddress::Socket(None));
        assert_eq!(
            m.exports[1].address,
            ExportAddress::Tcp("127.0.0.1:10809".parse().unwrap())
        );
        assert!(m.exports[1].read_only);
        for (bad, says) in [
            ("[[export]]\ndevice = \"disk9\"\n", "no such device"),
            (
                "[[export]]\ndevice = \"disk0\"\nsocket = \"/tmp/x\"\nlisten = \"127.0.0.1:1\"\n",
                "not both",
            ),
            (
                "[[export]]\ndevice = \"disk0\"\nlisten = \"localhost\"\n",
                "address and port",
            ),
            (
                "[[export]]\ndevice = \"disk0\"\nprotocol = \"iscsi\"\n",
                "nbd",
            ),
            (
                "[[export]]\ndevice = \"disk0\"\n[[export]]\ndevice = \"disk0\"\n",
                "two exports",
            ),
            (
                "[[export]]\ndevice = \"disk0\"\nport = 1\n",
                "unknown field",
            ),
            (
                "[[export]]\ndevice = \"disk0\"\ntls_cert = \"c.pem\"\n",
                "needs tls_key",
            ),
            (
                "[[export]]\ndevice = \"disk0\"\nlisten = \"0.0.0.0:10809\"\n",
                "without TLS",
            ),
            (
                "[[export]]\ndevice = \"disk0\"\ntls_verify_peer = \"ca.pem\"\n",
                "needs tls_cert",
            ),
        ] {
            let e = Machine::parse(&format!("{base}{bad}"), "m.toml").unwrap_err();
            assert!(e.message.contains(says), "{bad}: {e}");
            assert!(e.line >= 5, "{bad}: located at line {}", e.line);
        }
    }

    #[test]
    fn the_default_machine_parses() {
        let m = Machine::default_machine();
        assert_eq!(m.devices.len(), 1);
        assert_eq!(m.devices[0].name, "disk0");
        assert_eq!(m.devices[0].placement, Placement::Separate);
    }

    /// The keys serde takes for `T`, as its derived `Deserialize` asks for them.
    fn keys_of<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
        use serde::de::Visitor;
        #[derive(Debug)]
        struct Stop;
        impl std::fmt::Display for Stop {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("only the fields were wanted")
            }
        }
        impl std::error::Error for Stop {}
        impl serde::de::Error for Stop {
            fn custom<M: std::fmt::Display>(_: M) -> Self {
                Stop
            }
        }
        struct Fields(std::cell::Cell<&'static [&'static str]>);
        impl<'de> serde::Deserializer<'de> for &Fields {
            type Error = Stop;
            fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
                Err(Stop)
            }
            fn deserialize_struct<V: Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, Stop> {
                self.0.set(fields);
                Err(Stop)
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
                byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
                identifier ignored_any
            }
        }
        let f = Fields(std::cell::Cell::new(&[]));
        let _ = T::deserialize(&f);
        f.0.get()
    }

    /// `docs/machine.md` is the reference: a heading for every key the parser takes (of the
    /// machine, of every `[[device]]` and model, of every `[[export]]`), the embedded default
    /// as `outboard up --print-default` prints it, and a complete example the parser takes.
    #[test]
    fn the_configuration_reference_names_every_key_and_its_example_parses() {
        let doc = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/machine.md"
        ))
        .unwrap();
        let headings: Vec<&str> = doc.lines().filter(|l| l.starts_with('#')).collect();
        let keys = keys_of::<RawMachine>()
            .iter()
            .chain(keys_of::<RawDevice>())
            .chain(keys_of::<RawExport>())
            .chain(crate::models::MODELS.iter().flat_map(|m| m.keys));
        let mut seen = 0;
        for k in keys {
            seen += 1;
            let named = format!("`{k}`");
            assert!(
                headings.iter().any(|h| h.contains(&named)),
                "docs/machine.md has no heading for {named}"
            );
        }
        assert!(seen > 40, "only {seen} keys found");
        assert!(
            doc.contains(DEFAULT_MACHINE),
            "the default machine as printed"
        );
        let example = doc
            .split("## A complete example")
            .nth(1)
            .and_then(|rest| rest.split("```toml\n").nth(1))
            .and_then(|block| block.split("```").next())
            .expect("a complete example");
        let m = Machine::parse(example, "docs/machine.md").unwrap();
        assert!(m.devices.len() > 5 && m.exports.len() > 3);
        // Everything the default names, commented out, is a key the default takes.
        let uncommented: String = DEFAULT_MACHINE
            .lines()
            .map(|l| {
                l.strip_prefix("# ")
                    .filter(|r| r.contains(" = ") || r.starts_with("[["))
                    .unwrap_or(l)
            })
            .collect::<Vec<_>>()
            .join("\n");
        Machine::parse(&uncommented, "uncommented default").unwrap();
    }

    /// Every placement the README names is a placement the description takes: "grouped" is
    /// a separate placement in a server that other devices name too, so it needs the name.
    #[test]
    fn grouped_devices_share_the_server_they_name() {
        let two = |placement: &str, server: &str| {
            format!(
                "[[device]]\nname = \"a\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\n\
                 placement = \"{placement}\"\n{server}\n[[device]]\nname = \"b\"\n\
                 model = \"virtio-blk\"\nbacking = \"mem:1M\"\nplacement = \"{placement}\"\n\
                 {server}\n"
            )
        };
        let m = Machine::parse(&two("grouped", "server = \"pair\""), "g.toml").unwrap();
        for d in &m.devices {
            assert_eq!(
                (d.placement, d.server.as_str()),
                (Placement::Separate, "pair")
            );
        }
        let e = Machine::parse(&two("grouped", ""), "g.toml").unwrap_err();
        assert_eq!(e.line, 5, "{e}");
        assert!(e.message.contains("needs server = NAME"), "{e}");
        let e = Machine::parse(&two("shared", ""), "g.toml").unwrap_err();
        assert!(e.message.contains("\"grouped\""), "{e}");
    }

    #[test]
    fn errors_name_the_file_line_and_problem() {
        let bad = "name = \"m\"\n\n[[device]]\nname = \"disk0\"\nmodel = \"floppy\"\nbacking = \"mem:1M\"\n";
        let e = Machine::parse(bad, "m.toml").unwrap_err();
        assert_eq!((e.file.as_str(), e.line), ("m.toml", 5), "{e}");
        assert!(e.message.contains("unknown model"), "{e}");
        let typo = "[[device]]\nname = \"d\"\nmodel = \"virtio-blk\"\nbackin = \"mem:1M\"\n";
        let e = Machine::parse(typo, "t.toml").unwrap_err();
        assert_eq!(e.line, 4, "{e}");
        assert!(e.to_string().starts_with("t.toml:4: "), "{e}");
        let syntax = "[[device]\nname = 1\n";
        assert_eq!(Machine::parse(syntax, "s.toml").unwrap_err().line, 1);
        let dup = "[[device]]\nname = \"a\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\n[[device]]\nname = \"a\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\n";
        let e = Machine::parse(dup, "d.toml").unwrap_err();
        assert_eq!(e.line, 6, "{e}");
        let size = "[[device]]\nname = \"a\"\nmodel = \"virtio-blk\"\nbacking = \"mem:100\"\n";
        assert_eq!(Machine::parse(size, "z.toml").unwrap_err().line, 4);
        let q =
            "[[device]]\nname = \"a\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\nqueues = 99\n";
        assert_eq!(Machine::parse(q, "q.toml").unwrap_err().line, 5);
        assert!(Machine::parse("", "e.toml")
            .unwrap_err()
            .message
            .contains("no [[device]]"));
    }

    #[test]
    fn server_names_are_validated_and_placement_is_consistent() {
        let dev = |extra: &str| {
            format!(
                "[[device]]\nname = \"d\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\n{extra}"
            )
        };
        for bad in ["control/x", "../escaped", "", "a.sock", "x y"] {
            let e = Machine::parse(&dev(&format!("server = {bad:?}\n")), "s.toml").unwrap_err();
            assert_eq!(e.line, 5, "{bad:?}: {e}");
            assert!(e.message.contains("server name"), "{e}");
        }
        // "control" is a fine name: its socket is control.server.sock, not the control socket.
        Machine::parse(&dev("server = \"control\"\n"), "s.toml").unwrap();
        let e = Machine::parse(
            &dev("placement = \"colocated\"\nserver = \"s\"\n"),
            "c.toml",
        )
        .unwrap_err();
        assert!(e.message.contains("colocated"), "{e}");
        let null = "[[device]]\nname = \"n\"\nmodel = \"null-blk\"\nsize = \"1M\"\nplacement = \"colocated\"\n";
        assert!(Machine::parse(null, "n.toml")
            .unwrap_err()
            .message
            .contains("separate"));
    }

    #[test]
    fn driver_libraries_are_relative_to_the_description_and_named_once() {
        let dir = tempfile::tempdir().unwrap();
        let text = "[[driver]]\nlibrary = \"lib/a.so\"\n[[driver]]\nlibrary = \"/opt/b.so\"\n\
                    [[device]]\nname = \"c\"\nmodel = \"timer\"\nhz = 100\n";
        let path = dir.path().join("m.toml");
        std::fs::write(&path, text).unwrap();
        let m = Machine::load(&path).unwrap();
        assert_eq!(
            m.driver_libraries,
            vec![dir.path().join("lib/a.so"), "/opt/b.so".into()]
        );
        assert_eq!(m.devices[0].settings["hz"], "100");
        let twice = "[[driver]]\nlibrary = \"a.so\"\n[[driver]]\nlibrary = \"a.so\"\n\
                     [[device]]\nname = \"c\"\nmodel = \"timer\"\n";
        let e = Machine::parse(twice, "t.toml").unwrap_err();
        assert!(e.message.contains("named twice") && e.line == 4, "{e}");
        let other = "[[driver]]\nlibrary = \"a.so\"\nscore = 1\n[[device]]\nname = \"c\"\nmodel = \"timer\"\n";
        assert!(Machine::parse(other, "t.toml").is_err());
        let fast = "[[device]]\nname = \"c\"\nmodel = \"timer\"\nhz = 200000\n";
        let e = Machine::parse(fast, "t.toml").unwrap_err();
        assert!(e.message.contains("1 to 100000"), "{e}");
    }

    #[test]
    fn two_writable_devices_cannot_share_a_backing_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("disk.img");
        std::fs::write(&f, vec![0u8; 4096]).unwrap();
        let two = |ro_a: bool, ro_b: bool, b: &std::path::Path| {
            format!(
                "[[device]]\nname = \"a\"\nmodel = \"virtio-blk\"\nbacking = {:?}\nread_only = {ro_a}\n\
                 [[device]]\nname = \"b\"\nmodel = \"virtio-blk\"\nbacking = {:?}\nread_only = {ro_b}\n",
                f.display().to_string(),
                b.display().to_string()
            )
        };
        let e = Machine::parse(&two(false, false, &f), "t.toml").unwrap_err();
        assert!(e.message.contains("also a's"), "{e}");
        // The same file by another name is the same file.
        let other = dir.path().join(".").join("disk.img");
        assert!(Machine::parse(&two(false, true, &other), "t.toml").is_err());
        Machine::parse(&two(true, true, &f), "t.toml").unwrap();
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(s in "\\PC{0,300}") {
            let _ = Machine::parse(&s, "fuzz.toml");
        }
    }
}
