//! The PCI timer's drivers against the timer model served over vfio-user from a thread of this
//! test: the C driver (`c/timer.c`) in its legacy environment counts the device's ticks at the
//! rate the device was set to, reads the device's time, and the catalog picks it for the timer;
//! the native Rust driver counts the same ticks; and the native C driver (`c/native_timer.c`,
//! `include/outboard/native.h`) does too, called only by the loop (the test stands in for the
//! driver server's work loop: it waits on the driver's vector and calls `handle`, which calls
//! the C driver's `event` on this thread), stops its device when dropped, and is one device per
//! copy of its code until given up.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_clock::ClockDriver;
use outboard_drivers::legacy::clock::LegacyClock;
use outboard_drivers::legacy::descriptor::{builtin_native_timer, builtin_timer};
use outboard_drivers::native_c::clock::NativeCClock;
use outboard_drivers::{probe_driver, Probe};
use outboard_env::{DeviceEvent, Driver};
use outboard_hw::{DeviceSpec, PciFunction};
use outboard_spec::timer::{ctrl, reg};

use common::{one_at_a_time, pump};

/// A timer model of `hz` served at a socket in `dir` until the returned flag is set.
fn serve_timer(dir: &std::path::Path, hz: u32) -> (DeviceSpec, Arc<AtomicBool>) {
    let model = outboard_devices::timer::Timer::new(1_000_000_000 / hz).unwrap();
    common::serve_model(dir, "timer.sock", model)
}

/// Start options naming the clock.
fn named(name: &str) -> outboard_drivers::StartOptions {
    outboard_drivers::StartOptions {
        name: name.into(),
        ..Default::default()
    }
}

/// Waits on the driver's tick source, as a server's loop would, handling it each time it is
/// readable, until `want` ticks.
fn ticks_reach<C: ClockDriver>(clock: &mut C, want: u64, within: Duration) -> u64 {
    pump(clock, within, |c| c.ticks() >= want);
    clock.ticks()
}

#[test]
fn the_c_timer_driver_counts_the_devices_ticks_and_reads_its_time() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (spec, stop) = serve_timer(dir.path(), 1000);
    let f = PciFunction::open(&spec).unwrap();
    let probed = probe_driver(&Probe::Pci(&f)).unwrap();
    assert_eq!(probed.personality.driver, "legacy-timer");
    let c = builtin_timer().unwrap();
    let mut clock = LegacyClock::start("legacy-timer", &c, &named("clock0"), f).unwrap();
    assert_eq!(clock.info().hz, 1000);
    let t0 = clock.now().unwrap();
    let started = Instant::now();
    let got = ticks_reach(&mut clock, 100, Duration::from_secs(10));
    let took = started.elapsed();
    assert!(got >= 100, "only {got} ticks in 10 s");
    // 100 ticks at 1 kHz take 100 ms by the device's clock; the count is read from the
    // device, so it cannot run ahead of the time that passed.
    assert!(
        took >= Duration::from_millis(90),
        "100 ticks in {took:?}: faster than the device's rate"
    );
    let t1 = clock.now().unwrap();
    assert!(
        t1.device_ns > t0.device_ns,
        "the device's time did not move"
    );
    assert!(t1.ticks >= got);
    // The interrupts reached the C handler through the legacy model.
    let (uncontested, contested) = clock.delivered();
    assert!(uncontested + contested > 0);
    stop.store(true, Ordering::SeqCst);
}

#[test]
fn one_copy_of_a_c_driver_drives_one_device_and_abandon_frees_it() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (spec, stop) = serve_timer(dir.path(), 100);
    let other = tempfile::tempdir().unwrap();
    let (spec2, stop2) = serve_timer(other.path(), 100);
    let c = builtin_timer().unwrap();
    let open = |s: &DeviceSpec| PciFunction::open(s).unwrap();
    let mut first = LegacyClock::start("legacy-timer", &c, &named("clock0"), open(&spec)).unwrap();
    assert!(first.sources().iter().any(|(e, _)| *e == DeviceEvent::Lost));
    // The same C code for a second device, in the same process: refused, saying why.
    match LegacyClock::start("legacy-timer", &c, &named("clock1"), open(&spec2)) {
        Err(outboard_drivers::StartError::Refused(why)) => {
            assert!(why.contains("a server of its own"), "{why}")
        }
        other => panic!("a second instance started: {:?}", other.map(|_| ())),
    }
    // Given up, the first frees the code: the second device gets it.
    let _ = first.abandon();
    assert!(first.now().is_err(), "an abandoned driver still answers");
    let mut second =
        LegacyClock::start("legacy-timer", &c, &named("clock1"), open(&spec2)).unwrap();
    assert!(ticks_reach(&mut second, 2, Duration::from_secs(10)) >= 2);
    drop(first);
    drop(second);
    stop.store(true, Ordering::SeqCst);
    stop2.store(true, Ordering::SeqCst);
}

#[test]
fn the_native_timer_driver_counts_the_same_ticks_in_the_work_loop_model() {
    use outboard_drivers::timer::NativeTimer;
    let dir = tempfile::tempdir().unwrap();
    let (spec, stop) = serve_timer(dir.path(), 1000);
    let f = PciFunction::open(&spec).unwrap();
    let mut clock = NativeTimer::new("clock0", f).unwrap();
    assert_eq!(clock.info().hz, 1000);
    let started = Instant::now();
    ticks_reach(&mut clock, 100, Duration::from_secs(10));
    let took = started.elapsed();
    assert!(clock.ticks() >= 100, "{} ticks", clock.ticks());
    assert!(took >= Duration::from_millis(90), "100 ticks in {took:?}");
    let t = clock.now().unwrap();
    assert!(
        t.interrupts > 0 && u64::from(t.interrupts) <= t.ticks + 1,
        "{t:?}"
    );
    stop.store(true, Ordering::SeqCst);
}

/// The thesis's contested case in a driver server: with `contend`, a thread holds the driver
/// nearly all the time, so the ticks' interrupts find it inside and stop it; it reports its
/// CPU time and what the interrupts took from it, and the ticks are still all counted.
#[test]
fn a_contending_thread_holds_the_driver_and_the_interrupts_stop_it() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (spec, stop) = serve_timer(dir.path(), 2000);
    let c = builtin_timer().unwrap();
    let report = dir.path().join("contender.bin");
    let opts = outboard_drivers::StartOptions {
        contend: Some(report.clone()),
        ..named("clock0")
    };
    let mut clock =
        LegacyClock::start("legacy-timer", &c, &opts, PciFunction::open(&spec).unwrap()).unwrap();
    let got = ticks_reach(&mut clock, 2000, Duration::from_secs(20));
    assert!(got >= 2000, "only {got} ticks counted under contention");
    let (uncontested, contested) = clock.delivered();
    assert!(
        contested * 2 > uncontested + contested,
        "most interrupts should find the thread inside: {contested} contested, {uncontested} not"
    );
    let (used, lost) = outboard_drivers::legacy::contender::read_report(&report)
        .expect("the contending thread reports");
    assert!(
        used > 10_000_000,
        "it ran {used} ns of CPU in about a second"
    );
    // It keeps reporting while it runs. (How much the interrupts took, `lost`, is a
    // measurement for the bench, priced by a calibration that a loaded machine skews: this
    // test does not judge it.)
    std::thread::sleep(Duration::from_millis(500));
    let (later, _) = outboard_drivers::legacy::contender::read_report(&report).unwrap();
    assert!(
        later > used,
        "no new report in 500 ms ({used} ns, then {later} ns; lost {lost})"
    );
    // Abandoning the driver stops the thread first: it reports no more.
    let _ = clock.abandon();
    let last = outboard_drivers::legacy::contender::read_report(&report);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        outboard_drivers::legacy::contender::read_report(&report),
        last,
        "the contending thread ran on after its driver was abandoned"
    );
    stop.store(true, Ordering::SeqCst);
}

/// A driver with no process lock refuses a contending thread, saying why.
#[test]
fn a_native_driver_refuses_contention() {
    let opts = outboard_drivers::StartOptions {
        contend: Some("/nonexistent".into()),
        ..named("clock0")
    };
    let native = outboard_drivers::by_name("timer").unwrap();
    assert!(native.refuses(&opts).unwrap().contains("no process lock"));
    let legacy = outboard_drivers::by_name("legacy-timer").unwrap();
    assert_eq!(legacy.refuses(&opts), None);
}

#[test]
fn the_native_c_timer_counts_the_devices_ticks_and_reads_its_time() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (spec, stop) = serve_timer(dir.path(), 1000);
    let c = builtin_native_timer().unwrap();
    let f = PciFunction::open(&spec).unwrap();
    let mut clock = NativeCClock::start("native-c-timer", &c, "clock0", f).unwrap();
    assert_eq!(clock.info().hz, 1000);
    assert!(clock.sources().iter().any(|(e, _)| *e == DeviceEvent::Lost));
    let t0 = clock.now().unwrap();
    let started = Instant::now();
    let got = ticks_reach(&mut clock, 100, Duration::from_secs(10));
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
    drop(clock);
    stop.store(true, Ordering::SeqCst);
}

#[test]
fn one_copy_of_a_native_c_driver_drives_one_device_until_given_up() {
    let _one = one_at_a_time();
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
    assert!(ticks_reach(&mut second, 5, Duration::from_secs(10)) >= 5);
    // The first, dropped, does not stop its code's new device (it was given up: no `stop`).
    drop(first);
    let had = second.ticks();
    assert!(
        ticks_reach(&mut second, had + 5, Duration::from_secs(10)) >= had + 5,
        "the second timer stopped when the first driver went"
    );
    drop(second);
    stop.store(true, Ordering::SeqCst);
    stop2.store(true, Ordering::SeqCst);
}

/// `stop` is seen on the device while the driver's connection to it is still open: the
/// model in this process, looked at through a second function on it (a vfio-user model
/// resets when its client leaves, which would hide whether `stop` ran).
#[test]
fn a_native_c_driver_dropped_stops_its_device() {
    use outboard_hw::backend::in_process::InProcess;
    let _one = one_at_a_time();
    let model = outboard_devices::timer::Timer::new(1_000_000).unwrap();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    let f = PciFunction::with_backend("in-process".into(), backend.clone()).unwrap();
    let look = PciFunction::with_backend("look".into(), backend.clone()).unwrap();
    let regs = look.region(0).unwrap();
    let c = builtin_native_timer().unwrap();
    let clock = NativeCClock::start("native-c-timer", &c, "clock0", f).unwrap();
    assert_ne!(regs.read32(reg::CTRL).unwrap() & ctrl::RUN, 0, "started");
    drop(clock);
    assert_eq!(
        regs.read32(reg::CTRL).unwrap() & ctrl::RUN,
        0,
        "still running"
    );
}
