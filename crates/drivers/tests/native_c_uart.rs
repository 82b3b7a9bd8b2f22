//! The native C ABI's register accessors and the native 16550 driver (`c/native_uart16550.c`)
//! against Outboard's pci-serial model (one I/O BAR) and timer model (memory BARs), each
//! served over vfio-user from a thread of this test: ports are reached only through the I/O
//! accessors and registers only through the memory ones, within their BAR; the catalog
//! prefers the legacy driver and the native one is there when named; a model that goes away
//! makes the driver's next call fail, so the device is given up, not served with garbage.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_char::CharDriver;
use outboard_devices::serial::Serial;
use outboard_devices::serial_line::{Line, LineSpec};
use outboard_drivers::legacy::descriptor::builtin_native_uart16550;
use outboard_drivers::native_c::char::NativeCChar;
use outboard_drivers::native_c::device::{NativeDevice, EINVAL};
use outboard_drivers::{probe_driver, Probe};
use outboard_env::Driver;
use outboard_hw::{DeviceSpec, PciFunction};

fn uart_model(dir: &std::path::Path) -> (DeviceSpec, Arc<AtomicBool>) {
    common::serve_model(
        dir,
        "uart.sock",
        Serial::new(Line::open(&LineSpec::Loopback).unwrap()).unwrap(),
    )
}

#[test]
fn ports_are_reached_only_through_the_io_accessors_and_registers_only_through_the_memory_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (spec, stop) = uart_model(dir.path());
    let d = NativeDevice::new("test", PciFunction::open(&spec).unwrap());
    // The 16550's scratch register, port 7 of I/O BAR 0: it keeps what is written.
    d.io_write8(0, 7, 0x5a).unwrap();
    assert_eq!(d.io_read8(0, 7), Ok(0x5a));
    d.io_write8(0, 7, 0xa5).unwrap();
    assert_eq!(d.io_read8(0, 7), Ok(0xa5));
    // The same port through a memory accessor, a misaligned or too-wide access, a port past
    // the BAR's eight, a BAR the function does not have, no BAR at all: refused.
    assert_eq!(
        d.read8(0, 7),
        Err(EINVAL),
        "a memory accessor on an I/O BAR"
    );
    assert_eq!(d.write8(0, 7, 1), Err(EINVAL));
    assert_eq!(d.io_read16(0, 7), Err(EINVAL), "misaligned");
    assert_eq!(d.io_read8(0, 8), Err(EINVAL), "past the BAR");
    assert_eq!(d.io_read32(0, 6), Err(EINVAL), "runs past the BAR");
    assert_eq!(d.io_read8(1, 0), Err(EINVAL), "no BAR 1");
    assert_eq!(d.io_read8(6, 0), Err(EINVAL), "no BAR 6");
    assert_eq!(d.io_read8(0, u64::MAX), Err(EINVAL));
    // What was refused changed nothing.
    assert_eq!(d.io_read8(0, 7), Ok(0xa5));
    stop.store(true, Ordering::Release);

    let (spec, stop) = common::serve_model(
        dir.path(),
        "timer.sock",
        outboard_devices::timer::Timer::new(1_000_000).unwrap(),
    );
    let d = NativeDevice::new("test", PciFunction::open(&spec).unwrap());
    let id = outboard_spec::timer::reg::ID;
    assert!(d.read32(0, id).is_ok(), "a memory BAR's register");
    assert_eq!(
        d.io_read32(0, id),
        Err(EINVAL),
        "an I/O accessor on a memory BAR"
    );
    assert_eq!(d.io_write8(0, id, 0), Err(EINVAL));
    stop.store(true, Ordering::Release);
}

#[test]
fn the_catalog_prefers_the_legacy_driver_and_the_native_one_serves_when_named() {
    let _one = common::one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (spec, stop) = uart_model(dir.path());
    let f = PciFunction::open(&spec).unwrap();
    let probed = probe_driver(&Probe::Pci(&f)).unwrap();
    assert_eq!(probed.personality.driver, "uart16550");
    let c = builtin_native_uart16550().unwrap();
    let mut uart = NativeCChar::start("native-c-uart16550", &c, "tty0", f).unwrap();
    assert_eq!(uart.info().fifo, 16);
    assert_eq!(uart.line().to_string(), "115200 baud 8N1, no flow control");
    // Looped back in the model: what is written comes back, moved by the driver's events.
    let sent = b"native".to_vec();
    assert_eq!(uart.write(&sent).unwrap(), sent.len());
    let mut got = Vec::new();
    common::pump(&mut uart, Duration::from_secs(10), |u| {
        let mut buf = [0u8; 64];
        let n = u.read(&mut buf).unwrap();
        got.extend_from_slice(&buf[..n]);
        got.len() >= sent.len()
    });
    assert_eq!(got, sent);
    assert_eq!(uart.counters().sent, sent.len() as u64);
    drop(uart);
    stop.store(true, Ordering::Release);
}

#[test]
fn a_model_that_goes_away_makes_the_next_call_fail() {
    let _one = common::one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (spec, stop) = uart_model(dir.path());
    let c = builtin_native_uart16550().unwrap();
    let f = PciFunction::open(&spec).unwrap();
    let mut uart = NativeCChar::start("native-c-uart16550", &c, "tty0", f).unwrap();
    stop.store(true, Ordering::Release);
    // The model's loop notices its flag within its poll interval; until then calls succeed.
    let deadline = Instant::now() + Duration::from_secs(10);
    let failure = loop {
        match uart.set_line(&"9600,8N1".parse().unwrap()) {
            Err(f) => break f,
            Ok(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(r) => panic!("the driver still answers {r:?} with its model gone"),
        }
    };
    assert!(failure.to_string().contains("error -5"), "{failure}");
    // Given up, it is not called again, and says so.
    let _ = uart.abandon();
    let e = uart.write(b"x").unwrap_err();
    assert!(e.to_string().contains("given up"), "{e}");
}

#[test]
fn a_device_that_is_no_16550_is_refused_and_the_code_is_free_for_one_that_is() {
    let _one = common::one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (spec, stop) = common::serve_model(
        dir.path(),
        "timer.sock",
        outboard_devices::timer::Timer::new(1_000_000).unwrap(),
    );
    let c = builtin_native_uart16550().unwrap();
    let f = PciFunction::open(&spec).unwrap();
    match NativeCChar::start("native-c-uart16550", &c, "tty0", f) {
        Err(outboard_drivers::StartError::Refused(why)) => {
            assert!(why.contains("did not start"), "{why}")
        }
        other => panic!("started on a timer: {:?}", other.map(|_| ())),
    }
    stop.store(true, Ordering::Release);
    // The failed start kept nothing: the same code drives a UART next.
    let (spec, stop) = uart_model(dir.path());
    let f = PciFunction::open(&spec).unwrap();
    let uart = NativeCChar::start("native-c-uart16550", &c, "tty0", f).unwrap();
    assert_eq!(uart.info().max_baud, 115_200);
    drop(uart);
    stop.store(true, Ordering::Release);
}
