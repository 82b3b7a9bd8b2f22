//! `outboard blk bench`: a quick look at colocated vs separate on one device model, in one run.
//!
//! Sequential 64 KiB reads at queue depth 1, 4 KiB random reads at queue depth 32, null round
//! trips. One pass each, for a person at a terminal; the evaluation suite with repeated runs,
//! kernel baselines and targets is `outboard bench`.

use std::time::Duration;

use clap::Args;
use outboard_bench::fixture::Fixture;
use outboard_bench::stats::median;
use outboard_bench::workloads::{null_latencies, rand_read, sustained};
use outboard_block::{BlockDevice, BlockError, BlockOp, BlockRequest};
use outboard_block_client::{BlockClient, Colocated, SessionOptions, WaitMode};
use outboard_devices::backing::parse_size;
use outboard_drivers::Attachment;
use outboard_hw::DeviceSpec;

#[derive(Args)]
pub struct BenchArgs {
    /// Disk size (a file filled with data, read once beforehand).
    #[arg(long, default_value = "256M", value_parser = |s: &str| parse_size(s).ok_or("not a size"))]
    size: u64,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// The driver server's adaptive spin, in microseconds (0: it sleeps at once).
    #[arg(long, default_value_t = 20)]
    server_spin_us: u64,
}

struct Row {
    seq_mbs: f64,
    rand_iops: f64,
    null_us: f64,
}

fn workloads(d: &mut dyn BlockDevice, secs: f64) -> Result<Row, String> {
    let (blocks, bs) = (d.info().capacity, d.info().block_size as u64);
    let per = 65536 / bs;
    let mut next = 0u64;
    let seq = sustained(d, 1, secs, |tag| {
        let lba = next;
        next = (next + per) % (blocks - blocks % per);
        BlockRequest {
            op: BlockOp::Read,
            lba,
            blocks: per as u32,
            buf_offset: 0,
            tag,
        }
    })?;
    let rand = rand_read(d, 32, secs, 7)?;
    let null = median(&mut null_latencies(d, 20000)?);
    Ok(Row {
        seq_mbs: seq * 65536.0 / 1e6,
        rand_iops: rand,
        null_us: null,
    })
}

fn e(x: BlockError) -> String {
    x.to_string()
}

pub fn run(a: BenchArgs) -> Result<std::process::ExitCode, String> {
    let fx = Fixture::new(&std::env::current_exe().map_err(|x| x.to_string())?, a.size)?;
    let (_dev, dev_sock) = fx.device()?;
    println!(
        "outboard blk bench: {} MiB virtio-blk model over a file, {:.1} s per measurement, driver server spin {} µs",
        a.size >> 20,
        a.seconds,
        a.server_spin_us
    );
    let colo = {
        let mut d = Colocated::open(
            "disk0",
            &Attachment::Pci(DeviceSpec::VfioUser(dev_sock.clone())),
            4 << 20,
        )
        .map_err(e)?;
        workloads(&mut d, a.seconds)?
    };
    let (_host, host_sock) = fx.host(
        &format!("disk0=vfio-user:{}", dev_sock.display()),
        a.server_spin_us,
    )?;
    let mut c = BlockClient::open(&host_sock, "disk0", SessionOptions::default()).map_err(e)?;
    let sep = workloads(&mut c, a.seconds)?;
    c.set_mode(WaitMode::Adaptive(Duration::from_micros(20)));
    let adaptive_null = median(&mut null_latencies(&mut c, 20000)?);
    let adaptive_rand = rand_read(&mut c, 32, a.seconds, 9)?;
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
    Ok(std::process::ExitCode::SUCCESS)
}
