//! The `colocated` placement of a NIC: its driver linked into the application (Fluke "D"),
//! the same [`NetPort`] as a session with a driver server, no IPC.
//!
//! The application's thread is the driver's environment: a [`Waiter`] on the driver's event
//! sources stands in for the driver server's loop. Frames are sent from a buffer area mapped
//! into the device's DMA space (the device reads each frame where it was written); a received
//! frame is copied twice: out of the driver's buffer into a queue (the driver shows a batch of
//! frames at once and reposts their buffers), then into the caller's. The receive rule is the
//! server's ([`Reception`]): the NIC's address, broadcast, the groups joined, the mode, then
//! the filter.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_drivers::{Attachment, StartError, Started};
use outboard_env::{DeviceEnv, Failure, Mapping, WaitError, Waiter};
use outboard_net::bpf::Program;
use outboard_net::reception::Reception;
use outboard_net::{validate, NetCounters, NetDriver, NetError, NetInfo, NetOp, NetRequest};
use outboard_shm::SharedMem;

use crate::session::slot_for;
use crate::NetPort;

/// Transmit slots in the buffer area.
const TRANSMIT_SLOTS: u32 = 64;
/// Received frames kept for the application before more are dropped (as a session's posted
/// receive buffers bound what it holds).
const RECEIVED_KEPT: usize = 128;

/// A NIC driven in this process.
pub struct ColocatedNic {
    driver: Box<dyn NetDriver>,
    waiter: Waiter,
    buffers: Arc<SharedMem>,
    dma: Mapping,
    /// Transmit slots free.
    free: Vec<u32>,
    /// Frames received and taken, not yet read (buffers reused from `spare`).
    received: VecDeque<Vec<u8>>,
    spare: Vec<Vec<u8>>,
    sent: Vec<(u64, Result<u32, NetError>)>,
    failed: VecDeque<NetError>,
    reception: Reception,
    counters: NetCounters,
    info: NetInfo,
    /// Bytes of each transmit slot: a whole frame of the NIC's MTU.
    slot: u64,
    timeout: Duration,
}

/// The class error for a device its driver found failed.
fn failed(f: Failure) -> NetError {
    NetError::DeviceFailed(f.to_string())
}

fn wait_error(e: WaitError) -> NetError {
    match e {
        WaitError::Failed(f) => failed(f),
        WaitError::Loop(e) => NetError::Protocol(e.to_string()),
    }
}

/// The class error for a driver that could not be started.
fn start_error(e: StartError) -> NetError {
    match e {
        StartError::Busy(m) => NetError::Busy(format!("{m}: another client drives this NIC")),
        StartError::Unreachable(m) => NetError::NoSuchDevice(m),
        e => NetError::DeviceFailed(e.to_string()),
    }
}

impl ColocatedNic {
    /// Opens the NIC at `at` and starts its driver here (the best match).
    pub fn open(name: &str, at: &Attachment) -> Result<Self, NetError> {
        let Started { driver, env, .. } =
            outboard_drivers::start_colocated(name, at).map_err(start_error)?;
        let d = outboard_net::unbind(driver).map_err(|e| NetError::Protocol(e.to_string()))?;
        Self::with_driver(d, &env)
    }

    /// Wraps a driver already started.
    pub fn with_driver(driver: Box<dyn NetDriver>, env: &DeviceEnv) -> Result<Self, NetError> {
        let io = |e: &dyn std::fmt::Display| NetError::Protocol(e.to_string());
        let info = driver.info().clone();
        let slot = slot_for(&info)?;
        let buffers = Arc::new(
            SharedMem::create(
                "outboard-colocated-nic",
                (u64::from(TRANSMIT_SLOTS) * slot) as usize,
            )
            .map_err(|e| io(&e))?,
        );
        let dma = env.map(buffers.clone()).map_err(|e| io(&e))?;
        let waiter = Waiter::new(driver.sources()).map_err(|e| io(&e))?;
        Ok(Self {
            driver,
            waiter,
            buffers,
            dma,
            free: (0..TRANSMIT_SLOTS).rev().collect(),
            received: VecDeque::new(),
            spare: Vec::new(),
            sent: Vec::new(),
            failed: VecDeque::new(),
            reception: Reception::default(),
            counters: NetCounters::default(),
            info,
            slot,
            timeout: Duration::from_secs(10),
        })
    }

    /// Takes transmit completions and received frames from the driver; how many.
    fn poll(&mut self) -> Result<usize, NetError> {
        let Self {
            driver,
            sent,
            received,
            spare,
            reception,
            counters,
            info,
            ..
        } = self;
        let n = driver
            .poll(sent, &mut |frame| {
                counters.rx_frames += 1;
                counters.rx_bytes += frame.len() as u64;
                let take = reception.takes(frame, &info.mac) as usize;
                if take == 0 {
                    counters.rx_unclaimed += 1;
                } else if received.len() >= RECEIVED_KEPT {
                    counters.rx_no_buffer += 1;
                } else {
                    let mut b = spare.pop().unwrap_or_default();
                    b.clear();
                    b.extend_from_slice(&frame[..take]);
                    received.push_back(b);
                    counters.rx_delivered += 1;
                }
            })
            .map_err(failed)?;
        for (tag, result) in self.sent.drain(..) {
            self.free.push(tag as u32);
            if let Err(e) = result {
                self.failed.push_back(e);
            }
        }
        Ok(n)
    }

    /// Sleeps on the driver's sources (and `also`) until something comes or `deadline`;
    /// whether `also` became readable.
    fn sleep(&mut self, deadline: Instant, also: Option<BorrowedFd<'_>>) -> Result<bool, NetError> {
        // Arm, then look again before sleeping, so work that came between is not slept on.
        if self.driver.arm().map_err(failed)? {
            return Ok(false);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let mut readable = false;
        let mut wait = Duration::ZERO;
        match also {
            None => wait = left,
            Some(fd) => {
                let (device, other) = outboard_sys::poll::either(self.waiter.fd(), fd, left)
                    .map_err(|e| NetError::Protocol(format!("poll: {e}")))?;
                readable = other;
                if !device {
                    return Ok(readable);
                }
            }
        }
        let driver = &mut self.driver;
        self.waiter
            .wait_and_handle(wait, |ev| driver.handle(ev))
            .map_err(wait_error)?;
        Ok(readable)
    }

    fn take_received(&mut self, out: &mut [u8]) -> Option<Result<usize, NetError>> {
        let f = self.received.pop_front()?;
        let r = if f.len() > out.len() {
            Err(NetError::Truncated(format!(
                "a frame of {} bytes into {} bytes",
                f.len(),
                out.len()
            )))
        } else {
            out[..f.len()].copy_from_slice(&f);
            Ok(f.len())
        };
        self.spare.push(f);
        Some(r)
    }

    /// Checks a request as a server would (the colocated NIC applies it itself).
    fn check(&self, op: NetOp, length: u32) -> Result<(), NetError> {
        let r = NetRequest {
            op,
            tag: 0,
            buf_offset: 0,
            length,
        };
        validate(&r, &self.info, u64::from(length))
    }
}

impl NetPort for ColocatedNic {
    fn info(&self) -> &NetInfo {
        &self.info
    }

    fn status_now(&mut self) -> Result<NetInfo, NetError> {
        self.driver.refresh().map_err(failed)?;
        let mut info = self.driver.info().clone();
        info.counters = NetCounters {
            rx_device_errors: info.counters.rx_device_errors,
            ..self.counters
        };
        Ok(info)
    }

    fn send(&mut self, frame: &[u8]) -> Result<(), NetError> {
        if let Some(e) = self.failed.pop_front() {
            return Err(e);
        }
        self.check(NetOp::Transmit, frame.len() as u32)?;
        let deadline = Instant::now() + self.timeout;
        let slot = loop {
            if self.driver.has_room() {
                if let Some(s) = self.free.pop() {
                    break s;
                }
            }
            if self.poll()? == 0 {
                if Instant::now() >= deadline {
                    return Err(NetError::Timeout);
                }
                self.sleep(deadline, None)?;
            }
        };
        let offset = u64::from(slot) * self.slot;
        let staged = self
            .buffers
            .write(offset, frame)
            .map_err(|e| NetError::Protocol(e.to_string()))
            .and_then(|()| {
                self.driver.transmit(
                    self.dma.iova() + offset,
                    frame.len() as u32,
                    u64::from(slot),
                )
            });
        if let Err(e) = staged {
            self.free.push(slot);
            return Err(e);
        }
        self.counters.tx_frames += 1;
        self.counters.tx_bytes += frame.len() as u64;
        self.driver.kick().map_err(failed)
    }

    fn flush(&mut self) -> Result<(), NetError> {
        let deadline = Instant::now() + self.timeout;
        while self.free.len() < TRANSMIT_SLOTS as usize {
            if self.poll()? == 0 {
                if Instant::now() >= deadline {
                    return Err(NetError::Timeout);
                }
                self.sleep(deadline, None)?;
            }
        }
        self.failed.pop_front().map_or(Ok(()), Err)
    }

    fn recv_into(&mut self, out: &mut [u8], timeout: Duration) -> Result<Option<usize>, NetError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self.take_received(out) {
                return r.map(Some);
            }
            if self.poll()? > 0 {
                continue;
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            self.sleep(deadline, None)?;
        }
    }

    fn try_recv_into(&mut self, out: &mut [u8]) -> Result<Option<usize>, NetError> {
        if self.received.is_empty() {
            self.poll()?;
        }
        self.take_received(out).transpose()
    }

    fn wait_for(&mut self, timeout: Duration) -> Result<(), NetError> {
        if self.received.is_empty() && self.poll()? == 0 {
            self.sleep(Instant::now() + timeout, None)?;
        }
        Ok(())
    }

    fn wait_or(&mut self, also: BorrowedFd<'_>, timeout: Duration) -> Result<bool, NetError> {
        if !self.received.is_empty() || self.poll()? > 0 {
            return Ok(false);
        }
        self.sleep(Instant::now() + timeout, Some(also))
    }

    fn set_filter(&mut self, program: Option<&Program>) -> Result<(), NetError> {
        if let Some(p) = program {
            // The same checks a server makes: size, then the checker.
            self.check(NetOp::Filter, p.to_bytes().len() as u32)?;
            Program::parse(&p.to_bytes()).map_err(NetError::BadFilter)?;
        }
        self.reception.filter = program.cloned();
        Ok(())
    }

    fn set_mode(&mut self, flags: u32) -> Result<(), NetError> {
        self.check(NetOp::Mode, flags)?;
        self.reception.mode = flags;
        Ok(())
    }

    fn set_hold_off(&mut self, usecs: u32) -> Result<(), NetError> {
        self.check(NetOp::HoldOff, usecs)?;
        self.driver.set_hold_off(usecs)
    }

    fn set_groups(&mut self, groups: &[[u8; 6]]) -> Result<(), NetError> {
        let bytes: Vec<u8> = groups.iter().flatten().copied().collect();
        self.check(NetOp::Multicast, bytes.len() as u32)?;
        self.reception.set_groups(&bytes);
        Ok(())
    }
}

impl AsFd for ColocatedNic {
    /// The driver's event sources as one descriptor: readable when the NIC has work.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.waiter.fd()
    }
}
