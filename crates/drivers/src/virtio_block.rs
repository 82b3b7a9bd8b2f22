//! The block class on top of the virtio-blk chip driver: generic class requests in, chip
//! requests out (Mach's split between class code and chip code), spread over the device's
//! queues.

use std::os::fd::BorrowedFd;

use outboard_block::{BlockDriver, BlockError, BlockInfo, BlockOp, BlockRequest};
use outboard_env::{DeviceEvent, Driver, Failure, Fence};
use outboard_spec::virtio_blk::feature;

use crate::virtio_blk::{BlkCompletion, BlkError, BlkOp, BlkRequestRef, VirtioBlk, MAX_SEGMENTS};

/// A block device published from a virtio-blk driver instance, its requests spread over the
/// device's queues.
pub struct VirtioBlock {
    driver: VirtioBlk,
    info: BlockInfo,
    sectors_per_block: u64,
    /// The device queues the driver set up; requests are spread over all of them.
    queues: usize,
    /// Where the next request's search for a queue with room starts (round robin).
    next_queue: usize,
    /// Requests sent down each queue (for status and tests).
    per_queue: Vec<u64>,
    completions: Vec<BlkCompletion>,
    /// Fault injection: abort the process when a request touches this sector.
    abort_on: Option<u64>,
}

impl std::fmt::Debug for VirtioBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioBlock")
            .field("info", &self.info)
            .finish()
    }
}

/// Maps a driver error to the class's error.
pub fn class_error(e: BlkError) -> BlockError {
    match e {
        BlkError::OutOfRange { .. } => BlockError::OutOfRange,
        BlkError::ReadOnly => BlockError::ReadOnly,
        BlkError::Invalid(m) => BlockError::Invalid(m),
        BlkError::Unsupported(_) => BlockError::Unsupported,
        BlkError::Io => BlockError::Io("the device answered VIRTIO_BLK_S_IOERR".into()),
        BlkError::QueueFull => BlockError::QueueFull,
        BlkError::Timeout => BlockError::Timeout,
        BlkError::Device(why) => BlockError::DeviceFailed(why),
    }
}

impl VirtioBlock {
    /// Cuts `bytes` at device address `at` into segments no longer than the device's
    /// SIZE_MAX, in `out`; refuses a transfer that needs more segments than it takes.
    fn segments<'s>(
        &self,
        at: u64,
        bytes: u64,
        out: &'s mut [(u64, u32); MAX_SEGMENTS],
    ) -> Result<&'s [(u64, u32)], BlockError> {
        let d = self.driver.info();
        let max = d.size_max as u64;
        let n = bytes.div_ceil(max) as usize;
        if bytes == 0 || n > d.segments as usize {
            return Err(BlockError::Invalid(format!(
                "{bytes} bytes in one request: the device takes at most {}",
                d.max_transfer()
            )));
        }
        for (i, seg) in out[..n].iter_mut().enumerate() {
            let off = i as u64 * max;
            *seg = (at + off, (bytes - off).min(max) as u32);
        }
        Ok(&out[..n])
    }

    /// Wraps a driver instance.
    pub fn new(name: &str, driver: VirtioBlk) -> Self {
        let d = driver.info();
        let info = BlockInfo {
            name: name.into(),
            capacity: d.capacity * 512 / d.block_size as u64,
            block_size: d.block_size,
            read_only: d.read_only,
            queue_depth: d.queue_size as u32 * d.queues.max(1) as u32,
            max_transfer: d.max_transfer(),
            supports: outboard_block::Supports {
                flush: d.features & feature::FLUSH != 0,
                discard: d.features & feature::DISCARD != 0,
                write_zeroes: d.features & feature::WRITE_ZEROES != 0,
            },
        };
        Self {
            sectors_per_block: d.block_size as u64 / 512,
            queues: d.queues.max(1) as usize,
            next_queue: 0,
            per_queue: vec![0; d.queues.max(1) as usize],
            driver,
            info,
            completions: Vec::new(),
            abort_on: None,
        }
    }

    /// Aborts the process whenever a request touches `sector` (fault injection: a request
    /// that kills its driver every time).
    pub fn abort_on(mut self, sector: Option<u64>) -> Self {
        self.abort_on = sector;
        self
    }

    /// The environment of this driver's device (its DMA space).
    pub fn env(&self) -> outboard_env::DeviceEnv {
        outboard_env::DeviceEnv::for_function(self.driver.function())
    }

    /// The chip driver.
    pub fn driver(&self) -> &VirtioBlk {
        &self.driver
    }

    /// The device queues in use.
    pub fn queues(&self) -> usize {
        self.queues
    }

    /// Requests sent down each queue so far.
    pub fn requests_per_queue(&self) -> &[u64] {
        &self.per_queue
    }

    /// The next queue, round robin, that has room for a request of `bufs` buffers.
    fn pick_queue(&mut self, bufs: usize) -> Result<usize, BlockError> {
        for i in 0..self.queues {
            let q = (self.next_queue + i) % self.queues;
            if self.driver.has_room(q, bufs) {
                self.next_queue = (q + 1) % self.queues;
                return Ok(q);
            }
        }
        Err(BlockError::QueueFull)
    }

    /// Moves the driver's completions to `out` in the class's terms.
    fn hand_over(&mut self, out: &mut Vec<(u64, Result<u32, BlockError>)>) -> usize {
        let n = self.completions.len();
        out.extend(self.completions.drain(..).map(|c| {
            let result = c.result.map(|b| b as u32).map_err(|e| match e {
                // One request the device botched (a short transfer, no status): that request
                // failed in the device; the device itself goes on. (`DeviceFailed` means the
                // device was given up.)
                BlkError::Device(why) => {
                    tracing::warn!("request {}: {why}", c.tag);
                    BlockError::Io(why)
                }
                e => class_error(e),
            });
            (c.tag, result)
        }));
        n
    }
}

impl Driver for VirtioBlock {
    fn driver_name(&self) -> &'static str {
        "virtio-blk"
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        self.driver.sources()
    }

    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure> {
        self.driver.handle_event(event)
    }

    fn abandon(&mut self) -> Fence {
        if self.driver.function().abandon() {
            Fence::Now
        } else {
            Fence::AtReopen
        }
    }
}

/// A chip error that stops the whole device (rather than one request).
fn failure(e: BlkError) -> Failure {
    Failure::Driver(e.to_string())
}

impl BlockDriver for VirtioBlock {
    fn info(&self) -> &BlockInfo {
        &self.info
    }

    fn has_room(&self) -> bool {
        (0..self.queues).any(|q| self.driver.has_room(q, 1))
    }

    fn in_flight(&self) -> usize {
        (0..self.queues).map(|q| self.driver.in_flight(q)).sum()
    }

    fn submit(&mut self, r: &BlockRequest, iova_base: u64, tag: u64) -> Result<(), BlockError> {
        let bytes = r.blocks as u64 * self.info.block_size as u64;
        let sector = r.lba * self.sectors_per_block;
        if let Some(s) = self.abort_on {
            if (sector..sector + r.blocks as u64 * self.sectors_per_block).contains(&s) {
                eprintln!("outboard: injected driver fault: a request touched sector {s}: abort");
                std::process::abort();
            }
        }
        let sectors = || {
            u32::try_from(r.blocks as u64 * self.sectors_per_block)
                .map_err(|_| BlockError::OutOfRange)
        };
        // The data buffer, cut into segments the device takes, lives on the stack: nothing is
        // allocated per request.
        let mut segments = [(0u64, 0u32); MAX_SEGMENTS];
        let data = if r.op.has_data() {
            self.segments(iova_base + r.buf_offset, bytes, &mut segments)?
        } else {
            &[]
        };
        let (op, bufs): (BlkOp, &[(u64, u32)]) = match r.op {
            BlockOp::Read => (BlkOp::Read, data),
            BlockOp::Write => (BlkOp::Write, data),
            BlockOp::Flush => (BlkOp::Flush, &[]),
            BlockOp::Discard => (
                BlkOp::Discard {
                    sectors: sectors()?,
                },
                &[],
            ),
            BlockOp::WriteZeroes => (
                BlkOp::WriteZeroes {
                    sectors: sectors()?,
                },
                &[],
            ),
            BlockOp::Null | BlockOp::Lock | BlockOp::Unlock => {
                return Err(BlockError::Invalid(
                    "null, lock and unlock requests are answered by the host".into(),
                ))
            }
        };
        if bytes > u32::MAX as u64 {
            return Err(BlockError::Invalid("request larger than 4 GiB".into()));
        }
        let q = self.pick_queue(bufs.len())?;
        self.driver
            .submit_prechecked(
                q,
                &BlkRequestRef {
                    op,
                    sector,
                    bufs,
                    tag,
                },
            )
            .map_err(class_error)?;
        self.per_queue[q] += 1;
        Ok(())
    }

    fn kick(&mut self) -> Result<(), Failure> {
        for q in 0..self.queues {
            if self.driver.in_flight(q) > 0 {
                self.driver.kick(q).map_err(failure)?;
            }
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<(u64, Result<u32, BlockError>)>) -> Result<usize, Failure> {
        self.completions.clear();
        for q in 0..self.queues {
            self.driver
                .poll(q, &mut self.completions)
                .map_err(failure)?;
        }
        Ok(self.hand_over(out))
    }

    fn arm(&mut self) -> Result<bool, Failure> {
        for q in 0..self.queues {
            if self.driver.in_flight(q) > 0 && self.driver.arm(q).map_err(failure)? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}
