//! The `colocated` placement: the driver linked into the client's process (Fluke "D"), the
//! same [`BlockDevice`] API as a session, no IPC. The baseline every benchmark compares with.
//!
//! The client's thread is the driver's environment here: a [`Waiter`] on the driver's event
//! sources stands in for the driver server's loop.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use outboard_block::validate;
use outboard_block::{
    BlockCompletion, BlockDevice, BlockDriver, BlockError, BlockInfo, BlockRequest,
};
use outboard_drivers::{Attachment, StartError, Started};
use outboard_env::{DeviceEnv, Failure, Mapping, WaitError, Waiter};
use outboard_shm::SharedMem;

/// A block device driven in this process.
pub struct Colocated {
    driver: Box<dyn BlockDriver>,
    waiter: Waiter,
    buffers: Arc<SharedMem>,
    dma: Mapping,
    tags: HashSet<u64>,
    ready: Vec<BlockCompletion>,
    scratch: Vec<(u64, Result<u32, BlockError>)>,
}

/// The class error for a device its driver found failed.
fn failed(f: Failure) -> BlockError {
    BlockError::DeviceFailed(f.to_string())
}

/// The class error for a driver that could not be started.
pub fn start_error(e: StartError) -> BlockError {
    match e {
        StartError::Busy(m) => BlockError::Busy(format!("{m}: another client drives this device")),
        StartError::Unreachable(m) => BlockError::Unreachable(m),
        e => BlockError::DeviceFailed(e.to_string()),
    }
}

impl Colocated {
    /// Opens the device at `at`, starts its driver here (the best match), and maps a buffer
    /// area of `buffer_size` bytes into the device's DMA space.
    pub fn open(name: &str, at: &Attachment, buffer_size: usize) -> Result<Self, BlockError> {
        let Started { driver, env, .. } =
            outboard_drivers::start_colocated(name, at).map_err(start_error)?;
        let d = outboard_block::unbind(driver).map_err(|e| BlockError::Protocol(e.to_string()))?;
        Self::with_driver(d, &env, buffer_size)
    }

    /// Wraps a driver already started.
    pub fn with_driver(
        driver: Box<dyn BlockDriver>,
        env: &DeviceEnv,
        buffer_size: usize,
    ) -> Result<Self, BlockError> {
        let buffers = Arc::new(
            SharedMem::create("outboard-colocated", buffer_size.div_ceil(4096) * 4096)
                .map_err(|e| BlockError::Protocol(e.to_string()))?,
        );
        let dma = env
            .map(buffers.clone())
            .map_err(|e| BlockError::Protocol(e.to_string()))?;
        let waiter =
            Waiter::new(driver.sources()).map_err(|e| BlockError::Protocol(e.to_string()))?;
        Ok(Self {
            driver,
            waiter,
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

    fn poll_driver(&mut self) -> Result<usize, BlockError> {
        self.driver.poll(&mut self.scratch).map_err(failed)
    }
}

impl BlockDevice for Colocated {
    fn info(&self) -> &BlockInfo {
        self.driver.info()
    }

    fn buffers(&self) -> &SharedMem {
        &self.buffers
    }

    fn submit(&mut self, r: &BlockRequest) -> Result<(), BlockError> {
        validate(r, self.driver.info(), self.buffers.len() as u64)?;
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
            if !self.driver.has_room() {
                return Err(BlockError::QueueFull);
            }
            self.driver.submit(r, self.dma.iova(), r.tag)?;
        }
        self.tags.insert(r.tag);
        Ok(())
    }

    fn kick(&mut self) -> Result<(), BlockError> {
        self.driver.kick().map_err(failed)
    }

    fn poll(&mut self, out: &mut Vec<BlockCompletion>) -> Result<usize, BlockError> {
        self.poll_driver()?;
        Ok(self.reap(out))
    }

    fn block_until(&mut self, deadline: Instant) -> Result<(), BlockError> {
        // Arm, then re-check before sleeping, so a completion between the two is not lost.
        if self.driver.arm().map_err(failed)? {
            return Ok(());
        }
        let driver = &mut self.driver;
        self.waiter
            .wait_and_handle(deadline.saturating_duration_since(Instant::now()), |ev| {
                driver.handle(ev)
            })
            .map_err(|e| match e {
                WaitError::Failed(f) => failed(f),
                WaitError::Loop(e) => BlockError::Protocol(e.to_string()),
            })
    }

    fn in_flight(&self) -> usize {
        self.tags.len()
    }
}
