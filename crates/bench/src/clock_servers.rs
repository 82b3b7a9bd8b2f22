//! The clock test with timer *devices*: 1 to 6 PCI timer models, each driven in a driver
//! server of its own by the C driver on `osenv` (`legacy-timer`), by the native work-loop
//! driver (`timer`) or by the native C driver (`native-c-timer`, `native.h`), ticking at a rate for a fixed time — the C driver also *contested*: a
//! thread in each server holds the driver nearly all the time (`legacy::contender`), so its
//! interrupts stop that thread, as in the thesis; beside them, as the floor, 1 to 6
//! processes each with a thread blocked on a `timerfd` at the same rate (`bench-peer timerfd`).
//! Measured: the driver servers' (or floor processes') CPU time (every thread, from
//! `/proc/PID/task/*/schedstat`) per interrupt handled, and the share of the interrupts asked
//! for that were handled — where it falls, the machine is saturated. The interrupt counts come
//! from the drivers themselves (the clock class's time record), read through a session at the
//! start and the end of the window; a floor process answers its count on a socket.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outboard_clock::ClockDevice;
use outboard_clock_client::ClockClient;

use crate::fixture::{remove_work_dir, spawn, Proc};
use crate::model::{Figure, Point, Series};
use crate::stats::Summary;
use crate::tests::{figure, WARM_UP};
use crate::Context;

/// The configurations compared: (driver, contested, label); `timerfd` is the floor: no
/// device, no driver.
const DRIVERS: [(&str, bool, &str); 5] = [
    ("legacy-timer", false, "osenv (C driver)"),
    ("legacy-timer", true, "osenv (C driver), contested"),
    ("timer", false, "native"),
    ("native-c-timer", false, "native (C driver)"),
    (FLOOR, false, "timerfd (the floor)"),
];

const FLOOR: &str = "timerfd";

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

/// CPU nanoseconds the threads of `pid` have run: all of them, and those named `named`.
fn cpu_ns(pid: u32, named: &str) -> (u64, u64) {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten();
    let mut all = (0, 0);
    for t in tasks.flatten() {
        let Some(ns) = std::fs::read_to_string(t.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        else {
            continue;
        };
        all.0 += ns;
        if std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == named) {
            all.1 += ns;
        }
    }
    all
}

/// Where a timer's interrupt count is read.
enum Counter {
    /// A driver's: the clock class's time record, through a session.
    Driver(Box<ClockClient>),
    /// A floor process's: it answers its count on this socket.
    Floor(PathBuf),
}

impl Counter {
    fn interrupts(&mut self) -> Result<u64, String> {
        match self {
            Counter::Driver(c) => Ok(u64::from(c.now().map_err(|e| e.to_string())?.interrupts)),
            Counter::Floor(path) => {
                let mut s =
                    UnixStream::connect(&*path).map_err(|e| format!("{}: {e}", path.display()))?;
                let mut b = [0u8; 8];
                s.read_exact(&mut b)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                Ok(u64::from_le_bytes(b))
            }
        }
    }
}

/// `n` timers at `hz`, each with its driver server running `driver` (or, for the floor, a
/// process of its own on a `timerfd`).
struct Timers {
    _models: Vec<Proc>,
    hosts: Vec<Proc>,
    clients: Vec<Counter>,
    /// Where each server's contending thread reports (contested runs).
    contenders: Vec<PathBuf>,
    dir: PathBuf,
}

impl Drop for Timers {
    fn drop(&mut self) {
        self.clients.clear();
        self.hosts.clear();
        remove_work_dir(&self.dir);
    }
}

fn start(exe: &Path, driver: &str, contested: bool, n: usize, hz: u32) -> Result<Timers, String> {
    let dir = std::env::temp_dir().join(format!(
        "outboard-bench-clock-{}-{driver}-{contested}-{n}-{hz}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut t = Timers {
        _models: Vec::new(),
        hosts: Vec::new(),
        clients: Vec::new(),
        contenders: Vec::new(),
        dir: dir.clone(),
    };
    for i in 0..n {
        if driver == FLOOR {
            let sock = dir.join(format!("floor{i}.sock"));
            let a = [
                "bench-peer",
                "timerfd",
                &hz.to_string(),
                &sock.display().to_string(),
            ]
            .map(String::from);
            t.hosts.push(spawn(exe, &a, &sock)?);
            t.clients.push(Counter::Floor(sock));
            continue;
        }
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
        let mut h = [
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
        .map(String::from)
        .to_vec();
        if contested {
            let report = dir.join(format!("contender{i}.bin"));
            h.extend(["--contend".into(), format!("{name}={}", report.display())]);
            t.contenders.push(report);
        }
        t.hosts.push(spawn(exe, &h, &host)?);
        t.clients.push(Counter::Driver(Box::new(
            ClockClient::open(&host, &name).map_err(|e| format!("{name}: {e}"))?,
        )));
    }
    Ok(t)
}

/// One window: (µs of driver-server CPU per interrupt handled, share of the interrupts asked
/// that were handled). A count is read through a session, which enters the driver (and may
/// wait for a contending thread to leave it), so each timer's count is timed where it was
/// read: its rate over its own interval, applied to the window of the CPU readings. In a
/// contested run the CPU is `None` when a contending thread did more work in the window than
/// its calibration allows (its estimate of what the interrupts took from it went down): the
/// calibration does not hold there, and the window prices nothing.
fn window(t: &mut Timers, n: usize, hz: u32, secs: f64) -> Result<(Option<f64>, f64), String> {
    let irqs = |t: &mut Timers| -> Result<Vec<(u64, Instant)>, String> {
        let mut at = Vec::with_capacity(t.clients.len());
        for c in &mut t.clients {
            let count = c.interrupts()?;
            at.push((count, Instant::now()));
        }
        Ok(at)
    };
    // The servers' CPU, less each contending thread's but for what its interrupts took
    // from it (its own report; its CPU is read here, at the same moment as the rest).
    let cpu = |t: &Timers| -> Result<(i64, i64, Instant), String> {
        let (mut ns, mut contending, mut all_lost) = (0i64, 0i64, 0i64);
        for h in &t.hosts {
            let (all, theirs) = cpu_ns(h.pid, "contender");
            ns += all as i64;
            contending += theirs as i64;
        }
        for path in &t.contenders {
            let (_, lost) =
                outboard_drivers::legacy::contender::read_report(path).ok_or_else(|| {
                    format!("{}: no report from the contending thread", path.display())
                })?;
            contending -= lost;
            all_lost += lost;
        }
        Ok((ns - contending, all_lost, Instant::now()))
    };
    let first = irqs(t)?;
    let (c0, lost0, t0) = cpu(t)?;
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (c1, lost1, t1) = cpu(t)?;
    let last = irqs(t)?;
    let span = t1.duration_since(t0).as_secs_f64().max(1e-6);
    let per_second: f64 = first
        .iter()
        .zip(&last)
        .map(|(&(i0, a), &(i1, b))| {
            i1.wrapping_sub(i0) as f64 / b.duration_since(a).as_secs_f64().max(1e-6)
        })
        .sum();
    let handled = (per_second * span).max(1.0);
    let priced = lost1 >= lost0 && c1 >= c0;
    Ok((
        priced.then(|| (c1 - c0) as f64 / 1e3 / handled),
        (per_second / (n as f64 * f64::from(hz))).min(1.0) * 100.0,
    ))
}

/// The two figures (CPU per interrupt, share handled); per driver, the highest total rate
/// asked at which at least 95% were handled; and how many contested windows priced the
/// interrupts.
pub fn measure(ctx: &Context, secs: f64) -> Result<(Figure, Figure, Vec<String>, String), String> {
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
    let (mut unpriced, mut contested_windows) = (0usize, 0usize);
    for (driver, contested, label) in DRIVERS {
        // (total rate asked, median share handled) of every configuration.
        let mut shares: Vec<(f64, f64)> = Vec::new();
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
                let mut t = start(&ctx.exe, driver, contested, n, hz)?;
                // Let the first ticks and the sessions settle (and the contending threads
                // calibrate: five 10 ms stretches).
                std::thread::sleep(Duration::from_millis(if contested { 300 } else { 100 }));
                let (mut us, mut pct) = (Vec::new(), Vec::new());
                for _ in 0..ctx.runs {
                    let (u, p) = window(&mut t, n, hz, secs)?;
                    us.push(u);
                    pct.push(p);
                    ctx.progress.inc(1);
                }
                drop(t);
                // The warm-up window goes first; then the windows that priced nothing (none
                // but in a contested run: see `window`).
                let priced: Vec<f64> = us.iter().skip(WARM_UP).flatten().copied().collect();
                unpriced += us.len().saturating_sub(WARM_UP) - priced.len();
                if contested {
                    contested_windows += us.len().saturating_sub(WARM_UP);
                }
                let p = Summary::of(&pct, WARM_UP);
                shares.push((n as f64 * f64::from(hz), p.median));
                // A configuration no window priced has no point (rather than a made-up one).
                if !priced.is_empty() {
                    c.points.push(Point {
                        x: n as f64,
                        y: Summary::of(&priced, 0),
                    });
                }
                s.points.push(Point { x: n as f64, y: p });
            }
            cost.series.push(c);
            share.series.push(s);
        }
        saturation.push(format!("{label}: {}", saturation_of(&mut shares)));
    }
    let priced = format!(
        "{} of {contested_windows} (left out: {unpriced}, where a contending thread's \
         calibration did not hold)",
        contested_windows - unpriced
    );
    Ok((cost, share, saturation, priced))
}

/// Where the machine saturates, from (total rate asked, share handled) pairs: the highest
/// total rate below which every configuration handled at least 95%, and the first that did
/// not. Near saturation the share is noisy, so a higher rate that passed again is named too.
fn saturation_of(shares: &mut [(f64, f64)]) -> String {
    shares.sort_by(|a, b| a.0.total_cmp(&b.0));
    let Some(short) = shares.iter().position(|&(_, p)| p < 95.0) else {
        return match shares.last() {
            Some((t, _)) => format!(
                "≥95% handled at every total rate tried, up to {t:.0} interrupts/s (not saturated)"
            ),
            None => "nothing measured".into(),
        };
    };
    let (first_short, pct) = shares[short];
    let below = match short {
        0 => "below 95% already at the lowest total rate tried".to_string(),
        _ => format!(
            "≥95% handled at every total rate up to {:.0} interrupts/s",
            shares[short - 1].0
        ),
    };
    let again = shares[short..]
        .iter()
        .filter(|&&(_, p)| p >= 95.0)
        .map(|&(t, _)| t)
        .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.max(t))));
    format!(
        "{below}; {pct:.0}% at {first_short:.0}/s{}",
        again.map_or(String::new(), |t| format!(
            " (≥95% again at {t:.0}/s: the share is noisy near saturation)"
        ))
    )
}

/// The floor's process (`outboard bench-peer timerfd HZ SOCKET`): a thread blocked on a
/// periodic `timerfd` counts its wake-ups, and answers the count (8 bytes, little-endian) to
/// whoever connects to `SOCKET`. Runs until killed.
pub fn floor_peer(args: &[String]) -> Result<(), String> {
    use rustix::event::{poll, PollFd, PollFlags};
    let usage = || "bench-peer timerfd HZ SOCKET".to_string();
    let hz: u32 = args
        .get(1)
        .and_then(|s| s.parse().ok())
        .filter(|&h| h > 0)
        .ok_or_else(usage)?;
    let path = args.get(2).ok_or_else(usage)?;
    let listener = UnixListener::bind(path).map_err(|e| format!("{path}: {e}"))?;
    let timer = outboard_sys::timer::periodic(Some(outboard_sys::timer::period_of(hz)))
        .map_err(|e| format!("timerfd: {e}"))?;
    let mut wakeups = 0u64;
    loop {
        let mut fds = [
            PollFd::new(&timer, PollFlags::IN),
            PollFd::new(&listener, PollFlags::IN),
        ];
        match poll(&mut fds, None) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(format!("poll: {e}")),
        }
        let (tick, asked) = (
            fds[0].revents().contains(PollFlags::IN),
            fds[1].revents().contains(PollFlags::IN),
        );
        if tick {
            let mut b = [0u8; 8];
            if rustix::io::read(timer.as_fd(), &mut b) == Ok(8) {
                wakeups += 1;
            }
        }
        if asked {
            if let Ok((mut s, _)) = listener.accept() {
                let _ = s.write_all(&wakeups.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::saturation_of;

    #[test]
    fn saturation_names_the_first_shortfall_and_a_noisy_pass_above_it() {
        let mut s = vec![
            (2000.0, 99.0),
            (100.0, 100.0),
            (10000.0, 80.0),
            (20000.0, 96.0),
            (6000.0, 97.0),
        ];
        assert_eq!(
            saturation_of(&mut s),
            "≥95% handled at every total rate up to 6000 interrupts/s; 80% at 10000/s (≥95% \
             again at 20000/s: the share is noisy near saturation)"
        );
        let mut ok = vec![(1000.0, 100.0), (3000.0, 99.0)];
        assert_eq!(
            saturation_of(&mut ok),
            "≥95% handled at every total rate tried, up to 3000 interrupts/s (not saturated)"
        );
        let mut low = vec![(1000.0, 50.0)];
        assert_eq!(
            saturation_of(&mut low),
            "below 95% already at the lowest total rate tried; 50% at 1000/s"
        );
    }
}
