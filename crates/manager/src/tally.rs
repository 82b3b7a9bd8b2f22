//! What the machine has done, as `outboard ls --json`, `outboard top` and the metrics
//! endpoint see it: each class device's counts (read on demand from its driver server's
//! counters page, plus what ended incarnations carried over) and each process's CPU time and
//! memory (from `/proc`).

use std::collections::BTreeMap;

use outboard_server::counters::{DeviceCounters, Record};

use super::*;

/// The latency percentiles shown, and their property names.
const PERCENTILES: [(f64, &str); 3] = [(0.5, "p50"), (0.99, "p99"), (0.999, "p999")];

impl Manager {
    /// What driver server `i`'s counters page says now, of the devices the manager gave it
    /// (a page is the server's: a device it names that is not its own is not read).
    fn page_of(&self, i: usize) -> Vec<DeviceCounters> {
        let p = &self.procs[i];
        let Some(page) = &p.counters else {
            return Vec::new();
        };
        let own = Self::devices_of(&p.kind);
        match page.read() {
            Ok(devices) => devices
                .into_iter()
                .filter(|d| own.contains(&d.name))
                .collect(),
            Err(e) => {
                tracing::warn!("{}: its counters: {e}", p.role);
                Vec::new()
            }
        }
    }

    /// Driver server `i` ended (or is being replaced): what its counters page says now is
    /// final, and is carried into its devices' totals. What it had taken and not answered
    /// is not carried as in flight: its clients send it again to the next server.
    pub(crate) fn retire_counters(&mut self, i: usize) {
        for mut d in self.page_of(i) {
            d.total.taken = d.total.answered;
            d.sessions.clear();
            let carried = self
                .carried
                .entry(d.name.clone())
                .or_insert_with(|| (Record::default(), d.clone()));
            carried.0.add(&d.total);
            carried.1 = d;
        }
        self.procs[i].counters = None;
    }

    /// Every class device's counters now: what ended incarnations carried plus its live
    /// server's, with its live sessions. A device whose server is restarting, given up or
    /// gone keeps showing what it did.
    pub(crate) fn counts(&self) -> BTreeMap<String, (Record, Vec<Record>, DeviceCounters)> {
        let mut out: BTreeMap<String, (Record, Vec<Record>, DeviceCounters)> = self
            .carried
            .iter()
            .map(|(name, (r, d))| (name.clone(), (r.clone(), Vec::new(), d.clone())))
            .collect();
        for i in 0..self.procs.len() {
            for d in self.page_of(i) {
                let e = out
                    .entry(d.name.clone())
                    .or_insert_with(|| (Record::default(), Vec::new(), d.clone()));
                e.0.add(&d.total);
                e.1.extend(d.sessions.iter().cloned());
            }
        }
        out
    }

    /// The registry with what the machine did: counts on each class device (sessions as its
    /// children), CPU time and memory on each node that names a live process.
    pub(crate) fn registry_with_counts(&self) -> Node {
        let mut tree = self.registry.clone();
        let counts = self.counts();
        annotate(&mut tree, &counts);
        tree
    }
}

fn annotate(n: &mut Node, counts: &BTreeMap<String, (Record, Vec<Record>, DeviceCounters)>) {
    if n.kind.ends_with("-device") {
        if let Some((total, sessions, device)) = counts.get(&n.name) {
            set_record(n, total, device);
            n.children.retain(|c| c.kind != "session");
            for s in sessions {
                let mut c = Node::new("session", &s.id.to_string());
                if s.pid != 0 {
                    c.set("client-pid", s.pid);
                }
                set_record(&mut c, s, device);
                n.children.push(c);
            }
        }
    }
    if let Some(pid) = n.props.get("pid").and_then(serde_json::Value::as_u64) {
        if let Some(u) = usage(pid) {
            n.set("cpu-seconds", u.cpu_seconds);
            n.set("rss-bytes", u.rss_bytes);
        }
    }
    for c in &mut n.children {
        annotate(c, counts);
    }
}

/// A record's numbers as properties (numbers, for programs; the text view prints them).
fn set_record(n: &mut Node, r: &Record, device: &DeviceCounters) {
    n.set("requests", r.answered);
    n.set("in-flight", r.in_flight());
    n.set("bytes", r.bytes);
    n.set("errors", r.errors);
    n.set("resumes", r.resumes);
    n.set("replays", r.replays);
    for (k, count) in r.kinds.iter().enumerate() {
        if *count > 0 {
            n.set(&format!("errors.{}", device.kind_name(k)), *count);
        }
    }
    if let Some(mean) = r.sum_ns.checked_div(r.samples) {
        for (q, name) in PERCENTILES {
            if let Some(ns) = r.percentile(q) {
                n.set(&format!("latency-ns.{name}"), ns);
            }
        }
        n.set("latency-ns.mean", mean);
        n.set("latency-ns.sum", r.sum_ns);
        n.set("latency-ns.max", r.max_ns);
        n.set("latency-ns.samples", r.samples);
    }
}

/// A process's CPU time and resident memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    /// User and system time, seconds.
    pub cpu_seconds: f64,
    /// Resident set, bytes.
    pub rss_bytes: u64,
}

/// Process `pid`'s usage, from `/proc` (`None` if it is gone).
pub fn usage(pid: u64) -> Option<Usage> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    parse_usage(
        &stat,
        &statm,
        rustix::param::clock_ticks_per_second(),
        rustix::param::page_size() as u64,
    )
}

/// Reads `/proc/PID/stat` (utime and stime, fields 14 and 15, after the command name, which
/// may hold spaces and parentheses: the fields start after the last `)`) and
/// `/proc/PID/statm` (resident pages, the second field).
fn parse_usage(stat: &str, statm: &str, ticks: u64, page: u64) -> Option<Usage> {
    let after = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state): utime is field 14, stime 15.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    let resident: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(Usage {
        cpu_seconds: (utime + stime) as f64 / ticks.max(1) as f64,
        rss_bytes: resident * page,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_reads_past_a_command_name_with_spaces_and_parentheses() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 5 1000 77";
        let u = parse_usage(stat, "1000 77 10 1 0 20 0", 100, 4096).unwrap();
        assert_eq!(u.cpu_seconds, 3.0);
        assert_eq!(u.rss_bytes, 77 * 4096);
        assert!(parse_usage("42 (x", "1 2", 100, 4096).is_none());
        assert!(parse_usage("42 (x) S 1", "1 2", 100, 4096).is_none());
    }

    #[test]
    fn this_process_has_usage() {
        let u = usage(u64::from(std::process::id())).unwrap();
        assert!(u.rss_bytes > 0);
    }
}
