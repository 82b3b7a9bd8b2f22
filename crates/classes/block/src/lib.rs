//! The block class (Mach's device interface for disks), one folder: its contract with clients
//! ([`contract`]: requests, completions, status, errors, the ring entries, the [`BlockDevice`]
//! trait) and with drivers ([`driver`]: [`BlockDriver`] and its class-free binding). Its
//! dispatcher in a driver server is the crate beside it (`server/`, `outboard-block-server`).
//! The client library (`outboard-client`) implements `BlockDevice` for both placements.
#![deny(missing_docs)]

pub mod conformance;
pub mod contract;
pub mod driver;

pub use contract::*;
pub use driver::{bind, unbind, BlockBinding, BlockDriver};
