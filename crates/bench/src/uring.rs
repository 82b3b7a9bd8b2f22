//! The kernel's block path as a [`BlockDevice`]: a block device (a loop device) opened with
//! O_DIRECT and driven through io_uring, so the trace replay runs the very same event loop on
//! the kernel as on Outboard's placements.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::time::Instant;

use io_uring::{opcode, types, IoUring};
use outboard_block::validate;
use outboard_block::{BlockCompletion, BlockDevice, BlockError, BlockInfo, BlockOp, BlockRequest};
use outboard_shm::SharedMem;
use rustix::fs::{Mode, OFlags};

/// Requests in flight at most (the ring's size).
const DEPTH: u32 = 128;

/// A kernel block device behind io_uring.
pub struct UringDisk {
    ring: IoUring,
    fd: OwnedFd,
    buffers: SharedMem,
    info: BlockInfo,
    in_flight: usize,
}

impl UringDisk {
    /// Opens `dev` (e.g. `/dev/loop0`) with O_DIRECT, `bytes` long, with a buffer area of
    /// `buffer_size` bytes.
    pub fn open(dev: &Path, bytes: u64, buffer_size: usize) -> Result<Self, String> {
        let fd = rustix::fs::open(
            dev,
            OFlags::RDWR | OFlags::DIRECT | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| format!("{}: {e}", dev.display()))?;
        Ok(Self {
            ring: IoUring::new(DEPTH).map_err(|e| format!("io_uring: {e}"))?,
            fd,
            // Page-aligned, as O_DIRECT wants.
            buffers: SharedMem::heap(buffer_size).map_err(|e| e.to_string())?,
            info: BlockInfo {
                name: dev.display().to_string(),
                capacity: bytes / 512,
                block_size: 512,
                read_only: false,
                queue_depth: DEPTH,
                max_transfer: 0,
                supports: Default::default(),
            },
            in_flight: 0,
        })
    }
}

impl Drop for UringDisk {
    fn drop(&mut self) {
        // The kernel may still be writing into the buffer area: wait for it before it goes.
        while self.in_flight > 0 {
            if self.ring.submit_and_wait(1).is_err() {
                break;
            }
            self.in_flight -= self.ring.completion().count().min(self.in_flight);
        }
    }
}

impl BlockDevice for UringDisk {
    fn info(&self) -> &BlockInfo {
        &self.info
    }

    fn buffers(&self) -> &SharedMem {
        &self.buffers
    }

    fn submit(&mut self, r: &BlockRequest) -> Result<(), BlockError> {
        validate(r, &self.info, self.buffers.len() as u64)?;
        if self.in_flight >= DEPTH as usize {
            return Err(BlockError::QueueFull);
        }
        let fd = types::Fd(self.fd.as_raw_fd());
        let len = r.blocks * self.info.block_size;
        let at = r.lba * self.info.block_size as u64;
        let entry = match r.op {
            BlockOp::Read | BlockOp::Write => {
                let ptr = self
                    .buffers
                    .io_ptr(r.buf_offset, len as usize)
                    .map_err(|_| BlockError::BadBuffer)?;
                if r.op == BlockOp::Read {
                    opcode::Read::new(fd, ptr, len).offset(at).build()
                } else {
                    opcode::Write::new(fd, ptr, len).offset(at).build()
                }
            }
            BlockOp::Flush => opcode::Fsync::new(fd).build(),
            _ => return Err(BlockError::Unsupported),
        };
        // SAFETY: the buffer lies inside `self.buffers` (bounds-checked by `io_ptr`), which
        // lives as long as `self`; `Drop` waits for every request in flight before the buffer
        // area is freed, and the replay hands a piece of the area to one request at a time.
        unsafe { self.ring.submission().push(&entry.user_data(r.tag)) }
            .map_err(|_| BlockError::QueueFull)?;
        self.in_flight += 1;
        Ok(())
    }

    fn kick(&mut self) -> Result<(), BlockError> {
        self.ring
            .submit()
            .map(|_| ())
            .map_err(|e| BlockError::Protocol(format!("io_uring: {e}")))
    }

    fn poll(&mut self, out: &mut Vec<BlockCompletion>) -> Result<usize, BlockError> {
        let before = out.len();
        for c in self.ring.completion() {
            self.in_flight -= 1;
            out.push(BlockCompletion {
                tag: c.user_data(),
                result: if c.result() >= 0 {
                    Ok(c.result() as u32)
                } else {
                    Err(BlockError::Io(
                        std::io::Error::from_raw_os_error(-c.result()).to_string(),
                    ))
                },
            });
        }
        Ok(out.len() - before)
    }

    fn block_until(&mut self, _deadline: Instant) -> Result<(), BlockError> {
        // A disk answers: its completion is the bound.
        self.ring
            .submit_and_wait(1)
            .map_err(|e| BlockError::Protocol(format!("io_uring: {e}")))?;
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}
