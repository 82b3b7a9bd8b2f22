//! The network class's client: a session with a NIC's driver server ([`session`]) that sends
//! frames from its buffer area, keeps receive buffers posted there, and sets its receive mode,
//! multicast groups and packet filter.
//!
//! Opening a NIC by name ([`open_nic`]) asks the manager where its driver runs. Not yet: the
//! colocated placement (the driver linked into the client) and resuming a session when its
//! server restarts (the session ends with `device gone`).
#![deny(missing_docs)]

pub mod session;
pub mod stack;

pub use session::{NetClient, NetOptions};
pub use stack::Udp;

use std::path::Path;

use outboard_client::api::Placement;
use outboard_client::{ClassClient, Supervisor};
use outboard_hw::DeviceSpec;
use outboard_net::{NetError, CLASS};

/// The network class, as open-by-name builds its handle, with the session's options.
#[derive(Debug, Clone, Copy, Default)]
pub struct Net(pub NetOptions);

impl ClassClient for Net {
    const CLASS: &'static str = CLASS;
    type Handle = NetClient;
    type Error = NetError;

    fn separate(
        &self,
        server: &Path,
        name: &str,
        supervisor: Supervisor,
    ) -> Result<NetClient, NetError> {
        NetClient::open_supervised(&supervisor, server, name, self.0)
    }

    fn colocated(&self, name: &str, _: DeviceSpec) -> Result<NetClient, NetError> {
        Err(NetError::Invalid(format!(
            "{name}: the net class has no colocated placement yet; place its driver in a server"
        )))
    }

    fn not_there(e: &NetError) -> bool {
        matches!(
            e,
            NetError::DeviceGone | NetError::NoSuchDevice(_) | NetError::Timeout
        )
    }
}

/// Opens NIC `name` wherever the machine places its driver.
pub fn open_nic(
    control_path: &Path,
    name: &str,
    opts: NetOptions,
) -> Result<(NetClient, Placement), NetError> {
    outboard_client::open(control_path, name, &Net(opts))
}
