//! Supervision: the loop, children that exit or hang, the restart policy, quarantine, and
//! what a restarted server is told.

use super::*;

use crate::quarantine::Series;
use outboard_server::blame::Verdict;

impl Manager {
    /// Serves the control API and supervises children until `stop` is set.
    ///
    /// Nothing here blocks: a control connection is an event source of its own, read only when
    /// it is readable and answered without waiting, so an idle or stuck client cannot delay a
    /// crash report or another client.
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), ManagerError> {
        let mut work: WorkLoop<Source> = WorkLoop::new()?;
        let (listener, _) = self.listener.as_ref().ok_or(ManagerError::NotStarted)?;
        work.add(listener.as_fd(), Source::Listener)?;
        for (i, p) in self.procs.iter().enumerate() {
            if p.exited.is_none() {
                work.add(p.fd(), Source::Child(i))?;
            }
            p.watch(&mut work, i);
        }
        let mut ready = Vec::new();
        while !stop.load(Ordering::Relaxed) && !self.down {
            ready.clear();
            work.wait(Some(self.next_check()), &mut ready)?;
            self.renumbered = false;
            for &source in &ready {
                if self.renumbered {
                    break;
                }
                match source {
                    Source::Listener => self.accept(&mut work),
                    Source::Child(i) => {
                        if self.procs.get_mut(i).is_some_and(Process::reap) {
                            let _ = work.remove(self.procs[i].fd());
                            self.exited(i, &mut work);
                        }
                    }
                    Source::Conn(i) => self.serve(&mut work, i),
                    Source::Events(i) => {
                        self.child_event(&mut work, i);
                    }
                    Source::Broker(i) => self.serve_broker(&mut work, i),
                }
            }
            self.supervise(&mut work);
            self.resume_accepts(&mut work);
        }
        Ok(())
    }

    /// Takes one event a driver server reported, if one is waiting (true if it did); a
    /// channel that closed or sent garbage is dropped (the pidfd reports the exit itself).
    pub(crate) fn child_event(&mut self, work: &mut WorkLoop<Source>, i: usize) -> bool {
        let Some(ev) = self.procs.get(i).and_then(|p| p.events.as_ref()) else {
            return false;
        };
        let received = control::recv::<control::Event>(ev.as_fd(), Some(Duration::ZERO));
        if let Ok((event, _)) = &received {
            if !self.procs[i].kind.may_report(event) {
                tracing::warn!(
                    "{} (pid {}) reported {event:?}, about something it was not given: ignored",
                    self.procs[i].role,
                    self.procs[i].pid()
                );
                return true;
            }
        }
        match received {
            Ok((
                control::Event::DeviceFailed {
                    device,
                    why,
                    restarting,
                },
                _,
            )) => {
                self.procs[i].device_failed = Some(format!("{device}: {why}"));
                let detail = if restarting {
                    tracing::error!("{device}: failed, its driver is re-opening it: {why}");
                    Detail::While("restarting", &why)
                } else {
                    tracing::error!("{device}: its driver gave the device up: {why}");
                    Detail::Because(&why)
                };
                if let Some(drv) = self.driver_of_mut(&device) {
                    drv.set_state(State::Failed, detail);
                }
            }
            // A model's readiness is waited for where it is started.
            Ok((control::Event::Serving { startup }, fds))
                if matches!(self.procs[i].kind, supervisor::Kind::Server { .. }) =>
            {
                self.serving(i, fds, startup)
            }
            Ok((control::Event::Serving { .. }, _))
                if matches!(self.procs[i].kind, supervisor::Kind::Model { .. }) =>
            {
                self.model_serving(i)
            }
            Ok((control::Event::Serving { .. }, _)) => {}
            Ok((control::Event::ExportClients { export, clients }, _)) => {
                self.procs[i].served = true;
                self.procs[i].restarts.served();
                if let Some(n) = self.registry.find_mut("export", &format!("nbd:{export}")) {
                    n.set_state(State::Running, Detail::None);
                    n.set("clients", clients.len());
                    n.set("peers", clients.join(", "));
                }
            }
            Ok((control::Event::Quiesced { device }, _)) => {
                if self.move_drained(&device) {
                } else if self.procs[i].graceful.is_some() {
                    self.drained(i, &device);
                } else if self.detaching.contains(&device) {
                    self.finish_detach(&device, work);
                } else if self.suspended.contains(&device) {
                    tracing::info!("{device}: suspended (quiesced, nothing in flight)");
                    if let Some(b) = self.class_device_mut(&device) {
                        b.set_state(State::Suspended, Detail::None);
                    }
                }
            }
            Ok((control::Event::DeviceRecovered { device }, _)) => {
                tracing::info!("{device}: its driver brought the device back");
                if let Some(drv) = self.driver_of_mut(&device) {
                    drv.set_state(State::Running, Detail::Note("recovered"));
                }
            }
            Err(outboard_session::SessionError::Timeout) => return false,
            Err(_) => {
                if let Some(ev) = self.procs[i].events.take() {
                    let _ = work.remove(ev.as_fd());
                }
                return false;
            }
        }
        true
    }

    /// How long the loop may sleep: until the next restart is due, and no longer than the
    /// heartbeat check allows.
    pub(crate) fn next_check(&self) -> Duration {
        let now = std::time::Instant::now();
        let mut wait = Duration::from_millis(100);
        if let Some(t) = self.accept_paused {
            wait = wait.min(t.saturating_duration_since(now));
        }
        for p in &self.procs {
            // A server due to start but waiting for its models wakes nobody: their events
            // (a model serving, or dying) do. Counting it would spin the loop meanwhile.
            if let Some(at) = p.restart_at.filter(|_| !self.models_down(&p.kind)) {
                wait = wait.min(at.saturating_duration_since(now));
            }
            if p.heartbeat.is_some() {
                wait = wait.min(Duration::from_millis(50));
            }
            // A dead server's standby comes after its restart (which resets the timer).
            if let Some(at) = p.standby_at.filter(|_| p.exited.is_none()) {
                wait = wait.min(at.saturating_duration_since(now));
            }
        }
        wait
    }

    /// Whether `kind` is a driver server one of whose models is not in service (dead,
    /// waiting to restart, or starting): it must not start before them.
    pub(crate) fn models_down(&self, kind: &supervisor::Kind) -> bool {
        matches!(kind, supervisor::Kind::Server { .. })
            && Self::devices_of(kind).iter().any(|n| {
                self.procs.iter().any(|m| {
                    m.kind == (supervisor::Kind::Model { device: n.clone() })
                        && (m.restart_at.is_some() || m.exited.is_some() || m.serve_by.is_some())
                })
            })
    }

    /// The restart policy of the devices a process serves or models.
    pub(crate) fn policy(&self, kind: &supervisor::Kind) -> supervisor::RestartPolicy {
        let first = match kind {
            supervisor::Kind::Model { device } => Some(device),
            supervisor::Kind::Server { devices, .. } => devices.first(),
            supervisor::Kind::Export { .. } => None,
        };
        first
            .and_then(|n| self.machine.devices.iter().find(|d| &d.name == n))
            .map(|d| d.restart)
            .unwrap_or_default()
    }

    /// The class devices a process serves (a server) or models (a model).
    pub(crate) fn devices_of(kind: &supervisor::Kind) -> Vec<String> {
        match kind {
            supervisor::Kind::Model { device } => vec![device.clone()],
            supervisor::Kind::Server { devices, .. } => devices.clone(),
            supervisor::Kind::Export { .. } => Vec::new(),
        }
    }

    /// Records a state on the driver and the class device node of each of `devices`.
    pub(crate) fn set_state(
        &mut self,
        devices: &[String],
        driver: (State, Detail<'_>),
        device: (State, Detail<'_>),
    ) {
        for n in devices {
            if let Some(drv) = self.driver_of_mut(n) {
                drv.set_state(driver.0, driver.1);
            }
            if let Some(b) = self.class_device_mut(n) {
                b.set_state(device.0, device.1);
            }
        }
    }

    /// Child `i` exited while the machine runs: a driver server or a model is started again
    /// (at once the first time, with back-off after that) until it crashes more often than
    /// its policy allows; then it is given up and its clients are told so.
    pub(crate) fn exited(&mut self, i: usize, work: &mut WorkLoop<Source>) {
        // What it reported before it died is taken first: the loop may see the exit before
        // the channel, and a server that said it serves (with its heartbeat page, which names
        // the request in its device) and died at once would be weighed without them — a
        // crash that named nobody, which started a request's series of crashes again.
        // (Bounded: a dead writer sends nothing more.)
        for _ in 0..64 {
            if !self.child_event(work, i) {
                break;
            }
        }
        self.procs[i].unwatch(work);
        self.procs[i].events = None;
        self.procs[i].broker = None;
        // Progress, read before the heartbeat page goes: a server whose loop turned after it
        // said it serves; a model that came into service. A restart an operator asked for is
        // planned: started again whatever the policy.
        let p = &self.procs[i];
        let progressed = match &p.kind {
            supervisor::Kind::Server { .. } => {
                p.served && p.heartbeat.as_ref().is_some_and(|h| h.turned())
            }
            _ => p.served,
        };
        let death = if p.planned {
            supervisor::Death::Planned
        } else {
            supervisor::Death::of(p.exited, progressed, p.hung)
        };
        if matches!(p.kind, supervisor::Kind::Server { .. }) {
            let fault = supervisor::is_fault(p.exited, p.hung) || p.model_crashed;
            // No heartbeat page: it died before it served, with nothing in its devices.
            let (verdict, answered) = p.heartbeat.as_ref().map_or((Verdict::Nobody, 0), |h| {
                (h.verdict(), outboard_server::blame::answered(h.page()))
            });
            self.forget_answered(i, answered);
            self.weigh_for_quarantine(i, fault, verdict, death);
        }
        self.procs[i].heartbeat = None;
        self.retire_counters(i);
        self.procs[i].planned = false;
        let kind = self.procs[i].kind.clone();
        if let supervisor::Kind::Export { name } = &kind {
            self.export_exited(i, name, death);
            return;
        }
        let now = std::time::Instant::now();
        let policy = self.policy(&kind);
        let p = &mut self.procs[i];
        let status = match (p.hung, p.exited, p.kind.clone()) {
            (true, _, supervisor::Kind::Model { .. }) => {
                format!("not in service within {MODEL_START_TIME:?}, killed")
            }
            (true, _, _) => format!("hung: no heartbeat for {:?}, killed", policy.heartbeat),
            // A server that ended because its device failed says why in its last event.
            (false, Some(s), _) if s.code() == Some(outboard_server::host::EXIT_DEVICE_FAILED) => {
                match p.device_failed.take() {
                    Some(why) => format!("its device failed: {why}"),
                    None => format!("its device failed ({s})"),
                }
            }
            (false, Some(s), _) => s.to_string(),
            (false, None, _) => String::new(),
        };
        let (role, pid, log) = (p.role.clone(), p.pid(), p.log.clone());
        p.down_since.get_or_insert(now);
        if p.timeline.is_empty() {
            p.timeline.push(("down".into(), control::monotonic_ns()));
        }
        let delay = p.restarts.crashed(now, &policy, death);
        let total = p.restarts.total;
        // What ended it, and no dead pid shown as current.
        let devices = Self::devices_of(&kind);
        let last_exit = format!("{role} (pid {pid}) {status}");
        match &kind {
            supervisor::Kind::Model { device } => {
                if let Some(f) = self
                    .registry
                    .find_mut("pci-function", &format!("{device}@vfio-user"))
                {
                    f.props.remove("pid");
                    f.set("last-exit", last_exit.clone());
                }
            }
            _ => {
                let quarantined = self.procs[i].quarantined;
                for n in &devices {
                    if let Some(drv) = self.driver_of_mut(n) {
                        drv.props.remove("pid");
                        drv.set("last-exit", last_exit.clone());
                        if quarantined > 0 {
                            drv.set("quarantined", quarantined);
                        }
                    }
                }
            }
        }
        // A server whose model was given up has nothing to serve.
        let model_gone = Self::devices_of(&kind).iter().find_map(|n| {
            self.procs.iter().find_map(|m| {
                (m.kind == (supervisor::Kind::Model { device: n.clone() }))
                    .then(|| m.gave_up.clone())
                    .flatten()
            })
        });
        let delay = if model_gone.is_some() { None } else { delay };
        // The log explains the crash: it outlives the machine.
        self.created.retain(|f| f != &log);
        match delay {
            Some(d) => {
                tracing::warn!(
                    "{role} (pid {pid}) exited ({status}); restart {total} in {d:?}; log {}",
                    log.display()
                );
                self.procs[i].restart_at = Some(now + d);
                self.set_state(
                    &devices,
                    (
                        State::Restarting,
                        Detail::Note(&format!("{role} exited: {status}")),
                    ),
                    (State::Restarting, Detail::None),
                );
            }
            None => {
                let cause = match &model_gone {
                    Some(_) => format!("{role}: its device model was given up"),
                    None => {
                        let deaths = self.procs[i].restarts.failing(now, &policy) + 1;
                        crash_loop(&role, &status, policy.limit, deaths, &log)
                    }
                };
                let retry = self.procs[i].restarts.next_retry(&policy);
                let detail = format!(
                    "{cause}; trying again in {retry:?} (or now: outboard restart {})",
                    devices.first().map(String::as_str).unwrap_or("DEVICE")
                );
                let why = State::GaveUp.text(Detail::Because(&detail));
                tracing::error!("{why}");
                outboard_sys::errln!("outboard: {why}");
                self.procs[i].gave_up = Some(why);
                // Given up is not forever: tried again, sooner at first.
                self.procs[i].restart_at = Some(now + retry);
                let given_up = (State::GaveUp, Detail::Because(&detail));
                self.set_state(&devices, given_up, given_up);
            }
        }
        // A server that ended because its device failed (a hung or lying model): the model
        // is reset the only way an emulated device can be, by starting it again on its
        // backing. It is reaped here, so the server cannot start before it is back.
        // So is one that hung (most often in a call to a model that stopped answering) or
        // crashed before it served (it could not bring its device up). One killed from
        // outside before it served says nothing about the device. (Not when the server is
        // given up: the model's restart would report the device restarting, and its clients
        // would wait for it instead of being told it was given up.)
        let p = &self.procs[i];
        let device_failed = p.exited.and_then(|s| s.code())
            == Some(outboard_server::host::EXIT_DEVICE_FAILED)
            || p.hung
            || (!p.served && death == supervisor::Death::Crash);
        let device_failed = device_failed && matches!(kind, supervisor::Kind::Server { .. });
        if device_failed && delay.is_some() {
            // A model started after this server is a new one already: the failure was the
            // old one's.
            let server_started = self.procs[i].started;
            let models: Vec<usize> = (0..self.procs.len())
                .filter(|&j| {
                    let m = &self.procs[j];
                    m.exited.is_none()
                        && m.started <= server_started
                        && matches!(&m.kind, supervisor::Kind::Model { device } if devices.contains(device))
                })
                .collect();
            for j in models {
                let m = &mut self.procs[j];
                tracing::warn!(
                    "{}: its driver found the device failed; restarting it",
                    m.role
                );
                let _ = m.child.kill();
                m.exited = m.child.wait().ok();
                let _ = work.remove(m.fd());
                self.exited(j, work);
            }
        }
        if let supervisor::Kind::Model { device } = &kind {
            if let Some(f) = self
                .registry
                .find_mut("pci-function", &format!("{device}@vfio-user"))
            {
                f.set_state(
                    if delay.is_some() {
                        State::Restarting
                    } else {
                        State::GaveUp
                    },
                    Detail::None,
                );
                f.set("restarts", total);
            }
            // Its driver cannot serve without it: end the server now (it would notice at its
            // next request), so it starts again on the new model and its clients replay.
            let model_fault = supervisor::is_fault(self.procs[i].exited, false);
            for p in &mut self.procs {
                if p.kind.serves(device) && p.exited.is_none() {
                    p.model_crashed |= model_fault;
                    let _ = rustix::process::kill_process(
                        rustix::process::Pid::from_child(&p.child),
                        rustix::process::Signal::KILL,
                    );
                }
            }
        }
    }

    /// Server `i` answered the requests it was told to quarantine that `answered` names (bit
    /// `j` for the `j`th): the next is not told them again, since their fingerprints would
    /// fail the sessions' next requests like them for nothing.
    fn forget_answered(&mut self, i: usize, answered: u64) {
        if let Some(s) = self.procs[i].server.as_mut() {
            let mut j = 0;
            s.quarantine.retain(|_| {
                let keep = j >= 64 || answered & 1 << j == 0;
                j += 1;
                keep
            });
        }
    }

    /// Weighs the death of driver server `i` for quarantine ([`crate::quarantine`]). A
    /// crash of its own (or of its model) starts the next incarnation isolated, holding back
    /// what the crash named and failing what crashed it too often; a death that was no fault,
    /// after progress, ends isolation and the series.
    pub(crate) fn weigh_for_quarantine(
        &mut self,
        i: usize,
        fault: bool,
        verdict: Verdict,
        death: supervisor::Death,
    ) {
        const ISOLATE: Duration = Duration::from_secs(2);
        let p = &mut self.procs[i];
        if !fault {
            if matches!(
                death,
                supervisor::Death::AfterProgress | supervisor::Death::Planned
            ) {
                if let Some(s) = p.server.as_mut() {
                    s.isolate_ms = 0;
                    s.quarantine.clear();
                    s.hold_back.clear();
                }
                p.suspect = Series::None;
            }
            return;
        }
        let w = p.suspect.crash(verdict);
        for (b, strikes) in &w.quarantined {
            tracing::error!(
                "{}: request {b} crashed the driver {strikes} times: the next server fails it",
                p.role
            );
        }
        if let Series::Named(named) = &w.series {
            for (b, strikes) in named {
                tracing::warn!(
                    "{}: request {b} was in the device at this crash ({strikes} in a row)",
                    p.role
                );
            }
        }
        if let Some(s) = p.server.as_mut() {
            s.isolate_ms = ISOLATE.as_millis() as u64;
            for (b, _) in &w.quarantined {
                if !s.quarantine.contains(b) {
                    s.quarantine.push(*b);
                }
            }
            s.hold_back = w.series.held_back();
        }
        p.suspect = w.series;
        p.quarantined += w.quarantined.len() as u64;
    }

    /// Starts what is due to restart, kills driver servers whose heartbeat stopped and
    /// restarted models that do not come into service.
    pub(crate) fn supervise(&mut self, work: &mut WorkLoop<Source>) {
        let now = std::time::Instant::now();
        self.advance_move(now, work);
        // A graceful restart whose devices did not drain in time: restarted anyway (its
        // clients replay what was in the device).
        for i in 0..self.procs.len() {
            if self.procs[i]
                .graceful
                .as_ref()
                .is_some_and(|(_, by)| now >= *by)
            {
                tracing::warn!(
                    "{}: did not drain within {GRACEFUL_DRAIN:?}; restarting it anyway",
                    self.procs[i].role
                );
                self.end_for_restart(i);
            }
        }
        for i in 0..self.procs.len() {
            let kind = self.procs[i].kind.clone();
            if let Some(hb) = self.procs[i].heartbeat.as_mut() {
                let still = hb.still_for(now);
                let limit = self.policy(&kind).heartbeat;
                if still > limit && self.procs[i].exited.is_none() && !self.procs[i].hung {
                    // The heartbeat page stays until the death is weighed: whether this
                    // incarnation served, and which request was in the device, are on it.
                    self.procs[i]
                        .kill_as_hung(&format!("is hung: its loop has not turned for {still:?}"));
                    let devices = Self::devices_of(&kind);
                    for n in &devices {
                        if let Some(drv) = self.driver_of_mut(n) {
                            drv.set(
                                "last-hang",
                                format!("no heartbeat for {} ms", still.as_millis()),
                            );
                        }
                    }
                }
            }
            let p = &mut self.procs[i];
            if p.exited.is_none() && p.standby.as_mut().is_some_and(|s| !s.alive()) {
                tracing::warn!(
                    "{}: its standby died; another starts in {STANDBY_RETRY:?}",
                    p.role
                );
                p.standby = None;
                p.standby_at = Some(now + STANDBY_RETRY);
                self.show_standby(i);
            }
            if self.procs[i].standby_at.is_some_and(|at| at <= now)
                && self.procs[i].exited.is_none()
            {
                self.procs[i].standby_at = None;
                self.prepare_standby(i);
            }
            let p = &mut self.procs[i];
            if p.serve_by.is_some_and(|by| by <= now) && p.exited.is_none() && !p.hung {
                p.kill_as_hung(&format!(
                    "did not come into service within {MODEL_START_TIME:?}"
                ));
            }
            if self.procs[i].restart_at.is_none_or(|at| at > now) {
                continue;
            }
            // A server starts only once its models run again and are in service.
            if self.models_down(&kind) {
                continue;
            }
            self.restart(i, work);
        }
    }

    /// Starts child `i` again.
    pub(crate) fn restart(&mut self, i: usize, work: &mut WorkLoop<Source>) {
        self.procs[i].restart_at = None;
        let kind = self.procs[i].kind.clone();
        let p = &mut self.procs[i];
        if matches!(kind, supervisor::Kind::Server { .. }) {
            // Resuming sessions claim back what they kept before anyone is granted anything.
            if let Some(s) = p.server.as_mut() {
                s.resume_grace_ms = RESUME_GRACE.as_millis() as u64;
            }
        }
        if p.postponed_for_descriptors(ACCEPT_BACKOFF) {
            return;
        }
        p.timeline.push(("respawn".into(), control::monotonic_ns()));
        // No stamp when `respawn` returns: the child may reach `main` before it does; its own
        // first stamp is the next step.
        let exe = p.exe.clone().unwrap_or_else(|| self.opts.exe.clone());
        let started = if p.standby_suits(&exe) {
            let standby = p.standby.take().expect("it suits");
            p.take_over(standby).or_else(|e| {
                tracing::warn!(
                    "{}: its standby could not take over ({e}); starting anew",
                    p.role
                );
                p.respawn(&exe, self.opts.verbose)
            })
        } else {
            p.respawn(&exe, self.opts.verbose)
        };
        if let Err(e) = started {
            tracing::error!("{e}");
            // Counted as another crash: back-off, and in the end giving up, apply.
            p.exited = None;
            let now = std::time::Instant::now();
            let policy = self.policy(&kind);
            let p = &mut self.procs[i];
            match p.restarts.crashed(now, &policy, supervisor::Death::Crash) {
                Some(d) => p.restart_at = Some(now + d),
                None => {
                    let retry = p.restarts.next_retry(&policy);
                    let detail =
                        format!("{e}; trying again in {retry:?} (or now: outboard restart)");
                    p.gave_up = Some(State::GaveUp.text(Detail::Because(&detail)));
                    p.restart_at = Some(now + retry);
                    let given_up = (State::GaveUp, Detail::Because(&detail));
                    self.set_state(&Self::devices_of(&kind), given_up, given_up);
                }
            }
            // Its standby may have been used up by an attempt that failed.
            self.show_standby(i);
            return;
        }
        p.gave_up = None;
        let pid = p.pid();
        let _ = work.add(p.fd(), Source::Child(i));
        p.watch(work, i);
        let total = p.restarts.total;
        if let supervisor::Kind::Model { device } = &kind {
            // Its `Serving` event comes through the loop ([`Manager::model_serving`]); until
            // then its driver server waits, and the loop goes on supervising and answering.
            // One that is not in service in time is killed, like a hung server.
            self.procs[i].serve_by = Some(std::time::Instant::now() + MODEL_START_TIME);
            // Its device is coming back (after a give-up too): clients wait, not fail.
            self.set_state(
                std::slice::from_ref(device),
                (
                    State::Restarting,
                    Detail::Note("its device model is starting"),
                ),
                (State::Restarting, Detail::None),
            );
            if let Some(f) = self
                .registry
                .find_mut("pci-function", &format!("{device}@vfio-user"))
            {
                f.set_state(State::Starting, Detail::None);
                f.set("pid", pid);
                f.set("restarts", total);
            }
        } else if let supervisor::Kind::Export { name } = &kind {
            self.procs[i].served = false;
            if let Some(n) = self.registry.find_mut("export", &format!("nbd:{name}")) {
                n.set("pid", pid);
                n.set_state(State::Starting, Detail::None);
            }
        } else {
            let devices = Self::devices_of(&kind);
            for n in &devices {
                if let Some(drv) = self.driver_of_mut(n) {
                    drv.set("pid", pid);
                    drv.set("restarts", total);
                }
            }
            // A standby that took over is the server now; the next one comes once it serves.
            self.show_standby(i);
            self.set_state(
                &devices,
                (State::Starting, Detail::None),
                (State::Restarting, Detail::None),
            );
        }
    }

    /// Restarted device model `i` is in service: its driver server may start.
    pub(crate) fn model_serving(&mut self, i: usize) {
        let p = &mut self.procs[i];
        if p.serve_by.take().is_none() {
            // Its first start was waited for where it was launched.
            return;
        }
        p.served = true;
        p.restarts.served();
        let (pid, down) = (p.pid(), p.down_since.take().map(|t| t.elapsed()));
        if let supervisor::Kind::Model { device } = p.kind.clone() {
            tracing::info!(
                "device model for {device} restarted (pid {pid}) in {:?}",
                down.unwrap_or_default()
            );
            if let Some(f) = self
                .registry
                .find_mut("pci-function", &format!("{device}@vfio-user"))
            {
                f.set_state(State::Running, Detail::None);
            }
        }
    }

    /// Driver server `i` serves (first start or a restart): its heartbeat starts counting.
    pub(crate) fn serving(&mut self, i: usize, fds: Vec<OwnedFd>, startup: Vec<(String, u64)>) {
        let p = &mut self.procs[i];
        let mut timeline = std::mem::take(&mut p.timeline);
        if !timeline.is_empty() {
            timeline.extend(startup);
            timeline.push(("serving".into(), control::monotonic_ns()));
        }
        p.served = true;
        p.restarts.served();
        let mut fds = fds.into_iter();
        match fds.next().map(supervisor::Heartbeat::new) {
            Some(Ok(hb)) => p.heartbeat = Some(hb),
            Some(Err(e)) => tracing::warn!("{}: {e}", p.role),
            None => tracing::warn!("{}: no heartbeat page", p.role),
        }
        // A server that keeps no counts sends no page; a bad page is not read.
        if let Some(fd) = fds.next() {
            match outboard_server::counters::Reader::new(fd) {
                Ok(c) => p.counters = Some(c),
                Err(e) => tracing::warn!("{}: its counters: {e}", p.role),
            }
        }
        let (role, pid, total) = (p.role.clone(), p.pid(), p.restarts.total);
        let down = p.down_since.take().map(|t| t.elapsed());
        let devices = Self::devices_of(&p.kind.clone());
        if let Some(down) = down {
            tracing::info!("{role} (pid {pid}) serves again, {down:?} after it went down");
            for n in &devices {
                if let Some(drv) = self.driver_of_mut(n) {
                    drv.set("last-restart-ms", down.as_secs_f64() * 1e3);
                    drv.set("restarts", total);
                    if let Some(&(_, t0)) = timeline.first() {
                        // For people: each step, in ms after the death was noticed; for
                        // programs (`bench restart`), the stamps themselves.
                        let steps: Vec<String> = timeline
                            .iter()
                            .map(|(step, t)| {
                                format!("{step} +{:.2}", t.saturating_sub(t0) as f64 / 1e6)
                            })
                            .collect();
                        drv.set("last-restart-steps-ms", steps.join(", "));
                        drv.set("last-restart-stamps", serde_json::json!(timeline));
                    }
                }
            }
            self.set_state(
                &devices,
                (
                    State::Running,
                    Detail::Note(&format!("restarted {total} times")),
                ),
                (State::Serving, Detail::None),
            );
        } else {
            self.set_state(
                &devices,
                (State::Running, Detail::None),
                (State::Serving, Detail::None),
            );
        }
        // A new incarnation started with what was suspended quiesced (`--quiesce`); it
        // reports it drained, which needs the command's reply path: ask again.
        let suspended: Vec<String> = devices
            .into_iter()
            .filter(|n| self.suspended.contains(n) || self.detaching.contains(n))
            .collect();
        for n in suspended {
            self.command(&n, control::Command::Quiesce { device: n.clone() });
        }
        // At the first start at once; after a restart once the clients are back, so that the
        // standby's own start-up does not take the CPU their resume needs.
        if down.is_some() {
            self.procs[i].standby_at = Some(std::time::Instant::now() + STANDBY_AFTER_RESTART);
        } else {
            self.prepare_standby(i);
        }
    }

    /// Driver server `i` serves: unless its devices say otherwise (`standby = false`), a
    /// standby waits to take its place at its next death. Started once the server serves, so
    /// that its own start-up is off this restart's path.
    pub(crate) fn prepare_standby(&mut self, i: usize) {
        let kind = self.procs[i].kind.clone();
        let wanted = matches!(kind, supervisor::Kind::Server { .. }) && self.policy(&kind).standby;
        let exe = (self.procs[i].exe.clone()).unwrap_or_else(|| self.opts.exe.clone());
        let verbose = self.opts.verbose;
        let p = &mut self.procs[i];
        if !wanted {
            p.standby = None;
        } else if !p.standby_suits(&exe) {
            if let Some(args) = p.server.as_ref().filter(|a| crate::standby::may_serve(a)) {
                let role = format!("standby for {}", p.role);
                match crate::standby::Standby::spawn(&exe, &role, args, p.log.clone(), verbose) {
                    Ok(s) => p.standby = Some(s),
                    Err(e) => tracing::warn!("{}: no standby: {e}", p.role),
                }
            }
        }
        self.show_standby(i);
    }

    /// The registry names server `i`'s standby (`standby-pid` on its drivers), or none.
    pub(crate) fn show_standby(&mut self, i: usize) {
        let pid = self.procs[i].standby.as_ref().map(|s| s.pid());
        for n in Self::devices_of(&self.procs[i].kind.clone()) {
            if let Some(drv) = self.driver_of_mut(&n) {
                match pid {
                    Some(pid) => drv.set("standby-pid", pid),
                    None => {
                        drv.props.remove("standby-pid");
                    }
                }
            }
        }
    }

    /// Export `i` (named `name`) exited while the machine runs: the clients it had are gone
    /// with it, and it is started again like a driver server (at once if it had served,
    /// with back-off in a crash loop, given up past its policy's limit).
    pub(crate) fn export_exited(&mut self, i: usize, name: &str, death: supervisor::Death) {
        let now = std::time::Instant::now();
        let policy = supervisor::RestartPolicy::default();
        let p = &mut self.procs[i];
        let status = p.exited.map(|s| s.to_string()).unwrap_or_default();
        let (role, pid, log) = (p.role.clone(), p.pid(), p.log.clone());
        let delay = p.restarts.crashed(now, &policy, death);
        let total = p.restarts.total;
        // The log explains the crash: it outlives the machine.
        self.created.retain(|f| f != &log);
        let state = match delay {
            Some(d) => {
                tracing::warn!(
                    "{role} (pid {pid}) exited ({status}); restart {total} in {d:?}; log {}",
                    log.display()
                );
                self.procs[i].restart_at = Some(now + d);
                State::Restarting.text(Detail::Note(&status))
            }
            None => {
                let retry = self.procs[i].restarts.next_retry(&policy);
                let why = State::GaveUp.text(Detail::Because(&format!(
                    "{}; trying again in {retry:?}",
                    crash_loop(
                        &role,
                        &status,
                        policy.limit,
                        self.procs[i].restarts.failing(now, &policy) + 1,
                        &log
                    ),
                )));
                tracing::error!("{why}");
                outboard_sys::errln!("outboard: {why}");
                self.procs[i].gave_up = Some(why.clone());
                self.procs[i].restart_at = Some(now + retry);
                why
            }
        };
        if let Some(n) = self.registry.find_mut("export", &format!("nbd:{name}")) {
            n.set("state", state);
            n.set("clients", 0);
            n.set("peers", "");
            n.set("restarts", total);
            n.props.remove("pid");
        }
    }
}

/// Why a process is given up: the death that went past `limit` crashes in a row without
/// progress (or the only one, with `restarts = 0`), and where its log is.
pub(crate) fn crash_loop(
    role: &str,
    status: &str,
    limit: u32,
    deaths: usize,
    log: &Path,
) -> String {
    match limit {
        0 => format!("{role} exited ({status}) and restarts = 0"),
        _ => format!(
            "{role} exited ({status}), {deaths} times in a row without serving; log {}",
            log.display()
        ),
    }
}
