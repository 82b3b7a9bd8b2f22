//! The tests of EVALUATION.md: 1 disk read, 2 random IOPS, 3 null round trip.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use indicatif::ProgressBar;
use outboard_block_client::Colocated;
use outboard_block_client::{BlockClient, SessionOptions, WaitMode};
use outboard_drivers::Attachment;
use outboard_hw::DeviceSpec;

use crate::cpu::CpuMeter;
use crate::fixture::Fixture;
use crate::model::{Figure, Machine, Point, Series, Target, TestResult, Unavailable};
use crate::placement::{Pinned, Placement};
use crate::stats::{median, Summary};
use crate::{pingpong, workloads, Context};

pub(crate) const WARM_UP: usize = 1;

/// Repeats `f` for every run, advancing the progress bar.
pub(crate) fn repeat(
    ctx: &Context,
    mut f: impl FnMut() -> Result<f64, String>,
) -> Result<Summary, String> {
    let mut v = Vec::with_capacity(ctx.runs);
    for _ in 0..ctx.runs {
        v.push(f()?);
        ctx.progress.inc(1);
    }
    Ok(Summary::of(&v, WARM_UP))
}

pub(crate) fn figure(id: &str, title: &str, x: &str, y: &str, log_x: bool, kind: &str) -> Figure {
    Figure {
        id: id.into(),
        title: title.into(),
        x_label: x.into(),
        y_label: y.into(),
        log_x,
        log_y: false,
        kind: kind.into(),
        references: Vec::new(),
        series: Vec::new(),
    }
}

/// A bar chart's one bar: `label` at `y`.
pub(crate) fn bar(label: &str, y: Summary) -> Series {
    Series {
        label: label.into(),
        points: vec![Point { x: 0.0, y }],
    }
}

/// A ratio target: `num / den` over the x values in `xs` where both were measured (and `den`
/// is non-zero), judged at its worst point against `bound` (≥ if `at_least`, else ≤).
pub(crate) fn ratio_target(
    target: &str,
    num: Option<&Series>,
    den: Option<&Series>,
    xs: &[f64],
    bound: f64,
    at_least: bool,
    at: fn(f64) -> String,
) -> Target {
    let (Some(num), Some(den)) = (num, den) else {
        return Target {
            target: target.into(),
            measured: "a configuration was unavailable".into(),
            met: None,
        };
    };
    let ratios = xs.iter().filter_map(|&x| match (num.at(x), den.at(x)) {
        (Some(n), Some(d)) if d > 0.0 => Some((x, n / d)),
        _ => None,
    });
    let worst = if at_least {
        ratios.min_by(|a, b| a.1.total_cmp(&b.1))
    } else {
        ratios.max_by(|a, b| a.1.total_cmp(&b.1))
    };
    match worst {
        Some((x, r)) => Target {
            target: target.into(),
            measured: format!(
                "{} {r:.2}× (at {})",
                if at_least { "lowest" } else { "highest" },
                at(x)
            ),
            met: Some(if at_least { r >= bound } else { r <= bound }),
        },
        None => Target {
            target: target.into(),
            measured: "runs too short to measure".into(),
            met: None,
        },
    }
}

/// Test 1: sequential reads at queue depth 1, transfer sizes 512 B … 128 KiB.
pub fn disk_read(ctx: &Context) -> Result<TestResult, String> {
    let total = ctx
        .size
        .unwrap_or(if ctx.quick { 4 << 20 } else { 64 << 20 });
    let sizes: Vec<u64> = (9..=17).map(|s| 1u64 << s).collect();
    ctx.progress.set_message("disk-read: preparing the image");
    let fx = Fixture::new(&ctx.exe, total)?;
    let mut bw = figure(
        "bandwidth",
        "Disk read: bandwidth (QD1, sequential)",
        "transfer size (bytes)",
        "MB/s (log scale)",
        true,
        "line",
    );
    bw.log_y = true;
    let mut cpu = figure(
        "cpu",
        "Disk read: CPU busy, processes involved",
        "transfer size (bytes)",
        "CPU cores busy",
        true,
        "line",
    );
    let mut machine = figure(
        "cpu-machine",
        "Disk read: CPU busy, whole machine",
        "transfer size (bytes)",
        "CPU cores busy",
        true,
        "line",
    );
    let mut unavailable = Vec::new();
    let min_run = if ctx.quick { 0.05 } else { 0.5 };

    let mut measure = |label: &str,
                       pids: &[u32],
                       read: &mut dyn FnMut(u64) -> Result<f64, String>|
     -> Result<(), String> {
        ctx.progress.set_message(format!("disk-read: {label}"));
        let (mut b, mut c, mut m) = (
            Series {
                label: label.into(),
                points: vec![],
            },
            Series {
                label: label.into(),
                points: vec![],
            },
            Series {
                label: label.into(),
                points: vec![],
            },
        );
        for &t in &sizes {
            let (mut cpus, mut machines) = (Vec::new(), Vec::new());
            let y = repeat(ctx, || {
                // Whole passes until the run is long enough for CPU accounting, whose clock
                // ticks every 10 ms: a 64 MiB pass at 128 KiB lasts only a few milliseconds.
                let meter = CpuMeter::start(pids);
                let (mut secs, mut passes) = (0.0, 0u64);
                while secs < min_run {
                    secs += read(t)?;
                    passes += 1;
                }
                let busy = meter.stop();
                cpus.push(busy.processes);
                machines.push(busy.machine);
                Ok(total as f64 * passes as f64 / secs / 1e6)
            })?;
            b.points.push(Point { x: t as f64, y });
            c.points.push(Point {
                x: t as f64,
                y: Summary::of(&cpus, WARM_UP),
            });
            m.points.push(Point {
                x: t as f64,
                y: Summary::of(&machines, WARM_UP),
            });
        }
        bw.series.push(b);
        cpu.series.push(c);
        machine.series.push(m);
        Ok(())
    };
    let me = std::process::id();

    match fx.loop_device() {
        Ok(dev) => measure("kernel", &[me], &mut |t| {
            workloads::kernel_seq_read(&dev.path, t, total)
        })?,
        Err(reason) => unavailable.push(Unavailable {
            config: "kernel".into(),
            reason,
        }),
    }
    let (device, dev_sock) = fx.device()?;
    {
        let mut d = Colocated::open(
            "disk0",
            &Attachment::Pci(DeviceSpec::VfioUser(dev_sock.clone())),
            4 << 20,
        )
        .map_err(|e| e.to_string())?;
        measure("colocated", &[me, device.pid], &mut |t| {
            workloads::seq_read(&mut d, t, total)
        })?;
    }
    for (label, spin) in [("separate", 20), ("separate, server sleeps", 0)] {
        let (host, sock) = fx.host(&format!("disk0=vfio-user:{}", dev_sock.display()), spin)?;
        let mut d = BlockClient::open(&sock, "disk0", SessionOptions::default())
            .map_err(|e| e.to_string())?;
        measure(label, &[me, host.pid, device.pid], &mut |t| {
            workloads::seq_read(&mut d, t, total)
        })?;
    }
    drop(device);
    {
        let (host, sock) = fx.host(&format!("null0=null:{total}"), 20)?;
        let mut d = BlockClient::open(&sock, "null0", SessionOptions::default())
            .map_err(|e| e.to_string())?;
        measure("ipc-only", &[me, host.pid], &mut |t| {
            workloads::seq_read(&mut d, t, total)
        })?;
    }

    let big: Vec<f64> = sizes
        .iter()
        .filter(|&&t| t >= 4096)
        .map(|&t| t as f64)
        .collect();
    let all: Vec<f64> = sizes.iter().map(|&t| t as f64).collect();
    let bigger: Vec<f64> = sizes
        .iter()
        .filter(|&&t| t >= 16384)
        .map(|&t| t as f64)
        .collect();
    let targets = vec![
        ratio_target(
            "disk read: separate ≥ 95% of colocated bandwidth at every size ≥ 4 KiB",
            bw.series("separate"),
            bw.series("colocated"),
            &big,
            0.95,
            true,
            |x| format!("{x} B"),
        ),
        ratio_target(
            "disk read CPU: separate ≤ 1.3× colocated busy time",
            cpu.series("separate"),
            cpu.series("colocated"),
            &all,
            1.3,
            false,
            |x| format!("{x} B"),
        ),
        ratio_target(
            "disk read: colocated ≥ kernel bandwidth at ≥ 16 KiB",
            bw.series("colocated"),
            bw.series("kernel"),
            &bigger,
            1.0,
            true,
            |x| format!("{x} B"),
        ),
    ];
    Ok(TestResult {
        test: "disk-read".into(),
        title: "Disk read".into(),
        reference: "Fluke thesis §5.2.1, Figs 5.1–5.2".into(),
        runs: ctx.runs,
        discarded: WARM_UP,
        params: serde_json::json!({ "bytes_per_run": total, "queue_depth": 1, "transfer_sizes": sizes }),
        figures: vec![bw, cpu, machine]
            .into_iter()
            .map(|f| f.references_where(|label| label == "kernel"))
            .collect(),
        unavailable,
        targets,
        machine: Machine::here(),
    })
}

/// Test 2: 4 KiB random reads at several queue depths and client counts.
pub fn iops(ctx: &Context) -> Result<TestResult, String> {
    let disk = ctx
        .size
        .unwrap_or(if ctx.quick { 32 << 20 } else { 1 << 30 });
    let qds: Vec<usize> = if ctx.quick {
        vec![1, 16]
    } else {
        vec![1, 4, 16, 64, 128]
    };
    let clients: Vec<usize> = if ctx.quick { vec![1, 2] } else { vec![1, 2, 4] };
    let secs = if ctx.quick { 0.1 } else { 0.5 };
    ctx.progress.set_message("iops: preparing the image");
    let fx = Fixture::new(&ctx.exe, disk)?;
    let mut fig = figure(
        "iops",
        "Random 4 KiB reads",
        "queue depth (per client)",
        "IOPS (log scale)",
        true,
        "line",
    );
    fig.log_y = true;
    let mut unavailable = Vec::new();
    let client_label = |n: usize| {
        if n == 1 {
            "1 client".to_string()
        } else {
            format!("{n} clients")
        }
    };

    match fx.loop_device() {
        Ok(dev) => {
            for &n in &clients {
                ctx.progress
                    .set_message(format!("iops: kernel (fio io_uring), {}", client_label(n)));
                let mut s = Series {
                    label: format!("kernel io_uring, {}", client_label(n)),
                    points: vec![],
                };
                for &qd in &qds {
                    match repeat(ctx, || workloads::fio_iops(&dev.path, qd, n, secs)) {
                        Ok(y) => s.points.push(Point { x: qd as f64, y }),
                        Err(reason) => {
                            unavailable.push(Unavailable {
                                config: "kernel".into(),
                                reason,
                            });
                            break;
                        }
                    }
                }
                if !s.points.is_empty() {
                    fig.series.push(s);
                }
                if !unavailable.is_empty() {
                    break;
                }
            }
        }
        Err(reason) => unavailable.push(Unavailable {
            config: "kernel".into(),
            reason,
        }),
    }
    let (device, dev_sock) = fx.device()?;
    {
        ctx.progress.set_message("iops: colocated");
        let mut d = Colocated::open(
            "disk0",
            &Attachment::Pci(DeviceSpec::VfioUser(dev_sock.clone())),
            1 << 20,
        )
        .map_err(|e| e.to_string())?;
        let mut s = Series {
            label: "colocated, 1 client".into(),
            points: vec![],
        };
        for &qd in &qds {
            let y = repeat(ctx, || workloads::rand_read(&mut d, qd, secs, 7))?;
            s.points.push(Point { x: qd as f64, y });
        }
        fig.series.push(s);
    }
    {
        let (_host, sock) = fx.host(&format!("disk0=vfio-user:{}", dev_sock.display()), 20)?;
        for &n in &clients {
            ctx.progress
                .set_message(format!("iops: separate, {}", client_label(n)));
            let mut devs: Vec<BlockClient> = (0..n)
                .map(|_| {
                    BlockClient::open(&sock, "disk0", SessionOptions::default())
                        .map_err(|e| e.to_string())
                })
                .collect::<Result<_, _>>()?;
            let mut s = Series {
                label: format!("separate, {}", client_label(n)),
                points: vec![],
            };
            for &qd in &qds {
                let y = repeat(ctx, || {
                    let barrier = Arc::new(Barrier::new(n));
                    std::thread::scope(|scope| {
                        let handles: Vec<_> = devs
                            .iter_mut()
                            .enumerate()
                            .map(|(i, d)| {
                                let b = barrier.clone();
                                scope.spawn(move || {
                                    b.wait();
                                    workloads::rand_read(d, qd, secs, 100 + i as u64)
                                })
                            })
                            .collect();
                        handles
                            .into_iter()
                            .map(|h| h.join().expect("client thread"))
                            .sum::<Result<f64, String>>()
                    })
                })?;
                s.points.push(Point { x: qd as f64, y });
            }
            fig.series.push(s);
        }
    }
    drop(device);

    let deep: Vec<f64> = qds
        .iter()
        .filter(|&&q| q >= 16)
        .map(|&q| q as f64)
        .collect();
    let every: Vec<f64> = qds.iter().map(|&q| q as f64).collect();
    let targets = vec![
        ratio_target(
            "random IOPS: separate ≥ 90% of colocated at QD ≥ 16",
            fig.series("separate, 1 client"),
            fig.series("colocated, 1 client"),
            &deep,
            0.9,
            true,
            |x| format!("QD {x}"),
        ),
        ratio_target(
            "random IOPS: colocated ≥ kernel io_uring",
            fig.series("colocated, 1 client"),
            fig.series("kernel io_uring, 1 client"),
            &every,
            1.0,
            true,
            |x| format!("QD {x}"),
        ),
    ];
    Ok(TestResult {
        test: "iops".into(),
        title: "Random IOPS".into(),
        reference: "EVALUATION.md test 2 (modern)".into(),
        runs: ctx.runs,
        discarded: WARM_UP,
        params: serde_json::json!({ "disk_bytes": disk, "block": 4096, "queue_depths": qds, "clients": clients, "seconds_per_run": secs }),
        figures: vec![fig.references_where(|label| label.starts_with("kernel"))],
        unavailable,
        targets,
        machine: Machine::here(),
    })
}

/// Round trips per latency run and seconds per throughput run.
fn rtt_sizes(ctx: &Context) -> (usize, f64) {
    if ctx.quick {
        (2000, 0.1)
    } else {
        (20000, 0.5)
    }
}

/// One session configuration of the null round trip: a driver server hosting the null device,
/// placed by `pin`, measured for latency and for batched throughput.
#[allow(clippy::too_many_arguments)]
fn session_rtt(
    ctx: &Context,
    fx: &Fixture,
    pin: &Pinned,
    label: &str,
    host_spin: u64,
    mode: WaitMode,
    lat: &mut Figure,
    tput: &mut Figure,
) -> Result<(), String> {
    let (n, secs) = rtt_sizes(ctx);
    ctx.progress.set_message(format!("null-rtt: {label}"));
    let (host, sock) = fx.host("null0=null:1M", host_spin)?;
    pin.peer(host.pid)?;
    let opts = SessionOptions {
        mode,
        ..Default::default()
    };
    let mut d = BlockClient::open(&sock, "null0", opts).map_err(|e| e.to_string())?;
    let point = |y| Series {
        label: label.into(),
        points: vec![Point { x: 0.0, y }],
    };
    lat.series.push(point(repeat(ctx, || {
        Ok(median(&mut workloads::null_latencies(&mut d, n)?))
    })?));
    tput.series.push(point(repeat(ctx, || {
        workloads::null_throughput(&mut d, 32, secs)
    })?));
    Ok(())
}

/// Test 3: the null round trip through a session, next to the machine's physical floor.
pub fn null_rtt(ctx: &Context) -> Result<TestResult, String> {
    let (n, secs) = rtt_sizes(ctx);
    let fx = Fixture::new(&ctx.exe, 1 << 20)?;
    let mut lat = figure(
        "latency",
        "Null round trip (median per run)",
        "",
        "µs",
        false,
        "bar",
    );
    let mut tput = figure(
        "throughput",
        "Null requests with batching (QD 32)",
        "",
        "requests/s",
        false,
        "bar",
    );

    let mut unavailable = Vec::new();
    let one_cpu = |config: &str| Unavailable {
        config: config.into(),
        reason: "this process may run on one CPU only".into(),
    };
    // Blocking round trips, each beside the eventfd floor in the same placement.
    for placement in [Placement::OneCore, Placement::TwoCores] {
        let Some(pin) = Pinned::new(placement)? else {
            unavailable.push(one_cpu(&format!(
                "eventfd ping-pong, {}",
                placement.label()
            )));
            unavailable.push(one_cpu(&format!(
                "session, blocking, {}",
                placement.label()
            )));
            continue;
        };
        let floor = format!("eventfd ping-pong, {}", placement.label());
        ctx.progress.set_message(format!("null-rtt: {floor}"));
        lat.series.push(bar(
            &floor,
            repeat(ctx, || {
                Ok(median(&mut pingpong::eventfd(&ctx.exe, n, &pin)?))
            })?,
        ));
        let label = format!("session, blocking, {}", placement.label());
        session_rtt(
            ctx,
            &fx,
            &pin,
            &label,
            0,
            WaitMode::Blocking,
            &mut lat,
            &mut tput,
        )?;
    }
    // Spinning needs both sides running at once: two cores only.
    if let Some(pin) = Pinned::new(Placement::TwoCores)? {
        ctx.progress.set_message("null-rtt: cache-line ping-pong");
        lat.series.push(bar(
            "cache-line ping-pong",
            repeat(ctx, || {
                Ok(median(&mut pingpong::cacheline(&ctx.exe, n, &pin)?))
            })?,
        ));
        let adaptive = WaitMode::Adaptive(Duration::from_micros(20));
        session_rtt(
            ctx,
            &fx,
            &pin,
            "session, adaptive",
            20,
            adaptive,
            &mut lat,
            &mut tput,
        )?;
    } else {
        unavailable.push(one_cpu("cache-line ping-pong"));
        unavailable.push(one_cpu("session, adaptive"));
    }
    let m = |label: &str| lat.series(label).and_then(|s| s.at(0.0));
    let mut targets = Vec::new();
    for placement in [Placement::OneCore, Placement::TwoCores] {
        let at = placement.label();
        if let (Some(efd), Some(block)) = (
            m(&format!("eventfd ping-pong, {at}")),
            m(&format!("session, blocking, {at}")),
        ) {
            targets.push(Target {
                target: format!("null round trip: blocking ≤ 1.3× eventfd ping-pong ({at})"),
                measured: format!("{:.2}× ({block:.2} µs vs {efd:.2} µs)", block / efd),
                met: Some(block <= 1.3 * efd),
            });
        }
    }
    if let (Some(line), Some(adapt)) = (m("cache-line ping-pong"), m("session, adaptive")) {
        targets.push(Target {
            target: "null round trip: adaptive ≤ 3× cache-line ping-pong (two cores)".into(),
            measured: format!("{:.2}× ({adapt:.2} µs vs {line:.2} µs)", adapt / line),
            met: Some(adapt <= 3.0 * line),
        });
    }
    Ok(TestResult {
        test: "null-rtt".into(),
        title: "Null round trip".into(),
        reference: "Fluke thesis \"IPC-only\"; EVALUATION.md test 3".into(),
        runs: ctx.runs,
        discarded: WARM_UP,
        params: serde_json::json!({ "round_trips_per_run": n, "batch_queue_depth": 32, "seconds_per_throughput_run": secs }),
        figures: [lat, tput]
            .map(|f| f.references_where(|label| label.contains("ping-pong")))
            .into(),
        unavailable,
        targets,
        machine: Machine::here(),
    })
}

/// Progress steps a test will take (for the progress bar).
pub fn steps(test: &str, ctx: &Context) -> u64 {
    let r = ctx.runs as u64;
    match test {
        "disk-read" => 5 * 9 * r,
        "iops" => {
            let (q, c) = if ctx.quick { (2, 2) } else { (5, 3) };
            (c + 1 + c) * q * r
        }
        "null-rtt" => 9 * r,
        "clock" => crate::clock::steps(ctx),
        "counters" => crate::counting::steps(ctx),
        "exports" => crate::exports::steps(ctx),
        "trace" => crate::trace::steps(ctx),
        "restart" => crate::restart::steps(ctx),
        "faults" => crate::faults::steps(ctx),
        "echo" => crate::echo::steps(ctx),
        "combination" => crate::combination::steps(ctx),
        "net-load" => crate::netload::steps(ctx),
        "net-raw" => crate::netraw::steps(ctx),
        _ => 0,
    }
}

/// Keeps `ProgressBar` in the signature documentation.
pub type Progress = ProgressBar;
