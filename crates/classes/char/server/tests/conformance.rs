//! The char class's conformance suite (`outboard_char::conformance`) through a client session
//! with a driver server: the C 16550 driver on Outboard's pci-serial model, the model's line
//! looped back by an echo at its far end (a socket, a pseudo-terminal) and in the model itself
//! (`loopback`, as a plug joining TX to RX).

mod common;

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use outboard_char_client::CharClient;
use outboard_devices::serial_line::{Line, LineSpec};

/// The C driver keeps its state in statics: one instance at a time in this process.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// An echo at the far end, until `stop`.
fn echo(far: OwnedFd, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    std::thread::spawn(move || outboard_devices::serial_line::echo(&far, &stop).unwrap())
}

/// Serves `line` with the model, the C driver on it in a driver server, and runs the suite
/// through a client session, a line per check on standard error.
fn suite_on(line: Line, far: Option<OwnedFd>) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let served = common::serve(dir.path(), line);
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

#[test]
fn the_16550_driver_on_the_model_passes_the_suite_looped_through_a_socket() {
    let (near, far) = common::socket_pair();
    suite_on(Line::stream(near).unwrap(), Some(far));
}

#[test]
fn the_16550_driver_on_the_model_passes_the_suite_looped_through_a_pty() {
    let line = Line::open(&LineSpec::Pty).unwrap();
    let user = rustix::fs::open(
        line.pty_path().unwrap(),
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    suite_on(line, Some(user));
}

#[test]
fn the_16550_driver_on_the_model_passes_the_suite_looped_back_in_the_model() {
    suite_on(Line::open(&LineSpec::Loopback).unwrap(), None);
}
