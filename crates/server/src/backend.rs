//! What the driver host needs from a block driver: the block class's view of one device.

use std::any::Any;
use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use outboard_class::{BlockError, BlockInfo, BlockOp, BlockRequest};
use outboard_shm::SharedMem;

use crate::blockhost::BlockHost;

/// Opens a device again from scratch (see [`crate::recovery`]).
pub type Reopen = Arc<dyn Fn() -> Result<Box<dyn BlockBackend>, String> + Send + Sync>;

/// A block device the host can serve: a driver instance, or the null device.
pub trait BlockBackend: Send {
    /// Class status.
    fn info(&self) -> &BlockInfo;
    /// Whether another request fits now.
    fn has_room(&self) -> bool;
    /// Requests submitted and not yet reaped.
    fn in_flight(&self) -> usize;
    /// Submits a validated request whose buffer area starts at device address `iova_base`.
    fn submit(&mut self, r: &BlockRequest, iova_base: u64, tag: u64) -> Result<(), BlockError>;
    /// Publishes submitted requests.
    fn kick(&mut self) -> Result<(), BlockError>;
    /// Reaps `(tag, result)` completions.
    fn poll(&mut self, out: &mut Vec<(u64, Result<u32, BlockError>)>) -> Result<usize, BlockError>;
    /// Arms the completion interrupt; true if completions are already waiting.
    fn arm(&mut self) -> Result<bool, BlockError>;
    /// Acknowledges the completion interrupt.
    fn ack(&mut self) -> Result<(), BlockError>;
    /// The completion interrupts (one per queue in use; none for a device without).
    fn irq_fds(&self) -> Vec<BorrowedFd<'_>>;
    /// Readable or hung up when the device is lost (see `PciFunction::loss_fd`).
    fn loss_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// Gives the device up after a failure: it must stop reaching session memory.
    fn abandon(&mut self) {}
    /// The interrupt that signals a configuration change or a device in trouble.
    fn config_irq_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// After a configuration interrupt: why the device can no longer work, if it cannot.
    fn check_health(&mut self) -> Result<(), String> {
        Ok(())
    }
    /// How to open this device again after it failed, if it can be.
    fn reopener(&self) -> Option<Reopen> {
        None
    }
    /// Maps a session's buffer area into the device's DMA space: its base address and a guard
    /// that unmaps it when dropped.
    fn map_buffers(&self, mem: Arc<SharedMem>) -> Result<(u64, Box<dyn Any + Send>), BlockError>;
}

impl BlockBackend for BlockHost {
    fn info(&self) -> &BlockInfo {
        BlockHost::info(self)
    }
    fn has_room(&self) -> bool {
        BlockHost::has_room(self)
    }
    fn in_flight(&self) -> usize {
        BlockHost::in_flight(self)
    }
    fn submit(&mut self, r: &BlockRequest, iova_base: u64, tag: u64) -> Result<(), BlockError> {
        BlockHost::submit(self, r, iova_base, tag)
    }
    fn kick(&mut self) -> Result<(), BlockError> {
        BlockHost::kick(self)
    }
    fn poll(&mut self, out: &mut Vec<(u64, Result<u32, BlockError>)>) -> Result<usize, BlockError> {
        BlockHost::poll(self, out)
    }
    fn arm(&mut self) -> Result<bool, BlockError> {
        BlockHost::arm(self)
    }
    fn ack(&mut self) -> Result<(), BlockError> {
        BlockHost::ack(self)
    }
    fn irq_fds(&self) -> Vec<BorrowedFd<'_>> {
        let mut fds: Vec<BorrowedFd<'_>> = (0..self.queues())
            .filter_map(|q| self.driver().irq(q).map(|i| i.fd()))
            .collect();
        // Queues may share a vector (INTx): one registration each.
        fds.dedup_by_key(|f| std::os::fd::AsRawFd::as_raw_fd(f));
        fds
    }
    fn loss_fd(&self) -> Option<BorrowedFd<'_>> {
        self.driver().function().loss_fd()
    }
    fn abandon(&mut self) {
        self.driver().function().abandon()
    }
    fn config_irq_fd(&self) -> Option<BorrowedFd<'_>> {
        self.driver().config_irq().map(|i| i.fd())
    }
    fn reopener(&self) -> Option<Reopen> {
        let (name, spec, queues) = self.origin()?.clone();
        Some(Arc::new(move || {
            BlockHost::open(&name, &spec, queues)
                .map(|h| Box::new(h) as Box<dyn BlockBackend>)
                .map_err(|e| e.to_string())
        }))
    }
    fn check_health(&mut self) -> Result<(), String> {
        if let Some(i) = self.driver().config_irq() {
            i.ack();
        }
        match self.driver().needs_reset() {
            Ok(false) => Ok(()),
            Ok(true) => Err(outboard_drivers::virtio_blk::NEEDS_RESET.into()),
            Err(e) => Err(format!("its status cannot be read: {e}")),
        }
    }
    fn map_buffers(&self, mem: Arc<SharedMem>) -> Result<(u64, Box<dyn Any + Send>), BlockError> {
        let dma = self
            .driver()
            .function()
            .dma()
            .map_shared(mem)
            .map_err(|e| BlockError::Protocol(e.to_string()))?;
        Ok((dma.iova(), Box::new(dma)))
    }
}

/// The null block device: completes every request at once without moving data. It measures
/// the cost of the session path alone (the evaluation's `ipc-only` configuration).
#[derive(Debug)]
pub struct NullBlock {
    info: BlockInfo,
    done: VecDeque<(u64, Result<u32, BlockError>)>,
    staged: usize,
}

impl NullBlock {
    /// A null disk of `bytes` bytes in 512-byte blocks.
    pub fn new(name: &str, bytes: u64) -> Self {
        Self {
            info: BlockInfo {
                name: name.into(),
                capacity: bytes / 512,
                block_size: 512,
                read_only: false,
                queue_depth: 256,
            },
            done: VecDeque::new(),
            staged: 0,
        }
    }
}

impl BlockBackend for NullBlock {
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn has_room(&self) -> bool {
        self.done.len() < self.info.queue_depth as usize
    }
    fn in_flight(&self) -> usize {
        self.done.len()
    }
    fn submit(&mut self, r: &BlockRequest, _iova_base: u64, tag: u64) -> Result<(), BlockError> {
        let bytes = match r.op {
            BlockOp::Read | BlockOp::Write => r.blocks * self.info.block_size,
            _ => 0,
        };
        self.done.push_back((tag, Ok(bytes)));
        self.staged += 1;
        Ok(())
    }
    fn kick(&mut self) -> Result<(), BlockError> {
        self.staged = 0;
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<(u64, Result<u32, BlockError>)>) -> Result<usize, BlockError> {
        let n = self.done.len();
        out.extend(self.done.drain(..));
        Ok(n)
    }
    fn arm(&mut self) -> Result<bool, BlockError> {
        Ok(!self.done.is_empty())
    }
    fn ack(&mut self) -> Result<(), BlockError> {
        Ok(())
    }
    fn irq_fds(&self) -> Vec<BorrowedFd<'_>> {
        Vec::new()
    }
    fn map_buffers(&self, _mem: Arc<SharedMem>) -> Result<(u64, Box<dyn Any + Send>), BlockError> {
        Ok((0, Box::new(())))
    }
}
