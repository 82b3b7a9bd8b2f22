//! A native C clock driver behind the clock class: [`NativeCClock`] starts it on its device
//! and is its work loop's side. The device's vectors are the loop's event sources; when one
//! fires, the loop's thread calls the driver's `event`, which reports the running tick total to
//! the sink (the same `outboard_clock_sink` as a legacy driver's), and the clock dispatcher
//! completes the waits that are due.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use outboard_clock::{ClockDriver, ClockInfo, ClockTime};
use outboard_env::{DeviceEvent, Driver, Failure, Fence};
use outboard_hw::PciFunction;

use super::run::NativeRun;
use crate::legacy::descriptor::{
    builtin_native_timer, AtomicTicks, CDriver, ClockSink, NativeClockOps,
};
use crate::personality::StartError;

/// Longest wait a client may ask for: an hour of ticks.
const MAX_WAIT_SECONDS: u32 = 3600;

/// A native C clock driver, started on its device.
pub struct NativeCClock {
    run: NativeRun<NativeClockOps>,
    ticks: Arc<AtomicTicks>,
    info: ClockInfo,
    interrupts: u64,
}

impl NativeCClock {
    /// Starts native C driver `c` (personality `driver`) as clock `name` on `function`.
    pub fn start(
        driver: &'static str,
        c: &CDriver,
        name: &str,
        function: PciFunction,
    ) -> Result<Self, StartError> {
        let ops = c
            .native_clock_ops()
            .map_err(|e| StartError::Refused(format!("{driver}: {e}")))?;
        // Ticks are reported on the loop's own thread, inside `event`: the dispatcher looks at
        // the total after every event, so nothing needs ringing.
        let ticks = Arc::new(AtomicTicks {
            total: AtomicU64::new(0),
            moved: Box::new(|| {}),
        });
        let sink = ClockSink::new(ticks.clone());
        let (run, hz) = NativeRun::start(driver, c, function, ops, sink)?;
        if !(1..=100_000).contains(&hz) {
            return Err(run.refuse(&format!("the driver says it ticks at {hz} Hz")));
        }
        Ok(Self {
            run,
            ticks,
            info: ClockInfo {
                name: name.to_string(),
                hz,
                max_wait: hz.saturating_mul(MAX_WAIT_SECONDS),
            },
            interrupts: 0,
        })
    }
}

impl Driver for NativeCClock {
    fn driver_name(&self) -> &'static str {
        self.run.driver()
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        self.run.sources()
    }

    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure> {
        if self.run.handle(event)? {
            self.interrupts += 1;
        }
        Ok(())
    }

    fn abandon(&mut self) -> Fence {
        self.run.abandon()
    }
}

impl ClockDriver for NativeCClock {
    fn info(&self) -> &ClockInfo {
        &self.info
    }

    fn ticks(&self) -> u64 {
        self.ticks.total.load(Ordering::Acquire)
    }

    fn now(&mut self) -> Result<ClockTime, Failure> {
        let ns = self
            .run
            .ops()?
            .now()
            .map_err(|rc| self.run.failed("reading of the time", rc))?;
        Ok(ClockTime {
            ticks: self.ticks(),
            device_ns: ns,
            hz: self.info.hz,
            interrupts: self.interrupts as u32,
        })
    }
}

impl std::fmt::Debug for NativeCClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeCClock")
            .field("driver", &self.run.driver())
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

crate::legacy::builtin_c_driver! {
    /// The PCI timer's native C driver (`c/native_timer.c`): bids below the legacy C driver
    /// and the native Rust one, so it drives a timer when named (`driver-host --driver
    /// clock0=native-c-timer`) or as a library built with a higher score.
    NATIVE_C_TIMER, native_timer = builtin_native_timer,
    driver: "native-c-timer", class: outboard_clock::CLASS, score: 800,
    faults: &[],
}
