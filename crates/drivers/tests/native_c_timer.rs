//! The PCI timer's native C driver (`c/native_timer.c`, `include/outboard/native.h`) against
//! the timer model served over vfio-user from a thread of this test, the test standing in for
//! the driver server's work loop: it waits on the driver's vector and calls `handle`, which
//! calls the C driver's `event` on this thread. The driver counts the device's ticks at the
//! device's rate, reads its time, is stopped when dropped, and a second device for the same
//! code is refused until the first is given up.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_clock::ClockDriver;
use outboard_drivers::legacy::descriptor::builtin_native_timer;
use outboard_drivers::native_c::clock::NativeCClock;
use outboard_env::{DeviceEvent, Driver};
use outboard_hw::{DeviceSpec, PciFunction};
use outboard_spec::timer::{ctrl, reg};

/// A timer model of `hz` served at a socket in `dir` until the returned flag is set.
fn serve_timer(dir: &std::path::Path, hz: u32) -> (DeviceSpec, Arc<AtomicBool>) {
    let path = dir.join("timer.sock");
    let model = outboard_devices::timer::Timer::new(1_000_000_000 / hz).unwrap();
    let mut server = outboard_vfio_user::Server::bind(
        &path,
        model,
        outboard_vfio_user::ServerOptions::default(),
    )
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || server.run(&s));
    (
        format!("vfio-user:{}", path.display()).parse().unwrap(),
        stop,
    )
}

/// The C driver keeps its state in statics: one instance at a time in this process.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn vector(clock: &NativeCClock) -> OwnedFd {
    clock
        .sources()
        .iter()
        .find(|(e, _)| *e == DeviceEvent::Interrupt(0))
        .map(|(_, fd)| rustix::io::dup(fd).unwrap())
        .expect("the driver's vector is an event source")
}

/// The work loop's part: wait on the vector, hand the event to the driver, until `want`.
fn run_until(clock: &mut NativeCClock, want: u64, within: Duration) -> u64 {
    let irq = vector(clock);
    let deadline = Instant::now() + within;
    while clock.ticks() < want && Instant::now() < deadline {
        let mut p = [rustix::event::PollFd::new(
            &irq,
            rustix::event::PollFlags::IN,
        )];
        let ms = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 100_000_000,
        };
        if rustix::event::poll(&mut p, Some(&ms)).unwrap() > 0 {
            clock.handle(DeviceEvent::Interrupt(0)).unwrap();
        }
    }
    clock.ticks()
}

#[test]
fn the_native_c_timer_counts_the_devices_ticks_on_the_loops_thread_and_stops_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (spec, stop) = serve_timer(dir.path(), 1000);
    let c = builtin_native_timer().unwrap();
    let f = PciFunction::open(&spec).unwrap();
    let mut clock = NativeCClock::start("native-c-timer", &c, "clock0", f).unwrap();
    assert_eq!(clock.info().hz, 1000);
    assert!(clock.sources().iter().any(|(e, _)| *e == DeviceEvent::Lost));
    let t0 = clock.now().unwrap();
    let started = Instant::now();
    let got = run_until(&mut clock, 100, Duration::from_secs(10));
    let took = started.elapsed();
    assert!(got >= 100, "only {got} ticks in 10 s");
    assert!(
        took >= Duration::from_millis(90),
        "100 ticks in {took:?}: faster than the device's rate"
    );
    let t1 = clock.now().unwrap();
    assert!(
        t1.device_ns > t0.device_ns,
        "the device's time did not move"
    );
    assert!(t1.interrupts > 0 && u64::from(t1.interrupts) <= t1.ticks + 1);
    // Nothing runs the driver but the loop: with no `handle`, the count stands still while
    // the device goes on ticking.
    let before = clock.ticks();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        clock.ticks(),
        before,
        "something besides the loop called the driver"
    );
    drop(clock);
    // Dropped, the driver stopped its device (`stop` cleared CTRL.RUN).
    let f = PciFunction::open(&spec).unwrap();
    let regs = f.region(0).unwrap();
    assert_eq!(
        regs.read32(reg::CTRL).unwrap() & ctrl::RUN,
        0,
        "still running"
    );
    stop.store(true, Ordering::SeqCst);
}

#[test]
fn one_copy_of_a_native_c_driver_drives_one_device_until_given_up() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (spec, stop) = serve_timer(a.path(), 200);
    let (spec2, stop2) = serve_timer(b.path(), 200);
    let c = builtin_native_timer().unwrap();
    let open = |s: &DeviceSpec| PciFunction::open(s).unwrap();
    let mut first = NativeCClock::start("native-c-timer", &c, "clock0", open(&spec)).unwrap();
    match NativeCClock::start("native-c-timer", &c, "clock1", open(&spec2)) {
        Err(outboard_drivers::StartError::Refused(why)) => {
            assert!(why.contains("a server of its own"), "{why}")
        }
        other => panic!("a second instance started: {:?}", other.map(|_| ())),
    }
    let _ = first.abandon();
    assert!(first.now().is_err(), "a driver given up still answers");
    assert!(
        first.handle(DeviceEvent::Interrupt(0)).is_ok(),
        "an event after the give-up reaches nothing"
    );
    let mut second = NativeCClock::start("native-c-timer", &c, "clock1", open(&spec2)).unwrap();
    assert!(run_until(&mut second, 5, Duration::from_secs(10)) >= 5);
    drop(first);
    drop(second);
    stop.store(true, Ordering::SeqCst);
    stop2.store(true, Ordering::SeqCst);
}
