//! Blame: which request a driver server had in its device when it died, for the supervisor
//! to quarantine a request that crashes the driver every time.
//!
//! After a crash the manager starts the next server *isolated* for a while: it lets one
//! request at a time into the device, across every session, and before it submits one it
//! writes what it is into the heartbeat page it shares with the manager. If the server (or
//! its device model) dies then, the page names the request that was in the device. A request
//! named so at [`outboard_class::block::QUARANTINE_AFTER`] crashes in a row is passed to the
//! next server as quarantined: it completes alone with
//! [`outboard_class::BlockError::Quarantined`], and every
//! other request goes on.
//!
//! A request is named by its session's identity across restarts (the inode of the session's
//! buffer area, which a resuming client passes back) and its operation and blocks (what a
//! replay sends again).

use std::fmt;

use outboard_class::BlockRequest;
use outboard_shm::SharedMem;

use crate::session::Session;

/// Where the record sits in the heartbeat page (the word at 0 is the heartbeat).
const AT: u64 = 64;

/// A request the server had in its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suspect {
    /// The session's identity across restarts ([`session_key`]).
    pub key: u64,
    /// Operation code.
    pub op: u8,
    /// First block.
    pub lba: u64,
    /// Blocks.
    pub blocks: u32,
}

impl Suspect {
    /// `r` of the session with identity `key`.
    pub fn of(key: u64, r: &BlockRequest) -> Self {
        Self {
            key,
            op: r.op.code(),
            lba: r.lba,
            blocks: r.blocks,
        }
    }

    /// Whether `r` of session `key` is this request.
    pub fn matches(&self, key: u64, r: &BlockRequest) -> bool {
        *self == Self::of(key, r)
    }

    /// Records it in `page` as the request in the device.
    pub fn write(&self, page: &SharedMem) {
        let _ = page.write_u64(AT + 8, self.key);
        let _ = page.write_u64(AT + 16, self.lba);
        let _ = page.write_u32(AT + 24, self.blocks);
        let _ = page.write_u32(AT + 28, u32::from(self.op));
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
            lba: page.read_u64(AT + 16).ok()?,
            blocks: page.read_u32(AT + 24).ok()?,
            op: u8::try_from(page.read_u32(AT + 28).ok()?).ok()?,
        })
    }
}

impl fmt::Display for Suspect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}:{}", self.key, self.op, self.lba, self.blocks)
    }
}

impl std::str::FromStr for Suspect {
    type Err = String;

    /// `KEY:OP:LBA:BLOCKS`, as [`fmt::Display`] writes it.
    fn from_str(s: &str) -> Result<Self, String> {
        let f: Vec<&str> = s.split(':').collect();
        let bad = || format!("{s:?}: expected KEY:OP:LBA:BLOCKS");
        if f.len() != 4 {
            return Err(bad());
        }
        Ok(Self {
            key: f[0].parse().map_err(|_| bad())?,
            op: f[1].parse().map_err(|_| bad())?,
            lba: f[2].parse().map_err(|_| bad())?,
            blocks: f[3].parse().map_err(|_| bad())?,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_through_the_page_and_text() {
        let page = SharedMem::create("blame-test", 4096).unwrap();
        assert_eq!(Suspect::read(&page), None);
        let s = Suspect {
            key: 77,
            op: 1,
            lba: 2048,
            blocks: 8,
        };
        s.write(&page);
        assert_eq!(Suspect::read(&page), Some(s));
        assert_eq!(s.to_string().parse::<Suspect>(), Ok(s));
        Suspect::clear(&page);
        assert_eq!(Suspect::read(&page), None);
        assert!("1:2:3".parse::<Suspect>().is_err());
    }
}
