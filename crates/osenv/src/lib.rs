//! The `osenv` C interface (`include/outboard/osenv.h`) over Outboard's legacy execution model
//! (`outboard_env::legacy`): what a driver written for a uniprocessor kernel calls.
//!
//! An [`Osenv`] is one legacy driver's environment: its virtual CPU (process lock, interrupt
//! flag, handlers), its interrupt thread, and what its `osenv` calls keep (timers, memory
//! blocks, the device's DMA space). Outboard calls the driver's entry points through
//! [`Osenv::enter`]; the C calls find their driver as the calling thread's current one, since
//! they take no driver argument.
//!
//! The C functions are in [`abi`]; the variadic ones (`osenv_log`, `osenv_panic`) are C
//! (`c/varargs.c`), which formats and hands the text to Rust.

pub mod abi;
mod state;

use std::sync::Arc;

use outboard_env::legacy::{Cpu, Inside, InterruptThread};
use outboard_env::LoopError;
use outboard_hw::DmaSpace;

pub use state::{FIRST_TIMER_VECTOR, MAX_TIMERS};

/// One legacy driver's environment. Dropping it stops its interrupt thread.
pub struct Osenv {
    cpu: Arc<Cpu>,
    _interrupts: InterruptThread,
}

impl std::fmt::Debug for Osenv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Osenv").field("cpu", &self.cpu).finish()
    }
}

impl Osenv {
    /// The environment of driver `name`, whose wired memory comes from `dma` (none: a driver
    /// without a device, whose wired allocations fail).
    pub fn new(name: &str, dma: Option<DmaSpace>) -> Result<Self, LoopError> {
        let cpu = Cpu::new();
        let interrupts = InterruptThread::spawn(cpu.clone())?;
        let state = state::State::new(name, interrupts.sources(), dma);
        cpu.set_context(Box::new(state));
        Ok(Self {
            cpu,
            _interrupts: interrupts,
        })
    }

    /// Enters the driver at process level (to call one of its entry points).
    pub fn enter(&self) -> Inside {
        self.cpu.enter()
    }

    /// The driver's virtual CPU (to raise an interrupt, read delivery counts).
    pub fn cpu(&self) -> &Arc<Cpu> {
        &self.cpu
    }
}
