//! The block class's client over a session (the `separate` placement): block requests in and
//! out of a [`Channel`], which holds the class-independent session logic.

use std::path::Path;
use std::time::{Duration, Instant};

use outboard_class::block::{
    validate, BlockCompletion, BlockDevice, BlockError, BlockInfo, BlockRequest, Cqe, Sqe,
    CQE_SIZE, RINGS,
};
use outboard_session::Geometry;

pub use crate::channel::WaitMode;
use crate::channel::{Channel, ChannelError};

/// Options for a new session.
#[derive(Debug, Clone, Copy)]
pub struct SessionOptions {
    /// Entries in each ring (a power of two): the most requests in flight.
    pub depth: u32,
    /// Bytes in the buffer area (whole pages).
    pub buffer_size: u64,
    /// How to wait.
    pub mode: WaitMode,
    /// Control round-trip timeout.
    pub timeout: Duration,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            depth: 256,
            buffer_size: 4 << 20,
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
        "restarting" => BlockError::Restarting,
        "busy" => BlockError::Busy(message),
        _ => BlockError::Invalid(message),
    }
}

/// The block class's meaning of a session failure.
fn channel_err(e: ChannelError) -> BlockError {
    match e {
        ChannelError::Gone => BlockError::DeviceGone,
        ChannelError::Timeout => BlockError::Timeout,
        ChannelError::Connect(m) => BlockError::NoSuchDevice(m),
        ChannelError::Refused { code, message } => reply_error(&code, message),
        ChannelError::Protocol(m) => BlockError::Protocol(m),
    }
}

/// Where the completion ring is among [`RINGS`].
const COMPLETIONS: usize = 1;

/// A session with a block device served by a driver server.
pub struct BlockClient {
    channel: Channel,
    info: BlockInfo,
    in_flight: usize,
    /// Most requests in flight: the completion ring's entries.
    depth: usize,
    /// The buffer area's size, which requests are checked against.
    buffer_size: u64,
}

impl std::fmt::Debug for BlockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockClient")
            .field("session", &self.channel.session())
            .field("info", &self.info)
            .finish()
    }
}

impl BlockClient {
    /// Opens `device` on the driver server listening at `server`.
    pub fn open(server: &Path, device: &str, opts: SessionOptions) -> Result<Self, BlockError> {
        let geometry = Geometry::of_class(&RINGS, opts.depth, opts.buffer_size);
        let (channel, info) =
            Channel::open(server, device, "block", geometry, opts.mode, opts.timeout)
                .map_err(channel_err)?;
        let info = parse_info(info)?;
        let g = channel.geometry();
        let (depth, buffer_size) = (g.rings[COMPLETIONS].entries as usize, g.buffer_size);
        Ok(Self {
            channel,
            info,
            in_flight: 0,
            depth,
            buffer_size,
        })
    }

    /// Asks the driver server at `server` for the status of `device`, without opening a session.
    pub fn status(server: &Path, device: &str) -> Result<BlockInfo, BlockError> {
        parse_info(Channel::status(server, device, Duration::from_secs(10)).map_err(channel_err)?)
    }

    /// The session id the server assigned.
    pub fn session(&self) -> u64 {
        self.channel.session()
    }

    /// Changes how [`BlockDevice::wait`] waits.
    pub fn set_mode(&mut self, mode: WaitMode) {
        self.channel.set_mode(mode);
    }
}

/// A block device's status from a server, checked before anything relies on it.
fn parse_info(info: serde_json::Value) -> Result<BlockInfo, BlockError> {
    let info: BlockInfo = serde_json::from_value(info)
        .map_err(|e| BlockError::Protocol(format!("device status: {e}")))?;
    if info.block_size < 512 || !info.block_size.is_power_of_two() {
        return Err(BlockError::Protocol(format!(
            "block size {}",
            info.block_size
        )));
    }
    Ok(info)
}

impl BlockDevice for BlockClient {
    fn info(&self) -> &BlockInfo {
        &self.info
    }

    fn buffers(&self) -> &outboard_shm::SharedMem {
        self.channel.buffers()
    }

    fn submit(&mut self, r: &BlockRequest) -> Result<(), BlockError> {
        if self.channel.is_gone() {
            return Err(BlockError::DeviceGone);
        }
        validate(r, &self.info, self.buffer_size)?;
        if self.in_flight >= self.depth {
            return Err(BlockError::QueueFull);
        }
        let staged = self
            .channel
            .stage(0, &Sqe::encode(r).0)
            .map_err(channel_err)?;
        if staged {
            self.in_flight += 1;
            Ok(())
        } else {
            Err(BlockError::QueueFull)
        }
    }

    fn kick(&mut self) -> Result<(), BlockError> {
        self.channel.kick();
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<BlockCompletion>) -> Result<usize, BlockError> {
        let mut n = 0;
        let mut e = [0u8; CQE_SIZE as usize];
        while self.channel.pop(0, &mut e).map_err(channel_err)? {
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
            self.channel.wait(deadline).map_err(channel_err)?;
        }
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn wait_or_readable(
        &mut self,
        out: &mut Vec<BlockCompletion>,
        timeout: Duration,
        also: std::os::fd::BorrowedFd<'_>,
    ) -> Result<bool, BlockError> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.poll(out)? > 0 {
                return Ok(false);
            }
            if self.in_flight == 0 {
                return outboard_class::block::readable(also, timeout);
            }
            match self.channel.wait_or(deadline, Some(also)) {
                Ok(true) => return Ok(true),
                Ok(false) => {}
                Err(ChannelError::Timeout) => return Ok(false),
                Err(e) => return Err(channel_err(e)),
            }
        }
    }
}
