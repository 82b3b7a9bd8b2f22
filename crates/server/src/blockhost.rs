//! The block class on top of the virtio-blk driver: generic class requests in, chip requests
//! out (Mach's split between class code and chip code).

use outboard_class::{BlockError, BlockInfo, BlockOp, BlockRequest};
use outboard_drivers::virtio_blk::{
    BlkCompletion, BlkDriverOptions, BlkError, BlkOp, BlkRequest, VirtioBlk,
};
use outboard_hw::{DeviceSpec, HwError, PciFunction};

/// A block device published from a virtio-blk driver instance, its requests spread over the
/// device's queues.
pub struct BlockHost {
    driver: VirtioBlk,
    info: BlockInfo,
    sectors_per_block: u64,
    /// The device queues the driver set up; requests are spread over all of them.
    queues: usize,
    /// Where the next request's search for a queue with room starts (round robin).
    next_queue: usize,
    /// Requests sent down each queue (for status and tests).
    per_queue: Vec<u64>,
    /// How it was opened (name, device, queues), so that it can be opened again.
    origin: Option<(String, DeviceSpec, u16)>,
    completions: Vec<BlkCompletion>,
}

impl std::fmt::Debug for BlockHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockHost")
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
        BlkError::Io => BlockError::Io,
        BlkError::QueueFull => BlockError::QueueFull,
        BlkError::Timeout => BlockError::Timeout,
        BlkError::Device(why) => BlockError::DeviceFailed(why),
    }
}

impl BlockHost {
    /// Opens the device, matches and brings up its driver on up to `queues` of the device's
    /// queues, and names the class device.
    pub fn open(name: &str, spec: &DeviceSpec, queues: u16) -> Result<Self, BlockError> {
        let f = PciFunction::open(spec).map_err(|e| match e {
            HwError::Busy { spec } => {
                BlockError::Busy(format!("{spec}: another client drives this device"))
            }
            e @ HwError::Open { .. } => BlockError::Unreachable(e.to_string()),
            e => BlockError::DeviceFailed(e.to_string()),
        })?;
        let p = outboard_drivers::match_driver(&f.identity()).ok_or_else(|| {
            BlockError::DeviceFailed(format!(
                "{spec}: no driver matches {:04x}:{:04x}",
                f.identity().vendor,
                f.identity().device
            ))
        })?;
        if p.class != "block" {
            return Err(BlockError::DeviceFailed(format!(
                "{spec}: driver {} is not a block driver",
                p.driver
            )));
        }
        let opts = BlkDriverOptions {
            queues: queues.max(1),
            ..Default::default()
        };
        let driver = VirtioBlk::new(f, opts)
            .map_err(|e| BlockError::DeviceFailed(format!("{spec}: {e}")))?;
        let mut h = Self::new(name, driver);
        h.origin = Some((name.to_string(), spec.clone(), queues));
        Ok(h)
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
        };
        Self {
            sectors_per_block: d.block_size as u64 / 512,
            queues: d.queues.max(1) as usize,
            next_queue: 0,
            per_queue: vec![0; d.queues.max(1) as usize],
            origin: None,
            driver,
            info,
            completions: Vec::new(),
        }
    }

    /// Class status.
    pub fn info(&self) -> &BlockInfo {
        &self.info
    }

    /// The driver (for its PCI function's DMA space and interrupt).
    pub fn driver(&self) -> &VirtioBlk {
        &self.driver
    }

    /// Whether the driver can take another request now (on any queue).
    pub fn has_room(&self) -> bool {
        (0..self.queues).any(|q| self.driver.has_room(q, 1))
    }

    /// Requests in flight in the driver, on all queues.
    pub fn in_flight(&self) -> usize {
        (0..self.queues).map(|q| self.driver.in_flight(q)).sum()
    }

    /// The device queues in use.
    pub fn queues(&self) -> usize {
        self.queues
    }

    /// How the device was opened, if by [`BlockHost::open`].
    pub fn origin(&self) -> Option<&(String, DeviceSpec, u16)> {
        self.origin.as_ref()
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

    /// Submits an already validated class request whose buffer area starts at device address
    /// `iova_base`, under the driver tag `tag`. `Null` never reaches here.
    pub fn submit(&mut self, r: &BlockRequest, iova_base: u64, tag: u64) -> Result<(), BlockError> {
        let bytes = r.blocks as u64 * self.info.block_size as u64;
        let sector = r.lba * self.sectors_per_block;
        let sectors = || {
            u32::try_from(r.blocks as u64 * self.sectors_per_block)
                .map_err(|_| BlockError::OutOfRange)
        };
        let (op, bufs) = match r.op {
            BlockOp::Read => (BlkOp::Read, vec![(iova_base + r.buf_offset, bytes as u32)]),
            BlockOp::Write => (BlkOp::Write, vec![(iova_base + r.buf_offset, bytes as u32)]),
            BlockOp::Flush => (BlkOp::Flush, vec![]),
            BlockOp::Discard => (
                BlkOp::Discard {
                    sectors: sectors()?,
                },
                vec![],
            ),
            BlockOp::WriteZeroes => (
                BlkOp::WriteZeroes {
                    sectors: sectors()?,
                },
                vec![],
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
            .submit(
                q,
                &BlkRequest {
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

    /// Publishes submitted requests to the device, queue by queue.
    pub fn kick(&mut self) -> Result<(), BlockError> {
        for q in 0..self.queues {
            if self.driver.in_flight(q) > 0 {
                self.driver.kick(q).map_err(class_error)?;
            }
        }
        Ok(())
    }

    /// Reaps completions as `(driver tag, result)`.
    pub fn poll(
        &mut self,
        out: &mut Vec<(u64, Result<u32, BlockError>)>,
    ) -> Result<usize, BlockError> {
        self.completions.clear();
        for q in 0..self.queues {
            self.driver
                .poll(q, &mut self.completions)
                .map_err(class_error)?;
        }
        Ok(self.hand_over(out))
    }

    /// Blocks in the driver until something completes or `timeout` (colocated use, which
    /// drives one queue: a client in one thread has nothing to spread).
    pub fn wait(
        &mut self,
        out: &mut Vec<(u64, Result<u32, BlockError>)>,
        timeout: std::time::Duration,
    ) -> Result<usize, BlockError> {
        self.completions.clear();
        self.driver
            .wait(0, &mut self.completions, timeout)
            .map_err(class_error)?;
        Ok(self.hand_over(out))
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
                    BlockError::Io
                }
                e => class_error(e),
            });
            (c.tag, result)
        }));
        n
    }

    /// Arms the completion interrupts of the queues with requests in flight; true if
    /// completions are already waiting.
    pub fn arm(&mut self) -> Result<bool, BlockError> {
        for q in 0..self.queues {
            if self.driver.in_flight(q) > 0 && self.driver.arm(q).map_err(class_error)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Acknowledges the completion interrupts.
    pub fn ack(&mut self) -> Result<(), BlockError> {
        for q in 0..self.queues {
            self.driver.ack(q).map_err(class_error)?;
        }
        Ok(())
    }
}
