//! The char class (Mach's device interface for a serial line), one folder: its contract with
//! clients ([`contract`]: requests, completions, line settings and records, errors, ring
//! entries) and with drivers ([`driver`]: [`CharDriver`] and its class-free binding). Its
//! dispatcher in a driver server is `server/` (`outboard-char-server`), its client `client/`
//! (`outboard-char-client`).
//!
//! A client writes bytes (the completion comes once the device has sent them all), reads
//! bytes (the completion comes as soon as one has arrived), reads the line's settings and
//! counters, and sets the rate, frame and flow control. Across a driver restart nothing is
//! replayed: a write in flight fails as interrupted (some of its bytes may have gone out, and
//! a line must not send them twice), while bytes acknowledged to a writer had left the device.
//! Bytes the device had received that no reader had taken yet are lost with the driver.
#![deny(missing_docs)]

pub mod conformance;
pub mod contract;
pub mod driver;

pub use contract::*;
pub use driver::{bind, unbind, CharBinding, CharDriver};
