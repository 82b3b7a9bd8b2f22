//! The fault campaign: every fault kind, injected at a random point into one device's model
//! while clients do verified I/O through a driver server that also serves a healthy device.
//!
//! Invariants, for every kind: no request hangs past the deadline, no read returns wrong
//! data, every failed request says why (a specific error, never a protocol error), and the
//! other device's client sees no failure at all. Per kind, the table records what happened:
//! requests that succeeded, failed (and how), whether the device was given up.
//! The table is printed and written to `target/fault-campaign.md`.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Up, EXE};
use outboard_block::BlockError;

/// The device's request deadline in this campaign.
const DEADLINE: Duration = Duration::from_secs(2);
/// A request slower than this hung.
const HANG: Duration = Duration::from_secs(6);
/// Blocks of 4 KiB each client uses.
const UNITS: u64 = 32;

const MACHINE: &str = r#"
name = "campaign"
[[device]]
name = "victim"
model = "virtio-blk"
backing = "mem:4M"
server = "shared"
request_deadline = "2s"
fault_injection = true
[[device]]
name = "bystander"
model = "virtio-blk"
backing = "mem:4M"
server = "shared"
request_deadline = "2s"
"#;

#[derive(Default, Debug, Clone)]
struct Outcome {
    ok: u64,
    errors: BTreeMap<String, u64>,
    wrong_data: u64,
    hangs: u64,
    slowest: Duration,
    /// Requests that succeeded after the device had been given up (it came back).
    ok_after_failure: u64,
}

fn kind(e: &BlockError) -> String {
    match e {
        BlockError::Io(_) => "io".into(),
        BlockError::DeviceFailed(_) => "device-failed".into(),
        BlockError::Restarting => "restarting".into(),
        BlockError::DeviceGone => "gone".into(),
        BlockError::Timeout => "timeout".into(),
        other => format!("other: {other}"),
    }
}

/// Whether the client was told the device is out of service: being brought back
/// ("restarting") or given up for good ("device failed").
fn out_of_service(out: &Outcome) -> bool {
    out.errors.contains_key("device-failed") || out.errors.contains_key("restarting")
}

fn pattern(seed: u64) -> Vec<u8> {
    common::pattern(seed, 4096)
}

/// Verified random I/O on `name` until `stop`: a model of what each 4 KiB unit must hold
/// (unknown after a failed write), every read compared with it.
fn client(control: PathBuf, name: &str, stop: Arc<AtomicBool>, seed: u64) -> Outcome {
    let mut out = Outcome::default();
    let mut dev = outboard_block_client::open_block(&control, name).expect("open");
    let mut known: Vec<Option<u64>> = vec![None; UNITS as usize];
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut buf = vec![0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        let unit = next() % UNITS;
        let lba = unit * 8;
        let write = next() % 2 == 0;
        let t = Instant::now();
        let r = if write {
            let s = next();
            let r = dev.write_blocks(lba, &pattern(s));
            known[unit as usize] = r.is_ok().then_some(s);
            r
        } else {
            let r = dev.read_blocks(lba, &mut buf);
            if r.is_ok() {
                if let Some(s) = known[unit as usize] {
                    if buf != pattern(s) {
                        out.wrong_data += 1;
                    }
                }
            }
            r
        };
        let took = t.elapsed();
        out.slowest = out.slowest.max(took);
        if took > HANG {
            out.hangs += 1;
        }
        let given_up = out_of_service(&out);
        match r {
            Ok(()) => {
                out.ok += 1;
                if given_up {
                    out.ok_after_failure += 1;
                }
            }
            Err(e) => {
                *out.errors.entry(kind(&e)).or_default() += 1;
                // A device out of service answers at once: no need to spin on it.
                if matches!(e, BlockError::DeviceFailed(_) | BlockError::Restarting) {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
    out
}

fn inject(control: &Path, fault: &str) {
    let o = Command::new(EXE)
        .args(["fault", "victim", fault])
        .env("OUTBOARD_CONTROL", control)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "outboard fault victim {fault}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The state of the driver serving class device `name`.
fn driver_state(n: &serde_json::Value, name: &str) -> String {
    if n["kind"] == "driver"
        && n["children"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["name"] == name))
    {
        return n["props"]["state"].as_str().unwrap_or_default().to_string();
    }
    n["children"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| driver_state(c, name))
        .find(|s| !s.is_empty())
        .unwrap_or_default()
}

struct Row {
    fault: &'static str,
    victim: Outcome,
    bystander: Outcome,
    /// The victim's driver's state in the registry at the end.
    final_state: String,
}

impl Row {
    fn given_up(&self) -> bool {
        out_of_service(&self.victim)
    }
    fn back(&self) -> bool {
        self.victim.ok_after_failure > 0
    }
}

fn run_one(fault: &'static str, seed: u64) -> Row {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let stop = Arc::new(AtomicBool::new(false));
    let spawn = |name: &'static str, s: u64| {
        let (c, st) = (up.control.clone(), stop.clone());
        std::thread::spawn(move || client(c, name, st, s))
    };
    let victim = spawn("victim", seed);
    let bystander = spawn("bystander", seed ^ 0xabcdef);
    // A random point into the run.
    std::thread::sleep(Duration::from_millis(100 + seed % 400));
    inject(&up.control, fault);
    // Long enough for every fault to fire, for a stalled device to pass its deadline, and for
    // a device given up to come back (the 3 s stall ends 1 s after the deadline; re-opening
    // starts 100 ms after the failure and backs off from there).
    std::thread::sleep(DEADLINE + Duration::from_secs(5));
    if fault.starts_with("error=") {
        inject(&up.control, "clear");
    }
    stop.store(true, Ordering::Relaxed);
    let victim = victim.join().expect("victim client panicked");
    let bystander = bystander.join().expect("bystander client panicked");
    let final_state = driver_state(&common::registry(&up), "victim");
    // No process of the machine panicked: their logs are in the runtime directory.
    for log in std::fs::read_dir(&up.dir).unwrap().flatten() {
        let text = std::fs::read_to_string(log.path()).unwrap_or_default();
        assert!(
            !text.contains("panicked"),
            "{fault}: {} has a panic:\n{text}",
            log.path().display()
        );
    }
    assert!(
        !driver_state(&common::registry(&up), "bystander").starts_with("failed"),
        "{fault}: the bystander's driver is marked failed"
    );
    Row {
        fault,
        victim,
        bystander,
        final_state,
    }
}

#[test]
fn every_fault_kind_mid_run_fails_specifically_or_recovers_and_harms_nobody_else() {
    let faults: &[&'static str] = &[
        "error-next=3",
        "error=0-64",
        "drop-irq=5",
        "duplicate-irq=5",
        "spurious-irq=5",
        "corrupt-used=len",
        "corrupt-used=id",
        "stall=500ms",
        "stall=3s",
        "needs-reset",
        "crash",
    ];
    let seed = std::env::var("OUTBOARD_CAMPAIGN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    let mut rows = Vec::new();
    for (i, f) in faults.iter().enumerate() {
        rows.push(run_one(f, seed.wrapping_add(i as u64 * 7919)));
    }
    let mut table = format!(
        "fault campaign (seed {seed}; deadline {DEADLINE:?})\n\n\
         | fault | victim ok | victim errors | wrong data | hangs | slowest | device given up | back in service | state at the end | bystander ok | bystander errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    for r in &rows {
        let errs: Vec<String> = r
            .victim
            .errors
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        table += &format!(
            "| {} | {} | {} | {} | {} | {:?} | {} | {} | {} | {} | {} |\n",
            r.fault,
            r.victim.ok,
            if errs.is_empty() {
                "0".into()
            } else {
                errs.join(", ")
            },
            r.victim.wrong_data,
            r.victim.hangs,
            r.victim.slowest,
            if r.given_up() { "yes" } else { "no" },
            if r.back() { "yes" } else { "-" },
            r.final_state,
            r.bystander.ok,
            r.bystander.errors.values().sum::<u64>(),
        );
    }
    eprintln!("{table}");
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/fault-campaign.md");
    let _ = std::fs::write(out, &table);
    for r in &rows {
        let f = r.fault;
        assert_eq!(
            r.victim.wrong_data, 0,
            "{f}: a read returned wrong data\n{table}"
        );
        assert_eq!(r.victim.hangs, 0, "{f}: a request hung\n{table}");
        assert!(
            r.victim.errors.keys().all(|k| !k.starts_with("other")),
            "{f}: a failure did not say why\n{table}"
        );
        assert!(
            r.bystander.errors.is_empty(),
            "{f}: the other device suffered\n{table}"
        );
        assert!(
            r.bystander.ok > 0,
            "{f}: the other device made no progress\n{table}"
        );
        assert!(
            r.victim.ok > 0,
            "{f}: the victim did no I/O before the fault\n{table}"
        );
    }
    let row = |f: &str| rows.iter().find(|r| r.fault == f).unwrap();
    // What each fault must lead to.
    for f in [
        "drop-irq=5",
        "duplicate-irq=5",
        "spurious-irq=5",
        "stall=500ms",
    ] {
        assert!(
            row(f).victim.errors.is_empty(),
            "{f}: should be harmless\n{table}"
        );
    }
    for f in ["error-next=3", "error=0-64", "corrupt-used=len"] {
        assert!(row(f).victim.errors.contains_key("io"), "{f}\n{table}");
        assert!(
            !row(f).given_up(),
            "{f}: an I/O error is not a dead device\n{table}"
        );
    }
    // A device that stopped working ends its (restartable) server; the manager resets the
    // device by starting the server again, and the clients replay what was in flight: no
    // error at all — only a delay. A stall past the deadline too: answered "timed out" by the
    // old server, its requests could be carried out by the model after their clients had
    // reused the buffers.
    for f in ["corrupt-used=id", "needs-reset", "crash", "stall=3s"] {
        assert!(
            row(f).victim.errors.is_empty(),
            "{f}: a restart must not fail requests\n{table}"
        );
        assert!(
            row(f).final_state.starts_with("running (restarted"),
            "{f}: the driver should have been restarted\n{table}"
        );
    }
}

/// Requests that crash their driver (or its model) every time, read again and again by a
/// session of their own while four verified clients run (`outboard bench faults` with only
/// those kinds): each fails alone as quarantined after its crashes, and no client reads data
/// other than what was acknowledged. A server that died while a client replayed its requests
/// once left the replay's answers (tagged by their place in the replay) to be taken for the
/// client's own requests: reads completed without their data and acknowledged writes that were
/// never made, found by this campaign.
#[test]
fn requests_that_crash_their_server_cost_the_other_clients_no_data() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results");
    let o = Command::new(EXE)
        .args([
            "bench",
            "faults",
            "--faults",
            "120",
            "--fault-disks",
            "2",
            "--fault-kinds",
            "poison-driver,poison-model",
            "--out",
        ])
        .arg(&out)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("faults.json")).unwrap()).unwrap();
    let p = &v["params"];
    assert_eq!(p["faults"], 120);
    assert!(p["requests_verified"].as_u64().unwrap() > 1000, "{p}");
    assert_eq!(p["mismatches"], 0, "{}", p["mismatch_examples"]);
    assert_eq!(p["duplicates"], 0);
    assert_eq!(
        p["requests_failed_not_allowed"].as_array().unwrap().len(),
        0,
        "{}",
        p["not_allowed_examples"]
    );
    for t in v["targets"].as_array().unwrap() {
        assert_eq!(t["met"], true, "{t}");
    }
}
