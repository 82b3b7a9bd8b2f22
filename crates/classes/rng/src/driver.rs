//! The entropy class's contract with drivers: the trait an entropy driver implements on top
//! of the environment's [`Driver`], and the binding that carries it through class-free code.

use outboard_env::{Driver, Failure};

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

outboard_env::class_binding!(EntropyBinding, EntropyDriver, CLASS);
