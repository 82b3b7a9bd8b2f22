//! Test 9: Outboard's NBD export against its peers — `nbdkit memory` and
//! `qemu-storage-daemon` — on the same RAM-backed disk, with the same clients: `nbdcopy`
//! throughput in and out, and fio's `nbd` engine at 4 KiB random reads and writes, QD1 and QD32.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::fixture::{spawn_foreign, Proc};
use crate::model::{Figure, Machine, Point, Series, Target, TestResult, Unavailable};
use crate::stats::Summary;
use crate::Context;

/// The NBD servers compared.
const SERVERS: [&str; 3] = ["Outboard", "nbdkit memory", "qemu-storage-daemon"];

/// fio cells: (label, rw, queue depth).
const CELLS: [(&str, &str, usize); 4] = [
    ("read QD1", "randread", 1),
    ("read QD32", "randread", 32),
    ("write QD1", "randwrite", 1),
    ("write QD32", "randwrite", 32),
];

/// A running NBD server and the URI of its export.
struct Server {
    _procs: Vec<Proc>,
    uri: String,
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Starts `which` serving a RAM-backed disk of `size` bytes in `dir`.
fn start(which: &str, exe: &Path, dir: &Path, size: u64) -> Result<Server, String> {
    match which {
        "Outboard" => {
            let sock = dir.join("outboard.nbd");
            let description = format!(
                "name = \"bench-exports\"\n[[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\n\
                 backing = \"mem:{size}\"\n[[export]]\ndevice = \"disk0\"\nsocket = \"{}\"\n",
                sock.display()
            );
            let up = crate::fixture::machine(exe, dir, &description, std::slice::from_ref(&sock))?;
            Ok(Server {
                _procs: vec![up],
                uri: format!("nbd+unix:///disk0?socket={}", sock.display()),
            })
        }
        "nbdkit memory" => {
            let sock = dir.join("nbdkit.sock");
            let args = [
                "--exit-with-parent".to_string(),
                "-f".into(),
                "-U".into(),
                sock.display().to_string(),
                "memory".into(),
                size.to_string(),
            ];
            let p = spawn_foreign(Path::new("nbdkit"), &args, &sock)?;
            Ok(Server {
                _procs: vec![p],
                uri: format!("nbd+unix:///?socket={}", sock.display()),
            })
        }
        _ => {
            // A file in tmpfs: RAM-backed, as the other two are.
            let img = PathBuf::from(format!("/dev/shm/outboard-qsd-{}.img", std::process::id()));
            let f = std::fs::File::create(&img).map_err(|e| format!("{}: {e}", img.display()))?;
            f.set_len(size).map_err(|e| e.to_string())?;
            let sock = dir.join("qsd.sock");
            let args = [
                "--blockdev".to_string(),
                format!(
                    "driver=file,filename={},node-name=file,cache.direct=off",
                    img.display()
                ),
                "--blockdev".into(),
                "driver=raw,file=file,node-name=disk".into(),
                "--nbd-server".into(),
                format!("addr.type=unix,addr.path={}", sock.display()),
                "--export".into(),
                "type=nbd,id=e0,node-name=disk,name=disk0,writable=on".into(),
            ];
            let p = spawn_foreign(Path::new("qemu-storage-daemon"), &args, &sock);
            // The image is in the daemon's hands (or the start failed): unlinked at once either
            // way, so nothing is left in /dev/shm.
            let _ = std::fs::remove_file(&img);
            let p = p?;
            Ok(Server {
                _procs: vec![p],
                uri: format!("nbd+unix:///disk0?socket={}", sock.display()),
            })
        }
    }
}

/// `nbdcopy` from `from` to `to`; MB/s.
fn nbdcopy(from: &str, to: &str, bytes: u64) -> Result<f64, String> {
    let t = Instant::now();
    let o = Command::new("nbdcopy")
        .args([from, to])
        .output()
        .map_err(|e| format!("nbdcopy: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "nbdcopy: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    Ok(bytes as f64 / t.elapsed().as_secs_f64() / 1e6)
}

/// fio's nbd engine, 4 KiB `rw` at `qd` on `uri` for `secs`; IOPS.
fn fio(uri: &str, rw: &str, qd: usize, secs: f64, size: u64) -> Result<f64, String> {
    let o = Command::new("fio")
        .args([
            "--name=exports",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            &format!("--rw={rw}"),
            "--bs=4k",
            &format!("--size={size}"),
            &format!("--iodepth={qd}"),
            "--time_based",
            &format!("--runtime={}ms", (secs * 1000.0) as u64),
            "--output-format=json",
        ])
        .output()
        .map_err(|e| format!("fio: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "fio: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let json = &text[text.find('{').ok_or("fio printed no JSON")?..];
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("fio JSON: {e}"))?;
    let side = if rw == "randread" { "read" } else { "write" };
    v["jobs"][0][side]["iops"]
        .as_f64()
        .ok_or_else(|| "fio reported no IOPS".into())
}

fn series(label: String, points: Vec<(f64, Summary)>) -> Series {
    Series {
        label,
        points: points.into_iter().map(|(x, y)| Point { x, y }).collect(),
    }
}

/// Runs the comparison.
pub fn exports(ctx: &Context) -> Result<TestResult, String> {
    let size = ctx
        .size
        .unwrap_or(if ctx.quick { 64 << 20 } else { 256 << 20 });
    let secs = if ctx.quick { 0.5 } else { 2.0 };
    let dir = tempfile_dir()?;
    let image = dir.join("image");
    std::fs::write(&image, noise(size as usize)).map_err(|e| e.to_string())?;
    let back = dir.join("back");
    let mut iops = Figure {
        id: "iops".into(),
        title: "fio nbd engine, 4 KiB random (median IOPS)".into(),
        x_label: String::new(),
        y_label: "IOPS".into(),
        log_x: false,
        log_y: false,
        kind: "bar".into(),
        references: SERVERS[1..].iter().map(|s| s.to_string()).collect(),
        series: Vec::new(),
    };
    let mut copy = Figure {
        id: "nbdcopy".into(),
        title: format!("nbdcopy of a {} MiB image (MB/s)", size >> 20),
        kind: "bar".into(),
        y_label: "MB/s".into(),
        ..iops.clone()
    };
    let mut unavailable = Vec::new();
    let tools = [("nbdcopy", "libnbd-bin"), ("fio", "fio")];
    for (tool, package) in tools {
        if !have(tool) {
            return Err(format!("{tool} is needed (Debian package {package})"));
        }
    }
    for which in SERVERS {
        let needs = match which {
            "nbdkit memory" => Some("nbdkit"),
            "qemu-storage-daemon" => Some("qemu-storage-daemon"),
            _ => None,
        };
        if let Some(t) = needs.filter(|t| !have(t)) {
            unavailable.push(Unavailable {
                config: which.into(),
                reason: format!("{t} is not installed"),
            });
            continue;
        }
        let sub = dir.join(which.replace(' ', "-"));
        std::fs::create_dir_all(&sub).map_err(|e| e.to_string())?;
        ctx.progress
            .set_message(format!("exports: starting {which}"));
        let server = match start(which, &ctx.exe, &sub, size) {
            Ok(s) => s,
            Err(reason) => {
                unavailable.push(Unavailable {
                    config: which.into(),
                    reason,
                });
                continue;
            }
        };
        ctx.progress
            .set_message(format!("exports: {which}, nbdcopy"));
        let image_s = image.display().to_string();
        let back_s = back.display().to_string();
        let copy_in = crate::tests::repeat(ctx, || nbdcopy(&image_s, &server.uri, size))?;
        let copy_out = crate::tests::repeat(ctx, || nbdcopy(&server.uri, &back_s, size))?;
        if std::fs::read(&back).map_err(|e| e.to_string())?
            != std::fs::read(&image).map_err(|e| e.to_string())?
        {
            return Err(format!("{which}: the image came back different"));
        }
        copy.series
            .push(series(format!("{which}, in"), vec![(0.0, copy_in)]));
        copy.series
            .push(series(format!("{which}, out"), vec![(0.0, copy_out)]));
        for (cell, rw, qd) in CELLS {
            ctx.progress
                .set_message(format!("exports: {which}, fio {cell}"));
            let s = crate::tests::repeat(ctx, || fio(&server.uri, rw, qd, secs, size))?;
            iops.series
                .push(series(format!("{which}, {cell}"), vec![(0.0, s)]));
        }
    }
    crate::fixture::remove_work_dir(&dir);
    let m = |f: &Figure, label: &str| {
        f.series(label)
            .and_then(|s| s.points.first().map(|p| p.y.median))
    };
    let mut targets = Vec::new();
    let cells: Vec<(String, &Figure)> = CELLS
        .iter()
        .map(|(c, _, _)| (c.to_string(), &iops))
        .chain(["in", "out"].iter().map(|d| (d.to_string(), &copy)))
        .collect();
    for (cell, fig) in cells {
        let ours = m(fig, &format!("Outboard, {cell}"));
        let best = SERVERS[1..]
            .iter()
            .filter_map(|p| m(fig, &format!("{p}, {cell}")).map(|v| (v, *p)))
            .max_by(|a, b| a.0.total_cmp(&b.0));
        let what = if fig.id == "iops" {
            format!("fio {cell}")
        } else {
            format!("nbdcopy {cell}")
        };
        targets.push(match (ours, best) {
            (Some(o), Some((b, who))) => Target {
                target: format!("exports: Outboard ≥ the better peer, {what}"),
                measured: format!("{:.2}× ({o:.0} vs {b:.0}, {who})", o / b),
                met: Some(o >= b),
            },
            _ => Target {
                target: format!("exports: Outboard ≥ the better peer, {what}"),
                measured: "not measured (a server was unavailable)".into(),
                met: None,
            },
        });
    }
    Ok(TestResult {
        test: "exports".into(),
        title: "Exports against peers".into(),
        reference: "EVALUATION.md test 9".into(),
        runs: ctx.runs,
        discarded: crate::tests::WARM_UP,
        params: serde_json::json!({ "disk_bytes": size, "fio_seconds_per_run": secs, "block": 4096 }),
        figures: vec![iops, copy],
        unavailable,
        targets,
        machine: Machine::here(),
    })
}

/// Bytes that do not compress or repeat (xorshift), so no server can take a shortcut.
fn noise(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

fn tempfile_dir() -> Result<PathBuf, String> {
    let d = std::env::temp_dir().join(format!("outboard-bench-exports-{}", std::process::id()));
    std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
    Ok(d)
}

/// Progress steps (runs) the test takes.
pub fn steps(ctx: &Context) -> u64 {
    (SERVERS.len() * (2 + CELLS.len()) * ctx.runs) as u64
}
