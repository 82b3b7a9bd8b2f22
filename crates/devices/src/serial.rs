//! A 16550A UART on PCI, compatible with QEMU's `pci-serial` (`outboard_spec::uart`): the same
//! identity, one 8-byte I/O BAR, the interrupt on INTx; FIFOs with the four receive trigger
//! levels and the character timeout, interrupt identification by priority, modem control and
//! status, loopback, the divisor latch and scratch register. Its far end on the host is a
//! [`Line`] (a pty, a Unix socket, a file).
//!
//! **As a virtual UART.** Like QEMU's, it moves bytes as fast as both ends take them rather
//! than at the baud rate: the receiver takes from the far end only what its FIFO has room
//! for (so nothing overruns; the rest waits on the host), and the transmitter hands bytes to
//! the far end at once, holding them in its FIFO while the far end takes no more. The line
//! settings change no bytes except that 5 to 7 data bits mask the high bits; the baud rate
//! and frame decide the character timeout (four character times).
//! **Flow control.** The far end honours RTS as hardware flow control: while the driver holds
//! RTS off, nothing is received. CTS is on while the far end takes bytes and off while it is
//! backed up; DSR and DCD are on while someone is at the far end.
//! **The interrupt is a level.** As VFIO delivers INTx, it is masked when raised and raised
//! again when the driver unmasks it while an interrupt is still pending.

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use outboard_spec::pci;
use outboard_spec::uart::{self, fcr, ier, iir, lcr, lsr, mcr, msr, reg};
use outboard_vfio_user::wire::{self, region};
use outboard_vfio_user::{DeviceBackend, DeviceContext, RegionDesc};
use rustix::io::Errno;

use crate::faults::{FaultHandle, Faults};
use crate::pci_config::{Bar, ConfigBuilder, ConfigSpace, Ids};
use crate::serial_line::Line;

/// How soon a transmitter held by a backed-up far end tries again.
const RETRY: Duration = Duration::from_millis(1);

/// What the UART has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SerialStats {
    /// Bytes received from the far end (or looped back).
    pub received: u64,
    /// Bytes sent to the far end.
    pub sent: u64,
    /// Bytes lost to a full receive FIFO (only in loopback: the far end is never overrun).
    pub overruns: u64,
    /// Interrupts raised.
    pub interrupts: u64,
}

/// The UART model.
pub struct Serial {
    cfg: ConfigSpace,
    line: Line,
    ier: u8,
    lcr: u8,
    mcr: u8,
    scr: u8,
    divisor: u16,
    fifos: bool,
    trigger: usize,
    rx: VecDeque<u8>,
    tx: VecDeque<u8>,
    /// Error bits a read of LSR clears.
    errors: u8,
    /// The modem inputs last seen, and their changes since MSR was read.
    lines: u8,
    deltas: u8,
    /// The transmitter-empty interrupt's condition (set when the FIFO empties, cleared by
    /// reading IIR while it is the source, or by writing DATA).
    thre: bool,
    /// The far end took no more at the last try.
    backed_up: bool,
    /// The character timeout's condition, and when it is due.
    timed_out: bool,
    timeout_due: Option<Instant>,
    timer: outboard_sys::timer::Timer,
    stats: SerialStats,
    faults: FaultHandle,
}

impl Serial {
    /// A UART whose far end is `line`.
    pub fn new(line: Line) -> std::io::Result<Self> {
        let ids = Ids {
            vendor: uart::VENDOR,
            device: uart::DEVICE,
            // QEMU's default subsystem ids.
            subsystem_vendor: 0x1af4,
            subsystem: 0x1100,
            class: uart::CLASS,
            revision: uart::REVISION,
        };
        let cfg = ConfigBuilder::new(ids)
            .io_bar(Bar {
                index: 0,
                size: uart::BAR0_SIZE,
            })
            .build();
        let mut s = Self {
            cfg,
            line,
            ier: 0,
            lcr: 0,
            mcr: 0,
            scr: 0,
            divisor: 0,
            fifos: false,
            trigger: 1,
            rx: VecDeque::new(),
            tx: VecDeque::new(),
            errors: 0,
            lines: 0,
            deltas: 0,
            thre: false,
            backed_up: false,
            timed_out: false,
            timeout_due: None,
            timer: outboard_sys::timer::Timer::new()?,
            stats: SerialStats::default(),
            faults: std::sync::Arc::new(std::sync::Mutex::new(Faults {
                queueless: true,
                ..Faults::default()
            })),
        };
        s.power_on();
        Ok(s)
    }

    /// Its faults, fired at the next interrupt: `crash`, `stall=D`, `drop-irq=N`,
    /// `duplicate-irq=N`, `spurious-irq=N`.
    pub fn faults(&self) -> FaultHandle {
        self.faults.clone()
    }

    /// What the UART has done.
    pub fn stats(&self) -> SerialStats {
        self.stats
    }

    /// The far end.
    pub fn line(&self) -> &Line {
        &self.line
    }

    fn power_on(&mut self) {
        self.ier = 0;
        self.lcr = 0x03; // 8N1
        self.mcr = 0;
        self.scr = 0;
        self.divisor = 12; // 9600 baud
        self.fifos = false;
        self.trigger = 1;
        self.rx.clear();
        self.tx.clear();
        self.errors = 0;
        self.deltas = 0;
        self.thre = false;
        self.backed_up = false;
        self.timed_out = false;
        self.timeout_due = None;
        let _ = self.timer.disarm();
        self.lines = self.modem_inputs();
    }

    fn fifo_size(&self) -> usize {
        if self.fifos {
            uart::FIFO_SIZE
        } else {
            1
        }
    }

    fn looped(&self) -> bool {
        self.mcr & mcr::LOOP != 0
    }

    fn word_mask(&self) -> u8 {
        0xff >> (3 - (self.lcr & lcr::WORD_MASK))
    }

    /// Four character times at the current rate and frame.
    fn char_timeout(&self) -> Duration {
        let baud = uart::MAX_BAUD / u32::from(self.divisor.max(1));
        let bits = uart::frame_bits(self.lcr);
        Duration::from_nanos(4 * u64::from(bits) * 1_000_000_000 / u64::from(baud.max(1)))
    }

    /// The modem inputs as the far end (or loopback) sets them.
    fn modem_inputs(&self) -> u8 {
        if self.looped() {
            let m = self.mcr;
            let on = |bit: u8, out: u8| if m & bit != 0 { out } else { 0 };
            return on(mcr::RTS, msr::CTS)
                | on(mcr::DTR, msr::DSR)
                | on(mcr::OUT1, msr::RI)
                | on(mcr::OUT2, msr::DCD);
        }
        if !self.line.connected() {
            return 0;
        }
        let cts = if self.backed_up { 0 } else { msr::CTS };
        cts | msr::DSR | msr::DCD
    }

    /// Notes changes of the modem inputs in the delta bits.
    fn watch_modem(&mut self) {
        let now = self.modem_inputs();
        let changed = now ^ self.lines;
        if changed & msr::CTS != 0 {
            self.deltas |= msr::DCTS;
        }
        if changed & msr::DSR != 0 {
            self.deltas |= msr::DDSR;
        }
        if changed & msr::DCD != 0 {
            self.deltas |= msr::DDCD;
        }
        if self.lines & msr::RI != 0 && now & msr::RI == 0 {
            self.deltas |= msr::TERI;
        }
        self.lines = now;
    }

    /// The highest-priority interrupt pending and enabled.
    fn pending(&self) -> u8 {
        let level = if self.fifos { self.trigger } else { 1 };
        if self.ier & ier::RLS != 0 && self.errors != 0 {
            iir::RLS
        } else if self.ier & ier::RDA != 0 && self.rx.len() >= level {
            iir::RDA
        } else if self.ier & ier::RDA != 0 && self.timed_out && !self.rx.is_empty() {
            iir::TIMEOUT
        } else if self.ier & ier::THRE != 0 && self.thre {
            iir::THRE
        } else if self.ier & ier::MSI != 0 && self.deltas != 0 {
            iir::MODEM
        } else {
            iir::NONE
        }
    }

    /// Raises INTx if an interrupt is pending and INTx is not masked (delivered, and not yet
    /// unmasked by the driver).
    fn update_irq(&mut self, ctx: &mut DeviceContext) {
        // Nothing pending, delivered and not yet unmasked, or no driver listening: nothing
        // is raised (and no interrupt fault is spent on it).
        if self.pending() == iir::NONE
            || ctx.irqs.masked(wire::irq::INTX, 0)
            || ctx.irqs.enabled(wire::irq::INTX) == 0
        {
            return;
        }
        let (times, spurious) = crate::faults::at_interrupt(&self.faults, "serial");
        let mut raised = false;
        for _ in 0..times + spurious {
            raised |= ctx.irqs.trigger(wire::irq::INTX, 0);
        }
        if raised {
            self.stats.interrupts += u64::from(times + spurious);
            ctx.irqs.mask(wire::irq::INTX, 0);
        }
    }

    /// Bytes arrived in the receive FIFO: the character timeout starts again.
    fn received(&mut self) {
        self.timed_out = false;
        self.timeout_due =
            (self.fifos && !self.rx.is_empty()).then(|| Instant::now() + self.char_timeout());
        self.arm_timer();
    }

    fn arm_timer(&mut self) {
        let retry = (!self.tx.is_empty()).then(|| Instant::now() + RETRY);
        let due = [self.timeout_due, retry].into_iter().flatten().min();
        let r = match due {
            Some(at) => self.timer.arm_at(at),
            None => self.timer.disarm(),
        };
        if let Err(e) = r {
            tracing::warn!("serial: cannot arm the timer: {e}");
        }
    }

    /// Hands the far end what it takes of the transmit FIFO.
    fn flush(&mut self) {
        if self.tx.is_empty() {
            return;
        }
        let (a, _) = self.tx.as_slices();
        let n = self.line.send(a);
        self.stats.sent += n as u64;
        self.tx.drain(..n);
        if !self.tx.is_empty() && n > 0 {
            self.flush();
            return;
        }
        self.backed_up = !self.tx.is_empty();
        if self.tx.is_empty() {
            self.thre = true;
        }
    }

    fn write_data(&mut self, v: u8) {
        let v = v & self.word_mask();
        self.thre = false;
        if self.looped() {
            if self.rx.len() < self.fifo_size() {
                self.rx.push_back(v);
                self.stats.received += 1;
                self.received();
            } else {
                self.errors |= lsr::OE;
                self.stats.overruns += 1;
            }
            self.thre = true;
            return;
        }
        // A full transmitter drops the byte, as the hardware overwrites it.
        if self.tx.len() < self.fifo_size() {
            self.tx.push_back(v);
        }
        self.flush();
        self.watch_modem();
        self.arm_timer();
    }

    fn read_data(&mut self) -> u8 {
        let v = self.rx.pop_front().unwrap_or(0);
        self.timed_out = false;
        self.timeout_due =
            (self.fifos && !self.rx.is_empty()).then(|| Instant::now() + self.char_timeout());
        self.arm_timer();
        v
    }

    fn write_fcr(&mut self, v: u8) {
        let on = v & fcr::ENABLE != 0;
        if on != self.fifos {
            // Turning the FIFOs on or off empties them.
            self.rx.clear();
            self.tx.clear();
            self.thre = true;
        }
        self.fifos = on;
        if on {
            if v & fcr::CLEAR_RX != 0 {
                self.rx.clear();
                self.timed_out = false;
                self.timeout_due = None;
            }
            if v & fcr::CLEAR_TX != 0 {
                self.tx.clear();
                self.thre = true;
            }
            self.trigger = fcr::TRIGGER_LEVELS[usize::from(v >> fcr::TRIGGER_SHIFT)];
        } else {
            self.trigger = 1;
        }
        // Nothing waits for the far end any more only if the transmitter was emptied.
        if self.tx.is_empty() {
            self.backed_up = false;
        }
        self.arm_timer();
    }

    fn lsr(&self) -> u8 {
        let mut v = self.errors;
        if !self.rx.is_empty() {
            v |= lsr::DR;
        }
        if self.tx.is_empty() {
            v |= lsr::THRE | lsr::TEMT;
        }
        v
    }

    fn read_reg(&mut self, offset: u64) -> u8 {
        let dlab = self.lcr & lcr::DLAB != 0;
        match offset {
            reg::DATA if dlab => self.divisor as u8,
            reg::DATA => self.read_data(),
            reg::IER if dlab => (self.divisor >> 8) as u8,
            reg::IER => self.ier,
            reg::IIR_FCR => {
                let id = self.pending();
                if id == iir::THRE {
                    self.thre = false;
                }
                id | if self.fifos { iir::FIFOS_ON } else { 0 }
            }
            reg::LCR => self.lcr,
            reg::MCR => self.mcr,
            reg::LSR => {
                let v = self.lsr();
                self.errors = 0;
                v
            }
            reg::MSR => {
                self.watch_modem();
                let v = self.lines | self.deltas;
                self.deltas = 0;
                v
            }
            reg::SCR => self.scr,
            _ => 0xff,
        }
    }

    fn write_reg(&mut self, offset: u64, v: u8) {
        let dlab = self.lcr & lcr::DLAB != 0;
        match offset {
            reg::DATA if dlab => self.divisor = (self.divisor & 0xff00) | u16::from(v),
            reg::DATA => self.write_data(v),
            reg::IER if dlab => self.divisor = (self.divisor & 0x00ff) | (u16::from(v) << 8),
            reg::IER => {
                let was = self.ier;
                self.ier = v & ier::ALL;
                // Enabling the transmitter interrupt with the FIFO empty raises it, as on
                // the 16550 (drivers rely on it to start sending).
                if was & ier::THRE == 0 && self.ier & ier::THRE != 0 && self.tx.is_empty() {
                    self.thre = true;
                }
                // Disabled, a pending transmitter interrupt is forgotten (as QEMU's).
                if self.ier & ier::THRE == 0 {
                    self.thre = false;
                }
            }
            reg::IIR_FCR => self.write_fcr(v),
            reg::LCR => self.lcr = v,
            reg::MCR => {
                let was_looped = self.looped();
                self.mcr = v & mcr::ALL;
                if was_looped != self.looped() {
                    self.backed_up = false;
                }
                self.watch_modem();
            }
            reg::SCR => self.scr = v,
            _ => {}
        }
    }

    /// Room in the receive FIFO for the far end's bytes, if the far end may send now.
    fn receive_room(&self) -> usize {
        if self.looped() || self.mcr & mcr::RTS == 0 {
            return 0;
        }
        self.fifo_size().saturating_sub(self.rx.len())
    }
}

impl DeviceBackend for Serial {
    fn regions(&self) -> Vec<RegionDesc<'_>> {
        vec![
            RegionDesc {
                index: region::BAR0,
                size: uart::BAR0_SIZE,
                flags: region::FLAG_READ | region::FLAG_WRITE,
                mmap: None,
            },
            RegionDesc {
                index: region::CONFIG,
                size: pci::CONFIG_SPACE_SIZE as u64,
                flags: region::FLAG_READ | region::FLAG_WRITE,
                mmap: None,
            },
        ]
    }

    fn irqs(&self) -> Vec<wire::IrqInfo> {
        // INTx only, as QEMU's pci-serial.
        crate::msix::irq_infos(0)
    }

    fn region_read(
        &mut self,
        ctx: &mut DeviceContext,
        index: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), Errno> {
        match index {
            region::BAR0 => {
                // Byte registers; a wider access reads the registers in turn.
                for (i, b) in buf.iter_mut().enumerate() {
                    *b = self.read_reg(offset + i as u64);
                }
                self.update_irq(ctx);
            }
            region::CONFIG => self.cfg.read(offset, buf),
            _ => return Err(Errno::INVAL),
        }
        Ok(())
    }

    fn region_write(
        &mut self,
        ctx: &mut DeviceContext,
        index: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), Errno> {
        match index {
            region::BAR0 => {
                for (i, &v) in data.iter().enumerate() {
                    self.write_reg(offset + i as u64, v);
                }
                self.update_irq(ctx);
            }
            region::CONFIG => self.cfg.write(offset, data),
            _ => return Err(Errno::INVAL),
        }
        Ok(())
    }

    fn event_fds(&self) -> Vec<BorrowedFd<'_>> {
        vec![self.timer.fd()]
    }

    fn event(&mut self, ctx: &mut DeviceContext, _id: usize) {
        self.timer.ack();
        let now = Instant::now();
        if self.timeout_due.is_some_and(|t| t <= now) {
            self.timeout_due = None;
            self.timed_out = !self.rx.is_empty();
        }
        self.flush();
        self.watch_modem();
        self.arm_timer();
        self.update_irq(ctx);
    }

    fn input_fds(&self) -> Vec<BorrowedFd<'_>> {
        self.line
            .sources(self.receive_room() > 0)
            .into_iter()
            .map(|(_, fd)| fd)
            .collect()
    }

    fn input(&mut self, ctx: &mut DeviceContext, id: usize) {
        // The same list input_fds gave (nothing changed in between): which source this is.
        let Some(what) = self
            .line
            .sources(self.receive_room() > 0)
            .get(id)
            .map(|(w, _)| *w)
        else {
            return;
        };
        let mut buf = [0u8; uart::FIFO_SIZE];
        let room = self.receive_room();
        let n = self.line.ready(what, &mut buf[..room]);
        let mask = self.word_mask();
        self.rx.extend(buf[..n].iter().map(|b| b & mask));
        self.stats.received += n as u64;
        if n > 0 {
            self.received();
        }
        self.watch_modem();
        self.update_irq(ctx);
    }

    fn irqs_changed(&mut self, ctx: &mut DeviceContext, index: u32) {
        // An unmask with an interrupt still pending raises it again (a level).
        if index == wire::irq::INTX {
            self.update_irq(ctx);
        }
    }

    fn reset(&mut self, _ctx: &mut DeviceContext) {
        self.cfg.reset();
        self.power_on();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::OwnedFd;

    fn pair() -> (OwnedFd, OwnedFd) {
        rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap()
    }

    fn ctx() -> DeviceContext {
        DeviceContext::new(Duration::from_secs(1))
    }

    fn rd(s: &mut Serial, c: &mut DeviceContext, off: u64) -> u8 {
        let mut b = [0u8];
        s.region_read(c, region::BAR0, off, &mut b).unwrap();
        b[0]
    }

    fn wr(s: &mut Serial, c: &mut DeviceContext, off: u64, v: u8) {
        s.region_write(c, region::BAR0, off, &[v]).unwrap();
    }

    proptest::proptest! {
        /// Whatever a driver writes and reads, in any order and width, the model keeps its
        /// FIFOs within their size and answers every access.
        #[test]
        fn any_register_traffic_keeps_the_model_sound(
            ops in proptest::collection::vec((0u8..3, 0u64..10, proptest::prelude::any::<u8>()), 0..400)
        ) {
            let (a, b) = pair();
            let mut s = Serial::new(Line::stream(a).unwrap()).unwrap();
            let mut c = ctx();
            rustix::io::write(&b, &[0x55; 64]).unwrap();
            for (kind, off, v) in ops {
                match kind {
                    0 => {
                        let _ = s.region_write(&mut c, region::BAR0, off % 8, &[v]);
                    }
                    1 => {
                        let mut buf = [0u8; 2];
                        let _ = s.region_read(&mut c, region::BAR0, off % 7, &mut buf);
                    }
                    _ => {
                        if !s.input_fds().is_empty() {
                            s.input(&mut c, 0);
                        }
                        s.event(&mut c, 0);
                    }
                }
                proptest::prop_assert!(s.rx.len() <= uart::FIFO_SIZE);
                proptest::prop_assert!(s.tx.len() <= uart::FIFO_SIZE);
            }
        }
    }

    #[test]
    fn identity_is_qemus_pci_serial_with_an_io_bar() {
        let (a, _b) = pair();
        let mut s = Serial::new(Line::stream(a).unwrap()).unwrap();
        let mut c = ctx();
        let mut cfg = [0u8; 64];
        s.region_read(&mut c, region::CONFIG, 0, &mut cfg).unwrap();
        assert_eq!(u16::from_le_bytes([cfg[0], cfg[1]]), 0x1b36);
        assert_eq!(u16::from_le_bytes([cfg[2], cfg[3]]), 0x0002);
        assert_eq!(&cfg[9..12], &[0x02, 0x00, 0x07]);
        assert_eq!(cfg[0x10] & 1, 1, "BAR 0 is not an I/O BAR");
        assert_eq!(cfg[0x3d], 1, "INTA#");
        s.region_write(&mut c, region::CONFIG, 0x10, &[0xff; 4])
            .unwrap();
        s.region_read(&mut c, region::CONFIG, 0x10, &mut cfg[..4])
            .unwrap();
        assert_eq!(u32::from_le_bytes(cfg[..4].try_into().unwrap()), !7u32 | 1);
    }

    #[test]
    fn bytes_pass_both_ways_and_the_fifo_bounds_what_is_taken() {
        let (a, b) = pair();
        let mut s = Serial::new(Line::stream(a).unwrap()).unwrap();
        let mut c = ctx();
        wr(
            &mut s,
            &mut c,
            reg::IIR_FCR,
            fcr::ENABLE | fcr::CLEAR_RX | fcr::CLEAR_TX,
        );
        wr(&mut s, &mut c, reg::MCR, mcr::RTS | mcr::DTR);
        for &v in b"hi" {
            wr(&mut s, &mut c, reg::DATA, v);
        }
        let mut got = [0u8; 2];
        assert_eq!(rustix::io::read(&b, &mut got).unwrap(), 2);
        assert_eq!(&got, b"hi");
        rustix::io::write(&b, &[7u8; 40]).unwrap();
        assert_eq!(s.input_fds().len(), 1);
        s.input(&mut c, 0);
        assert_eq!(s.rx.len(), uart::FIFO_SIZE, "took more than the FIFO holds");
        assert!(s.input_fds().is_empty(), "a full FIFO still asks for input");
        assert_eq!(rd(&mut s, &mut c, reg::LSR) & lsr::DR, lsr::DR);
        assert_eq!(rd(&mut s, &mut c, reg::DATA), 7);
        assert_eq!(s.input_fds().len(), 1);
        // RTS off: the far end holds its bytes.
        wr(&mut s, &mut c, reg::MCR, mcr::DTR);
        assert!(s.input_fds().is_empty(), "RTS off and still receiving");
        assert_eq!(s.stats().overruns, 0);
    }

    #[test]
    fn interrupts_come_by_priority_and_clear_as_the_data_sheet_says() {
        let mut s = Serial::new(Line::open(&crate::serial_line::LineSpec::Null).unwrap()).unwrap();
        let mut c = ctx();
        wr(&mut s, &mut c, reg::MCR, mcr::LOOP);
        wr(
            &mut s,
            &mut c,
            reg::IIR_FCR,
            fcr::ENABLE | (2 << fcr::TRIGGER_SHIFT),
        );
        assert_eq!(rd(&mut s, &mut c, reg::IIR_FCR), iir::NONE | iir::FIFOS_ON);
        wr(&mut s, &mut c, reg::IER, ier::THRE | ier::RDA | ier::RLS);
        assert_eq!(rd(&mut s, &mut c, reg::IIR_FCR) & iir::ID_MASK, iir::THRE);
        assert_eq!(
            rd(&mut s, &mut c, reg::IIR_FCR) & iir::ID_MASK,
            iir::NONE,
            "reading IIR did not clear THRE"
        );
        // Seven bytes: below the trigger of 8, so no data interrupt until the timeout.
        for v in 0..7u8 {
            wr(&mut s, &mut c, reg::DATA, v);
        }
        assert_eq!(rd(&mut s, &mut c, reg::IIR_FCR) & iir::ID_MASK, iir::THRE);
        assert_eq!(rd(&mut s, &mut c, reg::IIR_FCR) & iir::ID_MASK, iir::NONE);
        std::thread::sleep(s.char_timeout() + Duration::from_millis(1));
        s.event(&mut c, 0);
        assert_eq!(
            rd(&mut s, &mut c, reg::IIR_FCR) & iir::ID_MASK,
            iir::TIMEOUT
        );
        assert_eq!(rd(&mut s, &mut c, reg::DATA), 0);
        assert_eq!(rd(&mut s, &mut c, reg::IIR_FCR) & iir::ID_MASK, iir::NONE);
        // Overfill the loopback FIFO: data at the trigger, and an overrun above it.
        for v in 0..20u8 {
            wr(&mut s, &mut c, reg::DATA, v);
        }
        assert_eq!(rd(&mut s, &mut c, reg::IIR_FCR) & iir::ID_MASK, iir::RLS);
        assert_eq!(rd(&mut s, &mut c, reg::LSR) & lsr::OE, lsr::OE);
        assert_eq!(rd(&mut s, &mut c, reg::IIR_FCR) & iir::ID_MASK, iir::RDA);
        assert_eq!(s.stats().overruns, 10);
    }

    #[test]
    fn loopback_ties_modem_outputs_to_inputs_and_deltas_clear_on_read() {
        let mut s = Serial::new(Line::open(&crate::serial_line::LineSpec::Null).unwrap()).unwrap();
        let mut c = ctx();
        wr(&mut s, &mut c, reg::MCR, mcr::LOOP | mcr::RTS | mcr::OUT2);
        let m = rd(&mut s, &mut c, reg::MSR);
        assert_eq!(m & (msr::CTS | msr::DCD | msr::DSR), msr::CTS | msr::DCD);
        assert_eq!(m & msr::DELTAS, msr::DCTS | msr::DDCD);
        assert_eq!(rd(&mut s, &mut c, reg::MSR) & msr::DELTAS, 0);
        // The divisor latch and the scratch register keep what is written.
        wr(&mut s, &mut c, reg::LCR, lcr::DLAB | 3);
        wr(&mut s, &mut c, reg::DATA, 0x34);
        wr(&mut s, &mut c, reg::IER, 0x12);
        assert_eq!(rd(&mut s, &mut c, reg::DATA), 0x34);
        assert_eq!(rd(&mut s, &mut c, reg::IER), 0x12);
        wr(&mut s, &mut c, reg::LCR, 3);
        wr(&mut s, &mut c, reg::SCR, 0x5a);
        assert_eq!(rd(&mut s, &mut c, reg::SCR), 0x5a);
        assert_eq!(s.divisor, 0x1234);
        // Seven data bits mask the eighth.
        wr(&mut s, &mut c, reg::LCR, 2);
        wr(&mut s, &mut c, reg::DATA, 0xff);
        assert_eq!(rd(&mut s, &mut c, reg::DATA), 0x7f);
    }

    #[test]
    fn a_backed_up_far_end_holds_the_transmitter_and_drops_cts() {
        let (a, b) = pair();
        let mut s = Serial::new(Line::stream(a).unwrap()).unwrap();
        let mut c = ctx();
        wr(&mut s, &mut c, reg::IIR_FCR, fcr::ENABLE);
        assert_eq!(rd(&mut s, &mut c, reg::MSR) & msr::CTS, msr::CTS);
        // Nobody reads `b`: fill the socket, then the FIFO stays full.
        let mut sent = 0u64;
        for _ in 0..4_000_000 {
            wr(&mut s, &mut c, reg::DATA, 1);
            if rd(&mut s, &mut c, reg::LSR) & lsr::THRE == 0 && s.tx.len() == uart::FIFO_SIZE {
                break;
            }
            sent += 1;
        }
        assert!(sent > 0 && s.tx.len() == uart::FIFO_SIZE, "never backed up");
        let m = rd(&mut s, &mut c, reg::MSR);
        assert_eq!(m & msr::CTS, 0, "CTS on while backed up");
        assert_eq!(m & msr::DCTS, msr::DCTS);
        // The far end reads: the retry drains the FIFO and CTS comes back.
        let flags = rustix::fs::fcntl_getfl(&b).unwrap();
        rustix::fs::fcntl_setfl(&b, flags | rustix::fs::OFlags::NONBLOCK).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        while rustix::io::read(&b, &mut buf).is_ok() {}
        std::thread::sleep(RETRY);
        s.event(&mut c, 0);
        assert!(s.tx.is_empty());
        assert_eq!(rd(&mut s, &mut c, reg::MSR) & msr::CTS, msr::CTS);
    }
}
