//! The entropy class (Mach's device interface for a source of random bytes), one folder: its
//! contract with clients ([`contract`]: requests, completions, status, errors, ring entries)
//! and with drivers ([`driver`]: [`EntropyDriver`] and its class-free binding). Its
//! dispatcher in a driver server is `server/` (`outboard-rng-server`), its client `client/`
//! (`outboard-rng-client`).
//!
//! A client asks for `length` random bytes into a piece of its buffer area; the device writes
//! them there (zero copy) and the completion says how many it wrote — at least one, possibly
//! fewer than asked (virtio 1.2 §5.4.6.1); the client asks again for the rest. Sending a
//! request again after a server restart is harmless (the bytes are random either way), so a
//! session's policy across restarts is to replay what was unanswered.
#![deny(missing_docs)]

pub mod contract;
pub mod driver;

pub use contract::*;
pub use driver::{bind, unbind, EntropyBinding, EntropyDriver};
