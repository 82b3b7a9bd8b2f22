//! The network class's client: a session with a NIC's driver server ([`session`]) that sends
//! frames from its buffer area, keeps receive buffers posted there, and sets its receive mode,
//! multicast groups and packet filter.
//!
//! Not yet: the colocated placement (the driver linked into the client), open-by-name through
//! the manager, and resuming a session when its server restarts.
#![deny(missing_docs)]

pub mod session;

pub use session::{NetClient, NetOptions};
