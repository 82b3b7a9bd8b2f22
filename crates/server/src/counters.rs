//! Counters a driver server keeps per device and per session, in a memfd it shares with the
//! manager, which reads them on demand (`outboard ls --json`, `outboard top`, the metrics
//! endpoint): requests taken and answered, bytes, errors by kind, and a latency histogram.
//!
//! Free on the hot path: one thread (the server's loop) writes every record, so a count is a
//! plain load and store, no locked instruction, and a request is counted once, in its
//! session's record; the reader adds the live sessions to their device's record, into which a
//! released session's counts move (under a sequence word, so a reader never counts them twice
//! or not at all). The page is the server's: a client never sees
//! it, so a client cannot forge another's counts. When a server dies the page outlives it in
//! the manager's mapping, which adds the last counts to what it carries across restarts: a
//! crash loses no count. Session records belong to one incarnation (a resumed session gets a
//! new record in the next server). (A server killed within the few nanoseconds of moving a
//! released session's counts leaves them half moved; its last counts are then inexact.)
//!
//! Layout (little-endian words; pinned by the tests below):
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic u64 ([`MAGIC`]) |
//! | 8 | version u32, devices u32 |
//! | 16 | session records per device u32, words per record u32 |
//! | 4096 + [`DEVICE_BYTES`]·d | device d: name (64 bytes), class (32), error kind names (16 × 32) |
//! | … + 1024 | its own record, then [`SESSIONS`] session records, [`RECORD_WORDS`] words each |
//!
//! A record: session id (0: a free slot; the device's own record: 0), client pid, a sequence
//! word (the device's record's; odd while a released session's counts move in), requests
//! taken, requests answered, bytes (what successes returned: block and entropy count bytes),
//! the sum of the latencies timed in ns, errors, sessions resumed after a restart, requests
//! their clients said they sent again (the class's replay), errors by kind ([`KINDS`]: the
//! class's code `-k` at `k`, any other at 0), then [`BUCKETS`] histogram buckets (whose sum is
//! the number of latencies timed, and whose highest non-empty one bounds the largest).
//!
//! Latency is measured for the requests a class times (block: those that entered the device,
//! from entering it to the server finding their completion).

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use outboard_shm::{Access, SharedMem, ShmError, Words};

/// "OBCOUNTS".
pub const MAGIC: u64 = u64::from_le_bytes(*b"OBCOUNTS");
/// Layout version.
pub const VERSION: u32 = 1;
/// Most devices one page describes.
pub const MAX_DEVICES: usize = 64;
/// Session records per device; sessions beyond these count in their device only.
pub const SESSIONS: usize = 32;
/// Error kinds counted apart (codes `-1` to `-(KINDS - 1)`; others together at 0).
pub const KINDS: usize = 24;
/// Histogram buckets: 8 per power of two (12.5% wide), from 1 ns to about 18 minutes.
pub const BUCKETS: usize = 304;

mod w {
    //! Word indices in a record; what every answer touches first, on one cache line.
    pub const ID: usize = 0;
    pub const PID: usize = 1;
    /// The device record's sequence word: odd while a released session's counts move in.
    pub const SEQ: usize = 2;
    pub const TAKEN: usize = 3;
    pub const ANSWERED: usize = 4;
    pub const BYTES: usize = 5;
    pub const SUM: usize = 6;
    pub const ERRORS: usize = 7;
    pub const RESUMES: usize = 8;
    pub const REPLAYS: usize = 9;
    pub const KINDS: usize = 10;
    pub const HIST: usize = KINDS + super::KINDS;
}

/// Words per record (rounded to whole cache lines).
pub const RECORD_WORDS: usize = (w::HIST + BUCKETS).div_ceil(8) * 8;
const HEADER_BYTES: u64 = 4096;
const NAME: usize = 64;
const CLASS: usize = 32;
const KIND_NAME: usize = 32;
const DESCRIPTOR_BYTES: u64 = 1024;
/// Bytes per device: its descriptor, its record and its sessions', whole pages.
pub const DEVICE_BYTES: u64 =
    (DESCRIPTOR_BYTES + ((1 + SESSIONS) * RECORD_WORDS * 8) as u64).div_ceil(4096) * 4096;

/// The bytes of a page for `devices` devices.
pub fn page_bytes(devices: usize) -> u64 {
    HEADER_BYTES + DEVICE_BYTES * devices as u64
}

fn device_at(d: usize) -> u64 {
    HEADER_BYTES + DEVICE_BYTES * d as u64
}

fn record_at(d: usize, r: usize) -> u64 {
    device_at(d) + DESCRIPTOR_BYTES + (r * RECORD_WORDS * 8) as u64
}

/// The histogram bucket of `ns`.
#[inline]
pub fn bucket(ns: u64) -> usize {
    if ns < 8 {
        return ns as usize;
    }
    let e = 63 - ns.leading_zeros() as usize;
    ((e - 2) * 8 + ((ns >> (e - 3)) & 7) as usize).min(BUCKETS - 1)
}

/// The smallest value bucket `i` holds.
pub fn bucket_floor(i: usize) -> u64 {
    if i < 8 {
        return i as u64;
    }
    let (e, m) = (i / 8 + 2, (i % 8) as u64);
    (8 + m) << (e - 3)
}

/// One writer's increment (no other thread writes the word).
#[inline]
fn add(word: &AtomicU64, by: u64) {
    word.store(
        word.load(Ordering::Relaxed).wrapping_add(by),
        Ordering::Relaxed,
    );
}

/// What a device is, for the descriptor.
#[derive(Debug, Clone)]
pub struct Described {
    /// Its class device name.
    pub name: String,
    /// Its class.
    pub class: String,
    /// Its class's error kinds: the name of code `-k` at `k - 1`.
    pub kinds: Vec<&'static str>,
}

/// The server's page: written by its loop.
pub struct Counters {
    page: Arc<SharedMem>,
    devices: usize,
}

fn put_str(page: &SharedMem, at: u64, room: usize, s: &str) -> Result<(), ShmError> {
    let mut b = vec![0u8; room];
    let n = s.len().min(room - 1);
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
    page.write(at, &b)
}

impl Counters {
    /// A new page describing `devices`, sealed against resizing (the manager maps it).
    pub fn create(devices: &[Described]) -> Result<Self, ShmError> {
        let n = devices.len().min(MAX_DEVICES);
        let page = SharedMem::create("outboard-counters", page_bytes(n) as usize)?;
        page.seal_size()?;
        page.write_u64(0, MAGIC)?;
        page.write_u32(8, VERSION)?;
        page.write_u32(12, n as u32)?;
        page.write_u32(16, SESSIONS as u32)?;
        page.write_u32(20, RECORD_WORDS as u32)?;
        for (d, dev) in devices.iter().take(n).enumerate() {
            let at = device_at(d);
            put_str(&page, at, NAME, &dev.name)?;
            put_str(&page, at + NAME as u64, CLASS, &dev.class)?;
            for (k, kind) in dev.kinds.iter().take(KINDS - 1).enumerate() {
                let off = at + (NAME + CLASS + (k + 1) * KIND_NAME) as u64;
                put_str(&page, off, KIND_NAME, kind)?;
            }
        }
        Ok(Self {
            page: Arc::new(page),
            devices: n,
        })
    }

    /// The page, to pass to the manager.
    pub fn page(&self) -> &SharedMem {
        &self.page
    }

    /// The tally for a new session `id` of device `d` (client `pid`): its own record if one
    /// is free, else its device's.
    pub fn open(&self, d: usize, id: u64, pid: u32) -> Option<Tally> {
        if d >= self.devices {
            return None;
        }
        let words = |r: usize| Words::new(self.page.clone(), record_at(d, r), RECORD_WORDS).ok();
        let device = words(0)?;
        let session = (1..=SESSIONS).find_map(|r| {
            let rec = words(r)?;
            if rec.get()[w::ID].load(Ordering::Relaxed) != 0 {
                return None;
            }
            // A reused slot still holds the counts of the session released from it (they
            // are in the device's record now): cleaned inside a write of the sequence word,
            // so that no reader sees the new id beside the old counts.
            let seq = &device.get()[w::SEQ];
            let n = seq.load(Ordering::Relaxed);
            seq.store(n.wrapping_add(1), Ordering::Relaxed);
            fence(Ordering::Release);
            for word in rec.get() {
                word.store(0, Ordering::Relaxed);
            }
            rec.get()[w::PID].store(u64::from(pid), Ordering::Relaxed);
            rec.get()[w::ID].store(id.max(1), Ordering::Relaxed);
            seq.store(n.wrapping_add(2), Ordering::Release);
            Some(rec)
        });
        Some(match session {
            Some(record) => Tally {
                record,
                device: Some(device),
            },
            None => Tally {
                record: device,
                device: None,
            },
        })
    }
}

/// One session's counts. A request is counted once, in the session's record (or, for a
/// session beyond the records, its device's); the reader adds the live sessions to their
/// device, and a released session's counts move into its device's record.
pub struct Tally {
    record: Words,
    /// The device's record, when `record` is the session's own.
    device: Option<Words>,
}

impl Tally {
    /// The session was resumed after a restart, its client about to send `replaying`
    /// requests again.
    pub fn resumed(&self, replaying: u32) {
        let r = self.record.get();
        add(&r[w::RESUMES], 1);
        add(&r[w::REPLAYS], u64::from(replaying));
    }

    /// A request was taken.
    #[inline]
    pub fn taken(&self) {
        add(&self.record.get()[w::TAKEN], 1);
    }

    /// A request was answered with `code` (0, or the class's negative code) and, for a
    /// success, `value`; `latency_ns` if the class timed it.
    #[inline]
    pub fn answered(&self, code: i32, value: u32, latency_ns: Option<u64>) {
        let r = self.record.get();
        add(&r[w::ANSWERED], 1);
        if code == 0 {
            add(&r[w::BYTES], u64::from(value));
        } else {
            let kind = match code.unsigned_abs() as usize {
                k @ 1..KINDS => k,
                _ => 0,
            };
            add(&r[w::ERRORS], 1);
            add(&r[w::KINDS + kind], 1);
        }
        if let Some(ns) = latency_ns {
            add(&r[w::SUM], ns);
            add(&r[w::HIST + bucket(ns)], 1);
        }
    }
}

impl Drop for Tally {
    /// The session is released: its counts move into its device's record and its slot is
    /// free, inside one write of the device's sequence word (odd while it moves), so that a
    /// reader never counts them twice or not at all. Requests it took and never answered (a
    /// client that left with requests parked) are not carried as in flight.
    fn drop(&mut self) {
        let Some(device) = &self.device else {
            return;
        };
        let (s, d) = (self.record.get(), device.get());
        let seq = d[w::SEQ].load(Ordering::Relaxed);
        d[w::SEQ].store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        let answered = s[w::ANSWERED].load(Ordering::Relaxed);
        add(&d[w::TAKEN], answered);
        for i in w::ANSWERED..RECORD_WORDS {
            add(&d[i], s[i].load(Ordering::Relaxed));
        }
        s[w::ID].store(0, Ordering::Relaxed);
        d[w::SEQ].store(seq.wrapping_add(2), Ordering::Release);
    }
}

/// One record's numbers, as read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    /// Session id (0 for a device's own record).
    pub id: u64,
    /// The client's pid (0 if unknown or a device's record).
    pub pid: u64,
    /// Requests taken.
    pub taken: u64,
    /// Requests answered.
    pub answered: u64,
    /// Bytes successes returned.
    pub bytes: u64,
    /// Requests answered with an error.
    pub errors: u64,
    /// Sessions resumed after a restart.
    pub resumes: u64,
    /// Requests their clients sent again after a restart.
    pub replays: u64,
    /// Errors by kind (code `-k` at `k`; others at 0).
    pub kinds: Vec<u64>,
    /// Latencies timed (the histogram's sum).
    pub samples: u64,
    /// Their sum, ns.
    pub sum_ns: u64,
    /// A bound on the largest, ns: the top of the highest non-empty bucket.
    pub max_ns: u64,
    /// Histogram ([`bucket`]).
    pub hist: Vec<u64>,
}

impl Record {
    fn read(words: &[AtomicU64]) -> Self {
        let g = |i: usize| words[i].load(Ordering::Relaxed);
        let mut r = Self {
            id: g(w::ID),
            pid: g(w::PID),
            taken: g(w::TAKEN),
            answered: g(w::ANSWERED),
            bytes: g(w::BYTES),
            errors: g(w::ERRORS),
            resumes: g(w::RESUMES),
            replays: g(w::REPLAYS),
            kinds: (0..KINDS).map(|k| g(w::KINDS + k)).collect(),
            samples: 0,
            sum_ns: g(w::SUM),
            max_ns: 0,
            hist: (0..BUCKETS).map(|b| g(w::HIST + b)).collect(),
        };
        r.summarise();
        r
    }

    /// Samples and the bound on the largest, from the histogram.
    fn summarise(&mut self) {
        self.samples = self.hist.iter().fold(0u64, |a, n| a.saturating_add(*n));
        self.max_ns = match self.hist.iter().rposition(|&n| n > 0) {
            Some(i) if i + 1 < BUCKETS => bucket_floor(i + 1) - 1,
            Some(_) => u64::MAX,
            None => 0,
        };
    }

    /// Requests taken and not yet answered.
    pub fn in_flight(&self) -> u64 {
        self.taken.saturating_sub(self.answered)
    }

    /// Adds `other`'s counts (a dead incarnation's, carried over).
    pub fn add(&mut self, other: &Record) {
        let sum = |a: &mut Vec<u64>, b: &[u64]| {
            a.resize(a.len().max(b.len()), 0);
            for (x, y) in a.iter_mut().zip(b) {
                *x = x.saturating_add(*y);
            }
        };
        self.taken = self.taken.saturating_add(other.taken);
        self.answered = self.answered.saturating_add(other.answered);
        self.bytes = self.bytes.saturating_add(other.bytes);
        self.errors = self.errors.saturating_add(other.errors);
        self.resumes = self.resumes.saturating_add(other.resumes);
        self.replays = self.replays.saturating_add(other.replays);
        sum(&mut self.kinds, &other.kinds);
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
        sum(&mut self.hist, &other.hist);
        self.summarise();
    }

    /// The latency (ns) below which fraction `q` of the samples lie: the middle of the
    /// bucket the `q`-th sample falls in; `None` without samples.
    pub fn percentile(&self, q: f64) -> Option<u64> {
        // Saturating: the buckets are a server's words, whatever it wrote.
        let total = self.hist.iter().fold(0u64, |a, n| a.saturating_add(*n));
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0u64;
        for (i, n) in self.hist.iter().enumerate() {
            seen = seen.saturating_add(*n);
            if seen >= rank {
                let (lo, hi) = (bucket_floor(i), bucket_floor(i + 1));
                return Some((lo + hi.max(lo + 1) - 1) / 2);
            }
        }
        None
    }
}

/// One device's counters, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Class device name.
    pub name: String,
    /// Its class.
    pub class: String,
    /// Its class's error kinds by code: `-k` at `k` (empty where unnamed).
    pub kinds: Vec<String>,
    /// Its totals.
    pub total: Record,
    /// Its sessions with records.
    pub sessions: Vec<Record>,
}

impl DeviceCounters {
    /// The name of error kind `k` (code `-k`), or a name made of the code.
    pub fn kind_name(&self, k: usize) -> String {
        match self.kinds.get(k).filter(|n| !n.is_empty()) {
            Some(n) => n.clone(),
            None if k == 0 => "other".into(),
            None => format!("code-{k}"),
        }
    }
}

fn get_str(page: &SharedMem, at: u64, room: usize) -> Result<String, ShmError> {
    let mut b = vec![0u8; room];
    page.read(at, &mut b)?;
    let end = b.iter().position(|&c| c == 0).unwrap_or(room);
    Ok(String::from_utf8_lossy(&b[..end]).into_owned())
}

/// Why a page could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BadPage {
    /// Not a counters page of this version.
    #[error("not an Outboard counters page (magic {magic:#x}, version {version})")]
    Foreign {
        /// What it starts with.
        magic: u64,
        /// Its version.
        version: u32,
    },
    /// Its header describes a layout other than this one, or more than it holds.
    #[error("counters page header out of bounds: {0}")]
    Layout(String),
    /// It could not be mapped or read.
    #[error(transparent)]
    Shm(#[from] ShmError),
}

/// The manager's view of a server's page (untrusted: every field is checked).
pub struct Reader {
    page: Arc<SharedMem>,
    devices: usize,
}

impl Reader {
    /// Maps the page a server passed (read-only; a shrink by the server cannot fault the
    /// reader) and checks its header.
    pub fn new(fd: std::os::fd::OwnedFd) -> Result<Self, BadPage> {
        let size = rustix::fs::fstat(&fd).map_err(|e| ShmError::Os {
            op: "fstat",
            errno: e,
        })?;
        let len = usize::try_from(size.st_size).unwrap_or(0);
        if len < HEADER_BYTES as usize {
            return Err(BadPage::Layout(format!("{len} bytes")));
        }
        let page = Arc::new(SharedMem::map_peer_owned(fd, 0, len, Access::ReadOnly)?);
        let magic = page.read_u64(0)?;
        let version = page.read_u32(8)?;
        if magic != MAGIC || version != VERSION {
            return Err(BadPage::Foreign { magic, version });
        }
        let devices = page.read_u32(12)? as usize;
        let (sessions, words) = (page.read_u32(16)? as usize, page.read_u32(20)? as usize);
        if sessions != SESSIONS || words != RECORD_WORDS {
            return Err(BadPage::Layout(format!(
                "{sessions} sessions of {words} words"
            )));
        }
        if devices > MAX_DEVICES || page_bytes(devices) > len as u64 {
            return Err(BadPage::Layout(format!("{devices} devices in {len} bytes")));
        }
        Ok(Self { page, devices })
    }

    /// Every device's counters now.
    pub fn read(&self) -> Result<Vec<DeviceCounters>, BadPage> {
        (0..self.devices).map(|d| self.device(d)).collect()
    }

    fn device(&self, d: usize) -> Result<DeviceCounters, BadPage> {
        let at = device_at(d);
        let words = |r: usize| self.page.atomics_u64(record_at(d, r), RECORD_WORDS);
        let seq = &words(0)?[w::SEQ];
        // A consistent look: the device's record and its live sessions' between two reads
        // of the sequence word that agree (and are even). A server that keeps it odd gets
        // what a look finds after the last try.
        // Relaxed loads and fences only: the mapping is read-only, where an atomic load
        // stronger than relaxed is not allowed.
        let look = || -> Result<(Record, Vec<Record>, bool), BadPage> {
            let before = seq.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            let mut total = Record::read(words(0)?);
            let mut sessions = Vec::new();
            for r in 1..=SESSIONS {
                let rec = Record::read(words(r)?);
                if rec.id != 0 {
                    total.add(&rec);
                    sessions.push(rec);
                }
            }
            fence(Ordering::Acquire);
            let after = seq.load(Ordering::Relaxed);
            Ok((total, sessions, before == after && before % 2 == 0))
        };
        let (mut total, mut sessions, mut whole) = look()?;
        for _ in 0..LOOKS {
            if whole {
                break;
            }
            std::thread::yield_now();
            (total, sessions, whole) = look()?;
        }
        total.id = 0;
        total.pid = 0;
        let mut kinds = vec![String::new()];
        for k in 1..KINDS {
            kinds.push(get_str(
                &self.page,
                at + (NAME + CLASS + k * KIND_NAME) as u64,
                KIND_NAME,
            )?);
        }
        Ok(DeviceCounters {
            name: get_str(&self.page, at, NAME)?,
            class: get_str(&self.page, at + NAME as u64, CLASS)?,
            kinds,
            total,
            sessions,
        })
    }
}

/// Tries at a consistent look at a device's counters.
const LOOKS: usize = 100;

#[cfg(test)]
mod tests {
    use super::*;

    fn disk() -> Described {
        Described {
            name: "disk0".into(),
            class: "block".into(),
            kinds: vec!["invalid", "out-of-range"],
        }
    }

    fn reader(c: &Counters) -> Reader {
        let fd = rustix::io::fcntl_dupfd_cloexec(c.page().fd().expect("memfd"), 0).unwrap();
        Reader::new(fd).unwrap()
    }

    #[test]
    fn buckets_are_contiguous_and_each_value_falls_in_its_own() {
        for i in 0..BUCKETS - 1 {
            assert!(bucket_floor(i) < bucket_floor(i + 1), "bucket {i}");
            assert_eq!(bucket(bucket_floor(i)), i);
            assert_eq!(bucket(bucket_floor(i + 1) - 1), i);
        }
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
        // 12.5% wide above 8 ns.
        let i = bucket(1_000_000);
        let (lo, hi) = (bucket_floor(i), bucket_floor(i + 1));
        assert!(lo <= 1_000_000 && 1_000_000 < hi && (hi - lo) * 8 <= lo);
    }

    #[test]
    fn counts_reach_the_session_and_its_device_and_survive_the_session() {
        let c = Counters::create(&[disk()]).unwrap();
        let r = reader(&c);
        let t = c.open(0, 7, 1234).unwrap();
        t.resumed(5);
        for _ in 0..3 {
            t.taken();
        }
        t.answered(0, 4096, Some(10_000));
        t.answered(-2, 0, Some(20_000));
        let d = &r.read().unwrap()[0];
        assert_eq!((d.name.as_str(), d.class.as_str()), ("disk0", "block"));
        assert_eq!(d.kind_name(2), "out-of-range");
        assert_eq!(d.kind_name(9), "code-9");
        for rec in [&d.total, &d.sessions[0]] {
            assert_eq!((rec.taken, rec.answered, rec.in_flight()), (3, 2, 1));
            assert_eq!((rec.bytes, rec.errors, rec.kinds[2]), (4096, 1, 1));
            assert_eq!((rec.resumes, rec.replays), (1, 5));
            assert_eq!((rec.samples, rec.sum_ns), (2, 30_000));
            assert!(
                (20_000..20_000 * 9 / 8).contains(&rec.max_ns),
                "{}",
                rec.max_ns
            );
        }
        assert_eq!((d.sessions[0].id, d.sessions[0].pid), (7, 1234));
        let p50 = d.total.percentile(0.5).unwrap();
        assert!((9_000..11_000).contains(&p50), "{p50}");
        drop(t);
        let d = &r.read().unwrap()[0];
        assert!(d.sessions.is_empty());
        assert_eq!(d.total.answered, 2);
    }

    #[test]
    fn sessions_beyond_the_records_count_in_their_device() {
        let c = Counters::create(&[disk()]).unwrap();
        let tallies: Vec<Tally> = (1..=SESSIONS as u64 + 3)
            .map(|id| c.open(0, id, 1).unwrap())
            .collect();
        for t in &tallies {
            t.answered(0, 1, None);
        }
        let d = &reader(&c).read().unwrap()[0];
        assert_eq!(d.sessions.len(), SESSIONS);
        assert_eq!(d.total.bytes, SESSIONS as u64 + 3);
        assert!(c.open(1, 1, 1).is_none(), "no such device");
    }

    #[test]
    fn a_page_that_is_not_one_or_lies_about_its_layout_is_refused() {
        let junk = SharedMem::create("junk", 8192).unwrap();
        let dup = || rustix::io::fcntl_dupfd_cloexec(junk.fd().unwrap(), 0).unwrap();
        assert!(matches!(Reader::new(dup()), Err(BadPage::Foreign { .. })));
        junk.write_u64(0, MAGIC).unwrap();
        junk.write_u32(8, VERSION).unwrap();
        junk.write_u32(12, 5).unwrap();
        junk.write_u32(16, SESSIONS as u32).unwrap();
        junk.write_u32(20, RECORD_WORDS as u32).unwrap();
        assert!(matches!(Reader::new(dup()), Err(BadPage::Layout(_))));
    }

    #[test]
    fn a_reader_never_sees_counts_go_back_while_sessions_come_and_go() {
        let c = Counters::create(&[disk()]).unwrap();
        let r = reader(&c);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let reading = scope.spawn(|| {
                let mut last = 0;
                let mut looks = 0;
                while !done.load(Ordering::Acquire) || looks == 0 {
                    let d = &r.read().unwrap()[0];
                    assert!(
                        d.total.answered >= last,
                        "{} after {last}",
                        d.total.answered
                    );
                    assert!(d.total.in_flight() <= 1, "{:?}", d.total.in_flight());
                    last = d.total.answered;
                    looks += 1;
                }
            });
            for id in 1..=3000 {
                let t = c.open(0, id, 1).unwrap();
                for _ in 0..3 {
                    t.taken();
                    t.answered(0, 512, Some(id));
                }
                drop(t);
            }
            done.store(true, Ordering::Release);
            reading.join().unwrap();
        });
        let d = &r.read().unwrap()[0];
        assert_eq!(
            (d.total.answered, d.total.taken, d.total.bytes),
            (9000, 9000, 9000 * 512)
        );
        assert_eq!(d.total.samples, 9000);
        assert_eq!(d.total.max_ns, bucket_floor(bucket(3000) + 1) - 1);
    }

    #[test]
    fn a_session_that_left_with_requests_unanswered_does_not_leave_them_in_flight() {
        let c = Counters::create(&[disk()]).unwrap();
        let t = c.open(0, 1, 1).unwrap();
        t.taken();
        t.taken();
        t.answered(0, 1, None);
        let r = reader(&c);
        assert_eq!(r.read().unwrap()[0].total.in_flight(), 1);
        drop(t);
        assert_eq!(r.read().unwrap()[0].total.in_flight(), 0);
        assert_eq!(r.read().unwrap()[0].total.answered, 1);
    }

    #[test]
    fn a_histogram_a_server_filled_with_huge_counts_gives_a_percentile_not_a_panic() {
        let mut hist = vec![0; BUCKETS];
        hist[3] = u64::MAX;
        hist[200] = u64::MAX;
        let r = Record {
            hist,
            ..Default::default()
        };
        assert!(r.percentile(0.999).is_some());
        let mut sum = r.clone();
        sum.add(&r);
        assert_eq!(sum.samples, u64::MAX);
    }

    #[test]
    fn carried_counts_add_up() {
        let mut a = Record {
            taken: 2,
            hist: vec![1, 0],
            kinds: vec![0; KINDS],
            ..Default::default()
        };
        let mut hist = vec![0; BUCKETS];
        hist[9] = 2;
        let b = Record {
            taken: 3,
            hist,
            kinds: vec![1; KINDS],
            ..Default::default()
        };
        a.add(&b);
        assert_eq!((a.taken, a.hist.len(), a.kinds[3]), (5, BUCKETS, 1));
        assert_eq!((a.samples, a.max_ns), (3, bucket_floor(10) - 1));
    }
}
