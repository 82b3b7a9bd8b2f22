//! The driver host (DESIGN.md §1, §3): runs drivers, publishes their class devices, serves
//! sessions — and the `colocated` placement, which links the same drivers into the client.
#![deny(missing_docs)]

pub mod backend;
pub mod blockhost;
pub mod colocated;
pub mod host;
pub mod ranges;
pub mod recovery;

pub use backend::{BlockBackend, NullBlock};
pub use blockhost::BlockHost;
pub use colocated::Colocated;
pub use host::{DriverHost, HostStats, Limits};
