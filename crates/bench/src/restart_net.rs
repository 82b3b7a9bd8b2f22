//! Evaluation test 8 for the network class: a stream of numbered frames from nic0 to nic1 (two
//! NIC models joined by a wire, each NIC's driver in its own server) while one of the two
//! driver servers is SIGKILLed every N ms, measured from the moment the previous restart
//! serves again.
//!
//! It holds the net class to its restart guarantee (`docs/restart.md`): a frame is sent at
//! most once, so none arrives twice; what arrives is in order and whole; a frame the dead
//! sender's server had taken completes as `interrupted` (it may have gone out); with the
//! sender's server killed, every other frame arrives. Frames that reach a NIC while no driver
//! runs are lost, as on a NIC being reset: with the receiver's server killed they are counted,
//! not failed. The outage of a kill is the longest gap between two frames arriving around it.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_net::NetError;
use outboard_net_client::{open_nic, NetOptions};

use crate::model::{Figure, Point, Series, Target};
use crate::restart::{percentile, pids_of};
use crate::stats::Summary;
use crate::Context;

/// Two NICs on one wire, under the default restart policy.
const MACHINE: &str = r#"name = "restart-net-bench"
[[device]]
name = "nic0"
model = "virtio-net"
mac = "02:00:00:00:00:01"
wire = "cable"

[[device]]
name = "nic1"
model = "virtio-net"
mac = "02:00:00:00:00:02"
wire = "cable"
"#;

/// The frames' length (a small frame: the most frames per second, the most at stake).
const FRAME: usize = 128;
/// An EtherType of the IEEE's range for local experiments.
const ETHERTYPE: u16 = 0x88b5;
/// Frames sent between two pauses of [`PAUSE`]: at most 8,000 frames a second (about 7,000
/// measured); the run without kills reports what went missing even so (`baseline_missing`).
const BURST: u64 = 16;
const PAUSE: Duration = Duration::from_millis(2);

/// Frame `seq`: to nic1 from nic0, its number, then bytes that follow from it (a frame cut,
/// padded or mixed with another is caught).
fn frame(seq: u64) -> Vec<u8> {
    let mut f = vec![0u8; FRAME];
    f[..6].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
    f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
    f[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
    f[14..22].copy_from_slice(&seq.to_be_bytes());
    for (i, b) in f[22..].iter_mut().enumerate() {
        *b = (seq.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8;
    }
    f
}

/// Which NIC's driver server is killed.
#[derive(Debug, Clone, Copy)]
enum Victim {
    Sender,
    Receiver,
}

impl Victim {
    fn nic(self) -> &'static str {
        match self {
            Victim::Sender => "nic0",
            Victim::Receiver => "nic1",
        }
    }
    fn label(self) -> &'static str {
        match self {
            Victim::Sender => "net: sender's driver server killed",
            Victim::Receiver => "net: receiver's driver server killed",
        }
    }
}

/// What one run came to.
struct Outcome {
    sent: u64,
    /// Frames that completed as `interrupted` (taken by a server that died; maybe sent).
    interrupted: u64,
    /// Sequence numbers as they arrived, each with when.
    arrived: Vec<(u64, Instant)>,
    damaged: u64,
    kills: Vec<Instant>,
    secs: f64,
}

impl Outcome {
    /// Frames that arrived again after a later one, or twice.
    fn out_of_order(&self) -> usize {
        self.arrived.windows(2).filter(|w| w[1].0 <= w[0].0).count()
    }

    /// Frames sent that never arrived (each sent frame counted once, whatever arrived twice).
    fn missing(&self) -> u64 {
        let mut seen: Vec<u64> = self
            .arrived
            .iter()
            .map(|a| a.0)
            .filter(|&s| s < self.sent)
            .collect();
        seen.sort_unstable();
        seen.dedup();
        self.sent - seen.len() as u64
    }

    /// Per kill, the longest gap (ms) between two arrivals from the last one before it to the
    /// first one at or after the next kill (or the last one): a kill after which nothing
    /// arrived until the next one counts its whole silence.
    fn outages(&self) -> Vec<f64> {
        let times: Vec<Instant> = self.arrived.iter().map(|a| a.1).collect();
        let mut out = Vec::new();
        for (i, &k) in self.kills.iter().enumerate() {
            let next = self.kills.get(i + 1).copied();
            let from = times.partition_point(|&t| t < k).saturating_sub(1);
            let to = next.map_or(times.len(), |n| times.partition_point(|&t| t < n) + 1);
            let span = &times[from.min(times.len())..to.min(times.len())];
            if span.len() >= 2 {
                let gap = span
                    .windows(2)
                    .map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1e3)
                    .fold(0.0, f64::max);
                out.push(gap);
            }
        }
        out
    }
}

/// Streams frames for `secs`, killing `victim`'s driver server every `every` (none: a
/// baseline). The receiver's session is open before the first frame is sent.
fn run(
    control: &Path,
    up_pid: u32,
    secs: f64,
    kill: Option<(Victim, Duration)>,
) -> Result<Outcome, String> {
    let (mut rx, _) =
        open_nic(control, "nic1", NetOptions::default()).map_err(|e| format!("nic1: {e}"))?;
    let done = Arc::new(AtomicBool::new(false));
    let receiver = {
        let done = done.clone();
        std::thread::spawn(move || -> Result<(Vec<(u64, Instant)>, u64), String> {
            let (mut arrived, mut damaged) = (Vec::new(), 0u64);
            let mut buf = [0u8; 2048];
            loop {
                match rx.recv_into(&mut buf, Duration::from_millis(200)) {
                    Ok(Some(n)) if n >= 22 && buf[12..14] == ETHERTYPE.to_be_bytes() => {
                        let seq = u64::from_be_bytes(buf[14..22].try_into().expect("8 bytes"));
                        if buf[..n] != frame(seq)[..] {
                            damaged += 1;
                        }
                        arrived.push((seq, Instant::now()));
                    }
                    // Another EtherType: not ours (nothing else runs on this wire).
                    Ok(Some(_)) => damaged += 1,
                    Ok(None) if done.load(Ordering::Relaxed) => break,
                    Ok(None) => {}
                    Err(e) => return Err(format!("nic1 receive: {e}")),
                }
            }
            Ok((arrived, damaged))
        })
    };
    let (mut tx, _) = match open_nic(control, "nic0", NetOptions::default()) {
        Ok(t) => t,
        Err(e) => {
            // The receiver stops at its next quiet 200 ms.
            done.store(true, Ordering::Relaxed);
            let _ = receiver.join();
            return Err(format!("nic0: {e}"));
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let sender = {
        let stop = stop.clone();
        std::thread::spawn(move || -> Result<(u64, u64), String> {
            let (mut sent, mut interrupted) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let f = frame(sent);
                loop {
                    match tx.send(&f) {
                        Ok(()) => break,
                        // An earlier frame the dead server had taken: it may have gone out.
                        Err(NetError::Interrupted) => interrupted += 1,
                        Err(e) => return Err(format!("frame {sent}: {e}")),
                    }
                }
                sent += 1;
                if sent % BURST == 0 {
                    std::thread::sleep(PAUSE);
                }
            }
            let flushed = Instant::now() + Duration::from_secs(30);
            loop {
                match tx.flush() {
                    Ok(()) => break,
                    Err(NetError::Interrupted) if Instant::now() < flushed => interrupted += 1,
                    Err(e) => return Err(format!("flush: {e}")),
                }
            }
            Ok((sent, interrupted))
        })
    };
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(secs);
    let mut kills = Vec::new();
    let mut failure = None;
    while Instant::now() < until {
        let Some((victim, every)) = kill else {
            std::thread::sleep(until - Instant::now());
            break;
        };
        std::thread::sleep(every);
        if let Err(e) = kill_and_wait(control, up_pid, victim, &mut kills) {
            failure = Some(e);
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let secs = started.elapsed().as_secs_f64();
    let sent = sender.join().map_err(|_| "the sender panicked")?;
    // Frames in flight arrive within a moment; the receiver stops after 200 ms of quiet.
    std::thread::sleep(Duration::from_millis(500));
    done.store(true, Ordering::Relaxed);
    let received = receiver.join().map_err(|_| "the receiver panicked")?;
    if let Some(e) = failure {
        return Err(e);
    }
    let ((sent, interrupted), (arrived, damaged)) = (sent?, received?);
    Ok(Outcome {
        sent,
        interrupted,
        arrived,
        damaged,
        kills,
        secs,
    })
}

/// Kills `victim`'s driver server (a child of the machine, checked through a pidfd) and waits
/// until another serves its NIC.
fn kill_and_wait(
    control: &Path,
    up_pid: u32,
    victim: Victim,
    kills: &mut Vec<Instant>,
) -> Result<(), String> {
    let nic = victim.nic();
    let pid = pids_of(control, nic)
        .ok_or_else(|| format!("no driver server for {nic}"))?
        .server;
    kills.push(Instant::now());
    crate::fixture::signal_child_of(up_pid, pid, &[rustix::process::Signal::KILL])?;
    let back = Instant::now() + Duration::from_secs(30);
    loop {
        match pids_of(control, nic) {
            Some(p) if p.serving && p.server != pid => return Ok(()),
            _ if Instant::now() > back => return Err(format!("{nic}'s driver did not come back")),
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// The NIC part of the restart test: figures, table rows and targets.
pub struct NetRestart {
    /// The outage per kill and the share of frames that arrived, per interval.
    pub figures: Vec<Figure>,
    /// One row per victim and interval.
    pub rows: Vec<serde_json::Value>,
    /// The guarantee, judged.
    pub targets: Vec<Target>,
}

fn one(v: f64) -> Summary {
    Summary {
        median: v,
        min: v,
        max: v,
        samples: vec![v],
    }
}

/// Runs each victim at each interval, after a baseline without kills.
pub fn net_restart(ctx: &Context) -> Result<NetRestart, String> {
    let intervals: &[u64] = if ctx.quick { &[100] } else { &[30, 100, 300] };
    let secs = if ctx.quick { 2.0 } else { 4.0 };
    let mut outage = Figure {
        id: "net-outage".into(),
        title: "NIC driver server killed: longest gap in the frame stream per kill (ms)".into(),
        x_label: "kill interval (ms)".into(),
        y_label: "ms".into(),
        log_x: true,
        log_y: false,
        kind: "line".into(),
        references: Vec::new(),
        series: Vec::new(),
    };
    let mut delivered = Figure {
        id: "net-delivered".into(),
        title: "NIC driver server killed: frames that arrived, of those sent (%)".into(),
        y_label: "% arrived".into(),
        ..outage.clone()
    };
    let mut rows = Vec::new();
    let (mut twice, mut damaged, mut sender_short) = (0usize, 0u64, 0u64);
    for victim in [Victim::Sender, Victim::Receiver] {
        let dir = std::env::temp_dir().join(format!(
            "outboard-bench-restart-net-{}-{victim:?}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let up = crate::fixture::machine(&ctx.exe, &dir, MACHINE, &[])?;
        let control = dir.join("control.sock");
        ctx.progress
            .set_message(format!("restart: {}, baseline", victim.label()));
        let base = run(&control, up.pid, secs, None)?;
        ctx.progress.inc(1);
        let (mut med, mut worst, mut share) = (Vec::new(), Vec::new(), Vec::new());
        for &n in intervals {
            ctx.progress
                .set_message(format!("restart: {}, every {n} ms", victim.label()));
            let o = run(
                &control,
                up.pid,
                secs,
                Some((victim, Duration::from_millis(n))),
            )?;
            ctx.progress.inc(1);
            let gaps = o.outages();
            let arrived = o.arrived.len() as f64 / o.sent.max(1) as f64 * 100.0;
            med.push(Point {
                x: n as f64,
                y: one(percentile(&gaps, 0.5)),
            });
            worst.push(Point {
                x: n as f64,
                y: one(percentile(&gaps, 1.0)),
            });
            share.push(Point {
                x: n as f64,
                y: one(arrived),
            });
            twice += o.out_of_order();
            damaged += o.damaged;
            // With the sender's server killed, only interrupted frames may be missing.
            if matches!(victim, Victim::Sender) {
                sender_short += o.missing().saturating_sub(o.interrupted);
            }
            rows.push(serde_json::json!({
                "victim": victim.label(),
                "interval_ms": n,
                "kills": o.kills.len(),
                "sent": o.sent,
                "arrived": o.arrived.len(),
                "interrupted": o.interrupted,
                "missing": o.missing(),
                "out_of_order_or_twice": o.out_of_order(),
                "damaged": o.damaged,
                "outage_median_ms": percentile(&gaps, 0.5),
                "outage_p99_ms": percentile(&gaps, 0.99),
                "outage_max_ms": percentile(&gaps, 1.0),
                "frames_per_s": o.arrived.len() as f64 / o.secs,
                "baseline_frames_per_s": base.arrived.len() as f64 / base.secs,
                "baseline_missing": base.missing(),
            }));
        }
        drop(up);
        crate::fixture::remove_work_dir(&dir);
        let who = victim.label();
        outage.series.push(Series {
            label: format!("{who}, median"),
            points: med,
        });
        outage.series.push(Series {
            label: format!("{who}, max"),
            points: worst,
        });
        delivered.series.push(Series {
            label: who.into(),
            points: share,
        });
    }
    let targets = vec![
        Target {
            target: "restart (net): no frame twice, none out of order, none damaged".into(),
            measured: format!("{twice} out of order or twice, {damaged} damaged"),
            met: Some(twice == 0 && damaged == 0),
        },
        Target {
            target: "restart (net): with the sender's server killed, no more frames missing \
                     than completed as interrupted"
                .into(),
            measured: format!("{sender_short} missing beyond those interrupted"),
            met: Some(sender_short == 0),
        },
    ];
    Ok(NetRestart {
        figures: vec![outage, delivered],
        rows,
        targets,
    })
}

/// Progress steps.
pub fn steps(ctx: &Context) -> u64 {
    2 * (1 + if ctx.quick { 1 } else { 3 })
}
