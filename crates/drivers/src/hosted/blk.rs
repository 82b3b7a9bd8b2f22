//! The `virtio-drivers` crate's `VirtIOBlk`, unmodified, as a block-class driver
//! (`virtio-drivers-blk`).
//!
//! Reads and writes go through the crate's non-blocking calls (`read_blocks_nb`,
//! `write_blocks_nb`, completed with `complete_*_blocks`), each with a slot of the adapter's DMA
//! pool as its buffer: a write's bytes are copied from the session's buffer area into the slot
//! first, a read's out of it after. Flush, and discard and write-zeroes (which the crate does not
//! have: written as zeros), are the crate's blocking calls; they wait until every request before
//! them completed and no request after them starts until they did, so they keep their order.
//! Completions come on MSI-X vector 0, which the transport gives the queue.

use std::collections::{HashMap, VecDeque};
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use outboard_block::{BlockDriver, BlockError, BlockInfo, BlockOp, BlockRequest, Supports};
use outboard_env::{AnyDriver, DeviceEvent, Driver, Failure, Fence};
use outboard_hw::{Irq, IrqKind, PciFunction};
use virtio_drivers::device::blk::{BlkReq, BlkResp, VirtIOBlk, SECTOR_SIZE};
use virtio_drivers::transport::DeviceType;

use super::hal::{within, Context, OutboardHal};
use super::transport::HostedTransport;
use crate::personality::{Personality, Provider, StartError, StartOptions};

/// Requests in flight at most: the pool's slots.
const DEPTH: usize = 16;
/// Largest transfer of one request.
const MAX_TRANSFER: usize = 64 * 1024;
/// The pool's slot after the requests' slots: zeros, never written (what discard and
/// write-zeroes write).
const ZEROS: usize = DEPTH;

/// A read or write the device has.
struct InFlight {
    tag: u64,
    write: bool,
    slot: usize,
    len: usize,
    /// Where a read's bytes go.
    dest: Option<(Arc<outboard_hw::SharedMem>, u64)>,
    req: Box<BlkReq>,
    resp: Box<BlkResp>,
}

/// A request that waits for the device to be idle.
struct Barrier {
    tag: u64,
    op: BlockOp,
    /// Where it starts, in the crate's 512-byte sectors.
    sector: u64,
    bytes: usize,
}

/// The crate's block driver on one device.
pub struct HostedBlk {
    // Dropped inside the Hal's context (its queue's memory goes back through the Hal).
    blk: ManuallyDrop<VirtIOBlk<OutboardHal, HostedTransport>>,
    cx: Arc<Context>,
    failed: Arc<Mutex<Option<String>>>,
    function: PciFunction,
    irq: Irq,
    loss: Option<OwnedFd>,
    info: BlockInfo,
    /// The crate's 512-byte sectors in one of the device's logical blocks.
    sectors_per_block: u64,
    free_slots: Vec<usize>,
    in_flight: HashMap<u16, InFlight>,
    barriers: VecDeque<Barrier>,
}

fn crate_error(e: virtio_drivers::Error) -> BlockError {
    match e {
        virtio_drivers::Error::IoError => {
            BlockError::Io("the device answered VIRTIO_BLK_S_IOERR".into())
        }
        virtio_drivers::Error::Unsupported => BlockError::Unsupported,
        virtio_drivers::Error::QueueFull => BlockError::QueueFull,
        other => BlockError::Io(format!("virtio-drivers: {other}")),
    }
}

impl HostedBlk {
    /// Brings the crate's driver up on `function` as block device `name`.
    pub fn start(name: &str, function: PciFunction) -> Result<Self, StartError> {
        let refused = |why: String| StartError::Refused(format!("virtio-drivers-blk: {why}"));
        // What a kernel's PCI code does before it hands a function to a driver (the crate's
        // own PCI transport leaves it to its caller too): memory decode and bus mastering on.
        // Without bus mastering a real device (QEMU's, through VFIO) reaches no memory at all.
        function
            .enable_command(
                outboard_spec::pci::COMMAND_MEMORY | outboard_spec::pci::COMMAND_BUS_MASTER,
            )
            .map_err(|e| refused(format!("PCI command register: {e}")))?;
        let pci = crate::virtio::Transport::new(&function).map_err(|e| refused(e.to_string()))?;
        let offered = pci.device_features().map_err(|e| refused(e.to_string()))?;
        if function.behind_iommu() && offered & outboard_spec::virtio::feature::ACCESS_PLATFORM == 0
        {
            return Err(refused(
                "the device does not offer VIRTIO_F_ACCESS_PLATFORM: its DMA would bypass the \
                 IOMMU"
                    .into(),
            ));
        }
        // The crate counts in 512-byte sectors and never reads `blk_size`; a disk with larger
        // logical blocks fails every request that is not whole blocks (QEMU answers IOERR), so
        // the class is given the device's own block and each request is put in sectors here.
        let block_size = if offered & outboard_spec::virtio_blk::feature::BLK_SIZE != 0 {
            let mut b = [0u8; 4];
            pci.read_config_field(outboard_spec::virtio_blk::config::BLK_SIZE, &mut b)
                .map_err(|e| refused(format!("blk_size: {e}")))?;
            u32::from_le_bytes(b)
        } else {
            SECTOR_SIZE as u32
        };
        if !block_size.is_power_of_two() || !(512..=MAX_TRANSFER as u32).contains(&block_size) {
            return Err(refused(format!(
                "a logical block of {block_size} bytes: this driver takes powers of two from \
                 512 to {MAX_TRANSFER}"
            )));
        }
        let sectors_per_block = u64::from(block_size) / SECTOR_SIZE as u64;
        let irq = function
            .enable_irqs(IrqKind::MsiX, 1)
            .map_err(|e| refused(format!("MSI-X: {e}")))?
            .remove(0);
        let loss = function
            .loss_fd()
            .map(|fd| rustix::io::fcntl_dupfd_cloexec(fd, 0))
            .transpose()
            .map_err(|e| refused(format!("the device's loss descriptor: {e}")))?;
        let transport = HostedTransport::new(pci, DeviceType::Block);
        let failed = transport.failed();
        let cx = Arc::new(
            Context::new(function.dma().clone(), (DEPTH + 1) * MAX_TRANSFER)
                .map_err(|e| refused(format!("DMA memory: {e}")))?,
        );
        let blk = within(&cx, || VirtIOBlk::<OutboardHal, _>::new(transport))
            .map_err(|e| refused(format!("the crate's driver did not start: {e}")))?;
        let blk = ManuallyDrop::new(blk);
        let per_request = if offered & outboard_spec::virtio::feature::RING_INDIRECT_DESC != 0 {
            1
        } else {
            3
        };
        if let Some(why) = failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(refused(why));
        }
        let info = BlockInfo {
            name: name.into(),
            capacity: blk.capacity() / sectors_per_block,
            block_size,
            read_only: blk.readonly(),
            // The crate's queue has 16 descriptors; a request takes one when the device takes
            // indirect descriptors (the crate then uses them), three when not.
            queue_depth: DEPTH.min(usize::from(blk.virt_queue_size()) / per_request) as u32,
            max_transfer: MAX_TRANSFER as u32,
            supports: Supports {
                flush: true,
                discard: true,
                write_zeroes: true,
            },
        };
        Ok(Self {
            free_slots: (0..info.queue_depth as usize).rev().collect(),
            blk,
            cx,
            failed,
            function,
            irq,
            loss,
            info,
            sectors_per_block,
            in_flight: HashMap::new(),
            barriers: VecDeque::new(),
        })
    }

    /// A register access failed in a call into the crate: the device is gone.
    fn check(&self) -> Result<(), Failure> {
        match self.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(why) => Err(Failure::Driver(why)),
            None => Ok(()),
        }
    }

    /// Runs a request that waits for the device to be idle, with the crate's blocking calls.
    fn run_barrier(&mut self, b: &Barrier) -> Result<u32, BlockError> {
        let cx = self.cx.clone();
        match b.op {
            BlockOp::Flush => within(&cx, || self.blk.flush())
                .map(|()| 0)
                .map_err(crate_error),
            BlockOp::Discard | BlockOp::WriteZeroes => {
                // SAFETY: the zero slot is never handed out to a request, and this is its only
                // slice while the crate's blocking writes run.
                let zeros = unsafe { cx.pool_slice(ZEROS * MAX_TRANSFER, MAX_TRANSFER) }
                    .expect("the zero slot lies in the pool");
                let mut sector = b.sector;
                let mut left = b.bytes;
                while left > 0 {
                    // MAX_TRANSFER is whole logical blocks (checked at start).
                    let n = left.min(MAX_TRANSFER);
                    within(&cx, || self.blk.write_blocks(sector as usize, &zeros[..n]))
                        .map_err(crate_error)?;
                    sector += (n / SECTOR_SIZE) as u64;
                    left -= n;
                }
                Ok(0)
            }
            _ => Err(BlockError::Unsupported),
        }
    }
}

impl Drop for HostedBlk {
    fn drop(&mut self) {
        let cx = self.cx.clone();
        // SAFETY: dropped once, here, and never used after.
        within(&cx, || unsafe { ManuallyDrop::drop(&mut self.blk) });
    }
}

impl std::fmt::Debug for HostedBlk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostedBlk")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl Driver for HostedBlk {
    fn driver_name(&self) -> &'static str {
        PERSONALITY.driver
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        let mut v = vec![(DeviceEvent::Interrupt(0), self.irq.fd())];
        if let Some(l) = &self.loss {
            v.push((DeviceEvent::Lost, l.as_fd()));
        }
        v
    }

    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure> {
        match event {
            DeviceEvent::Lost => Err(Failure::Lost),
            _ => {
                self.irq.ack();
                Ok(())
            }
        }
    }

    fn abandon(&mut self) -> Fence {
        if self.function.abandon() {
            Fence::Now
        } else {
            Fence::AtReopen
        }
    }
}

impl BlockDriver for HostedBlk {
    fn info(&self) -> &BlockInfo {
        &self.info
    }

    fn has_room(&self) -> bool {
        self.barriers.is_empty() && !self.free_slots.is_empty()
    }

    fn in_flight(&self) -> usize {
        self.in_flight.len() + self.barriers.len()
    }

    fn submit(&mut self, r: &BlockRequest, iova_base: u64, tag: u64) -> Result<(), BlockError> {
        let len = r.blocks as usize * self.info.block_size as usize;
        // A flush names no blocks (its lba is not checked): only a range is put in sectors,
        // and a range past what sectors can count is out of range.
        let sector = match r.op {
            BlockOp::Flush => 0,
            _ => r
                .lba
                .checked_mul(self.sectors_per_block)
                .ok_or(BlockError::OutOfRange)?,
        };
        let write = match r.op {
            BlockOp::Read => false,
            BlockOp::Write => true,
            BlockOp::Flush | BlockOp::Discard | BlockOp::WriteZeroes => {
                self.barriers.push_back(Barrier {
                    tag,
                    op: r.op,
                    sector,
                    bytes: len,
                });
                return Ok(());
            }
            _ => return Err(BlockError::Unsupported),
        };
        if len == 0 || len > MAX_TRANSFER {
            return Err(BlockError::Invalid(format!(
                "{len} bytes in one request: this driver takes 1 to {MAX_TRANSFER}"
            )));
        }
        let (mem, offset) = self
            .function
            .dma()
            .memory_at(iova_base + r.buf_offset, len as u64)
            .ok_or(BlockError::BadBuffer)?;
        let slot = self.free_slots.pop().ok_or(BlockError::QueueFull)?;
        let at = slot * MAX_TRANSFER;
        let cx = self.cx.clone();
        if write {
            if let Err(e) = mem.copy_to(offset, cx.pool(), at as u64, len) {
                self.free_slots.push(slot);
                return Err(BlockError::Invalid(format!("the buffer area: {e}")));
            }
        }
        let mut f = InFlight {
            tag,
            write,
            slot,
            len,
            dest: (!write).then_some((mem, offset)),
            req: Box::default(),
            resp: Box::default(),
        };
        // SAFETY: the slot was free: this request's alone until it completes.
        let buf = unsafe { cx.pool_slice(at, len) }.expect("a slot lies in the pool");
        // SAFETY: the request header, status and slot stay where they are, untouched, until
        // complete_*_blocks with the same three (InFlight keeps the boxes; the slot is this
        // request's until it completes).
        let token = within(&cx, || unsafe {
            if write {
                self.blk
                    .write_blocks_nb(sector as usize, &mut f.req, buf, &mut f.resp)
            } else {
                self.blk
                    .read_blocks_nb(sector as usize, &mut f.req, buf, &mut f.resp)
            }
        });
        match token {
            Ok(t) => {
                self.in_flight.insert(t, f);
                Ok(())
            }
            Err(e) => {
                self.free_slots.push(slot);
                Err(crate_error(e))
            }
        }
    }

    fn kick(&mut self) -> Result<(), Failure> {
        // The crate notifies the device as it adds each request.
        self.check()
    }

    fn poll(&mut self, out: &mut Vec<(u64, Result<u32, BlockError>)>) -> Result<usize, Failure> {
        let before = out.len();
        let cx = self.cx.clone();
        while let Some(token) = within(&cx, || self.blk.peek_used()) {
            let Some(mut f) = self.in_flight.remove(&token) else {
                return Err(Failure::Driver(format!(
                    "the device completed descriptor chain {token}, which the driver did not send"
                )));
            };
            let at = f.slot * MAX_TRANSFER;
            // SAFETY: the slot is this request's; the slice the crate had is no longer used.
            let buf = unsafe { cx.pool_slice(at, f.len) }.expect("a slot lies in the pool");
            // SAFETY: the same header, slot and status as the request was sent with.
            let done = within(&cx, || unsafe {
                if f.write {
                    self.blk
                        .complete_write_blocks(token, &f.req, buf, &mut f.resp)
                } else {
                    self.blk
                        .complete_read_blocks(token, &f.req, buf, &mut f.resp)
                }
            });
            let mut result = done.map(|()| f.len as u32).map_err(crate_error);
            if let (Ok(_), Some((mem, offset))) = (&result, &f.dest) {
                if let Err(e) = cx.pool().copy_to(at as u64, mem, *offset, f.len) {
                    result = Err(BlockError::Invalid(format!("the buffer area: {e}")));
                }
            }
            self.free_slots.push(f.slot);
            out.push((f.tag, result));
        }
        // Requests that wait for an idle device, in order, once it is.
        while self.in_flight.is_empty() {
            let Some(b) = self.barriers.pop_front() else {
                break;
            };
            let result = self.run_barrier(&b);
            out.push((b.tag, result));
        }
        self.check()?;
        Ok(out.len() - before)
    }

    fn arm(&mut self) -> Result<bool, Failure> {
        let cx = self.cx.clone();
        let waiting = within(&cx, || self.blk.peek_used()).is_some();
        Ok(waiting || (self.in_flight.is_empty() && !self.barriers.is_empty()))
    }
}

fn start(p: Provider, o: &StartOptions) -> Result<Box<dyn AnyDriver>, StartError> {
    let Provider::Pci(f) = p else {
        return Err(StartError::NoMatch(
            "virtio-drivers-blk drives PCI functions".into(),
        ));
    };
    Ok(outboard_block::bind(HostedBlk::start(&o.name, f)?))
}

/// The crate's block driver in the catalog. Its score is below the native driver's: it drives
/// a virtio-blk device when named (`--driver NAME=virtio-drivers-blk`).
pub const PERSONALITY: Personality = Personality {
    driver: "virtio-drivers-blk",
    class: outboard_block::CLASS,
    score: 500,
    // The device is the native driver's: the same passive match and active probe.
    matches: crate::personality::virtio_blk_matches,
    probe: crate::personality::virtio_blk_probe,
    start,
    faults: &[],
    library: None,
};
