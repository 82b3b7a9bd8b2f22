//! The clock class (Mach's device interface for a clock), one folder: its contract with
//! clients ([`contract`]: requests, completions, the time record, status, errors, ring
//! entries) and with drivers ([`driver`]: [`ClockDriver`] and its class-free binding). Its
//! dispatcher in a driver server is `server/` (`outboard-clock-server`), its client `client/`
//! (`outboard-clock-client`).
//!
//! A client asks to be woken after `n` ticks of the device's periodic interrupt (the
//! completion says how many ticks passed while it waited, at least `n`), or for the time now
//! (the tick count and the device's own nanosecond counter, on a ring of time records). Ticks
//! are counted by the driver, not replayed: after a driver restart the count starts again
//! from zero, and a wait that was in flight is sent again and waits its `n` ticks on the new
//! driver. The PCI timer's counter is the host's monotonic clock: it runs on through a restart.
#![deny(missing_docs)]

pub mod contract;
pub mod driver;

pub use contract::*;
pub use driver::{bind, unbind, ClockBinding, ClockDriver};
