//! What the counters cost: the null round trip and 4 KiB random reads through a driver
//! server that keeps its per-device and per-session counters, and through one that keeps
//! none (`driver-host --no-counters`), in one run. The two servers run side by side and are
//! measured in turns (ABBA: the order flips each run), so drift of the machine falls on both.

use std::time::Duration;

use outboard_block_client::{BlockClient, SessionOptions, WaitMode};

use crate::fixture::Fixture;
use crate::model::{Machine, Point, Series, Target, TestResult};
use crate::placement::{Pinned, Placement};
use crate::stats::{median, Summary};
use crate::tests::{figure, WARM_UP};
use crate::{workloads, Context};

/// Progress steps.
pub fn steps(ctx: &Context) -> u64 {
    2 * ctx.runs as u64
}

/// How long the server and the client spin before they sleep, µs.
const SPIN_US: u64 = 20;

/// The two configurations, with and without counters.
const LABELS: [&str; 2] = ["with counters", "without counters"];

fn sizes(ctx: &Context) -> (usize, f64, usize) {
    // Round trips per latency run, seconds per IOPS run, queue depth.
    if ctx.quick {
        (2000, 0.1, 16)
    } else {
        (20000, 0.5, 16)
    }
}

/// What counting one request costs in the server, in ns: the counts of a request taken and
/// answered with a timed success, repeated in this process (the page and the code the
/// driver server uses).
fn counting_ns(n: u64) -> Result<f64, String> {
    use outboard_server::counters::{Counters, Described};
    let page = Counters::create(&[Described {
        name: "null0".into(),
        class: "block".into(),
        kinds: Vec::new(),
    }])
    .map_err(|e| e.to_string())?;
    let tally = page.open(0, 1, 1).ok_or("no session record")?;
    // Latencies spread over many buckets, as a real device's are; each taken as the server
    // takes it, as the difference of two stamps of its turn clock.
    let found: Vec<u64> = (0..1024u64).map(|k| 5_000 + k * 97).collect();
    let t = std::time::Instant::now();
    for i in 0..n {
        tally.taken();
        let since = std::hint::black_box(i & 4095);
        let at = std::hint::black_box(found[(i & 1023) as usize]);
        tally.answered(0, 4096, Some(at.saturating_sub(since)));
    }
    Ok(t.elapsed().as_secs_f64() * 1e9 / n as f64)
}

/// The counters' cost.
pub fn counters(ctx: &Context) -> Result<TestResult, String> {
    let (n, secs, qd) = sizes(ctx);
    let fx = Fixture::new(&ctx.exe, 1 << 20)?;
    // A null device: what a request costs besides the device (reads complete in the driver,
    // through the same timed completion path as a real device's).
    let device = "null0=null:64M";
    let (with, with_sock) = fx.host_named("counted", device, SPIN_US, &[])?;
    let (without, without_sock) =
        fx.host_named("uncounted", device, SPIN_US, &["--no-counters"])?;
    // Both sides spin before they sleep, on two cores of their own when there are two: the
    // round trip is then short and steady enough that a few nanoseconds would show.
    let pinned = Pinned::new(Placement::TwoCores)?;
    if let Some(pin) = &pinned {
        pin.peer(with.pid)?;
        pin.peer(without.pid)?;
    }
    let opts = SessionOptions {
        mode: WaitMode::Adaptive(Duration::from_micros(SPIN_US)),
        ..Default::default()
    };
    let open =
        |sock: &std::path::Path| BlockClient::open(sock, "null0", opts).map_err(|e| e.to_string());
    let mut clients = [open(&with_sock)?, open(&without_sock)?];
    let mut lat: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut iops: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for run in 0..ctx.runs {
        ctx.progress
            .set_message(format!("counters: run {}", run + 1));
        let order = if run % 2 == 0 { [0, 1] } else { [1, 0] };
        for &c in &order {
            let d = &mut clients[c];
            lat[c].push(median(&mut workloads::null_latencies(d, n)?));
            iops[c].push(workloads::rand_read(d, qd, secs, 11 + run as u64)?);
        }
        ctx.progress.inc(2);
    }
    let summary = |v: &[f64]| Summary::of(v, WARM_UP.min(v.len().saturating_sub(1)));
    let mut lat_fig = figure(
        "latency",
        "Null round trip, with and without counters (median per run)",
        "",
        "µs",
        false,
        "bar",
    );
    let mut iops_fig = figure(
        "iops",
        &format!("4 KiB random reads of a null device at queue depth {qd}"),
        "",
        "IOPS",
        false,
        "bar",
    );
    for c in 0..2 {
        lat_fig.series.push(Series {
            label: LABELS[c].into(),
            points: vec![Point {
                x: 0.0,
                y: summary(&lat[c]),
            }],
        });
        iops_fig.series.push(Series {
            label: LABELS[c].into(),
            points: vec![Point {
                x: 0.0,
                y: summary(&iops[c]),
            }],
        });
    }
    let (l_with, l_without) = (summary(&lat[0]).median, summary(&lat[1]).median);
    let (i_with, i_without) = (summary(&iops[0]).median, summary(&iops[1]).median);
    // Judged by the median of each run's ratio (the two measured back to back), which drift
    // between runs does not move.
    let paired = |v: &[Vec<f64>; 2]| {
        let mut r: Vec<f64> = v[0]
            .iter()
            .zip(&v[1])
            .skip(WARM_UP)
            .map(|(a, b)| a / b)
            .collect();
        median(&mut r)
    };
    let (l_ratio, i_ratio) = (paired(&lat), paired(&iops));
    let per_request = counting_ns(if ctx.quick { 1_000_000 } else { 20_000_000 })?;
    let request_ns = 1e9 / i_without;
    let targets = vec![
        Target {
            target: "counters: null round trip at most 2% slower with them (median of paired runs)"
                .into(),
            measured: format!(
                "{l_ratio:.3}× (medians {l_with:.3} µs vs {l_without:.3} µs)"
            ),
            met: Some(l_ratio <= 1.02),
        },
        Target {
            target: "counters: 4 KiB IOPS at most 2% lower with them (median of paired runs)"
                .into(),
            measured: format!("{i_ratio:.3}× (medians {i_with:.0} vs {i_without:.0} IOPS)"),
            met: Some(i_ratio >= 0.98),
        },
        Target {
            target: "counters: counting a request costs at most 2% of a request's time (4 KiB reads of a null device, without counters)".into(),
            measured: format!(
                "{:.2}% ({per_request:.1} ns of {request_ns:.0} ns)",
                100.0 * per_request / request_ns
            ),
            met: Some(per_request <= 0.02 * request_ns),
        },
    ];
    Ok(TestResult {
        test: "counters".into(),
        title: "What the counters cost".into(),
        reference: "issue Operations v1: hot-path cost of the counters ≤ 2%".into(),
        runs: ctx.runs,
        discarded: WARM_UP,
        params: serde_json::json!({ "round_trips_per_run": n, "seconds_per_iops_run": secs, "queue_depth": qd, "device": device }),
        figures: vec![lat_fig, iops_fig],
        unavailable: Vec::new(),
        targets,
        machine: Machine::here(),
    })
}
