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
mod device;
mod state;

use std::sync::Arc;

use outboard_env::legacy::{Cpu, Inside, InterruptThread};
use outboard_env::LoopError;
use outboard_hw::{ConfigSnapshot, IrqKind, PciFunction};

pub use device::PORT_STRIDE;
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
    /// The environment of driver `name`, which has no device: its wired allocations and
    /// device accesses fail.
    pub fn new(name: &str) -> Result<Self, OsenvError> {
        Self::build(name, None)
    }

    /// The environment of driver `name` for `function`: wired memory is mapped in its DMA
    /// space, its configuration space, ports and BARs are the driver's, and its interrupt
    /// vectors (MSI-X, else MSI, else INTx; up to 48) are enabled and are the driver's vectors 0, 1, ….
    pub fn for_function(name: &str, function: PciFunction) -> Result<Self, OsenvError> {
        Self::build(name, Some(function))
    }

    /// The environment of driver `name`'s active probe: `snapshot` is its device. It reads
    /// configuration space (BAR sizing included) as the snapshot has it; configuration
    /// writes, ports, BAR registers, interrupts and wired memory are refused, so a probe
    /// changes nothing on the device (it never reaches it); timers are refused and a sleep
    /// returns at once, so it cannot arm anything that outlives it or wait for good.
    pub fn for_probe(name: &str, snapshot: ConfigSnapshot) -> Result<Self, OsenvError> {
        let cpu = Cpu::new();
        let interrupts = InterruptThread::spawn(cpu.clone())?;
        let mut state = state::State::new(
            name,
            interrupts.sources(),
            None,
            Some(device::Device::looking(snapshot)),
            Vec::new(),
        );
        state.probing = true;
        cpu.set_context(Box::new(state));
        Ok(Self {
            cpu,
            _interrupts: interrupts,
        })
    }

    fn build(name: &str, function: Option<PciFunction>) -> Result<Self, OsenvError> {
        let cpu = Cpu::new();
        let interrupts = InterruptThread::spawn(cpu.clone())?;
        let mut irqs = Vec::new();
        if let Some(f) = &function {
            let kind = [IrqKind::MsiX, IrqKind::Msi, IrqKind::Intx]
                .into_iter()
                .find(|k| f.irq_count(*k).is_ok_and(|n| n > 0));
            if let Some(kind) = kind {
                let n = f.irq_count(kind)?.min(FIRST_TIMER_VECTOR);
                irqs = f.enable_irqs(kind, n)?;
                for (v, irq) in irqs.iter().enumerate() {
                    let fd = rustix::io::dup(irq.fd()).map_err(std::io::Error::from)?;
                    interrupts.attach(fd, v as u32)?;
                }
            }
            if kind == Some(IrqKind::Intx) {
                // INTx is a level, masked as it is delivered: unmasked once the driver's
                // handlers ran, it interrupts again if the device still asserts it.
                let unmask = f.intx_unmasker();
                // A mask a dead predecessor left (delivered, never unmasked) goes first.
                if let Err(e) = unmask() {
                    tracing::warn!("osenv: cannot unmask INTx: {e}");
                }
                cpu.set_end_of_interrupt(vec![(
                    0,
                    Box::new(move || {
                        if let Err(e) = unmask() {
                            tracing::warn!("osenv: cannot unmask INTx: {e}");
                        }
                    }),
                )]);
            }
        }
        let dma = function.as_ref().map(|f| f.dma().clone());
        let state = state::State::new(
            name,
            interrupts.sources(),
            dma,
            function.map(device::Device::new),
            irqs,
        );
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

    /// Enters the driver at process level with interrupts held off until the driver enables
    /// them or the thread leaves ([`Cpu::enter_masked`]): how a class bridge calls a driver's
    /// short entry points (write, counters, settings), as a kernel's upper half calls at a
    /// raised priority.
    pub fn enter_masked(&self) -> Inside {
        self.cpu.enter_masked()
    }

    /// Gives the driver's device up after a failure, without waiting on it
    /// (`PciFunction::abandon`): true if it is certain not to reach the driver's memory any
    /// more (also when the driver has no device).
    pub fn abandon(&self) -> bool {
        self.cpu
            .context::<state::State>()
            .and_then(|s| s.device.as_ref())
            .and_then(|d| d.function())
            .is_none_or(|f| f.abandon())
    }

    /// The driver's virtual CPU (to raise an interrupt, read delivery counts).
    pub fn cpu(&self) -> &Arc<Cpu> {
        &self.cpu
    }
}

/// Why a legacy driver's environment could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum OsenvError {
    /// The interrupt thread or its sources.
    #[error(transparent)]
    Loop(#[from] LoopError),
    /// The device's interrupts.
    #[error("the device's interrupts: {0}")]
    Device(#[from] outboard_hw::HwError),
    /// Duplicating an interrupt's eventfd.
    #[error("an interrupt's eventfd: {0}")]
    Io(#[from] std::io::Error),
}
