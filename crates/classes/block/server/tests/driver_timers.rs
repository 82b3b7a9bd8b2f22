//! A driver's own timers are event sources like its interrupts: the driver server's loop
//! waits on them and hands each expiry to the driver's `handle` as `DeviceEvent::Timer(n)`.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_block::{BlockDriver, BlockError, BlockInfo, BlockRequest};
use outboard_env::{DeviceEnv, DeviceEvent, Driver, Failure, Timer};
use outboard_server::DriverHost;

/// A driver with no device work, only a timer that re-arms itself on each tick.
struct Ticking {
    info: BlockInfo,
    timer: Timer,
    ticks: Arc<AtomicU32>,
}

const TICK: Duration = Duration::from_millis(10);

impl Driver for Ticking {
    fn driver_name(&self) -> &'static str {
        "ticking"
    }
    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        vec![(DeviceEvent::Timer(3), self.timer.fd())]
    }
    fn handle(&mut self, ev: DeviceEvent) -> Result<(), Failure> {
        if ev == DeviceEvent::Timer(3) {
            self.timer.ack();
            self.ticks.fetch_add(1, Ordering::SeqCst);
            self.timer
                .arm_at(Instant::now() + TICK)
                .map_err(|e| Failure::Driver(e.to_string()))?;
        }
        Ok(())
    }
}

impl BlockDriver for Ticking {
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn has_room(&self) -> bool {
        true
    }
    fn in_flight(&self) -> usize {
        0
    }
    fn submit(&mut self, _: &BlockRequest, _: u64, _: u64) -> Result<(), BlockError> {
        Err(BlockError::Unsupported)
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

#[test]
fn a_drivers_timer_reaches_its_handle_through_the_server_loop() {
    let dir = tempfile::tempdir().unwrap();
    let ticks = Arc::new(AtomicU32::new(0));
    let mut timer = Timer::new().unwrap();
    timer.arm_at(Instant::now() + TICK).unwrap();
    let driver = Ticking {
        info: BlockInfo {
            name: "ticker".into(),
            capacity: 8,
            block_size: 512,
            read_only: true,
            queue_depth: 1,
            max_transfer: 0,
            supports: Default::default(),
        },
        timer,
        ticks: ticks.clone(),
    };
    let served =
        outboard_block_server::BlockDispatcher::served(driver, DeviceEnv::virtual_device());
    let (stop, thread) = DriverHost::bind(&dir.path().join("host.sock"), vec![served])
        .unwrap()
        .spawn();
    // Several ticks: each was delivered and the driver re-armed its timer from `handle`.
    let ticked = outboard_sys::wait::eventually(Duration::from_secs(10), || {
        ticks.load(Ordering::SeqCst) >= 5
    });
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap().unwrap();
    assert!(
        ticked,
        "only {} tick(s) reached the driver",
        ticks.load(Ordering::SeqCst)
    );
}
