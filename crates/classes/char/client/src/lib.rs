//! The char class's client: one [`CharDevice`](outboard_char::CharDevice) API over a session
//! with a driver server ([`session`], resumed when the server restarts), and opening a serial
//! line by name ([`open_char`]). A serial line has no colocated placement: its C driver's
//! interrupts need a process of their own.
#![deny(missing_docs)]

pub mod session;

pub use session::CharClient;

use std::path::Path;

use outboard_char::{CharDevice, CharError, CLASS};
use outboard_client::api::Placement;
use outboard_client::{ClassClient, Supervisor};
use outboard_hw::DeviceSpec;

/// Bytes of a session's buffer area: half for what reads bring, half for what writes send.
pub const BUFFER: u64 = 64 * 1024;

/// The char class, as open-by-name builds its handle.
#[derive(Debug, Clone, Copy, Default)]
pub struct Char;

impl ClassClient for Char {
    const CLASS: &'static str = CLASS;
    type Handle = Box<dyn CharDevice>;
    type Error = CharError;

    fn separate(
        &self,
        server: &Path,
        name: &str,
        supervisor: Supervisor,
    ) -> Result<Self::Handle, CharError> {
        Ok(Box::new(CharClient::open_supervised(
            supervisor, server, name,
        )?))
    }

    fn colocated(&self, name: &str, _device: DeviceSpec) -> Result<Self::Handle, CharError> {
        Err(CharError::Invalid(format!(
            "{name}: a serial line's driver runs in its own server, not in a client"
        )))
    }

    fn not_there(e: &CharError) -> bool {
        matches!(
            e,
            CharError::DeviceGone | CharError::NoSuchDevice(_) | CharError::Timeout
        )
    }
}

/// Opens serial line `name` wherever the machine places its driver.
pub fn open_char(
    control_path: &Path,
    name: &str,
) -> Result<(Box<dyn CharDevice>, Placement), CharError> {
    outboard_client::open(control_path, name, &Char)
}
