//! Helpers shared by the driver-host tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use outboard_devices::backing::Backing;
use outboard_drivers::virtio_blk::{BlkDriverOptions, VirtioBlk};
use outboard_hw::backend::in_process::InProcess;
use outboard_hw::PciFunction;
use outboard_server::{BlockHost, DriverHost, HostStats};

/// A memory-backed virtio-blk model in this process, with its driver brought up as `disk0`.
pub fn disk(size: &str) -> (BlockHost, Arc<InProcess>) {
    let model = outboard_devices::virtio_blk(
        Backing::open(&format!("mem:{size}"), None).unwrap(),
        Default::default(),
    )
    .unwrap();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    let f = PciFunction::with_backend("in-process".into(), backend.clone()).unwrap();
    (
        BlockHost::new(
            "disk0",
            VirtioBlk::new(f, BlkDriverOptions::default()).unwrap(),
        ),
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
    thread: JoinHandle<Result<HostStats, String>>,
}

impl Served {
    /// Serves a disk of `size` with a control socket in `dir`.
    pub fn start(dir: &Path, size: &str) -> Self {
        let (host, backend) = disk(size);
        let sock = dir.join("host.sock");
        let (stop, thread) = DriverHost::bind(&sock, vec![host]).unwrap().spawn();
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
