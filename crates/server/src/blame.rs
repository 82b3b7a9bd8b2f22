//! Blame: which request a driver server had in its device when it died, for the supervisor
//! to quarantine a request that crashes the driver every time.
//!
//! After a crash the manager starts the next server *isolated* for a while: it lets one
//! request at a time into the device, across every session, and before it submits one it
//! writes what it is into the heartbeat page it shares with the manager. If the server (or
//! its device model) dies then, the page names the request that was in the device. A request
//! named so at three crashes in a row is passed to the next server as quarantined: it
//! completes alone with its class's "quarantined" error, and every other request goes on.
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

/// Where the record sits in the heartbeat page (the word at 0 is the heartbeat).
const AT: u64 = 64;

/// A request the server had in its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suspect {
    /// The session's identity across restarts ([`session_key`]).
    pub key: u64,
    /// The class's fingerprint of the request.
    pub request: [u64; 2],
}

impl Suspect {
    /// Records it in `page` as the request in the device.
    pub fn write(&self, page: &SharedMem) {
        let _ = page.write_u64(AT + 8, self.key);
        let _ = page.write_u64(AT + 16, self.request[0]);
        let _ = page.write_u64(AT + 24, self.request[1]);
        // Valid last: a record is whole once this says so (read only after the writer died).
        let _ = page.write_u64(AT, 1);
    }

    /// Nothing is in the device any more.
    pub fn clear(page: &SharedMem) {
        let _ = page.write_u64(AT, 0);
    }

    /// The request `page` names, if any (read by the supervisor once the server died).
    pub fn read(page: &SharedMem) -> Option<Self> {
        if page.read_u64(AT).ok()? != 1 {
            return None;
        }
        Some(Self {
            key: page.read_u64(AT + 8).ok()?,
            request: [page.read_u64(AT + 16).ok()?, page.read_u64(AT + 24).ok()?],
        })
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

/// What a device's core keeps for blame: the page to name requests in while isolated, until
/// when, and the requests to fail instead of sending.
#[derive(Default)]
pub(crate) struct Watch {
    page: Option<Arc<SharedMem>>,
    until: Option<Instant>,
    quarantine: Vec<Suspect>,
}

impl Watch {
    pub(crate) fn isolate(&mut self, page: Arc<SharedMem>, until: Instant) {
        self.page = Some(page);
        self.until = Some(until);
    }

    pub(crate) fn quarantine(&mut self, suspect: Suspect) {
        self.quarantine.push(suspect);
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

    pub(crate) fn entering(&self, s: &Session, request: [u64; 2]) {
        if let (Some(page), true) = (&self.page, self.isolated()) {
            Suspect {
                key: session_key(s),
                request,
            }
            .write(page);
        }
    }

    pub(crate) fn emptied(&self) {
        if let Some(page) = &self.page {
            Suspect::clear(page);
        }
    }

    pub(crate) fn take_quarantined(&mut self, key: u64, request: [u64; 2]) -> bool {
        if self.quarantine.is_empty() {
            return false;
        }
        let wanted = Suspect { key, request };
        match self.quarantine.iter().position(|q| *q == wanted) {
            Some(i) => {
                tracing::error!(
                    "request {wanted} crashed the driver too often: failed, not sent again"
                );
                self.quarantine.remove(i);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_through_the_page_and_text() {
        let page = SharedMem::create("blame-test", 4096).unwrap();
        assert_eq!(Suspect::read(&page), None);
        let s = Suspect {
            key: 77,
            request: [1 << 32 | 8, 2048],
        };
        s.write(&page);
        assert_eq!(Suspect::read(&page), Some(s));
        assert_eq!(s.to_string().parse::<Suspect>(), Ok(s));
        Suspect::clear(&page);
        assert_eq!(Suspect::read(&page), None);
        assert!("1:2".parse::<Suspect>().is_err());
        assert!("1:2:zz".parse::<Suspect>().is_err());
    }
}
