//! Opening a class device by name through the manager, whatever its class: the client's side
//! of placement. The manager says where the device's driver runs — a driver server (a session
//! with it, which outlives restarts of the server) or nowhere yet (the driver is linked into
//! this process: the colocated placement) — and which class it serves; the class's client
//! ([`ClassClient`]) builds its handle for that placement. This module names no class.

use std::path::Path;
use std::time::{Duration, Instant};

use outboard_hw::DeviceSpec;
use outboard_session::{Code, Refusal};

use crate::api::{Placement, Reply, Request};
use crate::link::Control;
use crate::manager::unexpected;
use crate::resume::Supervisor;

/// Longest a client waits for a restarting driver before it fails its requests with "device
/// failed" (the manager normally gives up, and says so, much sooner).
pub const RESTART_PATIENCE: Duration = Duration::from_secs(120);

/// A class's client, as open-by-name builds it.
pub trait ClassClient {
    /// The class it speaks, as the manager and sessions name it.
    const CLASS: &'static str;
    /// What the caller gets.
    type Handle;
    /// Its errors; a refusal from the manager becomes one.
    type Error: From<Refusal>;
    /// A session with the driver server at `server` (connected to through
    /// `supervisor.control`), resumed under `supervisor` when the server restarts.
    fn separate(
        &self,
        server: &Path,
        name: &str,
        supervisor: Supervisor,
    ) -> Result<Self::Handle, Self::Error>;
    /// The driver started in this process on the device at `device`.
    fn colocated(&self, name: &str, device: DeviceSpec) -> Result<Self::Handle, Self::Error>;
    /// Whether `e`, from opening a session, means the server is not there (yet): open-by-name
    /// then asks the manager again, which knows whether it comes back.
    fn not_there(e: &Self::Error) -> bool;
}

/// Opens class device `name` wherever the machine places its driver, as class `C`'s handle;
/// also says where the driver runs (a colocated driver serves one client at a time). A device
/// of another class is refused ([`Code::WrongClass`]).
pub fn open<C: ClassClient>(
    control_path: &Path,
    name: &str,
    class: &C,
) -> Result<(C::Handle, Placement), C::Error> {
    open_via(&Control::from(control_path), name, class)
}

/// As [`open`], asking the manager through `control` (a brokered client's connection, say).
pub fn open_via<C: ClassClient>(
    control: &Control,
    name: &str,
    class: &C,
) -> Result<(C::Handle, Placement), C::Error> {
    // A device whose driver is restarting is opened once it is back; so is one whose server
    // died between the manager's answer and the open (the manager then says "restarting").
    let patience = Instant::now() + RESTART_PATIENCE;
    loop {
        let reply = control.ask(&Request::Open { name: name.into() })?;
        let (placement, server, device) = match reply {
            Reply::Error { code, .. } if code == Code::Restarting && Instant::now() < patience => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Reply::Open { class: Some(c), .. } if c != C::CLASS => {
                return Err(Refusal::new(
                    Code::WrongClass,
                    format!("{name} is of the {c} class, not the {} class", C::CLASS),
                )
                .into())
            }
            Reply::Open {
                placement,
                server,
                device,
                ..
            } => (placement, server, device),
            Reply::Error { code, message } => return Err(Refusal::new(code, message).into()),
            other => return Err(unexpected(&other).into()),
        };
        match (placement, server, device) {
            (Placement::Separate, Some(server), _) => {
                let supervisor = Supervisor {
                    control: control.clone(),
                    patience: RESTART_PATIENCE,
                };
                match class.separate(&server, name, supervisor) {
                    Ok(h) => return Ok((h, Placement::Separate)),
                    // The server is not there (or died while opening): the manager knows
                    // whether it comes back.
                    Err(e) if C::not_there(&e) && Instant::now() < patience => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(e),
                }
            }
            (Placement::Colocated, _, Some(device)) => {
                let spec = match control {
                    Control::Socket(_) => DeviceSpec::VfioUser(device),
                    // A brokered client reaches nothing by path: the manager connects it to
                    // the device's model.
                    Control::Broker(_) => {
                        let fd = control
                            .connect_server(&device, name)
                            .map_err(Refusal::from)?;
                        DeviceSpec::VfioUserFd(std::os::fd::IntoRawFd::into_raw_fd(fd))
                    }
                };
                return class
                    .colocated(name, spec)
                    .map(|h| (h, Placement::Colocated));
            }
            (p, ..) => {
                return Err(Refusal::new(
                    Code::Protocol,
                    format!("the manager placed {name} {p:?} without saying where"),
                )
                .into())
            }
        }
    }
}
