//! The driver host (docs/contract.md): runs drivers in the environment's loop, publishes their
//! class devices, serves sessions. (The `colocated` placement, which links the same drivers into
//! the client, is in `outboard-client`.)
#![deny(missing_docs)]

pub mod blame;
pub mod block;
pub mod dispatch;
pub mod host;
pub mod ranges;
pub mod recovery;
pub mod session;

pub use block::BlockDispatcher;
pub use dispatch::Dispatcher;
pub use host::{DriverHost, HostError, HostStats, Limits, Served};
