//! The clock class's client over a session: waits for ticks and reads of the time. Its policy
//! across a server restart is replay ([`outboard_clock::POLICY`]): a wait the dead server had
//! not answered is sent again and waits its ticks on the new driver (ticks are counted, not
//! replayed); a read of the time is read again.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outboard_client::resume::{reconnect, settle, Resume, Settled};
use outboard_client::{Channel, ChannelError, Supervisor, WaitMode};
use outboard_clock::{
    decode_time, validate, ClockDevice, ClockError, ClockInfo, ClockOp, ClockRequest, ClockTime,
    Sqe, CLASS, COMPLETIONS, POLICY, REQUESTS, RINGS, TIMES, TIME_SIZE,
};
use outboard_session::Geometry;

/// Requests in flight at most (the rings' depth).
const DEPTH: u32 = 16;
/// How long a request may take beyond its ticks before it fails with a timeout: more than a
/// stalled clock's detection (the device's request deadline, 30 s by default) and its
/// driver's restart, after which the request is sent again.
const PATIENCE: Duration = Duration::from_secs(120);

/// The clock class's meaning of a session failure.
fn channel_err(e: ChannelError) -> ClockError {
    match e {
        ChannelError::Gone => ClockError::DeviceGone,
        ChannelError::Timeout => ClockError::Timeout,
        ChannelError::Connect(m) => ClockError::NoSuchDevice(m),
        ChannelError::Refused(r) => r.into(),
        ChannelError::Protocol(m) => ClockError::Protocol(m),
    }
}

/// The device's status from a server, checked before anything relies on it.
fn parse_info(v: serde_json::Value) -> Result<ClockInfo, ClockError> {
    let info: ClockInfo = serde_json::from_value(v)
        .map_err(|e| ClockError::Protocol(format!("device status: {e}")))?;
    if info.hz == 0 || info.max_wait == 0 {
        return Err(ClockError::Protocol(format!(
            "a clock of {} Hz that waits at most {} ticks",
            info.hz, info.max_wait
        )));
    }
    Ok(info)
}

/// A session with a clock served by a driver server.
pub struct ClockClient {
    channel: Channel,
    info: ClockInfo,
    server: PathBuf,
    device: String,
    supervisor: Option<Supervisor>,
    next_tag: u64,
}

impl ClockClient {
    /// Opens `device` on the driver server at `server`.
    pub fn open(server: &Path, device: &str) -> Result<Self, ClockError> {
        let sock = outboard_client::link::connect_trusted(server).map_err(channel_err)?;
        Self::open_on(sock, server, device)
    }

    /// Opens `device` on the driver server at `server`, connected to through `supervisor`'s
    /// manager, and resumes the session under it when the server restarts.
    pub fn open_supervised(
        supervisor: Supervisor,
        server: &Path,
        device: &str,
    ) -> Result<Self, ClockError> {
        let sock = supervisor
            .control
            .connect_server(server, device)
            .map_err(channel_err)?;
        let mut c = Self::open_on(sock, server, device)?;
        c.supervisor = Some(supervisor);
        Ok(c)
    }

    fn open_on(
        sock: std::os::fd::OwnedFd,
        server: &Path,
        device: &str,
    ) -> Result<Self, ClockError> {
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

    /// The server is gone: resumes on its successor, or says why the session ends.
    fn resume(&mut self) -> Result<(), ClockError> {
        let Some(sup) = self.supervisor.clone() else {
            return Err(ClockError::DeviceGone);
        };
        let how = Resume::stateless(
            &self.server,
            &self.device,
            CLASS,
            &self.channel,
            Duration::from_secs(10),
        );
        let back =
            reconnect(&sup, &how, Instant::now() + sup.patience).map_err(ClockError::from)?;
        self.info = parse_info(back.info)?;
        self.channel = back.channel;
        self.server = back.server;
        Ok(())
    }

    /// How long `op` may take before it has failed.
    fn deadline(&self, op: ClockOp) -> Instant {
        let ticks = match op {
            ClockOp::Wait(n) => n,
            ClockOp::Now => 0,
        };
        let period = Duration::from_nanos(1_000_000_000 / u64::from(self.info.hz));
        Instant::now() + period * ticks + PATIENCE
    }

    /// Sends one request and waits for its answer; a server that dies meanwhile is resumed
    /// and the request sent again ([`POLICY`]). For `NOW`, the time record comes with it.
    fn one(&mut self, op: ClockOp) -> Result<(u32, Option<ClockTime>), ClockError> {
        let deadline = self.deadline(op);
        loop {
            let r = ClockRequest {
                tag: self.next_tag,
                op,
            };
            self.next_tag = self.next_tag.wrapping_add(1);
            validate(&r, &self.info)?;
            let result = match self.channel.stage(REQUESTS, &Sqe::encode(&r).0) {
                Ok(true) => {
                    self.channel.kick();
                    self.answer(r.tag, deadline)
                }
                Ok(false) => return Err(ClockError::QueueFull),
                Err(ChannelError::Gone) => Err(ClockError::DeviceGone),
                Err(e) => return Err(channel_err(e)),
            };
            let result = match result {
                Err(ClockError::DeviceGone) => self.resume_with(r, deadline)?,
                other => other.map(|v| (r.tag, v)),
            };
            match result {
                Err(ClockError::Restarting) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e),
                Ok((tag, v)) => {
                    let time = match op {
                        ClockOp::Now => Some(self.time_of(tag)?),
                        ClockOp::Wait(_) => None,
                    };
                    return Ok((v, time));
                }
            }
        }
    }

    /// The server died with `r` unanswered: resumes on its successor and sends `r` there
    /// again, as often as the new server dies too. Returns the tag it was answered under.
    fn resume_with(
        &mut self,
        r: ClockRequest,
        deadline: Instant,
    ) -> Result<Result<(u64, u32), ClockError>, ClockError> {
        loop {
            self.resume()?;
            let settled = settle::<ClockError>(
                POLICY,
                &mut self.channel,
                REQUESTS,
                1,
                |tag| Sqe::encode(&ClockRequest { tag, ..r }).0.to_vec(),
                1,
                deadline,
            )
            .map_err(channel_err)?;
            if let Settled::Answered(mut answers) = settled {
                let (tag, result) = answers.pop().expect("one request settled");
                return Ok(result.map(|v| (tag, v)));
            }
        }
    }

    /// Waits for the completion of `tag`.
    fn answer(&mut self, tag: u64, deadline: Instant) -> Result<u32, ClockError> {
        self.channel
            .answer::<ClockError>(COMPLETIONS, tag, deadline)
            .map_err(channel_err)?
    }

    /// The time record of the `NOW` request answered under `tag` (posted ahead of its
    /// completion; records of requests given up on are passed over).
    fn time_of(&mut self, tag: u64) -> Result<ClockTime, ClockError> {
        let mut e = [0u8; TIME_SIZE as usize];
        loop {
            match self.channel.pop(TIMES, &mut e).map_err(channel_err)? {
                false => {
                    return Err(ClockError::Protocol(
                        "a time request was answered without its time".into(),
                    ))
                }
                true => {
                    let (t, time) = decode_time(&e);
                    if t == tag {
                        return Ok(time);
                    }
                }
            }
        }
    }
}

impl ClockDevice for ClockClient {
    fn info(&self) -> &ClockInfo {
        &self.info
    }

    fn wait(&mut self, ticks: u32) -> Result<u32, ClockError> {
        self.one(ClockOp::Wait(ticks)).map(|(v, _)| v)
    }

    fn now(&mut self) -> Result<ClockTime, ClockError> {
        let (_, time) = self.one(ClockOp::Now)?;
        time.ok_or_else(|| ClockError::Protocol("no time record".into()))
    }
}
