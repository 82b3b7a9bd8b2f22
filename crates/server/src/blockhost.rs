//! The block class on top of the virtio-blk driver: generic class requests in, chip requests
//! out (Mach's split between class code and chip code).

use outboard_class::{BlockError, BlockInfo, BlockOp, BlockRequest};
use outboard_drivers::virtio_blk::{
    BlkCompletion, BlkDriverOptions, BlkError, BlkOp, BlkRequest, VirtioBlk,
};
use outboard_hw::{DeviceSpec, HwError, PciFunction};

/// A block device published from a virtio-blk driver instance (queue 0).
pub struct BlockHost {
    driver: VirtioBlk,
    info: BlockInfo,
    sectors_per_block: u64,
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
    /// Opens the device, matches and brings up its driver, and names the class device.
    pub fn open(name: &str, spec: &DeviceSpec) -> Result<Self, BlockError> {
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
        let driver = VirtioBlk::new(f, BlkDriverOptions::default())
            .map_err(|e| BlockError::DeviceFailed(format!("{spec}: {e}")))?;
        Ok(Self::new(name, driver))
    }

    /// Wraps a driver instance.
    pub fn new(name: &str, driver: VirtioBlk) -> Self {
        let d = driver.info();
        let info = BlockInfo {
            name: name.into(),
            capacity: d.capacity * 512 / d.block_size as u64,
            block_size: d.block_size,
            read_only: d.read_only,
            queue_depth: d.queue_size as u32,
        };
        Self {
            sectors_per_block: d.block_size as u64 / 512,
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

    /// Whether the driver can take another request now.
    pub fn has_room(&self) -> bool {
        self.driver.has_room(0, 1)
    }

    /// Requests in flight in the driver.
    pub fn in_flight(&self) -> usize {
        self.driver.in_flight(0)
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
        self.driver
            .submit(
                0,
                &BlkRequest {
                    op,
                    sector,
                    bufs,
                    tag,
                },
            )
            .map_err(class_error)
    }

    /// Publishes submitted requests to the device.
    pub fn kick(&mut self) -> Result<(), BlockError> {
        self.driver.kick(0).map_err(class_error)
    }

    /// Reaps completions as `(driver tag, result)`.
    pub fn poll(
        &mut self,
        out: &mut Vec<(u64, Result<u32, BlockError>)>,
    ) -> Result<usize, BlockError> {
        self.completions.clear();
        self.driver
            .poll(0, &mut self.completions)
            .map_err(class_error)?;
        Ok(self.hand_over(out))
    }

    /// Blocks in the driver until something completes or `timeout` (colocated use).
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

    /// Arms the completion interrupt; true if completions are already waiting.
    pub fn arm(&mut self) -> Result<bool, BlockError> {
        self.driver.arm(0).map_err(class_error)
    }

    /// Acknowledges the completion interrupt.
    pub fn ack(&mut self) -> Result<(), BlockError> {
        self.driver.ack(0).map_err(class_error)
    }
}
