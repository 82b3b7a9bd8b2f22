//! The block class's contract with drivers: the one small trait a block driver implements on
//! top of the environment's [`Driver`] contract, and the binding that carries it through
//! class-free code ([`AnyDriver`]).

use outboard_env::{Driver, Failure};

use crate::contract::{BlockError, BlockInfo, BlockRequest, CLASS};

/// A block driver: what the block dispatcher (in a driver server) and the colocated placement
/// call. Requests reach it validated against [`BlockDriver::info`]; their buffers are given as
/// offsets from `iova_base`, the device address of the client's buffer area.
pub trait BlockDriver: Driver {
    /// Class status.
    fn info(&self) -> &BlockInfo;
    /// Whether another request fits now.
    fn has_room(&self) -> bool;
    /// Requests submitted and not yet reaped.
    fn in_flight(&self) -> usize;
    /// Submits a validated data, flush, discard or write-zeroes request under the driver tag
    /// `tag`. An error is this request's alone — except [`BlockError::DeviceFailed`], which
    /// says the device can take no request any more: the environment gives the device up, and
    /// this request fails with everything else in it.
    fn submit(&mut self, r: &BlockRequest, iova_base: u64, tag: u64) -> Result<(), BlockError>;
    /// Publishes submitted requests to the device.
    fn kick(&mut self) -> Result<(), Failure>;
    /// Reaps `(tag, result)` completions into `out`; returns how many.
    fn poll(&mut self, out: &mut Vec<(u64, Result<u32, BlockError>)>) -> Result<usize, Failure>;
    /// Arms the completion interrupts before the environment sleeps; true if completions are
    /// already waiting (poll instead of sleeping).
    fn arm(&mut self) -> Result<bool, Failure>;
}

outboard_env::class_binding!(BlockBinding, BlockDriver, CLASS);
