//! A C clock driver behind the clock class: [`LegacyClock`] starts the driver in its legacy
//! environment on the device and serves its ticks. The C handler reports the running total
//! (`outboard_clock_sink.ticked`, at interrupt level, on the environment's interrupt thread);
//! the total moving rings an eventfd, which is the driver's event source in the driver
//! server's loop, and the clock dispatcher then completes the waits that are due.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use outboard_clock::{ClockDriver, ClockInfo, ClockTime};
use outboard_env::{DeviceEvent, Driver, Failure, Fence};
use outboard_hw::PciFunction;
use outboard_osenv::Osenv;

use super::claim::Claim;
use super::descriptor::{builtin_timer, AtomicTicks, CDriver, ClockOps, ClockSink};
use crate::personality::{DriverFault, StartError, StartOptions};

/// Longest wait a client may ask for: an hour of ticks.
const MAX_WAIT_SECONDS: u32 = 3600;

/// A C clock driver, started on its device.
pub struct LegacyClock {
    // Stopped before anything else goes: it holds the driver.
    contender: Option<super::contender::Contender>,
    // Dropped first of the rest: its interrupt thread stops before the sink it reports to goes, and
    // before the driver's code is free for another device. `None` once abandoned.
    osenv: Option<Osenv>,
    claim: Option<Claim>,
    // What the C driver reports ticks to: kept for as long as it runs.
    _sink: ClockSink,
    ticks: Arc<AtomicTicks>,
    wake: super::Wakeup,
    ops: ClockOps,
    info: ClockInfo,
    driver: &'static str,
}

impl LegacyClock {
    /// Starts the C driver `c` (personality `driver`) as clock `name` on `function`, with a
    /// thread contending for it if `o.contend` asks for one.
    pub fn start(
        driver: &'static str,
        c: &CDriver,
        o: &StartOptions,
        function: PciFunction,
    ) -> Result<Self, StartError> {
        let name = o.name.as_str();
        let refused = |why: String| StartError::Refused(format!("{driver}: {why}"));
        let ops = c.clock_ops().map_err(|e| refused(e.to_string()))?;
        let claim = Claim::take(c, driver)?;
        let wake = super::Wakeup::new(&function).map_err(refused)?;
        let rung = wake.bell.clone();
        let ticks = Arc::new(AtomicTicks {
            total: AtomicU64::new(0),
            moved: Box::new(move || super::Wakeup::ring(&rung)),
        });
        let sink = ClockSink::new(ticks.clone());
        let osenv = Osenv::for_function(driver, function).map_err(|e| refused(e.to_string()))?;
        let hz = {
            let _inside = osenv.enter();
            ops.start(&sink)
                .map_err(|rc| refused(format!("the driver did not start (error {rc})")))?
        };
        if !(1..=100_000).contains(&hz) {
            return Err(refused(format!("the driver says it ticks at {hz} Hz")));
        }
        let contender = o
            .contend
            .as_deref()
            .map(|path| super::contender::Contender::start(osenv.cpu().clone(), path))
            .transpose()
            .map_err(refused)?;
        Ok(Self {
            contender,
            osenv: Some(osenv),
            claim: Some(claim),
            _sink: sink,
            ticks,
            wake,
            ops,
            info: ClockInfo {
                name: name.to_string(),
                hz,
                max_wait: hz.saturating_mul(MAX_WAIT_SECONDS),
            },
            driver,
        })
    }

    /// Interrupts delivered to the C driver so far: those that found no thread in the driver
    /// (run by the interrupt thread, or left for a thread about to enter) and those that found
    /// one inside (contested).
    pub fn delivered(&self) -> (u64, u64) {
        self.osenv.as_ref().map_or((0, 0), |o| {
            let s = o.cpu().stats();
            (s.uncontested + s.left_for_entry, s.contested)
        })
    }
}

impl Driver for LegacyClock {
    fn driver_name(&self) -> &'static str {
        self.driver
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        self.wake.sources()
    }

    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure> {
        match event {
            DeviceEvent::Lost => Err(Failure::Lost),
            _ => {
                self.wake.drain();
                Ok(())
            }
        }
    }

    fn abandon(&mut self) -> Fence {
        // The device given up, the driver stops too: its interrupt thread ends with its
        // environment, and its code is free for the device's next driver. A contending
        // thread leaves it first.
        self.contender = None;
        let certain = self.osenv.as_ref().is_none_or(Osenv::abandon);
        self.osenv = None;
        self.claim = None;
        if certain {
            Fence::Now
        } else {
            Fence::AtReopen
        }
    }
}

impl ClockDriver for LegacyClock {
    fn info(&self) -> &ClockInfo {
        &self.info
    }

    fn ticks(&self) -> u64 {
        self.ticks.total.load(Ordering::Acquire)
    }

    fn now(&mut self) -> Result<ClockTime, Failure> {
        let Some(osenv) = &self.osenv else {
            return Err(Failure::Driver("the driver was given up".into()));
        };
        let ns = {
            let _inside = osenv.enter();
            self.ops.now()
        }
        .map_err(|rc| {
            Failure::Driver(format!("the driver could not read the time (error {rc})"))
        })?;
        let (uncontested, contested) = self.delivered();
        Ok(ClockTime {
            ticks: self.ticks(),
            device_ns: ns,
            hz: self.info.hz,
            interrupts: (uncontested + contested) as u32,
        })
    }
}

impl std::fmt::Debug for LegacyClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LegacyClock")
            .field("driver", &self.driver)
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

super::builtin_c_driver! {
    /// The PCI timer's C driver (`c/timer.c`), in the catalog like any built-in driver; its
    /// identities come from its descriptor.
    TIMER, timer = builtin_timer,
    driver: "legacy-timer", class: outboard_clock::CLASS, score: 1000,
    faults: &[DriverFault::Contend],
}
