//! What a session client remembers of each request until it completes, so that a request can
//! be sent again to a restarted server (docs/restart.md).
//!
//! A request travels under the slot it occupies here (its wire tag); the caller's own tag is
//! given back at completion. For each write still in flight the table also records the blocks
//! that writes acknowledged *after it was submitted* have since written: replaying the older
//! write over them would make it land after a write that was acknowledged later, so the replay
//! leaves those blocks out ([`InFlight::replay`]). Leaving them out is the same as the older
//! write having taken effect first, which the client cannot tell apart, because it had not been
//! acknowledged.
//!
//! Locks the session holds are remembered too: a resumed session claims them back before it
//! replays anything.

use outboard_block::{BlockCompletion, BlockError, BlockOp, BlockRequest};

/// `[start, end)` in blocks.
type Range = (u64, u64);

fn range(r: &BlockRequest) -> Range {
    (r.lba, r.lba.saturating_add(r.blocks as u64))
}

/// One request the server has not answered.
#[derive(Debug, Clone)]
struct Pending {
    /// As the caller submitted it (its tag is the caller's).
    req: BlockRequest,
    /// Submission order, for replay.
    seq: u64,
    /// Where it went on the server's ring, if anywhere.
    staged: Staged,
    /// Blocks written by writes acknowledged since this write was submitted (writes only),
    /// kept sorted and merged.
    written_since: Vec<Range>,
}

/// Where a request went on the server's ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Staged {
    /// Nowhere yet (recorded while the server was gone): no server has seen it.
    Not,
    /// At this position of the current server's ring.
    At(u32),
    /// Sent again in a replay: a server may have taken it.
    Resent,
}

/// A piece of a request to send again: `req` carries the wire tag to send it under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayPart {
    /// The slot of the request it belongs to.
    pub slot: u32,
    /// Whether a server may have taken it (sent again, it is a replay), or none did (it
    /// waited in a ring: sent again, it is sent for the first time).
    pub taken: bool,
    /// The request to send (for a write: possibly a part of the original's blocks, with the
    /// buffer offset moved along).
    pub req: BlockRequest,
}

/// Requests in flight on one session.
#[derive(Debug, Default)]
pub struct InFlight {
    slots: Vec<Option<Pending>>,
    free: Vec<u32>,
    len: usize,
    /// Writes in flight: when there is at most one, an acknowledgement has nothing to record.
    writes: usize,
    next_seq: u64,
    /// Locks granted and not yet released: (first block, blocks).
    locks: Vec<(u64, u32)>,
    /// Bytes per block: a replayed part's buffer offset moves with its first block.
    block_size: u64,
}

impl InFlight {
    /// An empty table for a device with blocks of `block_size` bytes.
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size: block_size as u64,
            ..Self::default()
        }
    }

    /// Requests in flight.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether none is.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The locks the session holds.
    pub fn locks(&self) -> &[(u64, u32)] {
        &self.locks
    }

    /// Records `req`; returns the request to put on the wire (the slot as its tag).
    #[inline]
    pub fn insert(&mut self, req: &BlockRequest) -> BlockRequest {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        if req.op.modifies() {
            self.writes += 1;
        }
        self.slots[slot as usize] = Some(Pending {
            req: *req,
            seq: self.next_seq,
            staged: Staged::Not,
            written_since: Vec::new(),
        });
        self.next_seq += 1;
        self.len += 1;
        BlockRequest {
            tag: slot as u64,
            ..*req
        }
    }

    /// Forgets a request that never reached the ring (it did not fit).
    pub fn cancel(&mut self, slot: u64) {
        self.take(slot);
    }

    fn take(&mut self, slot: u64) -> Option<Pending> {
        let p = self.slots.get_mut(usize::try_from(slot).ok()?)?.take()?;
        self.free.push(slot as u32);
        self.len -= 1;
        if p.req.op.modifies() {
            self.writes -= 1;
        }
        Some(p)
    }

    /// The server answered the request in `slot`: returns the caller's completion, or an
    /// error if no request is in flight there (the server broke the protocol).
    #[inline]
    pub fn complete(
        &mut self,
        slot: u64,
        result: Result<u32, BlockError>,
    ) -> Result<BlockCompletion, BlockError> {
        let p = self.take(slot).ok_or_else(|| {
            BlockError::Protocol(format!(
                "a completion for tag {slot}, which is not in flight"
            ))
        })?;
        if result.is_ok() {
            self.acknowledged(&p.req);
        }
        Ok(BlockCompletion {
            tag: p.req.tag,
            result,
        })
    }

    /// Records what an acknowledged request changes for the ones still in flight.
    fn acknowledged(&mut self, r: &BlockRequest) {
        match r.op {
            BlockOp::Lock => self.locks.push((r.lba, r.blocks)),
            BlockOp::Unlock => {
                if let Some(i) = self.locks.iter().position(|&l| l == (r.lba, r.blocks)) {
                    self.locks.swap_remove(i);
                }
            }
            op if op.modifies() && self.writes > 0 => {
                let done = range(r);
                for p in self.slots.iter_mut().flatten() {
                    if p.req.op.modifies() {
                        let mine = range(&p.req);
                        let (s, e) = (mine.0.max(done.0), mine.1.min(done.1));
                        if s < e {
                            add_range(&mut p.written_since, (s, e));
                        }
                    }
                }
            }
            _ => {}
        }
    }

    /// What to send again, in submission order, after a server restart: each request whole,
    /// except a write, which loses the blocks written since by writes acknowledged later
    /// (and may so become several parts, or none). Also returns the completions of writes with
    /// nothing left to write: they are finished already.
    pub fn replay(&self, taken: u32) -> (Vec<ReplayPart>, Vec<u32>) {
        let mut order: Vec<(u64, u32)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.as_ref().map(|p| (p.seq, i as u32)))
            .collect();
        order.sort_unstable();
        let mut parts = Vec::new();
        let mut covered = Vec::new();
        for (_, slot) in order {
            let p = self.slots[slot as usize].as_ref().expect("listed");
            let was_taken = match p.staged {
                Staged::Not => false,
                Staged::At(pos) => outboard_session::ring::was_taken(pos, taken),
                Staged::Resent => true,
            };
            if !p.req.op.modifies() || p.written_since.is_empty() {
                parts.push(ReplayPart {
                    slot,
                    taken: was_taken,
                    req: p.req,
                });
                continue;
            }
            let left = subtract(range(&p.req), &p.written_since);
            if left.is_empty() {
                covered.push(slot);
            }
            for (s, e) in left {
                let mut req = p.req;
                req.lba = s;
                req.blocks = (e - s) as u32;
                // Unchecked requests reach this table (the server checks them): an offset past
                // any buffer stays past it instead of wrapping, and is refused there again.
                req.buf_offset = p
                    .req
                    .buf_offset
                    .saturating_add((s - p.req.lba).saturating_mul(self.block_size));
                parts.push(ReplayPart {
                    slot,
                    taken: was_taken,
                    req,
                });
            }
        }
        (parts, covered)
    }

    /// `slot`'s request went on the server's ring at `position`.
    pub fn staged_at(&mut self, slot: u64, position: u32) {
        if let Some(Some(p)) = self.slots.get_mut(slot as usize) {
            p.staged = Staged::At(position);
        }
    }

    /// Every request is being sent again: from now on a server may have taken each.
    pub fn resent(&mut self) {
        for p in self.slots.iter_mut().flatten() {
            p.staged = Staged::Resent;
        }
    }

    /// The request in `slot`, as the caller submitted it.
    pub fn request(&self, slot: u32) -> Option<&BlockRequest> {
        self.slots.get(slot as usize)?.as_ref().map(|p| &p.req)
    }

    /// Every slot in flight.
    pub fn slots(&self) -> Vec<u32> {
        (0..self.slots.len() as u32)
            .filter(|&i| self.slots[i as usize].is_some())
            .collect()
    }
}

/// Adds `r` to a sorted list of disjoint ranges, merging neighbours.
fn add_range(list: &mut Vec<Range>, r: Range) {
    let mut merged = r;
    list.retain(|&(s, e)| {
        if e < merged.0 || s > merged.1 {
            true
        } else {
            merged = (merged.0.min(s), merged.1.max(e));
            false
        }
    });
    let at = list.partition_point(|&(s, _)| s < merged.0);
    list.insert(at, merged);
}

/// `whole` minus sorted, disjoint `holes`.
fn subtract(whole: Range, holes: &[Range]) -> Vec<Range> {
    let mut out = Vec::new();
    let mut at = whole.0;
    for &(s, e) in holes {
        if s > at {
            out.push((at, s.min(whole.1)));
        }
        at = at.max(e);
        if at >= whole.1 {
            break;
        }
    }
    if at < whole.1 {
        out.push((at, whole.1));
    }
    out.retain(|(s, e)| s < e);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(op: BlockOp, lba: u64, blocks: u32, tag: u64) -> BlockRequest {
        BlockRequest {
            op,
            lba,
            blocks,
            buf_offset: lba * 512,
            tag,
        }
    }

    #[test]
    fn tags_go_back_to_the_caller_and_unknown_slots_are_protocol_errors() {
        let mut t = InFlight::new(512);
        let a = t.insert(&req(BlockOp::Read, 0, 1, 77));
        let b = t.insert(&req(BlockOp::Read, 1, 1, 77 << 40));
        assert_ne!(a.tag, b.tag);
        assert_eq!(t.complete(b.tag, Ok(512)).unwrap().tag, 77 << 40);
        assert!(matches!(
            t.complete(b.tag, Ok(512)),
            Err(BlockError::Protocol(_))
        ));
        assert!(matches!(
            t.complete(9999, Ok(0)),
            Err(BlockError::Protocol(_))
        ));
        assert_eq!(t.complete(a.tag, Ok(512)).unwrap().tag, 77);
        assert!(t.is_empty());
    }

    #[test]
    fn a_replayed_write_leaves_out_blocks_a_later_acknowledged_write_wrote() {
        let mut t = InFlight::new(512);
        let old = t.insert(&req(BlockOp::Write, 0, 10, 1));
        let read = t.insert(&req(BlockOp::Read, 0, 10, 2));
        let newer = t.insert(&req(BlockOp::Write, 3, 2, 3));
        t.complete(newer.tag, Ok(1024)).unwrap();
        let (parts, covered) = t.replay(0);
        assert!(covered.is_empty());
        let ranges: Vec<_> = parts
            .iter()
            .map(|p| (p.slot, p.req.lba, p.req.blocks))
            .collect();
        assert_eq!(
            ranges,
            [
                (old.tag as u32, 0, 3),
                (old.tag as u32, 5, 5),
                (read.tag as u32, 0, 10)
            ]
        );
        assert_eq!(parts[1].req.buf_offset, 5 * 512);
        // A failed write wrote nothing that counts.
        let mut t = InFlight::new(512);
        t.insert(&req(BlockOp::Write, 0, 4, 1));
        let failed = t.insert(&req(BlockOp::Write, 0, 4, 2));
        t.complete(failed.tag, Err(BlockError::Io("bad sector".into())))
            .unwrap();
        assert_eq!(t.replay(0).0[0].req.blocks, 4);
    }

    #[test]
    fn a_write_wholly_overwritten_since_is_finished_without_replay() {
        let mut t = InFlight::new(512);
        let old = t.insert(&req(BlockOp::Write, 4, 2, 1));
        let newer = t.insert(&req(BlockOp::WriteZeroes, 0, 8, 2));
        t.complete(newer.tag, Ok(0)).unwrap();
        let (parts, covered) = t.replay(0);
        assert!(parts.is_empty());
        assert_eq!(covered, [old.tag as u32]);
    }

    #[test]
    fn locks_held_are_remembered_until_unlocked() {
        let mut t = InFlight::new(512);
        let l = t.insert(&req(BlockOp::Lock, 8, 2, 1));
        assert!(t.locks().is_empty());
        t.complete(l.tag, Ok(0)).unwrap();
        assert_eq!(t.locks(), [(8, 2)]);
        let u = t.insert(&req(BlockOp::Unlock, 8, 2, 2));
        t.complete(u.tag, Ok(0)).unwrap();
        assert!(t.locks().is_empty());
    }

    proptest! {
        /// Whatever writes are acknowledged while one is in flight, its replay covers exactly
        /// its blocks that none of them wrote, in order, without overlap.
        #[test]
        fn replay_parts_are_the_blocks_no_later_write_wrote(
            start in 0u64..64,
            len in 1u32..64,
            later in proptest::collection::vec((0u64..128, 1u32..32, any::<bool>()), 0..12),
        ) {
            let mut t = InFlight::new(512);
            let old = t.insert(&req(BlockOp::Write, start, len, 0));
            let mut written = std::collections::BTreeSet::new();
            for (i, (lba, n, ok)) in later.iter().enumerate() {
                let w = t.insert(&req(BlockOp::Write, *lba, *n, i as u64 + 1));
                let result = if *ok {
                    Ok(0)
                } else {
                    Err(BlockError::Io("bad sector".into()))
                };
                t.complete(w.tag, result).unwrap();
                if *ok {
                    written.extend(*lba..*lba + *n as u64);
                }
            }
            let (parts, covered) = t.replay(0);
            let mut replayed = Vec::new();
            for p in &parts {
                prop_assert_eq!(p.slot as u64, old.tag);
                prop_assert_eq!(p.req.buf_offset, p.req.lba * 512);
                replayed.extend(p.req.lba..p.req.lba + p.req.blocks as u64);
            }
            let expected: Vec<u64> =
                (start..start + len as u64).filter(|b| !written.contains(b)).collect();
            prop_assert_eq!(&replayed, &expected);
            prop_assert_eq!(covered.is_empty(), !expected.is_empty());
        }
    }

    #[test]
    fn a_request_the_server_never_took_is_not_a_replay() {
        let mut t = InFlight::new(512);
        let read = |lba| BlockRequest {
            op: BlockOp::Read,
            lba,
            blocks: 1,
            buf_offset: 0,
            tag: 0,
        };
        // Staged at ring positions 5 and 6; the server took 6 entries (0..=5); one more was
        // recorded while the server was gone and went on no ring.
        let a = t.insert(&read(0));
        t.staged_at(a.tag, 5);
        let b = t.insert(&read(1));
        t.staged_at(b.tag, 6);
        t.insert(&read(2));
        let taken: Vec<bool> = t.replay(6).0.iter().map(|p| p.taken).collect();
        assert_eq!(taken, vec![true, false, false]);
        // Positions wrap: staged at the last position, taken past it.
        t.staged_at(a.tag, u32::MAX);
        assert!(t.replay(1).0[0].taken);
        // Once sent again, any of them may have been taken by the next server.
        t.resent();
        assert!(t.replay(0).0.iter().all(|p| p.taken));
    }
}
