//! What the multiplexer needs from a class: one dispatcher per served device, taking the
//! class's requests out of its sessions and posting completions back.
//!
//! The multiplexer ([`crate::host`]) owns sessions, control connections, doorbells, sleeping
//! and waking, limits and the deadline timer; it knows no class. A dispatcher owns one device's
//! driver and everything class-specific: entry formats, validation, tags, ordering rules, what
//! a failure does to the requests in flight. A new class adds a dispatcher and touches nothing
//! here or in the multiplexer.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_env::{DeviceEvent, Driver, LoopError, WorkLoop};
use outboard_session::{control, RingShape};
use outboard_shm::SharedMem;

use crate::host::{HostStats, Source};
use crate::session::Session;

/// An error reply to a control request: a machine-readable code and a message.
pub type Refusal = (&'static str, String);

/// What a dispatcher may reach while it works: the sessions (it touches only its own), the
/// counters, its device's event sources, and the manager's event channel.
pub struct Ctx<'a> {
    /// Every session slot.
    pub sessions: &'a mut [Option<Session>],
    /// Counters.
    pub stats: &'a mut HostStats,
    /// This device's index.
    pub device: usize,
    pub(crate) work: &'a mut WorkLoop<Source>,
    pub(crate) notify: Option<BorrowedFd<'a>>,
    /// A supervisor restarts the server: a failed device ends the process.
    pub(crate) restartable: bool,
}

impl Ctx<'_> {
    /// Registers a driver's event sources for this device.
    pub fn watch(&mut self, driver: &dyn Driver) -> Result<(), LoopError> {
        for (ev, fd) in driver.sources() {
            self.work.add(fd, Source::Device(self.device, ev))?;
        }
        Ok(())
    }

    /// Removes a driver's event sources (before it is given up or dropped).
    pub fn unwatch(&mut self, driver: &dyn Driver) {
        for (_, fd) in driver.sources() {
            let _ = self.work.remove(fd);
        }
    }

    /// A device failed in a restartable server: tell the manager why, and end the process with
    /// the requests unanswered. The supervisor resets the device (closing our handle to it
    /// does) and starts a new server, on which the clients resume and send those requests
    /// again; failing them here would turn a restart into errors.
    pub fn end_for_restart(&self, device: &str, why: &str) -> ! {
        self.notify(&control::Event::DeviceFailed {
            device: device.into(),
            why: why.into(),
            restarting: true,
        });
        tracing::error!("device {device}: {why}; ending this server for its supervisor to restart");
        std::process::exit(crate::host::EXIT_DEVICE_FAILED)
    }

    /// Tells the manager (if one started this server) what happened to a device.
    pub fn notify(&self, event: &control::Event) {
        if let Some(n) = self.notify {
            if let Err(e) = control::try_send(n.as_fd(), event, &[]) {
                tracing::warn!("cannot tell the manager: {e}");
            }
        }
    }
}

/// One served device, by its class.
pub trait Dispatcher: Send {
    /// The class device's name.
    fn name(&self) -> &str;
    /// The class (`block`), as `Open` names it.
    fn class(&self) -> &'static str;
    /// The rings the class declares; a session must have exactly these.
    fn rings(&self) -> &'static [RingShape];
    /// The class status a client gets on `Status` and `Open`.
    fn status(&self) -> serde_json::Value;
    /// Why new sessions are refused now (the device is restarting or failed), if they are.
    fn refuses(&self) -> Option<Refusal>;
    /// Registers the device's event sources when serving starts.
    fn start(&mut self, cx: &mut Ctx<'_>) -> Result<(), LoopError>;
    /// A session opens at `slot`: map its buffer area for the device.
    fn open(&mut self, slot: usize, buffers: Arc<SharedMem>) -> Result<(), Refusal>;
    /// A resumed session at `slot` held these locks (first block, blocks) under the previous
    /// server: grant them back, or refuse all of them.
    fn reclaim(&mut self, slot: usize, locks: &[(u64, u32)]) -> Result<(), Refusal>;
    /// For `grace` from now, grant no new lock: the sessions of a previous server are still
    /// claiming theirs back. A class without locks ignores it.
    fn lock_grace(&mut self, _grace: std::time::Duration) {}
    /// Until `until`, let one request at a time into the device and name it in `blame`
    /// first (see [`crate::blame`]). A class that cannot ignores it.
    fn isolate(
        &mut self,
        _blame: std::sync::Arc<outboard_shm::SharedMem>,
        _until: std::time::Instant,
    ) {
    }
    /// Fail `suspect` once, alone, instead of sending it to the device.
    fn quarantine(&mut self, _suspect: crate::blame::Suspect) {}
    /// Takes what it may of session `slot`'s submissions; true if it took any.
    fn take(&mut self, slot: usize, cx: &mut Ctx<'_>) -> bool;
    /// Moves the device along: publishes, reaps, releases what waited, recovers a failed
    /// device. True if anything happened.
    fn progress(&mut self, cx: &mut Ctx<'_>) -> bool;
    /// Before the loop sleeps: arm the device's interrupts. False if work turned up.
    fn prepare_sleep(&mut self, cx: &mut Ctx<'_>) -> bool;
    /// One of the device's event sources fired.
    fn event(&mut self, ev: DeviceEvent, cx: &mut Ctx<'_>);
    /// When the oldest request in the device entered it.
    fn oldest(&self) -> Option<Instant>;
    /// Fails the device if its oldest request is older than `deadline`.
    fn check_deadline(&mut self, now: Instant, deadline: Duration, cx: &mut Ctx<'_>);
    /// Requests of session `slot` taken and not yet answered.
    fn outstanding(&self, slot: usize) -> usize;
    /// The client of session `slot` left: what it had waiting never starts.
    fn close(&mut self, slot: usize);
    /// Session `slot` drained: drop its buffer mapping.
    fn release(&mut self, slot: usize);
}
