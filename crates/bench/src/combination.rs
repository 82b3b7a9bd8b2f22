//! Test 5, combination (Fluke thesis §5.2.3): read the first 10 MiB of a disk in 80 KiB
//! blocks and send it as 1280-byte UDP payloads — a disk driver and a NIC driver in one data
//! path. The disk is a virtio-blk model over an image; the NIC sends over a wire to a second
//! NIC where `outboard net echo --discard` counts what arrives (the other host: its CPU is not
//! counted). Placements, as the thesis named them:
//!
//! - `colocated`: both drivers in this process;
//! - `etherapp`: the NIC's driver in this process, the disk's in a server;
//! - `diskether`: both drivers grouped in one server;
//! - `separate`: each driver in a server of its own.

use std::io::{BufRead, BufReader};
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outboard_block::{BlockOp, BlockRequest};
use outboard_block_client::{open_block_with, SessionOptions};
use outboard_net_client::{open_nic, NetOptions, Udp};

use crate::cpu::{descendants, CpuMeter};
use crate::fixture::{machine, Fixture};
use crate::model::{Figure, Machine, TestResult, Unavailable};
use crate::netns::Running;
use crate::stats::Summary;
use crate::tests::{bar, figure, ratio_target, WARM_UP};
use crate::Context;

/// The configurations: name, disk0's placement keys, nic0's.
const CONFIGS: [(&str, &str, &str); 4] = [
    (
        "colocated",
        "placement = \"colocated\"",
        "placement = \"colocated\"",
    ),
    ("etherapp", "server = \"disk\"", "placement = \"colocated\""),
    ("diskether", "server = \"both\"", "server = \"both\""),
    ("separate", "server = \"disk\"", "server = \"ether\""),
];
/// Bytes read per request.
const BLOCK: u64 = 80 << 10;
/// UDP payload bytes per datagram.
const PAYLOAD: usize = 1280;
const PORT: u16 = 9;

fn description(image: &Path, disk: &str, nic: &str) -> String {
    format!(
        "name = \"bench-combination\"\n\n\
         [[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\nbacking = \"{}\"\n{disk}\n\n\
         [[device]]\nname = \"nic0\"\nmodel = \"virtio-net\"\nmac = \"02:00:00:00:00:01\"\nwire = \"cable\"\n{nic}\n\n\
         [[device]]\nname = \"nic1\"\nmodel = \"virtio-net\"\nmac = \"02:00:00:00:00:02\"\nwire = \"cable\"\nserver = \"far\"\n",
        image.display()
    )
}

/// The far end: counts datagrams until a second passes without one; ready once it says so.
fn receiver(exe: &Path, dir: &Path) -> Result<Running, String> {
    let mut c = Command::new(exe)
        .arg("--control")
        .arg(dir.join("control.sock"))
        .args(["net", "echo", "nic1", "--address", "10.74.0.2/24", "--port"])
        .arg(PORT.to_string())
        .args(["--discard", "--idle", "1s"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("net echo: {e}"))?;
    let mut line = String::new();
    let _ = BufReader::new(c.stderr.take().expect("piped")).read_line(&mut line);
    if !line.contains("echoing") {
        let _ = c.kill();
        let _ = c.wait();
        return Err(format!("the receiver did not start: {}", line.trim()));
    }
    Ok(Running(c))
}

/// How many datagrams the receiver counted, once it stopped (bounded).
fn received(r: Running) -> Result<u64, String> {
    let out = r.last_line(Duration::from_secs(20), "the receiver")?;
    out.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("the receiver said {out:?}"))
}

/// One run: `total` bytes from the disk out of the NIC; the seconds it took.
fn transfer(
    disk: &mut dyn outboard_block::BlockDevice,
    udp: &mut Udp,
    total: u64,
) -> Result<f64, String> {
    let bs = u64::from(disk.info().block_size);
    let to = (Ipv4Addr::new(10, 74, 0, 2), PORT);
    let mut payload = vec![0u8; PAYLOAD];
    let mut out = Vec::with_capacity(1);
    let t0 = Instant::now();
    let mut at = 0;
    while at < total {
        let len = BLOCK.min(total - at);
        disk.submit(&BlockRequest {
            op: BlockOp::Read,
            lba: at / bs,
            blocks: (len / bs) as u32,
            buf_offset: 0,
            tag: at,
        })
        .map_err(|e| format!("disk0: {e}"))?;
        disk.kick().map_err(|e| format!("disk0: {e}"))?;
        out.clear();
        while out.is_empty() {
            disk.wait(&mut out, Duration::from_secs(10))
                .map_err(|e| format!("disk0: {e}"))?;
        }
        out[0].result.clone().map_err(|e| format!("disk0: {e}"))?;
        let mut off = 0;
        while off < len {
            let n = (PAYLOAD as u64).min(len - off) as usize;
            disk.buffers()
                .read(off, &mut payload[..n])
                .map_err(|e| e.to_string())?;
            udp.send_to(&payload[..n], to)
                .map_err(|e| format!("nic0: {e}"))?;
            off += n as u64;
        }
        at += len;
    }
    udp.flush().map_err(|e| format!("nic0: {e}"))?;
    Ok(t0.elapsed().as_secs_f64())
}

struct Measured {
    bandwidth: Summary,
    cpu: Summary,
    /// The receiving side's: the far NIC's model and server, and the receiver.
    cpu_far: Summary,
    delivered: Summary,
}

fn config(
    ctx: &Context,
    fx: &Fixture,
    name: &str,
    disk: &str,
    nic: &str,
    total: u64,
) -> Result<Measured, String> {
    let dir = fx.dir.join(name);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let up = machine(&ctx.exe, &dir, &description(&fx.image, disk, nic), &[])?;
    let control = dir.join("control.sock");
    let (mut d, _) = open_block_with(&control, "disk0", SessionOptions::default())
        .map_err(|e| format!("disk0: {e}"))?;
    let (port, _) =
        open_nic(&control, "nic0", NetOptions::default()).map_err(|e| format!("nic0: {e}"))?;
    let mut udp =
        Udp::bind(port, Ipv4Addr::new(10, 74, 0, 1), 24, 5000).map_err(|e| format!("nic0: {e}"))?;
    // The sending side: this process and every process but the far NIC's server and model.
    let far = |pid: &u32| {
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|c| {
                let c = String::from_utf8_lossy(&c);
                c.contains("far") || c.contains("02:00:00:00:00:02")
            })
            .unwrap_or(true)
    };
    let (far_pids, mut pids): (Vec<u32>, Vec<u32>) = descendants(up.pid).into_iter().partition(far);
    pids.extend([up.pid, std::process::id()]);
    let datagrams = total.div_ceil(PAYLOAD as u64);
    let (mut bw, mut cpu, mut cpu_far, mut delivered) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ctx.runs {
        let r = receiver(&ctx.exe, &dir)?;
        let meter = CpuMeter::start(&pids);
        let far_meter = CpuMeter::start(&[far_pids.as_slice(), &[r.0.id()]].concat());
        let secs = transfer(d.as_mut(), &mut udp, total)?;
        cpu.push(meter.stop().processes);
        cpu_far.push(far_meter.stop().processes);
        bw.push(total as f64 / secs / 1e6);
        delivered.push(100.0 * received(r)? as f64 / datagrams as f64);
        ctx.progress.inc(1);
    }
    Ok(Measured {
        bandwidth: Summary::of(&bw, WARM_UP),
        cpu: Summary::of(&cpu, WARM_UP),
        cpu_far: Summary::of(&cpu_far, WARM_UP),
        delivered: Summary::of(&delivered, WARM_UP),
    })
}

/// Test 5.
pub fn combination(ctx: &Context) -> Result<TestResult, String> {
    let total = ctx.size.unwrap_or(10 << 20);
    ctx.progress.set_message("combination: preparing the image");
    let fx = Fixture::new(&ctx.exe, total)?;
    let mut bw = figure(
        "bandwidth",
        "Combination: disk → UDP bandwidth",
        "",
        "MB/s",
        false,
        "bar",
    );
    let mut cpu = Figure {
        id: "cpu".into(),
        title: "Combination: CPU busy, sending side".into(),
        y_label: "CPU cores busy".into(),
        ..bw.clone()
    };
    let mut cpu_far = Figure {
        id: "cpu-far".into(),
        title: "Combination: CPU busy, receiving side (far NIC, receiver)".into(),
        y_label: "CPU cores busy".into(),
        ..bw.clone()
    };
    let mut delivered = Figure {
        id: "delivered".into(),
        title: "Combination: datagrams that reached the far NIC".into(),
        y_label: "%".into(),
        ..bw.clone()
    };
    let mut unavailable = Vec::new();
    for (name, disk, nic) in CONFIGS {
        ctx.progress.set_message(format!("combination: {name}"));
        match config(ctx, &fx, name, disk, nic, total) {
            Ok(m) => {
                bw.series.push(bar(name, m.bandwidth));
                cpu.series.push(bar(name, m.cpu));
                cpu_far.series.push(bar(name, m.cpu_far));
                delivered.series.push(bar(name, m.delivered));
            }
            Err(reason) => unavailable.push(Unavailable {
                config: name.into(),
                reason,
            }),
        }
    }
    let targets = vec![ratio_target(
        "separate ≥ 90% of colocated bandwidth",
        bw.series("separate"),
        bw.series("colocated"),
        &[0.0],
        0.9,
        true,
        |_| "10 MiB".into(),
    )];
    Ok(TestResult {
        test: "combination".into(),
        title: "Combination".into(),
        reference: "Fluke thesis §5.2.3, Figs 5.5–5.6".into(),
        runs: ctx.runs,
        discarded: WARM_UP,
        params: serde_json::json!({
            "bytes": total,
            "read_size": BLOCK,
            "udp_payload": PAYLOAD,
        }),
        figures: vec![bw, cpu, cpu_far, delivered],
        unavailable,
        targets,
        machine: Machine::here(),
    })
}

/// Progress steps.
pub fn steps(ctx: &Context) -> u64 {
    CONFIGS.len() as u64 * ctx.runs as u64
}
