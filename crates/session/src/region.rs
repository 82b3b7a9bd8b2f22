//! The shared region of a session: a control memfd (header, submission ring, completion ring)
//! and a separate buffer memfd.
//!
//! The buffer area is a memfd of its own so that it alone can be mapped into a device's DMA
//! space: the device (another process) never receives the rings. The server creates both memfds
//! and seals their size (`F_SEAL_GROW | F_SEAL_SHRINK`), so a client cannot truncate them under
//! the server (which would raise SIGBUS in the server).
//!
//! Control memfd layout (every index on its own cache line, pinned by the tests below):
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic u64 |
//! | 8 | version u32 |
//! | 12 | sq_entries u32 |
//! | 16 | cq_entries u32 |
//! | 24 | buffer_size u64 |
//! | 32 | sqe_size u32 (declared by the class) |
//! | 36 | cqe_size u32 (declared by the class) |
//! | 64 | SQ head (server) |
//! | 128 | SQ tail (client) |
//! | 192 | CQ head (client) |
//! | 256 | CQ tail (server) |
//! | 320 | server sleeping flag |
//! | 384 | client sleeping flag |
//! | 4096 | SQ entries, then CQ entries |

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use outboard_shm::{Access, SharedMem};
use rustix::fs::{MemfdFlags, SealFlags};

use crate::ring::RingStorage;
use crate::SessionError;

/// "OUTBOARD" in ASCII, little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"OUTBOARD");
/// Layout version (2: entry sizes are the class's, recorded in the header).
pub const VERSION: u32 = 2;

/// Header field offsets.
pub mod off {
    /// magic.
    pub const MAGIC: u64 = 0;
    /// version.
    pub const VERSION: u64 = 8;
    /// sq_entries.
    pub const SQ_ENTRIES: u64 = 12;
    /// cq_entries.
    pub const CQ_ENTRIES: u64 = 16;
    /// buffer_size.
    pub const BUFFER_SIZE: u64 = 24;
    /// Submission entry size.
    pub const SQE_SIZE: u64 = 32;
    /// Completion entry size.
    pub const CQE_SIZE: u64 = 36;
    /// SQ head.
    pub const SQ_HEAD: u64 = 64;
    /// SQ tail.
    pub const SQ_TAIL: u64 = 128;
    /// CQ head.
    pub const CQ_HEAD: u64 = 192;
    /// CQ tail.
    pub const CQ_TAIL: u64 = 256;
    /// Server sleep flag.
    pub const SERVER_SLEEPING: u64 = 320;
    /// Client sleep flag.
    pub const CLIENT_SLEEPING: u64 = 384;
    /// First SQ entry.
    pub const SQ: u64 = 4096;
}

/// Largest ring entry a class may declare.
pub const MAX_ENTRY_SIZE: u32 = 512;
/// Largest ring.
pub const MAX_ENTRIES: u32 = 4096;
/// Largest buffer area (1 GiB).
pub const MAX_BUFFER: u64 = 1 << 30;

/// The geometry of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Geometry {
    /// Submission ring entries (power of two).
    pub sq_entries: u32,
    /// Completion ring entries (power of two, at least `sq_entries`).
    pub cq_entries: u32,
    /// Bytes per submission entry: the class declares it (block: 32).
    pub sqe_size: u32,
    /// Bytes per completion entry: the class declares it (block: 16).
    pub cqe_size: u32,
    /// Buffer area size (whole pages).
    pub buffer_size: u64,
}

impl Geometry {
    /// Validates a requested geometry.
    pub fn check(&self) -> Result<(), SessionError> {
        let ok_ring = |n: u32| n.is_power_of_two() && (1..=MAX_ENTRIES).contains(&n);
        if !ok_ring(self.sq_entries)
            || !ok_ring(self.cq_entries)
            || self.cq_entries < self.sq_entries
        {
            return Err(SessionError::Invalid(format!(
                "rings of {}/{} entries: need powers of two up to {MAX_ENTRIES}, completion ≥ submission",
                self.sq_entries, self.cq_entries
            )));
        }
        let ok_entry = |n: u32| n.is_multiple_of(8) && (8..=MAX_ENTRY_SIZE).contains(&n);
        if !ok_entry(self.sqe_size) || !ok_entry(self.cqe_size) {
            return Err(SessionError::Invalid(format!(
                "ring entries of {}/{} bytes: need multiples of 8 from 8 to {MAX_ENTRY_SIZE}",
                self.sqe_size, self.cqe_size
            )));
        }
        if self.buffer_size == 0
            || !self.buffer_size.is_multiple_of(4096)
            || self.buffer_size > MAX_BUFFER
        {
            return Err(SessionError::Invalid(format!(
                "buffer area of {} bytes: need whole pages up to {MAX_BUFFER}",
                self.buffer_size
            )));
        }
        Ok(())
    }

    fn cq_offset(&self) -> u64 {
        off::SQ + (self.sq_entries as u64 * self.sqe_size as u64).div_ceil(64) * 64
    }

    /// Size of the control memfd.
    pub fn control_size(&self) -> u64 {
        (self.cq_offset() + self.cq_entries as u64 * self.cqe_size as u64).div_ceil(4096) * 4096
    }
}

/// Both mappings of a session, from either side.
#[derive(Debug, Clone)]
pub struct Region {
    /// Header and rings.
    pub control: Arc<SharedMem>,
    /// Data buffers (also mapped into the device's DMA space by the server).
    pub buffers: Arc<SharedMem>,
    /// Geometry (the creator's, or validated against the header by the attacher).
    pub geometry: Geometry,
}

fn sealed_memfd(name: &str, size: u64) -> Result<OwnedFd, SessionError> {
    let os = |e: rustix::io::Errno| SessionError::Os(e.to_string());
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(os)?;
    rustix::fs::ftruncate(&fd, size).map_err(os)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL)
        .map_err(os)?;
    Ok(fd)
}

impl Region {
    /// Creates a region (SERVER side).
    pub fn create(g: Geometry) -> Result<Self, SessionError> {
        g.check()?;
        let cfd = sealed_memfd("outboard-session", g.control_size())?;
        let bfd = sealed_memfd("outboard-buffers", g.buffer_size)?;
        let control = SharedMem::map_owned(cfd, 0, g.control_size() as usize, Access::ReadWrite)?;
        let buffers = SharedMem::map_owned(bfd, 0, g.buffer_size as usize, Access::ReadWrite)?;
        control.write_u64(off::MAGIC, MAGIC)?;
        control.write_u32(off::VERSION, VERSION)?;
        control.write_u32(off::SQ_ENTRIES, g.sq_entries)?;
        control.write_u32(off::CQ_ENTRIES, g.cq_entries)?;
        control.write_u64(off::BUFFER_SIZE, g.buffer_size)?;
        control.write_u32(off::SQE_SIZE, g.sqe_size)?;
        control.write_u32(off::CQE_SIZE, g.cqe_size)?;
        Ok(Self {
            control: Arc::new(control),
            buffers: Arc::new(buffers),
            geometry: g,
        })
    }

    /// Maps a region received from the server (CLIENT side), checking the header against the
    /// geometry the server announced.
    pub fn attach(control: OwnedFd, buffers: OwnedFd, g: Geometry) -> Result<Self, SessionError> {
        g.check()?;
        // The server's memfds: sealed by an honest server, sealed or guarded here whatever it is.
        let control =
            SharedMem::map_peer_owned(control, 0, g.control_size() as usize, Access::ReadWrite)?;
        let buffers =
            SharedMem::map_peer_owned(buffers, 0, g.buffer_size as usize, Access::ReadWrite)?;
        let header_ok = control.read_u64(off::MAGIC)? == MAGIC
            && control.read_u32(off::VERSION)? == VERSION
            && control.read_u32(off::SQ_ENTRIES)? == g.sq_entries
            && control.read_u32(off::CQ_ENTRIES)? == g.cq_entries
            && control.read_u64(off::BUFFER_SIZE)? == g.buffer_size
            && control.read_u32(off::SQE_SIZE)? == g.sqe_size
            && control.read_u32(off::CQE_SIZE)? == g.cqe_size;
        if !header_ok {
            return Err(SessionError::Invalid(
                "session header does not match its announcement".into(),
            ));
        }
        Ok(Self {
            control: Arc::new(control),
            buffers: Arc::new(buffers),
            geometry: g,
        })
    }

    /// The two fds to pass to the client.
    pub fn fds(&self) -> (std::os::fd::BorrowedFd<'_>, std::os::fd::BorrowedFd<'_>) {
        (
            self.control.fd().expect("created or attached with fds"),
            self.buffers.fd().expect("created or attached with fds"),
        )
    }

    /// The submission ring's storage.
    pub fn sq(&self) -> ShmRing {
        ShmRing::new(
            self.control.clone(),
            off::SQ_HEAD,
            off::SQ_TAIL,
            off::SQ,
            self.geometry.sqe_size as u64,
        )
    }

    /// The completion ring's storage.
    pub fn cq(&self) -> ShmRing {
        ShmRing::new(
            self.control.clone(),
            off::CQ_HEAD,
            off::CQ_TAIL,
            self.geometry.cq_offset(),
            self.geometry.cqe_size as u64,
        )
    }

    /// A sleep flag in the header.
    pub fn flag(&self, offset: u64) -> &std::sync::atomic::AtomicU32 {
        self.control
            .atomic_u32(offset)
            .expect("flag offsets are fixed, in bounds and aligned")
    }

    /// Whether the server announced sleep.
    pub fn server_sleeping(&self) -> &std::sync::atomic::AtomicU32 {
        self.flag(off::SERVER_SLEEPING)
    }

    /// Whether the client announced sleep.
    pub fn client_sleeping(&self) -> &std::sync::atomic::AtomicU32 {
        self.flag(off::CLIENT_SLEEPING)
    }

    /// Keeps the fds alive as `AsFd` for clarity in callers.
    pub fn control_fd(&self) -> impl AsFd + '_ {
        self.control.fd().expect("fd")
    }
}

/// A ring inside the control memfd.
#[derive(Debug, Clone)]
pub struct ShmRing {
    mem: Arc<SharedMem>,
    head: u64,
    tail: u64,
    base: u64,
    entry: u64,
}

impl ShmRing {
    fn new(mem: Arc<SharedMem>, head: u64, tail: u64, base: u64, entry: u64) -> Self {
        Self {
            mem,
            head,
            tail,
            base,
            entry,
        }
    }
}

impl RingStorage for ShmRing {
    fn head(&self) -> &std::sync::atomic::AtomicU32 {
        self.mem
            .atomic_u32(self.head)
            .expect("index offsets are fixed and aligned")
    }
    fn tail(&self) -> &std::sync::atomic::AtomicU32 {
        self.mem
            .atomic_u32(self.tail)
            .expect("index offsets are fixed and aligned")
    }
    fn write_slot(&self, slot: u32, e: &[u8]) {
        // `slot < capacity` (the ring handle guarantees it) keeps this inside the mapping,
        // whose size was computed from the same capacity.
        self.mem
            .write(self.base + slot as u64 * self.entry, e)
            .expect("slot inside the ring");
    }
    fn read_slot(&self, slot: u32, e: &mut [u8]) {
        self.mem
            .read(self.base + slot as u64 * self.entry, e)
            .expect("slot inside the ring");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_pinned() {
        let g = Geometry {
            sq_entries: 128,
            cq_entries: 256,
            sqe_size: 32,
            cqe_size: 16,
            buffer_size: 1 << 20,
        };
        assert_eq!(g.cq_offset(), 4096 + 128 * 32);
        assert_eq!(g.control_size(), 12288);
        for o in [
            off::SQ_HEAD,
            off::SQ_TAIL,
            off::CQ_HEAD,
            off::CQ_TAIL,
            off::SERVER_SLEEPING,
            off::CLIENT_SLEEPING,
        ] {
            assert_eq!(o % 64, 0, "each index on its own cache line");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot create or map a memfd")]
    fn attach_checks_header_and_sizes_are_sealed() {
        let g = Geometry {
            sq_entries: 8,
            cq_entries: 8,
            sqe_size: 32,
            cqe_size: 16,
            buffer_size: 8192,
        };
        let r = Region::create(g).unwrap();
        let (c, b) = r.fds();
        let (c, b) = (
            c.try_clone_to_owned().unwrap(),
            b.try_clone_to_owned().unwrap(),
        );
        // A client cannot shrink the buffers under the server.
        assert!(rustix::fs::ftruncate(&b, 0).is_err());
        let wrong = Geometry {
            sq_entries: 16,
            ..g
        };
        assert!(Region::attach(c.try_clone().unwrap(), b.try_clone().unwrap(), wrong).is_err());
        Region::attach(c, b, g).unwrap();
        assert!(Geometry { sq_entries: 3, ..g }.check().is_err());
        assert!(Geometry {
            buffer_size: 100,
            ..g
        }
        .check()
        .is_err());
        assert!(Geometry { cq_entries: 4, ..g }.check().is_err());
        assert!(Geometry { sqe_size: 12, ..g }.check().is_err());
        assert!(Geometry { cqe_size: 0, ..g }.check().is_err());
        assert!(Geometry {
            sqe_size: 1024,
            ..g
        }
        .check()
        .is_err());
        // The header records the class's entry sizes: a client told other sizes is refused.
        let (c, b) = r.fds();
        let other = Geometry { sqe_size: 64, ..g };
        assert!(Region::attach(
            c.try_clone_to_owned().unwrap(),
            b.try_clone_to_owned().unwrap(),
            other
        )
        .is_err());
    }

    /// The ring over its real storage ([`ShmRing`] on [`SharedMem`]), in ordinary memory so
    /// Miri can run it: a producer and a consumer thread move entries through a small ring many
    /// times around, and every entry arrives once, in order, intact.
    #[test]
    fn a_ring_in_shared_memory_moves_every_entry_once_in_order() {
        use crate::ring::{Consumer, Producer};
        let g = Geometry {
            sq_entries: 8,
            cq_entries: 8,
            sqe_size: 32,
            cqe_size: 16,
            buffer_size: 4096,
        };
        let mem = Arc::new(SharedMem::heap(g.control_size() as usize).unwrap());
        let ring = || ShmRing::new(mem.clone(), off::SQ_HEAD, off::SQ_TAIL, off::SQ, 32);
        let mut p = Producer::new(ring(), g.sq_entries);
        let mut c = Consumer::new(ring(), g.sq_entries);
        let n: u64 = if cfg!(miri) { 100 } else { 10_000 };
        let t = std::thread::spawn(move || {
            let mut next = 0u64;
            while next < n {
                let mut e = [0u8; 32];
                e[..8].copy_from_slice(&next.to_le_bytes());
                e[24..].copy_from_slice(&(!next).to_le_bytes());
                if p.push(&e).unwrap() {
                    next += 1;
                } else {
                    std::thread::yield_now();
                }
            }
        });
        let mut expect = 0u64;
        while expect < n {
            let mut e = [0u8; 32];
            if c.pop(&mut e).unwrap() {
                assert_eq!(u64::from_le_bytes(e[..8].try_into().unwrap()), expect);
                assert_eq!(u64::from_le_bytes(e[24..].try_into().unwrap()), !expect);
                expect += 1;
            } else {
                std::thread::yield_now();
            }
        }
        t.join().unwrap();
        // A peer that scribbles over the indices is caught, not trusted.
        mem.atomic_u32(off::SQ_TAIL)
            .unwrap()
            .store(u32::MAX, std::sync::atomic::Ordering::Release);
        assert!(c.pop(&mut [0u8; 32]).is_err());
    }
}
