//! What clients are told when a device fails: "restarting" while the server brings it back,
//! "device failed" when it cannot, "timed out" for requests a stalled device held — told
//! apart, end to end through a session.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outboard_block::{BlockDevice, BlockDriver, BlockError, BlockInfo, BlockRequest};
use outboard_block_client::{BlockClient, SessionOptions};
use outboard_env::{DeviceEnv, DeviceEvent, Driver, Failure};
use outboard_server::DriverHost;

/// A driver whose device is broken in a chosen way: its submissions reveal a dead device, or
/// it takes requests and never answers them.
struct Broken {
    info: BlockInfo,
    /// Submitting reveals the device is gone.
    dead: bool,
    in_flight: usize,
}

impl Broken {
    fn new(dead: bool) -> Self {
        Self {
            info: BlockInfo {
                name: "disk0".into(),
                capacity: 64,
                block_size: 512,
                read_only: false,
                queue_depth: 8,
                max_transfer: 0,
                supports: Default::default(),
            },
            dead,
            in_flight: 0,
        }
    }
}

impl Driver for Broken {
    fn driver_name(&self) -> &'static str {
        "broken"
    }
    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        Vec::new()
    }
    fn handle(&mut self, _: DeviceEvent) -> Result<(), Failure> {
        Ok(())
    }
}

impl BlockDriver for Broken {
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn has_room(&self) -> bool {
        self.in_flight < 8
    }
    fn in_flight(&self) -> usize {
        self.in_flight
    }
    fn submit(&mut self, _: &BlockRequest, _: u64, _: u64) -> Result<(), BlockError> {
        if self.dead {
            return Err(BlockError::DeviceFailed("the transport closed".into()));
        }
        self.in_flight += 1;
        Ok(())
    }
    fn kick(&mut self) -> Result<(), Failure> {
        Ok(())
    }
    fn poll(&mut self, _: &mut Vec<(u64, Result<u32, BlockError>)>) -> Result<usize, Failure> {
        Ok(0)
    }
    fn arm(&mut self) -> Result<bool, Failure> {
        Ok(false)
    }
}

/// Serves `driver` as `disk0`; `reopen` says whether the server can start it again (each
/// attempt fails, and is counted).
fn serve(
    dir: &std::path::Path,
    driver: Broken,
    reopen: bool,
    deadline: Duration,
) -> (std::path::PathBuf, Arc<AtomicU32>, Arc<AtomicBool>) {
    let attempts = Arc::new(AtomicU32::new(0));
    let mut served =
        outboard_block_server::BlockDispatcher::served(driver, DeviceEnv::virtual_device());
    if reopen {
        let a = attempts.clone();
        served.reopen = Some(Arc::new(move || {
            a.fetch_add(1, Ordering::SeqCst);
            Err("the device is still broken".into())
        }));
    }
    let sock = dir.join("host.sock");
    let mut host = DriverHost::bind(&sock, vec![served]).unwrap();
    host.set_deadline(deadline);
    let (stop, _thread) = host.spawn();
    (sock, attempts, stop)
}

fn write(d: &mut BlockClient) -> Result<(), BlockError> {
    d.write_blocks(0, &[7u8; 512])
}

#[test]
fn a_device_being_brought_back_answers_restarting_to_requests_and_opens() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, attempts, stop) =
        serve(dir.path(), Broken::new(true), true, Duration::from_secs(30));
    let mut d = BlockClient::open(&sock, "disk0", SessionOptions::default()).unwrap();
    // The request that revealed the failure, and the next one: restarting, not failed.
    assert_eq!(write(&mut d), Err(BlockError::Restarting));
    assert_eq!(write(&mut d), Err(BlockError::Restarting));
    assert!(matches!(
        BlockClient::open(&sock, "disk0", SessionOptions::default()),
        Err(BlockError::Restarting)
    ));
    // The server is indeed trying to bring it back.
    assert!(outboard_sys::wait::eventually(
        Duration::from_secs(5),
        || { attempts.load(Ordering::SeqCst) > 0 }
    ));
    stop.store(true, Ordering::Relaxed);
}

#[test]
fn a_device_that_cannot_be_brought_back_answers_device_failed_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, _, stop) = serve(
        dir.path(),
        Broken::new(true),
        false,
        Duration::from_secs(30),
    );
    let mut d = BlockClient::open(&sock, "disk0", SessionOptions::default()).unwrap();
    // A completion carries a code; the reason comes with the refusal of the next open.
    assert!(matches!(write(&mut d), Err(BlockError::DeviceFailed(_))));
    assert!(matches!(write(&mut d), Err(BlockError::DeviceFailed(_))));
    match BlockClient::open(&sock, "disk0", SessionOptions::default()) {
        Err(BlockError::DeviceFailed(why)) => assert!(why.contains("transport closed"), "{why}"),
        other => panic!("{other:?}"),
    }
    stop.store(true, Ordering::Relaxed);
}

#[test]
fn requests_in_a_stalled_device_time_out_then_new_ones_are_told_it_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, _, stop) = serve(
        dir.path(),
        Broken::new(false),
        true,
        Duration::from_millis(300),
    );
    let mut d = BlockClient::open(&sock, "disk0", SessionOptions::default()).unwrap();
    let t = std::time::Instant::now();
    assert_eq!(write(&mut d), Err(BlockError::Timeout));
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(write(&mut d), Err(BlockError::Restarting));
    stop.store(true, Ordering::Relaxed);
}
