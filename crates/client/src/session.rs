//! The block client library over a session: the `separate` placement.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use outboard_session::control::{self, Reply, Request};
use outboard_session::doorbell::{announce_sleep, cancel_sleep, peer_sleeping};
use outboard_session::region::ShmRing;
use outboard_session::{Consumer, Doorbell, Geometry, Producer, Region, SessionError};
use rustix::event::{PollFd, PollFlags};

use outboard_class::block::{
    validate, BlockCompletion, BlockDevice, BlockError, BlockInfo, BlockRequest, Cqe, Sqe,
};

/// How a client waits for completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitMode {
    /// Announce sleep and block on the doorbell at once.
    Blocking,
    /// Spin for up to this long re-checking the ring, then block.
    Adaptive(Duration),
}

/// Options for a new session.
#[derive(Debug, Clone, Copy)]
pub struct SessionOptions {
    /// Ring sizes and buffer area.
    pub geometry: Geometry,
    /// How to wait.
    pub mode: WaitMode,
    /// Control round-trip timeout.
    pub timeout: Duration,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            geometry: Geometry {
                sq_entries: 256,
                cq_entries: 256,
                sqe_size: outboard_class::block::SQE_SIZE,
                cqe_size: outboard_class::block::CQE_SIZE,
                buffer_size: 4 << 20,
            },
            mode: WaitMode::Blocking,
            timeout: Duration::from_secs(10),
        }
    }
}

/// The class error for a server's (or the manager's) error reply.
pub fn reply_error(code: &str, message: String) -> BlockError {
    match code {
        "no-such-device" => BlockError::NoSuchDevice(message),
        "device-failed" => BlockError::DeviceFailed(message),
        "busy" => BlockError::Busy(message),
        _ => BlockError::Invalid(message),
    }
}

fn session_err(e: SessionError) -> BlockError {
    match e {
        SessionError::Closed => BlockError::DeviceGone,
        SessionError::Timeout => BlockError::Timeout,
        SessionError::Connect(m) => BlockError::NoSuchDevice(m),
        e => BlockError::Protocol(e.to_string()),
    }
}

/// A session with a block device served by a driver server.
pub struct BlockClient {
    sock: OwnedFd,
    region: Region,
    sq: Producer<ShmRing>,
    cq: Consumer<ShmRing>,
    server_bell: Doorbell,
    client_bell: Doorbell,
    info: BlockInfo,
    in_flight: usize,
    mode: WaitMode,
    session: u64,
    /// The server closed the session: every later call fails with `DeviceGone` at once.
    gone: bool,
}

impl std::fmt::Debug for BlockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockClient")
            .field("session", &self.session)
            .field("info", &self.info)
            .finish()
    }
}

impl BlockClient {
    /// Opens `device` on the driver server listening at `server`.
    pub fn open(server: &Path, device: &str, opts: SessionOptions) -> Result<Self, BlockError> {
        let sock = control::connect(server).map_err(session_err)?;
        let req = Request::Open {
            device: device.into(),
            class: "block".into(),
            geometry: opts.geometry,
        };
        let (reply, fds) = control::call(sock.as_fd(), &req, opts.timeout).map_err(session_err)?;
        let (session, geometry, info) = match reply {
            Reply::Opened {
                session,
                geometry,
                info,
            } => (session, geometry, info),
            Reply::Error { code, message } => return Err(reply_error(&code, message)),
            other => return Err(BlockError::Protocol(format!("unexpected reply {other:?}"))),
        };
        let info: BlockInfo = serde_json::from_value(info)
            .map_err(|e| BlockError::Protocol(format!("device status: {e}")))?;
        if info.block_size < 512 || !info.block_size.is_power_of_two() {
            return Err(BlockError::Protocol(format!(
                "block size {}",
                info.block_size
            )));
        }
        let [control_fd, buffers_fd, server_bell, client_bell]: [OwnedFd; 4] =
            fds.try_into().map_err(|v: Vec<OwnedFd>| {
                BlockError::Protocol(format!("open reply carried {} fds, not 4", v.len()))
            })?;
        let region = Region::attach(control_fd, buffers_fd, geometry).map_err(session_err)?;
        Ok(Self {
            sq: Producer::new(region.sq(), geometry.sq_entries),
            cq: Consumer::new(region.cq(), geometry.cq_entries),
            region,
            sock,
            server_bell: Doorbell::from_fd(server_bell),
            client_bell: Doorbell::from_fd(client_bell),
            info,
            in_flight: 0,
            mode: opts.mode,
            session,
            gone: false,
        })
    }

    /// Asks the driver server at `server` for the status of `device`, without opening a session.
    pub fn status(server: &Path, device: &str) -> Result<BlockInfo, BlockError> {
        let sock = control::connect(server).map_err(session_err)?;
        let req = Request::Status {
            device: device.into(),
        };
        match control::call(sock.as_fd(), &req, Duration::from_secs(10))
            .map_err(session_err)?
            .0
        {
            Reply::Status { info } => serde_json::from_value(info)
                .map_err(|e| BlockError::Protocol(format!("device status: {e}"))),
            Reply::Error { code, message } => Err(reply_error(&code, message)),
            other => Err(BlockError::Protocol(format!("unexpected reply {other:?}"))),
        }
    }

    /// The session id the server assigned.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// Changes how [`BlockDevice::wait`] waits.
    pub fn set_mode(&mut self, mode: WaitMode) {
        self.mode = mode;
    }

    /// Blocks on the doorbell or the control socket; the latter means the server is gone.
    fn block(&mut self, timeout: Duration) -> Result<(), BlockError> {
        let ts = rustix::time::Timespec {
            tv_sec: timeout.as_secs() as _,
            tv_nsec: timeout.subsec_nanos() as _,
        };
        let bell = self.client_bell.fd();
        let mut p = [
            PollFd::new(&bell, PollFlags::IN),
            PollFd::new(&self.sock, PollFlags::IN),
        ];
        match rustix::event::poll(&mut p, Some(&ts)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(BlockError::Protocol(format!("poll: {e}"))),
        }
        if !p[1].revents().is_empty() {
            self.gone = true;
            return Err(BlockError::DeviceGone);
        }
        self.client_bell.drain();
        Ok(())
    }
}

impl BlockDevice for BlockClient {
    fn info(&self) -> &BlockInfo {
        &self.info
    }

    fn buffers(&self) -> &outboard_shm::SharedMem {
        &self.region.buffers
    }

    fn submit(&mut self, r: &BlockRequest) -> Result<(), BlockError> {
        if self.gone {
            return Err(BlockError::DeviceGone);
        }
        validate(r, &self.info, self.region.geometry.buffer_size)?;
        if self.in_flight >= self.region.geometry.cq_entries as usize {
            return Err(BlockError::QueueFull);
        }
        match self.sq.stage(&Sqe::encode(r).0) {
            Ok(true) => {
                self.in_flight += 1;
                Ok(())
            }
            Ok(false) => Err(BlockError::QueueFull),
            Err(e) => Err(BlockError::Protocol(e.to_string())),
        }
    }

    fn kick(&mut self) -> Result<(), BlockError> {
        self.sq.publish();
        if peer_sleeping(self.region.server_sleeping()) {
            self.server_bell.ring();
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<BlockCompletion>) -> Result<usize, BlockError> {
        let mut n = 0;
        let mut e = [0u8; 16];
        while self
            .cq
            .pop(&mut e)
            .map_err(|e| BlockError::Protocol(e.to_string()))?
        {
            self.in_flight = self.in_flight.saturating_sub(1);
            out.push(Cqe(e).decode());
            n += 1;
        }
        Ok(n)
    }

    fn wait(
        &mut self,
        out: &mut Vec<BlockCompletion>,
        timeout: Duration,
    ) -> Result<usize, BlockError> {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.poll(out)?;
            if n > 0 || self.in_flight == 0 {
                return Ok(n);
            }
            if self.gone {
                return Err(BlockError::DeviceGone);
            }
            if let WaitMode::Adaptive(spin) = self.mode {
                let until = Instant::now() + spin;
                while Instant::now() < until {
                    if self
                        .cq
                        .available()
                        .map_err(|e| BlockError::Protocol(e.to_string()))?
                        > 0
                    {
                        break;
                    }
                    std::hint::spin_loop();
                }
                let n = self.poll(out)?;
                if n > 0 {
                    return Ok(n);
                }
            }
            let flag = self.region.client_sleeping();
            announce_sleep(flag);
            // The re-check after announcing (see outboard_session::doorbell).
            if self
                .cq
                .available()
                .map_err(|e| BlockError::Protocol(e.to_string()))?
                > 0
            {
                cancel_sleep(flag);
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                cancel_sleep(flag);
                return Err(BlockError::Timeout);
            }
            let r = self.block(deadline - now);
            cancel_sleep(self.region.client_sleeping());
            r?;
        }
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}
