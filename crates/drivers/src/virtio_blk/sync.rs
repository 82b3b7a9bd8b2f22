//! Synchronous conveniences on top of submit and poll (self-test, tools), and tear-down.

use super::*;

impl VirtioBlk {
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

    pub(super) fn stop_device(&mut self) -> Result<(), BlkError> {
        Ok(self.device.stop()?)
    }
}
