//! The char class's conformance suite (`outboard_char::conformance`) through a client session
//! with a driver server: each C 16550 driver (the legacy one on osenv, the native one called by
//! the work loop) on Outboard's pci-serial model, the model's line
//! looped back by an echo at its far end (a socket, a pseudo-terminal) and in the model itself
//! (`loopback`, as a plug joining TX to RX).

mod common;

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use common::Uart;
use outboard_char_client::CharClient;
use outboard_devices::serial_line::{Line, LineSpec};

/// A C driver keeps its state in statics: one instance at a time in this process.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// An echo at the far end, until `stop`.
fn echo(far: OwnedFd, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    std::thread::spawn(move || outboard_devices::serial_line::echo(&far, &stop).unwrap())
}

/// Serves `line` with the model, driver `uart` on it in a driver server, and runs the suite
/// through a client session, a line per check on standard error.
fn suite_on(line: Line, far: Option<OwnedFd>, uart: Uart) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let served = common::serve_with(dir.path(), line, uart);
    let echo_stop = Arc::new(AtomicBool::new(false));
    let echo_thread = far.map(|far| echo(far, echo_stop.clone()));
    let mut client = CharClient::open(&served.sock, "tty0").unwrap();
    let mut verdict = Ok(());
    for c in outboard_char::conformance::CHECKS {
        let t0 = std::time::Instant::now();
        let r = (c.run)(&mut client);
        eprintln!(
            "{:<44} {:>7.0} ms  {r:?}",
            c.name,
            t0.elapsed().as_secs_f64() * 1e3
        );
        if let Err(e) = r {
            verdict = Err(format!("{}: {e}", c.name));
            break;
        }
    }
    drop(client);
    served.stop();
    echo_stop.store(true, Ordering::Release);
    if let Some(t) = echo_thread {
        t.join().unwrap();
    }
    verdict.unwrap();
}

fn through_a_socket(uart: Uart) {
    let (near, far) = common::socket_pair();
    suite_on(Line::stream(near).unwrap(), Some(far), uart);
}

fn through_a_pty(uart: Uart) {
    let line = Line::open(&LineSpec::Pty).unwrap();
    let user = rustix::fs::open(
        line.pty_path().unwrap(),
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    suite_on(line, Some(user), uart);
}

fn in_the_model(uart: Uart) {
    suite_on(Line::open(&LineSpec::Loopback).unwrap(), None, uart);
}

#[test]
fn the_16550_driver_on_the_model_passes_the_suite_looped_through_a_socket() {
    through_a_socket(Uart::Legacy);
}

#[test]
fn the_16550_driver_on_the_model_passes_the_suite_looped_through_a_pty() {
    through_a_pty(Uart::Legacy);
}

#[test]
fn the_16550_driver_on_the_model_passes_the_suite_looped_back_in_the_model() {
    in_the_model(Uart::Legacy);
}

#[test]
fn the_native_16550_driver_on_the_model_passes_the_suite_looped_through_a_socket() {
    through_a_socket(Uart::Native);
}

#[test]
fn the_native_16550_driver_on_the_model_passes_the_suite_looped_through_a_pty() {
    through_a_pty(Uart::Native);
}

#[test]
fn the_native_16550_driver_on_the_model_passes_the_suite_looped_back_in_the_model() {
    in_the_model(Uart::Native);
}
