//! Virtio block device model (virtio v1.2 §5.2), behind [`crate::virtio_pci::VirtioPci`].
//!
//! Requests: IN, OUT, FLUSH, GET_ID, DISCARD, WRITE_ZEROES, on any number of queues. Data moves
//! between the backing fd and client DMA memory with `pread`/`pwrite` straight into the mapped
//! buffers: no copy in the device. A buffer outside the client's DMA map, a range past the end
//! of the disk, a length that is not whole sectors, or a write to a read-only disk completes
//! with `VIRTIO_BLK_S_IOERR`; an unknown request type with `UNSUPP`. A chain so broken that it
//! has no status byte is returned with a used length of 0.
//!
//! Fault injection ([`crate::faults`]) lets tests play bad hardware; this model fires the
//! request faults (a failing sector range, the next N requests failing), the transport the
//! rest.

use outboard_spec::virtio::{self, feature as vfeature};
use outboard_spec::virtio_blk::{config, feature, req, status, SECTOR_SIZE};
use outboard_vfio_user::{DmaError, DmaMap};
use zerocopy::{FromZeros, IntoBytes};

use crate::backing::Backing;
use crate::virtio_pci::VirtioDevice;
use crate::virtqueue::{Chain, DeviceQueue, QueueError, Segment};

/// Largest queue the device offers.
pub const QUEUE_SIZE: u16 = 256;
/// Most data segments per request (SEG_MAX): a queue's worth minus header and status.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Largest single segment (SIZE_MAX).
pub const SIZE_MAX: u32 = 1 << 20;
/// Most sectors per discard / write-zeroes segment.
pub const MAX_ZERO_SECTORS: u32 = 1 << 22;

pub use crate::faults::{FaultHandle, Faults};

/// Per-device counters.
#[derive(Debug, Default, Clone, Copy)]
pub struct BlkStats {
    /// Read requests completed OK.
    pub reads: u64,
    /// Write requests completed OK.
    pub writes: u64,
    /// Flushes completed OK.
    pub flushes: u64,
    /// Requests completed with IOERR or UNSUPP.
    pub errors: u64,
    /// Bytes moved.
    pub bytes: u64,
}

/// Options for a new disk.
#[derive(Debug, Clone)]
pub struct BlkOptions {
    /// Refuse writes.
    pub read_only: bool,
    /// Number of request queues.
    pub num_queues: u16,
    /// Serial number returned by GET_ID (at most 20 bytes).
    pub serial: String,
}

impl Default for BlkOptions {
    fn default() -> Self {
        Self {
            read_only: false,
            num_queues: 1,
            serial: "outboard-blk".into(),
        }
    }
}

/// The block device model.
#[derive(Debug)]
pub struct VirtioBlk {
    backing: Backing,
    opts: BlkOptions,
    features: u64,
    faults: FaultHandle,
    stats: BlkStats,
    /// The chain being served, kept so its segment list is not allocated per request.
    chain: Chain,
}

struct Outcome {
    status: u8,
    written: u32,
}

impl VirtioBlk {
    /// A disk over `backing`.
    pub fn new(backing: Backing, opts: BlkOptions) -> Self {
        Self {
            backing,
            opts: BlkOptions {
                num_queues: opts.num_queues.max(1),
                ..opts
            },
            features: 0,
            faults: std::sync::Arc::new(std::sync::Mutex::new(crate::faults::Faults {
                sector_faults: true,
                ..Default::default()
            })),
            stats: BlkStats::default(),
            chain: Chain::default(),
        }
    }

    /// The fault-injection handle (clone it before handing the model to a server).
    pub fn faults(&self) -> FaultHandle {
        self.faults.clone()
    }

    /// Counters.
    pub fn stats(&self) -> BlkStats {
        self.stats
    }

    /// The backing store.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    fn capacity_sectors(&self) -> u64 {
        self.backing.len() / SECTOR_SIZE
    }

    /// Checks `[sector, sector + bytes/512)` against the disk and injected faults.
    fn check_range(&self, sector: u64, bytes: u64) -> Result<(), u8> {
        if !bytes.is_multiple_of(SECTOR_SIZE) {
            return Err(status::IOERR);
        }
        let end = sector
            .checked_add(bytes / SECTOR_SIZE)
            .ok_or(status::IOERR)?;
        if end > self.capacity_sectors() {
            return Err(status::IOERR);
        }
        let touches = |s: Option<u64>| s.is_some_and(|s| sector <= s && s < end.max(sector + 1));
        let mut faults = crate::faults::lock(&self.faults);
        if touches(faults.abort_on) {
            // The fault injected: this request kills the device, every time it comes.
            eprintln!("outboard: injected fault: a request touched sector {sector}..{end}: abort");
            std::process::abort();
        }
        if touches(faults.hang_on) {
            drop(faults);
            // The fault injected: this request hangs the device, every time it comes (the
            // fault socket still answers: it has its own lock and thread).
            eprintln!("outboard: injected fault: a request touched sector {sector}..{end}: hang");
            std::thread::sleep(std::time::Duration::from_secs(3600));
            return Err(status::IOERR);
        }
        if let Some(f) = &faults.fail_sectors {
            if sector < f.end && f.start < end.max(sector + 1) {
                return Err(status::IOERR);
            }
        }
        if Faults::spend(&mut faults.fail_next) {
            return Err(status::IOERR);
        }
        Ok(())
    }

    fn handle(&mut self, chain: &Chain, dma: &DmaMap) -> Outcome {
        let readable = chain.readable_len();
        let writable = chain.writable_len();
        if readable < req::HEADER_SIZE as u64 || writable < 1 {
            return Outcome {
                status: status::IOERR,
                written: 0,
            };
        }
        let mut header = req::Header::new_zeroed();
        if gather(dma, readable_segments(chain), 0, header.as_mut_bytes()).is_err() {
            return Outcome {
                status: status::IOERR,
                written: 0,
            };
        }
        let (kind, sector) = (header.kind.get(), header.sector.get());
        let out_len = readable - req::HEADER_SIZE as u64;
        let in_len = writable - 1;
        let result = match kind {
            req::IN => self
                .read(chain, dma, sector, in_len)
                .map(|()| in_len as u32),
            req::OUT => self.write(chain, dma, sector, out_len).map(|()| 0),
            req::FLUSH => self.backing.flush().map(|()| 0).map_err(|_| status::IOERR),
            req::GET_ID => {
                let mut id = [0u8; req::ID_BYTES as usize];
                let n = self.opts.serial.len().min(id.len());
                id[..n].copy_from_slice(&self.opts.serial.as_bytes()[..n]);
                let take = in_len.min(req::ID_BYTES as u64) as usize;
                scatter(dma, writable_segments(chain), 0, &id[..take])
                    .map(|()| take as u32)
                    .map_err(|_| status::IOERR)
            }
            req::DISCARD | req::WRITE_ZEROES
                if self.features & (feature::DISCARD | feature::WRITE_ZEROES) != 0 =>
            {
                self.zero_ranges(chain, dma, kind, out_len)
            }
            _ => Err(status::UNSUPP),
        };
        let (st, written) = match result {
            Ok(n) => {
                match kind {
                    req::IN => self.stats.reads += 1,
                    req::OUT => self.stats.writes += 1,
                    req::FLUSH => self.stats.flushes += 1,
                    _ => {}
                }
                (status::OK, n)
            }
            Err(s) => {
                self.stats.errors += 1;
                (s, 0)
            }
        };
        // The status byte is the last writable byte of the chain.
        if scatter(dma, writable_segments(chain), in_len, &[st]).is_err() {
            return Outcome {
                status: st,
                written: 0,
            };
        }
        Outcome {
            status: st,
            written: written + 1,
        }
    }

    fn read(&mut self, chain: &Chain, dma: &DmaMap, sector: u64, len: u64) -> Result<(), u8> {
        self.check_range(sector, len)?;
        let mut file_off = sector * SECTOR_SIZE;
        for (addr, n) in pieces(writable_segments(chain), 0, len) {
            match dma.translate(addr, n as u64, true) {
                Ok((mem, off)) => {
                    let got = mem
                        .pread_from(self.backing.fd(), file_off, off, n as usize)
                        .map_err(|_| status::IOERR)?;
                    if got < n as usize {
                        mem.fill(off + got as u64, n as usize - got, 0)
                            .map_err(|_| status::IOERR)?;
                    }
                }
                Err(DmaError::InBand { .. }) => {
                    let mut buf = vec![0u8; n as usize];
                    rustix::io::pread(self.backing.fd(), &mut buf, file_off)
                        .map_err(|_| status::IOERR)?;
                    dma.write(addr, &buf).map_err(|_| status::IOERR)?;
                }
                Err(_) => return Err(status::IOERR),
            }
            file_off += n as u64;
        }
        self.stats.bytes += len;
        Ok(())
    }

    fn write(&mut self, chain: &Chain, dma: &DmaMap, sector: u64, len: u64) -> Result<(), u8> {
        if self.opts.read_only {
            return Err(status::IOERR);
        }
        self.check_range(sector, len)?;
        let mut file_off = sector * SECTOR_SIZE;
        for (addr, n) in pieces(readable_segments(chain), req::HEADER_SIZE as u64, len) {
            match dma.translate(addr, n as u64, false) {
                Ok((mem, off)) => mem
                    .pwrite_to(self.backing.fd(), file_off, off, n as usize)
                    .map_err(|_| status::IOERR)?,
                Err(DmaError::InBand { .. }) => {
                    let mut buf = vec![0u8; n as usize];
                    dma.read(addr, &mut buf).map_err(|_| status::IOERR)?;
                    rustix::io::pwrite(self.backing.fd(), &buf, file_off)
                        .map_err(|_| status::IOERR)?;
                }
                Err(_) => return Err(status::IOERR),
            }
            file_off += n as u64;
        }
        self.stats.bytes += len;
        Ok(())
    }

    fn zero_ranges(&mut self, chain: &Chain, dma: &DmaMap, kind: u32, len: u64) -> Result<u32, u8> {
        let want = if kind == req::DISCARD {
            feature::DISCARD
        } else {
            feature::WRITE_ZEROES
        };
        if self.features & want == 0 {
            return Err(status::UNSUPP);
        }
        if self.opts.read_only {
            return Err(status::IOERR);
        }
        if len == 0
            || !len.is_multiple_of(req::SEGMENT_SIZE as u64)
            || len / req::SEGMENT_SIZE as u64 > 1
        {
            // max_discard_seg = max_write_zeroes_seg = 1
            return Err(status::UNSUPP);
        }
        let mut seg = req::Segment::new_zeroed();
        gather(
            dma,
            readable_segments(chain),
            req::HEADER_SIZE as u64,
            seg.as_mut_bytes(),
        )
        .map_err(|_| status::IOERR)?;
        let (sector, count, flags) = (seg.sector.get(), seg.num_sectors.get(), seg.flags.get());
        if flags & !req::SEGMENT_F_UNMAP != 0
            || (kind == req::DISCARD && flags != 0)
            || count > MAX_ZERO_SECTORS
        {
            return Err(status::UNSUPP);
        }
        let bytes = count as u64 * SECTOR_SIZE;
        self.check_range(sector, bytes)?;
        let r = if kind == req::DISCARD {
            self.backing.discard(sector * SECTOR_SIZE, bytes)
        } else {
            self.backing.zero(sector * SECTOR_SIZE, bytes)
        };
        r.map(|()| 0).map_err(|_| status::IOERR)
    }
}

fn readable_segments(chain: &Chain) -> impl Iterator<Item = &Segment> + Clone {
    chain.segments.iter().filter(|s| !s.write)
}

fn writable_segments(chain: &Chain) -> impl Iterator<Item = &Segment> + Clone {
    chain.segments.iter().filter(|s| s.write)
}

/// The `(addr, len)` pieces covering bytes `[skip, skip + take)` of a segment list, computed
/// as they are taken (nothing is allocated per request).
fn pieces<'a, I: Iterator<Item = &'a Segment>>(
    segs: I,
    skip: u64,
    take: u64,
) -> impl Iterator<Item = (u64, u32)> + use<'a, I> {
    let end = skip + take;
    segs.scan(0u64, move |pos, s| {
        let start = *pos;
        *pos += s.len as u64;
        (start < end).then_some((start, s))
    })
    .filter_map(move |(start, s)| {
        let (lo, hi) = (start.max(skip), (start + s.len as u64).min(end));
        (lo < hi).then(|| (s.addr + (lo - start), (hi - lo) as u32))
    })
}

fn gather<'a>(
    dma: &DmaMap,
    segs: impl Iterator<Item = &'a Segment>,
    skip: u64,
    buf: &mut [u8],
) -> Result<(), DmaError> {
    let mut at = 0;
    for (addr, n) in pieces(segs, skip, buf.len() as u64) {
        dma.read(addr, &mut buf[at..at + n as usize])?;
        at += n as usize;
    }
    Ok(())
}

fn scatter<'a>(
    dma: &DmaMap,
    segs: impl Iterator<Item = &'a Segment>,
    skip: u64,
    data: &[u8],
) -> Result<(), DmaError> {
    let mut at = 0;
    for (addr, n) in pieces(segs, skip, data.len() as u64) {
        dma.write(addr, &data[at..at + n as usize])?;
        at += n as usize;
    }
    Ok(())
}

impl VirtioDevice for VirtioBlk {
    fn faults(&self) -> FaultHandle {
        self.faults.clone()
    }

    fn device_id(&self) -> u16 {
        virtio::DEVICE_ID_BLOCK
    }

    fn class(&self) -> u32 {
        0x01_80_00 // mass storage, other
    }

    fn features(&self) -> u64 {
        let mut f = feature::SIZE_MAX
            | feature::SEG_MAX
            | feature::BLK_SIZE
            | feature::FLUSH
            | feature::DISCARD
            | feature::WRITE_ZEROES
            | vfeature::RING_EVENT_IDX
            | vfeature::RING_INDIRECT_DESC;
        if self.opts.num_queues > 1 {
            f |= feature::MQ;
        }
        if self.opts.read_only {
            f |= feature::RO;
        }
        f
    }

    fn num_queues(&self) -> u16 {
        self.opts.num_queues
    }

    fn max_queue_size(&self) -> u16 {
        QUEUE_SIZE
    }

    fn config(&self) -> Vec<u8> {
        let mut c = vec![0u8; config::SIZE as usize];
        let mut put = |off: u64, bytes: &[u8]| {
            c[off as usize..off as usize + bytes.len()].copy_from_slice(bytes)
        };
        put(config::CAPACITY, &self.capacity_sectors().to_le_bytes());
        put(config::SIZE_MAX, &SIZE_MAX.to_le_bytes());
        put(config::SEG_MAX, &SEG_MAX.to_le_bytes());
        put(config::BLK_SIZE, &(SECTOR_SIZE as u32).to_le_bytes());
        put(config::NUM_QUEUES, &self.opts.num_queues.to_le_bytes());
        put(config::MAX_DISCARD_SECTORS, &MAX_ZERO_SECTORS.to_le_bytes());
        put(config::MAX_DISCARD_SEG, &1u32.to_le_bytes());
        put(config::DISCARD_SECTOR_ALIGNMENT, &1u32.to_le_bytes());
        put(
            config::MAX_WRITE_ZEROES_SECTORS,
            &MAX_ZERO_SECTORS.to_le_bytes(),
        );
        put(config::MAX_WRITE_ZEROES_SEG, &1u32.to_le_bytes());
        put(config::WRITE_ZEROES_MAY_UNMAP, &[1]);
        c
    }

    fn activate(&mut self, features: u64) {
        self.features = features;
    }

    fn reset(&mut self) {
        self.features = 0;
    }

    fn process(
        &mut self,
        _index: u16,
        queue: &mut DeviceQueue,
        dma: &DmaMap,
    ) -> Result<(), QueueError> {
        let mut chain = std::mem::take(&mut self.chain);
        let served = queue.serve(dma, &mut chain, |c| {
            let out = self.handle(c, dma);
            if out.status != status::OK {
                tracing::debug!("request {} failed with status {}", c.head, out.status);
            }
            out.written
        });
        self.chain = chain;
        served
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_slice_across_segments() {
        let segs = [
            Segment {
                addr: 0x1000,
                len: 16,
                write: false,
            },
            Segment {
                addr: 0x2000,
                len: 512,
                write: false,
            },
            Segment {
                addr: 0x3000,
                len: 512,
                write: false,
            },
        ];
        let all = |skip, take| pieces(segs.iter(), skip, take).collect::<Vec<_>>();
        assert_eq!(all(16, 1024), vec![(0x2000, 512), (0x3000, 512)]);
        assert_eq!(all(8, 16), vec![(0x1008, 8), (0x2000, 8)]);
        assert_eq!(all(0, 0), vec![]);
        assert_eq!(all(1040, 100), vec![]);
        assert_eq!(all(1039, 100), vec![(0x3000 + 511, 1)]);
    }
}
