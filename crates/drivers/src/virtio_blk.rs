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

use std::time::Duration;

use std::os::fd::BorrowedFd;

use outboard_env::{DeviceEvent, Failure, Waiter};
use outboard_hw::{DmaBuf, PciFunction, PciIdentity};
use outboard_spec::virtio::{self, feature as vfeature};
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

/// Whether this driver can drive `id` (modern virtio-blk, or transitional with subsystem 2).
pub fn matches(id: &PciIdentity) -> bool {
    id.vendor == virtio::PCI_VENDOR_ID
        && (id.device == virtio::PCI_DEVICE_ID_BASE + virtio::DEVICE_ID_BLOCK
            || (id.device == 0x1001 && id.subsystem == 2))
}

/// The active probe (I/O Kit's `probe`), from configuration space and BAR sizes only — it
/// changes nothing on the device. This driver speaks the modern virtio-pci interface (§4.1.4),
/// so the common, notify, ISR and device-configuration structures must each be there, inside
/// a BAR the function has. A modern device (1042) is claimed with `initial`; a transitional one
/// (1001) that also offers the modern interface with 100 less, so that a driver for the legacy
/// interface could outbid it.
pub fn probe_score(
    id: &PciIdentity,
    caps: &[crate::virtio::transport::VirtioCap],
    bar_sizes: &[u64; 6],
    initial: u32,
) -> Result<u32, String> {
    use outboard_spec::virtio::cap;
    crate::virtio::device::modern_structures(
        caps,
        bar_sizes,
        &[
            cap::COMMON_CFG,
            cap::NOTIFY_CFG,
            cap::ISR_CFG,
            cap::DEVICE_CFG,
        ],
    )?;
    Ok(if id.device == 0x1001 {
        initial.saturating_sub(100)
    } else {
        initial
    })
}

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
        // 7: device-specific set-up.
        let cfg_u32 = |off: u64| -> Result<u32, VirtioError> {
            let mut b = [0u8; 4];
            t.read_config(off, &mut b)?;
            Ok(u32::from_le_bytes(b))
        };
        let mut cap = [0u8; 8];
        t.read_config(config::CAPACITY, &mut cap)?;
        let capacity = u64::from_le_bytes(cap);
        let block_size = if features & feature::BLK_SIZE != 0 {
            cfg_u32(config::BLK_SIZE)?
        } else {
            512
        };
        if block_size < 512 || !block_size.is_power_of_two() {
            n.fail();
            return Err(BlkError::Device(format!(
                "device reports block size {block_size}"
            )));
        }
        let size_max = if features & feature::SIZE_MAX != 0 {
            cfg_u32(config::SIZE_MAX)?.max(4096)
        } else {
            u32::MAX
        };
        let seg_max = if features & feature::SEG_MAX != 0 {
            cfg_u32(config::SEG_MAX)?.max(1)
        } else {
            MAX_SEGMENTS as u32
        };
        let device_queues = if features & feature::MQ != 0 {
            let mut b = [0u8; 2];
            t.read_config(config::NUM_QUEUES, &mut b)?;
            u16::from_le_bytes(b).max(1)
        } else {
            1
        };
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

    fn validate(&self, r: &BlkRequestRef<'_>) -> Result<(&'static str, u64), BlkError> {
        let bytes: u64 = r.bufs.iter().map(|b| b.1 as u64).sum();
        let (name, sectors) = match r.op {
            BlkOp::Read => ("read", bytes / SECTOR_SIZE),
            BlkOp::Write => ("write", bytes / SECTOR_SIZE),
            BlkOp::Flush => ("flush", 0),
            BlkOp::Discard { sectors } => ("discard", sectors as u64),
            BlkOp::WriteZeroes { sectors } => ("write-zeroes", sectors as u64),
            BlkOp::GetId => ("get-id", 0),
        };
        let f = self.info.features;
        match r.op {
            BlkOp::Flush if f & feature::FLUSH == 0 => return Err(BlkError::Unsupported("flush")),
            BlkOp::Discard { .. } if f & feature::DISCARD == 0 => {
                return Err(BlkError::Unsupported("discard"))
            }
            BlkOp::WriteZeroes { .. } if f & feature::WRITE_ZEROES == 0 => {
                return Err(BlkError::Unsupported("write-zeroes"))
            }
            _ => {}
        }
        if matches!(
            r.op,
            BlkOp::Write | BlkOp::Discard { .. } | BlkOp::WriteZeroes { .. }
        ) && self.info.read_only
        {
            return Err(BlkError::ReadOnly);
        }
        match r.op {
            BlkOp::Read | BlkOp::Write => {
                if r.bufs.is_empty() || !bytes.is_multiple_of(self.info.block_size as u64) {
                    return Err(BlkError::Invalid(format!(
                        "{name} of {bytes} bytes is not whole {}-byte blocks",
                        self.info.block_size
                    )));
                }
                // Sectors are 512 bytes whatever the block size (§5.2.6); a disk with larger
                // logical blocks fails requests that do not start on one.
                let per_block = self.info.block_size as u64 / SECTOR_SIZE;
                if !r.sector.is_multiple_of(per_block) {
                    return Err(BlkError::Invalid(format!(
                        "sector {} does not start a {}-byte block",
                        r.sector, self.info.block_size
                    )));
                }
                if r.bufs.len() > MAX_SEGMENTS.min(self.seg_max as usize) {
                    return Err(BlkError::Invalid(format!(
                        "{} buffers exceed the limit of {}",
                        r.bufs.len(),
                        MAX_SEGMENTS.min(self.seg_max as usize)
                    )));
                }
                if r.bufs.iter().any(|b| b.1 == 0 || b.1 > self.size_max) {
                    return Err(BlkError::Invalid(format!(
                        "a buffer is empty or larger than the device's {} bytes",
                        self.size_max
                    )));
                }
            }
            BlkOp::GetId if r.bufs.len() != 1 || r.bufs[0].1 < req::ID_BYTES => {
                return Err(BlkError::Invalid(
                    "get-id needs one buffer of at least 20 bytes".into(),
                ))
            }
            BlkOp::Flush | BlkOp::Discard { .. } | BlkOp::WriteZeroes { .. }
                if !r.bufs.is_empty() =>
            {
                return Err(BlkError::Invalid(format!("{name} takes no buffers")))
            }
            _ => {}
        }
        let end = r.sector.saturating_add(sectors);
        if end > self.info.capacity
            || (sectors == 0
                && matches!(r.op, BlkOp::Read | BlkOp::Write)
                && r.sector >= self.info.capacity)
        {
            return Err(BlkError::OutOfRange {
                sector: r.sector,
                end,
                capacity: self.info.capacity,
            });
        }
        Ok((name, bytes))
    }

    /// Queues a request on queue `q`. It reaches the device at the next [`VirtioBlk::kick`]
    /// (submit several, kick once: batching).
    pub fn submit(&mut self, q: usize, r: &BlkRequest) -> Result<(), BlkError> {
        self.submit_ref(q, &r.as_ref())
    }

    /// [`VirtioBlk::submit`] with a borrowed buffer list; allocates nothing.
    pub fn submit_ref(&mut self, q: usize, r: &BlkRequestRef<'_>) -> Result<(), BlkError> {
        let (_, bytes) = self.validate(r)?;
        let queue = self
            .queues
            .get_mut(q)
            .ok_or_else(|| BlkError::Invalid(format!("no queue {q}")))?;
        let zero_seg = matches!(r.op, BlkOp::Discard { .. } | BlkOp::WriteZeroes { .. });
        let n = r.bufs.len() + 2 + zero_seg as usize;
        if !queue.vq.can_add(n) {
            return Err(BlkError::QueueFull);
        }
        let head = queue.vq.next_head().expect("can_add checked") as u64;
        let slot = head * SLOT;
        let (kind, seg) = match r.op {
            BlkOp::Read => (req::IN, None),
            BlkOp::Write => (req::OUT, None),
            BlkOp::Flush => (req::FLUSH, None),
            BlkOp::GetId => (req::GET_ID, None),
            BlkOp::Discard { sectors } => (req::DISCARD, Some((sectors, 0u32))),
            BlkOp::WriteZeroes { sectors } => (req::WRITE_ZEROES, Some((sectors, 0u32))),
        };
        let header = req::Header {
            kind: kind.into(),
            reserved: 0.into(),
            sector: if kind == req::FLUSH || kind == req::GET_ID {
                0
            } else {
                r.sector
            }
            .into(),
        };
        let shm = |e: outboard_hw::ShmError| BlkError::Device(e.to_string());
        queue
            .slots
            .write(slot, zerocopy::IntoBytes::as_bytes(&header))
            .map_err(shm)?;
        queue
            .slots
            .write(slot + SLOT_STATUS, &[STATUS_UNSET])
            .map_err(shm)?;
        let base = queue.slots.iova();
        // The chain on the stack: header, segment, data (at most MAX_SEGMENTS, checked by
        // `validate`), status.
        let mut chain = [Buf {
            iova: 0,
            len: 0,
            write: false,
        }; crate::virtio::queue::MAX_INDIRECT + 1];
        let mut len = 0;
        let mut push = |b: Buf| {
            chain[len] = b;
            len += 1;
        };
        push(Buf {
            iova: base + slot,
            len: 16,
            write: false,
        });
        if let Some((sectors, flags)) = seg {
            let s = req::Segment {
                sector: r.sector.into(),
                num_sectors: sectors.into(),
                flags: flags.into(),
            };
            queue
                .slots
                .write(slot + SLOT_SEGMENT, zerocopy::IntoBytes::as_bytes(&s))
                .map_err(shm)?;
            push(Buf {
                iova: base + slot + SLOT_SEGMENT,
                len: 16,
                write: false,
            });
        }
        let write = matches!(r.op, BlkOp::Read | BlkOp::GetId);
        for &(iova, len) in r.bufs {
            push(Buf { iova, len, write });
        }
        push(Buf {
            iova: base + slot + SLOT_STATUS,
            len: 1,
            write: true,
        });
        let got = queue.vq.add(&chain[..len])?.ok_or(BlkError::QueueFull)?;
        debug_assert_eq!(got as u64, head);
        queue.in_flight[head as usize] = Some(InFlight {
            tag: r.tag,
            op: r.op,
            bytes,
        });
        Ok(())
    }

    /// Makes submitted requests visible to the device and notifies it if it is waiting.
    pub fn kick(&mut self, q: usize) -> Result<(), BlkError> {
        let queue = self
            .queues
            .get_mut(q)
            .ok_or_else(|| BlkError::Invalid(format!("no queue {q}")))?;
        queue.vq.publish()?;
        Ok(())
    }

    /// Rings queue `q`'s doorbell without publishing anything (for measurements).
    pub fn notify(&mut self, q: usize) -> Result<(), BlkError> {
        let queue = self
            .queues
            .get(q)
            .ok_or_else(|| BlkError::Invalid(format!("no queue {q}")))?;
        Ok(queue.vq.notify()?)
    }

    /// Asks for an interrupt at queue `q`'s next completion, for a caller running its own
    /// event loop on [`VirtioBlk::sources`]. Returns true if completions are already waiting (poll
    /// instead of sleeping).
    pub fn arm(&mut self, q: usize) -> Result<bool, BlkError> {
        let queue = self
            .queues
            .get_mut(q)
            .ok_or_else(|| BlkError::Invalid(format!("no queue {q}")))?;
        Ok(queue.vq.enable_interrupts()?)
    }

    /// Whether queue `q` can take a request of `bufs` data buffers now.
    pub fn has_room(&self, q: usize, bufs: usize) -> bool {
        self.queues.get(q).is_some_and(|qq| qq.vq.can_add(bufs + 2))
    }

    /// Reaps completions of queue `q` into `out`; returns how many.
    pub fn poll(&mut self, q: usize, out: &mut Vec<BlkCompletion>) -> Result<usize, BlkError> {
        let queue = self
            .queues
            .get_mut(q)
            .ok_or_else(|| BlkError::Invalid(format!("no queue {q}")))?;
        let mut n = 0;
        while let Some((head, len)) = queue.vq.pop_used()? {
            let f = queue.in_flight[head as usize]
                .take()
                .ok_or_else(|| BlkError::Device(format!("completion for idle slot {head}")))?;

            let mut st = [0u8; 1];
            queue
                .slots
                .read(head as u64 * SLOT + SLOT_STATUS, &mut st)
                .map_err(|e| BlkError::Device(e.to_string()))?;
            let result = match st[0] {
                status::OK => Ok(f.bytes),
                status::IOERR => Err(BlkError::Io),
                status::UNSUPP => Err(BlkError::Unsupported(match f.op {
                    BlkOp::Read => "read",
                    BlkOp::Write => "write",
                    BlkOp::Flush => "flush",
                    BlkOp::Discard { .. } => "discard",
                    BlkOp::WriteZeroes { .. } => "write-zeroes",
                    BlkOp::GetId => "get-id",
                })),
                STATUS_UNSET => Err(BlkError::Device(
                    "device completed a request without a status".into(),
                )),
                s => Err(BlkError::Device(format!(
                    "device returned unknown status {s}"
                ))),
            };
            // A success's used length is what the device wrote into the request's
            // device-writable buffers: the data of a read or GET_ID, then the status byte. Bytes
            // past it are not the device's (virtio 1.2 §2.7.8.1: the driver MUST NOT rely on
            // them), so a short count fails the request instead of handing back stale buffer
            // contents. (A failed request reports what it wrote: at least the status.)
            let wrote = match f.op {
                BlkOp::Read | BlkOp::GetId => f.bytes + 1,
                _ => 1,
            };
            let result = match result {
                Ok(_) if (len as u64) < wrote => Err(BlkError::Device(format!(
                    "short transfer: the device reports {len} of {wrote} bytes written"
                ))),
                r => r,
            };
            out.push(BlkCompletion { tag: f.tag, result });
            n += 1;
        }
        Ok(n)
    }

    /// Waits until queue `q` has completions (or `timeout`), then reaps them.
    pub fn wait(
        &mut self,
        q: usize,
        out: &mut Vec<BlkCompletion>,
        timeout: Duration,
    ) -> Result<usize, BlkError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let n = self.poll(q, out)?;
            if n > 0 {
                return Ok(n);
            }
            if self.in_flight(q) == 0 {
                return Ok(0);
            }
            // Re-arm, then re-check before sleeping (the flag-then-recheck rule).
            if self.queues[q].vq.enable_interrupts()? {
                continue;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Err(BlkError::Timeout);
            }
            // A device that stopped says so here, and nothing it holds will complete: waiting
            // out the deadline would only hide why.
            let device = &self.device;
            self.waiter
                .wait_and_handle(deadline - now, |ev| device.handle(ev))
                .map_err(|e| BlkError::Device(e.to_string()))?;
        }
    }

    /// The device's event sources for the environment's loop: each interrupt vector, the
    /// configuration-change vector and the device's loss.
    pub fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        self.device.sources()
    }

    /// Handles one of the device's events (the contract's `handle`): acknowledges an
    /// interrupt, and reports a device that needs a reset or is gone.
    pub fn handle_event(&mut self, ev: DeviceEvent) -> Result<(), Failure> {
        self.device.handle(ev)
    }

    /// Submits one request on queue 0 and waits for it.
    pub fn execute(&mut self, r: BlkRequest) -> Result<u64, BlkError> {
        if self.in_flight(0) > 0 {
            return Err(BlkError::Invalid("execute needs an idle queue 0".into()));
        }
        self.submit(0, &r)?;
        self.kick(0)?;
        let mut out = Vec::new();
        while out.is_empty() {
            self.wait(0, &mut out, self.timeout)?;
        }
        out.pop().expect("one completion").result
    }

    /// Runs `reqs` on queue `q` keeping at most `depth` in flight; returns every completion
    /// (in completion order). Per-request failures are in the completions; an `Err` means the
    /// device or queue failed.
    pub fn execute_batch(
        &mut self,
        q: usize,
        reqs: &[BlkRequest],
        depth: usize,
    ) -> Result<Vec<BlkCompletion>, BlkError> {
        let mut done = Vec::with_capacity(reqs.len());
        let mut next = 0;
        while done.len() < reqs.len() {
            while next < reqs.len() && self.in_flight(q) < depth.max(1) {
                match self.submit(q, &reqs[next]) {
                    Ok(()) => next += 1,
                    Err(BlkError::QueueFull) => break,
                    Err(e) => {
                        done.push(BlkCompletion {
                            tag: reqs[next].tag,
                            result: Err(e),
                        });
                        next += 1;
                    }
                }
            }
            self.kick(q)?;
            if self.in_flight(q) > 0 {
                self.wait(q, &mut done, self.timeout)?;
            }
        }
        Ok(done)
    }

    /// Reads `len` bytes at `sector` into `buf` at `offset`.
    pub fn read(
        &mut self,
        sector: u64,
        buf: &DmaBuf,
        offset: u64,
        len: u32,
    ) -> Result<u64, BlkError> {
        self.transfer(BlkOp::Read, sector, buf, offset, len)
    }

    /// Writes `len` bytes from `buf` at `offset` to `sector`.
    pub fn write(
        &mut self,
        sector: u64,
        buf: &DmaBuf,
        offset: u64,
        len: u32,
    ) -> Result<u64, BlkError> {
        self.transfer(BlkOp::Write, sector, buf, offset, len)
    }

    fn transfer(
        &mut self,
        op: BlkOp,
        sector: u64,
        buf: &DmaBuf,
        offset: u64,
        len: u32,
    ) -> Result<u64, BlkError> {
        let iova = buf
            .iova_at(offset, len as u64)
            .map_err(|e| BlkError::Invalid(e.to_string()))?;
        self.execute(BlkRequest {
            op,
            sector,
            bufs: vec![(iova, len)],
            tag: 0,
        })
    }

    /// Flushes the device's write cache.
    pub fn flush(&mut self) -> Result<(), BlkError> {
        self.execute(BlkRequest {
            op: BlkOp::Flush,
            sector: 0,
            bufs: vec![],
            tag: 0,
        })
        .map(|_| ())
    }

    /// Reads the device ID string.
    pub fn device_id(&mut self) -> Result<String, BlkError> {
        let buf = self
            .device
            .function()
            .dma()
            .alloc(4096)
            .map_err(|e| BlkError::Device(e.to_string()))?;
        self.execute(BlkRequest {
            op: BlkOp::GetId,
            sector: 0,
            bufs: vec![(buf.iova(), req::ID_BYTES)],
            tag: 0,
        })?;
        let mut id = [0u8; req::ID_BYTES as usize];
        buf.read(0, &mut id)
            .map_err(|e| BlkError::Device(e.to_string()))?;
        let end = id.iter().position(|&b| b == 0).unwrap_or(id.len());
        Ok(String::from_utf8_lossy(&id[..end]).into_owned())
    }

    /// Resets the device; in-flight requests are abandoned (the driver is being torn down).
    pub fn shutdown(mut self) -> Result<(), BlkError> {
        self.stop_device()
    }

    fn stop_device(&mut self) -> Result<(), BlkError> {
        Ok(self.device.stop()?)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::transport::VirtioCap;
    use outboard_spec::virtio::cap;

    fn id(device: u16) -> PciIdentity {
        PciIdentity {
            vendor: virtio::PCI_VENDOR_ID,
            device,
            subsystem_vendor: virtio::PCI_VENDOR_ID,
            subsystem: 2,
            class: 1,
            subclass: 0,
            prog_if: 0,
            revision: 1,
        }
    }

    fn structure(cfg_type: u8, offset: u32) -> VirtioCap {
        VirtioCap {
            at: 0x40 + cfg_type * 0x10,
            cfg_type,
            bar: 4,
            offset,
            length: 0x1000,
            multiplier: 4,
        }
    }

    /// The four structures QEMU places in BAR 4 (16 KiB).
    fn modern() -> (Vec<VirtioCap>, [u64; 6]) {
        let caps = [
            cap::COMMON_CFG,
            cap::ISR_CFG,
            cap::DEVICE_CFG,
            cap::NOTIFY_CFG,
        ]
        .iter()
        .enumerate()
        .map(|(i, &t)| structure(t, i as u32 * 0x1000))
        .collect();
        (caps, [0x1000, 0, 0, 0, 0x4000, 0])
    }

    #[test]
    fn a_modern_device_is_claimed_and_a_transitional_one_with_less() {
        let (caps, bars) = modern();
        assert_eq!(probe_score(&id(0x1042), &caps, &bars, 1000), Ok(1000));
        assert_eq!(probe_score(&id(0x1001), &caps, &bars, 1000), Ok(900));
    }

    #[test]
    fn a_device_without_the_modern_interface_is_declined_with_the_reason() {
        // Legacy only: no virtio capabilities at all.
        let why = probe_score(&id(0x1001), &[], &[0x40, 0, 0, 0, 0, 0], 1000).unwrap_err();
        assert!(why.contains("common"), "{why}");
        assert!(why.contains("modern virtio-pci"), "{why}");
        let (caps, bars) = modern();
        for missing in [
            cap::COMMON_CFG,
            cap::NOTIFY_CFG,
            cap::ISR_CFG,
            cap::DEVICE_CFG,
        ] {
            let some: Vec<VirtioCap> = caps
                .iter()
                .copied()
                .filter(|c| c.cfg_type != missing)
                .collect();
            let why = probe_score(&id(0x1042), &some, &bars, 1000).unwrap_err();
            assert!(why.contains(cap::name(missing)), "{why}");
        }
    }

    #[test]
    fn a_structure_outside_its_bar_does_not_count() {
        let (mut caps, bars) = modern();
        // The notify structure runs past the end of BAR 4.
        caps[3].offset = 0x3800;
        assert!(probe_score(&id(0x1042), &caps, &bars, 1000).is_err());
        // In a BAR the function does not have.
        let (mut caps, bars) = modern();
        caps[0].bar = 2;
        assert!(probe_score(&id(0x1042), &caps, &bars, 1000).is_err());
        // A BAR index past the six.
        let (mut caps, bars) = modern();
        caps[1].bar = 9;
        assert!(probe_score(&id(0x1042), &caps, &bars, 1000).is_err());
        // Offset and length that overflow.
        let (mut caps, bars) = modern();
        caps[2].offset = u32::MAX;
        caps[2].length = u32::MAX;
        assert!(probe_score(&id(0x1042), &caps, &bars, 1000).is_err());
    }
}
