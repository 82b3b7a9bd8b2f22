//! Outboard's PCI timer model (`outboard_spec::timer`, `docs/timer.md`): a periodic tick on an
//! interrupt and a free-running nanosecond counter.
//!
//! Time is read, not counted: `TICKS` is the whole periods between the moment `RUN` was set
//! (or the period last changed) and now, and `COUNTER_NS` the host's monotonic clock, both
//! read when the register is. A periodic timerfd only
//! decides when the interrupt is raised, so a model that is scheduled late raises one
//! interrupt for several ticks (the driver reads `TICKS`) and never loses one.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use outboard_spec::pci;
use outboard_spec::timer::{self, ctrl, reg, status};
use outboard_vfio_user::wire::{self, region};
use outboard_vfio_user::{DeviceBackend, DeviceContext, RegionDesc};
use rustix::io::Errno;

use crate::faults::{FaultHandle, Faults};
use crate::msix::{irq_infos, MsixTable};
use crate::pci_config::{Bar, ConfigBuilder, ConfigSpace, Ids};

/// The host's monotonic clock in nanoseconds: the same for every model process on the host,
/// so the counter never goes back, across a restart of the driver or of the model.
fn host_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// What the timer does, apart from its configuration space.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimerStats {
    /// Ticks the timerfd reported.
    pub ticks: u64,
    /// Interrupts raised.
    pub interrupts: u64,
}

/// The timer model.
pub struct Timer {
    cfg: ConfigSpace,
    msix: MsixTable,
    /// The period at power-on.
    default_period_ns: u32,
    ctrl: u32,
    period_ns: u32,
    status: u32,
    /// While running: ticks counted before `since` (a period change keeps them), and when
    /// the current period began.
    base_ticks: u64,
    since: Option<Instant>,
    tick: OwnedFd,
    stats: TimerStats,
    faults: FaultHandle,
}

impl Timer {
    /// A timer whose period at power-on is `period_ns` (clamped into the device's range).
    pub fn new(period_ns: u32) -> std::io::Result<Self> {
        let ids = Ids {
            vendor: timer::VENDOR,
            device: timer::DEVICE,
            subsystem_vendor: timer::VENDOR,
            subsystem: timer::DEVICE,
            class: timer::CLASS,
            revision: timer::REVISION,
        };
        let msix_body = MsixTable::capability_body(timer::MSIX_VECTORS, timer::PBA_OFFSET);
        let b = ConfigBuilder::new(ids)
            .bar(Bar {
                index: 0,
                size: timer::BAR0_SIZE,
            })
            .bar(Bar {
                index: 1,
                size: timer::BAR1_SIZE,
            });
        let (b, _) = b.capability(pci::CAP_ID_MSIX, &msix_body, &[(1, 0xc0)]);
        let period = timer::clamp_period(period_ns);
        Ok(Self {
            cfg: b.build(),
            msix: MsixTable::new(timer::MSIX_VECTORS, timer::PBA_OFFSET),
            default_period_ns: period,
            ctrl: 0,
            period_ns: period,
            status: 0,
            base_ticks: 0,
            since: None,
            tick: outboard_sys::timer::periodic(None)?,
            stats: TimerStats::default(),
            faults: std::sync::Arc::new(std::sync::Mutex::new(Faults {
                queueless: true,
                ..Faults::default()
            })),
        })
    }

    /// Its faults, armed at the next tick: `crash` aborts the model, `stall=D` stops it for D,
    /// `drop-irq=N` drops the next N interrupts (the ticks still count), `duplicate-irq=N`
    /// raises the next N twice, `spurious-irq=N` raises N with no tick behind them.
    pub fn faults(&self) -> FaultHandle {
        self.faults.clone()
    }

    /// What the timer has done.
    pub fn stats(&self) -> TimerStats {
        self.stats
    }

    fn period(&self) -> Duration {
        Duration::from_nanos(u64::from(self.period_ns))
    }

    /// Whole periods since `RUN` was set.
    fn ticks(&self, now: Instant) -> u64 {
        match self.since {
            None => 0,
            Some(t) => {
                self.base_ticks
                    + (now.saturating_duration_since(t).as_nanos() / u128::from(self.period_ns))
                        as u64
            }
        }
    }

    /// Starts, stops or re-times the periodic timerfd after `CTRL` or `PERIOD_NS` changed.
    fn retime(&mut self, now: Instant) {
        let running = self.ctrl & ctrl::RUN != 0;
        match (running, self.since) {
            (true, None) => {
                self.base_ticks = 0;
                self.since = Some(now);
            }
            (false, Some(_)) => {
                self.base_ticks = 0;
                self.since = None;
            }
            _ => {}
        }
        // Ticks set STATUS.TICK whether or not they raise the interrupt.
        let period = running.then(|| self.period());
        if let Err(e) = outboard_sys::timer::set_periodic(self.tick.as_fd(), period) {
            tracing::warn!("timer: cannot arm the tick: {e}");
        }
    }

    fn raise(&mut self, ctx: &mut DeviceContext, times: u32) {
        for _ in 0..times {
            self.stats.interrupts += 1;
            if !ctx.irqs.trigger(wire::irq::MSIX, 0) {
                ctx.irqs.trigger(wire::irq::INTX, 0);
            }
        }
    }

    fn read_reg(&self, offset: u64) -> u64 {
        let now = Instant::now();
        match offset {
            reg::ID => u64::from(timer::ID_VALUE),
            reg::CTRL => u64::from(self.ctrl),
            reg::PERIOD_NS => u64::from(self.period_ns),
            reg::COUNTER_NS => host_ns(),
            reg::TICKS => self.ticks(now),
            reg::STATUS => u64::from(self.status),
            _ => 0,
        }
    }

    fn write_reg(&mut self, offset: u64, v: u64) {
        let now = Instant::now();
        match offset {
            reg::CTRL => {
                self.ctrl = v as u32 & ctrl::ALL;
                self.retime(now);
            }
            reg::PERIOD_NS => {
                // The ticks so far stay counted; the new period starts now.
                if self.since.is_some() {
                    self.base_ticks = self.ticks(now);
                    self.since = Some(now);
                }
                self.period_ns = timer::clamp_period(v as u32);
                self.retime(now);
            }
            reg::STATUS => {
                // Ticks that passed while the bit was set are in TICKS already; the next one
                // raises the interrupt again.
                self.status &= !(v as u32);
            }
            _ => {}
        }
    }

    fn bar0_read(&self, offset: u64, buf: &mut [u8]) {
        buf.fill(0);
        // Registers are 32 or 64 bits wide, read whole or in aligned halves.
        let (base, within) = if (reg::COUNTER_NS..reg::STATUS).contains(&offset) {
            (offset & !7, (offset & 7) as usize)
        } else {
            (offset & !3, (offset & 3) as usize)
        };
        let v = self.read_reg(base).to_le_bytes();
        for (i, b) in buf.iter_mut().enumerate() {
            *b = v.get(within + i).copied().unwrap_or(0);
        }
    }

    fn bar0_write(&mut self, offset: u64, data: &[u8]) {
        // Writable registers are 32 bits; a write must be whole and aligned.
        if data.len() != 4 || !offset.is_multiple_of(4) {
            return;
        }
        let v = u32::from_le_bytes(data.try_into().expect("4 bytes"));
        self.write_reg(offset, u64::from(v));
    }
}

impl DeviceBackend for Timer {
    fn regions(&self) -> Vec<RegionDesc<'_>> {
        let rw = region::FLAG_READ | region::FLAG_WRITE;
        let desc = |index, size| RegionDesc {
            index,
            size,
            flags: rw,
            mmap: None,
        };
        vec![
            desc(region::BAR0, timer::BAR0_SIZE),
            desc(region::BAR0 + 1, timer::BAR1_SIZE),
            desc(region::CONFIG, pci::CONFIG_SPACE_SIZE as u64),
        ]
    }

    fn irqs(&self) -> Vec<wire::IrqInfo> {
        irq_infos(u32::from(timer::MSIX_VECTORS))
    }

    fn region_read(
        &mut self,
        _ctx: &mut DeviceContext,
        index: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), Errno> {
        match index {
            region::BAR0 => self.bar0_read(offset, buf),
            i if i == region::BAR0 + 1 => self.msix.read(offset, buf),
            region::CONFIG => self.cfg.read(offset, buf),
            _ => return Err(Errno::INVAL),
        }
        Ok(())
    }

    fn region_write(
        &mut self,
        _ctx: &mut DeviceContext,
        index: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), Errno> {
        match index {
            region::BAR0 => self.bar0_write(offset, data),
            i if i == region::BAR0 + 1 => self.msix.write(offset, data),
            region::CONFIG => self.cfg.write(offset, data),
            _ => return Err(Errno::INVAL),
        }
        Ok(())
    }

    fn event_fds(&self) -> Vec<BorrowedFd<'_>> {
        vec![self.tick.as_fd()]
    }

    fn event(&mut self, ctx: &mut DeviceContext, _id: usize) {
        self.stats.ticks += 1;
        if self.ctrl & ctrl::RUN == 0 {
            return;
        }
        let (times, spurious) = crate::faults::at_interrupt(&self.faults, "timer");
        let irq = self.ctrl & ctrl::IRQ_ENABLE != 0;
        if spurious > 0 {
            // Interrupts with no tick behind them: this tick leaves STATUS alone (TICKS
            // counts it all the same) and the next one sets it.
            if irq {
                self.raise(ctx, spurious);
            }
            return;
        }
        let rose = self.status & status::TICK == 0;
        self.status |= status::TICK;
        if irq && rose {
            self.raise(ctx, times);
        }
    }

    fn reset(&mut self, _ctx: &mut DeviceContext) {
        self.cfg.reset();
        self.msix.reset();
        self.ctrl = 0;
        self.status = 0;
        self.period_ns = self.default_period_ns;
        self.retime(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> DeviceContext {
        DeviceContext::new(Duration::from_secs(1))
    }

    fn read(t: &mut Timer, off: u64, width: usize) -> u64 {
        let mut b = [0u8; 8];
        t.region_read(&mut ctx(), region::BAR0, off, &mut b[..width])
            .unwrap();
        u64::from_le_bytes(b)
    }

    fn write(t: &mut Timer, c: &mut DeviceContext, off: u64, v: u32) {
        t.region_write(c, region::BAR0, off, &v.to_le_bytes())
            .unwrap();
    }

    #[test]
    fn identity_and_configuration_space_say_what_the_device_is() {
        let mut t = Timer::new(timer::DEFAULT_PERIOD_NS).unwrap();
        assert_eq!(read(&mut t, reg::ID, 4), u64::from(timer::ID_VALUE));
        let mut id = [0u8; 4];
        t.region_read(&mut ctx(), region::CONFIG, 0, &mut id)
            .unwrap();
        assert_eq!(u16::from_le_bytes([id[0], id[1]]), timer::VENDOR);
        assert_eq!(u16::from_le_bytes([id[2], id[3]]), timer::DEVICE);
        assert_eq!(t.cfg.bar_size(0), timer::BAR0_SIZE);
    }

    #[test]
    fn ticks_count_periods_while_running_and_the_counter_never_resets() {
        let mut c = ctx();
        let mut t = Timer::new(timer::MIN_PERIOD_NS).unwrap();
        assert_eq!(read(&mut t, reg::TICKS, 8), 0);
        write(&mut t, &mut c, reg::CTRL, ctrl::RUN);
        std::thread::sleep(Duration::from_millis(5));
        let n = read(&mut t, reg::TICKS, 8);
        // 5 ms of 10 µs periods, however late this thread ran: at least 500.
        assert!(n >= 500, "{n} ticks");
        let before = read(&mut t, reg::COUNTER_NS, 8);
        t.reset(&mut c);
        assert_eq!(read(&mut t, reg::TICKS, 8), 0, "a reset stops the timer");
        assert_eq!(read(&mut t, reg::CTRL, 4), 0);
        assert!(
            read(&mut t, reg::COUNTER_NS, 8) > before,
            "the counter went back"
        );
        // The low half then the high half read the same 64-bit value's parts.
        let hi = read(&mut t, reg::COUNTER_NS + 4, 4);
        assert_eq!(hi, read(&mut t, reg::COUNTER_NS, 8) >> 32);
    }

    #[test]
    fn the_period_is_clamped_and_a_change_keeps_the_ticks_counted() {
        let mut c = ctx();
        let mut t = Timer::new(timer::MIN_PERIOD_NS).unwrap();
        write(&mut t, &mut c, reg::PERIOD_NS, 1);
        assert_eq!(
            read(&mut t, reg::PERIOD_NS, 4),
            u64::from(timer::MIN_PERIOD_NS)
        );
        write(&mut t, &mut c, reg::CTRL, ctrl::RUN);
        std::thread::sleep(Duration::from_millis(3));
        write(&mut t, &mut c, reg::PERIOD_NS, u32::MAX);
        assert_eq!(
            read(&mut t, reg::PERIOD_NS, 4),
            u64::from(timer::MAX_PERIOD_NS)
        );
        assert!(
            read(&mut t, reg::TICKS, 8) >= 300,
            "ticks lost at the change"
        );
    }

    #[test]
    fn a_tick_sets_status_and_raises_one_interrupt_until_cleared() {
        let mut c = ctx();
        let mut t = Timer::new(timer::DEFAULT_PERIOD_NS).unwrap();
        write(&mut t, &mut c, reg::CTRL, ctrl::RUN | ctrl::IRQ_ENABLE);
        t.event(&mut c, 0);
        t.event(&mut c, 0);
        assert_eq!(read(&mut t, reg::STATUS, 4), u64::from(status::TICK));
        assert_eq!(
            t.stats().interrupts,
            1,
            "a second tick while TICK is set raised"
        );
        write(&mut t, &mut c, reg::STATUS, status::TICK);
        assert_eq!(read(&mut t, reg::STATUS, 4), 0);
        t.event(&mut c, 0);
        assert_eq!(t.stats().interrupts, 2);
        // Without IRQ_ENABLE the bit is set and nothing is raised.
        write(&mut t, &mut c, reg::CTRL, ctrl::RUN);
        write(&mut t, &mut c, reg::STATUS, status::TICK);
        t.event(&mut c, 0);
        assert_eq!(t.stats().interrupts, 2);
        assert_eq!(read(&mut t, reg::STATUS, 4), u64::from(status::TICK));
    }

    #[test]
    fn interrupt_faults_fire_at_ticks_and_queue_faults_are_refused() {
        let mut c = ctx();
        let mut t = Timer::new(timer::DEFAULT_PERIOD_NS).unwrap();
        write(&mut t, &mut c, reg::CTRL, ctrl::RUN | ctrl::IRQ_ENABLE);
        let f = t.faults();
        crate::faults::lock(&f).arm(crate::faults::Fault::DropIrq(1));
        t.event(&mut c, 0);
        assert_eq!(t.stats().interrupts, 0, "a dropped interrupt was raised");
        assert_eq!(read(&mut t, reg::STATUS, 4), u64::from(status::TICK));
        write(&mut t, &mut c, reg::STATUS, status::TICK);
        crate::faults::lock(&f).arm(crate::faults::Fault::DuplicateIrq(1));
        t.event(&mut c, 0);
        assert_eq!(t.stats().interrupts, 2);
        let e = crate::faults::lock(&f)
            .check(&crate::faults::Fault::NeedsReset)
            .unwrap_err();
        assert!(e.contains("no queues") && e.contains("drop-irq"), "{e}");
        assert!(crate::faults::lock(&f)
            .check(&crate::faults::Fault::Crash)
            .is_ok());
        // A spurious interrupt comes with STATUS.TICK clear: the driver can tell.
        write(&mut t, &mut c, reg::STATUS, status::TICK);
        crate::faults::lock(&f).arm(crate::faults::Fault::SpuriousIrq(1));
        t.event(&mut c, 0);
        assert_eq!(t.stats().interrupts, 3);
        assert_eq!(read(&mut t, reg::STATUS, 4), 0);
    }

    #[test]
    fn running_without_interrupts_still_sets_the_tick_bit() {
        let mut c = ctx();
        let mut t = Timer::new(timer::MIN_PERIOD_NS).unwrap();
        write(&mut t, &mut c, reg::CTRL, ctrl::RUN);
        // The model's own timer fires (what its server's loop would see).
        let mut p = [rustix::event::PollFd::new(
            &t.tick,
            rustix::event::PollFlags::IN,
        )];
        let ready = rustix::event::poll(
            &mut p,
            Some(&rustix::time::Timespec {
                tv_sec: 1,
                tv_nsec: 0,
            }),
        )
        .unwrap();
        assert_eq!(ready, 1, "a running timer without IRQ_ENABLE does not tick");
        t.event(&mut c, 0);
        assert_eq!(read(&mut t, reg::STATUS, 4), u64::from(status::TICK));
        assert_eq!(t.stats().interrupts, 0);
    }

    #[test]
    fn odd_accesses_are_harmless() {
        let mut c = ctx();
        let mut t = Timer::new(timer::DEFAULT_PERIOD_NS).unwrap();
        // A partial write is ignored, a read past the registers is zero.
        t.region_write(&mut c, region::BAR0, reg::CTRL, &[1])
            .unwrap();
        assert_eq!(read(&mut t, reg::CTRL, 4), 0);
        assert_eq!(read(&mut t, 0x800, 8), 0);
        assert!(t
            .region_write(&mut c, 9, 0, &[0; 4])
            .is_err_and(|e| e == Errno::INVAL));
    }
}
