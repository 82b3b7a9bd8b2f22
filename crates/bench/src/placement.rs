//! Where the two sides of a round trip run.
//!
//! A blocking wake-up costs very different amounts on one core (a context switch) and across
//! two (an inter-processor interrupt to a halted CPU, tens of µs on a virtual machine). Left to
//! itself the scheduler places a fresh ping-pong pair and a long-running driver server
//! differently, so a floor and a session measured unpinned are not comparable; each pair is
//! therefore measured pinned, in the same placement.

use rustix::process::Pid;
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// Where the peer runs relative to the measuring process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Both on one CPU: every wake-up is a context switch.
    OneCore,
    /// On two CPUs: a wake-up of a sleeping peer is an inter-processor interrupt.
    TwoCores,
}

impl Placement {
    /// How a report names it.
    pub fn label(self) -> &'static str {
        match self {
            Placement::OneCore => "one core",
            Placement::TwoCores => "two cores",
        }
    }
}

/// The measuring process pinned to one CPU; its affinity is restored when this is dropped.
pub struct Pinned {
    saved: CpuSet,
    mine: usize,
    other: Option<usize>,
}

impl Pinned {
    /// Pins this process to the first CPU it may use; the peer goes on the same one or the
    /// next. `None` for two cores on a machine that lets this process use only one.
    pub fn new(placement: Placement) -> Result<Option<Self>, String> {
        let saved = sched_getaffinity(None).map_err(|e| format!("sched_getaffinity: {e}"))?;
        let allowed: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| saved.is_set(c)).collect();
        let (mine, other) = match (placement, allowed.as_slice()) {
            (_, []) => return Err("no CPU to run on".into()),
            (Placement::OneCore, [c, ..]) => (*c, Some(*c)),
            (Placement::TwoCores, [a, b, ..]) => (*a, Some(*b)),
            (Placement::TwoCores, [_]) => return Ok(None),
        };
        set(None, mine)?;
        Ok(Some(Self { saved, mine, other }))
    }

    /// The CPU the measuring process runs on.
    pub fn cpu(&self) -> usize {
        self.mine
    }

    /// Pins the peer process `pid` where the placement puts it.
    pub fn peer(&self, pid: u32) -> Result<(), String> {
        let pid = i32::try_from(pid)
            .ok()
            .and_then(Pid::from_raw)
            .ok_or_else(|| format!("bad pid {pid}"))?;
        set(Some(pid), self.other.unwrap_or(self.mine))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = sched_setaffinity(None, &self.saved);
    }
}

fn set(pid: Option<Pid>, cpu: usize) -> Result<(), String> {
    let mut one = CpuSet::new();
    one.set(cpu);
    sched_setaffinity(pid, &one).map_err(|e| format!("sched_setaffinity to CPU {cpu}: {e}"))
}
