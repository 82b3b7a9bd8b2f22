//! The block class's conformance suite: what every block device must do for its clients,
//! whichever driver serves it and wherever that driver runs. The workspace's tests run it on
//! each driver in each placement, and `outboard hw selftest --suite` runs it on a real device
//! (QEMU's virtio-blk through VFIO, in the guest test), so a driver is held to one standard.
//!
//! The suite writes over the disk (its first 8 MiB and its last blocks): never run it on a disk
//! whose bytes matter. It reads the geometry from [`BlockInfo`] and so takes any block size.

use std::time::Duration;

use crate::{BlockDevice, BlockError, BlockOp, BlockRequest};

/// One check: its name, and the check itself (what it saw, or what went wrong).
pub struct Check {
    /// What it checks, in a few words.
    pub name: &'static str,
    /// Runs it; the detail on success, the failure otherwise.
    pub run: fn(&mut dyn BlockDevice) -> Result<String, String>,
}

/// Every check, in the order they run (the first, the geometry, says whether the rest can).
pub const CHECKS: &[Check] = &[
    Check {
        name: "geometry",
        run: geometry,
    },
    Check {
        name: "verified queued I/O at the start",
        run: |d| {
            let count = blocks_for(d, 1 << 20);
            queued_io_at(d, 0, count, 1)
        },
    },
    Check {
        name: "verified queued I/O at the end",
        run: |d| {
            let count = blocks_for(d, 160 << 10);
            let first = d.info().capacity - count;
            queued_io_at(d, first, count, 2)
        },
    },
    Check {
        name: "3 MiB through the synchronous calls",
        run: synchronous_io,
    },
    Check {
        name: "bad requests get the right error",
        run: refusals,
    },
    Check {
        name: "flush",
        run: flush,
    },
    Check {
        name: "write zeroes reads zeroes, neighbours kept",
        run: |d| ranged_op(d, BlockOp::WriteZeroes),
    },
    Check {
        name: "discard keeps the neighbours",
        run: |d| ranged_op(d, BlockOp::Discard),
    },
];

/// The smallest disk the suite runs on.
pub const MIN_BYTES: u64 = 8 << 20;

/// Bytes of buffer area each queued request has, at the least (a slot holds one block).
const SLOT: usize = 32 << 10;

/// The slot of a device: 32 KiB, or one block if that is larger.
fn slot(d: &dyn BlockDevice) -> usize {
    SLOT.max(d.info().block_size as usize)
}

/// Whole blocks covering `bytes`.
fn blocks_for(d: &dyn BlockDevice, bytes: u64) -> u64 {
    bytes.div_ceil(u64::from(d.info().block_size))
}

/// Runs every check; the first failure, named.
pub fn run(d: &mut dyn BlockDevice) -> Result<(), String> {
    for c in CHECKS {
        (c.run)(d).map_err(|e| format!("{}: {e}", c.name))?;
    }
    Ok(())
}

/// A reproducible pattern of `len` bytes (xorshift), different for each seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn geometry(d: &mut dyn BlockDevice) -> Result<String, String> {
    let i = d.info();
    let bs = i.block_size as u64;
    if !bs.is_power_of_two() || !(512..=65536).contains(&bs) {
        return Err(format!(
            "block size {bs}: not a power of two from 512 to 65536"
        ));
    }
    if i.capacity.saturating_mul(bs) < MIN_BYTES {
        return Err(format!(
            "{} bytes: the suite needs a disk of at least {MIN_BYTES}",
            i.capacity * bs
        ));
    }
    if i.read_only {
        return Err("the disk is read-only; the suite writes".into());
    }
    if depth(d) == 0 {
        return Err(format!(
            "a buffer area of {} bytes: the suite needs {} at least",
            d.buffers().len(),
            slot(d)
        ));
    }
    let i = d.info();
    Ok(format!(
        "{} blocks of {bs} B, queue depth {}, largest transfer {}",
        i.capacity,
        i.queue_depth,
        match i.max_transfer {
            0 => "unlimited".to_string(),
            m => format!("{m} B"),
        }
    ))
}

/// Requests the suite keeps in flight: 16, unless the driver or the buffer area takes fewer.
fn depth(d: &dyn BlockDevice) -> usize {
    16.min(d.info().queue_depth.max(1) as usize)
        .min(d.buffers().len() / slot(d))
}

fn queued_io_at(
    d: &mut dyn BlockDevice,
    first: u64,
    count: u64,
    seed: u64,
) -> Result<String, String> {
    verified_io(d, first, count, seed)?;
    Ok(format!(
        "blocks {first}..{}, up to {} in flight",
        first + count,
        depth(d)
    ))
}

/// Writes distinct patterns over blocks `first..first + count` with up to 16 requests in
/// flight, in requests of 1 to 64 blocks (as many as a 32 KiB slot of the buffer area holds),
/// then reads everything back the same way and compares; ends with a flush if the device
/// takes one. Every request has a tag of its own, and each must complete exactly once.
pub fn verified_io(
    d: &mut dyn BlockDevice,
    first: u64,
    count: u64,
    seed: u64,
) -> Result<(), String> {
    let bs = d.info().block_size as usize;
    let slot_len = slot(d);
    let per_slot = (slot_len / bs) as u64;
    let depth = depth(d);
    let mut plan = Vec::new();
    let mut lba = first;
    for i in 0.. {
        if lba >= first + count {
            break;
        }
        let n = [1u64, 8, 3, 64, 16, 5][i % 6]
            .min(per_slot)
            .min(first + count - lba);
        plan.push((lba, n));
        lba += n;
    }
    let shm = |e: outboard_shm::ShmError| format!("buffer area: {e}");
    for op in [BlockOp::Write, BlockOp::Read] {
        for (c, chunk) in plan.chunks(depth).enumerate() {
            // Request k of the plan has tag k: a completion that came late from an earlier
            // batch, or twice, is caught.
            let first_tag = (c * depth) as u64;
            if op == BlockOp::Read {
                d.buffers().fill(0, depth * slot_len, 0).map_err(shm)?;
            }
            for (slot, &(lba, n)) in chunk.iter().enumerate() {
                if op == BlockOp::Write {
                    let bytes = pattern(seed ^ lba, n as usize * bs);
                    d.buffers()
                        .write((slot * slot_len) as u64, &bytes)
                        .map_err(shm)?;
                }
                let r = BlockRequest {
                    op,
                    lba,
                    blocks: n as u32,
                    buf_offset: (slot * slot_len) as u64,
                    tag: first_tag + slot as u64,
                };
                d.submit(&r)
                    .map_err(|e| format!("{op:?} of block {lba} x {n} not queued: {e}"))?;
            }
            d.kick().map_err(|e| format!("kick: {e}"))?;
            let mut done = Vec::new();
            while done.len() < chunk.len() {
                d.wait(&mut done, Duration::from_secs(30))
                    .map_err(|e| format!("waiting for {op:?} completions: {e}"))?;
            }
            let mut seen = vec![false; chunk.len()];
            for c in &done {
                let at = c.tag.wrapping_sub(first_tag) as usize;
                let Some(&(lba, n)) = chunk.get(at) else {
                    return Err(format!("a completion with a tag not in flight: {}", c.tag));
                };
                if std::mem::replace(&mut seen[at], true) {
                    return Err(format!("tag {} completed twice", c.tag));
                }
                if c.result != Ok(n as u32 * bs as u32) {
                    return Err(format!(
                        "{op:?} of block {lba} x {n}: {:?}, expected {} bytes",
                        c.result,
                        n as usize * bs
                    ));
                }
            }
            if op == BlockOp::Read {
                for (slot, &(lba, n)) in chunk.iter().enumerate() {
                    let mut got = vec![0u8; n as usize * bs];
                    d.buffers()
                        .read((slot * slot_len) as u64, &mut got)
                        .map_err(shm)?;
                    if got != pattern(seed ^ lba, got.len()) {
                        return Err(format!("block {lba} x {n} read back differs"));
                    }
                }
            }
        }
    }
    if d.info().supports.flush {
        d.flush().map_err(|e| format!("flush: {e}"))?;
    }
    Ok(())
}

fn synchronous_io(d: &mut dyn BlockDevice) -> Result<String, String> {
    let bs = d.info().block_size as u64;
    let big = pattern(3, 3 << 20);
    let lba = (2 << 20) / bs;
    d.write_blocks(lba, &big)
        .map_err(|e| format!("write: {e}"))?;
    let mut back = vec![0u8; big.len()];
    d.read_blocks(lba, &mut back)
        .map_err(|e| format!("read: {e}"))?;
    if back != big {
        return Err("the bytes read back differ from those written".into());
    }
    Ok(format!(
        "{} buffer-area chunks of {} B",
        big.len().div_ceil(d.buffers().len()),
        d.buffers().len()
    ))
}

fn request(op: BlockOp, lba: u64, blocks: u32, buf_offset: u64) -> BlockRequest {
    BlockRequest {
        op,
        lba,
        blocks,
        buf_offset,
        tag: 9,
    }
}

fn refusals(d: &mut dyn BlockDevice) -> Result<String, String> {
    let cap = d.info().capacity;
    let bs = d.info().block_size as usize;
    let expect = |what: &str, got: Result<u32, BlockError>, ok: fn(&BlockError) -> bool| match got {
        Err(e) if ok(&e) => Ok(()),
        other => Err(format!("{what}: got {other:?}")),
    };
    let read = BlockOp::Read;
    let past = d.execute(&request(read, cap, 1, 0));
    expect("a read past the end", past, |e| {
        *e == BlockError::OutOfRange
    })?;
    let across = d.execute(&request(read, cap - 1, 2, 0));
    expect("a read across the end", across, |e| {
        *e == BlockError::OutOfRange
    })?;
    let far = d.execute(&request(read, u64::MAX, 1, 0));
    expect("a read at block 2^64-1", far, |e| {
        *e == BlockError::OutOfRange
    })?;
    let outside = d.execute(&request(read, 0, 1, u64::MAX - 10));
    expect("a buffer outside the area", outside, |e| {
        *e == BlockError::BadBuffer
    })?;
    let zero = d.execute(&request(read, 0, 0, 0));
    expect("zero blocks", zero, |e| matches!(e, BlockError::Invalid(_)))?;
    match d.execute(&request(BlockOp::Null, 0, 0, 0)) {
        Ok(0) => {}
        other => return Err(format!("a null request: got {other:?}, expected 0 bytes")),
    }
    // (Refused by the client library's own check, before it reaches a driver.)
    if d.read_blocks(0, &mut vec![0u8; bs / 2]).is_ok() {
        return Err("half a block read without an error".into());
    }
    // After all of that the device still serves.
    let mut one = vec![0u8; bs];
    d.read_blocks(cap - 1, &mut one)
        .map_err(|e| format!("the last block, after the refusals: {e}"))?;
    Ok("past and across the end, a bad buffer, zero blocks, half a block".into())
}

fn flush(d: &mut dyn BlockDevice) -> Result<String, String> {
    let takes = d.info().supports.flush;
    match (takes, d.flush()) {
        (true, Ok(())) => Ok("done".into()),
        (false, Err(BlockError::Unsupported)) => Ok("refused: the device has no cache".into()),
        (true, Err(e)) => Err(e.to_string()),
        (false, other) => Err(format!(
            "the device does not take flush, yet it answered {other:?}"
        )),
    }
}

/// Writes a pattern over 16 blocks at byte 6 MiB, applies `op` to the middle 4 and reads the
/// 16 back: the 12 around them keep the pattern; after write-zeroes the 4 read zeroes (after a
/// discard their contents are the device's choice: virtio and NVMe both allow either).
fn ranged_op(d: &mut dyn BlockDevice, op: BlockOp) -> Result<String, String> {
    let takes = d.info().supports.takes(op);
    let bs = d.info().block_size as usize;
    let lba = (6 << 20) / bs as u64;
    let before = pattern(if op == BlockOp::Discard { 5 } else { 6 }, 16 * bs);
    d.write_blocks(lba, &before)
        .map_err(|e| format!("writing the pattern: {e}"))?;
    match (takes, d.execute(&request(op, lba + 6, 4, 0))) {
        (true, Ok(_)) => {}
        (false, Err(BlockError::Unsupported)) => {
            return Ok("refused: the device does not take it".into())
        }
        (true, Err(e)) => return Err(e.to_string()),
        (false, other) => {
            return Err(format!(
                "the device does not take {op:?}, yet it answered {other:?}"
            ))
        }
    }
    let mut after = vec![1u8; 16 * bs];
    d.read_blocks(lba, &mut after)
        .map_err(|e| format!("reading back: {e}"))?;
    let (middle, kept) = (6 * bs..10 * bs, [0..6 * bs, 10 * bs..16 * bs]);
    for r in kept {
        if after[r.clone()] != before[r.clone()] {
            return Err(format!("blocks around the range changed (bytes {r:?})"));
        }
    }
    if op == BlockOp::WriteZeroes && after[middle].iter().any(|&b| b != 0) {
        return Err("the range does not read zeroes".into());
    }
    Ok("4 of 16 blocks".into())
}
