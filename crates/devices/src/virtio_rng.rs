//! Virtio entropy device model (virtio v1.2 §5.4), behind [`crate::virtio_pci::VirtioPci`].
//!
//! One queue (`requestq`). The driver makes device-writable buffers available; the device
//! fills each with random bytes and returns it with the number of bytes written (§5.4.6: the
//! device MUST place one or more random bytes into the buffer, but it MAY use less than the
//! entire buffer). No feature bits, no configuration space.
//!
//! The bytes come from the operating system's generator (`getrandom`) or, for tests that must
//! know what a driver should read, from a seeded generator (SplitMix64), whose stream is
//! [`Seeded::fill`]. A chain with a readable buffer, or with nothing writable, is returned
//! with a used length of 0 (the driver sees no bytes, not an error the specification does
//! not have). Fault injection works through the transport, as for every model.

use outboard_spec::virtio;
use outboard_vfio_user::DmaMap;

use crate::faults::FaultHandle;
use crate::virtio_pci::VirtioDevice;
use crate::virtqueue::{DeviceQueue, QueueError};

/// Largest queue the device offers.
pub const QUEUE_SIZE: u16 = 64;
/// Most bytes the device writes per buffer: a driver asking for more gets this many.
pub const MAX_PER_BUFFER: usize = 64 << 10;

/// A deterministic stream of bytes from a seed (SplitMix64, Steele, Lea and Flood 2014): the
/// same seed gives the same bytes, so a test knows what a driver must read.
#[derive(Debug, Clone)]
pub struct Seeded {
    state: u64,
}

impl Seeded {
    /// The stream for `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Fills `buf` with the next bytes of the stream (each 8-byte word little-endian; a
    /// partial word's unused bytes are dropped).
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let w = self.next().to_le_bytes();
            chunk.copy_from_slice(&w[..chunk.len()]);
        }
    }
}

/// Where the random bytes come from.
#[derive(Debug, Clone)]
pub enum Entropy {
    /// The operating system's generator.
    Os,
    /// A seeded stream (tests).
    Seeded(Seeded),
}

impl Entropy {
    fn fill(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            Entropy::Os => {
                let mut done = 0;
                while done < buf.len() {
                    let n = rustix::rand::getrandom(
                        &mut buf[done..],
                        rustix::rand::GetRandomFlags::empty(),
                    )?;
                    done += n;
                }
                Ok(())
            }
            Entropy::Seeded(s) => {
                s.fill(buf);
                Ok(())
            }
        }
    }
}

/// Counters.
#[derive(Debug, Default, Clone, Copy)]
pub struct RngStats {
    /// Buffers filled.
    pub requests: u64,
    /// Bytes written into them.
    pub bytes: u64,
    /// Chains returned empty (malformed, or the buffer was not reachable).
    pub refused: u64,
}

/// The entropy device model.
#[derive(Debug)]
pub struct VirtioRng {
    entropy: Entropy,
    faults: FaultHandle,
    stats: RngStats,
    scratch: Vec<u8>,
    chain: crate::virtqueue::Chain,
}

impl VirtioRng {
    /// A device whose bytes come from `entropy`.
    pub fn new(entropy: Entropy) -> Self {
        Self {
            entropy,
            faults: FaultHandle::default(),
            stats: RngStats::default(),
            scratch: Vec::new(),
            chain: Default::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> RngStats {
        self.stats
    }

    /// Fills a chain's writable buffers; the bytes written (0 for a chain it refuses).
    fn fill(&mut self, chain: &crate::virtqueue::Chain, dma: &DmaMap) -> u32 {
        if chain.readable_len() > 0 || chain.writable_len() == 0 {
            return 0;
        }
        let mut written = 0usize;
        for seg in &chain.segments {
            let room = MAX_PER_BUFFER - written;
            if room == 0 {
                break;
            }
            let n = (seg.len as usize).min(room);
            self.scratch.resize(n, 0);
            if self.entropy.fill(&mut self.scratch[..n]).is_err()
                || dma.write(seg.addr, &self.scratch[..n]).is_err()
            {
                // The bytes before this buffer were written; a driver reads only those.
                break;
            }
            written += n;
        }
        written as u32
    }
}

impl VirtioDevice for VirtioRng {
    fn device_id(&self) -> u16 {
        virtio::DEVICE_ID_ENTROPY
    }

    fn faults(&self) -> FaultHandle {
        self.faults.clone()
    }

    fn class(&self) -> u32 {
        0x10_80_00 // encryption/decryption controller, other
    }

    fn features(&self) -> u64 {
        0
    }

    fn num_queues(&self) -> u16 {
        1
    }

    fn max_queue_size(&self) -> u16 {
        QUEUE_SIZE
    }

    fn config(&self) -> Vec<u8> {
        Vec::new()
    }

    fn activate(&mut self, _features: u64) {}

    fn reset(&mut self) {}

    fn process(
        &mut self,
        _index: u16,
        queue: &mut DeviceQueue,
        dma: &DmaMap,
    ) -> Result<(), QueueError> {
        let mut chain = std::mem::take(&mut self.chain);
        let served = queue.serve(dma, &mut chain, |c| {
            let n = self.fill(c, dma);
            if n == 0 {
                self.stats.refused += 1;
            } else {
                self.stats.requests += 1;
                self.stats.bytes += u64::from(n);
            }
            n
        });
        self.chain = chain;
        served
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seeded_stream_repeats_and_differs_by_seed() {
        let (mut a, mut b, mut c) = (Seeded::new(7), Seeded::new(7), Seeded::new(8));
        let (mut x, mut y, mut z) = ([0u8; 37], [0u8; 37], [0u8; 37]);
        a.fill(&mut x);
        b.fill(&mut y);
        c.fill(&mut z);
        assert_eq!(x, y);
        assert_ne!(x, z);
        // SplitMix64's first output for seed 0 (the published reference value).
        let mut r = Seeded::new(0);
        assert_eq!(r.next(), 0xe220_a839_7b1d_cdaf);
    }
}
