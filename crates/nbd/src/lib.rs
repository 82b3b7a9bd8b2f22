//! The NBD export (docs/nbd.md): block devices served to any NBD client — QEMU, libnbd's
//! tools, fio's `nbd` engine, the Linux kernel — over a UNIX socket or TCP.
//!
//! The export is an ordinary client of the block class: a connection gets a session of its own
//! with its device, or shares the one the export reserved once the driver server has no room
//! ([`hub`], [`server`]); it negotiates fixed newstyle ([`negotiate`]), and then
//! moves requests between the socket and the session ([`transmit`]), data going straight
//! between the socket and the session's buffer area. The wire format is in [`proto`], pure and
//! fuzzed.
#![deny(missing_docs)]

pub mod deadline;
pub mod hub;
pub mod negotiate;
/// The wire format (in `spec`, shared with the client of remote disks).
pub use outboard_spec::nbd as proto;
pub mod server;
pub mod tls;
pub mod transmit;
pub mod transport;

pub use negotiate::{negotiate, negotiate_with, Export, Outcome, TlsPolicy};
pub use server::{ExportSpec, Listen, Listener, NbdServer, Opener};

/// Why a connection (or the server) stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NbdError {
    /// The client broke the protocol; its connection is closed.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The socket failed (or the client left mid-message).
    #[error("socket: {0}")]
    Io(String),
    /// The device failed in a way that ends the connection (gone, failed, stuck).
    #[error("device: {0}")]
    Device(outboard_block::BlockError),
    /// The export could not be set up (listen, open the device).
    #[error("{0}")]
    Setup(String),
}
