//! Test 12, raw frames (Chubb, Figs. 6–8): MAC-layer receive, transmit and echo of frames
//! from 60 to 1514 bytes — throughput and the CPU the measured side spends per frame size.
//!
//! Both ends are `outboard bench-peer raw-…` processes, so every configuration runs the same
//! programs: `kernel` (packet sockets on a veth pair between two namespaces), `colocated` and
//! `separate` (nic0 and nic1 on a wire, opened by name, their drivers in the peers or in
//! servers). The measured end is nic0's (veth-a's): it receives (`rx`), sends (`tx`) or echoes
//! (`echo`) while the other end sends as fast as it can (and, for echo, counts what came back)
//! or counts. Throughput is the frames that arrived at the counting end in the window.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outboard_net_client::{open_nic, NetOptions, NetPort};
use outboard_sys::packet::PacketSocket;

use crate::cpu::{descendants, CpuMeter};
use crate::echo::lan;
use crate::model::{Figure, Machine, Point, Series, TestResult, Twin, Unavailable};
use crate::netns::{Running, VethPair};
use crate::stats::Summary;
use crate::tests::{figure, ratio_target, WARM_UP};
use crate::Context;

/// Frame sizes (without the frame check sequence).
pub const SIZES: [usize; 6] = [60, 128, 256, 512, 1024, 1514];
/// The measured end's tasks.
const MODES: [&str; 3] = ["rx", "tx", "echo"];
/// The Ethernet type of the test's frames (the IEEE's for local experiments).
const ETHERTYPE: [u8; 2] = [0x88, 0xb5];

/// One end: a packet socket, or an Outboard NIC.
enum End {
    Packet(PacketSocket),
    Nic(Box<dyn NetPort>),
}

impl End {
    /// `if:NAME` or `nic:CONTROL:NAME`.
    fn open(spec: &str) -> Result<Self, String> {
        if let Some(ifname) = spec.strip_prefix("if:") {
            return PacketSocket::open(ifname)
                .map(End::Packet)
                .map_err(|e| format!("{ifname}: {e}"));
        }
        let rest = spec
            .strip_prefix("nic:")
            .ok_or("if:NAME or nic:CONTROL:NAME")?;
        let (control, name) = rest.rsplit_once(':').ok_or("nic:CONTROL:NAME")?;
        let (port, _) = open_nic(Path::new(control), name, NetOptions::default())
            .map_err(|e| format!("{name}: {e}"))?;
        Ok(End::Nic(port))
    }

    fn send(&mut self, f: &[u8]) -> Result<(), String> {
        match self {
            End::Packet(p) => p.send(f).map_err(|e| e.to_string()),
            End::Nic(n) => n.send(f).map_err(|e| e.to_string()),
        }
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<Option<usize>, String> {
        match self {
            End::Packet(p) => p.try_recv(buf).map_err(|e| e.to_string()),
            End::Nic(n) => n.try_recv_into(buf).map_err(|e| e.to_string()),
        }
    }

    fn wait(&mut self, t: Duration) -> Result<(), String> {
        match self {
            End::Packet(p) => outboard_sys::poll::readable([std::os::fd::AsFd::as_fd(p)], t)
                .map(drop)
                .map_err(|e| e.to_string()),
            End::Nic(n) => n.wait_for(t).map_err(|e| e.to_string()),
        }
    }

    fn flush(&mut self) {
        if let End::Nic(n) = self {
            let _ = n.flush();
        }
    }
}

fn ours(frame: &[u8]) -> bool {
    frame.get(12..14) == Some(&ETHERTYPE[..])
}

/// This process's CPU seconds so far.
fn own_cpu() -> f64 {
    crate::cpu::process_secs(std::process::id()).unwrap_or(0.0)
}

/// `outboard bench-peer raw-source|raw-sink|raw-echo END SIZE SECS`: prints
/// `frames returned cpu-seconds` when done.
pub fn peer(args: &[String]) -> Result<(), String> {
    let (mode, spec) = (args[0].as_str(), args.get(1).ok_or("END")?);
    let size: usize = args.get(2).and_then(|s| s.parse().ok()).ok_or("SIZE")?;
    let secs: f64 = args.get(3).and_then(|s| s.parse().ok()).ok_or("SECS")?;
    let mut end = End::open(spec)?;
    let mut frame = vec![0u8; size.max(14)];
    frame[..6].fill(0xff);
    frame[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 0x42]);
    frame[12..14].copy_from_slice(&ETHERTYPE);
    let mut buf = vec![0u8; 2048];
    println!("ready");
    let (mut frames, mut returned) = (0u64, 0u64);
    let cpu0 = own_cpu();
    match mode {
        "raw-source" => {
            let t0 = Instant::now();
            while t0.elapsed().as_secs_f64() < secs {
                end.send(&frame)?;
                frames += 1;
                while let Some(n) = end.try_recv(&mut buf)? {
                    returned += u64::from(ours(&buf[..n]));
                }
            }
            end.flush();
            let t1 = Instant::now();
            while t1.elapsed() < Duration::from_millis(100) {
                match end.try_recv(&mut buf)? {
                    Some(n) => returned += u64::from(ours(&buf[..n])),
                    None => end.wait(Duration::from_millis(5))?,
                }
            }
        }
        "raw-sink" | "raw-echo" => {
            // The window opens with the first frame (bounded wait for it).
            let first = Instant::now() + Duration::from_secs(10);
            let mut t0 = None::<Instant>;
            loop {
                let now = Instant::now();
                match t0 {
                    Some(t) if (now - t).as_secs_f64() >= secs => break,
                    None if now > first => break,
                    _ => {}
                }
                match end.try_recv(&mut buf)? {
                    Some(n) if ours(&buf[..n]) => {
                        t0.get_or_insert(now);
                        frames += 1;
                        if mode == "raw-echo" {
                            let f = &mut buf[..n];
                            f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 0x43]);
                            end.send(f)?;
                        }
                    }
                    Some(_) => {}
                    None => end.wait(Duration::from_millis(1))?,
                }
            }
            end.flush();
        }
        other => return Err(format!("bench-peer: unknown mode {other}")),
    }
    println!("{frames} {returned} {}", own_cpu() - cpu0);
    Ok(())
}

/// `outboard bench-peer ARGS` started (in `netns`, if given); returned once it said
/// `ready`.
pub(crate) fn start(
    exe: &Path,
    netns: Option<&crate::netns::Netns>,
    args: &[String],
) -> Result<Running, String> {
    let mut cmd = match netns {
        Some(ns) => ns.command(exe),
        None => {
            let mut c = Command::new(exe);
            c.stdin(Stdio::null());
            c
        }
    };
    let mut child: Child = cmd
        .arg("bench-peer")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("bench-peer: {e}"))?;
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    let _ = out.read_line(&mut line);
    if line.trim() != "ready" {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("bench-peer {args:?} did not start: {line:?}"));
    }
    child.stdout = Some(out.into_inner());
    Ok(Running(child))
}

/// Waits (bounded) for a peer's `frames returned cpu` line.
fn finish(r: Running) -> Result<(u64, u64, f64), String> {
    let line = r.last_line(Duration::from_secs(30), "a bench-peer")?;
    let w: Vec<&str> = line.split_whitespace().collect();
    match w.as_slice() {
        [f, r, c] => Ok((
            f.parse().map_err(|_| line.clone())?,
            r.parse().map_err(|_| line.clone())?,
            c.parse().map_err(|_| line.clone())?,
        )),
        _ => Err(format!("a bench-peer said {line:?}")),
    }
}

/// Where each end is and what else belongs to the measured side.
struct Ends<'a> {
    near: String,
    far: String,
    near_ns: Option<&'a crate::netns::Netns>,
    far_ns: Option<&'a crate::netns::Netns>,
    /// Processes of the measured side besides its peer (nic0's model and server).
    near_pids: Vec<u32>,
    /// The same of the other side (nic1's).
    far_pids: Vec<u32>,
}

/// One measurement: (frames a second, CPU cores of the measured side, of the other side).
fn measure(
    ctx: &Context,
    e: &Ends<'_>,
    mode: &str,
    size: usize,
    secs: f64,
) -> Result<(f64, f64, f64), String> {
    let s = size.to_string();
    let args =
        |m: &str, end: &str, t: f64| vec![m.to_string(), end.to_string(), s.clone(), t.to_string()];
    let counter_secs = secs;
    let source_secs = secs + 0.5;
    let (near_mode, far_mode, near_t, far_t) = match mode {
        "rx" => ("raw-sink", "raw-source", counter_secs, source_secs),
        "tx" => ("raw-source", "raw-sink", source_secs, counter_secs),
        _ => ("raw-echo", "raw-source", counter_secs, source_secs),
    };
    // The counting or echoing end first, so it sees the first frame.
    let (first, first_ns, second, second_ns, near_first) = if near_mode == "raw-source" {
        (
            args(far_mode, &e.far, far_t),
            e.far_ns,
            args(near_mode, &e.near, near_t),
            e.near_ns,
            false,
        )
    } else {
        (
            args(near_mode, &e.near, near_t),
            e.near_ns,
            args(far_mode, &e.far, far_t),
            e.far_ns,
            true,
        )
    };
    let a = start(&ctx.exe, first_ns, &first)?;
    let meter = CpuMeter::start(&e.near_pids);
    let far_meter = CpuMeter::start(&e.far_pids);
    let t0 = Instant::now();
    let b = start(&ctx.exe, second_ns, &second)?;
    let (ra, rb) = (finish(a)?, finish(b)?);
    let elapsed = t0.elapsed().as_secs_f64();
    let others = meter.stop().processes;
    let far_others = far_meter.stop().processes;
    let (near, far) = if near_first { (ra, rb) } else { (rb, ra) };
    let frames = match mode {
        "rx" => near.0,
        "tx" => far.0,
        _ => far.1,
    };
    let near_cpu = near.2 / near_t.max(1e-3) + others * elapsed / near_t.max(1e-3);
    let far_cpu = far.2 / far_t.max(1e-3) + far_others * elapsed / far_t.max(1e-3);
    Ok((frames as f64 / counter_secs, near_cpu, far_cpu))
}

fn config(
    ctx: &Context,
    label: &str,
    e: &Ends<'_>,
    secs: f64,
    out: &mut [(Figure, Figure)],
) -> Result<(), String> {
    for (mi, mode) in MODES.iter().enumerate() {
        let mut twin = Twin::new(label);
        // The other side's CPU beside it: every process is accounted for.
        let mut far = Series::named(&format!("{label}, far end"));
        for size in SIZES {
            ctx.progress
                .set_message(format!("net-raw: {label}, {mode}, {size}-byte frames"));
            let (mut t, mut c, mut f) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..ctx.runs {
                let (fps, cpu, far_cpu) = measure(ctx, e, mode, size, secs)?;
                t.push(fps);
                c.push(cpu);
                f.push(far_cpu);
                ctx.progress.inc(1);
            }
            twin.push(size as f64, &t, &c);
            far.points.push(Point {
                x: size as f64,
                y: Summary::of(&f, WARM_UP),
            });
        }
        out[mi].0.series.push(twin.first);
        out[mi].1.series.push(twin.second);
        out[mi].1.series.push(far);
    }
    Ok(())
}

/// One side's own processes under the machine `up`: `nic`'s model and server (its name or
/// its address on their command lines).
fn nic_processes(up: u32, nic: &str, mac: &str) -> Vec<u32> {
    descendants(up)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let c = String::from_utf8_lossy(&c);
                c.contains(nic) || c.contains(mac)
            })
        })
        .collect()
}

/// Test 12.
pub fn net_raw(ctx: &Context) -> Result<TestResult, String> {
    let secs = if ctx.quick { 0.3 } else { 1.0 };
    let mut figs: Vec<(Figure, Figure)> = MODES
        .iter()
        .map(|m| {
            let what = match *m {
                "rx" => "receive",
                "tx" => "transmit",
                _ => "echo",
            };
            let t = figure(
                &format!("{m}-throughput"),
                &format!("Raw frames, {what}: throughput"),
                "frame size (bytes)",
                "frames per second",
                false,
                "line",
            );
            let c = Figure {
                id: format!("{m}-cpu"),
                title: format!("Raw frames, {what}: CPU busy, measured side (and far end)"),
                y_label: "CPU cores busy".into(),
                ..t.clone()
            };
            (t, c)
        })
        .collect();
    let mut unavailable = Vec::new();
    let id = std::process::id() % 100_000;
    let kernel = VethPair::new(&format!("ob-raw-{id}"), 77).and_then(|v| {
        let e = Ends {
            near: "if:ob-veth-a".into(),
            far: "if:ob-veth-b".into(),
            near_ns: Some(&v.a),
            far_ns: Some(&v.b),
            near_pids: Vec::new(),
            far_pids: Vec::new(),
        };
        config(ctx, "kernel", &e, secs, &mut figs)
    });
    if let Err(reason) = kernel {
        unavailable.push(Unavailable {
            config: "kernel".into(),
            reason,
        });
    }
    for placement in ["colocated", "separate"] {
        let dir =
            std::env::temp_dir().join(format!("outboard-raw-{}-{placement}", std::process::id()));
        let r = lan(&ctx.exe, &dir, placement).and_then(|up| {
            let control = dir.join("control.sock").display().to_string();
            let e = Ends {
                near: format!("nic:{control}:nic0"),
                far: format!("nic:{control}:nic1"),
                near_ns: None,
                far_ns: None,
                near_pids: nic_processes(up.pid, "nic0", "02:00:00:00:00:01"),
                far_pids: nic_processes(up.pid, "nic1", "02:00:00:00:00:02"),
            };
            config(ctx, placement, &e, secs, &mut figs)
        });
        crate::fixture::remove_work_dir(&dir);
        if let Err(reason) = r {
            unavailable.push(Unavailable {
                config: placement.into(),
                reason,
            });
        }
    }
    let xs: Vec<f64> = SIZES.iter().map(|&s| s as f64).collect();
    let mut targets = Vec::new();
    for (m, (t, c)) in MODES.iter().zip(&figs) {
        targets.push(ratio_target(
            &format!("{m}: separate ≥ kernel throughput at every frame size"),
            t.series("separate"),
            t.series("kernel"),
            &xs,
            1.0,
            true,
            |x| format!("{x} B"),
        ));
        targets.push(ratio_target(
            &format!("{m}: separate CPU ≤ kernel's at every frame size"),
            c.series("separate"),
            c.series("kernel"),
            &xs,
            1.0,
            false,
            |x| format!("{x} B"),
        ));
    }
    Ok(TestResult {
        test: "net-raw".into(),
        title: "Raw frames".into(),
        reference: "Chubb, Figs. 6–8 (EVALUATION.md test 12)".into(),
        runs: ctx.runs,
        discarded: WARM_UP,
        params: serde_json::json!({ "frame_sizes": SIZES, "seconds_per_run": secs }),
        figures: figs.into_iter().flat_map(|(t, c)| [t, c]).collect(),
        unavailable,
        targets,
        machine: Machine::here(),
    })
}

/// Progress steps.
pub fn steps(ctx: &Context) -> u64 {
    3 * MODES.len() as u64 * SIZES.len() as u64 * ctx.runs as u64
}
