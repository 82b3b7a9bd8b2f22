//! The workloads, written once over `BlockDevice` so every placement runs the same code, plus
//! the kernel's equivalents.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use outboard_block::{BlockDevice, BlockError, BlockOp, BlockRequest};
use rustix::fs::{Mode, OFlags};

fn e(x: BlockError) -> String {
    x.to_string()
}

/// Keeps `depth` requests from `make` in flight for `secs`; returns completions per second.
pub fn sustained(
    d: &mut dyn BlockDevice,
    depth: usize,
    secs: f64,
    mut make: impl FnMut(u64) -> BlockRequest,
) -> Result<f64, String> {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let t0 = Instant::now();
    let (mut tag, mut done) = (0u64, 0u64);
    let mut out = Vec::with_capacity(depth);
    while Instant::now() < end {
        while d.in_flight() < depth {
            d.submit(&make(tag)).map_err(e)?;
            tag += 1;
        }
        d.kick().map_err(e)?;
        out.clear();
        d.wait(&mut out, Duration::from_secs(10)).map_err(e)?;
        for c in &out {
            c.result.clone().map_err(e)?;
        }
        done += out.len() as u64;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    while d.in_flight() > 0 {
        out.clear();
        d.wait(&mut out, Duration::from_secs(10)).map_err(e)?;
    }
    Ok(done as f64 / elapsed)
}

/// Reads `total` bytes from block 0 in `transfer`-byte requests at queue depth 1; returns the
/// elapsed seconds.
pub fn seq_read(d: &mut dyn BlockDevice, transfer: u64, total: u64) -> Result<f64, String> {
    let bs = d.info().block_size as u64;
    let blocks = (transfer / bs).max(1) as u32;
    let t0 = Instant::now();
    let mut lba = 0;
    let mut out = Vec::with_capacity(1);
    while lba * bs < total {
        d.submit(&BlockRequest {
            op: BlockOp::Read,
            lba,
            blocks,
            buf_offset: 0,
            tag: lba,
        })
        .map_err(e)?;
        d.kick().map_err(e)?;
        out.clear();
        while out.is_empty() {
            d.wait(&mut out, Duration::from_secs(10)).map_err(e)?;
        }
        out[0].result.clone().map_err(e)?;
        lba += blocks as u64;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// The kernel's version of [`seq_read`]: `pread` with O_DIRECT on a block device.
pub fn kernel_seq_read(dev: &Path, transfer: u64, total: u64) -> Result<f64, String> {
    let fd = rustix::fs::open(
        dev,
        OFlags::RDONLY | OFlags::DIRECT | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|x| format!("{}: {x}", dev.display()))?;
    let mut raw = vec![0u8; transfer as usize + 4096];
    let skew = raw.as_ptr().align_offset(4096);
    let buf = &mut raw[skew..skew + transfer as usize];
    let t0 = Instant::now();
    let mut off = 0;
    while off < total {
        let n = rustix::io::pread(&fd, &mut *buf, off).map_err(|x| format!("pread: {x}"))?;
        if n == 0 {
            return Err("short device".into());
        }
        off += n as u64;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// A fast deterministic generator of block-aligned random positions.
pub struct Rng(pub u64);

impl Rng {
    /// The next pseudo-random number (xorshift64).
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// 4 KiB random reads at queue depth `qd` for `secs`; returns IOPS.
pub fn rand_read(d: &mut dyn BlockDevice, qd: usize, secs: f64, seed: u64) -> Result<f64, String> {
    let per = (4096 / d.info().block_size as u64).max(1);
    let positions = (d.info().capacity / per).max(1);
    let mut rng = Rng(seed | 1);
    let slots = (d.buffers().len() as u64 / 4096).max(1);
    sustained(d, qd, secs, |tag| BlockRequest {
        op: BlockOp::Read,
        lba: rng.next_u64() % positions * per,
        blocks: per as u32,
        buf_offset: (tag % slots) * 4096,
        tag,
    })
}

/// Round-trip times of `n` null requests at queue depth 1, in microseconds.
pub fn null_latencies(d: &mut dyn BlockDevice, n: usize) -> Result<Vec<f64>, String> {
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        d.execute(&BlockRequest {
            op: BlockOp::Null,
            lba: 0,
            blocks: 0,
            buf_offset: 0,
            tag: i as u64,
        })
        .map_err(e)?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(v)
}

/// Null requests per second at queue depth `qd` (batched submission and completion).
pub fn null_throughput(d: &mut dyn BlockDevice, qd: usize, secs: f64) -> Result<f64, String> {
    sustained(d, qd, secs, |tag| BlockRequest {
        op: BlockOp::Null,
        lba: 0,
        blocks: 0,
        buf_offset: 0,
        tag,
    })
}

/// fio with io_uring: 4 KiB random reads, O_DIRECT, on `dev`; returns IOPS.
pub fn fio_iops(dev: &Path, qd: usize, jobs: usize, secs: f64) -> Result<f64, String> {
    let out = Command::new("fio")
        .args([
            "--name=outboard",
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=randread",
            "--bs=4k",
            "--time_based",
            "--group_reporting",
            "--output-format=json",
        ])
        .arg(format!("--filename={}", dev.display()))
        .arg(format!("--iodepth={qd}"))
        .arg(format!("--numjobs={jobs}"))
        .arg(format!("--runtime={}ms", (secs * 1000.0).max(1.0) as u64))
        .output()
        .map_err(|x| format!("fio: {x}"))?;
    if !out.status.success() {
        return Err(format!(
            "fio: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    // fio may print warnings before the JSON.
    let text = String::from_utf8_lossy(&out.stdout);
    let json = &text[text.find('{').ok_or("fio printed no JSON")?..];
    let v: serde_json::Value = serde_json::from_str(json).map_err(|x| format!("fio JSON: {x}"))?;
    v["jobs"][0]["read"]["iops"]
        .as_f64()
        .ok_or_else(|| "fio JSON has no read IOPS".to_string())
}
