//! What one legacy driver's `osenv` calls keep: its C handlers (to find the one
//! `osenv_irq_free` names), its timers, its memory blocks and its device's DMA space.
//!
//! Changed only by the driver's process-lock holder with interrupts held off (the C calls
//! take care of that), so the locks here are never contended by a handler interrupting their
//! holder.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use outboard_env::legacy::{SourceKey, Sources};
use outboard_hw::{DmaBuf, DmaSpace, Irq};

use crate::device::Device;

/// The first vector timers use: 0-47 are the device's.
pub const FIRST_TIMER_VECTOR: u32 = 48;
/// Timers a driver may have at once (vectors 48-63).
pub const MAX_TIMERS: usize = 16;

/// A C handler registered on a vector, as `osenv_irq_free` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CHandler {
    pub vector: u32,
    pub func: usize,
    pub data: usize,
    pub id: u64,
}

/// A registered timer.
#[derive(Debug)]
pub(crate) struct TimerReg {
    pub func: usize,
    pub freq: i32,
    pub vector: u32,
    pub handler: u64,
    pub source: SourceKey,
}

/// A block `osenv_mem_alloc` returned.
pub(crate) enum Block {
    /// From the process heap.
    Heap(Layout),
    /// DMA memory the device reaches at the buffer's IOVA.
    Wired(DmaBuf),
}

pub(crate) struct State {
    pub name: String,
    pub sources: Arc<Sources>,
    pub dma: Option<DmaSpace>,
    /// The driver's device, if it has one, and its interrupt vectors (kept enabled).
    pub device: Option<Device>,
    pub irqs: Vec<Irq>,
    pub handlers: Mutex<Vec<CHandler>>,
    pub timers: Mutex<Vec<TimerReg>>,
    /// Blocks by address.
    pub blocks: Mutex<BTreeMap<usize, Block>>,
    /// An active probe's environment: it may not sleep or arm timers (nothing would end them).
    pub probing: bool,
}

impl State {
    pub fn new(
        name: &str,
        sources: Arc<Sources>,
        dma: Option<DmaSpace>,
        device: Option<Device>,
        irqs: Vec<Irq>,
    ) -> Self {
        Self {
            name: name.to_string(),
            sources,
            dma,
            device,
            irqs,
            handlers: Mutex::new(Vec::new()),
            timers: Mutex::new(Vec::new()),
            blocks: Mutex::new(BTreeMap::new()),
            probing: false,
        }
    }

    /// The device address of `va` if it lies in a wired block.
    pub fn phys(&self, va: usize) -> Option<u64> {
        let blocks = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        let (&start, block) = blocks.range(..=va).next_back()?;
        match block {
            Block::Wired(buf) => {
                let offset = (va - start) as u64;
                (offset < buf.size()).then(|| buf.iova() + offset)
            }
            Block::Heap(_) => None,
        }
    }
}
