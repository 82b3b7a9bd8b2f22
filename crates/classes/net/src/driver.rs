//! The network class's contract with drivers: the trait a NIC driver implements on top of the
//! environment's [`Driver`], and the binding that carries it through class-free code.

use outboard_env::{Driver, Failure};

use crate::contract::{NetError, NetInfo, CLASS};

/// A NIC driver: what the net dispatcher (in a driver server) and the colocated placement
/// call. Transmit buffers are device addresses (the session's buffer area, mapped): the device
/// reads the frame where the client wrote it. Received frames land in the driver's own
/// buffers, which it posts and reposts itself; the dispatcher is shown each frame once and
/// copies it to the sessions that take it (it must look at a frame to know whose it is).
pub trait NetDriver: Driver {
    /// Class status (the link as last read; [`NetDriver::refresh`] reads it again).
    fn info(&self) -> &NetInfo;
    /// Reads what may have changed in the device's configuration (the link, after a
    /// configuration interrupt).
    fn refresh(&mut self) -> Result<(), Failure>;
    /// Whether another frame fits in the transmit queue now.
    fn has_room(&self) -> bool;
    /// Frames handed to the device and not yet given back.
    fn in_flight(&self) -> usize;
    /// Queues the `len`-byte frame at device address `iova` for transmission under the driver
    /// tag `tag`. An error is this frame's alone — except [`NetError::DeviceFailed`]: the
    /// device can take nothing any more.
    fn transmit(&mut self, iova: u64, len: u32, tag: u64) -> Result<(), NetError>;
    /// Publishes queued frames to the device (one doorbell for the batch).
    fn kick(&mut self) -> Result<(), Failure>;
    /// Reaps transmit completions `(tag, bytes sent or error)` into `sent`, and shows each
    /// frame received since the last call to `received` (the slice is the driver's; it is
    /// valid for the call only); reposts the receive buffers. Returns how many of either.
    fn poll(
        &mut self,
        sent: &mut Vec<(u64, Result<u32, NetError>)>,
        received: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, Failure>;
    /// Asks the device to hold receive interrupts back up to `usecs` (0: every frame at once):
    /// fewer wake-ups under load, at that much latency. Refused if the device cannot.
    fn set_hold_off(&mut self, usecs: u32) -> Result<(), NetError> {
        let _ = usecs;
        Err(NetError::Invalid(
            "this NIC's driver cannot hold interrupts back".into(),
        ))
    }
    /// Arms the device's interrupts before the environment sleeps; true if work is already
    /// waiting.
    fn arm(&mut self) -> Result<bool, Failure>;

    /// If this driver can lend receive buffers — put a client's buffer into the device's
    /// receive queue, so the device writes the frame where the client reads it — the bytes
    /// the device writes before each frame (its header). `None`: it cannot.
    fn lend_headroom(&self) -> Option<u32> {
        None
    }
    /// Starts (`on`) or stops lending. The device's receive queue is emptied either way:
    /// the tag of every lent buffer still in it is appended to `returned` (the device will
    /// not write it any more). Lending, the queue then holds only lent buffers; otherwise
    /// the driver's own again. Frames the device completed before are still reported.
    fn set_lending(&mut self, on: bool, returned: &mut Vec<u64>) -> Result<(), NetError> {
        let _ = (on, returned);
        Err(NetError::Invalid(
            "this NIC's driver cannot receive into a client's buffers".into(),
        ))
    }
    /// Whether another buffer may be lent now.
    fn can_lend(&self) -> bool {
        false
    }
    /// Lends the `len`-byte buffer at device address `iova` under `tag` (visible to the
    /// device at the next [`NetDriver::kick`] or poll). It must hold the headroom and the
    /// longest frame.
    fn lend(&mut self, iova: u64, len: u32, tag: u64) -> Result<(), NetError> {
        let _ = (iova, len, tag);
        Err(NetError::Invalid(
            "this NIC's driver cannot receive into a client's buffers".into(),
        ))
    }
    /// Lent buffers the device wrote a frame into since the last call, appended to `out`:
    /// the tag, and the frame's length after the headroom or why there is none.
    fn take_lent(&mut self, out: &mut Vec<(u64, Result<u32, NetError>)>) {
        let _ = out;
    }
    /// Checks the headroom the device wrote before a frame in a lent buffer (the driver
    /// cannot read a client's memory; the server reads it and asks): how many buffers the
    /// frame spans — 1 for a whole frame; more means the device spread a frame longer than
    /// any buffer over the next ones, which are not frames of their own.
    fn lent_pieces(&self, headroom: &[u8]) -> u16 {
        let _ = headroom;
        1
    }
}

outboard_env::class_binding!(NetBinding, NetDriver, CLASS);
