//! What every native C driver's class bridge does alike: [`NativeRun`] starts the driver on
//! its device (the handle and the sink kept alive for as long as it runs), lists the device's
//! vectors and loss as the loop's event sources, calls the driver's `event` when a vector
//! fired, gives the device up, and stops the driver exactly once — never after a give-up or a
//! failed start. A class's bridge adds only its own operations.

use std::ffi::{c_int, c_void};
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use outboard_env::{DeviceEvent, Failure, Fence};
use outboard_hw::PciFunction;

use super::device::NativeDevice;
use crate::legacy::claim::Claim;
use crate::legacy::descriptor::{
    CDriver, CharSink, ClockSink, NativeCharOps, NativeClockOps, RawCharInfo,
};
use crate::personality::StartError;

/// A class's native operations table, as far as the bridge calls it.
pub(crate) trait NativeOps: Copy {
    /// What the driver reports to.
    type Sink;
    /// What `start` says about the device.
    type Started;
    /// Calls the driver's `start`.
    ///
    /// # Safety
    /// `dev` is a live device handle that stays valid, like `sink`, until `stop` returns or
    /// the device is given up.
    unsafe fn start(&self, dev: *mut c_void, sink: &Self::Sink) -> Result<Self::Started, c_int>;
    /// Calls `event` for a vector.
    fn event(&self, vector: u32) -> Result<(), c_int>;
    /// Calls `stop`.
    fn stop(&self);
}

impl NativeOps for NativeClockOps {
    type Sink = ClockSink;
    type Started = u32;

    unsafe fn start(&self, dev: *mut c_void, sink: &ClockSink) -> Result<u32, c_int> {
        // SAFETY: the caller's contract is the call's.
        unsafe { NativeClockOps::start(self, dev, sink) }
    }

    fn event(&self, vector: u32) -> Result<(), c_int> {
        NativeClockOps::event(self, vector)
    }

    fn stop(&self) {
        NativeClockOps::stop(self)
    }
}

impl NativeOps for NativeCharOps {
    type Sink = CharSink;
    type Started = RawCharInfo;

    unsafe fn start(&self, dev: *mut c_void, sink: &CharSink) -> Result<RawCharInfo, c_int> {
        // SAFETY: the caller's contract is the call's.
        unsafe { NativeCharOps::start(self, dev, sink) }
    }

    fn event(&self, vector: u32) -> Result<(), c_int> {
        NativeCharOps::event(self, vector)
    }

    fn stop(&self) {
        NativeCharOps::stop(self)
    }
}

/// A native C driver running on its device.
pub(crate) struct NativeRun<O: NativeOps> {
    // The handle the C driver holds: shared, so its address is stable while the driver runs
    // and moving this value does not move (or re-borrow) it.
    device: Arc<NativeDevice>,
    ops: O,
    /// Whether the driver still runs (`stop` is owed to it, and it may be called).
    running: bool,
    claim: Option<Claim>,
    // What the C driver reports to: kept for as long as it runs.
    _sink: O::Sink,
    driver: &'static str,
}

impl<O: NativeOps> NativeRun<O> {
    /// Starts C driver `c` (personality `driver`) on `function` with `ops`, reporting to
    /// `sink`: the running driver and what its `start` said. A driver that enabled no
    /// interrupt vector is stopped and refused: nothing would ever call it.
    pub(crate) fn start(
        driver: &'static str,
        c: &CDriver,
        function: PciFunction,
        ops: O,
        sink: O::Sink,
    ) -> Result<(Self, O::Started), StartError> {
        let claim = Claim::take(c, driver)?;
        let device = Arc::new(NativeDevice::new(driver, function));
        let handle = Arc::as_ptr(&device).cast_mut().cast();
        // SAFETY: the handle is the shared device, which the value made below keeps until
        // after `stop`, as it keeps the sink (the C side only ever takes shared references to
        // the device); a failed start is not stopped, and the device and sink are dropped only
        // after it returned.
        let started = unsafe { ops.start(handle, &sink) }.map_err(|rc| {
            StartError::Refused(format!("{driver}: the driver did not start (error {rc})"))
        })?;
        let this = Self {
            device,
            ops,
            running: true,
            claim: Some(claim),
            _sink: sink,
            driver,
        };
        if this.device.irqs().is_empty() {
            return Err(
                this.refuse("the driver enabled no interrupt vector: nothing would ever call it")
            );
        }
        Ok((this, started))
    }

    /// Refuses the started driver for `why`: it is stopped first.
    pub(crate) fn refuse(mut self, why: &str) -> StartError {
        self.stop();
        StartError::Refused(format!("{}: {why}", self.driver))
    }

    fn stop(&mut self) {
        if std::mem::take(&mut self.running) {
            self.ops.stop();
        }
    }

    /// The driver's name.
    pub(crate) fn driver(&self) -> &'static str {
        self.driver
    }

    /// The operations, while the driver runs.
    pub(crate) fn ops(&self) -> Result<&O, Failure> {
        if self.running {
            Ok(&self.ops)
        } else {
            Err(Failure::Driver(format!(
                "{}: the driver was given up",
                self.driver
            )))
        }
    }

    /// The failure of a call (`what`) that returned `rc`: the device failed.
    pub(crate) fn failed(&self, what: &str, rc: c_int) -> Failure {
        Failure::Driver(format!(
            "{}: the driver's {what} failed (error {rc})",
            self.driver
        ))
    }

    /// The loop's event sources.
    pub(crate) fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        self.device.sources()
    }

    /// Handles a device event: true if the driver's `event` was called (and succeeded).
    pub(crate) fn handle(&mut self, event: DeviceEvent) -> Result<bool, Failure> {
        match event {
            DeviceEvent::Lost => Err(Failure::Lost),
            DeviceEvent::Interrupt(v) if self.running => {
                self.device.acknowledge(v);
                let r = self.ops.event(u32::from(v));
                self.device.end_of_interrupt();
                r.map_err(|rc| self.failed(&format!("handling of vector {v}"), rc))?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Gives the device up: the driver is not called again (not even `stop`: its device
    /// calls would fail), and its code is free for the device's next driver.
    pub(crate) fn abandon(&mut self) -> Fence {
        self.running = false;
        let certain = self.device.give_up();
        self.claim = None;
        if certain {
            Fence::Now
        } else {
            Fence::AtReopen
        }
    }
}

impl<O: NativeOps> Drop for NativeRun<O> {
    fn drop(&mut self) {
        // The driver stops before its device and sink go; its code is free afterwards.
        self.stop();
        self.claim = None;
    }
}
