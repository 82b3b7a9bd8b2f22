//! What a client links (docs/contract.md, `client`): opening class devices by name through the
//! manager ([`manager`]), the two placements — a session with a driver server ([`session`])
//! and the driver linked in ([`colocated`]) — behind one [`BlockDevice`] API, and the manager's
//! control API types ([`api`], [`registry`]).
//!
//! It never links the manager, the driver server or the device models: a program using
//! Outboard's devices carries only the class contracts, the session protocol and, for the
//! colocated placement, the drivers.
//!
//! [`BlockDevice`]: outboard_block::BlockDevice
#![deny(missing_docs)]

pub mod api;
pub mod buffers;
pub mod channel;
pub mod colocated;
pub mod inflight;
pub mod manager;
pub mod registry;
pub mod remote;
pub mod session;

pub use buffers::{Buffer, BufferPool};
pub use channel::{Channel, ChannelError};
pub use colocated::Colocated;
pub use manager::{open_block, open_block_with};
pub use remote::NbdClient;
pub use session::{reply_error, BlockClient, ResumeStats, SessionOptions, Supervisor, WaitMode};
