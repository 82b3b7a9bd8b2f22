//! A native C char driver behind the char class: [`NativeCChar`] starts it on its device and
//! is its work loop's side. The device's vectors are the loop's event sources; when one fires,
//! the loop's thread calls the driver's `event`, which moves bytes between the UART and the
//! driver's buffers, and the char dispatcher then reads, writes and completes what moved —
//! all on the one thread, so unlike a legacy driver's bridge there is no reader thread and no
//! cache of the counters (asking the driver for them is a call into its memory, not a device
//! access).

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use outboard_char::{CharDriver, CharInfo, LineCounters, LineSettings};
use outboard_env::{DeviceEvent, Driver, Failure, Fence};
use outboard_hw::PciFunction;

use super::run::NativeRun;
use crate::legacy::descriptor::{
    builtin_native_uart16550, CDriver, CharBell, CharSink, NativeCharOps,
};
use crate::legacy::serial::{cannot_make, counters, raw_line, settings};
use crate::personality::StartError;

/// A native C char driver, started on its device.
pub struct NativeCChar {
    run: NativeRun<NativeCharOps>,
    info: CharInfo,
    line: LineSettings,
}

impl NativeCChar {
    /// Starts native C driver `c` (personality `driver`) as serial line `name` on `function`.
    pub fn start(
        driver: &'static str,
        c: &CDriver,
        name: &str,
        function: PciFunction,
    ) -> Result<Self, StartError> {
        let ops = c
            .native_char_ops()
            .map_err(|e| StartError::Refused(format!("{driver}: {e}")))?;
        // The dispatcher looks at the driver after every call on the loop's thread, so a
        // word from the driver that something moved needs no ringing.
        let sink = CharSink::new(Arc::new(CharBell {
            moved: Box::new(|| {}),
        }));
        let (run, info) = NativeRun::start(driver, c, function, ops, sink)?;
        if info.max_baud == 0 || info.fifo == 0 {
            return Err(run.refuse(&format!(
                "the driver says the device makes {} baud with a {}-byte FIFO",
                info.max_baud, info.fifo
            )));
        }
        let Some(line) = ops.get_line().ok().and_then(|l| settings(&l)) else {
            return Err(run.refuse("the driver reports line settings it cannot have"));
        };
        Ok(Self {
            run,
            info: CharInfo {
                name: name.to_string(),
                max_baud: info.max_baud,
                fifo: info.fifo,
            },
            line,
        })
    }
}

impl Driver for NativeCChar {
    fn driver_name(&self) -> &'static str {
        self.run.driver()
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        self.run.sources()
    }

    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure> {
        self.run.handle(event).map(drop)
    }

    fn abandon(&mut self) -> Fence {
        self.run.abandon()
    }
}

impl CharDriver for NativeCChar {
    fn info(&self) -> &CharInfo {
        &self.info
    }

    fn write(&mut self, bytes: &[u8]) -> Result<usize, Failure> {
        self.run
            .ops()?
            .write(bytes)
            .map_err(|rc| self.run.failed("write", rc))
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<usize, Failure> {
        self.run
            .ops()?
            .read(buf)
            .map_err(|rc| self.run.failed("read", rc))
    }

    fn line(&self) -> LineSettings {
        self.line
    }

    fn set_line(&mut self, line: &LineSettings) -> Result<Result<(), String>, Failure> {
        match self.run.ops()?.set_line(&raw_line(line)) {
            Ok(()) => {
                self.line = *line;
                Ok(Ok(()))
            }
            Err(super::device::EINVAL) => Ok(Err(cannot_make(line, self.info.max_baud))),
            Err(rc) => Err(self.run.failed("line setting", rc)),
        }
    }

    fn counters(&self) -> LineCounters {
        self.status().0
    }

    fn held(&self) -> bool {
        self.status().1
    }
}

impl NativeCChar {
    /// The counters and whether sending is held, from the driver (nothing once it is given
    /// up).
    fn status(&self) -> (LineCounters, bool) {
        let Ok(ops) = self.run.ops() else {
            return (LineCounters::default(), false);
        };
        let c = ops.counters();
        (counters(&c), c.held != 0)
    }
}

impl std::fmt::Debug for NativeCChar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeCChar")
            .field("driver", &self.run.driver())
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

crate::legacy::builtin_c_driver! {
    /// The 16550's native C driver (`c/native_uart16550.c`): bids below the legacy C driver,
    /// so it drives a serial line when named (`driver-host --driver tty0=native-c-uart16550`)
    /// or as a library built with a higher score.
    NATIVE_C_UART16550, native_uart = builtin_native_uart16550,
    driver: "native-c-uart16550", class: outboard_char::CLASS, score: 800,
    faults: &[],
}
