//! What every client links, whatever the class (docs/contract.md, `client`): the session
//! [`Channel`] (open, rings, doorbells, waiting), resuming a session on a restarted server
//! ([`resume`]), reaching the manager ([`link`]), opening a class device by name through the manager ([`open`]), the manager's
//! control API ([`manager`], [`api`], [`registry`]), and handing out pieces of a buffer area
//! ([`buffers`]). It names no class: each class's client (block's is
//! `crates/classes/block/client`) builds on it.
//!
//! It never links the manager, the driver server or the device models.
#![deny(missing_docs)]

pub mod api;
pub mod buffers;
pub mod channel;
pub mod link;
pub mod manager;
pub mod open;
pub mod registry;
pub mod resume;

pub use buffers::{Buffer, BufferPool};
pub use channel::{Channel, ChannelError, WaitMode};
pub use link::{Broker, Control};
pub use open::{open, open_via, ClassClient, RESTART_PATIENCE};
pub use resume::{Policy, Supervisor};
