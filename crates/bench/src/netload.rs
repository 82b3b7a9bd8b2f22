//! Test 11, network under load (Elphinstone & Götz, Fig. 1b): UDP echo of 1024-byte payloads
//! while a rate-limited sender raises the offered load in steps; at each step the echoes that
//! came back (achieved throughput) and the CPU busy time of every process. The NICs' receive
//! interrupts are held back 0 and 100 µs (virtio's notification coalescing, asked for by the
//! driver). The paper's point: a user-level driver does not live-lock, where Linux did at no
//! hold-off.
//!
//! - `kernel`: `outboard bench-peer udp-load` against `bench-peer udp-echo` (the host's UDP
//!   over a veth pair between two namespaces; veth has no interrupts to hold back);
//! - `colocated, H µs` / `separate, H µs`: the same sender in this process with smoltcp on
//!   nic0, `outboard net echo --hold-off H` on nic1 (two NIC models on a wire).

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};

use std::time::{Duration, Instant};

use outboard_net_client::{open_nic, NetOptions, Udp};

use crate::cpu::{descendants, reaped_children_secs, CpuMeter};
use crate::echo::{echo_peer, lan, peer_said};
use crate::model::{Figure, Machine, Point, Series, Target, TestResult, Twin, Unavailable};
use crate::netns::{output_within, VethPair};
use crate::stats::Summary;
use crate::tests::{figure, ratio_target, WARM_UP};
use crate::Context;

/// Payload bytes.
const SIZE: usize = 1024;
/// Offered loads, datagrams a second.
const RATES: [u32; 6] = [2_000, 5_000, 10_000, 20_000, 40_000, 80_000];
/// Receive hold-offs, µs.
const HOLD_OFFS: [u32; 2] = [0, 100];
const PORT: u16 = 7;

/// Offered load in Mbit/s for `rate` datagrams a second.
fn mbit(rate: f64) -> f64 {
    rate * SIZE as f64 * 8.0 / 1e6
}

/// Sends `rate` datagrams a second for `secs` and counts the echoes (`recv` must not block);
/// (sent, echoes received, seconds it took — more than `secs` when sending blocked: a NIC
/// whose transmit ring is full holds the sender back).
pub fn offer(
    rate: u32,
    secs: f64,
    mut send: impl FnMut(&[u8]) -> Result<(), String>,
    mut recv: impl FnMut(&mut [u8]) -> Result<Option<usize>, String>,
) -> Result<(u64, u64, f64), String> {
    let total = (f64::from(rate) * secs) as u64;
    let payload = vec![0x5a; SIZE];
    let mut buf = vec![0u8; 2048];
    let (mut sent, mut got) = (0u64, 0u64);
    let t0 = Instant::now();
    let mut drain = |got: &mut u64| -> Result<(), String> {
        while let Some(n) = recv(&mut buf)? {
            *got += u64::from(n == SIZE);
        }
        Ok(())
    };
    while sent < total {
        let due = t0 + Duration::from_secs_f64(sent as f64 / f64::from(rate));
        drain(&mut got)?;
        let now = Instant::now();
        if now < due {
            if due - now > Duration::from_micros(200) {
                std::thread::sleep(due - now - Duration::from_micros(100));
            }
            continue;
        }
        send(&payload)?;
        sent += 1;
    }
    // Echoes still on their way.
    let end = Instant::now() + Duration::from_millis(200);
    while Instant::now() < end {
        drain(&mut got)?;
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok((sent, got, t0.elapsed().as_secs_f64() - 0.2))
}

/// `outboard bench-peer udp-echo ADDR:PORT` and `udp-load ADDR:PORT RATE SECS`: the kernel's
/// side, run inside a namespace.
pub fn peer(args: &[String]) -> Result<(), String> {
    let addr = |i: usize| -> Result<SocketAddr, String> {
        args.get(i)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bench-peer: bad address {:?}", args.get(i)))
    };
    match args.first().map(String::as_str) {
        Some("udp-echo") => {
            let s = UdpSocket::bind(addr(1)?).map_err(|e| e.to_string())?;
            println!("ready");
            let mut buf = vec![0u8; 65536];
            loop {
                let (n, from) = s.recv_from(&mut buf).map_err(|e| e.to_string())?;
                let _ = s.send_to(&buf[..n], from);
            }
        }
        Some("udp-load") => {
            let to = addr(1)?;
            let rate: u32 = args.get(2).and_then(|s| s.parse().ok()).ok_or("rate")?;
            let secs: f64 = args.get(3).and_then(|s| s.parse().ok()).ok_or("seconds")?;
            let s = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
            s.connect(to).map_err(|e| e.to_string())?;
            s.set_nonblocking(true).map_err(|e| e.to_string())?;
            let (sent, got, secs) = offer(
                rate,
                secs,
                |p| match s.send(p) {
                    // A full socket buffer drops the datagram, as a NIC would.
                    Ok(_) | Err(_) => Ok(()),
                },
                |b| match s.recv(b) {
                    Ok(n) => Ok(Some(n)),
                    // Nothing yet; or an earlier datagram found no one listening (ICMP).
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::ConnectionRefused
                        ) =>
                    {
                        Ok(None)
                    }
                    Err(e) => Err(e.to_string()),
                },
            )?;
            println!("{sent} {got} {secs}");
            Ok(())
        }
        _ => Err("bench-peer: udp-echo ADDR:PORT | udp-load ADDR:PORT RATE SECS".into()),
    }
}

/// One configuration's steps: throughput and CPU, and the load the sender really offered.
struct Steps {
    twin: Twin,
    offered: Series,
}

impl Steps {
    fn new(label: &str) -> Self {
        Self {
            twin: Twin::new(label),
            offered: Series::named(label),
        }
    }

    /// One step at `rate` datagrams a second, from its runs.
    fn push(&mut self, rate: u32, tput: &[f64], cpu: &[f64], offered: &[f64]) {
        let x = mbit(f64::from(rate));
        self.twin.push(x, tput, cpu);
        self.offered.points.push(Point {
            x,
            y: Summary::of(offered, WARM_UP),
        });
    }
}

fn kernel(ctx: &Context, secs: f64) -> Result<Steps, String> {
    let id = std::process::id() % 100_000;
    let v = VethPair::new(&format!("ob-load-{id}"), 75)?;
    // Listening before the first datagram is sent.
    let echo = crate::netraw::start(
        &ctx.exe,
        Some(&v.b),
        &["udp-echo".into(), "10.75.0.2:7".into()],
    )?;
    let mut m = Steps::new("kernel");
    for rate in RATES {
        ctx.progress
            .set_message(format!("net-load: kernel, {rate} datagrams/s"));
        let (mut tput, mut cpu, mut offered) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ctx.runs {
            let meter = CpuMeter::start(&[echo.0.id()]);
            let before = reaped_children_secs();
            let t0 = Instant::now();
            let mut cmd = v.a.command(&ctx.exe);
            cmd.args(["bench-peer", "udp-load", "10.75.0.2:7"])
                .arg(rate.to_string())
                .arg(secs.to_string());
            let out = output_within(&mut cmd, Duration::from_secs_f64(secs + 30.0))?;
            let elapsed = t0.elapsed().as_secs_f64();
            let client = (reaped_children_secs() - before) / elapsed;
            let text = String::from_utf8_lossy(&out.stdout);
            let mut words = text.split_whitespace().map(|w| w.parse::<f64>().ok());
            let said = (|| Some((words.next()??, words.next()??, words.next()??)))();
            let (sent, got, took) = said.ok_or_else(|| {
                format!(
                    "udp-load said {:?} {:?}",
                    text.trim(),
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            })?;
            tput.push(mbit(got / took));
            offered.push(mbit(sent / took));
            cpu.push(meter.stop().processes + client);
            ctx.progress.inc(1);
        }
        m.push(rate, &tput, &cpu, &offered);
    }
    Ok(m)
}

fn outboard(ctx: &Context, placement: &str, hold_off: u32, secs: f64) -> Result<Steps, String> {
    let dir = std::env::temp_dir().join(format!(
        "outboard-load-{}-{placement}-{hold_off}",
        std::process::id()
    ));
    let up = lan(&ctx.exe, &dir, placement)?;
    let hold = format!("--hold-off={hold_off}us");
    let _peer = echo_peer(&ctx.exe, &dir, "10.76.0.2/24", &[&hold])?;
    let (mut port, _) = open_nic(&dir.join("control.sock"), "nic0", NetOptions::default())
        .map_err(|e| format!("nic0: {e}"))?;
    port.set_hold_off(hold_off)
        .map_err(|e| format!("nic0: {e}"))?;
    let mut udp =
        Udp::bind(port, Ipv4Addr::new(10, 76, 0, 1), 24, 4000).map_err(|e| format!("nic0: {e}"))?;
    let to = (Ipv4Addr::new(10, 76, 0, 2), PORT);
    // The first echo: ARP done, the peer up.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = vec![0u8; 2048];
    loop {
        udp.send_to(&[0u8; SIZE], to).map_err(|e| e.to_string())?;
        if udp
            .recv_from(&mut buf, Duration::from_millis(200))
            .map_err(|e| e.to_string())?
            .is_some()
        {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("the echo peer never answered; {}", peer_said(&dir)));
        }
    }
    // Late echoes of the first tries.
    while udp
        .recv_from(&mut buf, Duration::from_millis(100))
        .map_err(|e| e.to_string())?
        .is_some()
    {}
    let mut pids = descendants(up.pid);
    pids.extend([up.pid, std::process::id()]);
    let label = format!("{placement}, {hold_off} µs");
    let mut m = Steps::new(&label);
    for rate in RATES {
        ctx.progress
            .set_message(format!("net-load: {label}, {rate} datagrams/s"));
        let (mut tput, mut cpu, mut offered) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ctx.runs {
            let meter = CpuMeter::start(&pids);
            let cell = std::cell::RefCell::new(&mut udp);
            let (sent, got, took) = offer(
                rate,
                secs,
                |p| {
                    // A datagram the NIC cannot take now is lost, as on a wire.
                    let _ = cell.borrow_mut().send_to(p, to);
                    Ok(())
                },
                |b| {
                    cell.borrow_mut()
                        .recv_from(b, Duration::ZERO)
                        .map(|r| r.map(|(n, _)| n))
                        .map_err(|e| e.to_string())
                },
            )?;
            cpu.push(meter.stop().processes);
            tput.push(mbit(got as f64 / took));
            offered.push(mbit(sent as f64 / took));
            ctx.progress.inc(1);
        }
        m.push(rate, &tput, &cpu, &offered);
    }
    drop(udp);
    drop(up);
    crate::fixture::remove_work_dir(&dir);
    Ok(m)
}

/// "Throughput never falls as offered load rises": every step keeps at least 90% of the best
/// step before it (a shared VM's noise allowed for).
fn no_live_lock(series: &[&Series]) -> Target {
    let target = "no live-lock: achieved throughput never falls below 90% of an earlier step (0 and 100 µs hold-off)".to_string();
    if series.is_empty() {
        return Target {
            target,
            measured: "no configuration ran".into(),
            met: None,
        };
    }
    let mut worst: Option<(String, f64, f64)> = None;
    for s in series {
        let mut best = 0.0f64;
        for p in &s.points {
            if best > 0.0 {
                let r = p.y.median / best;
                if worst.as_ref().is_none_or(|w| r < w.2) {
                    worst = Some((s.label.clone(), p.x, r));
                }
            }
            best = best.max(p.y.median);
        }
    }
    match worst {
        Some((label, x, r)) => Target {
            target,
            measured: format!("lowest {r:.2}× of the best before ({label}, {x:.0} Mbit/s offered)"),
            met: Some(r >= 0.9),
        },
        None => Target {
            target,
            measured: "one step only".into(),
            met: None,
        },
    }
}

/// Test 11.
pub fn net_load(ctx: &Context) -> Result<TestResult, String> {
    let secs = if ctx.quick { 0.3 } else { 1.0 };
    let mut tput = figure(
        "throughput",
        "Network under load: UDP echo throughput (1024-byte payloads)",
        "offered load (Mbit/s)",
        "achieved (Mbit/s)",
        true,
        "line",
    );
    let mut cpu = Figure {
        id: "cpu".into(),
        title: "Network under load: CPU busy, processes involved".into(),
        y_label: "CPU cores busy".into(),
        ..tput.clone()
    };
    let mut offered = Figure {
        id: "offered".into(),
        title: "Network under load: load the sender really offered".into(),
        y_label: "offered (Mbit/s)".into(),
        ..tput.clone()
    };
    let mut unavailable = Vec::new();
    let mut runs: Vec<(String, Result<Steps, String>)> = vec![("kernel".into(), kernel(ctx, secs))];
    for placement in ["colocated", "separate"] {
        for h in HOLD_OFFS {
            runs.push((
                format!("{placement}, {h} µs"),
                outboard(ctx, placement, h, secs),
            ));
        }
    }
    for (config, r) in runs {
        match r {
            Ok(m) => {
                tput.series.push(m.twin.first);
                cpu.series.push(m.twin.second);
                offered.series.push(m.offered);
            }
            Err(reason) => unavailable.push(Unavailable { config, reason }),
        }
    }
    let xs: Vec<f64> = RATES.iter().map(|&r| mbit(f64::from(r))).collect();
    let ours: Vec<&Series> = tput.series.iter().filter(|s| s.label != "kernel").collect();
    let targets = vec![
        no_live_lock(&ours),
        ratio_target(
            "separate (0 µs) ≥ kernel throughput at every step",
            tput.series("separate, 0 µs"),
            tput.series("kernel"),
            &xs,
            1.0,
            true,
            |x| format!("{x:.0} Mbit/s offered"),
        ),
        ratio_target(
            "separate (0 µs) CPU ≤ kernel's at every step",
            cpu.series("separate, 0 µs"),
            cpu.series("kernel"),
            &xs,
            1.0,
            false,
            |x| format!("{x:.0} Mbit/s offered"),
        ),
    ];
    Ok(TestResult {
        test: "net-load".into(),
        title: "Network under load".into(),
        reference: "Elphinstone & Götz, Fig. 1b (EVALUATION.md test 11)".into(),
        runs: ctx.runs,
        discarded: WARM_UP,
        params: serde_json::json!({
            "payload": SIZE,
            "rates_per_second": RATES,
            "seconds_per_step": secs,
            "hold_offs_us": HOLD_OFFS,
        }),
        figures: vec![tput, cpu, offered],
        unavailable,
        targets,
        machine: Machine::here(),
    })
}

/// Progress steps.
pub fn steps(ctx: &Context) -> u64 {
    (1 + 2 * HOLD_OFFS.len() as u64) * RATES.len() as u64 * ctx.runs as u64
}
