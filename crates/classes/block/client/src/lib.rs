//! The block class's client: one [`BlockDevice`](outboard_block::BlockDevice) API over a
//! session with a driver server ([`session`], resumed and replayed when the server restarts),
//! the driver linked into this process ([`colocated`]), or a remote disk over NBD
//! ([`remote`]); and opening a block device by name ([`open_block`]), on the class-free
//! open-by-name of `outboard-client`.
#![deny(missing_docs)]

pub mod colocated;
pub mod inflight;
pub mod open;
pub mod remote;
pub mod session;

pub use colocated::Colocated;
pub use open::{open_block, open_block_via, open_block_with, Block};
pub use outboard_client::{Supervisor, WaitMode};
pub use remote::NbdClient;
pub use session::{BlockClient, ResumeStats, SessionOptions};
