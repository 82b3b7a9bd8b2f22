//! The entropy class's client: one [`EntropyDevice`](outboard_rng::EntropyDevice) API over a
//! session with a driver server ([`session`], resumed and replayed when the server restarts:
//! asking a source of random bytes again is harmless) or the driver linked into this process
//! ([`colocated`]); and opening an entropy device by name ([`open_entropy`]).
#![deny(missing_docs)]

pub mod colocated;
pub mod session;

pub use colocated::Colocated;
pub use session::RngClient;

use std::path::Path;

use outboard_client::api::Placement;
use outboard_client::{ClassClient, Supervisor};
use outboard_hw::DeviceSpec;
use outboard_rng::{EntropyDevice, EntropyError, CLASS};

/// Bytes of a session's buffer area: what one read can ask for at once.
pub const BUFFER: u64 = 256 << 10;

/// The entropy class, as open-by-name builds its handle.
#[derive(Debug, Clone, Copy, Default)]
pub struct Entropy;

impl ClassClient for Entropy {
    const CLASS: &'static str = CLASS;
    type Handle = Box<dyn EntropyDevice>;
    type Error = EntropyError;

    fn separate(
        &self,
        server: &Path,
        name: &str,
        supervisor: Supervisor,
    ) -> Result<Self::Handle, EntropyError> {
        Ok(Box::new(RngClient::open_supervised(
            supervisor, server, name,
        )?))
    }

    fn colocated(&self, name: &str, device: DeviceSpec) -> Result<Self::Handle, EntropyError> {
        Ok(Box::new(Colocated::open(name, device)?))
    }

    fn not_there(e: &EntropyError) -> bool {
        matches!(
            e,
            EntropyError::DeviceGone | EntropyError::NoSuchDevice(_) | EntropyError::Timeout
        )
    }
}

/// Opens entropy device `name` wherever the machine places its driver.
pub fn open_entropy(
    control_path: &Path,
    name: &str,
) -> Result<(Box<dyn EntropyDevice>, Placement), EntropyError> {
    outboard_client::open(control_path, name, &Entropy)
}
