//! The driver server's core (docs/contract.md): runs drivers in the environment's loop,
//! serves sessions, and keeps each device's life — deadlines, failure, recovery — the same for
//! every class. It names no class: each class brings its [`Dispatcher`] from its own folder
//! (`crates/classes/<class>`). (The `colocated` placement, which links the same drivers into
//! the client, is in each class's client.)
#![deny(missing_docs)]

pub mod blame;
pub mod counters;
mod device;
pub mod dispatch;
pub mod host;
pub mod recovery;
pub mod session;
pub mod turn_clock;

pub use dispatch::{Code, Ctx, Dispatcher, Fate, HeldBack, Outage, Refusal, TurnClock};
pub use host::{DriverHost, HostError, HostStats, Limits, Served};
pub use recovery::{Reopen, ReopenError};
