//! The network class's client: a session with a NIC's driver server ([`session`]) that sends
//! frames from its buffer area, keeps receive buffers posted there, and sets its receive mode,
//! multicast groups and packet filter.
//!
//! [`colocated`] runs the driver in the application instead; both are a [`NetPort`], and
//! opening a NIC by name ([`open_nic`]) asks the manager where its driver runs and returns
//! the one that fits. A session under the manager's supervision is resumed when its driver
//! server restarts ([`session`] says what survives).
#![deny(missing_docs)]

pub mod colocated;
pub mod port;
pub mod session;
pub mod stack;

pub use colocated::ColocatedNic;
pub use port::NetPort;
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
    type Handle = Box<dyn NetPort>;
    type Error = NetError;

    fn separate(
        &self,
        server: &Path,
        name: &str,
        supervisor: Supervisor,
    ) -> Result<Box<dyn NetPort>, NetError> {
        Ok(Box::new(NetClient::open_supervised(
            &supervisor,
            server,
            name,
            self.0,
        )?))
    }

    fn colocated(&self, name: &str, device: DeviceSpec) -> Result<Box<dyn NetPort>, NetError> {
        Ok(Box::new(ColocatedNic::open(
            name,
            &outboard_drivers::Attachment::Pci(device),
        )?))
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
) -> Result<(Box<dyn NetPort>, Placement), NetError> {
    outboard_client::open(control_path, name, &Net(opts))
}
