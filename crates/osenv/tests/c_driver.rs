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
    safe fn selftest_config_id() -> u32;
    safe fn selftest_config_absent() -> u32;
    safe fn selftest_bar_size(bar: i32) -> u32;
    safe fn selftest_config_write_id() -> i32;
    safe fn selftest_bar_read32(bar: u32, offset: usize) -> u32;
    safe fn selftest_io_alloc(port: u32, size: u32) -> i32;
    safe fn selftest_config_rewrite_command() -> i32;
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

/// A virtio-blk model of 1 MiB in this process, as a PCI function (and its backend, to look
/// at the device's DMA mappings).
fn in_process_disk() -> (
    outboard_hw::PciFunction,
    Arc<outboard_hw::backend::in_process::InProcess>,
) {
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
    (func, backend)
}

/// The self-test driver keeps its state in C statics: its tests run one after another.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_c_driver_sleeps_until_its_interrupts_come_and_shares_state_with_its_handler() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let env = Arc::new(Osenv::new("selftest").unwrap());
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
    let env = Arc::new(Osenv::new("ticker").unwrap());
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
    // An unregistered timer raises nothing at all (a tick already pending may still land).
    let raised = |s: outboard_env::legacy::DeliveryStats| s.uncontested + s.contested + s.spurious;
    let before = raised(env.cpu().stats());
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        raised(env.cpu().stats()) <= before + 1,
        "an unregistered timer kept ticking: {:?}",
        env.cpu().stats()
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
    let env = Osenv::new("memory").unwrap();
    let _in = env.enter();
    assert_eq!(selftest_memory(), 0);
    assert_eq!(selftest_wired(), 0, "no device: no wired memory");
}

#[test]
fn wired_memory_is_mapped_for_the_device_at_the_address_it_is_given() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (func, backend) = in_process_disk();
    let env = Osenv::for_function("wired", func).unwrap();
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

#[test]
fn the_device_is_the_drivers_own_function_its_bars_sized_and_read_as_a_kernel_would() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (func, _backend) = in_process_disk();
    let id = func.config_read32(0).unwrap();
    let sizes = func.bar_sizes().unwrap();
    let bar = sizes.iter().position(|&s| s > 0).expect("a BAR") as u32;
    let region = func.region(bar as u8).unwrap();
    let first = region.read32(0).unwrap();
    let env = Osenv::for_function("device", func).unwrap();
    let _in = env.enter();
    assert_eq!(selftest_config_id(), id, "vendor and device IDs");
    assert_eq!(selftest_config_absent(), u32::MAX, "another slot is empty");
    assert_eq!(
        u64::from(selftest_bar_size(bar as i32)),
        sizes[bar as usize]
    );
    assert_eq!(
        selftest_config_write_id(),
        -1,
        "the IDs are not the driver's to write"
    );
    assert_eq!(
        selftest_config_rewrite_command(),
        0,
        "the command register is"
    );
    assert_eq!(
        selftest_bar_read32(bar, 0),
        first,
        "a BAR register as the device has it"
    );
    assert_eq!(
        selftest_bar_read32(bar, sizes[bar as usize] as usize),
        u32::MAX,
        "past the BAR"
    );
    assert_eq!(selftest_bar_read32(6, 0), u32::MAX, "no BAR 6");
    assert_eq!(
        selftest_io_alloc(0x1000, 8),
        -16,
        "virtio-blk has no I/O BAR"
    );
}

#[test]
fn a_probe_sees_configuration_space_as_it_was_and_reaches_nothing_of_the_device() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (func, _backend) = in_process_disk();
    let id = func.config_read32(0).unwrap();
    let sizes = func.bar_sizes().unwrap();
    let bar = sizes.iter().position(|&s| s > 0).expect("a BAR") as u32;
    let snapshot = func.snapshot().unwrap();
    // The probe needs nothing but the snapshot: the device is closed before it runs.
    drop(func);
    let env = Osenv::for_probe("probe", snapshot).unwrap();
    let _in = env.enter();
    assert_eq!(selftest_config_id(), id, "vendor and device IDs");
    assert_eq!(selftest_config_absent(), u32::MAX, "another slot is empty");
    assert_eq!(
        u64::from(selftest_bar_size(bar as i32)),
        sizes[bar as usize],
        "BAR sizing is a look"
    );
    assert_eq!(
        selftest_config_rewrite_command(),
        -1,
        "a probe writes no configuration register"
    );
    assert_eq!(
        selftest_bar_read32(bar, 0),
        u32::MAX,
        "a probe reads no BAR register"
    );
    assert_eq!(selftest_wired(), 0, "a probe has no DMA memory");
    assert_eq!(
        selftest_start(),
        -22,
        "a probe has no interrupt vectors to allocate"
    );
    assert_eq!(selftest_ticks(1000, 1), -1, "a probe arms no timer");
    assert_eq!(selftest_memory(), 0, "ordinary memory it has");
}

/// Timer interrupts counted by [`tick`], and those that found the thread inside the allocator.
static TICKS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
static TICKS_IN_ALLOCATOR: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

extern "C" fn tick() {
    TICKS.fetch_add(1, SeqCst);
    if outboard_osenv::abi::in_allocator() {
        TICKS_IN_ALLOCATOR.fetch_add(1, SeqCst);
    }
}

/// The rule "allocations run with interrupts held off": a 20 kHz timer interrupts a driver
/// that does nothing but allocate and free (each interrupt contested: the thread is in the
/// driver, so it is stopped and runs the handler at once, unless its interrupts are off). Its
/// handler must never find the thread inside the allocator. (With `osenv_mem_alloc` not
/// holding interrupts off, thousands do.)
#[test]
fn no_interrupt_lands_inside_an_allocation() {
    use outboard_osenv::abi::{osenv_mem_alloc, osenv_mem_free, osenv_timer_register};
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let env = Osenv::new("alloc-rule").unwrap();
    let _in = env.enter();
    assert_eq!(osenv_timer_register(Some(tick), 20_000), 0);
    let end = Instant::now() + Duration::from_secs(1);
    let mut rounds = 0u64;
    while Instant::now() < end {
        // 64 KiB, zeroed: a few microseconds inside the allocator each time.
        let p = osenv_mem_alloc(64 << 10, 0, 64);
        assert!(!p.is_null());
        osenv_mem_free(p, 0x01, 0);
        rounds += 1;
    }
    outboard_osenv::abi::osenv_timer_unregister(Some(tick), 20_000);
    let ticks = TICKS.load(SeqCst);
    assert!(
        ticks >= 1000,
        "only {ticks} timer interrupts in {rounds} allocations: the test saw too few to judge"
    );
    assert_eq!(
        TICKS_IN_ALLOCATOR.load(SeqCst),
        0,
        "of {ticks} timer interrupts during {rounds} allocations, some ran inside the allocator"
    );
}
