//! Drivers written in C against `include/outboard/osenv.h`, run in the legacy execution model
//! (`outboard_osenv`): their descriptors ([`descriptor`], `include/outboard/driver.h`) and, per
//! class, the Rust driver that serves the class through the C driver's operations
//! ([`clock`]).
//!
//! Built in: the PCI timer's driver (`c/timer.c`, [`clock::TIMER`]).

pub mod clock;
pub mod descriptor;
pub mod library;
