//! The 16550's C driver (`c/uart16550.c`), in its legacy environment, against the pci-serial
//! model served over vfio-user from a thread of this test, its far end a socket the test
//! holds: bytes go out and come in unchanged and in order, bursts larger than the FIFO and
//! than the driver's buffers, line settings, and flow control (RTS/CTS loses nothing where no
//! flow control drops and counts).

mod common;

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_char::{CharDriver, LineSettings};
use outboard_devices::serial::Serial;
use outboard_devices::serial_line::Line;
use outboard_drivers::legacy::descriptor::builtin_uart16550;
use outboard_drivers::legacy::serial::LegacyChar;
use outboard_drivers::{probe_driver, Probe};

use outboard_hw::{DeviceSpec, PciFunction};

use common::{one_at_a_time, pump};

/// A UART model whose far end is the returned socket, served at a socket in `dir` until the
/// returned flag is set.
fn serve_uart(dir: &std::path::Path) -> (DeviceSpec, OwnedFd, Arc<AtomicBool>) {
    let (near, far) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let (spec, stop) = serve_line(dir, Line::stream(near).unwrap());
    (spec, far, stop)
}

/// A UART model whose far end is `line`, served at a socket in `dir`.
fn serve_line(dir: &std::path::Path, line: Line) -> (DeviceSpec, Arc<AtomicBool>) {
    common::serve_model(dir, "uart.sock", Serial::new(line).unwrap())
}

fn start(dir: &std::path::Path) -> (LegacyChar, OwnedFd, Arc<AtomicBool>) {
    let (spec, far, stop) = serve_uart(dir);
    (driver_on(&spec), far, stop)
}

fn driver_on(spec: &DeviceSpec) -> LegacyChar {
    let f = PciFunction::open(spec).unwrap();
    let probed = probe_driver(&Probe::Pci(&f)).unwrap();
    assert_eq!(probed.personality.driver, "uart16550");
    let c = builtin_uart16550().unwrap();
    LegacyChar::start("uart16550", &c, "tty0", f).unwrap()
}

/// Sends all of `bytes` through the driver, as the dispatcher would.
fn send(uart: &mut LegacyChar, bytes: &[u8]) {
    let mut at = 0;
    pump(uart, Duration::from_secs(60), |u| {
        at += u.write(&bytes[at..]).unwrap();
        at == bytes.len()
    });
    assert_eq!(at, bytes.len(), "the driver stopped taking bytes");
}

/// Reads from the far end until `n` bytes came or nothing comes for a second.
fn far_read(far: &OwnedFd, n: usize) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while got.len() < n {
        let mut p = [rustix::event::PollFd::new(
            far,
            rustix::event::PollFlags::IN,
        )];
        let s = rustix::time::Timespec {
            tv_sec: 1,
            tv_nsec: 0,
        };
        if rustix::event::poll(&mut p, Some(&s)).unwrap() == 0 {
            break;
        }
        let k = rustix::io::read(far, &mut buf).unwrap();
        if k == 0 {
            break;
        }
        got.extend_from_slice(&buf[..k]);
    }
    got
}

/// Reads through the driver until `n` bytes came or `within` passed.
fn receive(uart: &mut LegacyChar, n: usize, within: Duration) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    pump(uart, within, |u| {
        let k = u.read(&mut buf).unwrap();
        got.extend_from_slice(&buf[..k]);
        got.len() >= n
    });
    got
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn bytes_go_out_and_come_in_in_order_in_bursts_larger_than_the_fifo() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (mut uart, far, stop) = start(dir.path());
    assert_eq!(uart.info().fifo, 16);
    assert_eq!(uart.info().max_baud, 115_200);
    assert_eq!(uart.line(), LineSettings::default());

    let out = pattern(3000, 1);
    send(&mut uart, &out);
    assert_eq!(far_read(&far, out.len()), out);
    pump(&mut uart, Duration::from_secs(10), |u| {
        u.counters().sent == out.len() as u64
    });
    assert_eq!(
        uart.counters().sent,
        out.len() as u64,
        "not all counted sent"
    );

    let incoming = pattern(3000, 7);
    rustix::io::write(&far, &incoming).unwrap();
    let got = receive(&mut uart, incoming.len(), Duration::from_secs(60));
    assert_eq!(got, incoming);
    let c = uart.counters();
    assert_eq!((c.received, c.dropped, c.overruns), (3000, 0, 0));
    assert_ne!(c.modem & outboard_char::modem::CTS, 0, "CTS off");
    drop(uart);
    stop.store(true, Ordering::Release);
}

#[test]
fn line_settings_take_effect_and_rates_the_device_cannot_make_are_refused() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (mut uart, far, stop) = start(dir.path());
    let seven: LineSettings = "9600,7E2".parse().unwrap();
    uart.set_line(&seven).unwrap().unwrap();
    assert_eq!(uart.line(), seven);
    // Seven data bits: the eighth does not go out.
    send(&mut uart, &[0xff, 0x41]);
    assert_eq!(far_read(&far, 2), vec![0x7f, 0x41]);
    let odd: LineSettings = "100000".parse().unwrap();
    let why = uart.set_line(&odd).unwrap().unwrap_err();
    assert!(why.contains("cannot make"), "{why}");
    assert_eq!(uart.line(), seven, "a refused setting changed the line");
    drop(uart);
    stop.store(true, Ordering::Release);
}

#[test]
fn every_frame_the_class_names_is_set_and_data_bits_mask_what_goes_out() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (mut uart, far, stop) = start(dir.path());
    for data in 5..=8u8 {
        for parity in ['N', 'O', 'E', 'M', 'S'] {
            for stop_bits in 1..=2u8 {
                let frame = format!("38400,{data}{parity}{stop_bits}");
                let l: LineSettings = frame.parse().unwrap();
                uart.set_line(&l).unwrap().unwrap();
                assert_eq!(uart.line(), l, "{frame}");
                send(&mut uart, &[0xff]);
                let want = (0xffu16 >> (8 - data)) as u8;
                assert_eq!(far_read(&far, 1), vec![want], "{frame}");
            }
        }
    }
    drop(uart);
    stop.store(true, Ordering::Release);
}

#[test]
fn through_a_pty_bytes_loop_back_raw() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let line = Line::open(&outboard_devices::serial_line::LineSpec::Pty).unwrap();
    let tty = line.pty_path().unwrap().to_owned();
    let (spec, stop) = serve_line(dir.path(), line);
    let mut uart = driver_on(&spec);
    let user = rustix::fs::open(
        &tty,
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    // Control characters and a burst larger than the FIFO, unchanged both ways.
    let out: Vec<u8> = (0..600u32).map(|i| (i % 251) as u8).collect();
    send(&mut uart, &out);
    assert_eq!(far_read(&user, out.len()), out);
    rustix::io::write(&user, &out).unwrap();
    assert_eq!(receive(&mut uart, out.len(), Duration::from_secs(60)), out);
    drop(uart);
    stop.store(true, Ordering::Release);
}

#[test]
fn a_far_end_that_takes_no_more_holds_sending_without_flow_control_too() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (near, far) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    // A small socket buffer: the far end, not reading, backs up after a few KiB.
    rustix::net::sockopt::set_socket_send_buffer_size(&near, 4096).unwrap();
    let (spec, stop) = serve_line(dir.path(), Line::stream(near).unwrap());
    let mut uart = driver_on(&spec);
    assert_eq!(uart.line().flow, outboard_char::Flow::None);
    let out = pattern(64 * 1024, 9);
    let mut at = 0;
    pump(&mut uart, Duration::from_secs(20), |u| {
        at += u.write(&out[at..]).unwrap();
        at == out.len() || u.held()
    });
    // Sending waits on the far end: held (so the server sets no deadline on it), CTS off.
    assert!(uart.held(), "backed up and not held ({at} bytes taken)");
    assert_eq!(uart.counters().modem & outboard_char::modem::CTS, 0);
    // The far end reads: everything taken so far goes out, in order, and sending moves on.
    let got = far_read(&far, at);
    assert_eq!(got, out[..at]);
    pump(&mut uart, Duration::from_secs(10), |u| !u.held());
    assert!(!uart.held());
    drop(uart);
    stop.store(true, Ordering::Release);
}

/// 12 KiB arrive while nobody reads for a while: more than the driver's ring and the bridge's
/// queue hold (4 KiB each).
fn flood(flow: &str) -> (Vec<u8>, Vec<u8>, outboard_char::LineCounters) {
    let dir = tempfile::tempdir().unwrap();
    let (mut uart, far, stop) = start(dir.path());
    uart.set_line(&format!("115200,8N1,{flow}").parse().unwrap())
        .unwrap()
        .unwrap();
    let incoming = pattern(12 * 1024, 3);
    let writer = {
        let far = rustix::io::dup(&far).unwrap();
        let bytes = incoming.clone();
        std::thread::spawn(move || {
            rustix::io::write(&far, &bytes).unwrap();
        })
    };
    // Nobody reads until the line has gone quiet (everything taken in or held back).
    let mut last = (u64::MAX, Instant::now());
    pump(&mut uart, Duration::from_secs(60), |u| {
        let r = u.counters().received;
        if r != last.0 {
            last = (r, Instant::now());
        }
        last.1.elapsed() > Duration::from_millis(500)
    });
    // Everything is either read or counted dropped.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    pump(&mut uart, Duration::from_secs(60), |u| {
        let k = u.read(&mut buf).unwrap();
        got.extend_from_slice(&buf[..k]);
        got.len() as u64 + u64::from(u.counters().dropped) >= incoming.len() as u64
    });
    writer.join().unwrap();
    let c = uart.counters();
    drop(uart);
    stop.store(true, Ordering::Release);
    (incoming, got, c)
}

#[test]
fn with_rts_cts_a_flood_nobody_reads_loses_nothing() {
    let _one = one_at_a_time();
    let (incoming, got, c) = flood("rtscts");
    assert_eq!(c.dropped, 0);
    assert_eq!(got.len(), incoming.len());
    assert!(got == incoming, "bytes changed or out of order");
}

#[test]
fn without_flow_control_what_the_driver_has_no_room_for_is_dropped_and_counted() {
    let _one = one_at_a_time();
    let (incoming, got, c) = flood("none");
    assert!(c.dropped > 0, "nothing dropped: {c:?}");
    assert_eq!(
        got.len() as u64 + u64::from(c.dropped),
        incoming.len() as u64
    );
    // What arrived is the flood's beginning, in order.
    assert_eq!(got[..4096], incoming[..4096]);
}
