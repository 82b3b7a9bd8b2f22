//! Opening class devices by name through the manager: the client's side of placement.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outboard_block::{BlockDevice, BlockError};
use outboard_drivers::Attachment;
use outboard_hw::DeviceSpec;
use outboard_session::control;

use crate::api::{Placement, Reply, Request};
use crate::colocated::Colocated;
use crate::registry::Node;
use crate::session::{reply_error, BlockClient, SessionOptions, Supervisor};

/// Longest a client waits for a restarting driver before it fails its requests with "device
/// failed" (the manager normally gives up, and says so, much sooner).
pub const RESTART_PATIENCE: Duration = Duration::from_secs(120);

/// Sends one request to the manager.
pub fn ask(control_path: &Path, req: &Request) -> Result<Reply, BlockError> {
    let sock = control::connect(control_path).map_err(|e| {
        BlockError::Unreachable(format!(
            "the manager: {e} (is `outboard up` running? --control / OUTBOARD_CONTROL pick its \
             socket)"
        ))
    })?;
    let fd = std::os::fd::AsFd::as_fd(&sock);
    manager_is_trusted(fd, control_path)?;
    control::send(fd, req, &[]).map_err(|e| BlockError::Protocol(e.to_string()))?;
    let (reply, _) = control::recv(fd, Some(Duration::from_secs(10)))
        .map_err(|e| BlockError::Protocol(e.to_string()))?;
    Ok(reply)
}

/// Whether the process serving `control_path` runs as this user or as root: a socket another
/// user put where clients look (a runtime directory they made first) is not talked to.
fn manager_is_trusted(
    sock: std::os::fd::BorrowedFd<'_>,
    control_path: &Path,
) -> Result<(), BlockError> {
    let cred = rustix::net::sockopt::socket_peercred(sock).map_err(|e| {
        BlockError::Unreachable(format!("{}: who serves it: {e}", control_path.display()))
    })?;
    let (them, me) = (cred.uid.as_raw(), rustix::process::geteuid().as_raw());
    if them == 0 || them == me {
        return Ok(());
    }
    Err(BlockError::Unreachable(format!(
        "{} is served by uid {them}, neither you (uid {me}) nor root: refusing to use it \
         (pick the right manager with --control / OUTBOARD_CONTROL)",
        control_path.display()
    )))
}

/// The manager's registry.
pub fn registry(control_path: &Path) -> Result<Node, BlockError> {
    match ask(control_path, &Request::List)? {
        Reply::Registry { tree } => Ok(tree),
        Reply::Error { code, message } => Err(reply_error(&code, message)),
        other => Err(BlockError::Protocol(format!("unexpected reply {other:?}"))),
    }
}

/// A reply that carries a class device's registry entry, or says why not.
fn node_reply(reply: Reply) -> Result<Node, BlockError> {
    match reply {
        Reply::Status { node } => Ok(node),
        Reply::Error { code, message } => Err(reply_error(&code, message)),
        other => Err(BlockError::Protocol(format!("unexpected reply {other:?}"))),
    }
}

/// A class device's registry entry.
pub fn status(control_path: &Path, name: &str) -> Result<Node, BlockError> {
    node_reply(ask(control_path, &Request::Status { name: name.into() })?)
}

/// Asks for class device `name` to be suspended or resumed; returns its registry entry as
/// the manager answered (the state reads `suspending` until the device has drained).
pub fn power(control_path: &Path, name: &str, suspend: bool) -> Result<Node, BlockError> {
    node_reply(ask(
        control_path,
        &Request::Power {
            name: name.into(),
            suspend,
        },
    )?)
}

/// Starts class device `name`'s driver again (given up or running); returns its registry
/// entry at once.
pub fn restart(control_path: &Path, name: &str) -> Result<Node, BlockError> {
    node_reply(ask(control_path, &Request::Restart { name: name.into() })?)
}

/// Attaches a declared device (`name`) or new ones (`description`, `[[device]]` tables);
/// returns the class device's registry entry once it serves.
pub fn attach(
    control_path: &Path,
    name: Option<&str>,
    description: Option<&str>,
) -> Result<Node, BlockError> {
    let req = Request::Attach {
        name: name.map(Into::into),
        description: description.map(Into::into),
    };
    node_reply(ask(control_path, &req)?)
}

/// Starts detaching class device `name`; returns its registry entry (state `detaching`).
pub fn detach(control_path: &Path, name: &str) -> Result<Node, BlockError> {
    node_reply(ask(control_path, &Request::Detach { name: name.into() })?)
}

/// The fault socket of class device `name`'s model (it has one when it is emulated).
pub fn faults_socket(control_path: &Path, name: &str) -> Result<std::path::PathBuf, BlockError> {
    let tree = registry(control_path)?;
    fn find<'a>(n: &'a Node, name: &str) -> Option<&'a Node> {
        let serves = |f: &Node| {
            f.children
                .iter()
                .any(|d| d.children.iter().any(|c| c.name == name))
        };
        if n.kind == "pci-function" && serves(n) {
            return Some(n);
        }
        n.children.iter().find_map(|c| find(c, name))
    }
    find(&tree, name)
        .and_then(|f| f.props.get("faults-socket"))
        .and_then(|p| p.as_str())
        .map(std::path::PathBuf::from)
        .ok_or_else(|| {
            BlockError::NoSuchDevice(format!(
                "{name} has no fault socket: faults are injected only into emulated devices \
                 whose machine description asks for it (fault_injection = true in its \
                 [[device]] table, or `outboard up --faults` for all)"
            ))
        })
}

/// Opens block device `name` wherever the machine places its driver: a session with its
/// driver server, or the driver linked into this process. A URI (`nbd://HOST[:PORT]/EXPORT`,
/// `nbd+unix:///EXPORT?socket=PATH`) opens a remote disk over NBD instead.
pub fn open_block(control_path: &Path, name: &str) -> Result<Box<dyn BlockDevice>, BlockError> {
    open_block_with(control_path, name, SessionOptions::default()).map(|(d, _)| d)
}

/// As [`open_block`], with the session's depth and buffer area chosen; also says where the
/// driver runs (a colocated driver serves one client at a time).
pub fn open_block_with(
    control_path: &Path,
    name: &str,
    opts: SessionOptions,
) -> Result<(Box<dyn BlockDevice>, Placement), BlockError> {
    // A remote disk's URI needs no manager: the same API reaches it over NBD.
    if crate::remote::is_uri(name) {
        let d = crate::remote::NbdClient::open(name, opts.buffer_size as usize)?;
        return Ok((Box::new(d), Placement::Separate));
    }
    // A device whose driver is restarting is opened once it is back; so is one whose server
    // died between the manager's answer and the open (the manager then says "restarting").
    let patience = Instant::now() + RESTART_PATIENCE;
    let reply = loop {
        let reply = ask(control_path, &Request::Open { name: name.into() })?;
        let server = match &reply {
            Reply::Error { code, .. } if code == "restarting" && Instant::now() < patience => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Reply::Open {
                placement: Placement::Separate,
                server: Some(server),
                ..
            } => server,
            _ => break reply,
        };
        match BlockClient::open(server, name, opts) {
            Ok(client) => {
                let client = client.supervised(Supervisor {
                    control: control_path.to_owned(),
                    patience: RESTART_PATIENCE,
                });
                return Ok((Box::new(client), Placement::Separate));
            }
            Err(BlockError::DeviceGone | BlockError::NoSuchDevice(_) | BlockError::Timeout)
                if Instant::now() < patience =>
            {
                // The server is not there (or died while opening): the manager knows whether
                // it comes back.
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e),
        }
    };
    match reply {
        Reply::Open {
            placement: Placement::Colocated,
            device: Some(device),
            ..
        } => Ok((
            Box::new(Colocated::open(
                name,
                &Attachment::Pci(DeviceSpec::VfioUser(device)),
                opts.buffer_size as usize,
            )?),
            Placement::Colocated,
        )),
        Reply::Error { code, message } => Err(reply_error(&code, message)),
        other => Err(BlockError::Protocol(format!("unexpected reply {other:?}"))),
    }
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
