//! A session that outlives its server: waiting for the supervisor's new server and resuming
//! on it, the same for every class. What happens to the requests that were in flight is the
//! class's policy, applied by the class's client once [`reconnect`] hands it the new channel:
//!
//! - **replay** — requests that are safe to send again are sent again, in order, before any
//!   new one (block: reads, and writes minus the blocks a later-acknowledged write covered —
//!   see the block client; entropy: reads of random bytes);
//! - **fail** — a class whose requests must not be repeated (a serial port's transmitted
//!   bytes) completes them with an error saying the server restarted, and goes on.
//!
//! What the class must carry across the restart (block: the ranges it held locked) goes in
//! `kept`, which the session protocol passes to the new server without reading it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_session::{Code, Geometry, Refusal};
use outboard_shm::SharedMem;

use crate::channel::{Channel, ChannelError, WaitMode};

/// Who restarts the server, so that a session outlives it.
#[derive(Debug, Clone)]
pub struct Supervisor {
    /// The manager's control socket: asked whether the driver is coming back.
    pub control: PathBuf,
    /// Longest the client waits for the server to come back before it ends the session with
    /// [`Code::DeviceFailed`] (the manager normally says sooner that it gave up).
    pub patience: Duration,
}

/// What a class's policy does with the requests a dead server had not answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Send them again on the new server, before anything new.
    Replay,
    /// Complete them with an error (they may have taken effect; sending them twice would be
    /// wrong), and go on with new requests.
    Fail,
}

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
    /// How the new channel waits.
    pub mode: WaitMode,
    /// Control round-trip timeout.
    pub timeout: Duration,
}

/// Waits for the supervisor's new server and opens the session on it: the new channel and the
/// device's status, or why the session cannot go on (the manager gave the driver up, the
/// device was detached, the server did not come back in time, the new server refused).
pub fn reconnect(
    sup: &Supervisor,
    r: &Resume<'_>,
    give_up: Instant,
) -> Result<(Channel, serde_json::Value), Refusal> {
    let mut next_question = Instant::now();
    loop {
        match Channel::resume(
            r.server,
            r.device,
            r.class,
            r.geometry.clone(),
            r.buffers.clone(),
            r.kept.clone(),
            r.mode,
            r.timeout,
        ) {
            Ok(opened) => return Ok(opened),
            Err(ChannelError::Connect(_) | ChannelError::Gone | ChannelError::Timeout) => {}
            Err(ChannelError::Refused(e)) if e.code == Code::Restarting => {}
            Err(e) => {
                // Refused by the new server: the manager may know why (the device was
                // detached, or given up), which says more than the server can.
                return Err(verdict(&sup.control, r.device).unwrap_or_else(|| e.into()));
            }
        }
        let now = Instant::now();
        if now >= give_up {
            return Err(Refusal::new(
                Code::DeviceFailed,
                format!(
                    "its driver server did not come back within {:?}",
                    sup.patience
                ),
            ));
        }
        if now >= next_question {
            if let Some(e) = verdict(&sup.control, r.device) {
                return Err(e);
            }
            next_question = now + Duration::from_millis(100);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What the manager says about `device` while its server is down: why it is not coming back,
/// or `None` while it is (or the manager cannot say yet).
pub fn verdict(control: &Path, device: &str) -> Option<Refusal> {
    match crate::manager::status(control, device) {
        Ok(node) => {
            let state = node.props.get("state")?.as_str()?;
            state
                .starts_with("gave up")
                .then(|| Refusal::new(Code::DeviceFailed, format!("{device}: {state}")))
        }
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
