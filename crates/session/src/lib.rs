//! Client ↔ driver IPC (docs/session.md).
//!
//! A session is long-lived: opening one costs a control round trip ([`control`]); using it costs
//! no system call when both sides are busy. Its shared [`region`] holds the rings its class
//! declares (block: a submission ring, client → server, and a completion ring, server → client)
//! and a buffer area the server maps into
//! the device's DMA space, so devices move data straight to and from client buffers. The rings
//! follow one protocol ([`ring`]); wake-ups use eventfd [`doorbell`]s rung only when the other
//! side announced it is about to sleep.
//!
//! Everything a client writes is untrusted by the server and vice versa: ring indices are
//! checked, entries are decoded and validated by the class layer, memfds are size-sealed.
#![deny(missing_docs)]

pub mod completion;
#[cfg(not(loom))]
pub mod control;
pub mod doorbell;
pub mod reason;
pub mod refusal;
#[cfg(not(loom))]
pub mod region;
pub mod ring;
pub mod sync;

pub use doorbell::Doorbell;
pub use refusal::{Code, Refusal};
#[cfg(not(loom))]
pub use region::{Direction, Geometry, Region, RingShape, RingSpec};
pub use ring::{Consumer, Producer, RingError, RingStorage};

/// Session errors.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The peer is not there.
    #[error("cannot connect to {0}")]
    Connect(String),
    /// The peer closed the connection.
    #[error("the connection was closed")]
    Closed,
    /// Waiting timed out.
    #[error("timed out")]
    Timeout,
    /// Malformed or refused input.
    #[error("{0}")]
    Invalid(String),
    /// The peer broke the ring protocol.
    #[error(transparent)]
    Ring(#[from] RingError),
    /// Shared memory failed.
    #[error(transparent)]
    Shm(#[from] outboard_shm::ShmError),
    /// The operating system refused.
    #[error("{0}")]
    Os(String),
}
