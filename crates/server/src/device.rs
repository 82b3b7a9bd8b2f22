//! One served device's life in the server core, the same for every class: its event sources,
//! each session's buffer area mapped into it, deadlines, failure, abandon, recovery and the
//! answers it gives while out of service.
//!
//! The class's dispatcher ([`crate::dispatch::Dispatcher`]) says what its requests are and
//! which have a deadline; this module decides when the device has failed and what follows:
//!
//! - a failure (an event or a call revealed [`Failure`], or the oldest request with a deadline
//!   is older than the deadline: [`Failure::Stalled`]) takes the device out of service at once:
//!   its sources are removed, the driver abandons the device, and the dispatcher answers
//!   everything the device held — "timed out" if it stalled, else the outage — but only once
//!   the device cannot carry it out any more: a client takes its buffers back with the answer,
//!   and a device still reaching them would write other bytes than the client's, or read
//!   into memory the client uses again. A reset device cannot ([`Fence::Now`]); a vfio-user
//!   model that stalled may, until it wakes and sees its client leave, so its requests are
//!   answered when it is open again, or given up ([`Fence::AtReopen`]);
//! - in a server a supervisor restarts, every failure (a stall too) ends the process instead
//!   (exit [`crate::host::EXIT_DEVICE_FAILED`]), leaving the requests unanswered for clients
//!   to resume on the next server, after the supervisor reset the device;
//! - otherwise the device is opened again in the background ([`crate::recovery`]); meanwhile
//!   new requests and opens are answered "restarting", and "device failed" with the reason
//!   once recovery gives up. When the device is back, the new driver is swapped into the
//!   dispatcher and every live session's buffers are mapped into the new device.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_env::{
    AnyDriver, DeviceEnv, DeviceEvent, Driver, Failure, Fence, LoopError, Mapping, WorkLoop,
};
use outboard_session::control;
use outboard_shm::SharedMem;

use crate::blame::{Suspect, Watch};
use crate::dispatch::{Code, Ctx, Dispatcher, Fate, Outage, Refusal};
use crate::host::{HostStats, Source};
use crate::recovery::{Progress, Recovery, Reopen};
use crate::session::Session;

/// What a device needs from the host while it works.
pub(crate) struct Core<'a> {
    pub sessions: &'a mut [Option<Session>],
    pub stats: &'a mut HostStats,
    pub work: &'a mut WorkLoop<Source>,
    pub notify: Option<BorrowedFd<'a>>,
    /// A supervisor restarts the server: a failed device ends the process.
    pub restartable: bool,
    /// The loop's turn clock.
    pub clock: &'a crate::dispatch::TurnClock,
}

impl Core<'_> {
    /// Tells the manager (if one started this server) what happened to a device.
    fn notify(&self, event: &control::Event) {
        if let Some(n) = self.notify {
            if let Err(e) = control::try_send(n.as_fd(), event, &[]) {
                tracing::warn!("cannot tell the manager: {e}");
            }
        }
    }

    /// A device failed in a restartable server: tell the manager why, and end the process with
    /// the requests unanswered. The supervisor resets the device (closing our handle to it
    /// does) and starts a new server, on which the clients resume and send those requests
    /// again; failing them here would turn a restart into errors.
    fn end_for_restart(&self, device: &str, why: &str) -> ! {
        self.notify(&control::Event::DeviceFailed {
            device: device.into(),
            why: why.into(),
            restarting: true,
        });
        tracing::error!("device {device}: {why}; ending this server for its supervisor to restart");
        std::process::exit(crate::host::EXIT_DEVICE_FAILED)
    }

    fn watch(&mut self, d: usize, driver: &dyn Driver) -> Result<(), LoopError> {
        for (ev, fd) in driver.sources() {
            self.work.add_device(fd, ev, Source::Device(d, ev))?;
        }
        Ok(())
    }

    fn unwatch(&mut self, driver: &dyn Driver) {
        for (_, fd) in driver.sources() {
            let _ = self.work.remove(fd);
        }
    }
}

/// A device, opened again, as recovery brings it back.
type Reopened = (Box<dyn AnyDriver>, DeviceEnv);

/// One served device.
pub(crate) struct Device {
    /// Its index among the host's devices (its sources carry it).
    index: usize,
    pub(crate) class: Box<dyn Dispatcher>,
    env: DeviceEnv,
    reopen: Option<Reopen<Reopened>>,
    /// Session slot → its buffer area in the device.
    maps: Vec<Option<Mapping>>,
    /// Why the device is out of service, while it is.
    outage: Option<Outage>,
    /// Why it failed (kept while it restarts, for the final reason).
    why: Option<String>,
    recovery: Option<Recovery<Reopened>>,
    /// What the requests the device held at its failure get, while they wait for the device
    /// to be unable to carry them out ([`Fence::AtReopen`]).
    unanswered: Option<Fate>,
    watch: Watch,
}

/// A dispatcher's context over `dev`'s fields and the host's.
macro_rules! cx {
    ($dev:expr, $core:expr) => {
        Ctx {
            sessions: &mut *$core.sessions,
            stats: &mut *$core.stats,
            maps: &$dev.maps,
            outage: $dev.outage.as_ref(),
            watch: &mut $dev.watch,
            clock: $core.clock,
        }
    };
}

impl Device {
    pub(crate) fn new(
        index: usize,
        class: Box<dyn Dispatcher>,
        env: DeviceEnv,
        reopen: Option<Reopen<Reopened>>,
    ) -> Self {
        Self {
            index,
            class,
            env,
            reopen,
            maps: Vec::new(),
            outage: None,
            why: None,
            recovery: None,
            unanswered: None,
            watch: Watch::default(),
        }
    }

    pub(crate) fn name(&self) -> &str {
        self.class.name()
    }

    /// Registers the device's event sources when serving starts.
    pub(crate) fn start(&mut self, core: &mut Core<'_>) -> Result<(), LoopError> {
        core.watch(self.index, self.class.driver())
    }

    /// Why new sessions are refused now (the device is restarting or failed), if they are.
    pub(crate) fn refuses(&self) -> Option<Refusal> {
        Some(match self.outage.as_ref()? {
            Outage::Restarting => Refusal::new(
                Code::Restarting,
                format!("{} is being re-opened; try again", self.name()),
            ),
            Outage::Failed(why) => Refusal::new(
                Code::DeviceFailed,
                format!("{}: device failed: {why}", self.name()),
            ),
        })
    }

    /// A session opens at `slot`: its buffer area is mapped into the device (zero copy: the
    /// device reaches the client's buffers directly) and the class sets it up.
    pub(crate) fn open(
        &mut self,
        slot: usize,
        buffers: Arc<SharedMem>,
        resumed: Option<&serde_json::Value>,
    ) -> Result<(), Refusal> {
        let dma = self.env.map(buffers).map_err(|e| match e {
            // The device died under this server, which ends for its supervisor to bring it
            // back: the client waits for the next server, as for any restart.
            outboard_env::EnvError::Dma(outboard_hw::HwError::Gone(_)) => {
                Refusal::new(Code::Restarting, e.to_string())
            }
            e => Refusal::new(Code::Resources, e.to_string()),
        })?;
        if self.maps.len() <= slot {
            self.maps.resize_with(slot + 1, || None);
        }
        self.class.open(slot, resumed)?;
        self.maps[slot] = Some(dma);
        Ok(())
    }

    pub(crate) fn take(&mut self, slot: usize, core: &mut Core<'_>) -> bool {
        let r = self.class.take(slot, &mut cx!(self, core));
        self.settle(r, core)
    }

    /// Moves the device along, or its recovery if it is out of service.
    pub(crate) fn progress(&mut self, core: &mut Core<'_>) -> bool {
        if self.outage.is_some() {
            return self.recover(core);
        }
        let r = self.class.progress(&mut cx!(self, core));
        self.settle(r, core)
    }

    /// Before the loop sleeps; false if work turned up.
    pub(crate) fn prepare_sleep(&mut self, core: &mut Core<'_>) -> bool {
        if self.outage.is_some() {
            return true;
        }
        match self.class.prepare_sleep(&mut cx!(self, core)) {
            Ok(idle) => idle,
            Err(f) => {
                self.fail(f, core);
                false
            }
        }
    }

    pub(crate) fn event(&mut self, ev: DeviceEvent, core: &mut Core<'_>) {
        if self.outage.is_some() {
            return;
        }
        if let Err(f) = self.class.driver_mut().handle(ev) {
            self.fail(f, core);
        }
    }

    /// A call's result: a failure takes the device out of service.
    fn settle(&mut self, r: Result<bool, Failure>, core: &mut Core<'_>) -> bool {
        match r {
            Ok(progress) => progress,
            Err(f) => {
                self.fail(f, core);
                true
            }
        }
    }

    /// When the oldest request with a deadline entered the device.
    pub(crate) fn oldest(&self) -> Option<Instant> {
        if self.outage.is_some() {
            return None;
        }
        self.class.oldest_due()
    }

    /// Fails the device if its oldest request with a deadline is older than `deadline`.
    pub(crate) fn check_deadline(&mut self, now: Instant, deadline: Duration, core: &mut Core<'_>) {
        if self
            .oldest()
            .is_some_and(|t| now.duration_since(t) > deadline)
        {
            self.fail(Failure::Stalled(deadline), core);
        }
    }

    /// Takes the device out of service (see the module's description).
    fn fail(&mut self, failure: Failure, core: &mut Core<'_>) {
        if self.outage.is_some() {
            return;
        }
        let stalled = matches!(failure, Failure::Stalled(_));
        let why = failure.to_string();
        let name = self.name().to_string();
        if core.restartable {
            // Every failure, a stall too: the requests in the device stay unanswered and the
            // clients send them again to the next server, once the supervisor has reset the
            // device (an emulated one by starting its model again). Answered here, a stalled
            // model could still carry them out after their clients took their buffers back.
            core.end_for_restart(&name, &why);
        }
        tracing::error!("device {name}: {why}; giving it up");
        core.stats.device_failures += 1;
        core.unwatch(self.class.driver());
        let fence = self.class.driver_mut().abandon();
        self.recovery = self.reopen.clone().map(Recovery::new);
        let outage = match self.recovery {
            Some(_) => Outage::Restarting,
            None => Outage::Failed(why.clone()),
        };
        self.why = Some(why.clone());
        core.notify(&control::Event::DeviceFailed {
            device: name.clone(),
            why: why.clone(),
            restarting: self.recovery.is_some(),
        });
        let fate = if stalled {
            Fate::TimedOut
        } else {
            Fate::Out(outage.clone())
        };
        self.outage = Some(outage);
        // Unfenced, the answers wait until the device cannot carry the requests out: it is
        // back (it reset) or given up. A device nothing will re-open is given up now.
        if fence == Fence::AtReopen && self.recovery.is_some() {
            tracing::warn!(
                "device {name}: its requests are answered once it is back (it may still \
                 carry them out until it resets)"
            );
            self.unanswered = Some(fate);
        } else {
            self.class.fail_all(&fate, &mut cx!(self, core));
        }
    }

    /// Answers the requests the device held at its failure, if they still wait: it can no
    /// longer carry them out. `gave_up` replaces an outage's answer with the final one.
    fn answer_unanswered(&mut self, gave_up: bool, core: &mut Core<'_>) {
        let Some(fate) = self.unanswered.take() else {
            return;
        };
        let fate = match (fate, &self.outage) {
            (Fate::Out(_), Some(o)) if gave_up => Fate::Out(o.clone()),
            (fate, _) => fate,
        };
        self.class.fail_all(&fate, &mut cx!(self, core));
    }

    /// Advances the recovery; when the device is open again, swaps the new driver in and maps
    /// every live session's buffers into the new device.
    fn recover(&mut self, core: &mut Core<'_>) -> bool {
        let Some(recovery) = self.recovery.as_mut() else {
            return false;
        };
        let (new, env) = match recovery.poll() {
            Progress::Trying => return false,
            Progress::Back(device) => device,
            Progress::GaveUp(why) => {
                self.give_up(why, core);
                return true;
            }
        };
        // Open again, the device was reset: what the old one held is answered first.
        self.answer_unanswered(false, core);
        let name = self.name().to_string();
        if new.class() != self.class.class() {
            let why = format!("the re-opened device serves the {} class", new.class());
            self.give_up(why, core);
            return true;
        }
        if let Err(e) = core.watch(self.index, new.driver()) {
            tracing::error!("device {name}: cannot watch the re-opened device: {e}");
            core.unwatch(new.driver());
            return false;
        }
        if let Err(why) = self.class.replace(new) {
            self.give_up(why.to_string(), core);
            return true;
        }
        self.env = env;
        let attempts = self.recovery.take().map_or(0, |r| r.attempts);
        self.outage = None;
        self.why = None;
        for (slot, map) in self.maps.iter_mut().enumerate() {
            let Some(map) = map.as_mut() else { continue };
            let Some(s) = core.sessions[slot].as_mut().filter(|s| !s.closing()) else {
                continue;
            };
            match self.env.map(s.region.buffers.clone()) {
                // The old mapping unmaps from the old device, which is gone: that fails fast.
                Ok(dma) => *map = dma,
                Err(e) => {
                    tracing::warn!(
                        "session {}: cannot map into the re-opened device: {e}",
                        s.id
                    );
                    s.cut_off();
                }
            }
        }
        tracing::warn!("device {name}: back after {attempts} attempt(s)");
        core.stats.device_recoveries += 1;
        core.notify(&control::Event::DeviceRecovered { device: name });
        true
    }

    /// Recovery failed for good.
    fn give_up(&mut self, why: String, core: &mut Core<'_>) {
        let name = self.name().to_string();
        tracing::error!("device {name}: {why}; given up for good");
        let why = format!("{}; {why}", self.why.take().unwrap_or_default());
        self.outage = Some(Outage::Failed(why.clone()));
        self.why = Some(why.clone());
        self.recovery = None;
        core.notify(&control::Event::DeviceFailed {
            device: name,
            why,
            restarting: false,
        });
        // Not certain it cannot carry them out (a model that never came back may yet wake),
        // but nothing will open it again to make it so: the clients are told now.
        self.answer_unanswered(true, core);
    }

    #[inline]
    pub(crate) fn outstanding(&self, slot: usize) -> usize {
        self.class.outstanding(slot)
    }

    pub(crate) fn close(&mut self, slot: usize) {
        self.class.close(slot);
    }

    /// Session `slot` drained: the class forgets it and its buffers leave the device.
    pub(crate) fn release(&mut self, slot: usize) {
        self.class.release(slot);
        if let Some(m) = self.maps.get_mut(slot) {
            *m = None;
        }
    }

    pub(crate) fn isolate(&mut self, page: Arc<SharedMem>, until: Instant) {
        self.watch.isolate(page, self.index, until);
    }

    pub(crate) fn quarantine(&mut self, suspect: Suspect) {
        self.watch.quarantine(suspect);
    }

    pub(crate) fn hold_back(&mut self, suspect: Suspect) {
        self.watch.hold_back(suspect);
    }
}
