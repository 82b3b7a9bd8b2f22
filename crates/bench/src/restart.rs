//! Evaluation test 8: restarts under load (the network class's part:
//! [`crate::restart_net`]). The verified workload ([`crate::verified`]) runs
//! with several clients while the block driver server — or, separately, its device model — is
//! killed with SIGKILL again and again. Reported per kill interval: the time from each kill to
//! the first completion from the restarted server (median, p99, max), failed requests, data
//! mismatches, duplicate completions, and throughput against a run without kills.
//!
//! "Every N ms" is measured from the moment the previous restart serves again: a kill before
//! the new server has started would measure start-up, not recovery.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::model::{Figure, Machine, Point, Series, Target, TestResult};
use crate::stats::Summary;
use crate::verified::{self, Workload};
use crate::Context;

/// Clients running the workload.
const CLIENTS: u64 = 4;

/// What the killer aims at.
#[derive(Debug, Clone, Copy)]
enum Victim {
    Driver,
    Model,
}

impl Victim {
    fn label(self) -> &'static str {
        match self {
            Victim::Driver => "driver server killed",
            Victim::Model => "device model killed",
        }
    }
}

/// One run: what the clients saw and when the kills were.
struct Outcome {
    iops: f64,
    kills: Vec<Instant>,
    /// Kill → first completion from the new server, per kill.
    recoveries: Vec<f64>,
    failed: usize,
    mismatches: usize,
    duplicates: u64,
    replayed: u64,
    /// Per kill with a recovery: each phase of the restart, in ms, in order.
    phases: Vec<Vec<(String, f64)>>,
}

pub(crate) fn first_of<'a>(
    n: &'a outboard_client::registry::Node,
    kind: &str,
) -> Option<&'a outboard_client::registry::Node> {
    if n.kind == kind {
        return Some(n);
    }
    n.children.iter().find_map(|c| first_of(c, kind))
}

/// The processes behind one device, as the registry shows them.
pub(crate) struct DevicePids {
    /// Its driver server.
    pub server: i32,
    /// Its device model (an emulated device's).
    pub model: Option<i32>,
    /// Whether its driver serves it.
    pub serving: bool,
}

/// The driver server and device model of `device`, and whether it is served.
pub(crate) fn pids_of(control: &Path, device: &str) -> Option<DevicePids> {
    use outboard_client::registry::{Node, State};
    fn pid(n: &Node) -> Option<i32> {
        Some(n.props.get("pid")?.as_i64()? as i32)
    }
    fn driver<'a>(n: &'a Node, device: &str) -> Option<&'a Node> {
        if n.kind == "driver" && n.children.iter().any(|c| c.name == device) {
            return Some(n);
        }
        n.children.iter().find_map(|c| driver(c, device))
    }
    let tree = outboard_client::manager::registry(control).ok()?;
    let server = driver(&tree, device)?;
    Some(DevicePids {
        server: pid(server)?,
        model: tree
            .find("pci-function", &format!("{device}@vfio-user"))
            .and_then(pid),
        serving: server
            .children
            .iter()
            .any(|c| c.name == device && c.state() == Some(State::Serving)),
    })
}

/// The manager's stamps of the last restart of the first driver (`last-restart-stamps`:
/// each step and when it ended, `CLOCK_MONOTONIC` ns).
fn restart_stamps(control: &Path) -> Option<Vec<(String, u64)>> {
    let tree = outboard_client::manager::registry(control).ok()?;
    let v = first_of(&tree, "driver")?
        .props
        .get("last-restart-stamps")?;
    serde_json::from_value(v.clone()).ok()
}

/// A restart split into its phases, in ms: from the kill to the death noticed, the manager's
/// steps, the new server's start-up steps, and from serving to the first completion a client
/// got (its reconnect and replay).
fn phases(kill_ns: u64, stamps: &[(String, u64)], first_completion_ns: u64) -> Vec<(String, f64)> {
    let ms = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e6;
    let mut out = Vec::new();
    let mut prev = kill_ns;
    for (step, at) in stamps {
        // Every driver of a grouped server is one step: its device opened and driver started.
        let name = match step.as_str() {
            "down" => "death noticed",
            "respawn" => "restart delay",
            "taken" => HAND_OVER,
            "exec" => "fork, exec, start-up to main",
            "arguments" => "argument parsing, logging",
            "privileges" => "privileges dropped",
            s if s.starts_with("driver ") => "device open, driver start",
            "listening" => "listening",
            "heartbeat" => "heartbeat page",
            "serving" => "manager told",
            other => other,
        };
        match out.last_mut() {
            Some((last, v)) if last == name => *v += ms(prev, *at),
            _ => out.push((name.to_string(), ms(prev, *at))),
        }
        prev = *at;
    }
    out.push((
        "client reconnect and replay".into(),
        ms(prev, first_completion_ns),
    ));
    out
}

/// Runs the workload for `secs`, killing `victim` every `every` (none: a baseline).
fn run(
    control: &Path,
    w: Workload,
    secs: f64,
    kill: Option<(Victim, Duration)>,
    round: u64,
) -> Result<Outcome, String> {
    let stop = Arc::new(AtomicBool::new(false));
    // Each run's clients own regions no earlier run wrote: they start from zeros.
    let clients = verified::spawn_clients(
        control,
        "disk0",
        round * CLIENTS..(round + 1) * CLIENTS,
        w,
        &stop,
    )?;
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(secs);
    let mut kills = Vec::new();
    // Per kill: its CLOCK_MONOTONIC time and the manager's stamps of the restart it caused.
    let mut stamped = Vec::new();
    while Instant::now() < until {
        let Some((victim, every)) = kill else {
            std::thread::sleep(until - Instant::now());
            break;
        };
        std::thread::sleep(every);
        let before = pids_of(control, "disk0").ok_or("no driver server")?;
        let server = before.server;
        let pid = match victim {
            Victim::Driver => server,
            Victim::Model => before.model.ok_or("no device model")?,
        };
        // Before the signal: a client can notice the death before kill(2) returns here.
        kills.push(Instant::now());
        let kill_ns = outboard_session::control::monotonic_ns();
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).ok_or("bad pid")?,
            rustix::process::Signal::KILL,
        )
        .map_err(|e| format!("kill {pid}: {e}"))?;
        let back = Instant::now() + Duration::from_secs(30);
        loop {
            match pids_of(control, "disk0") {
                Some(p) if p.serving && p.server != server => {
                    stamped.push((kill_ns, restart_stamps(control)));
                    break;
                }
                _ if Instant::now() > back => return Err("the driver did not come back".into()),
                _ => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut o = Outcome {
        iops: 0.0,
        recoveries: Vec::new(),
        failed: 0,
        mismatches: 0,
        duplicates: 0,
        replayed: 0,
        kills: kills.clone(),
        phases: Vec::new(),
    };
    let mut resumes = Vec::new();
    for c in clients {
        let r = c.join().map_err(|_| "a client panicked")??;
        o.iops += r.completed as f64 / elapsed;
        o.failed += r.failed.len();
        o.mismatches += r.mismatches.len();
        o.duplicates += r.duplicates;
        o.replayed += r.replayed;
        resumes.extend(r.resumes);
    }
    for (i, k) in kills.iter().enumerate() {
        let next = kills.get(i + 1).copied();
        let first = resumes
            .iter()
            .filter(|(noticed, _)| noticed >= k && next.is_none_or(|n| *noticed < n))
            .map(|(_, answered)| answered.duration_since(*k).as_secs_f64() * 1e3)
            .min_by(f64::total_cmp);
        if let Some(ms) = first {
            o.recoveries.push(ms);
            // A driver server's restart, stamped by the manager (a model's kill restarts the
            // model first: its stamps are the server's, from later).
            if let Some((kill_ns, Some(stamps))) = stamped.get(i) {
                if stamps.first().is_some_and(|(_, down)| down >= kill_ns) {
                    let done = kill_ns + (ms * 1e6) as u64;
                    o.phases.push(phases(*kill_ns, stamps, done));
                }
            }
        }
    }
    Ok(o)
}

/// The machine: one emulated disk under the default restart policy (a driver that serves
/// between kills is restarted for ever; no limit is raised for the benchmark).
const MACHINE: &str = r#"name = "restart-bench"
[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:64M"
queues = 2
"#;

pub(crate) fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The phase of a restart handed to a standby driver server.
const HAND_OVER: &str = "hand-over to the standby";

/// Restarts that went one way: how many, kill to first completion (the sum of their phases,
/// median and p99, ms), and each phase's median and p99.
fn path_summary(restarts: &[Vec<(String, f64)>]) -> serde_json::Value {
    let totals: Vec<f64> = (restarts.iter())
        .map(|p| p.iter().map(|(_, v)| v).sum())
        .collect();
    serde_json::json!({
        "restarts": restarts.len(),
        "kill_to_first_completion_median_ms": percentile(&totals, 0.5),
        "kill_to_first_completion_p99_ms": percentile(&totals, 0.99),
        "phases": phase_figure(restarts).1,
    })
}

/// Where a driver server's restart goes: the median and p99 of each phase over every kill,
/// as a bar figure and as rows (phase, median, p99, share of the summed medians).
fn phase_figure(all: &[Vec<(String, f64)>]) -> (Figure, Vec<serde_json::Value>) {
    let mut names: Vec<String> = Vec::new();
    for p in all {
        for (n, _) in p {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
    }
    let of = |name: &str| -> Vec<f64> {
        all.iter()
            .filter_map(|p| p.iter().find(|(n, _)| n == name).map(|(_, v)| *v))
            .collect()
    };
    let medians: Vec<f64> = names.iter().map(|n| percentile(&of(n), 0.5)).collect();
    let total: f64 = medians.iter().filter(|m| m.is_finite()).sum();
    let rows = names
        .iter()
        .zip(&medians)
        .map(|(n, m)| {
            serde_json::json!({
                "phase": n,
                "median_ms": m,
                "p99_ms": percentile(&of(n), 0.99),
                "share": if total > 0.0 { m / total } else { 0.0 },
                "restarts": of(n).len(),
            })
        })
        .collect();
    let figure = Figure {
        id: "phases".into(),
        title: "Where a driver server's restart goes (median ms per phase)".into(),
        x_label: String::new(),
        y_label: "ms".into(),
        log_x: false,
        log_y: false,
        kind: "bar".into(),
        references: Vec::new(),
        series: names
            .iter()
            .zip(&medians)
            .map(|(n, &m)| Series {
                label: n.clone(),
                points: vec![Point {
                    x: 0.0,
                    y: Summary {
                        median: m,
                        min: m,
                        max: m,
                        samples: vec![m],
                    },
                }],
            })
            .collect(),
    };
    (figure, rows)
}

/// Runs the test.
pub fn restart_test(ctx: &Context) -> Result<TestResult, String> {
    let intervals: &[u64] = if ctx.quick {
        &[100, 1000]
    } else {
        &[10, 30, 100, 300, 1000]
    };
    let secs = if ctx.quick { 2.0 } else { 6.0 };
    let w = Workload {
        depth: 16,
        blocks: 512,
        flush_every: 64,
    };
    let mut latency = Figure {
        id: "recovery".into(),
        title: "Kill to first completion from the new server (ms)".into(),
        x_label: "kill interval (ms)".into(),
        y_label: "ms".into(),
        log_x: true,
        log_y: false,
        kind: "line".into(),
        references: Vec::new(),
        series: Vec::new(),
    };
    let mut tput = Figure {
        id: "throughput".into(),
        title: "Verified requests per second, with kills and without".into(),
        y_label: "requests/s".into(),
        ..latency.clone()
    };
    let mut table = Vec::new();
    let mut targets = Vec::new();
    let mut all_medians = Vec::new();
    let (mut failed, mut mismatched, mut dups) = (0, 0, 0);
    // Each driver-server restart's phases, over every interval.
    let mut driver_phases: Vec<Vec<(String, f64)>> = Vec::new();
    for victim in [Victim::Driver, Victim::Model] {
        let dir = std::env::temp_dir().join(format!(
            "outboard-bench-restart-{}-{:?}",
            std::process::id(),
            victim
        ));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let up = crate::fixture::machine(&ctx.exe, &dir, MACHINE, &[])?;
        let control = dir.join("control.sock");
        ctx.progress
            .set_message(format!("restart: {}, baseline", victim.label()));
        let base = run(&control, w, secs, None, 0)?;
        ctx.progress.inc(1);
        let mut med = Vec::new();
        let mut p99 = Vec::new();
        let mut max = Vec::new();
        let mut rate = Vec::new();
        for (round, &n) in (1..).zip(intervals) {
            ctx.progress
                .set_message(format!("restart: {}, every {n} ms", victim.label()));
            let o = run(
                &control,
                w,
                secs,
                Some((victim, Duration::from_millis(n))),
                round,
            )?;
            ctx.progress.inc(1);
            let s = |v: f64| Summary {
                median: v,
                min: v,
                max: v,
                samples: vec![v],
            };
            let m = percentile(&o.recoveries, 0.5);
            all_medians.push(m);
            med.push(Point {
                x: n as f64,
                y: s(m),
            });
            p99.push(Point {
                x: n as f64,
                y: s(percentile(&o.recoveries, 0.99)),
            });
            max.push(Point {
                x: n as f64,
                y: s(percentile(&o.recoveries, 1.0)),
            });
            rate.push(Point {
                x: n as f64,
                y: s(o.iops),
            });
            if matches!(victim, Victim::Driver) {
                driver_phases.extend(o.phases.iter().cloned());
            }
            failed += o.failed;
            mismatched += o.mismatches;
            dups += o.duplicates;
            table.push(serde_json::json!({
                "victim": victim.label(),
                "interval_ms": n,
                "kills": o.kills.len(),
                "recovered": o.recoveries.len(),
                "median_ms": m,
                "p99_ms": percentile(&o.recoveries, 0.99),
                "max_ms": percentile(&o.recoveries, 1.0),
                "failed": o.failed,
                "mismatches": o.mismatches,
                "duplicates": o.duplicates,
                "replayed": o.replayed,
                "requests_per_s": o.iops,
                "baseline_per_s": base.iops,
                "throughput_lost": 1.0 - o.iops / base.iops,
            }));
        }
        drop(up);
        crate::fixture::remove_work_dir(&dir);
        let who = victim.label();
        latency.series.push(Series {
            label: format!("{who}, median"),
            points: med,
        });
        latency.series.push(Series {
            label: format!("{who}, p99"),
            points: p99,
        });
        latency.series.push(Series {
            label: format!("{who}, max"),
            points: max,
        });
        tput.series.push(Series {
            label: who.into(),
            points: rate,
        });
        tput.series.push(Series {
            label: format!("{who}: baseline, no kills"),
            points: intervals
                .iter()
                .map(|&n| Point {
                    x: n as f64,
                    y: Summary {
                        median: base.iops,
                        min: base.iops,
                        max: base.iops,
                        samples: vec![base.iops],
                    },
                })
                .collect(),
        });
    }
    // The network class under the same kills; if its machine cannot run, the disk's
    // results stand and the reason is listed.
    let mut unavailable = Vec::new();
    let net = match crate::restart_net::net_restart(ctx) {
        Ok(net) => net,
        Err(reason) => {
            unavailable.push(crate::model::Unavailable {
                config: "net".into(),
                reason,
            });
            crate::restart_net::NetRestart {
                figures: Vec::new(),
                rows: Vec::new(),
                targets: Vec::new(),
            }
        }
    };
    targets.extend(net.targets);
    let (by_phase, phase_rows) = phase_figure(&driver_phases);
    // The two ways back, apart: handed to a standby, or started afresh (no standby was ready).
    let (handed, fresh): (Vec<_>, Vec<_>) =
        (driver_phases.iter().cloned()).partition(|p| p.iter().any(|(n, _)| n == HAND_OVER));
    let by_path = serde_json::json!({
        "standby": path_summary(&handed),
        "fresh": path_summary(&fresh),
    });
    let worst = all_medians.iter().copied().fold(0.0, f64::max);
    targets.push(Target {
        target: "restart: kill-to-first-completion median ≤ 50 ms (worst interval)".into(),
        measured: format!("{worst:.1} ms"),
        met: Some(worst <= 50.0),
    });
    targets.push(Target {
        target: "restart: zero failed requests, zero mismatches, zero duplicates".into(),
        measured: format!("{failed} failed, {mismatched} mismatches, {dups} duplicates"),
        met: Some(failed == 0 && mismatched == 0 && dups == 0),
    });
    Ok(TestResult {
        test: "restart".into(),
        title: "Restart under load".into(),
        reference: "EVALUATION.md test 8".into(),
        runs: 1,
        discarded: 0,
        params: serde_json::json!({
            "clients": CLIENTS,
            "queue_depth": w.depth,
            "blocks_per_client": w.blocks,
            "block_bytes": verified::BLOCK,
            "seconds_per_interval": secs,
            "rows": table,
            "driver_restart_phases": phase_rows,
            "driver_restarts_by_path": by_path,
            "net_rows": net.rows,
        }),
        figures: [vec![latency, tput, by_phase], net.figures].concat(),
        unavailable,
        targets,
        machine: Machine::here(),
    })
}

/// Progress steps.
pub fn steps(ctx: &Context) -> u64 {
    2 * (1 + if ctx.quick { 2 } else { 5 }) + crate::restart_net::steps(ctx)
}
