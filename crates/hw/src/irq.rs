//! Interrupt vectors as eventfds.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::event::{EventfdFlags, PollFd, PollFlags};
use rustix::io::Errno;

use crate::{HwError, Result};

/// One interrupt vector: the device (or the kernel, for VFIO) signals this eventfd.
#[derive(Debug)]
pub struct Irq {
    vector: u32,
    fd: OwnedFd,
}

impl Irq {
    pub(crate) fn new(vector: u32) -> Result<Self> {
        let fd = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| HwError::Irq(format!("eventfd: {e}")))?;
        Ok(Self { vector, fd })
    }

    /// Vector number.
    pub fn vector(&self) -> u32 {
        self.vector
    }

    /// The eventfd, for a work loop to wait on.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Consumes pending interrupts; returns how many were signalled since the last call.
    pub fn ack(&self) -> u64 {
        let mut b = [0u8; 8];
        match rustix::io::read(&self.fd, &mut b) {
            Ok(8) => u64::from_ne_bytes(b),
            _ => 0,
        }
    }

    /// Waits up to `timeout` (forever if `None`) for an interrupt and consumes it. Returns
    /// whether one arrived.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        loop {
            if self.ack() > 0 {
                return true;
            }
            let ts = timeout.map(|t| rustix::time::Timespec {
                tv_sec: t.as_secs() as _,
                tv_nsec: t.subsec_nanos() as _,
            });
            let mut p = [PollFd::new(&self.fd, PollFlags::IN)];
            match rustix::event::poll(&mut p, ts.as_ref()) {
                Ok(0) => return self.ack() > 0,
                Ok(_) => continue,
                Err(Errno::INTR) => continue,
                Err(_) => return false,
            }
        }
    }
}
