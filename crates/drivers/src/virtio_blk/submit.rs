//! The submission path: a request checked, written into its slot and the ring, the doorbell.

use super::*;

impl VirtioBlk {
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
        self.enqueue(q, r, bytes)
    }

    /// [`VirtioBlk::submit_ref`] for a caller that has checked the request against what the
    /// device takes already (the block server checks each client request once, against the
    /// same limits, and this is the path it uses): only what protects the driver itself is
    /// checked here (the chain fits the indirect table). A request that breaks the device's
    /// rules anyway is the device's to refuse — virtio-blk answers `IOERR` or `UNSUPP` — never
    /// a hazard to the driver or its memory.
    pub fn submit_prechecked(&mut self, q: usize, r: &BlkRequestRef<'_>) -> Result<(), BlkError> {
        if r.bufs.len() > MAX_SEGMENTS {
            return Err(BlkError::Invalid(format!(
                "{} buffers exceed the limit of {MAX_SEGMENTS}",
                r.bufs.len()
            )));
        }
        let bytes = r.bufs.iter().map(|b| b.1 as u64).sum();
        self.enqueue(q, r, bytes)
    }

    /// Writes the request into its slot and its chain into the ring.
    fn enqueue(&mut self, q: usize, r: &BlkRequestRef<'_>, bytes: u64) -> Result<(), BlkError> {
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
        // both callers), status.
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
}
