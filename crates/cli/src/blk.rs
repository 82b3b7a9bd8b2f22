//! `outboard blk …`: use a block device by name, through whatever placement the machine gives it.

use std::io::Read;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use outboard_block::{BlockDevice, BlockError};
use outboard_devices::backing::parse_size;

#[derive(Subcommand)]
pub enum BlkCommand {
    /// State, capacity, block size, read-only, queue depth.
    Info {
        /// Device name, e.g. disk0.
        device: String,
        /// One JSON object, numbers as numbers (capacity in bytes), for scripts.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        wait: Wait,
    },
    /// Read bytes from a device to stdout or a file.
    Read(ReadArgs),
    /// Write bytes from stdin or a file to a device. Partial blocks are read-modify-written.
    Write(WriteArgs),
    /// Compare placements on a fresh emulated disk: colocated vs separate, one run (does not
    /// need `outboard up`).
    Bench(crate::blkbench::BenchArgs),
}

#[derive(Args)]
pub struct ReadArgs {
    /// Device name.
    device: String,
    /// Byte offset to start at (K/M/G suffixes allowed).
    #[arg(long, default_value = "0", value_parser = size, allow_negative_numbers = true)]
    offset: u64,
    /// Bytes to read [default: to the end of the device].
    #[arg(long, value_parser = size, allow_negative_numbers = true)]
    length: Option<u64>,
    /// Write to this file instead of stdout.
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    #[command(flatten)]
    wait: Wait,
}

#[derive(Args)]
pub struct WriteArgs {
    /// Device name.
    device: String,
    /// Byte offset to start at (K/M/G suffixes allowed).
    #[arg(long, default_value = "0", value_parser = size, allow_negative_numbers = true)]
    offset: u64,
    /// Read from this file instead of stdin.
    #[arg(short, long, value_name = "FILE")]
    input: Option<PathBuf>,
    #[command(flatten)]
    wait: Wait,
}

/// How long a command waits on its device.
#[derive(Args)]
pub struct Wait {
    /// Give up after this long (e.g. 30s, 500ms), saying how far the transfer got; exit
    /// status 124, as timeout(1)'s. Without it the command waits as long as the device keeps
    /// it waiting (suspended, restarting), and says once why after a second without progress.
    #[arg(long, value_name = "DURATION", value_parser = crate::up::parse_duration)]
    pub timeout: Option<std::time::Duration>,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).ok_or_else(|| format!("{s:?} is not a byte count (e.g. 4096, 64K, 1M)"))
}

fn e(x: BlockError) -> String {
    x.to_string()
}

/// Largest piece moved per request batch.
const CHUNK: u64 = 1 << 20;

pub fn run(c: BlkCommand, control: PathBuf) -> Result<ExitCode, String> {
    let watch = |what: &str, device: &str, wait: &Wait, verb: &'static str| {
        // A remote disk (an NBD URI) has no registry entry to say why it waits.
        let named = (!outboard_block_client::remote::is_uri(device)).then(|| device.to_string());
        crate::watch::start(
            format!("blk {what} {device}"),
            control.clone(),
            named,
            verb,
            wait.timeout,
        )
    };
    match c {
        BlkCommand::Bench(a) => return crate::blkbench::run(a),
        BlkCommand::Info { device, json, wait } => {
            let _watch = watch("info", &device, &wait, "");
            // A remote disk (an NBD URI) has no registry entry here.
            let node = if outboard_block_client::remote::is_uri(&device) {
                None
            } else {
                Some(outboard_manager::open::status(&control, &device).map_err(|r| r.to_string())?)
            };
            let d = outboard_block_client::open_block(&control, &device).map_err(e)?;
            let i = d.info();
            let state = node.as_ref().and_then(|n| n.props.get("state"));
            if json {
                let info = serde_json::json!({
                    "name": i.name,
                    "state": state,
                    "capacity_bytes": i.bytes(),
                    "blocks": i.capacity,
                    "block_size": i.block_size,
                    "read_only": i.read_only,
                    "queue_depth": i.queue_depth,
                    "max_transfer_bytes": i.max_transfer,
                    "supports": i.supports,
                });
                println!("{info}");
                return Ok(ExitCode::SUCCESS);
            }
            println!("{}", i.name);
            if let Some(state) = state {
                println!("  state        {}", state.as_str().unwrap_or_default());
            }
            println!("  capacity     {} bytes ({} blocks)", i.bytes(), i.capacity);
            println!("  block size   {} bytes", i.block_size);
            println!("  read-only    {}", if i.read_only { "yes" } else { "no" });
            println!("  queue depth  {}", i.queue_depth);
        }
        BlkCommand::Read(a) => {
            let w = watch("read", &a.device, &a.wait, "read");
            let mut d = outboard_block_client::open_block(&control, &a.device).map_err(e)?;
            let total = d.info().bytes();
            // Checked once, before the output file is created: a bad range must not truncate it.
            let length = a.length.unwrap_or(total.saturating_sub(a.offset));
            let range = d.info().byte_range(a.offset, length).map_err(|_| {
                format!(
                    "{length} bytes at offset {} run past the end of {} ({total} bytes)",
                    a.offset, a.device
                )
            })?;
            // Straight from the buffer area the device wrote into to the output: no copy here.
            let file = a
                .output
                .as_ref()
                .map(|p| std::fs::File::create(p).map_err(|x| format!("{}: {x}", p.display())))
                .transpose()?;
            let stdout = std::io::stdout();
            let fd = match &file {
                Some(f) => f.as_fd(),
                None => stdout.as_fd(),
            };
            let progress = w.progress.with_total(range.len());
            // A piece at a time, counted: a read cut off (a timeout, a detach) says how far
            // it got.
            let (mut at, end) = (range.offset(), range.offset() + range.len());
            while at < end {
                let n = CHUNK.min(end - at);
                let piece = d.info().byte_range(at, n).map_err(e)?;
                d.read_out(piece, fd).map_err(|x| progress.cut_off(e(x)))?;
                progress.add(n);
                at += n;
            }
        }
        BlkCommand::Write(a) => {
            let mut data = Vec::new();
            match &a.input {
                Some(p) => std::fs::File::open(p)
                    .and_then(|mut f| f.read_to_end(&mut data))
                    .map_err(|x| format!("{}: {x}", p.display()))?,
                None => std::io::stdin()
                    .lock()
                    .read_to_end(&mut data)
                    .map_err(|x| x.to_string())?,
            };
            let w = watch("write", &a.device, &a.wait, "written");
            let mut d = outboard_block_client::open_block(&control, &a.device).map_err(e)?;
            let total = d.info().bytes();
            if a.offset
                .checked_add(data.len() as u64)
                .is_none_or(|end| end > total)
            {
                return Err(format!(
                    "{} bytes at offset {} run past the end of {} ({total} bytes)",
                    data.len(),
                    a.offset,
                    a.device
                ));
            }
            let progress = w.progress.with_total(data.len() as u64);
            for (i, piece) in data.chunks(CHUNK as usize).enumerate() {
                write_range(d.as_mut(), a.offset + i as u64 * CHUNK, piece)
                    .map_err(|x| progress.cut_off(x))?;
                progress.add(piece.len() as u64);
            }
            d.flush().map_err(|x| progress.cut_off(e(x)))?;
            eprintln!(
                "wrote {} bytes at offset {} to {}",
                data.len(),
                a.offset,
                a.device
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `data` at byte `offset`; partial first and last blocks are read, merged and
/// rewritten (read-modify-write), not refused. The blocks are locked against other clients'
/// writes from the read to the write-back, so a client writing other bytes of the same block
/// at the same time cannot be overwritten with this client's stale copy.
pub fn write_range(d: &mut dyn BlockDevice, offset: u64, data: &[u8]) -> Result<(), String> {
    if data.is_empty() {
        return Ok(());
    }
    let bs = d.info().block_size as u64;
    let first = offset / bs;
    let end = (offset + data.len() as u64).div_ceil(bs);
    let skip = (offset - first * bs) as usize;
    let partial_end = !(offset + data.len() as u64).is_multiple_of(bs);
    if skip == 0 && !partial_end {
        return d.write_blocks(first, data).map_err(e);
    }
    let count = u32::try_from(end - first).map_err(|_| "write too large".to_string())?;
    // A remote disk has no range locks: its read-modify-write is then unguarded.
    let locked = match d.lock_blocks(first, count) {
        Ok(()) => true,
        Err(outboard_block::BlockError::Unsupported) => false,
        Err(x) => return Err(e(x)),
    };
    let merged = (|| {
        let mut blocks = vec![0u8; ((end - first) * bs) as usize];
        if skip != 0 {
            d.read_blocks(first, &mut blocks[..bs as usize])?;
        }
        if partial_end {
            let last = blocks.len() - bs as usize;
            d.read_blocks(end - 1, &mut blocks[last..])?;
        }
        blocks[skip..skip + data.len()].copy_from_slice(data);
        d.write_blocks(first, &blocks)
    })();
    let unlocked = if locked {
        d.unlock_blocks(first, count)
    } else {
        Ok(())
    };
    merged.map_err(e)?;
    unlocked.map_err(e)
}
