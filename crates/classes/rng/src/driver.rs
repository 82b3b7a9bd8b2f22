//! The entropy class's contract with drivers: the trait an entropy driver implements on top
//! of the environment's [`Driver`], and the binding that carries it through class-free code.

use outboard_env::{AnyDriver, Driver, Failure};

use crate::contract::{EntropyError, EntropyInfo, CLASS};

/// An entropy driver: what the entropy dispatcher (in a driver server) and the colocated
/// placement call. Buffers are device addresses (the session's buffer area, mapped).
pub trait EntropyDriver: Driver {
    /// Class status.
    fn info(&self) -> &EntropyInfo;
    /// Whether another request fits now.
    fn has_room(&self) -> bool;
    /// Requests submitted and not yet reaped.
    fn in_flight(&self) -> usize;
    /// Asks the device for `length` random bytes at device address `iova`, under the driver
    /// tag `tag`. An error is this request's alone — except [`EntropyError::DeviceFailed`]:
    /// the device can take no request any more.
    fn submit(&mut self, iova: u64, length: u32, tag: u64) -> Result<(), EntropyError>;
    /// Publishes submitted requests to the device.
    fn kick(&mut self) -> Result<(), Failure>;
    /// Reaps `(tag, bytes written or error)` completions into `out`; returns how many.
    fn poll(&mut self, out: &mut Vec<(u64, Result<u32, EntropyError>)>) -> Result<usize, Failure>;
    /// Arms the completion interrupt before the environment sleeps; true if completions are
    /// already waiting.
    fn arm(&mut self) -> Result<bool, Failure>;
}

/// A started entropy driver as class-free code carries it.
pub struct EntropyBinding(pub Box<dyn EntropyDriver>);

impl AnyDriver for EntropyBinding {
    fn class(&self) -> &'static str {
        CLASS
    }

    fn driver(&self) -> &dyn Driver {
        self.0.as_ref()
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// Wraps an entropy driver for class-free code (a personality's `start`).
pub fn bind(d: impl EntropyDriver + 'static) -> Box<dyn AnyDriver> {
    Box::new(EntropyBinding(Box::new(d)))
}

/// Takes the entropy driver back out of a started driver; an error names its class.
pub fn unbind(d: Box<dyn AnyDriver>) -> Result<Box<dyn EntropyDriver>, String> {
    outboard_env::downcast::<EntropyBinding>(d, CLASS).map(|b| b.0)
}
