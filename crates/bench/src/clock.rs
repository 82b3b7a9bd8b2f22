//! Evaluation test 7 (the Fluke thesis's clock interrupt test, §5), in two parts.
//!
//! In this process: what one clock interrupt costs in CPU time, delivered four ways — a thread
//! blocked on a `timerfd` (the floor), the native work loop, and the `osenv` legacy model
//! uncontested (no thread in the driver: the interrupt thread runs the handler) and contested
//! (a process-level thread spinning inside the driver is stopped for each one) — at rising
//! rates, and how many of the interrupts asked for arrive (where the machine saturates).
//!
//! With devices ([`crate::clock_servers`]): 1 to 6 PCI timer models, each driven in its own
//! driver server by the C driver on `osenv` or by the native driver, the servers' CPU per
//! interrupt and the share handled. Contested delivery is measured in the first part only: a
//! driver server has no process-level thread that stays inside its driver.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_env::legacy::{Cpu, InterruptThread};
use outboard_env::WorkLoop;
use outboard_sys::timer;
use rustix::time::{clock_gettime, ClockId, Timespec};

use crate::model::{Machine, Point, Series, Target, TestResult};
use crate::stats::Summary;
use crate::tests::{figure, WARM_UP};
use crate::Context;

/// How the interrupt is delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delivery {
    Timerfd,
    Native,
    Uncontested,
    Contested,
}

impl Delivery {
    const ALL: [Delivery; 4] = [
        Delivery::Timerfd,
        Delivery::Native,
        Delivery::Uncontested,
        Delivery::Contested,
    ];

    fn label(self) -> &'static str {
        match self {
            Delivery::Timerfd => "timerfd, a thread",
            Delivery::Native => "native work loop",
            Delivery::Uncontested => "osenv, uncontested",
            Delivery::Contested => "osenv, contested",
        }
    }
}

/// Runs per rate and configuration in the progress bar's count.
pub fn steps(ctx: &Context) -> u64 {
    (rates(ctx).len() * Delivery::ALL.len() * ctx.runs) as u64 + crate::clock_servers::steps(ctx)
}

fn rates(ctx: &Context) -> &'static [u32] {
    if ctx.quick {
        &[1000, 10_000]
    } else {
        &[100, 1000, 2000, 5000, 10_000, 20_000]
    }
}

/// The clock test.
pub fn clock(ctx: &Context) -> Result<TestResult, String> {
    let secs = if ctx.quick { 0.2 } else { 1.0 };
    let mut cost = figure(
        "cpu-per-interrupt",
        "CPU time per clock interrupt",
        "interrupts asked per second",
        "µs of CPU per interrupt",
        true,
        "line",
    );
    let mut delivered = figure(
        "delivered",
        "Clock interrupts delivered",
        "interrupts asked per second",
        "delivered per second",
        true,
        "line",
    );
    for d in Delivery::ALL {
        let mut c = Series {
            label: d.label().into(),
            points: Vec::new(),
        };
        let mut n = c.clone();
        for &hz in rates(ctx) {
            ctx.progress
                .set_message(format!("clock: {} at {hz} Hz", d.label()));
            let (mut us, mut per_sec) = (Vec::new(), Vec::new());
            for _ in 0..ctx.runs {
                let m = measure(d, hz, secs)?;
                us.push(m.cpu_us_per_interrupt);
                per_sec.push(m.delivered_per_sec);
                ctx.progress.inc(1);
            }
            c.points.push(Point {
                x: f64::from(hz),
                y: Summary::of(&us, WARM_UP),
            });
            n.points.push(Point {
                x: f64::from(hz),
                y: Summary::of(&per_sec, WARM_UP),
            });
        }
        cost.series.push(c);
        delivered.series.push(n);
    }
    let at = |label: &str| {
        cost.series
            .iter()
            .find(|s| s.label == label)
            .and_then(|s| s.at(1000.0))
    };
    let (un, con) = (
        at(Delivery::Uncontested.label()),
        at(Delivery::Contested.label()),
    );
    let (servers_cost, servers_share, saturation, priced) =
        crate::clock_servers::measure(ctx, secs)?;
    let mut targets = vec![
        Target {
            target: "clock: osenv uncontested ≤ 5 µs of CPU per interrupt (1 kHz)".into(),
            measured: un.map_or("not measured".into(), |u| format!("{u:.2} µs")),
            met: un.map(|u| u <= 5.0),
        },
        Target {
            target: "clock: osenv contested ≤ 1.5× uncontested (1 kHz)".into(),
            measured: match (un, con) {
                (Some(u), Some(c)) if u > 0.0 => format!("{:.2}× ({c:.2} µs vs {u:.2} µs)", c / u),
                _ => "not measured".into(),
            },
            met: match (un, con) {
                (Some(u), Some(c)) if u > 0.0 => Some(c / u <= 1.5),
                _ => None,
            },
        },
    ];
    targets.extend(saturation.into_iter().map(|s| Target {
        target: "clock: timer drivers in servers, where the machine saturates".into(),
        measured: s,
        met: None,
    }));
    targets.push(Target {
        target: "clock: timer drivers in servers, contested windows that priced the interrupts"
            .into(),
        measured: priced,
        met: None,
    });
    Ok(TestResult {
        test: "clock".into(),
        title: "Clock interrupts".into(),
        reference: "Fluke thesis §5 (clock interrupt test); EVALUATION.md test 7: one driver in this process, then 1-6 timer drivers each in its own server".into(),
        runs: ctx.runs,
        discarded: WARM_UP,
        params: serde_json::json!({
            "rates_hz": rates(ctx),
            "seconds_per_run": secs,
            "server_rates_hz": crate::clock_servers::rates(ctx),
        }),
        figures: vec![
            cost.references_where(|l| l == Delivery::Timerfd.label()),
            delivered,
            servers_cost,
            servers_share,
        ],
        unavailable: Vec::new(),
        targets,
        machine: Machine::here(),
    })
}

/// One run's outcome.
struct Measured {
    cpu_us_per_interrupt: f64,
    delivered_per_sec: f64,
}

fn periodic(hz: u32) -> Result<OwnedFd, String> {
    timer::periodic(Some(timer::period_of(hz))).map_err(|e| format!("timerfd: {e}"))
}

fn seconds(t: Timespec) -> f64 {
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

fn process_cpu() -> f64 {
    seconds(clock_gettime(ClockId::ProcessCPUTime))
}

fn thread_cpu() -> f64 {
    seconds(clock_gettime(ClockId::ThreadCPUTime))
}

/// Reads a timerfd's count; 0 if it had not fired.
fn ack(fd: &OwnedFd) -> u64 {
    let mut b = [0u8; 8];
    match rustix::io::read(fd, &mut b) {
        Ok(8) => u64::from_ne_bytes(b),
        _ => 0,
    }
}

/// Work a process-level thread does in the driver, in units that take the same time (the
/// contending thread's, so both contested measurements price the same work).
use outboard_drivers::legacy::contender::work_unit;

/// A legacy driver whose vector 0 counts into `handled`, and its interrupt thread.
fn counting_driver(handled: &Arc<AtomicU64>) -> Result<(Arc<Cpu>, InterruptThread), String> {
    let cpu = Cpu::new();
    let h = handled.clone();
    cpu.enter()
        .irq_alloc(
            0,
            Arc::new(move || {
                h.fetch_add(1, SeqCst);
            }),
            false,
        )
        .map_err(|e| e.to_string())?;
    let thread = InterruptThread::spawn(cpu.clone()).map_err(|e| e.to_string())?;
    Ok((cpu, thread))
}

/// Windows of a contested run, alternately with the timer running and stopped.
const WINDOWS: u64 = 10;

/// A contested run: a thread spins inside the driver doing work units while the timer runs
/// in every other window and is stopped in the rest. What the interrupts cost the spinning
/// thread is its CPU in the timer's windows minus the work it did there, at the rate it
/// worked in the quiet windows of the same run (so drift falls on both alike); the rest of
/// the process's CPU is the interrupt thread's.
fn contested(hz: u32, secs: f64) -> Result<Measured, String> {
    let window = Duration::from_secs_f64(secs / (WINDOWS / 2) as f64);
    let handled = Arc::new(AtomicU64::new(0));
    let (cpu, thread) = counting_driver(&handled)?;
    let fd = periodic(hz)?;
    let control = rustix::io::dup(&fd).map_err(|e| format!("dup: {e}"))?;
    stop_timer(&control)?;
    thread.attach(fd, 0).map_err(|e| e.to_string())?;
    // The window the spinner is in; it records (units, CPU seconds) per window as it sees the
    // number change (an atomic load per unit).
    let current = Arc::new(AtomicU64::new(0));
    let (c, w) = (cpu.clone(), current.clone());
    let spinning = std::thread::spawn(move || {
        let _inside = c.enter();
        let mut per_window = vec![(0u64, 0f64); WINDOWS as usize];
        let (mut units, mut x, mut at) = (0u64, 1u64, 0u64);
        let mut since = thread_cpu();
        loop {
            work_unit(&mut x);
            units += 1;
            let now_in = w.load(SeqCst);
            if now_in != at {
                let t = thread_cpu();
                per_window[at as usize] = (units, t - since);
                (units, since, at) = (0, t, now_in);
                if at >= WINDOWS {
                    return per_window;
                }
            }
        }
    });
    let before = process_cpu();
    for k in 0..WINDOWS {
        current.store(k, SeqCst);
        if k % 2 == 0 {
            start_timer(&control, hz)?;
        } else {
            stop_timer(&control)?;
        }
        std::thread::sleep(window);
    }
    stop_timer(&control)?;
    current.store(WINDOWS, SeqCst);
    let per_window = spinning.join().map_err(|_| "spinner panicked")?;
    drop(thread);
    let used = process_cpu() - before;
    let sum = |on: bool| {
        per_window
            .iter()
            .enumerate()
            .filter(|(k, _)| (k % 2 == 0) == on)
            .fold((0u64, 0f64), |(u, c), (_, (wu, wc))| (u + wu, c + wc))
    };
    let ((units_on, cpu_on), (units_off, cpu_off)) = (sum(true), sum(false));
    let rate = units_off as f64 / cpu_off.max(1e-9);
    let spinner_cpu = cpu_on + cpu_off;
    let lost = cpu_on - units_on as f64 / rate;
    let n = handled.load(SeqCst).max(1) as f64;
    Ok(Measured {
        cpu_us_per_interrupt: ((used - spinner_cpu) + lost) / n * 1e6,
        delivered_per_sec: handled.load(SeqCst) as f64 / secs,
    })
}

fn start_timer(fd: &OwnedFd, hz: u32) -> Result<(), String> {
    timer::set_periodic(fd.as_fd(), Some(timer::period_of(hz))).map_err(|e| format!("timerfd: {e}"))
}

fn stop_timer(fd: &OwnedFd) -> Result<(), String> {
    timer::set_periodic(fd.as_fd(), None).map_err(|e| format!("timerfd: {e}"))
}

fn measure(d: Delivery, hz: u32, secs: f64) -> Result<Measured, String> {
    if d == Delivery::Contested {
        return contested(hz, secs);
    }
    let span = Duration::from_secs_f64(secs);
    let handled = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let fd = periodic(hz)?;
    let before = process_cpu();
    let started = Instant::now();
    let mut keep = None;
    let worker = match d {
        Delivery::Timerfd => {
            let (h, s) = (handled.clone(), stop.clone());
            Some(std::thread::spawn(move || {
                while !s.load(SeqCst) {
                    let mut p = [rustix::event::PollFd::new(
                        &fd,
                        rustix::event::PollFlags::IN,
                    )];
                    let t = Timespec {
                        tv_sec: 0,
                        tv_nsec: 50_000_000,
                    };
                    let _ = rustix::event::poll(&mut p, Some(&t));
                    if ack(&fd) > 0 {
                        h.fetch_add(1, SeqCst);
                    }
                }
            }))
        }
        Delivery::Native => {
            let (h, s) = (handled.clone(), stop.clone());
            Some(std::thread::spawn(move || {
                let mut work = WorkLoop::new().expect("work loop");
                work.add(fd.as_fd(), 0u8).expect("add the timer");
                let mut ready = Vec::new();
                while !s.load(SeqCst) {
                    ready.clear();
                    let _ = work.wait(Some(Duration::from_millis(50)), &mut ready);
                    for _ in ready.drain(..) {
                        if ack(&fd) > 0 {
                            h.fetch_add(1, SeqCst);
                        }
                    }
                }
            }))
        }
        Delivery::Uncontested | Delivery::Contested => {
            let (_, thread) = counting_driver(&handled)?;
            thread.attach(fd, 0).map_err(|e| e.to_string())?;
            keep = Some(thread);
            None
        }
    };
    std::thread::sleep(span);
    stop.store(true, SeqCst);
    let elapsed = started.elapsed().as_secs_f64();
    if let Some(w) = worker {
        w.join().map_err(|_| "timer thread panicked")?;
    }
    drop(keep);
    let used = process_cpu() - before;
    let n = handled.load(SeqCst).max(1) as f64;
    Ok(Measured {
        cpu_us_per_interrupt: used / n * 1e6,
        delivered_per_sec: handled.load(SeqCst) as f64 / elapsed,
    })
}
