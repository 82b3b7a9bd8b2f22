//! Device-independent class interfaces (Mach's device interface, DESIGN.md §2.5).
//!
//! Clients open devices by name and use the interface of their class. The [`block`] class is
//! the first: its contract (requests, completions, status, errors, the [`block::BlockDevice`]
//! trait) and its session client ([`client::BlockClient`], the `separate` placement). The
//! `colocated` placement implements the same trait with the driver in the client's process.
#![deny(missing_docs)]

pub mod block;
pub mod client;

pub use block::{BlockCompletion, BlockDevice, BlockError, BlockInfo, BlockOp, BlockRequest};
pub use client::{BlockClient, SessionOptions, WaitMode};
