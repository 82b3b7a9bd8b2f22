//! The `colocated` placement: the driver linked into the client's process (Fluke "D"), the
//! same [`BlockDevice`] API as a session, no IPC. The baseline every benchmark compares with.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outboard_class::block::validate;
use outboard_class::{BlockCompletion, BlockDevice, BlockError, BlockInfo, BlockRequest};
use outboard_hw::{DeviceSpec, DmaBuf};
use outboard_shm::SharedMem;

use crate::blockhost::BlockHost;

/// A block device driven in this process.
pub struct Colocated {
    host: BlockHost,
    buffers: Arc<SharedMem>,
    dma: DmaBuf,
    tags: HashSet<u64>,
    ready: Vec<BlockCompletion>,
    scratch: Vec<(u64, Result<u32, BlockError>)>,
}

impl Colocated {
    /// Opens the device at `spec`, brings its driver up here, and maps a buffer area of
    /// `buffer_size` bytes into the device's DMA space.
    pub fn open(name: &str, spec: &DeviceSpec, buffer_size: usize) -> Result<Self, BlockError> {
        let host = BlockHost::open(name, spec, 1)?;
        Self::with_host(host, buffer_size)
    }

    /// Wraps a driver already brought up.
    pub fn with_host(host: BlockHost, buffer_size: usize) -> Result<Self, BlockError> {
        let buffers = Arc::new(
            SharedMem::create("outboard-colocated", buffer_size.div_ceil(4096) * 4096)
                .map_err(|e| BlockError::Protocol(e.to_string()))?,
        );
        let dma = host
            .driver()
            .function()
            .dma()
            .map_shared(buffers.clone())
            .map_err(|e| BlockError::Protocol(e.to_string()))?;
        Ok(Self {
            host,
            buffers,
            dma,
            tags: HashSet::new(),
            ready: Vec::new(),
            scratch: Vec::new(),
        })
    }

    fn reap(&mut self, out: &mut Vec<BlockCompletion>) -> usize {
        let mut n = 0;
        for c in self.ready.drain(..) {
            self.tags.remove(&c.tag);
            out.push(c);
            n += 1;
        }
        for (tag, result) in self.scratch.drain(..) {
            self.tags.remove(&tag);
            out.push(BlockCompletion { tag, result });
            n += 1;
        }
        n
    }
}

impl BlockDevice for Colocated {
    fn info(&self) -> &BlockInfo {
        self.host.info()
    }

    fn buffers(&self) -> &SharedMem {
        &self.buffers
    }

    fn submit(&mut self, r: &BlockRequest) -> Result<(), BlockError> {
        validate(r, self.host.info(), self.buffers.len() as u64)?;
        if self.tags.contains(&r.tag) {
            return Err(BlockError::DuplicateTag);
        }
        // One client drives a colocated device: a lock has nobody to exclude.
        if r.op.served_by_host() {
            self.ready.push(BlockCompletion {
                tag: r.tag,
                result: Ok(0),
            });
        } else {
            self.host.submit(r, self.dma.iova(), r.tag)?;
        }
        self.tags.insert(r.tag);
        Ok(())
    }

    fn kick(&mut self) -> Result<(), BlockError> {
        self.host.kick()
    }

    fn poll(&mut self, out: &mut Vec<BlockCompletion>) -> Result<usize, BlockError> {
        self.host.poll(&mut self.scratch)?;
        Ok(self.reap(out))
    }

    fn wait(
        &mut self,
        out: &mut Vec<BlockCompletion>,
        timeout: Duration,
    ) -> Result<usize, BlockError> {
        if self.ready.is_empty() && self.host.in_flight() > 0 {
            self.host.wait(&mut self.scratch, timeout)?;
        } else {
            self.host.poll(&mut self.scratch)?;
        }
        Ok(self.reap(out))
    }

    fn in_flight(&self) -> usize {
        self.tags.len()
    }
}
