//! The clock test with timer *devices*: 1 to 6 PCI timer models, each driven in a driver
//! server of its own by the C driver on `osenv` (`legacy-timer`) or by the native work-loop
//! driver (`timer`), ticking at a rate for a fixed time. Measured: the driver servers' CPU time
//! (every thread, from `/proc/PID/task/*/schedstat`) per interrupt their drivers handled, and
//! the share of the interrupts asked for that were handled — where it falls, the machine is
//! saturated. The interrupt counts come from the drivers themselves (the clock class's time
//! record), read through a session at the start and the end of the window.

use std::path::{Path, PathBuf};
use std::time::Duration;

use outboard_clock::ClockDevice;
use outboard_clock_client::ClockClient;

use crate::fixture::{remove_work_dir, spawn, Proc};
use crate::model::{Figure, Point, Series};
use crate::stats::Summary;
use crate::tests::{figure, WARM_UP};
use crate::Context;

/// The drivers compared, with their labels.
const DRIVERS: [(&str, &str); 2] = [("legacy-timer", "osenv (C driver)"), ("timer", "native")];

/// How many timers at once.
fn counts(ctx: &Context) -> &'static [usize] {
    if ctx.quick {
        &[1, 2]
    } else {
        &[1, 2, 3, 4, 5, 6]
    }
}

/// Each timer's rate.
pub(crate) fn rates(ctx: &Context) -> &'static [u32] {
    if ctx.quick {
        &[1000]
    } else {
        &[100, 1000, 10_000]
    }
}

/// Runs in the progress bar's count.
pub fn steps(ctx: &Context) -> u64 {
    (DRIVERS.len() * counts(ctx).len() * rates(ctx).len() * ctx.runs) as u64
}

/// CPU nanoseconds every thread of `pid` has run.
fn cpu_ns(pid: u32) -> u64 {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten();
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// `n` timers at `hz`, each with its driver server running `driver`.
struct Timers {
    _models: Vec<Proc>,
    hosts: Vec<Proc>,
    clients: Vec<ClockClient>,
    dir: PathBuf,
}

impl Drop for Timers {
    fn drop(&mut self) {
        self.clients.clear();
        self.hosts.clear();
        remove_work_dir(&self.dir);
    }
}

fn start(exe: &Path, driver: &str, n: usize, hz: u32) -> Result<Timers, String> {
    let dir = std::env::temp_dir().join(format!(
        "outboard-bench-clock-{}-{driver}-{n}-{hz}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut t = Timers {
        _models: Vec::new(),
        hosts: Vec::new(),
        clients: Vec::new(),
        dir: dir.clone(),
    };
    for i in 0..n {
        let model = dir.join(format!("timer{i}.sock"));
        let host = dir.join(format!("host{i}.sock"));
        let name = format!("clock{i}");
        let m = [
            "device",
            "timer",
            "--socket",
            &model.display().to_string(),
            "--hz",
            &hz.to_string(),
        ]
        .map(String::from);
        t._models.push(spawn(exe, &m, &model)?);
        let h = [
            "driver-host",
            "--listen",
            &host.display().to_string(),
            "--device",
            &format!("{name}=vfio-user:{}", model.display()),
            "--driver",
            &format!("{name}={driver}"),
            "--spin-us",
            "0",
        ]
        .map(String::from);
        t.hosts.push(spawn(exe, &h, &host)?);
        t.clients
            .push(ClockClient::open(&host, &name).map_err(|e| format!("{name}: {e}"))?);
    }
    Ok(t)
}

/// One window: (µs of driver-server CPU per interrupt handled, share of the interrupts asked
/// that were handled).
fn window(t: &mut Timers, n: usize, hz: u32, secs: f64) -> Result<(f64, f64), String> {
    let irqs = |t: &mut Timers| -> Result<u64, String> {
        let mut sum = 0u64;
        for c in &mut t.clients {
            sum += u64::from(c.now().map_err(|e| e.to_string())?.interrupts);
        }
        Ok(sum)
    };
    let cpu = |t: &Timers| t.hosts.iter().map(|h| cpu_ns(h.pid)).sum::<u64>();
    let (i0, c0) = (irqs(t)?, cpu(t));
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (c1, i1) = (cpu(t), irqs(t)?);
    let handled = i1.wrapping_sub(i0).max(1);
    let asked = n as f64 * f64::from(hz) * secs;
    Ok((
        c1.saturating_sub(c0) as f64 / 1e3 / handled as f64,
        (handled as f64 / asked).min(1.0) * 100.0,
    ))
}

/// The two figures (CPU per interrupt, share handled) and, per driver, the highest total rate
/// asked at which at least 95% were handled.
pub fn measure(ctx: &Context, secs: f64) -> Result<(Figure, Figure, Vec<String>), String> {
    let mut cost = figure(
        "servers-cpu-per-interrupt",
        "Timer drivers in servers: CPU per interrupt",
        "timer drivers, each in its own server",
        "µs of driver-server CPU per interrupt",
        false,
        "line",
    );
    let mut share = figure(
        "servers-handled",
        "Timer drivers in servers: interrupts handled",
        "timer drivers, each in its own server",
        "% of the ticks that raised an interrupt",
        false,
        "line",
    );
    let mut saturation = Vec::new();
    for (driver, label) in DRIVERS {
        let mut best: Option<f64> = None;
        let mut first_short: Option<f64> = None;
        for &hz in rates(ctx) {
            let name = format!("{label}, {hz} Hz each");
            let mut c = Series {
                label: name.clone(),
                points: Vec::new(),
            };
            let mut s = c.clone();
            for &n in counts(ctx) {
                ctx.progress
                    .set_message(format!("clock: {n} × {driver} at {hz} Hz"));
                let mut t = start(&ctx.exe, driver, n, hz)?;
                // Let the first ticks and the sessions settle.
                std::thread::sleep(Duration::from_millis(100));
                let (mut us, mut pct) = (Vec::new(), Vec::new());
                for _ in 0..ctx.runs {
                    let (u, p) = window(&mut t, n, hz, secs)?;
                    us.push(u);
                    pct.push(p);
                    ctx.progress.inc(1);
                }
                drop(t);
                let (u, p) = (Summary::of(&us, WARM_UP), Summary::of(&pct, WARM_UP));
                let total = n as f64 * f64::from(hz);
                if p.median >= 95.0 {
                    best = Some(best.map_or(total, |b| b.max(total)));
                } else {
                    first_short = Some(first_short.map_or(total, |f| f.min(total)));
                }
                c.points.push(Point { x: n as f64, y: u });
                s.points.push(Point { x: n as f64, y: p });
            }
            cost.series.push(c);
            share.series.push(s);
        }
        saturation.push(format!(
            "{label}: ≥95% handled up to {} interrupts/s in total{}",
            best.map_or("none".into(), |b| format!("{b:.0}")),
            first_short.map_or(" (not saturated at the rates tried)".into(), |f| format!(
                "; below 95% from {f:.0}/s"
            )),
        ));
    }
    Ok((cost, share, saturation))
}
