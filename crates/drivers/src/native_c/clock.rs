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

use super::device::NativeDevice;
use crate::legacy::claim::Claim;
use crate::legacy::descriptor::{
    builtin_native_timer, AtomicTicks, CDriver, ClockSink, NativeClockOps,
};
use crate::personality::StartError;

/// Longest wait a client may ask for: an hour of ticks.
const MAX_WAIT_SECONDS: u32 = 3600;

/// A native C clock driver, started on its device.
pub struct NativeCClock {
    // The handle the C driver holds: shared, so its address is stable while the driver runs
    // and moving this value does not move (or re-borrow) it.
    device: Arc<NativeDevice>,
    claim: Option<Claim>,
    // What the C driver reports ticks to: kept for as long as it runs.
    _sink: ClockSink,
    ticks: Arc<AtomicTicks>,
    ops: NativeClockOps,
    info: ClockInfo,
    driver: &'static str,
    interrupts: u64,
    /// Whether the driver still runs (`stop` is owed to it).
    running: bool,
}

impl NativeCClock {
    /// Starts native C driver `c` (personality `driver`) as clock `name` on `function`.
    pub fn start(
        driver: &'static str,
        c: &CDriver,
        name: &str,
        function: PciFunction,
    ) -> Result<Self, StartError> {
        let refused = |why: String| StartError::Refused(format!("{driver}: {why}"));
        let ops = c.native_clock_ops().map_err(|e| refused(e.to_string()))?;
        let claim = Claim::take(c, driver)?;
        // Ticks are reported on the loop's own thread, inside `event`: the dispatcher looks at
        // the total after every event, so nothing needs ringing.
        let ticks = Arc::new(AtomicTicks {
            total: AtomicU64::new(0),
            moved: Box::new(|| {}),
        });
        let sink = ClockSink::new(ticks.clone());
        let device = Arc::new(NativeDevice::new(driver, function));
        let handle = Arc::as_ptr(&device).cast_mut().cast();
        // SAFETY: the handle is the shared device, which this value keeps until after `stop`,
        // as it keeps the sink (the C side only ever takes shared references to it); a failed
        // start is not stopped, and the device and sink are dropped only after it returned.
        let hz = unsafe { ops.start(handle, &sink) }
            .map_err(|rc| refused(format!("the driver did not start (error {rc})")))?;
        let mut this = Self {
            device,
            claim: Some(claim),
            _sink: sink,
            ticks,
            ops,
            info: ClockInfo {
                name: name.to_string(),
                hz,
                max_wait: hz.saturating_mul(MAX_WAIT_SECONDS),
            },
            driver,
            interrupts: 0,
            running: true,
        };
        if !(1..=100_000).contains(&hz) {
            this.stop();
            return Err(refused(format!("the driver says it ticks at {hz} Hz")));
        }
        if this.device.irqs().is_empty() {
            this.stop();
            return Err(refused(
                "the driver enabled no interrupt vector: nothing would ever call it".into(),
            ));
        }
        Ok(this)
    }

    fn stop(&mut self) {
        if std::mem::take(&mut self.running) {
            self.ops.stop();
        }
    }
}

impl Drop for NativeCClock {
    fn drop(&mut self) {
        // The driver stops before its device (and the sink) go; the code is free afterwards.
        self.stop();
        self.claim = None;
    }
}

impl Driver for NativeCClock {
    fn driver_name(&self) -> &'static str {
        self.driver
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        let mut v: Vec<_> = self
            .device
            .irqs()
            .iter()
            .enumerate()
            .map(|(i, irq)| (DeviceEvent::Interrupt(i as u16), irq.fd()))
            .collect();
        if let Some(fd) = self.device.function().loss_fd() {
            v.push((DeviceEvent::Lost, fd));
        }
        v
    }

    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure> {
        match event {
            DeviceEvent::Lost => Err(Failure::Lost),
            DeviceEvent::Interrupt(v) if self.running => {
                if let Some(irq) = self.device.irqs().get(usize::from(v)) {
                    irq.ack();
                }
                self.interrupts += 1;
                let r = self.ops.event(u32::from(v));
                self.device.end_of_interrupt();
                r.map_err(|rc| {
                    Failure::Driver(format!(
                        "{}: the driver failed handling vector {v} (error {rc})",
                        self.driver
                    ))
                })
            }
            _ => Ok(()),
        }
    }

    fn abandon(&mut self) -> Fence {
        // The device given up, the driver is not called again (not even `stop`: its device
        // calls would fail), and its code is free for the device's next driver.
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

impl ClockDriver for NativeCClock {
    fn info(&self) -> &ClockInfo {
        &self.info
    }

    fn ticks(&self) -> u64 {
        self.ticks.total.load(Ordering::Acquire)
    }

    fn now(&mut self) -> Result<ClockTime, Failure> {
        if !self.running {
            return Err(Failure::Driver("the driver was given up".into()));
        }
        let ns = self.ops.now().map_err(|rc| {
            Failure::Driver(format!("the driver could not read the time (error {rc})"))
        })?;
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
            .field("driver", &self.driver)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_personality_is_the_descriptors() {
        let c = native_timer().unwrap();
        assert_eq!(NATIVE_C_TIMER.driver, c.name);
        assert_eq!(NATIVE_C_TIMER.class, c.class);
        assert_eq!(NATIVE_C_TIMER.score, c.score);
        assert_eq!(c.model, crate::legacy::descriptor::Model::Native);
        assert!(c.native_clock_ops().is_ok() && c.clock_ops().is_err());
    }
}
