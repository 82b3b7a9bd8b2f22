//! A server asleep in its wait is woken by the descriptor given to `wake_on`: whoever sets the
//! stop flag (a signal handler) writes it, and `run` looks at the flag at once instead of when
//! its wait ends.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use outboard_vfio_user::{Server, ServerOptions};

use common::Idle;

/// Asserts that a turn of `server` waits out its 200 ms: nothing is left to wake it.
fn waits_its_time_out(server: &mut Server<Idle>) {
    let began = Instant::now();
    server.run_once(Duration::from_millis(200)).unwrap();
    assert!(
        began.elapsed() >= Duration::from_millis(150),
        "{:?}",
        began.elapsed()
    );
}

fn idle_server(dir: &tempfile::TempDir) -> Server<Idle> {
    Server::bind(
        &dir.path().join("idle.sock"),
        Idle,
        ServerOptions::default(),
    )
    .unwrap()
}

#[test]
fn a_byte_on_the_wake_descriptor_ends_a_long_wait_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = idle_server(&dir);
    let (mut writer, reader) = UnixStream::pair().unwrap();
    server.wake_on(reader.into());
    let waker = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        writer.write_all(b"x").unwrap();
        writer
    });
    let began = Instant::now();
    // Without the wake descriptor this waits its whole 20 s.
    server.run_once(Duration::from_secs(20)).unwrap();
    let waited = began.elapsed();
    let _writer = waker.join().unwrap();
    assert!(waited < Duration::from_secs(10), "woke after {waited:?}");
    // The byte was read: the next wait is not cut short by it.
    waits_its_time_out(&mut server);
}

#[test]
fn a_wake_descriptor_whose_writer_is_gone_is_dropped_not_spun_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = idle_server(&dir);
    let (writer, reader) = UnixStream::pair().unwrap();
    server.wake_on(reader.into());
    drop(writer);
    // The first turn finds its end and drops it; the next one waits its time-out.
    server.run_once(Duration::from_millis(200)).unwrap();
    waits_its_time_out(&mut server);
}
