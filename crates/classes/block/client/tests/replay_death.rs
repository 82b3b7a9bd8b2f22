//! A driver server that dies while it answers a client's replay, against scripted servers
//! and a scripted manager, so that every step happens in the order that once lost data.
//!
//! A replay's answers are tagged by their place in the replay, not by the client's slots. When
//! the server answering a replay died with an answer posted and unread, the client read that
//! channel as if it were the session's own: the answer to the replay's first request (the
//! oldest, here in slot 1) completed the request in slot 0 — a read finished with no data, a
//! write acknowledged that no device made. The client must instead send the whole replay again
//! to the next server, and each request must get its own answer.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_block::{BlockDevice, BlockError, BlockOp, BlockRequest, Sqe, SQE_SIZE};
use outboard_block_client::{BlockClient, SessionOptions};
use outboard_client::{Control, Supervisor};
use outboard_session::completion::Completion;
use outboard_session::control::{self, Reply, Request};
use outboard_session::doorbell::Doorbell;
use outboard_session::{Consumer, Direction, Producer, Region};

const LIMIT: Duration = Duration::from_secs(20);

/// A listening socket at `path` (removed when the second half is dropped).
fn listen(path: &Path) -> (OwnedFd, impl Send) {
    control::listen(path).unwrap()
}

/// The next connection on `l`, within [`LIMIT`].
fn accept(l: BorrowedFd<'_>) -> OwnedFd {
    let mut p = [rustix::event::PollFd::new(&l, rustix::event::PollFlags::IN)];
    let ts = rustix::time::Timespec {
        tv_sec: LIMIT.as_secs() as _,
        tv_nsec: 0,
    };
    assert_eq!(
        rustix::event::poll(&mut p, Some(&ts)).unwrap(),
        1,
        "no client came"
    );
    control::accept(l).unwrap()
}

/// A manager that says, whatever it is asked, that the device is restarting: the client then
/// waits for the server to come back where it was.
fn manager(path: &Path, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let (l, _at) = listen(path);
    std::thread::spawn(move || {
        let _at = _at;
        while !stop.load(Ordering::Relaxed) {
            let mut p = [rustix::event::PollFd::new(&l, rustix::event::PollFlags::IN)];
            let ts = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 50_000_000,
            };
            if rustix::event::poll(&mut p, Some(&ts)).unwrap_or(0) == 0 {
                continue;
            }
            let c = control::accept(l.as_fd()).unwrap();
            if control::recv::<serde_json::Value>(c.as_fd(), Some(LIMIT)).is_ok() {
                let reply = outboard_client::api::Reply::Error {
                    code: outboard_session::Code::Restarting,
                    message: "restarting".into(),
                };
                let _ = control::send(c.as_fd(), &reply, &[]);
            }
        }
    })
}

/// One incarnation of a scripted server: the session it opened or resumed.
struct Incarnation {
    _sock: OwnedFd,
    region: Region,
    from_client: Consumer<outboard_session::region::ShmRing>,
    to_client: Producer<outboard_session::region::ShmRing>,
    client_bell: Doorbell,
    _server_bell: Doorbell,
}

impl Incarnation {
    /// Takes the client's open (or resume) on `sock` and answers it.
    fn accept(sock: OwnedFd) -> Self {
        let (req, mut fds) = control::recv::<Request>(sock.as_fd(), Some(LIMIT)).unwrap();
        let (geometry, region) = match req {
            Request::Open { geometry, .. } => (geometry.clone(), Region::create(geometry)),
            Request::Resume { geometry, .. } => (
                geometry.clone(),
                Region::resume(geometry, fds.pop().expect("the buffer area")),
            ),
            other => panic!("{other:?}"),
        };
        let region = region.unwrap();
        let (server_bell, client_bell) = (Doorbell::new().unwrap(), Doorbell::new().unwrap());
        let info = serde_json::json!({
            "name": "disk0", "capacity": 1024, "block_size": 512,
            "read_only": false, "queue_depth": 8,
        });
        let (cfd, bfd) = region.fds();
        control::send(
            sock.as_fd(),
            &Reply::Opened {
                session: 1,
                geometry,
                info,
            },
            &[cfd, bfd, server_bell.fd(), client_bell.fd()],
        )
        .unwrap();
        Self {
            from_client: region.consumers(Direction::ToServer).remove(0),
            to_client: region.producers(Direction::ToClient).remove(0),
            region,
            _sock: sock,
            client_bell,
            _server_bell: server_bell,
        }
    }

    /// The next `n` requests the client sends, within [`LIMIT`].
    fn requests(&mut self, n: usize) -> Vec<BlockRequest> {
        let until = Instant::now() + LIMIT;
        let mut out = Vec::new();
        while out.len() < n {
            let mut e = [0u8; SQE_SIZE as usize];
            if self.from_client.pop(&mut e).unwrap() {
                out.push(Sqe(e).decode().unwrap());
            } else {
                assert!(Instant::now() < until, "{} of {n} requests came", out.len());
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        out
    }

    /// Posts the answer to `tag`; the client is rung only if `ring`.
    fn answer(&mut self, tag: u64, result: Result<u32, BlockError>, ring: bool) {
        assert!(self
            .to_client
            .push(&Completion::of(tag, &result).encode())
            .unwrap());
        if ring {
            self.client_bell.ring();
        }
    }

    /// Waits (within [`LIMIT`]) until the client sleeps on its doorbell.
    fn client_asleep(&self) {
        let until = Instant::now() + LIMIT;
        while !outboard_session::doorbell::peer_sleeping(self.region.client_sleeping()) {
            assert!(Instant::now() < until, "the client never slept");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Past its last look at the ring, in poll.
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn write(lba: u64, tag: u64) -> BlockRequest {
    BlockRequest {
        op: BlockOp::Write,
        lba,
        blocks: 8,
        buf_offset: lba * 512,
        tag,
    }
}

#[test]
fn a_server_that_dies_with_a_replay_answer_unread_costs_each_request_its_own_answer() {
    let dir = std::env::temp_dir().join(format!("replay-death-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (server_path, manager_path): (PathBuf, PathBuf) =
        (dir.join("server.sock"), dir.join("control.sock"));
    let stop = Arc::new(AtomicBool::new(false));
    let mgr = manager(&manager_path, stop.clone());
    let (listener, at) = listen(&server_path);
    let script = std::thread::spawn(move || {
        let _at = at;
        let l = listener.as_fd();
        // The first server: answers A, takes B and C, and dies with both unanswered.
        let mut first = Incarnation::accept(accept(l));
        let ab = first.requests(2);
        first.answer(ab[0].tag, Ok(4096), true);
        let c = first.requests(1)[0];
        drop(first);
        // The second: the replay comes (B, the oldest, first; then C). It answers B, the
        // replay's request 0, without ringing, and dies before the client reads it.
        let mut second = Incarnation::accept(accept(l));
        let replay = second.requests(2);
        assert_eq!(replay[0].lba, ab[1].lba, "the oldest first");
        assert_eq!(replay[1].lba, c.lba);
        second.client_asleep();
        second.answer(replay[0].tag, Ok(4096), false);
        drop(second);
        // The third: whatever is replayed gets its answer: B succeeds, C fails (a device
        // error), so C's answer says which server gave it.
        let mut third = Incarnation::accept(accept(l));
        let replay = third.requests(2);
        for r in &replay {
            let result = if r.lba == c.lba {
                Err(BlockError::Timeout)
            } else {
                Ok(4096)
            };
            third.answer(r.tag, result, true);
        }
        // Kept until the client is done with it.
        std::thread::sleep(Duration::from_secs(2));
    });
    let supervisor = Supervisor {
        control: Control::Socket(manager_path),
        patience: LIMIT,
    };
    let opts = SessionOptions {
        depth: 8,
        buffer_size: 1 << 20,
        mode: outboard_client::WaitMode::Blocking,
        timeout: Duration::from_secs(5),
    };
    let mut dev = BlockClient::open_supervised(supervisor, &server_path, "disk0", opts).unwrap();
    // A in slot 0 and B in slot 1; A answered frees slot 0 for C, newer than B.
    dev.submit(&write(0, 100)).unwrap();
    dev.submit(&write(8, 101)).unwrap();
    dev.kick().unwrap();
    let mut done = Vec::new();
    while !done
        .iter()
        .any(|c: &outboard_block::BlockCompletion| c.tag == 100)
    {
        dev.wait(&mut done, LIMIT).unwrap();
    }
    assert_eq!(done.remove(0).result, Ok(4096));
    dev.submit(&write(16, 102)).unwrap();
    dev.kick().unwrap();
    let until = Instant::now() + LIMIT;
    while done.len() < 2 {
        assert!(Instant::now() < until, "answers: {done:?}");
        let _ = dev.wait(&mut done, LIMIT);
    }
    stop.store(true, Ordering::Relaxed);
    let of = |tag| done.iter().find(|c| c.tag == tag).map(|c| c.result.clone());
    assert_eq!(of(101), Some(Ok(4096)), "B: {done:?}");
    // C was never answered but by the third server, which failed it.
    assert_eq!(of(102), Some(Err(BlockError::Timeout)), "C: {done:?}");
    script.join().unwrap();
    mgr.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
