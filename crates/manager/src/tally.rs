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
    let pid = n.props.get("pid").and_then(serde_json::Value::as_u64);
    if let Some(pid) = pid.and_then(|p| u32::try_from(p).ok()) {
        use outboard_sys::process::{cpu_seconds, resident_bytes};
        if let (Some(cpu), Some(rss)) = (cpu_seconds(pid), resident_bytes(pid)) {
            n.set("cpu-seconds", cpu);
            n.set("rss-bytes", rss);
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
