//! Drivers written in C against `include/outboard/osenv.h`, run in the legacy execution model
//! (`outboard_osenv`): their descriptors ([`descriptor`], `include/outboard/driver.h`) and, per
//! class, the Rust driver that serves the class through the C driver's operations
//! ([`clock`], [`serial`] for the char class).
//!
//! Built in: the PCI timer's driver (`c/timer.c`, [`clock::TIMER`]) and the 16550's
//! (`c/uart16550.c`, [`serial::UART16550`]).

mod claim;
pub mod clock;
pub mod descriptor;
pub mod library;
pub mod serial;

use descriptor::CDriver;

use crate::personality::{Provider, StartError, StartOptions};

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
    match c.class.as_str() {
        outboard_clock::CLASS => Ok(outboard_clock::bind(clock::LegacyClock::start(
            driver, c, &o.name, f,
        )?)),
        outboard_char::CLASS => Ok(outboard_char::bind(serial::LegacyChar::start(
            driver, c, &o.name, f,
        )?)),
        other => Err(StartError::Refused(format!(
            "{driver}: this Outboard serves no C driver of the {other} class"
        ))),
    }
}
