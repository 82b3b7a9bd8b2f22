//! CPU busy time of the processes involved, from `/proc/<pid>/stat` (utime + stime, every
//! thread), and of the whole machine from `/proc/stat`, as a fraction of elapsed time.

use std::time::Instant;

use outboard_sys::process::cpu_ticks as process_ticks;

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

/// A CPU measurement in progress.
pub struct CpuMeter {
    pids: Vec<u32>,
    start: Vec<u64>,
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
        Self {
            pids: pids.to_vec(),
            start: pids
                .iter()
                .map(|p| process_ticks(*p).unwrap_or(0))
                .collect(),
            machine: machine_ticks().unwrap_or(0),
            t0: Instant::now(),
        }
    }

    /// Stops and reports.
    pub fn stop(&self) -> CpuBusy {
        let secs = self.t0.elapsed().as_secs_f64().max(1e-9);
        let hz = rustix::param::clock_ticks_per_second() as f64;
        let used: u64 = self
            .pids
            .iter()
            .zip(&self.start)
            .map(|(p, s)| process_ticks(*p).unwrap_or(*s).saturating_sub(*s))
            .sum();
        let machine = machine_ticks()
            .unwrap_or(self.machine)
            .saturating_sub(self.machine);
        CpuBusy {
            processes: used as f64 / hz / secs,
            machine: machine as f64 / hz / secs,
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
