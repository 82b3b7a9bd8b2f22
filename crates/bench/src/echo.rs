//! Test 4, echo (Fluke thesis §5.2.2): UDP round trips of 64…1472-byte payloads between two
//! hosts. Here the hosts are two NICs on one wire (two virtio-net models joined by a socket
//! pair) or, for the kernel, two network namespaces joined by a veth pair:
//!
//! - `kernel`: `sockperf ping-pong` over the veth pair;
//! - `colocated`: this process with `smoltcp` and nic0's driver in it, `outboard net echo` on
//!   nic1 with its driver in it too (Fluke "D" on both hosts);
//! - `separate`: the same programs, each NIC's driver in a driver server (Fluke "C");
//! - `tap`: `sockperf` over the host's stack, through the two Outboard NICs exported as TAP
//!   interfaces into two namespaces.
//!
//! Beside it, `iperf3` (TCP) through the host's stack over the veth pair and over the TAP
//! exports: how much bulk traffic the user-level path carries.
//!
//! Each run is `n` round trips of one size; its figure is their median (a shared machine's
//! scheduler adds a long tail that a mean would let decide).

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outboard_net_client::{open_nic, NetOptions, Udp};

use crate::cpu::{descendants, reaped_children_secs, CpuMeter};
use crate::fixture::{machine, Proc};
use crate::model::{Figure, Machine, Target, TestResult, Twin, Unavailable};
use crate::netns::{interface_exists, output_within, Netns, Running, VethPair};
use crate::placement::{Pinned, Placement};
use crate::stats::{median, Summary};
use crate::tests::{bar, figure, ratio_target, WARM_UP};
use crate::{pingpong, Context};

/// Payload sizes (the thesis's 64…1472, the largest that fits a 1500-byte MTU).
pub const SIZES: [usize; 6] = [64, 128, 256, 512, 1024, 1472];
const PORT: u16 = 7;

/// Two NICs on one wire under a manager, both placed `placement`.
pub fn lan(exe: &Path, dir: &Path, placement: &str) -> Result<Proc, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let nic = |n: u8| {
        format!(
            "[[device]]\nname = \"nic{n}\"\nmodel = \"virtio-net\"\nmac = \"02:00:00:00:00:0{}\"\nwire = \"cable\"\nplacement = \"{placement}\"\n",
            n + 1
        )
    };
    machine(
        exe,
        dir,
        &format!("name = \"bench-lan\"\n\n{}\n{}", nic(0), nic(1)),
        &[],
    )
}

/// `outboard net echo nic1 --address ADDR EXTRA…` under the machine at `dir`; what it says
/// goes to `dir/echo-peer.log` ([`peer_said`]).
pub fn echo_peer(exe: &Path, dir: &Path, addr: &str, extra: &[&str]) -> Result<Running, String> {
    let log = std::fs::File::create(dir.join("echo-peer.log")).map_err(|e| e.to_string())?;
    Command::new(exe)
        .arg("--control")
        .arg(dir.join("control.sock"))
        .args(["net", "echo", "nic1", "--address", addr])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map(Running)
        .map_err(|e| format!("net echo: {e}"))
}

/// What the echo peer under `dir` said, for an error.
pub fn peer_said(dir: &Path) -> String {
    let text = std::fs::read_to_string(dir.join("echo-peer.log")).unwrap_or_default();
    format!("the echo peer said {:?}", text.trim())
}

/// A datagram of `size` bytes carrying `seq` first.
fn datagram(size: usize, seq: u64) -> Vec<u8> {
    let mut d: Vec<u8> = (0..size).map(|i| (i as u64 ^ seq) as u8).collect();
    d[..8].copy_from_slice(&seq.to_le_bytes());
    d
}

/// Round trips (µs) of `n` datagrams of `size` bytes to `to`, each checked; an echo that
/// does not come within a second is counted lost and the next one sent (a late one is told
/// apart by its sequence number).
pub fn udp_rtts(
    udp: &mut Udp,
    to: (Ipv4Addr, u16),
    size: usize,
    n: usize,
    seq: &mut u64,
) -> Result<(Vec<f64>, u64), String> {
    let mut rtts = Vec::with_capacity(n);
    let mut lost = 0;
    let mut buf = vec![0u8; 2048];
    for _ in 0..n {
        *seq += 1;
        let d = datagram(size, *seq);
        let t0 = Instant::now();
        udp.send_to(&d, to).map_err(|e| format!("send: {e}"))?;
        loop {
            let left = Duration::from_secs(1).saturating_sub(t0.elapsed());
            match udp
                .recv_from(&mut buf, left)
                .map_err(|e| format!("receive: {e}"))?
            {
                None => {
                    lost += 1;
                    break;
                }
                Some((got, _)) if buf[..got] == d[..] => {
                    rtts.push(t0.elapsed().as_secs_f64() * 1e6);
                    break;
                }
                Some((got, _)) if got >= 8 && buf[..8] != d[..8] => continue, // a late echo
                Some(_) => {
                    return Err(format!(
                        "datagram {seq} of {size} bytes came back different"
                    ))
                }
            }
        }
    }
    Ok((rtts, lost))
}

/// Sends until the first echo comes back (ARP, the peer starting), for up to 20 s.
fn first_echo(udp: &mut Udp, to: (Ipv4Addr, u16), seq: &mut u64) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = vec![0u8; 2048];
    while Instant::now() < deadline {
        *seq += 1;
        udp.send_to(&datagram(64, *seq), to)
            .map_err(|e| format!("send: {e}"))?;
        if let Some((n, _)) = udp
            .recv_from(&mut buf, Duration::from_millis(200))
            .map_err(|e| format!("receive: {e}"))?
        {
            if n == 64 && buf[..8] == seq.to_le_bytes() {
                return Ok(());
            }
        }
    }
    Err("the echo peer never answered".into())
}

/// `colocated` or `separate`: this process against `outboard net echo`.
fn outboard_config(ctx: &Context, placement: &str, n: usize) -> Result<Twin, String> {
    let dir =
        std::env::temp_dir().join(format!("outboard-echo-{}-{placement}", std::process::id()));
    let up = lan(&ctx.exe, &dir, placement)?;
    let _peer = echo_peer(&ctx.exe, &dir, "10.71.0.2/24", &[])?;
    let (port, _) = open_nic(&dir.join("control.sock"), "nic0", NetOptions::default())
        .map_err(|e| format!("nic0: {e}"))?;
    let mut udp =
        Udp::bind(port, Ipv4Addr::new(10, 71, 0, 1), 24, 4000).map_err(|e| format!("nic0: {e}"))?;
    let to = (Ipv4Addr::new(10, 71, 0, 2), PORT);
    let mut seq = 0;
    first_echo(&mut udp, to, &mut seq).map_err(|e| format!("{e}; {}", peer_said(&dir)))?;
    let mut pids = descendants(up.pid);
    pids.extend([up.pid, std::process::id()]);
    let mut m = Twin::new(placement);
    for size in SIZES {
        ctx.progress
            .set_message(format!("echo: {placement}, {size}-byte payloads"));
        let (mut lat, mut cpu) = (Vec::new(), Vec::new());
        for _ in 0..ctx.runs {
            let meter = CpuMeter::start(&pids);
            let (mut rtts, _lost) = udp_rtts(&mut udp, to, size, n, &mut seq)?;
            cpu.push(meter.stop().processes);
            lat.push(if rtts.is_empty() {
                f64::NAN
            } else {
                median(&mut rtts)
            });
            ctx.progress.inc(1);
        }
        m.push(size as f64, &lat, &cpu);
    }
    drop(udp);
    drop(up);
    crate::fixture::remove_work_dir(&dir);
    Ok(m)
}

/// The median round trip (µs) sockperf printed.
fn sockperf_median(out: &str) -> Option<f64> {
    out.lines()
        .find(|l| l.contains("percentile 50.000"))?
        .rsplit('=')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// `sockperf ping-pong` from `client` to a server at `server_ip` in `server`, for every size.
fn sockperf_config(
    ctx: &Context,
    label: &str,
    client: &Netns,
    server: &Netns,
    server_ip: &str,
    extra_pids: &[u32],
) -> Result<Twin, String> {
    let sockperf = Path::new("sockperf");
    let srv = server.serve_quietly("sockperf", &["server", "-i", server_ip, "-p", "11111"])?;
    let mut m = Twin::new(label);
    let secs = "1";
    for size in SIZES {
        ctx.progress
            .set_message(format!("echo: {label}, {size}-byte payloads"));
        let (mut lat, mut cpu) = (Vec::new(), Vec::new());
        let mut run = 0;
        let mut tries = 0;
        while run < ctx.runs {
            let mut pids = descendants(srv.0.id());
            pids.push(srv.0.id());
            pids.extend_from_slice(extra_pids);
            let mut cmd = client.command(sockperf);
            cmd.args([
                "ping-pong",
                "-i",
                server_ip,
                "-p",
                "11111",
                "-t",
                secs,
                "--full-rtt",
            ])
            .args(["-m", &size.to_string()]);
            let meter = CpuMeter::start(&pids);
            let before = reaped_children_secs();
            let t0 = Instant::now();
            let out = output_within(&mut cmd, Duration::from_secs(20))?;
            let client = (reaped_children_secs() - before) / t0.elapsed().as_secs_f64();
            let busy = meter.stop().processes + client;
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            let Some(median) = sockperf_median(&text) else {
                // The server may still be starting: a few tries, then the output is the error.
                tries += 1;
                if tries > 10 {
                    return Err(format!("sockperf ping-pong: {}", text.trim()));
                }
                std::thread::sleep(Duration::from_millis(200));
                continue;
            };
            lat.push(median);
            cpu.push(busy);
            run += 1;
            ctx.progress.inc(1);
        }
        m.push(size as f64, &lat, &cpu);
    }
    Ok(m)
}

/// TCP throughput (Mbit/s, one sample a run) from `client` to an `iperf3` server at
/// `server_ip` in `server`: how much the host's stack gets through a link.
fn iperf3(
    ctx: &Context,
    client: &Netns,
    server: &Netns,
    server_ip: &str,
) -> Result<Summary, String> {
    let iperf3 = Path::new("iperf3");
    let _srv = server.serve_quietly("iperf3", &["-s", "-B", server_ip, "-p", "5211"])?;
    let secs = if ctx.quick { "1" } else { "3" };
    let (mut samples, mut tries) = (Vec::new(), 0);
    while samples.len() < ctx.runs {
        ctx.progress
            .set_message(format!("echo: iperf3 to {server_ip}"));
        let mut cmd = client.command(iperf3);
        cmd.args(["-c", server_ip, "-p", "5211", "-t", secs, "-J"]);
        let out = output_within(&mut cmd, Duration::from_secs(30))?;
        let bps = serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .ok()
            .and_then(|j| j["end"]["sum_received"]["bits_per_second"].as_f64());
        match bps {
            Some(b) => samples.push(b / 1e6),
            // The server may still be starting: a few tries, then the output is the error.
            None if tries < 10 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
            None => {
                return Err(format!(
                    "iperf3 -c {server_ip}: {}",
                    String::from_utf8_lossy(&out.stdout).trim()
                ))
            }
        }
    }
    Ok(Summary::of(&samples, WARM_UP))
}

/// `tap`: two Outboard NICs (drivers in servers) exported as TAP interfaces into two
/// namespaces, sockperf between them (and iperf3, for TCP throughput).
fn tap_config(ctx: &Context) -> Result<(Twin, Result<Summary, String>), String> {
    let id = std::process::id() % 100_000;
    let dir = std::env::temp_dir().join(format!("outboard-echo-{}-tap", std::process::id()));
    let up = lan(&ctx.exe, &dir, "separate")?;
    let a = Netns::new(format!("ob-echo-tap-a-{id}"))?;
    let b = Netns::new(format!("ob-echo-tap-b-{id}"))?;
    let mut exports = Vec::new();
    for (nic, ns, cidr) in [("nic0", &a, "10.72.0.1/24"), ("nic1", &b, "10.72.0.2/24")] {
        let ifname = format!("obt{id}{}", &nic[3..]);
        exports.push(Running(
            Command::new(&ctx.exe)
                .arg("--control")
                .arg(dir.join("control.sock"))
                // Each export is its NIC's only receiver: frames are written in place.
                .args(["export", "tap", nic, "--name", &ifname, "--own"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("export tap: {e}"))?,
        ));
        if !outboard_sys::wait::eventually(Duration::from_secs(20), || interface_exists(&ifname)) {
            return Err(format!("export tap {nic} never made {ifname}"));
        }
        ns.adopt(&ifname, cidr)?;
    }
    let mut pids = descendants(up.pid);
    pids.push(up.pid);
    pids.extend(exports.iter().map(|e| e.0.id()));
    let m = sockperf_config(ctx, "tap", &a, &b, "10.72.0.2", &pids)
        .map(|m| (m, iperf3(ctx, &a, &b, "10.72.0.2")));
    drop(exports);
    drop((a, b, up));
    crate::fixture::remove_work_dir(&dir);
    m
}

/// Test 4.
pub fn echo(ctx: &Context) -> Result<TestResult, String> {
    let n = if ctx.quick { 1_000 } else { 10_000 };
    let mut lat = figure(
        "latency",
        "Echo: UDP round trip (median)",
        "payload (bytes)",
        "µs",
        false,
        "line",
    );
    let mut cpu = figure(
        "cpu",
        "Echo: CPU busy, processes involved",
        "payload (bytes)",
        "CPU cores busy",
        false,
        "line",
    );
    let mut tcp = figure(
        "tcp",
        "TCP (iperf3): veth pair vs two Outboard NICs as TAP",
        "",
        "Mbit/s",
        false,
        "bar",
    );
    let mut unavailable = Vec::new();
    let mut add = |config: &str, r: Result<(Twin, Option<Result<Summary, String>>), String>| match r
    {
        Ok((m, t)) => {
            lat.series.push(m.first);
            cpu.series.push(m.second);
            match t {
                Some(Ok(y)) => tcp.series.push(bar(config, y)),
                Some(Err(reason)) => unavailable.push(Unavailable {
                    config: format!("{config} (iperf3)"),
                    reason,
                }),
                None => {}
            }
        }
        Err(reason) => unavailable.push(Unavailable {
            config: config.into(),
            reason,
        }),
    };
    let id = std::process::id() % 100_000;
    let kernel = VethPair::new(&format!("ob-echo-{id}"), 70).and_then(|v| {
        let m = sockperf_config(ctx, "kernel", &v.a, &v.b, "10.70.0.2", &[])?;
        Ok((m, Some(iperf3(ctx, &v.a, &v.b, "10.70.0.2"))))
    });
    add("kernel", kernel);
    add(
        "colocated",
        outboard_config(ctx, "colocated", n).map(|m| (m, None)),
    );
    add(
        "separate",
        outboard_config(ctx, "separate", n).map(|m| (m, None)),
    );
    add("tap", tap_config(ctx).map(|(m, t)| (m, Some(t))));
    // The floor a driver server adds at most: one eventfd round trip, here, now.
    let eventfd = match Pinned::new(Placement::TwoCores)? {
        Some(pin) => Some(median(&mut pingpong::eventfd(&ctx.exe, 10_000, &pin)?)),
        None => None,
    };
    let xs: Vec<f64> = SIZES.iter().map(|&s| s as f64).collect();
    let mut targets = vec![ratio_target(
        "colocated ≤ kernel veth (round trip)",
        lat.series("colocated"),
        lat.series("kernel"),
        &xs,
        1.0,
        false,
        |x| format!("{x} B"),
    )];
    targets.push(separate_vs_colocated(&lat, eventfd, &xs));
    Ok(TestResult {
        test: "echo".into(),
        title: "Echo".into(),
        reference: "Fluke thesis §5.2.2, Figs 5.3–5.4".into(),
        runs: ctx.runs,
        discarded: WARM_UP,
        params: serde_json::json!({
            "payload_sizes": SIZES,
            "round_trips_per_run": n,
            "sockperf_seconds_per_run": 1,
            "iperf3_seconds_per_run": if ctx.quick { 1 } else { 3 },
            "eventfd_round_trip_us": eventfd,
        }),
        figures: vec![lat, cpu, tcp],
        unavailable,
        targets,
        machine: Machine::here(),
    })
}

/// "separate ≤ colocated + one eventfd round trip", at the worst size.
fn separate_vs_colocated(lat: &Figure, eventfd: Option<f64>, xs: &[f64]) -> Target {
    let target = "separate ≤ colocated + one eventfd round trip".to_string();
    let (Some(sep), Some(col), Some(floor)) =
        (lat.series("separate"), lat.series("colocated"), eventfd)
    else {
        return Target {
            target,
            measured: "a configuration was unavailable".into(),
            met: None,
        };
    };
    let worst = xs
        .iter()
        .filter_map(|&x| Some((x, sep.at(x)? - col.at(x)?)))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    match worst {
        Some((x, extra)) => Target {
            target,
            measured: format!(
                "separate adds at most {extra:.1} µs (at {x} B); one eventfd round trip {floor:.1} µs"
            ),
            met: Some(extra <= floor),
        },
        None => Target {
            target,
            measured: "no size measured in both".into(),
            met: None,
        },
    }
}

/// Progress steps.
pub fn steps(ctx: &Context) -> u64 {
    4 * SIZES.len() as u64 * ctx.runs as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_median_sockperf_prints() {
        let out = "sockperf: ---> percentile 75.000 =  328.421\nsockperf: ---> percentile 50.000 =  114.783\nsockperf: ---> percentile 25.000 =   23.072\n";
        assert_eq!(sockperf_median(out), Some(114.783));
        assert_eq!(sockperf_median("sockperf: ERROR: connection refused"), None);
    }

    #[test]
    fn a_datagram_carries_its_sequence_number_first() {
        let d = datagram(64, 0x0102_0304_0506_0708);
        assert_eq!(d.len(), 64);
        assert_eq!(d[..8], 0x0102_0304_0506_0708u64.to_le_bytes());
        assert_ne!(datagram(64, 1), datagram(64, 2));
    }
}
