//! Block-range locks: what makes a client's read-modify-write of a partial block safe when
//! other clients write the same block.
//!
//! A client that writes part of a block reads the block, merges its bytes and writes the block
//! back. Two clients doing that to one block (each to its own bytes) each write back the
//! other's stale copy, and one acknowledged write is lost. So such a client first takes a
//! [`BlockOp::Lock`] on the blocks it will rewrite:
//!
//! - a lock is granted when no other session holds an overlapping lock, no other session's
//!   write to the range is in the device, and no other session's overlapping request waits
//!   ahead of it (first come, first served: a stream of writes cannot starve a lock);
//! - while it is held, other sessions' writes (write, write-zeroes, discard) and locks that
//!   overlap it wait here, parked in arrival order; reads are never held back;
//! - `Unlock`, or the end of the session, releases it and the parked requests go on.
//!
//! Only the host's single thread touches this: no atomics, no locks of its own.

use outboard_block::{BlockOp, BlockRequest};

/// `[start, end)` in blocks.
pub type Range = (u64, u64);

fn overlaps(a: Range, b: Range) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// The blocks a request covers, if it takes part in locking (writes and locks).
pub fn range_of(r: &BlockRequest) -> Option<Range> {
    let ordered = r.op.modifies() || matches!(r.op, BlockOp::Lock | BlockOp::Unlock);
    ordered.then(|| (r.lba, r.lba.saturating_add(r.blocks as u64)))
}

/// What to do with a request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// A lock that was granted: complete it.
    Granted,
    /// Send it to the device.
    Submit,
    /// It waits here for a conflicting lock or write to end.
    Parked,
}

/// One device's locks and the requests waiting on them.
#[derive(Debug, Default)]
pub struct RangeLocks {
    /// Held locks: (session, range).
    held: Vec<(usize, Range)>,
    /// Requests waiting, in arrival order: (session, request).
    parked: Vec<(usize, BlockRequest)>,
    /// Until then no new lock is granted: sessions of a restarted server's predecessor are
    /// still claiming back the locks they held ([`RangeLocks::reclaim`]).
    grace_until: Option<std::time::Instant>,
}

impl RangeLocks {
    /// Grants no new lock for `grace` from now: locks held under the previous server go to
    /// their holders first, whatever order the sessions resume in.
    pub fn start_grace(&mut self, grace: std::time::Duration) {
        self.grace_until = Some(std::time::Instant::now() + grace);
    }

    /// Whether the grace period runs.
    pub fn in_grace(&self) -> bool {
        self.grace_until
            .is_some_and(|t| std::time::Instant::now() < t)
    }

    /// Whether anything waits.
    pub fn has_parked(&self) -> bool {
        !self.parked.is_empty()
    }

    /// Requests waiting.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// The decision for `r` from `session`, given the requests parked ahead of it and whether
    /// another session's write to a range is in the device.
    fn decide(
        &self,
        session: usize,
        r: &BlockRequest,
        ahead: &[(usize, BlockRequest)],
        write_in_flight: &dyn Fn(usize, Range) -> bool,
    ) -> Decision {
        let Some(range) = range_of(r) else {
            return Decision::Submit;
        };
        let foreign_lock = self
            .held
            .iter()
            .any(|&(s, h)| s != session && overlaps(h, range));
        // The holder's own writes are what its lock is for: they never wait, not even behind
        // a lock someone else is waiting for (that lock waits for this one).
        let own_lock = self
            .held
            .iter()
            .any(|&(s, h)| s == session && overlaps(h, range));
        let waits_behind = ahead.iter().any(|(s, p)| {
            *s != session
                && (p.op == BlockOp::Lock || r.op == BlockOp::Lock)
                && range_of(p).is_some_and(|pr| overlaps(pr, range))
        });
        match r.op {
            BlockOp::Lock
                if foreign_lock
                    || waits_behind
                    || write_in_flight(session, range)
                    || self.in_grace() =>
            {
                Decision::Parked
            }
            BlockOp::Lock => Decision::Granted,
            _ if own_lock && !foreign_lock => Decision::Submit,
            _ if foreign_lock || waits_behind => Decision::Parked,
            _ => Decision::Submit,
        }
    }

    /// Admits a new request: a granted lock is recorded, a parked request kept.
    pub fn admit(
        &mut self,
        session: usize,
        r: BlockRequest,
        write_in_flight: &dyn Fn(usize, Range) -> bool,
    ) -> Decision {
        let d = self.decide(session, &r, &self.parked, write_in_flight);
        match d {
            Decision::Granted => self.held.push((session, range_of(&r).expect("a lock"))),
            Decision::Parked => self.parked.push((session, r)),
            Decision::Submit => {}
        }
        d
    }

    /// Releases `session`'s lock on exactly `r`'s range; false if it held none.
    pub fn unlock(&mut self, session: usize, r: &BlockRequest) -> bool {
        let range = range_of(r).expect("an unlock has a range");
        match self.held.iter().position(|&h| h == (session, range)) {
            Some(i) => {
                self.held.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// Moves the parked requests that may go on now into `out`, in order, recording granted
    /// locks; at most `room` of them are to be submitted to the device.
    pub fn release(
        &mut self,
        mut room: usize,
        write_in_flight: &dyn Fn(usize, Range) -> bool,
        out: &mut Vec<(usize, BlockRequest, Decision)>,
    ) {
        // Writes let go in this pass are not in the device yet, but a lock granted later in the
        // pass must wait for them all the same.
        let mut let_go: Vec<(usize, Range)> = Vec::new();
        let mut i = 0;
        while i < self.parked.len() {
            let (session, r) = self.parked[i];
            let in_flight = |s: usize, range: Range| {
                write_in_flight(s, range)
                    || let_go.iter().any(|&(o, w)| o != s && overlaps(w, range))
            };
            let d = self.decide(session, &r, &self.parked[..i], &in_flight);
            match d {
                Decision::Parked => i += 1,
                Decision::Submit if room == 0 => i += 1,
                Decision::Submit => {
                    room -= 1;
                    self.parked.remove(i);
                    if let Some(w) = range_of(&r).filter(|_| r.op.modifies()) {
                        let_go.push((session, w));
                    }
                    out.push((session, r, d));
                }
                Decision::Granted => {
                    self.held.push((session, range_of(&r).expect("a lock")));
                    self.parked.remove(i);
                    out.push((session, r, d));
                }
            }
        }
    }

    /// Forgets a session that ended: its locks are released; returns its parked requests.
    pub fn end_session(&mut self, session: usize) -> Vec<BlockRequest> {
        self.held.retain(|&(s, _)| s != session);
        let (gone, kept) = self.parked.drain(..).partition(|(s, _)| *s == session);
        self.parked = kept;
        gone.into_iter().map(|(_, r)| r).collect()
    }

    /// Grants `session` the locks it held under a previous server (a resumed session). They
    /// are refused, and none is granted, if one overlaps a lock another session holds: two
    /// sessions cannot both have held it.
    pub fn reclaim(&mut self, session: usize, ranges: &[Range]) -> Result<(), String> {
        for &r in ranges {
            if r.0 >= r.1 {
                return Err(format!("lock range {r:?} is empty"));
            }
            if let Some((_, h)) = self
                .held
                .iter()
                .find(|&&(s, h)| s != session && overlaps(h, r))
            {
                return Err(format!(
                    "lock on blocks {}..{} overlaps blocks {}..{}, held by another session",
                    r.0, r.1, h.0, h.1
                ));
            }
        }
        self.held.extend(ranges.iter().map(|&r| (session, r)));
        Ok(())
    }

    /// Drops everything (the device failed); returns every parked request.
    pub fn clear(&mut self) -> Vec<(usize, BlockRequest)> {
        self.held.clear();
        std::mem::take(&mut self.parked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn during_the_grace_period_locks_go_back_to_their_holders_and_no_new_one_is_granted() {
        let mut l = RangeLocks::default();
        l.start_grace(std::time::Duration::from_millis(200));
        let none = |_: usize, _: Range| false;
        // Session 1 asks first, for what session 0 held before the restart.
        let r = req(BlockOp::Lock, 0, 8, 1);
        assert_eq!(l.admit(1, r, &none), Decision::Parked);
        // Even a lock nobody held waits.
        assert_eq!(
            l.admit(2, req(BlockOp::Lock, 100, 8, 2), &none),
            Decision::Parked
        );
        // Session 0 resumes and claims its lock back: it is its own again.
        l.reclaim(0, &[(0, 8)]).unwrap();
        let mut out = Vec::new();
        l.release(4, &none, &mut out);
        assert!(out.is_empty(), "nothing is granted during the grace period");
        std::thread::sleep(std::time::Duration::from_millis(250));
        l.release(4, &none, &mut out);
        // After it: the lock nobody holds is granted; session 1's waits for session 0's.
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].0, out[0].2), (2, Decision::Granted));
        assert!(l.unlock(0, &req(BlockOp::Unlock, 0, 8, 3)));
        out.clear();
        l.release(4, &none, &mut out);
        assert_eq!((out[0].0, out[0].2), (1, Decision::Granted));
    }

    fn req(op: BlockOp, lba: u64, blocks: u32, tag: u64) -> BlockRequest {
        BlockRequest {
            op,
            lba,
            blocks,
            buf_offset: 0,
            tag,
        }
    }
    const NONE: &dyn Fn(usize, Range) -> bool = &|_, _| false;

    #[test]
    fn reclaimed_locks_hold_back_others_and_conflicting_reclaims_are_refused() {
        let mut l = RangeLocks::default();
        l.reclaim(1, &[(10, 20)]).unwrap();
        assert_eq!(
            l.admit(2, req(BlockOp::Write, 15, 1, 1), NONE),
            Decision::Parked
        );
        assert_eq!(
            l.admit(1, req(BlockOp::Write, 15, 1, 2), NONE),
            Decision::Submit
        );
        let e = l.reclaim(3, &[(0, 4), (19, 30)]).unwrap_err();
        assert!(e.contains("19..30"), "{e}");
        assert!(l.reclaim(3, &[(5, 5)]).is_err());
        // Neither of session 3's ranges was granted.
        assert_eq!(
            l.admit(2, req(BlockOp::Lock, 0, 4, 3), NONE),
            Decision::Granted
        );
    }

    #[test]
    fn a_lock_holds_back_other_sessions_writes_until_unlocked() {
        let mut l = RangeLocks::default();
        assert_eq!(
            l.admit(1, req(BlockOp::Lock, 10, 2, 1), NONE),
            Decision::Granted
        );
        // Session 2's write to block 11 waits; its write elsewhere and its read do not.
        assert_eq!(
            l.admit(2, req(BlockOp::Write, 11, 1, 2), NONE),
            Decision::Parked
        );
        assert_eq!(
            l.admit(2, req(BlockOp::Write, 12, 1, 3), NONE),
            Decision::Submit
        );
        assert_eq!(
            l.admit(2, req(BlockOp::Read, 10, 2, 4), NONE),
            Decision::Submit
        );
        // The holder's own writes go through.
        assert_eq!(
            l.admit(1, req(BlockOp::Write, 10, 2, 5), NONE),
            Decision::Submit
        );
        // A second lock on the range waits too.
        assert_eq!(
            l.admit(3, req(BlockOp::Lock, 11, 1, 6), NONE),
            Decision::Parked
        );
        let mut out = Vec::new();
        l.release(8, NONE, &mut out);
        assert!(out.is_empty(), "nothing moves while the lock is held");
        assert!(l.unlock(1, &req(BlockOp::Unlock, 10, 2, 7)));
        l.release(8, NONE, &mut out);
        // In arrival order: session 2's write goes to the device; then session 3's lock must
        // still wait for that write to leave the device, which the host reports.
        assert_eq!(
            out,
            vec![(2, req(BlockOp::Write, 11, 1, 2), Decision::Submit)]
        );
        out.clear();
        let busy: &dyn Fn(usize, Range) -> bool = &|s, r| s != 2 || overlaps(r, (11, 12));
        l.release(8, busy, &mut out);
        assert!(out.is_empty(), "session 2's write is still in the device");
        l.release(8, NONE, &mut out);
        assert_eq!(
            out,
            vec![(3, req(BlockOp::Lock, 11, 1, 6), Decision::Granted)]
        );
    }

    #[test]
    fn the_holders_writes_pass_a_lock_waiting_behind_its_own() {
        let mut l = RangeLocks::default();
        assert_eq!(
            l.admit(1, req(BlockOp::Lock, 0, 2, 1), NONE),
            Decision::Granted
        );
        assert_eq!(
            l.admit(2, req(BlockOp::Lock, 1, 1, 2), NONE),
            Decision::Parked
        );
        // Session 1 writes its locked blocks back: it must not wait for session 2's lock,
        // which waits for session 1's.
        assert_eq!(
            l.admit(1, req(BlockOp::Write, 0, 2, 3), NONE),
            Decision::Submit
        );
    }

    #[test]
    fn a_waiting_lock_is_not_starved_by_later_writes() {
        let mut l = RangeLocks::default();
        assert_eq!(
            l.admit(1, req(BlockOp::Lock, 0, 1, 1), NONE),
            Decision::Granted
        );
        assert_eq!(
            l.admit(2, req(BlockOp::Lock, 0, 1, 2), NONE),
            Decision::Parked
        );
        // Session 3's later write waits behind session 2's lock, even after 1 unlocks.
        assert_eq!(
            l.admit(3, req(BlockOp::Write, 0, 1, 3), NONE),
            Decision::Parked
        );
        assert!(l.unlock(1, &req(BlockOp::Unlock, 0, 1, 4)));
        let mut out = Vec::new();
        l.release(8, NONE, &mut out);
        assert_eq!(
            out,
            vec![(2, req(BlockOp::Lock, 0, 1, 2), Decision::Granted)]
        );
    }

    #[test]
    fn a_session_that_ends_releases_its_locks_and_parked_requests() {
        let mut l = RangeLocks::default();
        l.admit(1, req(BlockOp::Lock, 0, 4, 1), NONE);
        l.admit(2, req(BlockOp::Write, 1, 1, 2), NONE);
        l.admit(1, req(BlockOp::Lock, 8, 1, 3), NONE);
        l.admit(3, req(BlockOp::Lock, 8, 1, 4), NONE);
        assert_eq!(l.end_session(2), vec![req(BlockOp::Write, 1, 1, 2)]);
        assert!(l.end_session(1).is_empty());
        let mut out = Vec::new();
        l.release(8, NONE, &mut out);
        assert_eq!(
            out,
            vec![(3, req(BlockOp::Lock, 8, 1, 4), Decision::Granted)]
        );
        assert!(
            !l.unlock(1, &req(BlockOp::Unlock, 0, 4, 5)),
            "gone with its session"
        );
    }

    mod model {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Step {
            Lock(usize, u64, u32),
            Write(usize, u64, u32),
            Unlock(usize),
            Complete,
            End(usize),
        }

        fn step() -> impl Strategy<Value = Step> {
            prop_oneof![
                (0..3usize, 0..8u64, 1..4u32).prop_map(|(s, l, n)| Step::Lock(s, l, n)),
                (0..3usize, 0..8u64, 1..4u32).prop_map(|(s, l, n)| Step::Write(s, l, n)),
                (0..3usize).prop_map(Step::Unlock),
                Just(Step::Complete),
                (0..3usize).prop_map(Step::End),
            ]
        }

        proptest! {
            /// Whatever the interleaving: no two sessions hold overlapping locks; no lock is
            /// granted over another session's write in the device; no write enters the device
            /// over another session's lock; and once locks end and writes finish, nothing
            /// stays parked.
            #[test]
            fn locks_exclude_and_everything_finishes(steps in proptest::collection::vec(step(), 1..60)) {
                let mut l = RangeLocks::default();
                let mut devices: Vec<(usize, Range)> = Vec::new(); // writes in the device
                let mut held: Vec<(usize, BlockRequest)> = Vec::new();
                let mut tag = 0;
                let mut out = Vec::new();
                let check_grant = |s: usize, r: &BlockRequest, held: &[(usize, BlockRequest)], dev: &[(usize, Range)]| {
                    let rr = range_of(r).unwrap();
                    assert!(!held.iter().any(|(o, h)| *o != s && overlaps(range_of(h).unwrap(), rr)), "overlapping locks");
                    assert!(!dev.iter().any(|(o, w)| *o != s && overlaps(*w, rr)), "lock over a write in flight");
                };
                let check_submit = |s: usize, r: &BlockRequest, held: &[(usize, BlockRequest)]| {
                    let rr = range_of(r).unwrap();
                    assert!(!held.iter().any(|(o, h)| *o != s && overlaps(range_of(h).unwrap(), rr)), "write under a foreign lock");
                };
                for st in steps {
                    tag += 1;
                    match st {
                        Step::Lock(s, lba, n) | Step::Write(s, lba, n) => {
                            let op = if matches!(st, Step::Lock(..)) { BlockOp::Lock } else { BlockOp::Write };
                            let r = req(op, lba, n, tag);
                            let dev = devices.clone();
                            let d = l.admit(s, r, &|o, rr| dev.iter().any(|(x, w)| *x != o && overlaps(*w, rr)));
                            match d {
                                Decision::Granted => { check_grant(s, &r, &held, &devices); held.push((s, r)); }
                                Decision::Submit => { check_submit(s, &r, &held); devices.push((s, range_of(&r).unwrap())); }
                                Decision::Parked => {}
                            }
                        }
                        Step::Unlock(s) => {
                            if let Some(i) = held.iter().position(|(o, _)| *o == s) {
                                let (_, r) = held.remove(i);
                                prop_assert!(l.unlock(s, &req(BlockOp::Unlock, r.lba, r.blocks, 0)));
                            }
                        }
                        Step::Complete => { if !devices.is_empty() { devices.remove(0); } }
                        Step::End(s) => { l.end_session(s); held.retain(|(o, _)| *o != s); }
                    }
                    out.clear();
                    let dev = devices.clone();
                    l.release(4, &|o, rr| dev.iter().any(|(x, w)| *x != o && overlaps(*w, rr)), &mut out);
                    for (s, r, d) in out.drain(..) {
                        match d {
                            Decision::Granted => { check_grant(s, &r, &held, &devices); held.push((s, r)); }
                            Decision::Submit => { check_submit(s, &r, &held); devices.push((s, range_of(&r).unwrap())); }
                            Decision::Parked => unreachable!(),
                        }
                    }
                }
                // Drain: every lock released, every write finished; nothing may stay parked.
                for _ in 0..100 {
                    for (s, r) in held.drain(..) {
                        l.unlock(s, &req(BlockOp::Unlock, r.lba, r.blocks, 0));
                    }
                    devices.clear();
                    out.clear();
                    l.release(usize::MAX, &|_, _| false, &mut out);
                    for (s, r, d) in out.drain(..) {
                        if d == Decision::Granted { held.push((s, r)); }
                    }
                    if !l.has_parked() && held.is_empty() { break; }
                }
                prop_assert!(!l.has_parked(), "requests left parked forever");
            }
        }
    }
}
