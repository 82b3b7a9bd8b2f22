//! The PCI timer's native driver (`docs/timer.md`): the same device as the C driver
//! (`c/timer.c`, `legacy-timer`), driven in the native work-loop model — its tick vector is an
//! event source of the driver server's loop, and the loop's thread handles it. It bids less
//! than the C driver, so the catalog picks the C driver unless this one is named
//! (`driver-host --driver clock0=timer`): the two exist to be compared (`outboard bench clock`).

use std::os::fd::BorrowedFd;

use outboard_clock::{ClockDriver, ClockInfo, ClockTime};
use outboard_env::{AnyDriver, DeviceEvent, Driver, Failure, Fence};
use outboard_hw::{Irq, IrqKind, PciFunction, Region};
use outboard_spec::timer::{self, ctrl, reg, status};

use crate::personality::{Identity, Personality, Probe, Provider, StartError, StartOptions};

/// Longest wait a client may ask for: an hour of ticks.
const MAX_WAIT_SECONDS: u32 = 3600;

/// The native timer driver, started on its device.
pub struct NativeTimer {
    function: PciFunction,
    regs: Region,
    irq: Irq,
    info: ClockInfo,
    ticks: u64,
    interrupts: u64,
}

fn hw(e: outboard_hw::HwError) -> Failure {
    Failure::Driver(format!("the timer did not answer: {e}"))
}

impl NativeTimer {
    /// Brings the timer up as clock `name`: checks its identity, reads its rate, takes its
    /// vector and starts it.
    pub fn new(name: &str, function: PciFunction) -> Result<Self, String> {
        let regs = function.region(0).map_err(|e| format!("BAR 0: {e}"))?;
        let id = regs.read32(reg::ID).map_err(|e| e.to_string())?;
        if id != timer::ID_VALUE {
            return Err(format!(
                "the identity register reads {id:#x}, not {:#x}",
                timer::ID_VALUE
            ));
        }
        function
            .enable_command(outboard_spec::pci::COMMAND_MEMORY)
            .map_err(|e| e.to_string())?;
        let period = regs.read32(reg::PERIOD_NS).map_err(|e| e.to_string())?;
        if !(timer::MIN_PERIOD_NS..=timer::MAX_PERIOD_NS).contains(&period) {
            return Err(format!(
                "the timer's period reads {period} ns, outside the device's range"
            ));
        }
        regs.write32(reg::CTRL, 0).map_err(|e| e.to_string())?;
        regs.write32(reg::STATUS, status::TICK)
            .map_err(|e| e.to_string())?;
        let irq = function
            .enable_irqs(IrqKind::MsiX, 1)
            .map_err(|e| format!("its MSI-X vector: {e}"))?
            .pop()
            .ok_or("the timer has no MSI-X vector")?;
        regs.write32(reg::CTRL, ctrl::RUN | ctrl::IRQ_ENABLE)
            .map_err(|e| e.to_string())?;
        let hz = 1_000_000_000 / period;
        Ok(Self {
            function,
            regs,
            irq,
            info: ClockInfo {
                name: name.to_string(),
                hz,
                max_wait: hz.saturating_mul(MAX_WAIT_SECONDS),
            },
            ticks: 0,
            interrupts: 0,
        })
    }
}

impl Driver for NativeTimer {
    fn driver_name(&self) -> &'static str {
        "timer"
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        let mut v = vec![(DeviceEvent::Interrupt(0), self.irq.fd())];
        if let Some(fd) = self.function.loss_fd() {
            v.push((DeviceEvent::Lost, fd));
        }
        v
    }

    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure> {
        match event {
            DeviceEvent::Lost => Err(Failure::Lost),
            DeviceEvent::Interrupt(_) => {
                self.irq.ack();
                self.interrupts += 1;
                // Clear first, read second: a tick in between raises the vector again.
                self.regs.write32(reg::STATUS, status::TICK).map_err(hw)?;
                let t = self.regs.read64(reg::TICKS).map_err(hw)?;
                self.ticks = self.ticks.max(t);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn abandon(&mut self) -> Fence {
        if self.function.abandon() {
            Fence::Now
        } else {
            Fence::AtReopen
        }
    }
}

impl ClockDriver for NativeTimer {
    fn info(&self) -> &ClockInfo {
        &self.info
    }

    fn ticks(&self) -> u64 {
        self.ticks
    }

    fn now(&mut self) -> Result<ClockTime, Failure> {
        Ok(ClockTime {
            ticks: self.ticks,
            device_ns: self.regs.read64(reg::COUNTER_NS).map_err(hw)?,
            hz: self.info.hz,
            interrupts: self.interrupts as u32,
        })
    }
}

fn matches(id: &Identity<'_>) -> bool {
    matches!(id, Identity::Pci(id) if id.vendor == timer::VENDOR && id.device == timer::DEVICE)
}

fn probe(_: &Probe<'_>, initial: u32) -> Result<u32, String> {
    Ok(initial)
}

fn start(p: Provider, o: &StartOptions) -> Result<Box<dyn AnyDriver>, StartError> {
    let Provider::Pci(f) = p else {
        return Err(StartError::NoMatch("timer drives PCI functions".into()));
    };
    let d = NativeTimer::new(&o.name, f).map_err(StartError::Refused)?;
    Ok(outboard_clock::bind(d))
}

/// The native timer driver's personality: below the C driver's bid.
pub const PERSONALITY: Personality = Personality {
    driver: "timer",
    class: outboard_clock::CLASS,
    score: 900,
    matches,
    probe,
    start,
    faults: &[],
    library: None,
};
