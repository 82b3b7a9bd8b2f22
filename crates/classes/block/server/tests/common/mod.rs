//! Helpers shared by the driver-host tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use outboard_block::{BlockDevice, BlockError, BlockOp, BlockRequest};
use outboard_block::{Cqe, Sqe};
use outboard_block_client::{BlockClient, SessionOptions};
use outboard_devices::backing::Backing;
use outboard_drivers::virtio_blk::{BlkDriverOptions, VirtioBlk};
use outboard_drivers::virtio_block::VirtioBlock;
use outboard_hw::backend::in_process::InProcess;
use outboard_hw::PciFunction;
use outboard_server::{DriverHost, HostStats};
use outboard_session::control::{self, Reply, Request};
use outboard_session::region::ShmRing;
use outboard_session::{Consumer, Direction, Doorbell, Geometry, Producer, Region};
use std::os::fd::{AsFd, OwnedFd};

/// A memory-backed virtio-blk model in this process, with its driver brought up as `disk0`.
pub fn disk(size: &str) -> (VirtioBlock, Arc<InProcess>) {
    disk_with_queues(size, 1)
}

/// The same with `queues` request queues, all driven.
pub fn disk_with_queues(size: &str, queues: u16) -> (VirtioBlock, Arc<InProcess>) {
    let model = outboard_devices::virtio_blk(
        Backing::open(&format!("mem:{size}"), None).unwrap(),
        outboard_devices::virtio_blk::BlkOptions {
            num_queues: queues,
            ..Default::default()
        },
    )
    .unwrap();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    let f = PciFunction::with_backend("in-process".into(), backend.clone()).unwrap();
    let opts = BlkDriverOptions {
        queues,
        ..Default::default()
    };
    (
        VirtioBlock::new("disk0", VirtioBlk::new(f, opts).unwrap()),
        backend,
    )
}

/// A driver host serving one disk on a thread.
pub struct Served {
    /// Its control socket.
    pub sock: PathBuf,
    /// The device model behind it.
    pub backend: Arc<InProcess>,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<HostStats, outboard_server::HostError>>,
}

impl Served {
    /// Serves a disk of `size` with a control socket in `dir`.
    pub fn start(dir: &Path, size: &str) -> Self {
        let (host, backend) = disk(size);
        let sock = dir.join("host.sock");
        let (stop, thread) = DriverHost::bind(
            &sock,
            vec![{
                let env = host.env();
                outboard_block_server::BlockDispatcher::served(host, env)
            }],
        )
        .unwrap()
        .spawn();
        Self {
            sock,
            backend,
            stop,
            thread,
        }
    }

    /// Stops the host after letting closing sessions finish, and returns its counters.
    pub fn stop(self) -> HostStats {
        std::thread::sleep(Duration::from_millis(200)); // sessions are released asynchronously
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .expect("host thread")
            .expect("host ran cleanly")
    }
}

/// A client that speaks the session protocol by hand, so it can break it.
pub struct Raw {
    pub sock: OwnedFd,
    pub region: Region,
    sq: Producer<ShmRing>,
    cq: Consumer<ShmRing>,
    reasons: Consumer<ShmRing>,
    pub bell: Doorbell,
}

/// The geometry a raw client opens: the block class's rings, 16 entries each, 64 KiB of buffers.
pub fn g() -> Geometry {
    Geometry::of_class(&outboard_block::RINGS, 16, 65536)
}

impl Raw {
    pub fn open(sock_path: &Path) -> Self {
        let sock = control::connect(sock_path).unwrap();
        let req = Request::Open {
            device: "disk0".into(),
            class: "block".into(),
            geometry: g(),
        };
        let (reply, fds) = control::call(sock.as_fd(), &req, Duration::from_secs(5)).unwrap();
        assert!(matches!(reply, Reply::Opened { .. }));
        let [c, b, sb, _cb]: [OwnedFd; 4] = fds.try_into().unwrap();
        let region = Region::attach(c, b, g()).unwrap();
        let mut to_client = region.consumers(Direction::ToClient);
        Self {
            sq: region.producers(Direction::ToServer).remove(0),
            reasons: to_client.remove(1),
            cq: to_client.remove(0),
            region,
            sock,
            bell: Doorbell::from_fd(sb),
        }
    }
    pub fn send(&mut self, entries: &[[u8; 32]]) {
        for e in entries {
            assert!(self.sq.stage(e).unwrap());
        }
        self.sq.publish();
        self.bell.ring();
    }
    pub fn completions(&mut self, n: usize) -> Vec<(u64, Result<u32, BlockError>)> {
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
    /// The next entry of the reasons ring, decoded, if there is one.
    pub fn reason(&mut self) -> Option<(u64, String)> {
        let mut e = [0u8; outboard_session::reason::REASON_SIZE as usize];
        self.reasons
            .pop(&mut e)
            .unwrap()
            .then(|| outboard_session::reason::decode(&e).expect("a well-formed reason"))
    }

    /// Whether the server hung up on us.
    pub fn cut_off(&self) -> bool {
        control::recv::<Reply>(self.sock.as_fd(), Some(Duration::from_secs(2))).is_err()
    }
}

pub fn entry(op: u8, tag: u64, lba: u64, blocks: u32, buf: u32) -> [u8; 32] {
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
pub fn good_client_works(sock: &Path) {
    let mut d = BlockClient::open(sock, "disk0", SessionOptions::default()).unwrap();
    let data: Vec<u8> = (0..4096).map(|i| (i * 7) as u8).collect();
    d.write_blocks(100, &data).unwrap();
    let mut back = vec![0u8; 4096];
    d.read_blocks(100, &mut back).unwrap();
    assert_eq!(back, data);
}

pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

pub fn maps() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count()
}

/// Not every test binary that includes this module waits for a state.
#[allow(unused_imports)]
pub use outboard_sys::wait::eventually;
