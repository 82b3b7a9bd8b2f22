//! Blame: which request a driver server had in its device when it died, for the supervisor
//! to quarantine a request that crashes the driver every time.
//!
//! After a crash the manager starts the next server *isolated* for a while: it lets one
//! request at a time into each device, across every session, and before it submits one it
//! writes what it is into the heartbeat page it shares with the manager (one record per
//! device). If the server (or its device model) dies then, the page names the request that
//! was in the device — or says that the device was empty, or that isolation was over and
//! nobody was named. A request named so at three crashes in a row is passed to the next
//! server as quarantined: it completes alone with its class's "quarantined" error, and every
//! other request goes on.
//!
//! A request named at a crash is *held back* by the next server: it enters its device only
//! once another request has been through (or nothing else is there to go). Without that, the
//! request a replay sends first — the oldest — is the first in the device after every restart,
//! and a device that misbehaves on its first request after a restart (or a fault that strikes
//! early, whatever the request) named that same innocent request at every crash.
//!
//! A request is named by its session's identity across restarts (the inode of the session's
//! buffer area, which a resuming client passes back) and a fingerprint its class computes from
//! what a replay sends again (block: operation, first block, blocks). This module knows no
//! class: the fingerprint is two opaque words.

use std::fmt;

use std::sync::Arc;
use std::time::Instant;

use outboard_shm::SharedMem;

use crate::session::Session;

/// Where the first device's record sits in the heartbeat page (the word at 0 is the
/// heartbeat); each record takes [`RECORD`] bytes.
const AT: u64 = 64;
/// A word of bits: bit `i` set once the server answered the `i`th request it was told to
/// quarantine (in the order it was told), so the manager passes it on no more — its
/// fingerprint would fail the session's next request like it (a later write of the same
/// block) for nothing.
const ANSWERED: u64 = 8;
/// Quarantined requests whose answer the page can record.
const TRACKED: usize = 64;
/// Set when a device has no record of its own (more than [`RECORDS`] in one server): its
/// requests go in unnamed, and a crash may be any of theirs.
const OVERFLOW: u64 = 16;
const RECORD: u64 = 32;
/// Devices with a record of their own: the rest of the page.
pub const RECORDS: usize = ((4096 - AT) / RECORD) as usize;

/// A record's state word.
const UNWRITTEN: u64 = 0;
const NAMED: u64 = 1;
const EMPTY: u64 = 2;
const UNWATCHED: u64 = 3;

/// A request the server had in its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suspect {
    /// The session's identity across restarts ([`session_key`]).
    pub key: u64,
    /// The class's fingerprint of the request.
    pub request: [u64; 2],
}

/// What a dead server's heartbeat page says was in its devices when it died.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not known: a device was not isolated (any of the requests in it may have done it).
    Unknown,
    /// Isolated devices with nothing in them: no request did it.
    Nobody,
    /// Isolated devices with these requests in them (one per device at most).
    Named(Vec<Suspect>),
}

impl Verdict {
    /// Reads the records in `page` (the supervisor, once the server died).
    pub fn read(page: &SharedMem) -> Self {
        if page.read_u64(OVERFLOW).unwrap_or(1) != 0 {
            return Self::Unknown;
        }
        let mut named = Vec::new();
        let mut written = false;
        for d in 0..RECORDS {
            let at = AT + d as u64 * RECORD;
            match page.read_u64(at) {
                Ok(NAMED) => {
                    let word = |o: u64| page.read_u64(at + o).unwrap_or(0);
                    named.push(Suspect {
                        key: word(8),
                        request: [word(16), word(24)],
                    });
                }
                Ok(EMPTY) => {}
                Ok(UNWRITTEN) => continue,
                // Over, or unreadable: that device's requests went in unnamed.
                _ => return Self::Unknown,
            }
            written = true;
        }
        match (written, named.is_empty()) {
            (false, _) => Self::Unknown,
            (true, true) => Self::Nobody,
            (true, false) => Self::Named(named),
        }
    }
}

/// Which of the requests a dead server was told to quarantine it answered: bit `i` for the
/// `i`th (read by the supervisor once the server died).
pub fn answered(page: &SharedMem) -> u64 {
    page.read_u64(ANSWERED).unwrap_or(0)
}

/// One device's record in the page.
struct Record {
    page: Arc<SharedMem>,
    at: u64,
}

impl Record {
    fn state(&self, state: u64) {
        let _ = self.page.write_u64(self.at, state);
    }

    /// Names `s` as the request in the device. The state goes last: the record is whole
    /// once it says so. (Read only after the writer died.)
    fn name(&self, s: &Suspect) {
        let _ = self.page.write_u64(self.at + 8, s.key);
        let _ = self.page.write_u64(self.at + 16, s.request[0]);
        let _ = self.page.write_u64(self.at + 24, s.request[1]);
        self.state(NAMED);
    }
}

impl fmt::Display for Suspect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{:x}:{:x}",
            self.key, self.request[0], self.request[1]
        )
    }
}

impl std::str::FromStr for Suspect {
    type Err = String;

    /// `KEY:W0:W1` (the key in decimal, the fingerprint's words in hex), as
    /// [`fmt::Display`] writes it.
    fn from_str(s: &str) -> Result<Self, String> {
        let f: Vec<&str> = s.split(':').collect();
        let bad = || format!("{s:?}: expected KEY:W0:W1 (a session key and two hex words)");
        if f.len() != 3 {
            return Err(bad());
        }
        let word = |w: &str| u64::from_str_radix(w, 16).map_err(|_| bad());
        Ok(Self {
            key: f[0].parse().map_err(|_| bad())?,
            request: [word(f[1])?, word(f[2])?],
        })
    }
}

/// A session's identity across restarts of its server: the inode of its buffer area (the
/// memfd the first server made and a resuming client passes back). 0 if it cannot be read.
pub fn session_key(s: &Session) -> u64 {
    s.region
        .buffers
        .fd()
        .and_then(|fd| rustix::fs::fstat(fd).ok())
        .map_or(0, |st| st.st_ino)
}

/// What a device's core keeps for blame: its record in the page while isolated, until when,
/// the requests to fail instead of sending, and the ones held back.
#[derive(Default)]
pub(crate) struct Watch {
    record: Option<Record>,
    /// The page, for a device with no record of its own too (quarantines answered).
    page: Option<Arc<SharedMem>>,
    /// When isolation ends; `None` once it has (or if it never began).
    until: Option<Instant>,
    /// Requests to fail instead of sending, each with its place in the list the server was
    /// given.
    quarantine: Vec<(usize, Suspect)>,
    told: usize,
    /// Requests named at the last crash: not the first into the device.
    held_back: Vec<Suspect>,
    /// A request went through the device since isolation began: the held back may go.
    went_through: bool,
}

impl Watch {
    /// One request at a time into device number `device`, named in its record of `page`,
    /// until `until`.
    pub(crate) fn isolate(&mut self, page: Arc<SharedMem>, device: usize, until: Instant) {
        self.page = Some(page.clone());
        if device >= RECORDS {
            // No record of its own: it is not isolated, and the page says that a crash may be
            // any request's doing.
            let _ = page.write_u64(OVERFLOW, 1);
            return;
        }
        let record = Record {
            page,
            at: AT + device as u64 * RECORD,
        };
        record.state(EMPTY);
        self.record = Some(record);
        self.until = Some(until);
        self.went_through = false;
    }

    pub(crate) fn quarantine(&mut self, suspect: Suspect) {
        self.quarantine.push((self.told, suspect));
        self.told += 1;
    }

    pub(crate) fn hold_back(&mut self, suspect: Suspect) {
        self.held_back.push(suspect);
    }

    /// Whether any request waits to be failed instead of sent.
    #[inline]
    pub(crate) fn quarantining(&self) -> bool {
        !self.quarantine.is_empty()
    }

    #[inline]
    pub(crate) fn isolated(&self) -> bool {
        self.until.is_some_and(|t| Instant::now() < t)
    }

    /// Isolation ended: what enters from now on is not named, and the record says so (a
    /// crash now may be any request's doing).
    fn over(&mut self) {
        self.until = None;
        self.held_back.clear();
        if let Some(r) = &self.record {
            r.state(UNWATCHED);
        }
    }

    /// Whether naming is on (something was isolated).
    #[inline]
    pub(crate) fn naming(&self) -> bool {
        self.until.is_some()
    }

    /// The device's record while it is isolated; once isolation is over, ends it first
    /// ([`Watch::over`]) and gives nothing.
    fn watching(&mut self) -> Option<&Record> {
        self.until?;
        if !self.isolated() {
            self.over();
            return None;
        }
        self.record.as_ref()
    }

    /// Session `s`'s request `request` enters the device: named while isolated.
    pub(crate) fn entering(&mut self, s: &Session, request: [u64; 2]) {
        if let Some(r) = self.watching() {
            r.name(&Suspect {
                key: session_key(s),
                request,
            });
        }
    }

    /// The request just named did not enter the device (the driver refused it): the device
    /// holds nothing again, though nothing went through it.
    pub(crate) fn refused(&mut self) {
        if let Some(r) = self.watching() {
            r.state(EMPTY);
        }
    }

    /// The device has nothing in it any more, after a request went through.
    pub(crate) fn emptied(&mut self) {
        let Some(r) = self.watching() else {
            return;
        };
        r.state(EMPTY);
        self.went_through = true;
    }

    /// Whether anything may be held back now.
    #[inline]
    pub(crate) fn holds_any(&self) -> bool {
        !self.held_back.is_empty() && !self.went_through
    }

    /// Whether session key `key`'s request `request` waits before it enters the device:
    /// named at the last crash, and nothing has been through the device since isolation
    /// began.
    #[inline]
    pub(crate) fn holding(&self, key: impl FnOnce() -> u64, request: [u64; 2]) -> bool {
        if self.held_back.is_empty() || self.went_through || !self.isolated() {
            return false;
        }
        let wanted = Suspect {
            key: key(),
            request,
        };
        self.held_back.contains(&wanted)
    }

    /// Whether session key `key`'s request `request` is to be failed as quarantined: true
    /// once, and the page then says it was answered.
    pub(crate) fn take_quarantined(&mut self, key: u64, request: [u64; 2]) -> bool {
        if self.quarantine.is_empty() {
            return false;
        }
        let wanted = Suspect { key, request };
        let Some(i) = self.quarantine.iter().position(|(_, q)| *q == wanted) else {
            return false;
        };
        tracing::error!("request {wanted} crashed the driver too often: failed, not sent again");
        let (told, _) = self.quarantine.remove(i);
        // Recorded before the answer is posted: a server that dies in between leaves the
        // request to be sent again (and named again), never a later one failed for it.
        if let (Some(page), true) = (&self.page, told < TRACKED) {
            let was = page.read_u64(ANSWERED).unwrap_or(0);
            let _ = page.write_u64(ANSWERED, was | 1 << told);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn page() -> Arc<SharedMem> {
        Arc::new(SharedMem::create("blame-test", 4096).unwrap())
    }

    const S: Suspect = Suspect {
        key: 77,
        request: [1 << 32 | 8, 2048],
    };

    #[test]
    fn a_suspect_round_trips_through_text() {
        assert_eq!(S.to_string().parse::<Suspect>(), Ok(S));
        assert!("1:2".parse::<Suspect>().is_err());
        assert!("1:2:zz".parse::<Suspect>().is_err());
    }

    #[test]
    fn a_page_says_what_each_isolated_device_held_and_nothing_for_one_never_isolated() {
        let page = page();
        assert_eq!(Verdict::read(&page), Verdict::Unknown);
        let mut a = Watch::default();
        let mut b = Watch::default();
        let until = Instant::now() + Duration::from_secs(60);
        a.isolate(page.clone(), 0, until);
        b.isolate(page.clone(), 1, until);
        assert_eq!(Verdict::read(&page), Verdict::Nobody);
        Record {
            page: page.clone(),
            at: AT + RECORD,
        }
        .name(&S);
        assert_eq!(Verdict::read(&page), Verdict::Named(vec![S]));
        b.emptied();
        assert_eq!(Verdict::read(&page), Verdict::Nobody);
        assert!(b.went_through && !a.went_through);
    }

    #[test]
    fn a_device_without_a_record_makes_every_crash_unknown() {
        let page = page();
        let mut w = Watch::default();
        w.isolate(page.clone(), 0, Instant::now() + Duration::from_secs(60));
        assert_eq!(Verdict::read(&page), Verdict::Nobody);
        let mut beyond = Watch::default();
        beyond.isolate(
            page.clone(),
            RECORDS,
            Instant::now() + Duration::from_secs(60),
        );
        assert!(!beyond.isolated());
        assert_eq!(Verdict::read(&page), Verdict::Unknown);
    }

    #[test]
    fn once_isolation_is_over_the_record_names_nobody_and_says_so() {
        let page = page();
        let mut w = Watch::default();
        w.isolate(page.clone(), 0, Instant::now() + Duration::from_millis(20));
        Record {
            page: page.clone(),
            at: AT,
        }
        .name(&S);
        assert_eq!(Verdict::read(&page), Verdict::Named(vec![S]));
        std::thread::sleep(Duration::from_millis(30));
        // Requests go in unnamed now: a crash cannot be put on the one named before.
        w.emptied();
        assert_eq!(Verdict::read(&page), Verdict::Unknown);
        assert!(!w.isolated());
    }

    #[test]
    fn a_quarantined_request_is_failed_once_and_the_page_says_which() {
        let page = page();
        let mut w = Watch::default();
        w.isolate(page.clone(), 0, Instant::now() + Duration::from_secs(60));
        let other = Suspect { key: 5, ..S };
        w.quarantine(other);
        w.quarantine(S);
        assert_eq!(answered(&page), 0);
        assert!(w.take_quarantined(S.key, S.request));
        assert!(!w.take_quarantined(S.key, S.request), "once");
        assert_eq!(answered(&page), 0b10);
    }

    #[test]
    fn a_request_named_at_the_last_crash_waits_until_another_went_through() {
        let page = page();
        let mut w = Watch::default();
        w.hold_back(S);
        // Not isolated: nothing is held.
        assert!(!w.holding(|| S.key, S.request));
        w.isolate(page, 0, Instant::now() + Duration::from_secs(60));
        assert!(w.holding(|| S.key, S.request));
        assert!(!w.holding(|| S.key + 1, S.request), "another session's");
        assert!(!w.holding(|| S.key, [0, 0]), "another request");
        w.emptied();
        assert!(!w.holding(|| S.key, S.request));
    }
}
