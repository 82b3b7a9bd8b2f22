//! The `colocated` placement for the entropy class: the driver linked into this process, its
//! device's buffers a memory area of this process mapped for the device.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_drivers::Attachment;
use outboard_env::{Mapping, Waiter};
use outboard_hw::DeviceSpec;
use outboard_rng::{EntropyDevice, EntropyDriver, EntropyError, EntropyInfo};
use outboard_shm::SharedMem;

/// An entropy device driven in this process.
pub struct Colocated {
    driver: Box<dyn EntropyDriver>,
    waiter: Waiter,
    buffers: Arc<SharedMem>,
    dma: Mapping,
    done: Vec<(u64, Result<u32, EntropyError>)>,
}

impl Colocated {
    /// Starts the entropy driver on the device at `device`, here.
    pub fn open(name: &str, device: DeviceSpec) -> Result<Self, EntropyError> {
        let started = outboard_drivers::start_colocated(name, &Attachment::Pci(device))
            .map_err(|e| EntropyError::DeviceFailed(e.to_string()))?;
        let driver = outboard_rng::unbind(started.driver)
            .map_err(|e| EntropyError::Protocol(e.to_string()))?;
        let buffers = Arc::new(
            SharedMem::create("outboard-rng-colocated", super::BUFFER as usize)
                .map_err(|e| EntropyError::Protocol(e.to_string()))?,
        );
        let dma = started
            .env
            .map(buffers.clone())
            .map_err(|e| EntropyError::Protocol(e.to_string()))?;
        let waiter =
            Waiter::new(driver.sources()).map_err(|e| EntropyError::Protocol(e.to_string()))?;
        Ok(Self {
            driver,
            waiter,
            buffers,
            dma,
            done: Vec::new(),
        })
    }

    fn one(&mut self, length: u32) -> Result<u32, EntropyError> {
        self.driver.submit(self.dma.iova(), length, 0)?;
        self.driver
            .kick()
            .map_err(|f| EntropyError::DeviceFailed(f.to_string()))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.done.clear();
            self.driver
                .poll(&mut self.done)
                .map_err(|f| EntropyError::DeviceFailed(f.to_string()))?;
            if let Some((_, r)) = self.done.pop() {
                return r;
            }
            if self
                .driver
                .arm()
                .map_err(|f| EntropyError::DeviceFailed(f.to_string()))?
            {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(EntropyError::Timeout);
            }
            let driver = &mut self.driver;
            self.waiter
                .wait_and_handle(deadline - now, |ev| driver.handle(ev))
                .map_err(|e| EntropyError::DeviceFailed(e.to_string()))?;
        }
    }
}

impl EntropyDevice for Colocated {
    fn info(&self) -> &EntropyInfo {
        self.driver.info()
    }

    fn read(&mut self, out: &mut [u8]) -> Result<(), EntropyError> {
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done)
                .min(self.driver.info().max_read as usize)
                .min(self.buffers.len()) as u32;
            let got = self.one(want)? as usize;
            self.buffers
                .read(0, &mut out[done..done + got])
                .map_err(|e| EntropyError::Protocol(e.to_string()))?;
            done += got;
        }
        Ok(())
    }
}
