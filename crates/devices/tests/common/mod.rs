//! Helpers shared by the device-model tests.

#![allow(dead_code)]

use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use outboard_devices::backing::Backing;
use outboard_devices::virtio_blk::BlkOptions;
use outboard_vfio_user::wire::{self, cmd, Header};
use outboard_vfio_user::{Channel, Server, ServerOptions, ServerStats};

/// A 1 MiB memory-backed virtio-blk model served on a thread, stopped by [`Running::stop`].
pub struct Running {
    pub path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<ServerStats>>,
    _dir: tempfile::TempDir,
}

impl Running {
    pub fn start() -> Self {
        Self::start_with(Duration::from_millis(300))
    }

    pub fn start_with(timeout: Duration) -> Self {
        Self::start_model(timeout, BlkOptions::default())
    }

    /// A model with the given options.
    pub fn start_model(timeout: Duration, opts: BlkOptions) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blk.sock");
        let model =
            outboard_devices::virtio_blk(Backing::open("mem:1M", None).unwrap(), opts).unwrap();
        let opts = ServerOptions {
            timeout,
            ..Default::default()
        };
        let mut server = Server::bind(&path, model, opts).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                server.run_once(Duration::from_millis(10)).unwrap();
            }
            server.stats()
        });
        Self {
            path,
            stop,
            thread: Some(thread),
            _dir: dir,
        }
    }

    pub fn stop(mut self) -> ServerStats {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .unwrap()
            .join()
            .expect("server thread did not panic")
    }
}

/// Not every test binary that includes this module waits for a state.
#[allow(unused_imports)]
pub use outboard_sys::wait::eventually;

/// A vfio-user client written by hand, message by message, as a test needs it.
pub struct Raw {
    pub chan: Channel,
    pub id: u16,
}

impl Raw {
    pub fn connect(p: &Path) -> Self {
        let s = UnixStream::connect(p).unwrap();
        Self {
            chan: Channel::new(s.into()),
            id: 0,
        }
    }
    pub fn call(
        &mut self,
        command: u16,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<Vec<u8>, u32> {
        self.call_fds(command, payload, fds).map(|(p, _)| p)
    }
    /// A call whose reply's fds the test wants too; an error reply is its errno (and any fds
    /// that came with it count as a failure of the test).
    pub fn call_fds(
        &mut self,
        command: u16,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Vec<u8>, Vec<OwnedFd>), u32> {
        self.id += 1;
        let h = Header::command(self.id, command, payload.len());
        self.chan.send(&h, payload, fds).unwrap();
        let m = self
            .chan
            .recv_within(Duration::from_secs(2))
            .expect("a reply");
        assert!(m.header.is_reply());
        assert_eq!(m.header.msg_id, self.id);
        if m.header.is_error() {
            assert!(m.fds.is_empty(), "fds with an error reply");
            Err(m.header.error)
        } else {
            Ok((m.payload, m.fds))
        }
    }
    /// VERSION with the given capabilities JSON.
    pub fn version_with(&mut self, json: &str) -> Result<Vec<u8>, u32> {
        let v = wire::Version {
            major: 0,
            minor: 1,
            json: json.into(),
        };
        self.call(cmd::VERSION, &v.encode(), &[])
    }
    pub fn version(&mut self) {
        let v = wire::Version {
            major: 0,
            minor: 1,
            json: "{}".into(),
        };
        self.call(cmd::VERSION, &v.encode(), &[]).unwrap();
    }
    /// Whether the server closed the connection (a read returns EOF within 2 s).
    pub fn closed(&self) -> bool {
        self.chan.recv_within(Duration::from_secs(2)).is_err()
    }
}

/// A DMA_MAP payload for `size` bytes at `addr`, readable and writable by the device.
pub fn dma_map(addr: u64, size: u64) -> Vec<u8> {
    wire::DmaMap {
        argsz: 32,
        flags: 3,
        offset: 0,
        addr,
        size,
    }
    .encode()
}
