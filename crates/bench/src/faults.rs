//! `outboard bench faults`: a long fault campaign. Verified clients ([`crate::verified`]: reads
//! and writes checked against what was acknowledged, at queue depth 16) run against one disk
//! under the default restart policy while faults of every kind are injected at random
//! instants, one after another, each once the machine has recovered from the last:
//!
//! - signals to the driver server and to the device model: SIGKILL, a segmentation fault
//!   (two SIGSEGVs), SIGSTOP (a hang the heartbeat or the request deadline must notice);
//! - device faults through the model's fault socket: a stall past the request deadline,
//!   corrupt completions (a used id not in flight, a short length), an I/O error;
//! - requests that crash their driver or their model every time: a read of a sector the
//!   machine description marks (`driver_abort_on`, the model's `abort-on` fault), sent by the
//!   campaign's own session, which must fail alone as quarantined while the clients go on.
//!
//! Reported: faults by kind, requests verified, requests failed and whether each failure is
//! one the policy allows (an I/O error the device reported, a quarantined request), reads that saw data other than acknowledged (a lost
//! write), duplicated completions, and per kind the time from the fault to a new driver server
//! serving.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_block::{BlockDevice, BlockError, BlockOp, BlockRequest};
use rustix::process::Signal;

use crate::model::{Figure, Machine, Point, Series, Target, TestResult};
use crate::restart::{percentile, pids_of};
use crate::stats::Summary;
use crate::verified::{self, Workload};
use crate::Context;

/// Verified clients.
const CLIENTS: u64 = 4;
/// The request deadline: a stall longer than this fails what is in the device.
const DEADLINE: Duration = Duration::from_millis(250);
/// The stall injected: past the deadline.
const STALL: Duration = Duration::from_millis(400);
/// Longest wait for the machine to serve again after a fault.
const RECOVERY: Duration = Duration::from_secs(30);
/// The verified clients use blocks from 0 up to `CLIENTS * 512`; the poisoned sectors lie
/// beyond them, so only the campaign's own requests touch them.
const DRIVER_POISON_BLOCK: u64 = 16_000;
const MODEL_POISON_BLOCK: u64 = 16_100;

/// The machine: `disks` disks (`disk0`, `disk1`, …) under the default restart policy, each
/// with fault injection, a short deadline and heartbeat (a hang is noticed in well under a
/// second), and two poisoned sectors.
fn machine(disks: u64) -> String {
    let mut m = String::from("name = \"fault-campaign\"\n");
    for d in 0..disks {
        m.push_str(&format!(
            r#"
[[device]]
name = "disk{d}"
model = "virtio-blk"
backing = "mem:64M"
queues = 2
request_deadline = "{}ms"
heartbeat = "250ms"
fault_injection = true
faults = ["abort-on={}"]
driver_abort_on = {}
"#,
            DEADLINE.as_millis(),
            MODEL_POISON_BLOCK * 8,
            DRIVER_POISON_BLOCK * 8
        ));
    }
    m
}

/// The kinds by name, in [`Kind::ALL`]'s order (`--fault-kinds`).
pub const FAULT_KINDS: &[&str] = &[
    "kill-server",
    "segv-server",
    "stop-server",
    "kill-model",
    "segv-model",
    "stop-model",
    "stall",
    "corrupt-id",
    "corrupt-len",
    "io-error",
    "poison-driver",
    "poison-model",
];

/// The kinds the campaign injects: `--fault-kinds`, else every kind.
fn kinds(ctx: &Context) -> Result<Vec<Kind>, String> {
    let Some(names) = &ctx.fault_kinds else {
        return Ok(Kind::ALL.to_vec());
    };
    names
        .iter()
        .map(|n| {
            Kind::ALL
                .into_iter()
                .find(|k| k.name() == n)
                .ok_or_else(|| {
                    format!(
                        "no fault kind {n:?}; the kinds are {}",
                        FAULT_KINDS.join(", ")
                    )
                })
        })
        .collect()
}

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    KillServer,
    SegvServer,
    StopServer,
    KillModel,
    SegvModel,
    StopModel,
    Stall,
    CorruptId,
    CorruptLen,
    DeviceError,
    PoisonDriver,
    PoisonModel,
}

impl Kind {
    const ALL: [Kind; 12] = [
        Kind::KillServer,
        Kind::SegvServer,
        Kind::StopServer,
        Kind::KillModel,
        Kind::SegvModel,
        Kind::StopModel,
        Kind::Stall,
        Kind::CorruptId,
        Kind::CorruptLen,
        Kind::DeviceError,
        Kind::PoisonDriver,
        Kind::PoisonModel,
    ];

    /// The kind's name on the command line (`--fault-kinds`).
    fn name(self) -> &'static str {
        FAULT_KINDS[Kind::ALL.iter().position(|&k| k == self).expect("listed")]
    }

    fn label(self) -> &'static str {
        match self {
            Kind::KillServer => "SIGKILL driver server",
            Kind::SegvServer => "SIGSEGV driver server",
            Kind::StopServer => "SIGSTOP driver server",
            Kind::KillModel => "SIGKILL device model",
            Kind::SegvModel => "SIGSEGV device model",
            Kind::StopModel => "SIGSTOP device model",
            Kind::Stall => "device stall past the deadline",
            Kind::CorruptId => "corrupt completion (id)",
            Kind::CorruptLen => "corrupt completion (length)",
            Kind::DeviceError => "device I/O error",
            Kind::PoisonDriver => "request that crashes the driver",
            Kind::PoisonModel => "request that crashes the model",
        }
    }

    /// The errors a verified client may see because of this fault: what the device itself
    /// answered (an I/O error, a completion it cut short). Anything else is a failure the
    /// policy does not allow: a device stalled past its deadline, or a model stopped, is
    /// restarted and what it held is sent again.
    fn allows(self) -> &'static [&'static str] {
        match self {
            Kind::DeviceError | Kind::CorruptLen => &["io"],
            // A model stalled past the deadline is restarted and its requests sent again.
            _ => &[],
        }
    }

    /// Whether a new driver server must serve after the fault: not for faults the driver
    /// answers in place.
    fn replaces_server(self) -> bool {
        !matches!(self, Kind::CorruptLen | Kind::DeviceError)
    }

    /// The signals to send, and to which process (the driver server, else the model). A
    /// segmentation fault is two SIGSEGVs: Rust's runtime catches the first to tell a stack
    /// overflow from other faults and returns from it, and a real faulting access then faults
    /// again, which kills; one sent from outside faults nothing, so the second is sent too.
    fn signal(self) -> Option<(bool, &'static [Signal])> {
        const SEGFAULT: &[Signal] = &[Signal::SEGV, Signal::SEGV];
        match self {
            Kind::KillServer => Some((true, &[Signal::KILL])),
            Kind::SegvServer => Some((true, SEGFAULT)),
            Kind::StopServer => Some((true, &[Signal::STOP])),
            Kind::KillModel => Some((false, &[Signal::KILL])),
            Kind::SegvModel => Some((false, SEGFAULT)),
            Kind::StopModel => Some((false, &[Signal::STOP])),
            _ => None,
        }
    }

    /// A fault for the model's fault socket.
    fn device_fault(self) -> Option<String> {
        match self {
            Kind::Stall => Some(format!("stall={}ms", STALL.as_millis())),
            Kind::CorruptId => Some("corrupt-used=id".into()),
            Kind::CorruptLen => Some("corrupt-used=len".into()),
            Kind::DeviceError => Some("error-next=1".into()),
            _ => None,
        }
    }

    /// The poisoned block a request of the campaign's own reads.
    fn poison(self) -> Option<u64> {
        match self {
            Kind::PoisonDriver => Some(DRIVER_POISON_BLOCK),
            Kind::PoisonModel => Some(MODEL_POISON_BLOCK),
            _ => None,
        }
    }
}

/// One fault as it happened.
struct Injected {
    kind: Kind,
    at: Instant,
    /// When a new driver server served (for faults that replace it), in ms after `at`.
    recovered_ms: Option<f64>,
    /// A poisoned request: whether it failed alone as quarantined.
    quarantined: Option<bool>,
}

/// Arms `fault` in `disk`'s model, as an operator would (`outboard fault`).
fn arm(exe: &Path, control: &Path, disk: &str, fault: &str) -> Result<(), String> {
    let out = std::process::Command::new(exe)
        .arg("--control")
        .arg(control)
        .args(["fault", disk, fault])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "outboard fault {disk} {fault}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Reads `block` (of 4 KiB) through the campaign's own session and says whether it failed
/// as quarantined.
fn poisoned_read(control: &Path, disk: &str, block: u64) -> Result<bool, String> {
    let mut dev = verified::open(control, disk, 1)?;
    let sectors = verified::BLOCK / dev.info().block_size as u64;
    let req = BlockRequest {
        op: BlockOp::Read,
        lba: block * sectors,
        blocks: sectors as u32,
        buf_offset: 0,
        tag: 0,
    };
    dev.submit(&req).map_err(|e| format!("submit: {e}"))?;
    dev.kick().map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    dev.wait(&mut out, RECOVERY)
        .map_err(|e| format!("poisoned read: {e}"))?;
    Ok(matches!(
        out.first().map(|c| &c.result),
        Some(Err(BlockError::Quarantined))
    ))
}

/// `disk`'s processes once it is served (waiting up to [`RECOVERY`]).
fn serving(control: &Path, disk: &str) -> Result<crate::restart::DevicePids, String> {
    let until = Instant::now() + RECOVERY;
    loop {
        match pids_of(control, disk) {
            Some(p) if p.serving => return Ok(p),
            _ if Instant::now() > until => {
                return Err(format!("{disk}: not served within {RECOVERY:?}"))
            }
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Injects one fault of `kind` into `disk` and waits until it is served again.
fn inject(exe: &Path, control: &Path, up: u32, disk: &str, kind: Kind) -> Result<Injected, String> {
    // A crash series may still run (a poisoned request crashes three servers in a row):
    // the fault goes to a server that serves.
    let before = serving(control, disk)?;
    let at = Instant::now();
    let mut quarantined = None;
    if let Some((server, sigs)) = kind.signal() {
        let pid = if server {
            before.server
        } else {
            before
                .model
                .ok_or_else(|| format!("{disk}: no device model"))?
        };
        crate::fixture::signal_child_of(up, pid, sigs)?;
    } else if let Some(f) = kind.device_fault() {
        arm(exe, control, disk, &f)?;
    } else if let Some(block) = kind.poison() {
        quarantined = Some(poisoned_read(control, disk, block)?);
    }
    let mut recovered_ms = None;
    if kind.replaces_server() {
        loop {
            match pids_of(control, disk) {
                Some(p) if p.serving && p.server != before.server => {
                    recovered_ms = Some(at.elapsed().as_secs_f64() * 1e3);
                    break;
                }
                _ if Instant::now() > at + RECOVERY => {
                    return Err(format!(
                        "{disk}: {}: no new driver server served within {RECOVERY:?}",
                        kind.label()
                    ))
                }
                _ => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }
    Ok(Injected {
        kind,
        at,
        recovered_ms,
        quarantined,
    })
}

fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// What the campaign counted.
#[derive(Default)]
struct Tally {
    verified: u64,
    /// Failed requests by (fault kind they followed, error kind, allowed).
    failed: BTreeMap<(Option<Kind>, &'static str, bool), u64>,
    mismatches: u64,
    /// The first few mismatches, for people.
    examples: Vec<String>,
    duplicates: u64,
    replayed: u64,
    /// The first few failures the policy does not allow, with when they were sent and
    /// answered against the faults around them, for people.
    unexplained: Vec<String>,
}

impl Tally {
    /// Adds another disk's counts.
    fn merge(&mut self, o: Tally) {
        self.verified += o.verified;
        for (k, c) in o.failed {
            *self.failed.entry(k).or_default() += c;
        }
        self.mismatches += o.mismatches;
        let room = 10usize.saturating_sub(self.examples.len());
        self.examples.extend(o.examples.into_iter().take(room));
        self.duplicates += o.duplicates;
        self.replayed += o.replayed;
        let room = 10usize.saturating_sub(self.unexplained.len());
        self.unexplained
            .extend(o.unexplained.into_iter().take(room));
    }
}

/// One disk's campaign: `faults` faults into `disk` under the verified load of clients `ids`
/// (regions of their own), each failure weighed against this disk's faults.
fn campaign(
    ctx: &Context,
    control: &Path,
    up: u32,
    disk: &str,
    ids: std::ops::Range<u64>,
    faults: u64,
) -> Result<(Vec<Injected>, Tally), String> {
    let w = Workload {
        depth: 16,
        blocks: 512,
        flush_every: 64,
    };
    let mut order = kinds(ctx)?;
    let stop = Arc::new(AtomicBool::new(false));
    let clients = verified::spawn_clients(control, disk, ids.clone(), w, &stop)?;
    // Each kind in turn, in an order shuffled per round, at a random instant.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(std::process::id()) ^ (ids.start << 32);

    let mut done = Vec::new();
    let mut result = Ok(());
    for i in 0..faults {
        let slot = (i % order.len() as u64) as usize;
        if slot == 0 {
            for j in (1..order.len()).rev() {
                rng = xorshift(rng);
                order.swap(j, (rng % (j as u64 + 1)) as usize);
            }
        }
        rng = xorshift(rng);
        std::thread::sleep(Duration::from_millis(10 + rng % 50));
        ctx.progress
            .set_message(format!("faults: {disk}: {}", order[slot].label()));
        match inject(&ctx.exe, control, up, disk, order[slot]) {
            Ok(f) => done.push(f),
            Err(e) => {
                // Said at once: the other disks' campaigns may run on for a long time.
                let e = format!("{disk}: fault {} ({}): {e}", i + 1, order[slot].label());
                ctx.progress.suspend(|| eprintln!("faults: {e}"));
                result = Err(e);
                break;
            }
        }
        ctx.progress.inc(1);
    }
    stop.store(true, Ordering::Relaxed);
    let mut t = Tally::default();
    let injected: Vec<(Instant, Kind)> = done.iter().map(|d| (d.at, d.kind)).collect();
    for c in clients {
        let r = c.join().map_err(|_| "a client panicked")??;
        t.verified += r.completed - r.failed.len() as u64;
        t.mismatches += r.mismatches.len() as u64;
        t.examples.extend(
            r.mismatches
                .iter()
                .take(10 - t.examples.len().min(10))
                .map(|m| format!("{disk}: {}", timeline(&injected, m))),
        );
        t.duplicates += r.duplicates;
        t.replayed += r.replayed;
        for f in r.failed {
            let (after, allowed) = blame(&injected, f.sent, f.at, f.kind);
            *t.failed.entry((after, f.kind, allowed)).or_default() += 1;
            if !allowed && t.unexplained.len() < 10 {
                t.unexplained
                    .push(format!("{disk}: {}", timeline(&injected, &f)));
            }
        }
    }
    result.map(|()| (done, t))
}

/// The disks to inject into at once: `--fault-disks`, else one, or four for a campaign of
/// more than 1,000 faults (one disk at a time would take hours).
fn disks(ctx: &Context) -> u64 {
    ctx.fault_disks
        .unwrap_or(if count(ctx) > 1000 { 4 } else { 1 })
        .clamp(1, count(ctx))
}

/// Every disk's campaign at once, each in its own thread with its share of the faults and of
/// the clients (at least one each); the faults injected, in time order, and the counts.
fn campaigns(
    ctx: &Context,
    control: &Path,
    up: u32,
    faults: u64,
    disks: u64,
) -> Result<(Vec<Injected>, Tally), String> {
    let per_disk = CLIENTS.div_ceil(disks).max(1);
    let outcomes: Vec<Result<(Vec<Injected>, Tally), String>> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..disks)
            .map(|d| {
                let share = faults / disks + u64::from(d < faults % disks);
                let ids = d * per_disk..(d + 1) * per_disk;
                s.spawn(move || campaign(ctx, control, up, &format!("disk{d}"), ids, share))
            })
            .collect();
        runs.into_iter()
            .map(|r| {
                r.join()
                    .unwrap_or_else(|_| Err("a campaign panicked".into()))
            })
            .collect()
    });
    let (mut done, mut tally) = (Vec::new(), Tally::default());
    for o in outcomes {
        let (d, t) = o?;
        done.extend(d);
        tally.merge(t);
    }
    done.sort_by_key(|d| d.at);
    Ok((done, tally))
}

/// Which fault a request that failed with `kind` answers to, and whether the policy allows
/// the failure. `injected`: the faults in the order they were injected. A request lives
/// through the fault in force when it was sent (the last one injected before, e.g. a model
/// still stopped) and every fault injected before its answer came; the failure is allowed if
/// any of them allows it (an armed error can fire after the next fault was injected),
/// and is then counted against that fault; otherwise against the last one before its answer.
fn blame(
    injected: &[(Instant, Kind)],
    sent: Instant,
    at: Instant,
    kind: &str,
) -> (Option<Kind>, bool) {
    let last_before = |t: Instant| injected.iter().rposition(|(when, _)| *when <= t);
    let Some(last) = last_before(at) else {
        return (None, false);
    };
    let first = last_before(sent).unwrap_or(0);
    match injected[first..=last]
        .iter()
        .rev()
        .find(|(_, k)| k.allows().contains(&kind))
    {
        Some((_, k)) => (Some(*k), true),
        None => (Some(injected[last].1), false),
    }
}

/// A failure the policy does not allow, told against the faults injected around it.
fn timeline(injected: &[(Instant, Kind)], f: &verified::Failed) -> String {
    // The last two faults before `t`, nearest first.
    let near = |t: Instant| match injected.iter().rposition(|(when, _)| *when <= t) {
        Some(i) => injected[i.saturating_sub(1)..=i]
            .iter()
            .rev()
            .map(|(when, kind)| {
                format!(
                    "{:.1} ms after {}",
                    (t - *when).as_secs_f64() * 1e3,
                    kind.label()
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        None => "before any fault".into(),
    };
    format!("{}: sent {}, answered {}", f.what, near(f.sent), near(f.at))
}

/// How many faults: `--faults N`, else 24 quick and 240 otherwise.
fn count(ctx: &Context) -> u64 {
    ctx.faults
        .unwrap_or(if ctx.quick { 24 } else { 240 })
        .max(1)
}

/// Runs the test.
pub fn faults_test(ctx: &Context) -> Result<TestResult, String> {
    let n = count(ctx);
    let disks = disks(ctx);
    let dir = std::env::temp_dir().join(format!("outboard-bench-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let up = crate::fixture::machine(&ctx.exe, &dir, &machine(disks), &[])?;
    let control = dir.join("control.sock");
    let started = Instant::now();
    let outcome = campaigns(ctx, &control, up.pid, n, disks);
    let elapsed = started.elapsed().as_secs_f64();
    drop(up);
    crate::fixture::remove_work_dir(&dir);
    let (done, t) = outcome?;
    let mut rows = Vec::new();
    let mut series = Vec::new();
    let mut all_recoveries = Vec::new();
    for kind in Kind::ALL {
        let of: Vec<&Injected> = done.iter().filter(|d| d.kind == kind).collect();
        let rec: Vec<f64> = of.iter().filter_map(|d| d.recovered_ms).collect();
        all_recoveries.extend(&rec);
        let failed = |allowed: bool| -> BTreeMap<&str, u64> {
            let mut m = BTreeMap::new();
            for ((after, e, a), c) in &t.failed {
                if *after == Some(kind) && *a == allowed {
                    *m.entry(*e).or_default() += c;
                }
            }
            m
        };
        let quarantined = of.iter().filter(|d| d.quarantined == Some(true)).count();
        rows.push(serde_json::json!({
            "fault": kind.label(),
            "injected": of.len(),
            "restart_median_ms": percentile(&rec, 0.5),
            "restart_p99_ms": percentile(&rec, 0.99),
            "restart_max_ms": percentile(&rec, 1.0),
            "failed_allowed": failed(true),
            "failed_not_allowed": failed(false),
            "poisoned_requests_quarantined": kind.poison().map(|_| quarantined),
        }));
        if !rec.is_empty() {
            let mut samples = rec.clone();
            samples.sort_by(f64::total_cmp);
            series.push(Series {
                label: kind.label().into(),
                points: vec![Point {
                    x: 0.0,
                    y: Summary {
                        median: percentile(&rec, 0.5),
                        min: samples[0],
                        max: samples[samples.len() - 1],
                        samples,
                    },
                }],
            });
        }
    }
    let allowed: u64 = t.failed.iter().filter(|(k, _)| k.2).map(|(_, c)| c).sum();
    let not_allowed: Vec<String> = t
        .failed
        .iter()
        .filter(|(k, _)| !k.2)
        .map(|((after, e, _), c)| {
            format!("{c} {e} after {}", after.map_or("no fault", Kind::label))
        })
        .collect();
    let poisoned = done.iter().filter(|d| d.quarantined.is_some()).count();
    let quarantined = done.iter().filter(|d| d.quarantined == Some(true)).count();
    let targets = vec![
        Target {
            target: "faults: no failed request but those the policy allows".into(),
            measured: if not_allowed.is_empty() {
                format!("{allowed} failed, all allowed")
            } else {
                not_allowed.join(", ")
            },
            met: Some(not_allowed.is_empty()),
        },
        Target {
            target: "faults: no lost and no duplicated write".into(),
            measured: format!("{} mismatches, {} duplicates", t.mismatches, t.duplicates),
            met: Some(t.mismatches == 0 && t.duplicates == 0),
        },
        Target {
            target:
                "faults: every request that crashes its driver or model fails alone, quarantined"
                    .into(),
            measured: format!("{quarantined} of {poisoned}"),
            met: Some(quarantined == poisoned),
        },
    ];
    Ok(TestResult {
        test: "faults".into(),
        title: "Fault campaign under verified load".into(),
        reference: "Restart v2: a long fault campaign".into(),
        runs: 1,
        discarded: 0,
        params: serde_json::json!({
            "faults": done.len(),
            "seconds": elapsed,
            "disks": disks,
            "kinds": kinds(ctx)?.iter().map(|k| k.name()).collect::<Vec<_>>(),
            "clients": CLIENTS.div_ceil(disks).max(1) * disks,
            "queue_depth": 16,
            "request_deadline_ms": DEADLINE.as_millis() as u64,
            "requests_verified": t.verified,
            "requests_failed_allowed": allowed,
            "requests_failed_not_allowed": not_allowed,
            "mismatches": t.mismatches,
            "mismatch_examples": t.examples,
            "not_allowed_examples": t.unexplained,
            "duplicates": t.duplicates,
            "replayed": t.replayed,
            "restart_median_ms": percentile(&all_recoveries, 0.5),
            "restart_p99_ms": percentile(&all_recoveries, 0.99),
            "rows": rows,
        }),
        figures: vec![Figure {
            id: "recovery".into(),
            title: "Fault to a new driver server serving, by fault (ms)".into(),
            x_label: String::new(),
            y_label: "ms".into(),
            log_x: false,
            log_y: true,
            kind: "bar".into(),
            references: Vec::new(),
            series,
        }],
        unavailable: Vec::new(),
        targets,
        machine: Machine::here(),
    })
}

/// Progress steps.
pub fn steps(ctx: &Context) -> u64 {
    count(ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_answers_to_every_fault_its_request_lived_through() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let injected = [
            (ms(0), Kind::DeviceError),
            (ms(900), Kind::KillServer),
            (ms(2000), Kind::CorruptId),
        ];
        // Sent while the error was armed, answered after the next fault was injected: the
        // armed error allows it.
        assert_eq!(
            blame(&injected, ms(100), ms(950), "io"),
            (Some(Kind::DeviceError), true)
        );
        // Sent after the kill, with nothing before its answer that makes an I/O error: not
        // allowed, counted against the last fault before it.
        assert_eq!(
            blame(&injected, ms(1000), ms(2100), "io"),
            (Some(Kind::CorruptId), false)
        );
        // An error no fault it lived through allows.
        assert_eq!(
            blame(&injected, ms(100), ms(950), "timeout"),
            (Some(Kind::KillServer), false)
        );
        // Before any fault was injected: nothing allows it.
        assert_eq!(blame(&[], ms(1), ms(2), "timeout"), (None, false));
    }
}
