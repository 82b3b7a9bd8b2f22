//! CPU busy time of the processes involved, from each one's CPU clock (every thread, to the
//! nanosecond), and of the whole machine from its CPUs' idle time, as a fraction of elapsed
//! time.
//!
//! Both are read finer than the kernel's 10 ms ticks on purpose: a quick run lasts 50 ms, and a
//! tick-counted figure of it moves by 20% from one run to the next with nothing changed, too
//! coarse to tell a 5% change between two builds.

use std::time::Instant;

use outboard_sys::process::cpu_nanos as process_nanos;
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// CPU seconds of this process's children that ended and were waited for (`cutime` and
/// `cstime`): what a short-lived helper (a `sockperf` client) used, read after it ended.
pub fn reaped_children_secs() -> f64 {
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let f: Vec<u64> = s
                .rsplit(')')
                .next()?
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            // After the state (not a number): ppid … cutime is field 16, cstime 17 of stat.
            Some(f.get(12)? + f.get(13)?)
        })
        .unwrap_or(0);
    ticks as f64 / rustix::param::clock_ticks_per_second() as f64
}

/// CPU seconds process `pid` has used (all its threads).
pub use outboard_sys::process::cpu_seconds as process_secs;

/// Busy ticks of the whole machine from `/proc/stat`: the fallback where idle time cannot be
/// read per CPU.
fn machine_ticks() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = s.lines().next()?;
    // user nice system idle iowait irq softirq steal
    let v: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    Some(v.first()? + v.get(1)? + v.get(2)? + v.get(5)? + v.get(6)? + v.get(7).unwrap_or(&0))
}

/// The machine's CPUs at one moment: when each was read and how long it had been idle.
#[derive(Debug, Clone)]
struct IdleReading(Vec<(Instant, u64)>);

impl IdleReading {
    /// Reads each CPU's idle time (the microseconds `cpuidle` accounts to its idle states)
    /// from that CPU itself: a CPU's current idle stretch is added only when it ends, so this
    /// thread moves onto each CPU in turn, which ends it. `None` where that cannot be done: no
    /// `cpuidle`, or this thread may not run on every CPU. The thread's own affinity is put
    /// back.
    fn now() -> Option<Self> {
        let cpus = online_cpus()?;
        let saved = sched_getaffinity(None).ok()?;
        if cpus.iter().any(|&c| !saved.is_set(c)) {
            return None;
        }
        let mut out = Vec::with_capacity(cpus.len());
        for &cpu in &cpus {
            let mut one = CpuSet::new();
            one.set(cpu);
            if sched_setaffinity(None, &one).is_err() {
                break;
            }
            match idle_micros(cpu) {
                Some(idle) => out.push((Instant::now(), idle)),
                None => break,
            }
        }
        let _ = sched_setaffinity(None, &saved);
        (out.len() == cpus.len()).then_some(Self(out))
    }

    /// CPU-seconds busy between `self` and `later`, summed over CPUs: each CPU's time between
    /// its two readings less the idle time it gained.
    fn busy_since(&self, later: &IdleReading) -> f64 {
        self.0
            .iter()
            .zip(&later.0)
            .map(|((t0, i0), (t1, i1))| {
                let span = t1.saturating_duration_since(*t0).as_secs_f64();
                (span - i1.saturating_sub(*i0) as f64 / 1e6).max(0.0)
            })
            .sum()
    }
}

/// The CPUs `/proc/stat` lists (`cpu0`, `cpu1`, …).
fn online_cpus() -> Option<Vec<usize>> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let cpus: Vec<usize> = s
        .lines()
        .filter_map(|l| {
            l.split_whitespace()
                .next()?
                .strip_prefix("cpu")?
                .parse()
                .ok()
        })
        .collect();
    (!cpus.is_empty()).then_some(cpus)
}

/// Microseconds CPU `cpu` has spent in its idle states.
fn idle_micros(cpu: usize) -> Option<u64> {
    let dir = std::fs::read_dir(format!("/sys/devices/system/cpu/cpu{cpu}/cpuidle")).ok()?;
    let mut total = 0u64;
    let mut states = 0;
    for state in dir.flatten() {
        if !state.file_name().to_string_lossy().starts_with("state") {
            continue;
        }
        let time = std::fs::read_to_string(state.path().join("time")).ok()?;
        total += time.trim().parse::<u64>().ok()?;
        states += 1;
    }
    (states > 0).then_some(total)
}

/// A CPU measurement in progress.
pub struct CpuMeter {
    pids: Vec<u32>,
    start: Vec<u64>,
    idle: Option<IdleReading>,
    machine: u64,
    t0: Instant,
}

/// CPU busy fractions over a measurement (1.0 = one core fully busy).
#[derive(Debug, Clone, Copy)]
pub struct CpuBusy {
    /// Sum over the processes involved.
    pub processes: f64,
    /// The whole machine (includes kernel threads).
    pub machine: f64,
}

impl CpuMeter {
    /// Starts measuring `pids`.
    pub fn start(pids: &[u32]) -> Self {
        let idle = IdleReading::now();
        Self {
            pids: pids.to_vec(),
            start: pids
                .iter()
                .map(|p| process_nanos(*p).unwrap_or(0))
                .collect(),
            machine: machine_ticks().unwrap_or(0),
            idle,
            t0: Instant::now(),
        }
    }

    /// Stops and reports.
    pub fn stop(&self) -> CpuBusy {
        let secs = self.t0.elapsed().as_secs_f64().max(1e-9);
        let used: u64 = self
            .pids
            .iter()
            .zip(&self.start)
            .map(|(p, s)| process_nanos(*p).unwrap_or(*s).saturating_sub(*s))
            .sum();
        let machine = match (&self.idle, IdleReading::now()) {
            (Some(before), Some(after)) => before.busy_since(&after),
            _ => {
                let hz = rustix::param::clock_ticks_per_second() as f64;
                machine_ticks()
                    .unwrap_or(self.machine)
                    .saturating_sub(self.machine) as f64
                    / hz
            }
        };
        CpuBusy {
            processes: used as f64 / 1e9 / secs,
            machine: machine / secs,
        }
    }
}

/// Every process below `root` (its children, theirs, …), read from `/proc`.
pub fn descendants(root: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The command name may hold spaces and parentheses: fields start after the last ')'.
            let rest = &stat[stat.rfind(')')? + 2..];
            let ppid = rest.split(' ').nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        found.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    found.remove(0);
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spinning_thread_is_seen_by_both_meters() {
        // This process spins one thread for 200 ms: both its own figure and the machine's
        // must see about a core busy (more if the machine is busy with other work too).
        let meter = CpuMeter::start(&[std::process::id()]);
        let t0 = Instant::now();
        let mut x = 0u64;
        while t0.elapsed() < std::time::Duration::from_millis(200) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let busy = meter.stop();
        assert!(busy.processes > 0.5 && busy.processes < 1.5, "{busy:?}");
        assert!(busy.machine > 0.5, "{busy:?}");
    }

    #[test]
    fn idle_readings_come_from_every_cpu_or_none() {
        if let Some(r) = IdleReading::now() {
            assert_eq!(r.0.len(), online_cpus().unwrap().len());
            let later = IdleReading::now().unwrap();
            assert!(r.busy_since(&later) >= 0.0);
        }
    }

    #[test]
    fn finds_a_grandchild_and_not_itself() {
        // sh → sleep: both below this process.
        let mut c = std::process::Command::new("sh")
            .args(["-c", "sleep 5 & wait"])
            .spawn()
            .unwrap();
        let found = outboard_sys::wait::eventually(std::time::Duration::from_secs(5), || {
            descendants(std::process::id()).len() >= 2
        });
        let d = descendants(std::process::id());
        let _ = c.kill();
        let _ = c.wait();
        assert!(found, "{d:?}");
        assert!(d.contains(&c.id()));
        assert!(!d.contains(&std::process::id()));
    }
}
