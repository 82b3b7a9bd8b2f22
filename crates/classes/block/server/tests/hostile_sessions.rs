//! Hostile clients: garbage entries, out-of-range requests, reused tags, an overfilled ring, a
//! client that vanishes with requests in flight. Each gets an error or is cut off; the server
//! keeps serving a well-behaved client correctly and leaks nothing.

mod common;

use std::os::fd::AsFd;
use std::time::Duration;

use outboard_block::BlockError;
use outboard_session::control::{self, Reply, Request};
use outboard_session::region::off;

const SIZE: &str = "1M";

use common::{entry, good_client_works, Raw};

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
fn a_failure_sends_its_reason_ahead_and_a_client_that_never_reads_them_loses_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let mut raw = Raw::open(&srv.sock);
    // Three ring-fulls of bad requests, the reasons never read: the reasons ring fills after
    // the first, and the server goes on without them — every completion still comes.
    for round in 0..3u64 {
        let batch: Vec<[u8; 32]> = (0..16)
            .map(|i| entry(99, round * 16 + i, 0, 1, 0))
            .collect();
        raw.send(&batch);
        let got = raw.completions(16);
        assert!(got
            .iter()
            .all(|(_, r)| matches!(r, Err(BlockError::Invalid(_)))));
    }
    // The first ring-full's reasons wait, in order, each naming its request and saying why.
    for tag in 0..16 {
        let (t, why) = raw.reason().expect("a reason for each of the first 16");
        assert_eq!(t, tag);
        assert_eq!(why, "unknown opcode 99");
    }
    assert_eq!(raw.reason(), None, "the later ones were not sent");
    good_client_works(&srv.sock);
    srv.stop();
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
    raw.region
        .control
        .write_u32(off::tail(0, outboard_session::Direction::ToServer), 1000)
        .unwrap();
    raw.bell.ring();
    assert!(raw.cut_off(), "the server hangs up on a corrupt ring");
    good_client_works(&sock);
    let stats = srv.stop();
    assert_eq!(stats.cut_off, 1);
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

/// `Open` names the class; a block device refuses another class, and refuses rings that are not
/// the ones the block class declares: other entry sizes, another count, another direction.
#[test]
fn an_open_for_another_class_or_other_rings_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let s = control::connect(&srv.sock).unwrap();
    let open = |class: &str, geometry| Request::Open {
        device: "disk0".into(),
        class: class.into(),
        geometry,
    };
    let refused = |req: &Request| {
        let (reply, fds) = control::call(s.as_fd(), req, Duration::from_secs(2)).unwrap();
        assert!(fds.is_empty());
        match reply {
            Reply::Error { code, message } => (code, message),
            other => panic!("opened: {other:?}"),
        }
    };
    let (code, message) = refused(&open("net", common::g()));
    assert_eq!(code, outboard_session::Code::WrongClass);
    assert!(message.contains("the block class"), "{message}");
    let mut wide = common::g();
    wide.rings[0].entry_size = 64;
    let mut extra = common::g();
    extra.rings.push(extra.rings[1]);
    let mut reversed = common::g();
    reversed.rings.reverse();
    let mut none = common::g();
    none.rings.clear();
    for geometry in [wide, extra, reversed, none] {
        let (code, message) = refused(&open("block", geometry.clone()));
        assert_eq!(code, outboard_session::Code::Invalid, "{geometry:?}");
        assert!(
            message.contains("32-byte entries to the server, 16-byte entries to the client"),
            "{message}"
        );
    }
    good_client_works(&srv.sock);
    srv.stop();
}

fn open_with(
    sock: &std::path::Path,
    buffer_size: u64,
) -> Result<outboard_block_client::BlockClient, BlockError> {
    let opts = outboard_block_client::SessionOptions {
        buffer_size,
        ..Default::default()
    };
    outboard_block_client::BlockClient::open(sock, "disk0", opts)
}

/// Reliability defect 11: one session could claim a 1 GiB buffer area, and clients coming and
/// going used up the device's address space for good.
#[test]
fn a_client_cannot_claim_the_servers_memory_or_address_space() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let e = open_with(&srv.sock, 1 << 30).unwrap_err();
    assert!(
        matches!(&e, BlockError::Invalid(m) if m.contains("more than this server gives")),
        "{e}"
    );
    // Sessions come and go many times over: their buffers' addresses are reused, so opening
    // never fails for lack of them (each 64 MiB session also takes a guard page).
    for _ in 0..300 {
        let c = open_with(&srv.sock, 64 << 20).unwrap();
        drop(c);
    }
    // Too many at once is "busy", and room comes back when they close.
    let many: Vec<_> = (0..16).map(|_| open_with(&srv.sock, 64 << 20)).collect();
    let refused = many
        .iter()
        .filter(|r| matches!(r, Err(BlockError::Busy(_))))
        .count();
    assert_eq!(refused, 0, "16 × 64 MiB fits the 1 GiB default");
    let e = open_with(&srv.sock, 64 << 20).unwrap_err();
    assert!(matches!(e, BlockError::Busy(_)), "{e}");
    drop(many);
    // The server releases a session when it sees its client leave: wait for that, not a time.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while let Err(BlockError::Busy(_)) = open_with(&srv.sock, 64 << 20) {
        assert!(std::time::Instant::now() < deadline, "room never came back");
        std::thread::yield_now();
    }
    common::good_client_works(&srv.sock);
    srv.stop();
}
