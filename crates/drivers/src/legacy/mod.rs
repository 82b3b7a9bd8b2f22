//! Drivers written in C against `include/outboard/osenv.h`, run in the legacy execution model
//! (`outboard_osenv`): their descriptors ([`descriptor`], `include/outboard/driver.h`) and, per
//! class, the Rust driver that serves the class through the C driver's operations
//! ([`clock`], [`serial`] for the char class).
//!
//! Built in: the PCI timer's driver (`c/timer.c`, [`clock::TIMER`]) and the 16550's
//! (`c/uart16550.c`, [`serial::UART16550`]).

pub(crate) mod claim;
pub mod clock;
pub mod contender;
pub mod descriptor;
pub mod library;
pub mod probe;
pub mod serial;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use descriptor::{CDriver, DescriptorError, Model};
use outboard_env::DeviceEvent;
use outboard_hw::PciFunction;
use rustix::event::{eventfd, EventfdFlags};

use crate::personality::{Identity, Provider, StartError, StartOptions};

/// How a C driver's bridge wakes the driver server's loop: an eventfd that its side (the C
/// handler's sink, a reader thread) rings, and the device's loss descriptor.
pub(crate) struct Wakeup {
    /// Rung when something moved.
    pub bell: Arc<OwnedFd>,
    loss: Option<OwnedFd>,
}

impl Wakeup {
    /// For a driver of `function`.
    pub(crate) fn new(function: &PciFunction) -> Result<Self, String> {
        let loss = function
            .loss_fd()
            .map(|fd| rustix::io::fcntl_dupfd_cloexec(fd, 0))
            .transpose()
            .map_err(|e| format!("the device's loss descriptor: {e}"))?;
        let bell = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| format!("eventfd: {e}"))?;
        Ok(Self {
            bell: Arc::new(bell),
            loss,
        })
    }

    /// Rings `bell` (from any thread, at interrupt level too).
    pub(crate) fn ring(bell: &OwnedFd) {
        let _ = rustix::io::write(bell, &1u64.to_ne_bytes());
    }

    /// The driver's event sources: the bell as its interrupt, the loss descriptor.
    pub(crate) fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        let mut v = vec![(DeviceEvent::Interrupt(0), self.bell.as_fd())];
        if let Some(l) = &self.loss {
            v.push((DeviceEvent::Lost, l.as_fd()));
        }
        v
    }

    /// Consumes the bell's count after the loop reported it.
    pub(crate) fn drain(&self) {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&*self.bell, &mut b);
    }
}

/// A built-in C driver in the catalog: `$descriptor()` reads its descriptor once (with
/// `$read`), and the personality `$name` matches the ids the descriptor lists, probes with the
/// descriptor's probe and starts through its class's bridge ([`start_c`]).
macro_rules! builtin_c_driver {
    (
        $(#[$doc:meta])*
        $name:ident, $descriptor:ident = $read:path,
        driver: $driver:literal, class: $class:expr, score: $score:literal,
        faults: $faults:expr $(,)?
    ) => {
        /// The built-in driver's descriptor, read once.
        fn $descriptor() -> Result<&'static $crate::legacy::descriptor::CDriver, String> {
            static CELL: std::sync::OnceLock<
                Result<$crate::legacy::descriptor::CDriver, String>,
            > = std::sync::OnceLock::new();
            $crate::legacy::builtin(&CELL, $read)
        }

        $(#[$doc])*
        pub const $name: $crate::personality::Personality = {
            fn matches(id: &$crate::personality::Identity<'_>) -> bool {
                $crate::legacy::lists($descriptor(), id)
            }
            fn probe(dev: &$crate::personality::Probe<'_>, initial: u32) -> Result<u32, String> {
                $crate::legacy::probe::probe_c($descriptor()?, dev, initial)
            }
            fn start(
                p: $crate::personality::Provider,
                o: &$crate::personality::StartOptions,
            ) -> Result<Box<dyn outboard_env::AnyDriver>, $crate::personality::StartError> {
                let c = $descriptor().map_err($crate::personality::StartError::Refused)?;
                $crate::legacy::start_c($driver, c, p, o)
            }
            $crate::personality::Personality {
                driver: $driver,
                class: $class,
                score: $score,
                matches,
                probe,
                start,
                faults: $faults,
                library: None,
            }
        };

        /// The personality is what the driver's descriptor says, and its class's operations
        /// are all there.
        #[cfg(test)]
        mod $descriptor {
            #[test]
            fn is_the_personality() {
                let c = super::$descriptor().unwrap();
                assert_eq!(super::$name.driver, c.name);
                assert_eq!(super::$name.class, c.class);
                assert_eq!(super::$name.score, c.score);
                c.check_class().unwrap();
            }
        }
    };
}
pub(crate) use builtin_c_driver;

/// A built-in C driver's descriptor, read once into `cell`.
pub(crate) fn builtin(
    cell: &'static OnceLock<Result<CDriver, String>>,
    read: fn() -> Result<CDriver, DescriptorError>,
) -> Result<&'static CDriver, String> {
    cell.get_or_init(|| read().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether a C driver's descriptor lists the identity `id`.
pub(crate) fn lists(c: Result<&CDriver, String>, id: &Identity<'_>) -> bool {
    match (id, c) {
        (Identity::Pci(id), Ok(c)) => c.ids.contains(&(id.vendor, id.device)),
        _ => false,
    }
}

/// Starts C driver `c` (personality `driver`) on a device, through its class's bridge.
pub fn start_c(
    driver: &'static str,
    c: &CDriver,
    p: Provider,
    o: &StartOptions,
) -> Result<Box<dyn outboard_env::AnyDriver>, StartError> {
    let Provider::Pci(f) = p else {
        return Err(StartError::NoMatch(format!(
            "{driver} drives PCI functions"
        )));
    };
    match (c.class.as_str(), c.model) {
        (outboard_clock::CLASS, Model::Legacy) => Ok(outboard_clock::bind(
            clock::LegacyClock::start(driver, c, o, f)?,
        )),
        (outboard_clock::CLASS, Model::Native) => Ok(outboard_clock::bind(
            crate::native_c::clock::NativeCClock::start(driver, c, &o.name, f)?,
        )),
        (outboard_char::CLASS, Model::Legacy) => Ok(outboard_char::bind(
            serial::LegacyChar::start(driver, c, &o.name, f)?,
        )),
        (outboard_char::CLASS, Model::Native) => Ok(outboard_char::bind(
            crate::native_c::char::NativeCChar::start(driver, c, &o.name, f)?,
        )),
        (other, model) => Err(StartError::Refused(format!(
            "{driver}: this Outboard serves no {model:?} C driver of the {other} class"
        ))),
    }
}
