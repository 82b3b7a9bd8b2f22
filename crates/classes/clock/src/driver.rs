//! The clock class's contract with drivers: the trait a clock driver implements on top of the
//! environment's [`Driver`], and the binding that carries it through class-free code.
//!
//! A clock driver counts its device's ticks (in its interrupt handler, or wherever the device
//! says how many passed) and makes one of its [`Driver::sources`] readable when the count
//! moves, so the environment wakes and the dispatcher completes the waits that are due.

use outboard_env::{Driver, Failure};

use crate::contract::{ClockInfo, ClockTime, CLASS};

/// A clock driver: what the clock dispatcher in a driver server calls.
pub trait ClockDriver: Driver {
    /// Class status.
    fn info(&self) -> &ClockInfo;
    /// Ticks since this driver started.
    fn ticks(&self) -> u64;
    /// The time now: the tick count and the device's nanosecond counter.
    fn now(&mut self) -> Result<ClockTime, Failure>;
}

outboard_env::class_binding!(ClockBinding, ClockDriver, CLASS);
