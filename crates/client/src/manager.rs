//! The manager's control API from a client: the registry, a device's entry, power, restart,
//! attach and detach. Every call answers with the manager's reply or a [`Refusal`] (its code
//! and reason), whatever the device's class.

use std::path::{Path, PathBuf};
use std::time::Duration;

use outboard_session::{control, Code, Refusal};

use crate::api::{Reply, Request};
use crate::registry::Node;

/// A connection to the manager at `control_path`, once it is known to run as this user or
/// root.
fn connect_manager(control_path: &Path) -> Result<std::os::fd::OwnedFd, Refusal> {
    let sock = control::connect(control_path).map_err(|e| {
        Refusal::new(
            Code::Unreachable,
            format!(
            "the manager: {e} (is `outboard up` running? --control / OUTBOARD_CONTROL pick its \
             socket)"
        ),
        )
    })?;
    manager_is_trusted(std::os::fd::AsFd::as_fd(&sock), control_path)?;
    Ok(sock)
}

/// Sends one request to the manager.
pub fn ask(control_path: &Path, req: &Request) -> Result<Reply, Refusal> {
    let sock = connect_manager(control_path)?;
    let fd = std::os::fd::AsFd::as_fd(&sock);
    if let Err(e) = control::send(fd, req, &[]) {
        // A manager that does not serve this user answers at once and hangs up: its refusal
        // may be waiting even though the request could not be sent.
        return match control::recv(fd, Some(Duration::from_millis(100))) {
            Ok((reply, _)) => Ok(reply),
            Err(_) => Err(Refusal::new(Code::Protocol, e.to_string())),
        };
    }
    let (reply, _) = control::recv(fd, Some(Duration::from_secs(10)))
        .map_err(|e| Refusal::new(Code::Protocol, e.to_string()))?;
    Ok(reply)
}

/// Whether the process serving `control_path` runs as this user or as root: a socket another
/// user put where clients look (a runtime directory they made first) is not talked to. The
/// same holds for a driver server's session socket (which the manager binds).
pub(crate) fn manager_is_trusted(
    sock: std::os::fd::BorrowedFd<'_>,
    control_path: &Path,
) -> Result<(), Refusal> {
    let cred = rustix::net::sockopt::socket_peercred(sock).map_err(|e| {
        Refusal::new(
            Code::Unreachable,
            format!("{}: who serves it: {e}", control_path.display()),
        )
    })?;
    let (them, me) = (cred.uid.as_raw(), rustix::process::geteuid().as_raw());
    if them == 0 || them == me {
        return Ok(());
    }
    Err(Refusal::new(
        Code::Unreachable,
        format!(
            "{} is served by uid {them}, neither you (uid {me}) nor root: refusing to use it \
             (pick the right manager with --control / OUTBOARD_CONTROL)",
            control_path.display()
        ),
    ))
}

/// The manager's registry.
pub fn registry(control_path: &Path) -> Result<Node, Refusal> {
    match ask(control_path, &Request::List)? {
        Reply::Registry { tree } => Ok(tree),
        other => Err(refusal(other)),
    }
}

/// A reply that carries a class device's registry entry, or says why not.
pub(crate) fn node_reply(reply: Reply) -> Result<Node, Refusal> {
    match reply {
        Reply::Status { node } => Ok(node),
        other => Err(refusal(other)),
    }
}

/// A reply other than the one asked for: the manager's refusal, or a protocol error.
fn refusal(reply: Reply) -> Refusal {
    match reply {
        Reply::Error { code, message } => Refusal::new(code, message),
        other => unexpected(&other),
    }
}

/// A class device's registry entry.
pub fn status(control_path: &Path, name: &str) -> Result<Node, Refusal> {
    node_reply(ask(control_path, &Request::Status { name: name.into() })?)
}

/// Asks for class device `name` to be suspended or resumed; returns its registry entry as
/// the manager answered (the state reads `suspending` until the device has drained).
pub fn power(control_path: &Path, name: &str, suspend: bool) -> Result<Node, Refusal> {
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
pub fn restart(control_path: &Path, name: &str) -> Result<Node, Refusal> {
    restart_with(control_path, name, false, None)
}

/// Restarts `name`'s driver, draining it first if `graceful`, on program `exe` if given (see
/// [`Request::Restart`]).
pub fn restart_with(
    control_path: &Path,
    name: &str,
    graceful: bool,
    exe: Option<&Path>,
) -> Result<Node, Refusal> {
    node_reply(ask(
        control_path,
        &Request::Restart {
            name: name.into(),
            graceful,
            exe: exe.map(Path::to_path_buf),
        },
    )?)
}

/// An export started by hand, registered with the manager for as long as it lives (see
/// [`Request::ExportUp`]): dropping it (or the process ending) takes it out of the registry.
pub struct Registration {
    conn: std::sync::Mutex<std::os::fd::OwnedFd>,
    name: String,
    device: String,
    uri: String,
}

impl Registration {
    /// Registers export `name` of `device` at `uri` with the manager at `control_path`.
    pub fn new(control_path: &Path, name: &str, device: &str, uri: &str) -> Result<Self, Refusal> {
        let r = Self {
            conn: std::sync::Mutex::new(connect_manager(control_path)?),
            name: name.into(),
            device: device.into(),
            uri: uri.into(),
        };
        r.clients(Vec::new())?;
        Ok(r)
    }

    /// The export's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tells the manager the export's clients now.
    pub fn clients(&self, clients: Vec<String>) -> Result<(), Refusal> {
        let req = Request::ExportUp {
            name: self.name.clone(),
            device: self.device.clone(),
            uri: self.uri.clone(),
            clients,
        };
        // One request and its answer at a time, whichever connection thread tells.
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let fd = std::os::fd::AsFd::as_fd(&*conn);
        control::send(fd, &req, &[]).map_err(|e| Refusal::new(Code::Protocol, e.to_string()))?;
        match control::recv(fd, Some(Duration::from_secs(2))) {
            Ok((Reply::Noted, _)) => Ok(()),
            Ok((other, _)) => Err(refusal(other)),
            Err(e) => Err(Refusal::new(Code::Protocol, e.to_string())),
        }
    }
}

/// Asks the manager to stop the machine (see [`Request::Down`]); returns once it said it
/// stops, before it has.
pub fn down(control_path: &Path) -> Result<(), Refusal> {
    match ask(control_path, &Request::Down)? {
        Reply::Stopping => Ok(()),
        other => Err(refusal(other)),
    }
}

/// Moves class device `name`'s driver into driver server `server` (see [`Request::Move`]);
/// returns its registry entry at once (state `restarting`).
pub fn move_device(control_path: &Path, name: &str, server: &str) -> Result<Node, Refusal> {
    node_reply(ask(
        control_path,
        &Request::Move {
            name: name.into(),
            server: server.into(),
        },
    )?)
}

/// Attaches a declared device (`name`) or new ones (`description`, `[[device]]` tables);
/// returns the class device's registry entry once it serves.
pub fn attach(
    control_path: &Path,
    name: Option<&str>,
    description: Option<&str>,
) -> Result<Node, Refusal> {
    let req = Request::Attach {
        name: name.map(Into::into),
        description: description.map(Into::into),
    };
    node_reply(ask(control_path, &req)?)
}

/// Starts detaching class device `name`; returns its registry entry (state `detaching`).
pub fn detach(control_path: &Path, name: &str) -> Result<Node, Refusal> {
    node_reply(ask(control_path, &Request::Detach { name: name.into() })?)
}

/// The fault socket of class device `name`'s model (it has one when it is emulated).
pub fn faults_socket(control_path: &Path, name: &str) -> Result<std::path::PathBuf, Refusal> {
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
            Refusal::new(
                Code::NoSuchDevice,
                format!(
                    "{name} has no fault socket: faults are injected only into emulated devices \
                 whose machine description asks for it (fault_injection = true in its \
                 [[device]] table, or `outboard up --faults` for all)"
                ),
            )
        })
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

/// A reply the manager should not have given to the request.
pub(crate) fn unexpected(reply: &Reply) -> Refusal {
    Refusal::new(Code::Protocol, format!("unexpected reply {reply:?}"))
}
