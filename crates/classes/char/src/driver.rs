//! The char class's contract with drivers: the trait a serial driver implements on top of the
//! environment's [`Driver`], and the binding that carries it through class-free code.
//!
//! A char driver buffers what its device receives and what it is given to send. It makes one
//! of its [`Driver::sources`] readable whenever something moved (bytes arrived, bytes went
//! out, the modem lines changed), so the environment wakes and the dispatcher completes what
//! is due. Nothing it is called with blocks.

use outboard_env::{Driver, Failure};

use crate::contract::{CharInfo, LineCounters, LineSettings, CLASS};

/// A char driver: what the char dispatcher in a driver server calls.
pub trait CharDriver: Driver {
    /// Class status.
    fn info(&self) -> &CharInfo;
    /// Takes as many of `bytes` as it has room for now, to send; returns how many.
    fn write(&mut self, bytes: &[u8]) -> Result<usize, Failure>;
    /// Moves received bytes into `buf`; returns how many (0 if none).
    fn read(&mut self, buf: &mut [u8]) -> Result<usize, Failure>;
    /// The line's settings.
    fn line(&self) -> LineSettings;
    /// Applies settings (already checked against [`CharInfo`]): `Ok(Err(why))` if the device
    /// cannot make them, the line unchanged.
    fn set_line(&mut self, line: &LineSettings) -> Result<Result<(), String>, Failure>;
    /// What the line has done; `counters().sent` counts bytes the device has sent, which is
    /// when a write completes.
    fn counters(&self) -> LineCounters;
    /// Whether sending waits on the far end (flow control holds it): a write that is not
    /// moving then is not a stalled device.
    fn held(&self) -> bool;
}

outboard_env::class_binding!(CharBinding, CharDriver, CLASS);
