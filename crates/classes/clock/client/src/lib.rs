//! The clock class's client: one [`ClockDevice`](outboard_clock::ClockDevice) API over a
//! session with a driver server ([`session`], resumed and its requests sent again when the
//! server restarts), and opening a clock by name ([`open_clock`]). A clock has no colocated
//! placement: its driver's interrupts need a process of their own.
#![deny(missing_docs)]

pub mod session;

pub use session::ClockClient;

use std::path::Path;

use outboard_client::api::Placement;
use outboard_client::{ClassClient, Supervisor};
use outboard_clock::{ClockDevice, ClockError, CLASS};
use outboard_hw::DeviceSpec;

/// Bytes of a session's buffer area: a clock moves no data through it.
pub const BUFFER: u64 = 4096;

/// The clock class, as open-by-name builds its handle.
#[derive(Debug, Clone, Copy, Default)]
pub struct Clock;

impl ClassClient for Clock {
    const CLASS: &'static str = CLASS;
    type Handle = Box<dyn ClockDevice>;
    type Error = ClockError;

    fn separate(
        &self,
        server: &Path,
        name: &str,
        supervisor: Supervisor,
    ) -> Result<Self::Handle, ClockError> {
        Ok(Box::new(ClockClient::open_supervised(
            supervisor, server, name,
        )?))
    }

    fn colocated(&self, name: &str, _device: DeviceSpec) -> Result<Self::Handle, ClockError> {
        Err(ClockError::Invalid(format!(
            "{name}: a clock's driver runs in its own server, not in a client"
        )))
    }

    fn not_there(e: &ClockError) -> bool {
        matches!(
            e,
            ClockError::DeviceGone | ClockError::NoSuchDevice(_) | ClockError::Timeout
        )
    }
}

/// Opens clock `name` wherever the machine places its driver.
pub fn open_clock(
    control_path: &Path,
    name: &str,
) -> Result<(Box<dyn ClockDevice>, Placement), ClockError> {
    outboard_client::open(control_path, name, &Clock)
}
