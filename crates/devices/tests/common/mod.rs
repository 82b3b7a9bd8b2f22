//! Helpers shared by the device-model tests.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use outboard_devices::backing::Backing;
use outboard_devices::virtio_blk::BlkOptions;
use outboard_vfio_user::{Server, ServerOptions, ServerStats};

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
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blk.sock");
        let model = outboard_devices::virtio_blk(
            Backing::open("mem:1M", None).unwrap(),
            BlkOptions::default(),
        )
        .unwrap();
        let opts = ServerOptions { timeout };
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

/// Waits until `cond` holds, re-checking as the system settles, for at most `limit`: tests
/// wait for the state they assert, never a fixed time a loaded machine may not honour.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
