//! A C serial driver behind the char class: [`LegacyChar`] starts the driver in its legacy
//! environment on the device and serves its line.
//!
//! Two threads use the driver, as in a uniprocessor kernel: the driver server's loop, which
//! writes, reads what has been received, and sets the line, never waiting; and a reader
//! thread of the bridge, which sleeps inside the driver's `read` (`osenv_sleep`, the process
//! lock released) until the interrupt handler wakes it, and moves what it read into a bounded
//! queue. The handler's sink and the reader both ring an eventfd, the driver's source in the
//! server's loop. While the queue is full the reader stops reading, the driver's own ring fills,
//! and the driver applies its flow control.

use std::collections::VecDeque;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use outboard_char::{CharDriver, CharInfo, LineCounters, LineSettings};
use outboard_env::legacy::Cpu;
use outboard_env::{DeviceEvent, Driver, Failure, Fence};
use outboard_hw::PciFunction;
use outboard_osenv::Osenv;

use super::claim::Claim;
use super::descriptor::{
    builtin_uart16550, CDriver, CharBell, CharOps, CharSink, RawCharCounters, RawLine,
};
use crate::personality::StartError;

/// Bytes the reader thread holds for the loop at most.
const QUEUE: usize = 4096;
/// How long stopping waits for the reader thread to leave the driver.
const STOP_PATIENCE: Duration = Duration::from_secs(5);

/// What the reader thread hands the loop.
struct Received {
    bytes: Mutex<VecDeque<u8>>,
    /// Signalled when the loop took bytes (room for the reader again).
    room: Condvar,
    stop: AtomicBool,
    /// Why the reader stopped, if it stopped on its own (the driver's read failed).
    failed: Mutex<Option<String>>,
}

/// A C serial driver, started on its device.
pub struct LegacyChar {
    // Stopped and dropped first (see `stop`): the reader leaves the driver, then the
    // interrupt thread stops, then the sink goes and the code is free again.
    osenv: Option<Osenv>,
    reader: Option<std::thread::JoinHandle<()>>,
    claim: Option<Claim>,
    sink: Option<CharSink>,
    /// The sink was kept alive for a reader that never left the driver.
    sink_kept: bool,
    received: Arc<Received>,
    wake: super::Wakeup,
    ops: CharOps,
    info: CharInfo,
    line: LineSettings,
    driver: &'static str,
    /// Times the driver said something moved (its sink was called).
    moves: Arc<AtomicU64>,
    /// The counters and whether sending is held, as of a count of moves: read again only
    /// after the driver said something moved, or after a write or new settings. Each read
    /// enters the driver, which waits for its interrupts; a server's loop asks every turn.
    known: Mutex<Option<(u64, LineCounters, bool)>>,
}

/// Settings as a C driver takes them.
pub(crate) fn raw_line(l: &LineSettings) -> RawLine {
    let w = outboard_char::LineLayout::of(l);
    RawLine {
        baud: w.baud.get(),
        data_bits: w.data_bits,
        parity: w.parity,
        stop_bits: w.stop_bits,
        flow: w.flow,
    }
}

/// Settings a C driver reports, if a line can have them.
pub(crate) fn settings(r: &RawLine) -> Option<LineSettings> {
    outboard_char::LineLayout {
        baud: r.baud.into(),
        data_bits: r.data_bits,
        parity: r.parity,
        stop_bits: r.stop_bits,
        flow: r.flow,
    }
    .settings()
    .ok()
}

/// Why a C driver refused settings (`EINVAL` from its `set_line`).
pub(crate) fn cannot_make(line: &LineSettings, max_baud: u32) -> String {
    format!("the device cannot make {line} (its rates are {max_baud} divided by a whole number)")
}

/// The class's counters from a C driver's.
pub(crate) fn counters(c: &RawCharCounters) -> LineCounters {
    LineCounters {
        sent: c.sent,
        received: c.received,
        dropped: c.dropped,
        overruns: c.overruns,
        errors: c.errors,
        modem: c.modem,
    }
}

/// The reader thread: sleeps in the driver's read until bytes come, queues them, rings.
fn read_loop(cpu: Arc<Cpu>, ops: CharOps, received: Arc<Received>, bell: Arc<OwnedFd>) {
    let mut buf = vec![0u8; QUEUE];
    loop {
        let room = {
            let mut q = received.bytes.lock().unwrap_or_else(|p| p.into_inner());
            while q.len() >= QUEUE && !received.stop.load(Ordering::Acquire) {
                q = received
                    .room
                    .wait_timeout(q, Duration::from_millis(100))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            QUEUE - q.len()
        };
        if received.stop.load(Ordering::Acquire) {
            return;
        }
        let got = {
            let _inside = cpu.enter_masked();
            ops.read(&mut buf[..room], true)
        };
        match got {
            Ok(0) => {}
            Ok(n) => {
                received
                    .bytes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend(&buf[..n]);
                super::Wakeup::ring(&bell);
            }
            Err(rc) => {
                if !received.stop.load(Ordering::Acquire) {
                    *received.failed.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(format!("the driver's read failed (error {rc})"));
                    super::Wakeup::ring(&bell);
                }
                return;
            }
        }
    }
}

impl LegacyChar {
    /// Starts the C driver `c` (personality `driver`) as serial line `name` on `function`.
    pub fn start(
        driver: &'static str,
        c: &CDriver,
        name: &str,
        function: PciFunction,
    ) -> Result<Self, StartError> {
        let refused = |why: String| StartError::Refused(format!("{driver}: {why}"));
        let ops = c.char_ops().map_err(|e| refused(e.to_string()))?;
        let claim = Claim::take(c, driver)?;
        let wake = super::Wakeup::new(&function).map_err(refused)?;
        let rung = wake.bell.clone();
        let moves = Arc::new(AtomicU64::new(0));
        let counted = moves.clone();
        let sink = CharSink::new(Arc::new(CharBell {
            moved: Box::new(move || {
                counted.fetch_add(1, Ordering::AcqRel);
                super::Wakeup::ring(&rung)
            }),
        }));
        let osenv = Osenv::for_function(driver, function).map_err(|e| refused(e.to_string()))?;
        let (info, line) = {
            let _inside = osenv.enter();
            let info = ops
                .start(&sink)
                .map_err(|rc| refused(format!("the driver did not start (error {rc})")))?;
            (info, ops.get_line())
        };
        // Started: from here a refusal stops the driver first (its interrupts off, its
        // device quiet) before its code is free again.
        let stop_then = |why: String| {
            let _inside = osenv.enter();
            ops.stop();
            refused(why)
        };
        let line = line
            .ok()
            .and_then(|l| settings(&l))
            .ok_or_else(|| stop_then("the driver reports line settings it cannot have".into()))?;
        if info.max_baud == 0 || info.fifo == 0 {
            return Err(stop_then(format!(
                "the driver says the device makes {} baud with a {}-byte FIFO",
                info.max_baud, info.fifo
            )));
        }
        let received = Arc::new(Received {
            bytes: Mutex::new(VecDeque::new()),
            room: Condvar::new(),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
        });
        let reader = {
            let (cpu, r, b) = (osenv.cpu().clone(), received.clone(), wake.bell.clone());
            std::thread::Builder::new()
                .name("osenv-reader".into())
                .spawn(move || read_loop(cpu, ops, r, b))
                .map_err(|e| stop_then(format!("the reader thread: {e}")))?
        };
        Ok(Self {
            osenv: Some(osenv),
            reader: Some(reader),
            claim: Some(claim),
            sink: Some(sink),
            sink_kept: false,
            received,
            wake,
            ops,
            info: CharInfo {
                name: name.to_string(),
                max_baud: info.max_baud,
                fifo: info.fifo,
            },
            line,
            driver,
            moves,
            known: Mutex::new(None),
        })
    }

    /// The counters and whether sending is held: from the driver if something moved since
    /// they were last read, else as they were.
    fn status(&self) -> (LineCounters, bool) {
        let Ok(osenv) = self.osenv() else {
            return (LineCounters::default(), false);
        };
        // Counted before reading: a move while the driver is read makes the next call read
        // again.
        let moves = self.moves.load(Ordering::Acquire);
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, c, held)) = *known {
            if at == moves {
                return (c, held);
            }
        }
        let c = {
            let _inside = osenv.enter_masked();
            self.ops.counters()
        };
        let now = counters(&c);
        *known = Some((moves, now, c.held != 0));
        (now, c.held != 0)
    }

    /// What the driver was given changes its status: the next read of it enters the driver.
    fn forget_status(&self) {
        *self.known.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn osenv(&self) -> Result<&Osenv, Failure> {
        self.osenv
            .as_ref()
            .ok_or_else(|| Failure::Driver("the driver was given up".into()))
    }

    /// Stops the driver: its reader woken and gone, its environment (and interrupt thread)
    /// ended, its code free for another device. True if the reader left in time (else the
    /// environment is left to the process's end, as the reader may still be inside).
    fn stop(&mut self) -> bool {
        let Some(osenv) = self.osenv.take() else {
            return true;
        };
        self.received.stop.store(true, Ordering::Release);
        self.received.room.notify_all();
        {
            let _inside = osenv.enter();
            self.ops.stop();
        }
        let left = match self.reader.take() {
            None => true,
            Some(h) => {
                let deadline = std::time::Instant::now() + STOP_PATIENCE;
                while !h.is_finished() && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let done = h.is_finished();
                if done {
                    let _ = h.join();
                }
                done
            }
        };
        if left {
            drop(osenv);
            self.claim = None;
        } else {
            // A thread may still be inside the C code: its environment, its code's claim and
            // the sink it reports to stay as they are, for the rest of the process.
            tracing::error!("{}: the reader did not leave the driver", self.driver);
            std::mem::forget(osenv);
            std::mem::forget(self.claim.take());
            self.sink_kept = true;
        }
        left
    }
}

impl Drop for LegacyChar {
    fn drop(&mut self) {
        self.stop();
        if self.sink_kept {
            std::mem::forget(self.sink.take());
        }
    }
}

impl Driver for LegacyChar {
    fn driver_name(&self) -> &'static str {
        self.driver
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        self.wake.sources()
    }

    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure> {
        if let DeviceEvent::Lost = event {
            return Err(Failure::Lost);
        }
        self.wake.drain();
        match self
            .received
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            Some(why) => Err(Failure::Driver(why)),
            None => Ok(()),
        }
    }

    fn abandon(&mut self) -> Fence {
        // The device is given up: the driver stops, its code free for the next driver.
        let certain = self.osenv.as_ref().is_none_or(Osenv::abandon);
        self.stop();
        if certain {
            Fence::Now
        } else {
            Fence::AtReopen
        }
    }
}

impl CharDriver for LegacyChar {
    fn info(&self) -> &CharInfo {
        &self.info
    }

    fn write(&mut self, bytes: &[u8]) -> Result<usize, Failure> {
        let osenv = self.osenv()?;
        self.forget_status();
        let _inside = osenv.enter_masked();
        self.ops
            .write(bytes)
            .map_err(|rc| Failure::Driver(format!("the driver's write failed (error {rc})")))
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<usize, Failure> {
        let mut q = self
            .received
            .bytes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let n = buf.len().min(q.len());
        for (b, v) in buf.iter_mut().zip(q.drain(..n)) {
            *b = v;
        }
        if n > 0 {
            self.received.room.notify_one();
        }
        Ok(n)
    }

    fn line(&self) -> LineSettings {
        self.line
    }

    fn set_line(&mut self, line: &LineSettings) -> Result<Result<(), String>, Failure> {
        let osenv = self.osenv()?;
        self.forget_status();
        let set = {
            let _inside = osenv.enter_masked();
            self.ops.set_line(&raw_line(line))
        };
        match set {
            Ok(()) => {
                self.line = *line;
                Ok(Ok(()))
            }
            Err(rc) if rc == outboard_osenv::abi::EINVAL => {
                Ok(Err(cannot_make(line, self.info.max_baud)))
            }
            Err(rc) => Err(Failure::Driver(format!(
                "the driver could not set the line (error {rc})"
            ))),
        }
    }

    fn counters(&self) -> LineCounters {
        self.status().0
    }

    fn held(&self) -> bool {
        self.status().1
    }
}

impl std::fmt::Debug for LegacyChar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LegacyChar")
            .field("driver", &self.driver)
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

super::builtin_c_driver! {
    /// The 16550's C driver (`c/uart16550.c`), in the catalog like any built-in driver; its
    /// identities come from its descriptor.
    UART16550, uart = builtin_uart16550,
    driver: "uart16550", class: outboard_char::CLASS, score: 1000,
    faults: &[],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_cross_the_c_boundary_unchanged() {
        let l: LineSettings = "19200,7O2,rtscts".parse().unwrap();
        assert_eq!(settings(&raw_line(&l)), Some(l));
    }
}
