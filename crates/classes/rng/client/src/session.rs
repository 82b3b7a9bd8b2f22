//! The entropy class's client over a session: requests for random bytes into the session's
//! buffer area, completions out. Its policy across a server restart is replay: the requests
//! the dead server had not answered are asked again of the new one (the bytes are random
//! either way; nothing is done twice that matters).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outboard_client::resume::{reconnect, settle, Resume, Settled};
use outboard_client::{Channel, ChannelError, Supervisor, WaitMode};
use outboard_rng::{
    no_bytes_is_an_error, validate, EntropyDevice, EntropyError, EntropyInfo, EntropyRequest, Sqe,
    CLASS, POLICY, RINGS,
};
use outboard_session::Geometry;

/// Requests in flight at most (the rings' depth).
const DEPTH: u32 = 16;
/// How long one read waits for the device before it fails with a timeout.
const PATIENCE: Duration = Duration::from_secs(30);

/// The entropy class's meaning of a session failure.
fn channel_err(e: ChannelError) -> EntropyError {
    match e {
        ChannelError::Gone => EntropyError::DeviceGone,
        ChannelError::Timeout => EntropyError::Timeout,
        ChannelError::Connect(m) => EntropyError::NoSuchDevice(m),
        ChannelError::Refused(r) => r.into(),
        ChannelError::Protocol(m) => EntropyError::Protocol(m),
    }
}

/// The device's status from a server, checked before anything relies on it.
fn parse_info(v: serde_json::Value) -> Result<EntropyInfo, EntropyError> {
    let info: EntropyInfo = serde_json::from_value(v)
        .map_err(|e| EntropyError::Protocol(format!("device status: {e}")))?;
    if info.max_read == 0 {
        return Err(EntropyError::Protocol(
            "a device that gives 0 bytes at once".into(),
        ));
    }
    Ok(info)
}

/// A session with an entropy device served by a driver server.
pub struct RngClient {
    channel: Channel,
    info: EntropyInfo,
    server: PathBuf,
    device: String,
    supervisor: Option<Supervisor>,
    next_tag: u64,
}

impl RngClient {
    /// Opens `device` on the driver server at `server`.
    pub fn open(server: &Path, device: &str) -> Result<Self, EntropyError> {
        let sock = outboard_client::link::connect_trusted(server).map_err(channel_err)?;
        Self::open_on(sock, server, device)
    }

    /// Opens `device` on the driver server at `server`, connected to through `supervisor`'s
    /// manager, and resumes the session under it when the server restarts.
    pub fn open_supervised(
        supervisor: Supervisor,
        server: &Path,
        device: &str,
    ) -> Result<Self, EntropyError> {
        let sock = supervisor
            .control
            .connect_server(server, device)
            .map_err(channel_err)?;
        Ok(Self::open_on(sock, server, device)?.supervised(supervisor))
    }

    /// Opens `device` on `sock`, a connection to the driver server at `server`.
    fn open_on(
        sock: std::os::fd::OwnedFd,
        server: &Path,
        device: &str,
    ) -> Result<Self, EntropyError> {
        let geometry = Geometry::of_class(&RINGS, DEPTH, super::BUFFER);
        let (channel, info) = Channel::open_on(
            sock,
            device,
            CLASS,
            geometry,
            WaitMode::Blocking,
            Duration::from_secs(10),
        )
        .map_err(channel_err)?;
        Ok(Self {
            info: parse_info(info)?,
            channel,
            server: server.to_owned(),
            device: device.to_owned(),
            supervisor: None,
            next_tag: 1,
        })
    }

    /// Makes the session outlive its server (see `outboard_client::resume`).
    pub fn supervised(mut self, supervisor: Supervisor) -> Self {
        self.supervisor = Some(supervisor);
        self
    }

    /// The server is gone: resumes on its successor, or says why the session ends.
    fn resume(&mut self) -> Result<(), EntropyError> {
        let Some(sup) = self.supervisor.clone() else {
            return Err(EntropyError::DeviceGone);
        };
        // Not counted as a replay: entropy asks again for what it still wants.
        let how = Resume::stateless(
            &self.server,
            &self.device,
            CLASS,
            &self.channel,
            Duration::from_secs(10),
        );
        let back =
            reconnect(&sup, &how, Instant::now() + sup.patience).map_err(EntropyError::from)?;
        self.info = parse_info(back.info)?;
        self.channel = back.channel;
        self.server = back.server;
        Ok(())
    }

    /// Asks for `length` bytes at the start of the buffer area and waits for the answer; a
    /// server that dies meanwhile is resumed and the request settled by the class's policy
    /// ([`POLICY`]: asked again).
    fn one(&mut self, length: u32) -> Result<u32, EntropyError> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let r = EntropyRequest {
                tag: self.next_tag,
                buf_offset: 0,
                length,
            };
            self.next_tag = self.next_tag.wrapping_add(1);
            validate(&r, &self.info, self.channel.geometry().buffer_size)?;
            let result = match self.channel.stage(0, &Sqe::encode(&r).0) {
                Ok(true) => {
                    self.channel.kick();
                    self.answer(r.tag, deadline)
                }
                Ok(false) => return Err(EntropyError::QueueFull),
                Err(ChannelError::Gone) => Err(EntropyError::DeviceGone),
                Err(e) => return Err(channel_err(e)),
            };
            let result = match result {
                Err(EntropyError::DeviceGone) => self.resume_with(r, deadline)?,
                other => other,
            };
            match result {
                Err(EntropyError::Restarting) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                other => return other,
            }
        }
    }

    /// The server died with `r` unanswered: resumes on its successor and settles `r` there
    /// (the client core's replay), as often as the new server dies too.
    fn resume_with(
        &mut self,
        r: EntropyRequest,
        deadline: Instant,
    ) -> Result<Result<u32, EntropyError>, EntropyError> {
        loop {
            self.resume()?;
            let settled = settle::<EntropyError>(
                POLICY,
                &mut self.channel,
                0,
                1,
                |tag| Sqe::encode(&EntropyRequest { tag, ..r }).0.to_vec(),
                1,
                deadline,
            )
            .map_err(channel_err)?;
            if let Settled::Answered(mut answers) = settled {
                let (_, result) = answers.pop().expect("one request settled");
                return Ok(no_bytes_is_an_error(result));
            }
        }
    }

    /// Waits for the completion of `tag`.
    fn answer(&mut self, tag: u64, deadline: Instant) -> Result<u32, EntropyError> {
        self.channel
            .answer::<EntropyError>(0, tag, deadline)
            .map_err(channel_err)?
    }
}

impl EntropyDevice for RngClient {
    fn info(&self) -> &EntropyInfo {
        &self.info
    }

    fn read(&mut self, out: &mut [u8]) -> Result<(), EntropyError> {
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done)
                .min(self.info.max_read as usize)
                .min(self.channel.geometry().buffer_size as usize) as u32;
            let got = self.one(want)? as usize;
            self.channel
                .buffers()
                .read(0, &mut out[done..done + got])
                .map_err(|e| EntropyError::Protocol(e.to_string()))?;
            done += got;
        }
        Ok(())
    }
}
