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

/// A device with nothing to do: BAR0 and configuration space that read as zeros and ignore
/// writes.
pub struct Idle;

impl outboard_vfio_user::DeviceBackend for Idle {
    fn regions(&self) -> Vec<RegionDesc<'_>> {
        bar0_and_config()
    }
    fn irqs(&self) -> Vec<outboard_vfio_user::wire::IrqInfo> {
        vec![]
    }
    fn region_read(
        &mut self,
        _: &mut outboard_vfio_user::DeviceContext,
        _: u32,
        _: u64,
        buf: &mut [u8],
    ) -> Result<(), rustix::io::Errno> {
        buf.fill(0);
        Ok(())
    }
    fn region_write(
        &mut self,
        _: &mut outboard_vfio_user::DeviceContext,
        _: u32,
        _: u64,
        _: &[u8],
    ) -> Result<(), rustix::io::Errno> {
        Ok(())
    }
    fn reset(&mut self, _: &mut outboard_vfio_user::DeviceContext) {}
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

/// A client of the server at `path` that negotiated a twin socket (in-band DMA possible).
pub fn client_with_twin_socket(path: &std::path::Path) -> outboard_vfio_user::Client {
    let c = outboard_vfio_user::Client::connect(path, outboard_vfio_user::ClientOptions::default())
        .unwrap();
    assert!(c
        .peer_capabilities()
        .twin_socket
        .as_ref()
        .is_some_and(|t| t.supported));
    c
}
