//! The osenv interface from C: a small driver written against `osenv.h` alone
//! (`c/selftest.c`) sleeps for interrupts, counts timer ticks, shares a counter with its
//! handler under `osenv_intr_disable`, and allocates memory. Every wait has a time-out.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_osenv::Osenv;

// The self-test driver's entry points take and return plain integers and touch only its own
// statics and the osenv calls, which check where they are called from: safe to call.
unsafe extern "C" {
    safe fn selftest_start() -> i32;
    safe fn selftest_stop();
    safe fn selftest_wait_irqs(want: i32) -> i32;
    safe fn selftest_increment(rounds: i64, pause_ns: i64) -> i64;
    safe fn selftest_ticks(hz: i32, want: i32) -> i32;
    safe fn selftest_memory() -> i32;
    safe fn selftest_wired() -> usize;
    safe fn selftest_intr_enabled() -> i32;
}

/// Runs `f` on a thread and fails if it does not return within `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let h = std::thread::spawn(f);
    let end = Instant::now() + limit;
    while !h.is_finished() {
        assert!(Instant::now() < end, "timed out");
        std::thread::sleep(Duration::from_millis(1));
    }
    h.join().expect("the driver thread panicked")
}

/// The self-test driver keeps its state in C statics: its tests run one after another.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_c_driver_sleeps_until_its_interrupts_come_and_shares_state_with_its_handler() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let env = Arc::new(Osenv::new("selftest", None).unwrap());
    {
        let _in = env.enter();
        assert_eq!(selftest_start(), 0);
        assert_eq!(selftest_intr_enabled(), 1);
    }
    // Interrupts from a "device": an eventfd on vector 0 of the interrupt thread.
    let stop = Arc::new(AtomicBool::new(false));
    let (e, s) = (env.clone(), stop.clone());
    let device = std::thread::spawn(move || {
        while !s.load(SeqCst) {
            e.cpu().raise(0);
            std::thread::sleep(Duration::from_micros(50));
        }
    });
    let e = env.clone();
    let (got, lost) = within(Duration::from_secs(20), move || {
        let _in = e.enter();
        let got = selftest_wait_irqs(200);
        let lost = selftest_increment(20_000, 2_000);
        (got, lost)
    });
    stop.store(true, SeqCst);
    device.join().unwrap();
    assert!(got >= 200, "{got} interrupts");
    assert_eq!(
        lost, 0,
        "an increment was lost: a handler ran inside a disabled section"
    );
    let st = env.cpu().stats();
    assert!(
        st.contested > 0,
        "the handler interrupted process level: {st:?}"
    );
    {
        let _in = env.enter();
        selftest_stop();
    }
}

#[test]
fn a_c_driver_counts_timer_ticks_while_it_sleeps() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let env = Arc::new(Osenv::new("ticker", None).unwrap());
    let e = env.clone();
    let started = Instant::now();
    let rc = within(Duration::from_secs(20), move || {
        let _in = e.enter();
        selftest_ticks(1000, 50)
    });
    assert_eq!(rc, 0);
    // 50 ticks at 1 kHz: at least 50 ms, and no tick before its time.
    assert!(
        started.elapsed() >= Duration::from_millis(49),
        "{:?}",
        started.elapsed()
    );
    let before = env.cpu().stats().handled;
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        env.cpu().stats().handled <= before + 1,
        "an unregistered timer kept ticking"
    );
    // Bad frequencies are refused.
    let e = env.clone();
    within(Duration::from_secs(5), move || {
        let _in = e.enter();
        assert_eq!(selftest_ticks(0, 1), -22);
        assert_eq!(selftest_ticks(1_000_000, 1), -22);
    });
}

#[test]
fn memory_of_every_plain_kind_and_wired_memory_only_with_a_device() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let env = Osenv::new("memory", None).unwrap();
    let _in = env.enter();
    assert_eq!(selftest_memory(), 0);
    assert_eq!(selftest_wired(), 0, "no device: no wired memory");
}

#[test]
fn wired_memory_is_mapped_for_the_device_at_the_address_it_is_given() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let model = outboard_devices::virtio_blk(
        outboard_devices::backing::Backing::open("mem:1M", None).unwrap(),
        Default::default(),
    )
    .unwrap();
    let backend = Arc::new(outboard_hw::backend::in_process::InProcess::new(Box::new(
        model,
    )));
    let func =
        outboard_hw::PciFunction::with_backend("in-process".into(), backend.clone()).unwrap();
    let env = Osenv::new("wired", Some(func.dma().clone())).unwrap();
    let phys = {
        let _in = env.enter();
        selftest_wired()
    };
    assert_ne!(phys, 0, "wired memory has a device address");
    assert_eq!(
        phys % 4096,
        100,
        "the address of byte 100 of a page-aligned block"
    );
    backend.with_device(|_, ctx| assert!(ctx.dma.is_empty(), "freed: unmapped from the device"));
}

#[test]
fn calls_from_outside_a_driver_are_refused() {
    assert_eq!(selftest_start(), -1);
    assert_eq!(selftest_intr_enabled(), 0);
}
