//! The null block driver: a virtual device that completes every request at once without
//! moving data. It measures the cost of the session path alone (the evaluation's `ipc-only`
//! configuration), and it is the smallest complete example of the driver contract: no
//! hardware, no interrupts, no DMA.

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;

use outboard_block::{BlockDriver, BlockError, BlockInfo, BlockOp, BlockRequest};
use outboard_env::{DeviceEvent, Driver, Failure};

/// The null disk.
#[derive(Debug)]
pub struct NullBlock {
    info: BlockInfo,
    done: VecDeque<(u64, Result<u32, BlockError>)>,
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
                max_transfer: 0,
                supports: Default::default(),
            },
            done: VecDeque::new(),
        }
    }
}

impl Driver for NullBlock {
    fn driver_name(&self) -> &'static str {
        "null-blk"
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        Vec::new()
    }

    fn handle(&mut self, _event: DeviceEvent) -> Result<(), Failure> {
        Ok(())
    }
}

impl BlockDriver for NullBlock {
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
        Ok(())
    }

    fn kick(&mut self) -> Result<(), Failure> {
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<(u64, Result<u32, BlockError>)>) -> Result<usize, Failure> {
        let n = self.done.len();
        out.extend(self.done.drain(..));
        Ok(n)
    }

    fn arm(&mut self) -> Result<bool, Failure> {
        Ok(!self.done.is_empty())
    }
}
