//! Outboard's evaluation suite (EVALUATION.md): each test runs every configuration side by side
//! in one invocation, repeats each measurement (the first run discarded as warm-up), and
//! reports medians with min/max. Results go to `<out>/<test>.json`, a PNG chart per figure, and
//! `<out>/REPORT.md` with the targets and whether this run met them.
#![deny(missing_docs)]

pub mod charts;
pub mod clock;
pub mod clock_servers;
pub mod combination;
pub mod compare;
pub mod counting;
pub mod cpu;
pub mod echo;
pub mod exports;
pub mod faults;
pub mod fixture;
pub mod model;
pub mod netload;
pub mod netns;
pub mod netraw;
pub mod pingpong;
pub mod placement;
pub mod report;
pub mod restart;
pub mod restart_net;
pub mod stats;
pub mod tests;
pub mod trace;
pub mod uring;
pub mod verified;
pub mod workloads;

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};

/// The tests, in report order.
pub const TESTS: &[&str] = &[
    "disk-read",
    "iops",
    "null-rtt",
    "counters",
    "trace",
    "exports",
    "restart",
    "faults",
    "echo",
    "combination",
    "net-load",
    "net-raw",
    "clock",
];

/// What a run needs.
pub struct Context {
    /// The `outboard` executable (device models, driver servers, ping-pong peers).
    pub exe: PathBuf,
    /// Runs per measurement, including the warm-up.
    pub runs: usize,
    /// Short runs for a smoke test.
    pub quick: bool,
    /// Overrides the test's data size (bytes read, or disk size).
    pub size: Option<u64>,
    /// Faults to inject (`faults`; default 240, quick 24).
    pub faults: Option<u64>,
    /// Disks the fault campaign injects into at once (default 1; 4 above 1,000 faults).
    pub fault_disks: Option<u64>,
    /// The fault kinds the campaign injects ([`faults::FAULT_KINDS`]; default all).
    pub fault_kinds: Option<Vec<String>>,
    /// Progress.
    pub progress: ProgressBar,
}

/// Options from the command line.
pub struct Options {
    /// The `outboard` executable.
    pub exe: PathBuf,
    /// Runs per measurement (0: default, 11; quick: 2).
    pub runs: usize,
    /// Short runs.
    pub quick: bool,
    /// Data size override.
    pub size: Option<u64>,
    /// Faults to inject in the fault campaign.
    pub faults: Option<u64>,
    /// Disks the fault campaign injects into at once.
    pub fault_disks: Option<u64>,
    /// The fault kinds the campaign injects.
    pub fault_kinds: Option<Vec<String>>,
    /// Output directory.
    pub out: PathBuf,
}

/// Runs `tests` and writes JSON, charts and the report.
pub fn run(tests: &[&str], opts: Options) -> Result<(), String> {
    std::fs::create_dir_all(&opts.out).map_err(|e| format!("{}: {e}", opts.out.display()))?;
    let runs = if opts.runs > 0 {
        opts.runs
    } else if opts.quick {
        2
    } else {
        11
    };
    let mut ctx = Context {
        exe: opts.exe,
        runs: runs.max(2),
        quick: opts.quick,
        size: opts.size,
        faults: opts.faults,
        fault_disks: opts.fault_disks,
        fault_kinds: opts.fault_kinds,
        progress: ProgressBar::hidden(),
    };
    let total: u64 = tests.iter().map(|t| tests::steps(t, &ctx)).sum();
    ctx.progress = ProgressBar::new(total);
    ctx.progress.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} runs  {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    for &t in tests {
        let result = match t {
            "disk-read" => tests::disk_read(&ctx),
            "iops" => tests::iops(&ctx),
            "null-rtt" => tests::null_rtt(&ctx),
            "counters" => counting::counters(&ctx),
            "exports" => exports::exports(&ctx),
            "trace" => trace::trace_test(&ctx),
            "restart" => restart::restart_test(&ctx),
            "faults" => faults::faults_test(&ctx),
            "echo" => echo::echo(&ctx),
            "combination" => combination::combination(&ctx),
            "net-load" => netload::net_load(&ctx),
            "net-raw" => netraw::net_raw(&ctx),
            "clock" => clock::clock(&ctx),
            other => Err(format!(
                "unknown test {other:?} (known: {})",
                TESTS.join(", ")
            )),
        }?;
        let json = serde_json::to_string_pretty(&result).map_err(|e| e.to_string())?;
        std::fs::write(opts.out.join(format!("{t}.json")), json).map_err(|e| e.to_string())?;
    }
    ctx.progress.finish_and_clear();
    // Charts for every result present (so the report is whole even after single-test runs).
    let mut drawn = Vec::new();
    for t in TESTS {
        let Ok(text) = std::fs::read_to_string(opts.out.join(format!("{t}.json"))) else {
            continue;
        };
        let r: model::TestResult = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        for f in &r.figures {
            let name = format!("{t}-{}.png", f.id);
            drawn.push((name.clone(), charts::draw(f, &opts.out.join(&name))));
        }
    }
    report::write(&opts.out, &drawn)
}
