//! Drivers written in C in the native model (`include/outboard/native.h`): the driver server's
//! work loop calls them, one call at a time, on its thread — no `osenv`, no process lock, no
//! interrupt thread. Their device calls (`outboard_dev_*`) are in [`abi`] over a
//! [`device::NativeDevice`]; the class bridges are [`clock`] and [`char`].
//!
//! Built in: the PCI timer's native C driver (`c/native_timer.c`, [`clock::NATIVE_C_TIMER`])
//! and the 16550's (`c/native_uart16550.c`, [`char::NATIVE_C_UART16550`]).

pub mod abi;
pub mod char;
pub mod clock;
pub mod device;
mod run;
