//! The char class's client over a session. The buffer area's first half takes what reads
//! bring, its second half what writes send. One read at a time stays posted: a read that
//! times out is still waiting in the server, and the next call collects it.
//!
//! **Across a server restart** ([`outboard_char::POLICY`]): a write in flight fails as
//! interrupted and is not sent again (bytes acknowledged before it had left the device); the
//! posted read and a line request are sent again (repeating them is harmless), and line
//! settings this client set are set again on the new driver before anything else.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outboard_char::{
    decode_line, validate, CharDevice, CharError, CharInfo, CharOp, CharRequest, LineSettings,
    LineStatus, Sqe, CLASS, COMPLETIONS, LINES, LINE_SIZE, REQUESTS, RINGS,
};
use outboard_client::resume::{reconnect, Resume};
use outboard_client::{Channel, ChannelError, Supervisor, WaitMode};
use outboard_session::Geometry;

/// Requests in flight at most (the rings' depth).
const DEPTH: u32 = 16;
/// How long a write or a line request may take before it fails with a timeout: more than a
/// stalled device's detection and its driver's restart.
const PATIENCE: Duration = Duration::from_secs(120);
/// Where reads land in the buffer area, and where writes are put.
const READ_AREA: u64 = 0;
const WRITE_AREA: u64 = super::BUFFER / 2;
/// Most bytes one request moves.
const MOST: usize = (super::BUFFER / 2) as usize;

/// The char class's meaning of a session failure.
fn channel_err(e: ChannelError) -> CharError {
    match e {
        ChannelError::Gone => CharError::DeviceGone,
        ChannelError::Timeout => CharError::Timeout,
        ChannelError::Connect(m) => CharError::NoSuchDevice(m),
        ChannelError::Refused(r) => r.into(),
        ChannelError::Protocol(m) => CharError::Protocol(m),
    }
}

/// The device's status from a server, checked before anything relies on it.
fn parse_info(v: serde_json::Value) -> Result<CharInfo, CharError> {
    let info: CharInfo = serde_json::from_value(v)
        .map_err(|e| CharError::Protocol(format!("device status: {e}")))?;
    if info.max_baud == 0 {
        return Err(CharError::Protocol("a line of 0 baud".into()));
    }
    Ok(info)
}

/// A session with a serial line served by a driver server.
pub struct CharClient {
    channel: Channel,
    info: CharInfo,
    server: PathBuf,
    device: String,
    supervisor: Option<Supervisor>,
    next_tag: u64,
    /// The read posted and not yet answered.
    posted: Option<(u64, usize)>,
    /// Bytes a read brought beyond what its caller's buffer took: the next read's first.
    surplus: std::collections::VecDeque<u8>,
    /// A write that timed out unanswered: the server may still be taking its bytes out of the
    /// buffer area, so the next write waits for it before it puts its own there.
    unsettled: Option<u64>,
    /// Answers that came while another was awaited.
    answers: HashMap<u64, Result<u32, CharError>>,
    /// The settings this client set, set again after a restart.
    line: Option<LineSettings>,
}

impl CharClient {
    /// Opens `device` on the driver server at `server`.
    pub fn open(server: &Path, device: &str) -> Result<Self, CharError> {
        let sock = outboard_client::link::connect_trusted(server).map_err(channel_err)?;
        Self::open_on(sock, server, device)
    }

    /// Opens `device` on the driver server at `server`, connected to through `supervisor`'s
    /// manager, and resumes the session under it when the server restarts.
    pub fn open_supervised(
        supervisor: Supervisor,
        server: &Path,
        device: &str,
    ) -> Result<Self, CharError> {
        let sock = supervisor
            .control
            .connect_server(server, device)
            .map_err(channel_err)?;
        let mut c = Self::open_on(sock, server, device)?;
        c.supervisor = Some(supervisor);
        Ok(c)
    }

    fn open_on(sock: std::os::fd::OwnedFd, server: &Path, device: &str) -> Result<Self, CharError> {
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
            posted: None,
            surplus: std::collections::VecDeque::new(),
            unsettled: None,
            answers: HashMap::new(),
            line: None,
        })
    }

    /// The server is gone: resumes on its successor (the posted read and every answer
    /// awaited are lost with it), sets this client's line settings again, or says why the
    /// session ends.
    fn resume(&mut self) -> Result<(), CharError> {
        let Some(sup) = self.supervisor.clone() else {
            return Err(CharError::DeviceGone);
        };
        let how = Resume::stateless(
            &self.server,
            &self.device,
            CLASS,
            &self.channel,
            Duration::from_secs(10),
        );
        let back = reconnect(&sup, &how, Instant::now() + sup.patience).map_err(CharError::from)?;
        self.info = parse_info(back.info)?;
        self.channel = back.channel;
        self.server = back.server;
        self.posted = None;
        self.unsettled = None;
        self.answers.clear();
        if let Some(l) = self.line {
            self.once(CharOp::SetLine(l))?;
        }
        Ok(())
    }

    /// Stages `op`; returns its tag.
    fn send(&mut self, op: CharOp) -> Result<u64, CharError> {
        let r = CharRequest {
            tag: self.next_tag,
            op,
        };
        self.next_tag = self.next_tag.wrapping_add(1);
        validate(&r, &self.info, super::BUFFER)?;
        match self.channel.stage(REQUESTS, &Sqe::encode(&r).0) {
            Ok(true) => {
                self.channel.kick();
                Ok(r.tag)
            }
            Ok(false) => Err(CharError::QueueFull),
            Err(e) => Err(channel_err(e)),
        }
    }

    /// Waits for the answer to `tag` until `deadline`: `None` if it has not come by then.
    /// Other answers that come meanwhile are kept for whoever waits for them.
    fn await_answer(
        &mut self,
        tag: u64,
        deadline: Instant,
    ) -> Result<Option<Result<u32, CharError>>, CharError> {
        loop {
            while let Some((t, result)) = self
                .channel
                .completion::<CharError>(COMPLETIONS)
                .map_err(channel_err)?
            {
                self.answers.insert(t, result);
            }
            if let Some(r) = self.answers.remove(&tag) {
                return Ok(Some(r));
            }
            match self.channel.wait(deadline) {
                Ok(()) => {}
                Err(ChannelError::Timeout) => return Ok(None),
                Err(e) => return Err(channel_err(e)),
            }
        }
    }

    /// Sends `op` and waits for its answer, once: a server that dies meanwhile is an error.
    fn once(&mut self, op: CharOp) -> Result<(u64, u32), CharError> {
        let tag = self.send(op)?;
        match self.await_answer(tag, Instant::now() + PATIENCE)? {
            Some(r) => r.map(|v| (tag, v)),
            None => Err(CharError::Timeout),
        }
    }

    /// Sends `op`, which may be repeated safely, and waits for its answer, sending it again
    /// on the successor of a server that dies meanwhile.
    fn repeatable(&mut self, op: CharOp) -> Result<(u64, u32), CharError> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            match self.once(op) {
                Err(CharError::DeviceGone) => self.resume()?,
                Err(CharError::Interrupted(_) | CharError::Restarting)
                    if Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                other => return other,
            }
        }
    }
}

impl CharDevice for CharClient {
    fn info(&self) -> &CharInfo {
        &self.info
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), CharError> {
        if let Some(tag) = self.unsettled {
            match self.await_answer(tag, Instant::now() + PATIENCE)? {
                Some(_) => self.unsettled = None,
                None => {
                    return Err(CharError::Timeout);
                }
            }
        }
        let mut done = 0usize;
        for chunk in bytes.chunks(MOST) {
            self.channel
                .buffers()
                .write(WRITE_AREA, chunk)
                .map_err(|e| CharError::Protocol(format!("the buffer area: {e}")))?;
            let op = CharOp::Write {
                offset: WRITE_AREA,
                len: chunk.len() as u32,
            };
            let tag = self.send(op)?;
            let answer = match self.await_answer(tag, Instant::now() + PATIENCE) {
                Ok(Some(r)) => r,
                Ok(None) => {
                    self.unsettled = Some(tag);
                    return Err(CharError::Timeout);
                }
                Err(e) => Err(e),
            };
            match answer {
                Ok(_) => done += chunk.len(),
                // The bytes may be partly on the line: never sent again, and said so.
                Err(
                    e @ (CharError::DeviceGone
                    | CharError::Interrupted(_)
                    | CharError::Restarting
                    | CharError::Timeout),
                ) => {
                    if matches!(e, CharError::DeviceGone) {
                        self.resume()?;
                    }
                    return Err(CharError::Interrupted(format!(
                        "the first {done} bytes were sent; of the next {}, some may have been \
                         and none will be again ({e})",
                        chunk.len()
                    )));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn read(&mut self, buf: &mut [u8], timeout: Option<Duration>) -> Result<usize, CharError> {
        if buf.is_empty() {
            return Ok(0);
        }
        if !self.surplus.is_empty() {
            let n = buf.len().min(self.surplus.len());
            for (b, v) in buf.iter_mut().zip(self.surplus.drain(..n)) {
                *b = v;
            }
            return Ok(n);
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let (tag, len) = match self.posted {
                Some(p) => p,
                None => {
                    let len = buf.len().min(MOST);
                    let tag = self.send(CharOp::Read {
                        offset: READ_AREA,
                        len: len as u32,
                    })?;
                    self.posted = Some((tag, len));
                    (tag, len)
                }
            };
            // Without a time-out, wait in long steps (a read may wait for ever).
            let until = deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            match self.await_answer(tag, until) {
                Ok(None) if deadline.is_some() => return Ok(0),
                Ok(None) => {}
                Ok(Some(result)) => {
                    self.posted = None;
                    match result {
                        Ok(n) => {
                            // The read may have been posted by a call with a larger buffer:
                            // what this one has no room for is kept for the next.
                            let mut got = vec![0u8; (n as usize).min(len)];
                            self.channel
                                .buffers()
                                .read(READ_AREA, &mut got)
                                .map_err(|e| {
                                    CharError::Protocol(format!("the buffer area: {e}"))
                                })?;
                            let k = got.len().min(buf.len());
                            buf[..k].copy_from_slice(&got[..k]);
                            self.surplus.extend(&got[k..]);
                            return Ok(k);
                        }
                        // The read was in a driver that restarted: post it again.
                        Err(CharError::Interrupted(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
                Err(CharError::DeviceGone) => self.resume()?,
                Err(e) => return Err(e),
            }
        }
    }

    fn line(&mut self) -> Result<LineStatus, CharError> {
        let (tag, _) = self.repeatable(CharOp::Line)?;
        let mut e = [0u8; LINE_SIZE as usize];
        loop {
            if !self.channel.pop(LINES, &mut e).map_err(channel_err)? {
                return Err(CharError::Protocol(
                    "a line request was answered without its record".into(),
                ));
            }
            let (t, status) = decode_line(&e);
            if t == tag {
                return status.map_err(|e| CharError::Protocol(format!("line record: {e}")));
            }
        }
    }

    fn set_line(&mut self, line: &LineSettings) -> Result<(), CharError> {
        self.repeatable(CharOp::SetLine(*line))?;
        self.line = Some(*line);
        Ok(())
    }
}
