//! The completion path: interrupts armed, completions reaped, waiting on the device's events.

use super::*;

impl VirtioBlk {
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
}
