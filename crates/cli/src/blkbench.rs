//! `outboard blk bench`: colocated vs separate on one device model, in one run.
//!
//! Starts a device model process, drives it first with the driver linked in (colocated), then
//! through a driver server process (separate), with the same workloads: sequential 64 KiB reads
//! at queue depth 1, 4 KiB random reads at queue depth 32, and null-request round trips. Numbers
//! for a person to read; the evaluation suite proper is `outboard bench` (a later issue).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use outboard_class::{
    BlockClient, BlockDevice, BlockError, BlockOp, BlockRequest, SessionOptions, WaitMode,
};
use outboard_devices::backing::parse_size;
use outboard_hw::DeviceSpec;
use outboard_server::Colocated;

#[derive(Args)]
pub struct BenchArgs {
    /// Disk size (memory-backed, filled before measuring).
    #[arg(long, default_value = "256M", value_parser = |s: &str| parse_size(s).ok_or("not a size"))]
    size: u64,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// The driver server's adaptive spin, in microseconds (0: it sleeps at once).
    #[arg(long, default_value_t = 20)]
    server_spin_us: u64,
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str], sock: &Path) -> Result<Killed, String> {
    let child = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        if Instant::now() > deadline {
            return Err(format!("{args:?} did not start"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(Killed(child))
}

fn e(x: BlockError) -> String {
    x.to_string()
}

/// Keeps `depth` requests made by `make` in flight for `secs`; returns completions per second.
fn sustained(
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
    while d.in_flight() > 0 {
        out.clear();
        d.wait(&mut out, Duration::from_secs(10)).map_err(e)?;
    }
    Ok(done as f64 / t0.elapsed().as_secs_f64())
}

fn null_rtt(d: &mut dyn BlockDevice, n: u32) -> Result<f64, String> {
    let mut v = Vec::with_capacity(n as usize);
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
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

struct Row {
    seq_mbs: f64,
    rand_iops: f64,
    null_us: f64,
}

fn workloads(d: &mut dyn BlockDevice, secs: f64) -> Result<Row, String> {
    let blocks = d.info().capacity;
    let bs = d.info().block_size as u64;
    let per64k = 65536 / bs;
    let mut next = 0u64;
    let seq = sustained(d, 1, secs, |tag| {
        let lba = next;
        next = (next + per64k) % (blocks - blocks % per64k);
        BlockRequest {
            op: BlockOp::Read,
            lba,
            blocks: per64k as u32,
            buf_offset: 0,
            tag,
        }
    })?;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let per4k = 4096 / bs;
    let rand = sustained(d, 32, secs, |tag| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let lba = (x % (blocks / per4k)) * per4k;
        BlockRequest {
            op: BlockOp::Read,
            lba,
            blocks: per4k as u32,
            buf_offset: (tag % 32) * 4096,
            tag,
        }
    })?;
    let null = null_rtt(d, 20000)?;
    Ok(Row {
        seq_mbs: seq * 65536.0 / 1e6,
        rand_iops: rand,
        null_us: null,
    })
}

pub fn run(a: BenchArgs) -> Result<std::process::ExitCode, String> {
    let dir = std::env::temp_dir().join(format!("outboard-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|x| x.to_string())?;
    let dev_sock = dir.join("dev.sock");
    let host_sock = dir.join("host.sock");
    let result = (|| -> Result<(), String> {
        let backing = format!("mem:{}", a.size);
        let _dev = spawn(
            &[
                "device",
                "virtio-blk",
                "--socket",
                dev_sock.to_str().unwrap(),
                "--backing",
                &backing,
            ],
            &dev_sock,
        )?;
        println!(
            "outboard blk bench: {} MiB memory-backed virtio-blk model, {:.1} s per measurement, driver server spin {} µs",
            a.size >> 20,
            a.seconds,
            a.server_spin_us
        );
        let spec = DeviceSpec::VfioUser(dev_sock.clone());
        let colo = {
            let mut d = Colocated::open("disk0", &spec, 4 << 20).map_err(e)?;
            // Fill the disk so reads touch real pages, not holes.
            let chunk = vec![0x5au8; 1 << 20];
            for i in 0..(a.size >> 20) {
                d.write_blocks(i * (1 << 20) / 512, &chunk).map_err(e)?;
            }
            workloads(&mut d, a.seconds)?
        };
        let spec_arg = format!("disk0=vfio-user:{}", dev_sock.display());
        let spin = a.server_spin_us.to_string();
        let _host = spawn(
            &[
                "driver-host",
                "--listen",
                host_sock.to_str().unwrap(),
                "--device",
                &spec_arg,
                "--spin-us",
                &spin,
            ],
            &host_sock,
        )?;
        let mut c = BlockClient::open(&host_sock, "disk0", SessionOptions::default()).map_err(e)?;
        let sep = workloads(&mut c, a.seconds)?;
        c.set_mode(WaitMode::Adaptive(Duration::from_micros(20)));
        let adaptive_null = null_rtt(&mut c, 20000)?;
        c.set_mode(WaitMode::Adaptive(Duration::from_micros(20)));
        let adaptive_rand = {
            let mut x = 1u64;
            let blocks = c.info().capacity;
            sustained(&mut c, 32, a.seconds, |tag| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                BlockRequest {
                    op: BlockOp::Read,
                    lba: ((x >> 20) % (blocks / 8)) * 8,
                    blocks: 8,
                    buf_offset: (tag % 32) * 4096,
                    tag,
                }
            })?
        };
        println!();
        println!(
            "  {:<40} {:>12} {:>12} {:>8}",
            "measurement", "colocated", "separate", "ratio"
        );
        println!(
            "  {:<40} {:>12.0} {:>12.0} {:>7.0}%",
            "sequential 64 KiB reads, QD1 (MB/s)",
            colo.seq_mbs,
            sep.seq_mbs,
            100.0 * sep.seq_mbs / colo.seq_mbs
        );
        println!(
            "  {:<40} {:>12.0} {:>12.0} {:>7.0}%",
            "random 4 KiB reads, QD32 (IOPS)",
            colo.rand_iops,
            sep.rand_iops,
            100.0 * sep.rand_iops / colo.rand_iops
        );
        println!(
            "  {:<40} {:>12.2} {:>12.2}",
            "null request round trip, blocking (µs)", colo.null_us, sep.null_us
        );
        println!(
            "  {:<40} {:>12} {:>12.2}",
            "null request round trip, adaptive (µs)", "-", adaptive_null
        );
        println!(
            "  {:<40} {:>12} {:>12.0}",
            "random 4 KiB reads, QD32, adaptive (IOPS)", "-", adaptive_rand
        );
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result.map(|()| std::process::ExitCode::SUCCESS)
}
