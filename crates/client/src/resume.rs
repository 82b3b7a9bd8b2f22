//! A session that outlives its server: waiting for the supervisor's new server and resuming
//! on it, and what becomes of the requests the dead server had not answered — the same for
//! every class. The class says which policy its requests take ([`Policy`]) and hands
//! [`settle`] the unanswered requests; the core carries it out on the new channel:
//!
//! - **replay** — the requests are sent again, in order, at most a ring's worth in flight,
//!   before any new one, and each one's answer comes back (block: reads, and writes minus the
//!   blocks a later-acknowledged write covered — the class picks which to hand over; entropy:
//!   reads of random bytes);
//! - **fail** — a class whose requests must not be repeated (a serial port's transmitted
//!   bytes) gets each of them answered with [`Code::Interrupted`] (it may have taken effect),
//!   and goes on.
//!
//! What the class must carry across the restart (block: the ranges it held locked) goes in
//! `kept`, which the session protocol passes to the new server without reading it.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_session::{Code, Geometry, Refusal};
use outboard_shm::SharedMem;

use outboard_session::completion::WireError;

use crate::channel::{Answer, Channel, ChannelError, WaitMode};
use crate::link::Control;
use crate::registry::State;

/// Who restarts the server, so that a session outlives it.
#[derive(Debug, Clone)]
pub struct Supervisor {
    /// The manager: asked whether the driver is coming back (and, for a brokered client, to
    /// connect to the new server).
    pub control: Control,
    /// Longest the client waits for the server to come back before it ends the session with
    /// [`Code::DeviceFailed`] (the manager normally says sooner that it gave up).
    pub patience: Duration,
}

pub use outboard_session::control::Policy;

/// The session to resume: where, which device, its class, and what it keeps.
#[derive(Debug, Clone)]
pub struct Resume<'a> {
    /// The driver server's socket (the supervisor starts the new server there).
    pub server: &'a Path,
    /// The device's name.
    pub device: &'a str,
    /// The class the session speaks.
    pub class: &'a str,
    /// Its geometry.
    pub geometry: Geometry,
    /// Its buffer area, which the new session keeps.
    pub buffers: Arc<SharedMem>,
    /// The class's kept state.
    pub kept: serde_json::Value,
    /// How many requests the class will send again once resumed (counted by the server).
    pub replaying: u32,
    /// How the new channel waits.
    pub mode: WaitMode,
    /// Control round-trip timeout.
    pub timeout: Duration,
}

impl<'a> Resume<'a> {
    /// The resume of a session that keeps nothing and counts nothing as a replay (a class
    /// whose requests are simply sent again, or failed): on `channel`'s geometry, buffers and
    /// wait mode.
    pub fn stateless(
        server: &'a Path,
        device: &'a str,
        class: &'a str,
        channel: &Channel,
        timeout: Duration,
    ) -> Self {
        Self {
            server,
            device,
            class,
            geometry: channel.geometry().clone(),
            buffers: channel.shared_buffers(),
            kept: serde_json::Value::Null,
            replaying: 0,
            mode: channel.mode(),
            timeout,
        }
    }
}

/// A session opened again on the supervisor's new server.
#[derive(Debug)]
pub struct Reconnected {
    /// The new channel.
    pub channel: Channel,
    /// The device's status, as the new server answered the resume.
    pub info: serde_json::Value,
    /// Where the device is served now: the same socket, or another server's after the
    /// device was moved (`outboard move`); the next resume starts there.
    pub server: std::path::PathBuf,
}

/// Waits for the supervisor's new server and opens the session on it, or says why the
/// session cannot go on (the manager gave the driver up, the device was detached, the server
/// did not come back in time, the new server refused). A device that moved to another
/// server is followed there: when its old socket is gone or the server there no longer
/// serves it, the manager is asked where it is served now.
pub fn reconnect(
    sup: &Supervisor,
    r: &Resume<'_>,
    give_up: Instant,
) -> Result<Reconnected, Refusal> {
    let mut server = r.server.to_path_buf();
    let mut next_question = Instant::now();
    let mut next_lookup = Instant::now();
    loop {
        // The manager first: while it has given the device up, the server's socket (which
        // the manager keeps bound) still takes a connection, and a resume sent there would
        // wait its whole time-out for an answer nobody gives.
        let now = Instant::now();
        if now >= next_question {
            if let Some(e) = verdict(&sup.control, r.device) {
                return Err(e);
            }
            next_question = now + Duration::from_millis(100);
        }
        let opened = sup
            .control
            .connect_server(&server, r.device)
            .and_then(|sock| {
                Channel::resume_on(
                    sock,
                    r.device,
                    r.class,
                    r.geometry.clone(),
                    r.buffers.clone(),
                    r.kept.clone(),
                    r.replaying,
                    r.mode,
                    r.timeout,
                )
            });
        let moved = match opened {
            Ok((channel, info)) => {
                return Ok(Reconnected {
                    channel,
                    info,
                    server,
                })
            }
            Err(ChannelError::Connect(_)) => true,
            Err(ChannelError::Refused(e)) if e.code == Code::NoSuchDevice => true,
            Err(ChannelError::Gone | ChannelError::Timeout) => false,
            Err(ChannelError::Refused(e)) if e.code == Code::Restarting => false,
            Err(e) => {
                // Refused by the new server: the manager may know why (the device was
                // detached, or given up), which says more than the server can.
                return Err(verdict(&sup.control, r.device).unwrap_or_else(|| e.into()));
            }
        };
        // Not at the socket it was: moved, perhaps (asked at most every 10 ms; until the
        // move is done the manager answers "restarting").
        if moved && Instant::now() >= next_lookup {
            if let Some(now_at) = served_at(&sup.control, r.device) {
                server = now_at;
            }
            next_lookup = Instant::now() + Duration::from_millis(10);
        }
        if Instant::now() >= give_up {
            return Err(Refusal::new(
                Code::DeviceFailed,
                format!(
                    "its driver server did not come back within {:?}",
                    sup.patience
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The socket of the driver server that serves `device` now, if the manager says.
fn served_at(control: &Control, device: &str) -> Option<std::path::PathBuf> {
    match control.ask(&crate::api::Request::Open {
        name: device.into(),
    }) {
        Ok(crate::api::Reply::Open { server, .. }) => server,
        _ => None,
    }
}

/// What the manager says about `device` while its server is down: why it is not coming back,
/// or `None` while it is (or the manager cannot say yet).
pub fn verdict(control: &Control, device: &str) -> Option<Refusal> {
    match control.status(device) {
        Ok(node) => (node.state()? == State::GaveUp).then(|| {
            let state = node.props["state"].as_str().unwrap_or_default();
            Refusal::new(Code::GivenUp, format!("{device}: {state}"))
        }),
        // No manager: nobody will start the server again. Detached, or no longer part of
        // the machine: nothing will serve it.
        Err(e)
            if matches!(
                e.code,
                Code::Unreachable | Code::DeviceGone | Code::NoSuchDevice
            ) =>
        {
            Some(Refusal::new(
                Code::DeviceGone,
                format!("{device}: its driver server is gone and nothing will restart it"),
            ))
        }
        Err(_) => None,
    }
}

/// How [`settle`] ended.
#[derive(Debug)]
pub enum Settled<E> {
    /// Every request has its answer: (its index among those handed over, its result), in the
    /// order they came.
    Answered(Vec<Answer<E>>),
    /// The new server died before it answered them all: resume again and settle again.
    GoneAgain,
}

/// Carries out the class's `policy` for the `count` requests a dead server had not answered,
/// on `channel` (the new server's). `entry(i)` encodes the `i`-th as an entry of the ring to
/// the server `ring`, with `i` as its tag; answers come on the ring to the client `ring`.
/// Nothing new is sent before every replayed request is answered; at most `depth` are in
/// flight; past `deadline` the replay ends with [`ChannelError::Timeout`].
pub fn settle<E: WireError + From<Refusal>>(
    policy: Policy,
    channel: &mut Channel,
    ring: usize,
    count: usize,
    mut entry: impl FnMut(u64) -> Vec<u8>,
    depth: usize,
    deadline: Instant,
) -> Result<Settled<E>, ChannelError> {
    if policy == Policy::Fail {
        return Ok(Settled::Answered(interrupted(count)));
    }
    let mut answers = Vec::with_capacity(count);
    let mut answered = vec![false; count];
    let mut sent = 0usize;
    while answers.len() < count {
        while sent < count && sent - answers.len() < depth.max(1) {
            match channel.stage(ring, &entry(sent as u64)) {
                Ok(true) => sent += 1,
                Ok(false) => break,
                Err(ChannelError::Gone) => return Ok(Settled::GoneAgain),
                Err(e) => return Err(e),
            }
        }
        channel.kick();
        while let Some((tag, result)) = channel.completion::<E>(ring)? {
            let waiting = (tag < sent as u64).then(|| &mut answered[tag as usize]);
            match waiting {
                Some(done) if !*done => *done = true,
                _ => {
                    return Err(ChannelError::Protocol(format!(
                        "replay: an answer for request {tag}, which is not waiting for one"
                    )))
                }
            }
            answers.push((tag, result));
        }
        if answers.len() < count {
            match channel.wait(deadline) {
                Ok(()) => {}
                Err(ChannelError::Gone) => return Ok(Settled::GoneAgain),
                Err(e) => return Err(e),
            }
        }
    }
    Ok(Settled::Answered(answers))
}

/// The answers of the [`Policy::Fail`] policy: each request interrupted.
fn interrupted<E: From<Refusal>>(count: usize) -> Vec<Answer<E>> {
    (0..count as u64)
        .map(|i| {
            let why = "the driver server restarted with this request in flight; it may have \
                       taken effect, and the class does not send it again";
            (i, Err(Refusal::new(Code::Interrupted, why).into()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct E(Code, String);

    impl From<Refusal> for E {
        fn from(r: Refusal) -> Self {
            E(r.code, r.reason)
        }
    }

    #[test]
    fn the_fail_policy_answers_every_request_interrupted_and_sends_nothing() {
        let got = interrupted::<E>(3);
        assert_eq!(got.iter().map(|a| a.0).collect::<Vec<_>>(), [0, 1, 2]);
        for (_, r) in got {
            let E(code, why) = r.unwrap_err();
            assert_eq!(code, Code::Interrupted);
            assert!(why.contains("may have taken effect"), "{why}");
        }
    }
}
