//! Hostile clients: garbage entries, out-of-range requests, reused tags, an overfilled ring, a
//! client that vanishes with requests in flight. Each gets an error or is cut off; the server
//! keeps serving a well-behaved client correctly and leaks nothing.

mod common;

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use outboard_class::block::{Cqe, Sqe};
use outboard_class::{BlockClient, BlockDevice, BlockError, BlockOp, BlockRequest, SessionOptions};
use outboard_session::control::{self, Reply, Request};
use outboard_session::region::{off, ShmRing};
use outboard_session::{Consumer, Doorbell, Geometry, Producer, Region};

/// A client that speaks the session protocol by hand, so it can break it.
struct Raw {
    sock: OwnedFd,
    region: Region,
    sq: Producer<ShmRing>,
    cq: Consumer<ShmRing>,
    bell: Doorbell,
}

const G: Geometry = Geometry {
    sq_entries: 16,
    cq_entries: 16,
    buffer_size: 65536,
};

impl Raw {
    fn open(sock_path: &Path) -> Self {
        let sock = control::connect(sock_path).unwrap();
        let req = Request::Open {
            device: "disk0".into(),
            geometry: G,
        };
        let (reply, fds) = control::call(sock.as_fd(), &req, Duration::from_secs(5)).unwrap();
        assert!(matches!(reply, Reply::Opened { .. }));
        let [c, b, sb, _cb]: [OwnedFd; 4] = fds.try_into().unwrap();
        let region = Region::attach(c, b, G).unwrap();
        Self {
            sq: Producer::new(region.sq(), G.sq_entries),
            cq: Consumer::new(region.cq(), G.cq_entries),
            region,
            sock,
            bell: Doorbell::from_fd(sb),
        }
    }
    fn send(&mut self, entries: &[[u8; 32]]) {
        for e in entries {
            assert!(self.sq.stage(e).unwrap());
        }
        self.sq.publish();
        self.bell.ring();
    }
    fn completions(&mut self, n: usize) -> Vec<(u64, Result<u32, BlockError>)> {
        let mut out = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while out.len() < n {
            let mut e = [0u8; 16];
            if self.cq.pop(&mut e).unwrap() {
                let c = Cqe(e).decode();
                out.push((c.tag, c.result));
            } else {
                assert!(std::time::Instant::now() < deadline, "no completion");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        out
    }
    /// Whether the server hung up on us.
    fn cut_off(&self) -> bool {
        control::recv::<Reply>(self.sock.as_fd(), Some(Duration::from_secs(2))).is_err()
    }
}

const SIZE: &str = "1M";

fn entry(op: u8, tag: u64, lba: u64, blocks: u32, buf: u32) -> [u8; 32] {
    let mut e = Sqe::encode(&BlockRequest {
        op: BlockOp::Read,
        lba,
        blocks,
        buf_offset: buf as u64,
        tag,
    })
    .0;
    e[0] = op;
    e
}

/// A well-behaved client's round trip, to show the server still serves others correctly.
fn good_client_works(sock: &Path) {
    let mut d = BlockClient::open(sock, "disk0", SessionOptions::default()).unwrap();
    let data: Vec<u8> = (0..4096).map(|i| (i * 7) as u8).collect();
    d.write_blocks(100, &data).unwrap();
    let mut back = vec![0u8; 4096];
    d.read_blocks(100, &mut back).unwrap();
    assert_eq!(back, data);
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn maps() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count()
}

#[test]
fn bad_entries_get_specific_errors_and_others_keep_working() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let sock = srv.sock.clone();
    let mut raw = Raw::open(&sock);
    let mut reserved = entry(1, 5, 0, 1, 0);
    reserved[3] = 0xee;
    raw.send(&[
        entry(99, 1, 0, 1, 0),    // unknown opcode
        entry(1, 2, 2048, 1, 0),  // past the end of a 1 MiB disk
        entry(1, 3, 0, 1, 65535), // buffer past the buffer area
        entry(1, 4, 0, 0, 0),     // zero blocks
        reserved,                 // reserved bytes set
        entry(1, 6, 0, 1, 0),     // fine
    ]);
    let mut got = raw.completions(6);
    got.sort_by_key(|c| c.0);
    assert!(matches!(got[0].1, Err(BlockError::Invalid(_))));
    assert_eq!(got[1].1, Err(BlockError::OutOfRange));
    assert_eq!(got[2].1, Err(BlockError::BadBuffer));
    assert!(matches!(got[3].1, Err(BlockError::Invalid(_))));
    assert!(matches!(got[4].1, Err(BlockError::Invalid(_))));
    assert_eq!(got[5].1, Ok(512));
    good_client_works(&sock);
    let stats = srv.stop();
    assert_eq!(stats.rejected, 5);
}

#[test]
fn reused_tags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let sock = srv.sock.clone();
    let mut raw = Raw::open(&sock);
    // Sixteen reads under one tag: whichever are in flight together, the repeats are refused.
    let same: Vec<[u8; 32]> = (0..16).map(|_| entry(1, 7, 0, 64, 0)).collect();
    raw.send(&same);
    let got = raw.completions(16);
    assert!(
        got.iter().any(|c| c.1 == Err(BlockError::DuplicateTag)),
        "{got:?}"
    );
    assert!(got.iter().any(|c| c.1 == Ok(32768)), "{got:?}");
    good_client_works(&sock);
    srv.stop();
}

#[test]
fn an_overfilled_ring_cuts_the_client_off_and_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let sock = srv.sock.clone();
    let raw = Raw::open(&sock);
    // Claim 1000 entries in a 16-entry ring.
    raw.region.control.write_u32(off::SQ_TAIL, 1000).unwrap();
    raw.bell.ring();
    assert!(raw.cut_off(), "the server hangs up on a corrupt ring");
    good_client_works(&sock);
    let stats = srv.stop();
    assert_eq!(stats.cut_off, 1);
}

#[test]
fn a_client_killed_with_requests_in_flight_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let (sock, backend) = (srv.sock.clone(), srv.backend.clone());
    good_client_works(&sock); // warm up: the first session's one-time allocations
    std::thread::sleep(Duration::from_millis(200));
    let (fds, mapped, dma) = (
        open_fds(),
        maps(),
        backend.with_device(|_, ctx| ctx.dma.len()),
    );
    for round in 0..5 {
        let mut raw = Raw::open(&sock);
        let reads: Vec<[u8; 32]> = (0..16)
            .map(|i| entry(1, i, i * 8, 8, (i as u32) * 4096))
            .collect();
        raw.send(&reads);
        drop(raw); // gone, with up to 16 requests in the device
        std::thread::sleep(Duration::from_millis(50 + round * 10));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        backend.with_device(|_, ctx| ctx.dma.len()),
        dma,
        "DMA mappings released"
    );
    assert_eq!(open_fds(), fds, "fds released");
    assert_eq!(maps(), mapped, "memory maps released");
    good_client_works(&sock);
    let stats = srv.stop();
    assert_eq!(stats.sessions_opened, stats.sessions_released);
}

#[test]
fn garbage_control_messages_get_error_replies() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let sock = srv.sock.clone();
    let s = control::connect(&sock).unwrap();
    rustix::net::send(&s, b"not json at all", rustix::net::SendFlags::empty()).unwrap();
    let (reply, _): (Reply, _) = control::recv(s.as_fd(), Some(Duration::from_secs(2))).unwrap();
    assert!(matches!(reply, Reply::Error { .. }));
    let (reply, _) = control::call(
        s.as_fd(),
        &Request::Status {
            device: "disk0".into(),
        },
        Duration::from_secs(2),
    )
    .unwrap();
    assert!(
        matches!(reply, Reply::Status { .. }),
        "the connection survives"
    );
    good_client_works(&sock);
    srv.stop();
}
