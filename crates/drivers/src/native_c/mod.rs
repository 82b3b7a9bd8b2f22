//! Drivers written in C in the native model (`include/outboard/native.h`): the driver server's
//! work loop calls them, one call at a time, on its thread — no `osenv`, no process lock, no
//! interrupt thread. Their device calls (`outboard_dev_*`) are in [`abi`] over a
//! [`device::NativeDevice`]; the class bridge is [`clock`] (the clock class; char drivers in C
//! are legacy drivers).
//!
//! Built in: the PCI timer's native C driver (`c/native_timer.c`, [`clock::NATIVE_C_TIMER`]).

pub mod abi;
pub mod clock;
pub mod device;
