//! Device-independent class interfaces (Mach's device interface; docs/contract.md).
//!
//! Clients open devices by name and use the interface of their class. The [`block`] class is
//! the first: its contract with clients (requests, completions, status, errors, the
//! [`block::BlockDevice`] trait, the ring entries) and its contract with drivers
//! ([`driver::BlockDriver`]). The client library (`outboard-client`) implements
//! `BlockDevice` for both placements; drivers implement `BlockDriver`.
#![deny(missing_docs)]

pub mod block;
pub mod driver;

pub use block::{BlockCompletion, BlockDevice, BlockError, BlockInfo, BlockOp, BlockRequest};
pub use driver::{BlockDriver, ClassDriver};
