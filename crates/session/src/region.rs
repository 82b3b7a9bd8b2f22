//! The shared region of a session: a control memfd (header and rings) and a separate buffer
//! memfd.
//!
//! A class declares its rings ([`RingShape`]: direction and entry size); a session picks how
//! many entries each has ([`Geometry`]). Block declares one submission ring (to the server, 32
//! bytes) and one completion ring (to the client, 16 bytes); a class may declare up to
//! [`MAX_RINGS`] rings in either direction.
//!
//! The buffer area is a memfd of its own so that it alone can be mapped into a device's DMA
//! space: the device (another process) never receives the rings. The server creates both memfds
//! and seals their size (`F_SEAL_GROW | F_SEAL_SHRINK`), so a client cannot truncate them under
//! the server (which would raise SIGBUS in the server).
//!
//! Control memfd layout (pinned by the tests below). Every index and flag is on a cache line of
//! its own, and the words each side writes are kept together, apart from the other side's: the
//! server's (its sleep flag, the heads of the rings to it, the tails of the rings from it) from
//! 256, the client's from 1024. x86 fetches lines in aligned pairs, so a side reading the
//! other's words gets two per miss, and no line pair is written by both sides.
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic u64 |
//! | 8 | version u32 |
//! | 12 | ring count u32 |
//! | 16 | buffer_size u64 |
//! | 64 + 16·i | ring i: direction u32 (0 to the server, 1 to the client), entries u32, entry size u32 |
//! | 256 | server sleeping flag |
//! | 320 + 64·i | ring i's index the server writes (head of a ring to it, tail of a ring to the client) |
//! | 1024 | client sleeping flag |
//! | 1088 + 64·i | ring i's index the client writes (tail of a ring to the server, head of a ring to it) |
//! | 4096 | ring 0's entries, then ring 1's, … each on a 64-byte boundary |

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use outboard_shm::{Access, SharedMem};
use rustix::fs::{MemfdFlags, SealFlags};

use crate::ring::RingStorage;
use crate::SessionError;

/// "OUTBOARD" in ASCII, little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"OUTBOARD");
/// Layout version (3: the class declares its rings, each described in the header).
pub const VERSION: u32 = 3;

/// Header field offsets.
pub mod off {
    /// magic.
    pub const MAGIC: u64 = 0;
    /// version.
    pub const VERSION: u64 = 8;
    /// Number of rings.
    pub const RING_COUNT: u64 = 12;
    /// buffer_size.
    pub const BUFFER_SIZE: u64 = 16;
    /// Ring `i`'s description (direction, entries, entry size).
    pub const fn ring(i: usize) -> u64 {
        64 + 16 * i as u64
    }
    use super::Direction;

    /// Server sleep flag.
    pub const SERVER_SLEEPING: u64 = 256;
    /// Client sleep flag.
    pub const CLIENT_SLEEPING: u64 = 1024;
    /// The index of ring `i` that the server writes.
    pub const fn server_index(i: usize) -> u64 {
        SERVER_SLEEPING + 64 + 64 * i as u64
    }
    /// The index of ring `i` that the client writes.
    pub const fn client_index(i: usize) -> u64 {
        CLIENT_SLEEPING + 64 + 64 * i as u64
    }
    /// Ring `i`'s head, advanced by its consumer.
    pub const fn head(i: usize, d: Direction) -> u64 {
        match d {
            Direction::ToServer => server_index(i),
            Direction::ToClient => client_index(i),
        }
    }
    /// Ring `i`'s tail, advanced by its producer.
    pub const fn tail(i: usize, d: Direction) -> u64 {
        match d {
            Direction::ToServer => client_index(i),
            Direction::ToClient => server_index(i),
        }
    }
    /// The first ring's first entry.
    pub const RINGS: u64 = 4096;
}

/// Most rings a class may declare.
pub const MAX_RINGS: usize = 8;
/// Largest ring entry a class may declare.
pub const MAX_ENTRY_SIZE: u32 = 512;
/// Largest ring.
pub const MAX_ENTRIES: u32 = 4096;
/// Largest buffer area (1 GiB).
pub const MAX_BUFFER: u64 = 1 << 30;

/// Which way a ring carries entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Direction {
    /// Client to server: requests.
    ToServer,
    /// Server to client: completions, received data, events.
    ToClient,
}

impl Direction {
    fn code(self) -> u32 {
        match self {
            Direction::ToServer => 0,
            Direction::ToClient => 1,
        }
    }
}

/// A ring as a class declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingShape {
    /// Which way it carries entries.
    pub direction: Direction,
    /// Bytes per entry.
    pub entry_size: u32,
}

impl RingShape {
    /// The shape most classes have: one ring of requests to the server (`request`-byte
    /// entries), one of completions to the client (`completion`-byte entries), and one of
    /// reasons for failed requests to the client ([`crate::reason`]).
    pub const fn request_reply(request: u32, completion: u32) -> [RingShape; 3] {
        [
            RingShape {
                direction: Direction::ToServer,
                entry_size: request,
            },
            RingShape {
                direction: Direction::ToClient,
                entry_size: completion,
            },
            RingShape {
                direction: Direction::ToClient,
                entry_size: crate::reason::REASON_SIZE,
            },
        ]
    }

    /// Where the completions are among the rings to the client, in the
    /// [`RingShape::request_reply`] shape.
    pub const COMPLETIONS: usize = 0;
    /// Where the reasons are among the rings to the client, in the same shape.
    pub const REASONS: usize = 1;
}

/// A ring as a session has it: the class's shape and the session's entry count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RingSpec {
    /// Which way it carries entries.
    pub direction: Direction,
    /// Entries (a power of two).
    pub entries: u32,
    /// Bytes per entry (the class's).
    pub entry_size: u32,
}

/// The geometry of a session: its rings, in the class's order, and its buffer area.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Geometry {
    /// The rings.
    pub rings: Vec<RingSpec>,
    /// Buffer area size (whole pages).
    pub buffer_size: u64,
}

impl Geometry {
    /// A class's rings, each with `entries` entries, and a buffer area of `buffer_size` bytes.
    pub fn of_class(shapes: &[RingShape], entries: u32, buffer_size: u64) -> Self {
        Self {
            rings: shapes
                .iter()
                .map(|s| RingSpec {
                    direction: s.direction,
                    entries,
                    entry_size: s.entry_size,
                })
                .collect(),
            buffer_size,
        }
    }

    /// Whether the rings are the ones a class declares (count, order, directions, entry sizes).
    pub fn has_shapes(&self, shapes: &[RingShape]) -> bool {
        self.rings.len() == shapes.len()
            && self
                .rings
                .iter()
                .zip(shapes)
                .all(|(r, s)| r.direction == s.direction && r.entry_size == s.entry_size)
    }

    /// The rings that carry entries `direction`, by index in the session.
    pub fn rings_to(&self, direction: Direction) -> impl Iterator<Item = (usize, &RingSpec)> {
        self.rings
            .iter()
            .enumerate()
            .filter(move |(_, r)| r.direction == direction)
    }

    /// Validates a requested geometry.
    pub fn check(&self) -> Result<(), SessionError> {
        if self.rings.is_empty() || self.rings.len() > MAX_RINGS {
            return Err(SessionError::Invalid(format!(
                "{} rings: a session has 1 to {MAX_RINGS}",
                self.rings.len()
            )));
        }
        for (i, r) in self.rings.iter().enumerate() {
            if !r.entries.is_power_of_two() || r.entries > MAX_ENTRIES {
                return Err(SessionError::Invalid(format!(
                    "ring {i} of {} entries: need a power of two up to {MAX_ENTRIES}",
                    r.entries
                )));
            }
            if !r.entry_size.is_multiple_of(8) || !(8..=MAX_ENTRY_SIZE).contains(&r.entry_size) {
                return Err(SessionError::Invalid(format!(
                    "ring {i} entries of {} bytes: need a multiple of 8 from 8 to {MAX_ENTRY_SIZE}",
                    r.entry_size
                )));
            }
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

    /// Where ring `i`'s entries start in the control memfd.
    fn ring_offset(&self, i: usize) -> u64 {
        self.rings[..i].iter().fold(off::RINGS, |at, r| {
            at + (r.entries as u64 * r.entry_size as u64).div_ceil(64) * 64
        })
    }

    /// Size of the control memfd.
    pub fn control_size(&self) -> u64 {
        self.ring_offset(self.rings.len()).div_ceil(4096) * 4096
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
        let bfd = sealed_memfd("outboard-buffers", g.buffer_size)?;
        let buffers = SharedMem::map_owned(bfd, 0, g.buffer_size as usize, Access::ReadWrite)?;
        Self::with_buffers(g, buffers)
    }

    /// A fresh control memfd (header and empty rings) around `buffers`.
    fn with_buffers(g: Geometry, buffers: SharedMem) -> Result<Self, SessionError> {
        let cfd = sealed_memfd("outboard-session", g.control_size())?;
        let control = SharedMem::map_owned(cfd, 0, g.control_size() as usize, Access::ReadWrite)?;
        control.write_u64(off::MAGIC, MAGIC)?;
        control.write_u32(off::VERSION, VERSION)?;
        control.write_u32(off::RING_COUNT, g.rings.len() as u32)?;
        control.write_u64(off::BUFFER_SIZE, g.buffer_size)?;
        for (i, r) in g.rings.iter().enumerate() {
            control.write_u32(off::ring(i), r.direction.code())?;
            control.write_u32(off::ring(i) + 4, r.entries)?;
            control.write_u32(off::ring(i) + 8, r.entry_size)?;
        }
        Ok(Self {
            control: Arc::new(control),
            buffers: Arc::new(buffers),
            geometry: g,
        })
    }

    /// Creates a region around a buffer area a client brought back from a previous server
    /// (SERVER side, `Resume`): fresh header and rings, the client's buffers. The memfd must be
    /// one a server made — sealed against growing, shrinking and further seals, with no write
    /// seal (the device must be able to write into it) — and exactly the geometry's size.
    pub fn resume(g: Geometry, buffers: OwnedFd) -> Result<Self, SessionError> {
        g.check()?;
        let seals = rustix::fs::fcntl_get_seals(&buffers).map_err(|e| {
            SessionError::Invalid(format!("the buffer area is not a sealed memfd ({e})"))
        })?;
        let needed = SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL;
        if !seals.contains(needed) || seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE) {
            return Err(SessionError::Invalid(format!(
                "the buffer area's seals are {seals:?}, not exactly grow, shrink and seal"
            )));
        }
        let size = rustix::fs::fstat(&buffers)
            .map_err(|e| SessionError::Os(e.to_string()))?
            .st_size as u64;
        if size != g.buffer_size {
            return Err(SessionError::Invalid(format!(
                "the buffer area is {size} bytes, the geometry says {}",
                g.buffer_size
            )));
        }
        let buffers = SharedMem::map_owned(buffers, 0, g.buffer_size as usize, Access::ReadWrite)?;
        Self::with_buffers(g, buffers)
    }

    /// Maps a region received from the server (CLIENT side), checking the header against the
    /// geometry the server announced.
    pub fn attach(control: OwnedFd, buffers: OwnedFd, g: Geometry) -> Result<Self, SessionError> {
        g.check()?;
        // The server's memfds: sealed by an honest server, sealed or guarded here whatever it is.
        let buffers =
            SharedMem::map_peer_owned(buffers, 0, g.buffer_size as usize, Access::ReadWrite)?;
        Self::attach_to(control, Arc::new(buffers), g)
    }

    /// Maps the control memfd of a resumed session (CLIENT side) around the buffer area the
    /// client kept, checking the header against the geometry.
    pub fn attach_to(
        control: OwnedFd,
        buffers: Arc<SharedMem>,
        g: Geometry,
    ) -> Result<Self, SessionError> {
        g.check()?;
        if buffers.len() as u64 != g.buffer_size {
            return Err(SessionError::Invalid(format!(
                "the buffer area is {} bytes, the geometry says {}",
                buffers.len(),
                g.buffer_size
            )));
        }
        let control =
            SharedMem::map_peer_owned(control, 0, g.control_size() as usize, Access::ReadWrite)?;
        let mut header_ok = control.read_u64(off::MAGIC)? == MAGIC
            && control.read_u32(off::VERSION)? == VERSION
            && control.read_u32(off::RING_COUNT)? == g.rings.len() as u32
            && control.read_u64(off::BUFFER_SIZE)? == g.buffer_size;
        for (i, r) in g.rings.iter().enumerate() {
            header_ok &= control.read_u32(off::ring(i))? == r.direction.code()
                && control.read_u32(off::ring(i) + 4)? == r.entries
                && control.read_u32(off::ring(i) + 8)? == r.entry_size;
        }
        if !header_ok {
            return Err(SessionError::Invalid(
                "session header does not match its announcement".into(),
            ));
        }
        Ok(Self {
            control: Arc::new(control),
            buffers,
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

    /// Ring `i`'s storage and capacity, if the session has that ring.
    pub fn ring(&self, i: usize) -> Option<(ShmRing, u32)> {
        let r = self.geometry.rings.get(i)?;
        let storage = ShmRing::new(
            self.control.clone(),
            off::head(i, r.direction),
            off::tail(i, r.direction),
            self.geometry.ring_offset(i),
            r.entry_size as u64,
        );
        Some((storage, r.entries))
    }

    /// The producer ends of the rings that carry entries `direction`, in session order.
    pub fn producers(&self, direction: Direction) -> Vec<crate::Producer<ShmRing>> {
        self.ends(direction, crate::Producer::new)
    }

    /// The consumer ends of the rings that carry entries `direction`, in session order.
    pub fn consumers(&self, direction: Direction) -> Vec<crate::Consumer<ShmRing>> {
        self.ends(direction, crate::Consumer::new)
    }

    fn ends<T>(&self, direction: Direction, end: impl Fn(ShmRing, u32) -> T) -> Vec<T> {
        self.geometry
            .rings_to(direction)
            .filter_map(|(i, _)| self.ring(i))
            .map(|(storage, entries)| end(storage, entries))
            .collect()
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
    #[inline]
    fn head(&self) -> &std::sync::atomic::AtomicU32 {
        self.mem
            .atomic_u32(self.head)
            .expect("index offsets are fixed and aligned")
    }
    #[inline]
    fn tail(&self) -> &std::sync::atomic::AtomicU32 {
        self.mem
            .atomic_u32(self.tail)
            .expect("index offsets are fixed and aligned")
    }
    #[inline]
    fn write_slot(&self, slot: u32, e: &[u8]) {
        // `slot < capacity` (the ring handle guarantees it) keeps this inside the mapping,
        // whose size was computed from the same capacity.
        self.mem
            .write(self.base + slot as u64 * self.entry, e)
            .expect("slot inside the ring");
    }
    #[inline]
    fn read_slot(&self, slot: u32, e: &mut [u8]) {
        self.mem
            .read(self.base + slot as u64 * self.entry, e)
            .expect("slot inside the ring");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCKLIKE: [RingShape; 2] = [
        RingShape {
            direction: Direction::ToServer,
            entry_size: 32,
        },
        RingShape {
            direction: Direction::ToClient,
            entry_size: 16,
        },
    ];

    #[test]
    fn layout_is_pinned() {
        let mut g = Geometry::of_class(&BLOCKLIKE, 128, 1 << 20);
        g.rings[1].entries = 256;
        assert_eq!(g.ring_offset(0), 4096);
        assert_eq!(g.ring_offset(1), 4096 + 128 * 32);
        assert_eq!(g.control_size(), 12288);
        let server: Vec<u64> = std::iter::once(off::SERVER_SLEEPING)
            .chain((0..MAX_RINGS).map(off::server_index))
            .collect();
        let client: Vec<u64> = std::iter::once(off::CLIENT_SLEEPING)
            .chain((0..MAX_RINGS).map(off::client_index))
            .collect();
        let all: Vec<u64> = server.iter().chain(&client).copied().collect();
        for (n, o) in all.iter().enumerate() {
            assert_eq!(o % 64, 0, "each index on its own cache line");
            assert!(all[..n].iter().all(|p| p != o), "no two share one");
        }
        // No aligned pair of lines holds words of both sides.
        let pair = |o: &u64| o / 128;
        assert!(server
            .iter()
            .all(|s| client.iter().all(|c| pair(s) != pair(c))));
        assert!(off::ring(MAX_RINGS) <= off::SERVER_SLEEPING);
        assert!(off::server_index(MAX_RINGS - 1) < off::CLIENT_SLEEPING - 128);
        assert!(off::client_index(MAX_RINGS - 1) + 64 <= off::RINGS);
        // The side that advances an index is the side that writes it.
        for d in [Direction::ToServer, Direction::ToClient] {
            let (producer, consumer) = match d {
                Direction::ToServer => (&client, &server),
                Direction::ToClient => (&server, &client),
            };
            assert!(producer.contains(&off::tail(3, d)));
            assert!(consumer.contains(&off::head(3, d)));
        }
        // An odd entry size still starts the next ring on a cache line.
        let odd = Geometry {
            rings: vec![
                RingSpec {
                    direction: Direction::ToServer,
                    entries: 1,
                    entry_size: 24,
                },
                RingSpec {
                    direction: Direction::ToClient,
                    entries: 1,
                    entry_size: 8,
                },
            ],
            buffer_size: 4096,
        };
        assert_eq!(odd.ring_offset(1), 4096 + 64);
    }

    #[test]
    fn geometry_checks_every_ring() {
        let g = Geometry::of_class(&BLOCKLIKE, 8, 8192);
        g.check().unwrap();
        assert!(g.has_shapes(&BLOCKLIKE));
        assert!(!g.has_shapes(&BLOCKLIKE[..1]));
        let mut swapped = BLOCKLIKE;
        swapped.swap(0, 1);
        assert!(!g.has_shapes(&swapped));
        let bad = |f: &dyn Fn(&mut Geometry)| {
            let mut b = g.clone();
            f(&mut b);
            b.check().is_err()
        };
        assert!(bad(&|b| b.rings.clear()));
        assert!(bad(&|b| b.rings = vec![b.rings[0]; MAX_RINGS + 1]));
        assert!(bad(&|b| b.rings[0].entries = 3));
        assert!(bad(&|b| b.rings[1].entries = 0));
        assert!(bad(&|b| b.rings[1].entries = MAX_ENTRIES * 2));
        assert!(bad(&|b| b.rings[0].entry_size = 12));
        assert!(bad(&|b| b.rings[1].entry_size = 0));
        assert!(bad(&|b| b.rings[0].entry_size = 1024));
        assert!(bad(&|b| b.buffer_size = 100));
        assert!(bad(&|b| b.buffer_size = MAX_BUFFER * 2));
        // The largest geometry's control area still has a sane size.
        let big = Geometry {
            rings: vec![
                RingSpec {
                    direction: Direction::ToServer,
                    entries: MAX_ENTRIES,
                    entry_size: MAX_ENTRY_SIZE,
                };
                MAX_RINGS
            ],
            buffer_size: 4096,
        };
        big.check().unwrap();
        assert_eq!(big.control_size(), 4096 + (MAX_RINGS as u64) * (2 << 20));
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot create or map a memfd")]
    fn attach_checks_header_and_sizes_are_sealed() {
        let g = Geometry::of_class(&BLOCKLIKE, 8, 8192);
        let r = Region::create(g.clone()).unwrap();
        let fds = || {
            let (c, b) = r.fds();
            (
                c.try_clone_to_owned().unwrap(),
                b.try_clone_to_owned().unwrap(),
            )
        };
        // A client cannot shrink the buffers under the server.
        assert!(rustix::fs::ftruncate(&fds().1, 0).is_err());
        // The header records every ring: a client told another geometry is refused.
        for change in [
            &(|g: &mut Geometry| g.rings[0].entries = 16) as &dyn Fn(&mut Geometry),
            &|g| g.rings[1].entry_size = 64,
            &|g| g.rings[1].direction = Direction::ToServer,
            &|g| g.rings.truncate(1),
            &|g| g.buffer_size = 4096,
        ] {
            let mut other = g.clone();
            change(&mut other);
            let (c, b) = fds();
            assert!(Region::attach(c, b, other).is_err());
        }
        let (c, b) = fds();
        let attached = Region::attach(c, b, g).unwrap();
        assert_eq!(attached.producers(Direction::ToServer).len(), 1);
        assert_eq!(attached.consumers(Direction::ToClient).len(), 1);
        assert!(attached.ring(2).is_none());
    }

    /// A resumed session keeps the client's buffers (same bytes, new rings); a buffer area that
    /// is not a server's sealed memfd of the right size is refused.
    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot create or map a memfd")]
    fn resume_takes_back_only_a_sealed_buffer_area_of_the_right_size() {
        let g = Geometry::of_class(&BLOCKLIKE, 8, 8192);
        let old = Region::create(g.clone()).unwrap();
        old.buffers.write(4096, b"kept").unwrap();
        let bfd = || old.fds().1.try_clone_to_owned().unwrap();
        let new = Region::resume(g.clone(), bfd()).unwrap();
        let mut kept = [0; 4];
        new.buffers.read(4096, &mut kept).unwrap();
        assert_eq!(&kept, b"kept");
        assert_ne!(
            rustix::fs::fstat(new.fds().0).unwrap().st_ino,
            rustix::fs::fstat(old.fds().0).unwrap().st_ino,
            "the rings are new"
        );
        let e = Region::resume(
            Geometry {
                buffer_size: 4096,
                ..g.clone()
            },
            bfd(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("8192 bytes"), "{e}");
        let plain = rustix::fs::memfd_create("plain", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&plain, 8192).unwrap();
        let e = Region::resume(g.clone(), plain).unwrap_err();
        assert!(e.to_string().contains("seals"), "{e}");
        let file = tempfile::tempfile().unwrap();
        file.set_len(8192).unwrap();
        let e = Region::resume(g, file.into()).unwrap_err();
        assert!(e.to_string().contains("not a sealed memfd"), "{e}");
    }

    /// Rings in both directions, several of each, over one control area: entries pushed into
    /// each ring come out of that ring and no other.
    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot create or map a memfd")]
    fn each_declared_ring_is_its_own() {
        let shapes = [
            RingShape {
                direction: Direction::ToServer,
                entry_size: 16,
            },
            RingShape {
                direction: Direction::ToClient,
                entry_size: 8,
            },
            RingShape {
                direction: Direction::ToServer,
                entry_size: 64,
            },
        ];
        let g = Geometry::of_class(&shapes, 4, 4096);
        let server = Region::create(g.clone()).unwrap();
        let (c, b) = server.fds();
        let client = Region::attach(
            c.try_clone_to_owned().unwrap(),
            b.try_clone_to_owned().unwrap(),
            g,
        )
        .unwrap();
        let mut out = client.producers(Direction::ToServer);
        let mut into = server.consumers(Direction::ToServer);
        assert_eq!((out.len(), into.len()), (2, 2));
        assert!(out[0].push(&[1; 16]).unwrap());
        assert!(out[1].push(&[2; 64]).unwrap());
        assert!(out[1].push(&[3; 64]).unwrap());
        let mut e16 = [0; 16];
        let mut e64 = [0; 64];
        assert!(into[0].pop(&mut e16).unwrap());
        assert_eq!(e16, [1; 16]);
        assert!(!into[0].pop(&mut e16).unwrap());
        assert!(into[1].pop(&mut e64).unwrap());
        assert_eq!(e64, [2; 64]);
        assert!(into[1].pop(&mut e64).unwrap());
        assert_eq!(e64, [3; 64]);
        let mut back = server.producers(Direction::ToClient);
        let mut from = client.consumers(Direction::ToClient);
        assert!(back[0].push(&[9; 8]).unwrap());
        let mut e8 = [0; 8];
        assert!(from[0].pop(&mut e8).unwrap());
        assert_eq!(e8, [9; 8]);
    }

    /// The ring over its real storage ([`ShmRing`] on [`SharedMem`]), in ordinary memory so
    /// Miri can run it: a producer and a consumer thread move entries through a small ring many
    /// times around, and every entry arrives once, in order, intact.
    #[test]
    fn a_ring_in_shared_memory_moves_every_entry_once_in_order() {
        use crate::ring::{Consumer, Producer};
        let g = Geometry::of_class(&BLOCKLIKE, 8, 4096);
        let mem = Arc::new(SharedMem::heap(g.control_size() as usize).unwrap());
        let d = Direction::ToServer;
        let ring = || {
            ShmRing::new(
                mem.clone(),
                off::head(0, d),
                off::tail(0, d),
                off::RINGS,
                32,
            )
        };
        let mut p = Producer::new(ring(), 8);
        let mut c = Consumer::new(ring(), 8);
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
        mem.atomic_u32(off::tail(0, d))
            .unwrap()
            .store(u32::MAX, std::sync::atomic::Ordering::Release);
        assert!(c.pop(&mut [0u8; 32]).is_err());
    }
}
