//! Native virtio-blk driver (virtio v1.2 §5.2), work-loop model.
//!
//! Assumes a modern (VERSION_1) virtio-pci function; legacy devices are refused. Implements
//! read, write, flush, discard, write-zeroes and GET_ID on one or more queues, with indirect
//! descriptors (one ring slot per request, so a queue of 256 holds 256 requests), EVENT_IDX
//! notification suppression both ways, and MSI-X (one vector per queue plus one for
//! configuration), falling back to INTx. Requests carry device addresses of the caller's DMA
//! buffers, so data moves without a copy. Non-goals: the legacy interface, packed rings,
//! zoned devices, secure erase, configuration write-back caching control.
//!
//! Skeleton, as for every Outboard driver: tunables and state; [`VirtioBlk::new`] (the init
//! sequence of §3.1.1); operations ([`VirtioBlk::submit`], [`VirtioBlk::kick`]); the completion
//! path ([`VirtioBlk::poll`], [`VirtioBlk::wait`]); synchronous conveniences; tests.

mod complete;
mod probe;
mod submit;
mod sync;

pub use probe::{matches, probe_score};

use std::time::Duration;

use std::os::fd::BorrowedFd;

use outboard_env::{DeviceEvent, Failure, Waiter};
use outboard_hw::{DmaBuf, PciFunction};
use outboard_spec::virtio::feature as vfeature;
use outboard_spec::virtio_blk::{config, feature, req, status, SECTOR_SIZE};

use crate::virtio::{Buf, Negotiation, VirtQueue, VirtioDevice, VirtioError};

/// Largest queue the driver sets up.
pub const MAX_QUEUE_SIZE: u16 = 256;
/// Most data buffers in one request.
pub const MAX_SEGMENTS: usize = crate::virtio::queue::MAX_INDIRECT - 2;
/// Per-request slot of driver-owned DMA memory: header at 0..16, discard / write-zeroes
/// segment at 16..32, status byte at 32.
const SLOT: u64 = 48;
const SLOT_SEGMENT: u64 = 16;
const SLOT_STATUS: u64 = 32;
/// Status value the device never writes: a completion still showing it had no status.
const STATUS_UNSET: u8 = 0xff;

/// Features this driver implements; everything else the device offers is declined.
pub const SUPPORTED_FEATURES: u64 = vfeature::VERSION_1
    | vfeature::ACCESS_PLATFORM
    | vfeature::RING_EVENT_IDX
    | vfeature::RING_INDIRECT_DESC
    | feature::SIZE_MAX
    | feature::SEG_MAX
    | feature::BLK_SIZE
    | feature::RO
    | feature::FLUSH
    | feature::MQ
    | feature::DISCARD
    | feature::WRITE_ZEROES;

/// A block operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlkOp {
    /// Read sectors into the buffers.
    Read,
    /// Write sectors from the buffers.
    Write,
    /// Make completed writes durable.
    Flush,
    /// Deallocate `sectors` sectors (no buffers).
    Discard {
        /// Sector count.
        sectors: u32,
    },
    /// Zero `sectors` sectors (no buffers).
    WriteZeroes {
        /// Sector count.
        sectors: u32,
    },
    /// Read the 20-byte device ID string into the buffer.
    GetId,
}

/// Why a block request failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum BlkError {
    /// The range runs past the end of the disk.
    #[error("sectors {sector}..{end} are beyond the disk's {capacity} sectors")]
    OutOfRange {
        /// First sector.
        sector: u64,
        /// One past the last.
        end: u64,
        /// Disk size.
        capacity: u64,
    },
    /// The disk is read-only.
    #[error("the disk is read-only")]
    ReadOnly,
    /// The request is malformed (length not whole sectors, too many buffers).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The device does not support the operation.
    #[error("the device does not support {0}")]
    Unsupported(&'static str),
    /// The device reported an I/O error.
    #[error("the device reported an I/O error")]
    Io,
    /// Every queue slot is in use.
    #[error("the queue is full")]
    QueueFull,
    /// The device misbehaved or went away.
    #[error("{0}")]
    Device(String),
    /// Nothing completed within the time allowed.
    #[error("timed out waiting for the device")]
    Timeout,
}

impl From<VirtioError> for BlkError {
    fn from(e: VirtioError) -> Self {
        BlkError::Device(e.to_string())
    }
}

/// One request.
#[derive(Debug, Clone)]
pub struct BlkRequest {
    /// What to do.
    pub op: BlkOp,
    /// First 512-byte sector.
    pub sector: u64,
    /// Data buffers, as device addresses and lengths (from [`DmaBuf::iova_at`]).
    pub bufs: Vec<(u64, u32)>,
    /// The caller's tag, returned in the completion.
    pub tag: u64,
}

/// A request whose buffer list is borrowed: what [`VirtioBlk::submit_ref`] takes, so a caller
/// with one buffer on its stack allocates nothing.
#[derive(Debug, Clone, Copy)]
pub struct BlkRequestRef<'a> {
    /// What to do.
    pub op: BlkOp,
    /// First 512-byte sector.
    pub sector: u64,
    /// Data buffers, as device addresses and lengths.
    pub bufs: &'a [(u64, u32)],
    /// The caller's tag, returned in the completion.
    pub tag: u64,
}

impl BlkRequest {
    /// The borrowed view.
    pub fn as_ref(&self) -> BlkRequestRef<'_> {
        BlkRequestRef {
            op: self.op,
            sector: self.sector,
            bufs: &self.bufs,
            tag: self.tag,
        }
    }
}

/// A finished request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlkCompletion {
    /// The request's tag.
    pub tag: u64,
    /// Bytes transferred, or why it failed.
    pub result: Result<u64, BlkError>,
}

/// What the driver learned about the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlkInfo {
    /// Capacity in 512-byte sectors.
    pub capacity: u64,
    /// Logical block size.
    pub block_size: u32,
    /// Writes are refused.
    pub read_only: bool,
    /// Request queues in use.
    pub queues: u16,
    /// Entries per queue.
    pub queue_size: u16,
    /// Negotiated features.
    pub features: u64,
    /// Interrupt mode used.
    pub msix: bool,
    /// Largest data segment the device takes (SIZE_MAX; 4 GiB - 1 when it sets no limit).
    pub size_max: u32,
    /// Most data segments in one request: the device's SEG_MAX, at most what one indirect
    /// table holds.
    pub segments: u32,
}

impl BlkInfo {
    /// The largest data transfer of one request, in bytes, in whole blocks.
    pub fn max_transfer(&self) -> u32 {
        let max = (self.size_max as u64 * self.segments as u64).min(u32::MAX as u64) as u32;
        max / self.block_size * self.block_size
    }
}

struct InFlight {
    tag: u64,
    op: BlkOp,
    bytes: u64,
}

struct Queue {
    vq: VirtQueue,
    slots: DmaBuf,
    in_flight: Vec<Option<InFlight>>,
}

/// Options.
#[derive(Debug, Clone, Copy)]
pub struct BlkDriverOptions {
    /// Queues to use (at most what the device has).
    pub queues: u16,
    /// How long a synchronous call waits for the device.
    pub timeout: Duration,
}

impl Default for BlkDriverOptions {
    fn default() -> Self {
        Self {
            queues: 1,
            timeout: Duration::from_secs(30),
        }
    }
}

/// The driver instance for one virtio-blk function.
pub struct VirtioBlk {
    device: VirtioDevice,
    queues: Vec<Queue>,
    /// The environment's loop for synchronous use (`wait`), on this device's sources.
    waiter: Waiter,
    info: BlkInfo,
    size_max: u32,
    seg_max: u32,
    timeout: Duration,
}

impl std::fmt::Debug for VirtioBlk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioBlk")
            .field("info", &self.info)
            .finish()
    }
}

impl VirtioBlk {
    /// Brings the device up: §3.1.1 device initialization, then queue and vector set-up.
    pub fn new(func: PciFunction, opts: BlkDriverOptions) -> Result<Self, BlkError> {
        if !matches(&func.identity()) {
            return Err(BlkError::Device(format!(
                "{:04x}:{:04x} is not a virtio-blk device",
                func.identity().vendor,
                func.identity().device
            )));
        }
        // 1-6: reset, ACKNOWLEDGE, DRIVER, features.
        let n = Negotiation::begin(func, "virtio-blk", SUPPORTED_FEATURES)?;
        let features = n.features();
        let t = n.transport();
        // 7: device-specific set-up: the fields it uses, read as one consistent set.
        let cfg_u32 = |off: u64| -> Result<u32, VirtioError> {
            let mut b = [0u8; 4];
            t.read_config_field(off, &mut b)?;
            Ok(u32::from_le_bytes(b))
        };
        let (capacity, block_size, size_max, seg_max, device_queues) = t.consistently(|| {
            let mut cap = [0u8; 8];
            t.read_config_field(config::CAPACITY, &mut cap)?;
            let block_size = match features & feature::BLK_SIZE != 0 {
                true => cfg_u32(config::BLK_SIZE)?,
                false => 512,
            };
            let size_max = match features & feature::SIZE_MAX != 0 {
                true => cfg_u32(config::SIZE_MAX)?.max(4096),
                false => u32::MAX,
            };
            let seg_max = match features & feature::SEG_MAX != 0 {
                true => cfg_u32(config::SEG_MAX)?.max(1),
                false => MAX_SEGMENTS as u32,
            };
            let device_queues = if features & feature::MQ != 0 {
                let mut b = [0u8; 2];
                t.read_config_field(config::NUM_QUEUES, &mut b)?;
                u16::from_le_bytes(b).max(1)
            } else {
                1
            };
            Ok((
                u64::from_le_bytes(cap),
                block_size,
                size_max,
                seg_max,
                device_queues,
            ))
        })?;
        if block_size < 512 || !block_size.is_power_of_two() {
            n.fail();
            return Err(BlkError::Device(format!(
                "device reports block size {block_size}"
            )));
        }
        let nq = opts
            .queues
            .clamp(1, device_queues.min(t.num_queues()?.max(1)));

        // 7 (queues and vectors) and 8: DRIVER_OK.
        let (device, vqs) = n.finish(nq, MAX_QUEUE_SIZE)?;
        let mut queues = Vec::new();
        for vq in vqs {
            let slots = device
                .function()
                .dma()
                .alloc(vq.size() as usize * SLOT as usize)
                .map_err(|e| BlkError::Device(e.to_string()))?;
            queues.push(Queue {
                in_flight: (0..vq.size()).map(|_| None).collect(),
                vq,
                slots,
            });
        }
        let msix = device.msix();
        let waiter = Waiter::new(device.sources()).map_err(|e| BlkError::Device(e.to_string()))?;
        let info = BlkInfo {
            capacity,
            block_size,
            read_only: features & feature::RO != 0,
            queues: nq,
            queue_size: queues[0].vq.size(),
            features,
            msix,
            size_max,
            segments: seg_max.min(MAX_SEGMENTS as u32),
        };
        Ok(Self {
            device,
            queues,
            waiter,
            info,
            size_max,
            seg_max,
            timeout: opts.timeout,
        })
    }

    /// What the driver learned about the disk.
    pub fn info(&self) -> BlkInfo {
        self.info
    }

    /// The PCI function (for its DMA space).
    pub fn function(&self) -> &PciFunction {
        self.device.function()
    }

    /// Whether the device set DEVICE_NEEDS_RESET (virtio 1.2 §2.1.2): it has stopped, and
    /// what it holds will not complete. A trapped register read: call it on the configuration
    /// interrupt, never per request.
    pub fn needs_reset(&self) -> Result<bool, BlkError> {
        Ok(self.device.needs_reset()?)
    }

    /// Device addresses of queue `q`'s descriptor table, available ring and used ring.
    pub fn queue_rings(&self, q: usize) -> Option<(u64, u64, u64)> {
        self.queues.get(q).map(|qq| qq.vq.addresses())
    }

    /// Requests in flight on queue `q`.
    pub fn in_flight(&self, q: usize) -> usize {
        self.queues.get(q).map_or(0, |qq| qq.vq.in_flight())
    }
}

impl Drop for VirtioBlk {
    /// The device must stop using our memory before the rings and buffers are unmapped from
    /// it (the field drops that follow), so reset it first (§3.3.1: reset, then free).
    fn drop(&mut self) {
        if let Err(e) = self.stop_device() {
            tracing::warn!("virtio-blk: reset on teardown failed: {e}");
        }
    }
}
