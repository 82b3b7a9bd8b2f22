//! Helpers shared by the vfio-user tests.

#![allow(dead_code)]

use outboard_vfio_user::wire::region;
use outboard_vfio_user::RegionDesc;

/// A 4 KiB read-write BAR0 reached by trapped accesses, and a 256-byte configuration space:
/// the smallest device a test backend needs.
pub fn bar0_and_config() -> Vec<RegionDesc<'static>> {
    vec![
        RegionDesc {
            index: region::BAR0,
            size: 0x1000,
            flags: region::FLAG_READ | region::FLAG_WRITE,
            mmap: None,
        },
        RegionDesc {
            index: region::CONFIG,
            size: 256,
            flags: region::FLAG_READ,
            mmap: None,
        },
    ]
}

/// A server for `backend` at `path`, run on a thread until [`Served::stop`].
pub struct Served {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

/// Binds `backend` at `path` and serves it on a thread.
pub fn serve<B: outboard_vfio_user::DeviceBackend + Send + 'static>(
    path: &std::path::Path,
    backend: B,
) -> Served {
    use std::sync::atomic::Ordering;
    let mut server = outboard_vfio_user::Server::bind(
        path,
        backend,
        outboard_vfio_user::ServerOptions::default(),
    )
    .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    let thread = std::thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            server
                .run_once(std::time::Duration::from_millis(10))
                .unwrap();
        }
    });
    Served { stop, thread }
}

impl Served {
    /// Stops the server and waits for its thread.
    pub fn stop(self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap();
    }
}
