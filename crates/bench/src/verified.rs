//! A verified block workload: clients that write stamped blocks, read them back and flush, at
//! a queue depth, each in a region of the disk of its own, and check every answer against
//! what was acknowledged. The restart test and `bench restart` run it while the driver (or its
//! device model) is killed.
//!
//! A block written by client `c` with version `v` carries `(c, block, v)` and bytes derived
//! from them, so a read tells exactly which write it sees. A read is consistent when it sees a
//! version at least as new as the newest write acknowledged before the read was submitted, and
//! no newer than the newest submitted. A write is never submitted to a block that has one in
//! flight, so "newest" is well defined. At the end every block must hold what was acknowledged
//! last — or a later write that failed, since a write that fails may have taken effect (the
//! device wrote, then reported an error or cut its completion short).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use outboard_block::{BlockCompletion, BlockDevice, BlockOp, BlockRequest};
use outboard_block_client::{BlockClient, SessionOptions, Supervisor};
use outboard_client::api::{Reply, Request};

/// Bytes per stamped block.
pub const BLOCK: u64 = 4096;

/// The shape of the workload.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Requests each client keeps in flight.
    pub depth: usize,
    /// Blocks of [`BLOCK`] bytes each client owns.
    pub blocks: u64,
    /// One request in this many is a flush.
    pub flush_every: u64,
}

/// What one client saw.
#[derive(Debug, Default)]
pub struct ClientReport {
    /// Requests answered.
    pub completed: u64,
    /// Requests that failed: when, what kind of error, and what.
    pub failed: Vec<Failed>,
    /// Reads that returned data inconsistent with the acknowledged writes.
    pub mismatches: Vec<Failed>,
    /// Completions for a request that had already completed.
    pub duplicates: u64,
    /// Each resume on a restarted server: found gone, replay answered.
    pub resumes: Vec<(Instant, Instant)>,
    /// Requests sent again that a server may have taken (replayed).
    pub replayed: u64,
    /// Requests sent to a new server that the old one never took (they waited in its ring).
    pub requeued: u64,
}

/// A request that failed.
#[derive(Debug, Clone)]
pub struct Failed {
    /// When it was submitted.
    pub sent: Instant,
    /// When its completion arrived.
    pub at: Instant,
    /// The kind of error ([`error_kind`]).
    pub kind: &'static str,
    /// The request and the error, for people.
    pub what: String,
}

/// A short name for the kind of `e`, for tables: what a fault may be allowed to cause.
pub fn error_kind(e: &outboard_block::BlockError) -> &'static str {
    use outboard_block::BlockError as E;
    match e {
        E::Io(_) => "io",
        E::Quarantined => "quarantined",
        E::Timeout => "timeout",
        E::DeviceFailed(_) => "device-failed",
        E::Restarting => "restarting",
        E::DeviceGone => "device-gone",
        E::Protocol(_) => "protocol",
        _ => "other",
    }
}

struct Op {
    op: BlockOp,
    block: u64,
    version: u64,
    /// Newest version acknowledged when a read was submitted.
    floor: u64,
}

fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// The bytes of version `v` of `block` written by `client` (version 0: never written, zeros).
fn stamp(client: u64, block: u64, v: u64, out: &mut [u8]) {
    if v == 0 {
        out.fill(0);
        return;
    }
    let mut x = (client << 48) ^ (block << 20) ^ v ^ 0x9e37_79b9_7f4a_7c15;
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let word = match i {
            0 => client,
            1 => block,
            2 => v,
            _ => {
                x = xorshift(x);
                x
            }
        };
        chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
    }
}

/// Which version of `block` the bytes are, if they are one of this client's.
fn version_of(client: u64, block: u64, data: &[u8]) -> Option<u64> {
    if data.iter().all(|b| *b == 0) {
        return Some(0);
    }
    let v = u64::from_le_bytes(data[16..24].try_into().ok()?);
    let mut want = vec![0; data.len()];
    stamp(client, block, v, &mut want);
    (want == data).then_some(v)
}

/// What bytes that are no version of the block hold, for people: another block's or
/// client's whole version (a transfer that landed in the wrong place), or neither (torn).
fn describe(data: &[u8]) -> String {
    let word = |i: usize| u64::from_le_bytes(data[i * 8..i * 8 + 8].try_into().expect("8"));
    let (client, block, v) = (word(0), word(1), word(2));
    let mut want = vec![0; data.len()];
    stamp(client, block, v, &mut want);
    if want == data {
        return format!("client {client}'s block {block} version {v}, whole");
    }
    let same = want.iter().zip(data).filter(|(a, b)| a == b).count();
    let zeros = data.iter().filter(|b| **b == 0).count();
    format!(
        "no whole version: headed client {client} block {block} version {v}, {same} of {} bytes \
         match that, {zeros} zero",
        data.len()
    )
}

/// Opens `device` through the manager at `control` as a session that resumes across restarts.
pub fn open(control: &Path, device: &str, depth: usize) -> Result<BlockClient, String> {
    let server = match outboard_client::manager::ask(
        control,
        &Request::Open {
            name: device.into(),
        },
    )
    .map_err(|e| e.to_string())?
    {
        Reply::Open {
            server: Some(s), ..
        } => s,
        other => return Err(format!("open {device}: {other:?}")),
    };
    let opts = SessionOptions {
        depth: depth.next_power_of_two() as u32,
        buffer_size: (depth as u64 * BLOCK).next_multiple_of(4096),
        ..SessionOptions::default()
    };
    Ok(BlockClient::open(&server, device, opts)
        .map_err(|e| e.to_string())?
        .supervised(Supervisor {
            control: outboard_client::Control::Socket(control.to_owned()),
            patience: Duration::from_secs(60),
        }))
}

/// A client's thread: its report once `stop` is set and its region is read back.
pub type ClientThread = std::thread::JoinHandle<Result<ClientReport, String>>;

/// Opens a session on `device` for each client in `ids` and runs the workload on each in a
/// thread of its own until `stop` is set.
pub fn spawn_clients(
    control: &Path,
    device: &str,
    ids: std::ops::Range<u64>,
    w: Workload,
    stop: &std::sync::Arc<AtomicBool>,
) -> Result<Vec<ClientThread>, String> {
    ids.map(|id| {
        let mut dev = open(control, device, w.depth)?;
        let stop = stop.clone();
        Ok(std::thread::spawn(move || {
            run_client(&mut dev, id, w, &stop)
        }))
    })
    .collect()
}

/// Runs client `id` of the workload on `dev` until `stop` is set, then reads its whole region
/// back and checks it.
pub fn run_client(
    dev: &mut BlockClient,
    id: u64,
    w: Workload,
    stop: &AtomicBool,
) -> Result<ClientReport, String> {
    let sectors = BLOCK / dev.info().block_size as u64;
    let first = id * w.blocks;
    let mut acked = vec![0u64; w.blocks as usize];
    let mut newest = vec![0u64; w.blocks as usize];
    let mut writing = vec![false; w.blocks as usize];
    // The newest version of each block whose write failed: a write that fails may still have
    // taken effect (a device that wrote and then reported an error, or cut the completion
    // short), so reading it back is no mismatch — reading anything older than what was
    // acknowledged is.
    let mut failed = vec![0u64; w.blocks as usize];
    let mut slots: Vec<Option<Op>> = (0..w.depth).map(|_| None).collect();
    // When each slot's request was submitted: a failure is weighed against every fault it
    // lived through, not only the last one before its answer.
    let mut sent_at = vec![Instant::now(); w.depth];
    let mut r = ClientReport::default();
    let mut rng = xorshift(id.wrapping_add(1).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let mut out: Vec<BlockCompletion> = Vec::new();
    let mut buf = vec![0u8; BLOCK as usize];
    let mut submitted = 0u64;
    let mut verify_from = None;
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        if stopping && verify_from.is_none() {
            verify_from = Some(0u64);
        }
        for slot in 0..w.depth {
            if slots[slot].is_some() {
                continue;
            }
            rng = xorshift(rng);
            let op = match verify_from.as_mut() {
                // Stopping: read every block back, once nothing is in flight.
                Some(next) => {
                    if slots
                        .iter()
                        .any(|s| s.as_ref().is_some_and(|o| o.op != BlockOp::Read))
                        || *next >= w.blocks
                    {
                        break;
                    }
                    *next += 1;
                    let b = *next - 1;
                    Op {
                        op: BlockOp::Read,
                        block: b,
                        version: 0,
                        floor: acked[b as usize],
                    }
                }
                None => {
                    let block = (rng >> 8) % w.blocks;
                    let pick = rng % 100;
                    if submitted % w.flush_every == w.flush_every - 1 {
                        Op {
                            op: BlockOp::Flush,
                            block,
                            version: 0,
                            floor: 0,
                        }
                    } else if pick < 50 && !writing[block as usize] {
                        newest[block as usize] += 1;
                        writing[block as usize] = true;
                        Op {
                            op: BlockOp::Write,
                            block,
                            version: newest[block as usize],
                            floor: 0,
                        }
                    } else {
                        Op {
                            op: BlockOp::Read,
                            block,
                            version: 0,
                            floor: acked[block as usize],
                        }
                    }
                }
            };
            let offset = slot as u64 * BLOCK;
            if op.op == BlockOp::Write {
                stamp(id, first + op.block, op.version, &mut buf);
                dev.buffers()
                    .write(offset, &buf)
                    .map_err(|e| e.to_string())?;
            }
            let req = BlockRequest {
                op: op.op,
                lba: (first + op.block) * sectors,
                blocks: if op.op == BlockOp::Flush {
                    0
                } else {
                    sectors as u32
                },
                buf_offset: offset,
                tag: slot as u64,
            };
            dev.submit(&req).map_err(|e| format!("submit: {e}"))?;
            submitted += 1;
            slots[slot] = Some(op);
            sent_at[slot] = Instant::now();
        }
        dev.kick().map_err(|e| e.to_string())?;
        if slots.iter().all(Option::is_none) {
            break;
        }
        out.clear();
        dev.wait(&mut out, Duration::from_secs(60))
            .map_err(|e| format!("wait: {e}"))?;
        for c in &out {
            let Some(op) = slots.get_mut(c.tag as usize).and_then(Option::take) else {
                r.duplicates += 1;
                continue;
            };
            r.completed += 1;
            let b = op.block as usize;
            if let Err(e) = &c.result {
                r.failed.push(Failed {
                    sent: sent_at[c.tag as usize],
                    at: Instant::now(),
                    kind: error_kind(e),
                    what: format!("{:?} of block {}: {e}", op.op, first + op.block),
                });
                if op.op == BlockOp::Write {
                    writing[b] = false;
                    failed[b] = failed[b].max(op.version);
                }
                continue;
            }
            match op.op {
                BlockOp::Write => {
                    acked[b] = acked[b].max(op.version);
                    writing[b] = false;
                }
                BlockOp::Read => {
                    dev.buffers()
                        .read(c.tag * BLOCK, &mut buf)
                        .map_err(|e| e.to_string())?;
                    let seen = version_of(id, first + op.block, &buf);
                    let ok = seen.is_some_and(|v| v >= op.floor && v <= newest[b]);
                    // At the end, nothing is in flight: the block holds what was acknowledged
                    // last, or a later write that failed.
                    let exact = verify_from.is_none()
                        || seen == Some(acked[b])
                        || seen.is_some_and(|v| v > acked[b] && v <= failed[b]);
                    if !ok || !exact {
                        let what = match seen {
                            Some(_) => String::new(),
                            None => format!(" ({})", describe(&buf)),
                        };
                        r.mismatches.push(Failed {
                            sent: sent_at[c.tag as usize],
                            at: Instant::now(),
                            kind: "mismatch",
                            what: format!(
                                "block {}: read version {seen:?}{what}, acknowledged {} (at submission {}), newest {}, {}",
                                first + op.block,
                                acked[b],
                                op.floor,
                                newest[b],
                                if verify_from.is_some() { "read back at the end" } else { "under load" }
                            ),
                        });
                    }
                }
                _ => {}
            }
        }
    }
    r.resumes = dev.resume_log().to_vec();
    r.replayed = dev.resume_stats().replayed;
    r.requeued = dev.resume_stats().requeued;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_names_its_version_and_nothing_else_passes() {
        let mut b = vec![0; 4096];
        assert_eq!(version_of(1, 7, &b), Some(0));
        stamp(1, 7, 42, &mut b);
        assert_eq!(version_of(1, 7, &b), Some(42));
        assert_eq!(version_of(2, 7, &b), None);
        assert_eq!(version_of(1, 8, &b), None);
        b[4000] ^= 1;
        assert_eq!(version_of(1, 7, &b), None);
    }
}
