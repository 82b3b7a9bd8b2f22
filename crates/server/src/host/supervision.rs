//! The driver server's side of supervision: the heartbeat, isolation and quarantine after a
//! crash, the grace for resuming sessions, and quiescing on the manager's command.

use super::*;

impl DriverHost {
    /// Tells the manager the server is serving, and hands it the heartbeat: a sealed page
    /// whose first word this loop bumps each turn (and at least every 100 ms when idle).
    /// `startup`: when each step of the start-up ended ([`control::Event::Serving`]).
    pub fn announce_serving(&mut self, startup: Vec<(String, u64)>) -> Result<(), HostError> {
        let Some(notify) = self.notify.as_ref() else {
            return Ok(());
        };
        let beat = outboard_shm::SharedMem::create("outboard-heartbeat", 4096)
            .map_err(|e| HostError::Listen(SessionError::Os(e.to_string())))?;
        beat.seal_size()
            .map_err(|e| HostError::Listen(SessionError::Os(e.to_string())))?;
        let fd = beat.fd().expect("a memfd");
        let mut startup = startup;
        startup.push(("heartbeat".into(), control::monotonic_ns()));
        // The counters page goes second, if the server keeps counts.
        let mut fds = vec![fd];
        fds.extend(self.counters.as_ref().and_then(|c| c.page().fd()));
        control::send(notify.as_fd(), &control::Event::Serving { startup }, &fds)?;
        self.heartbeat = Some(Arc::new(beat));
        Ok(())
    }

    /// For `period` from now, lets one request at a time into each device and names it in
    /// the heartbeat page first: a server started after a crash, so that another crash names
    /// the request that caused it. Needs the heartbeat page (after [`Self::announce_serving`]).
    pub fn isolate(&mut self, period: Duration) {
        let Some(page) = self.heartbeat.clone() else {
            return;
        };
        let until = std::time::Instant::now() + period;
        for d in &mut self.devices {
            d.isolate(page.clone(), until);
        }
    }

    /// Lets `suspect` (named at the last crash) into its device only after another request
    /// went through, while isolated ([`crate::blame`]).
    pub fn hold_back(&mut self, suspect: crate::blame::Suspect) {
        for d in &mut self.devices {
            d.hold_back(suspect);
        }
    }

    /// Fails `suspect` once, alone, instead of sending it to its device.
    pub fn quarantine(&mut self, suspect: crate::blame::Suspect) {
        // A fingerprint is its class's; a device of another class never matches it.
        for d in &mut self.devices {
            d.quarantine(suspect);
        }
    }

    /// One turn of the loop, for the manager's hung-server check.
    #[inline]
    pub(super) fn beat(&self) {
        if let Some(h) = &self.heartbeat {
            if let Ok(word) = h.atomic_u32(0) {
                word.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// For `grace` from now, the sessions of this server's predecessor are still resuming:
    /// each class grants nothing that could conflict with what they claim back (block: no new
    /// lock).
    pub fn resume_grace(&mut self, grace: Duration) {
        for d in &mut self.devices {
            d.class.resume_grace(grace);
        }
    }

    /// Quiesces device `name` (`on`: its sessions' new requests wait in their rings until it
    /// is put back) or puts it back; at start-up for a server restarted while the device was
    /// suspended, later on the manager's command. False if this server does not serve it.
    pub fn quiesce(&mut self, name: &str, on: bool) -> bool {
        let Some(d) = self.devices.iter().position(|x| x.name() == name) else {
            return false;
        };
        // Asked again while quiet: it reports again once drained.
        self.quiesce[d] = on.then_some(Quiesce::Draining);
        true
    }

    /// Requests in device `d`, over all its sessions.
    pub(super) fn in_flight(&self, d: usize) -> usize {
        self.sessions
            .iter()
            .enumerate()
            .filter(|(_, s)| s.as_ref().is_some_and(|s| s.device == d))
            .map(|(i, _)| self.devices[d].outstanding(i))
            .sum()
    }

    /// Tells the manager about each quiescing device that has drained.
    pub(super) fn report_quiesced(&mut self) {
        for d in 0..self.devices.len() {
            if self.quiesce[d] != Some(Quiesce::Draining) || self.in_flight(d) > 0 {
                continue;
            }
            self.quiesce[d] = Some(Quiesce::Quiet);
            let device = self.devices[d].name().to_string();
            tracing::info!("{device}: quiesced");
            if let Some(n) = &self.notify {
                let _ = control::send(n.as_fd(), &control::Event::Quiesced { device }, &[]);
            }
        }
    }

    /// A command from the manager.
    pub(super) fn command(&mut self) {
        let Some(n) = self.notify.as_ref() else {
            return;
        };
        let cmd = match control::recv::<control::Command>(n.as_fd(), Some(Duration::ZERO)) {
            Ok((cmd, _)) => cmd,
            Err(SessionError::Timeout) => return,
            Err(e) => {
                // The manager is gone (it takes its children with it) or sent garbage.
                tracing::warn!("supervisor channel: {e}");
                let _ = self.work.remove(n.as_fd());
                return;
            }
        };
        let (device, quiesce) = match &cmd {
            control::Command::Quiesce { device } => (device, true),
            control::Command::Resume { device } => (device, false),
        };
        tracing::info!("{cmd:?}");
        if !self.quiesce(device, quiesce) {
            tracing::warn!("supervisor asked about {device:?}, which this server does not serve");
        }
        self.report_quiesced();
    }
}
