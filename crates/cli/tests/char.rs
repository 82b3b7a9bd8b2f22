//! The char class under the manager, as a user meets it: PCI 16550 models driven by the C
//! 16550 driver in their own driver servers, their lines' far ends a socket this test holds
//! and a file; `outboard char`, `outboard tty`; a driver server killed under a waiting reader.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{stdout, Up};
use outboard_char::LineSettings;
use rustix::process::Signal;

fn machine(dir: &Path) -> String {
    format!(
        r#"
name = "lines"

[[device]]
name = "tty0"
model = "serial"
line = "listen:{0}/line0.sock"

[[device]]
name = "tty1"
model = "serial"
line = "file:{0}/line1.out"
"#,
        dir.display()
    )
}

/// The far end of tty0's line: connects to its model's socket.
fn far_end(dir: &Path) -> UnixStream {
    let path = dir.join("line0.sock");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match UnixStream::connect(&path) {
            Ok(s) => {
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                // The model takes the newest peer when it next looks: give it a moment.
                std::thread::sleep(Duration::from_millis(200));
                return s;
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("{}: {e}", path.display()),
        }
    }
}

fn read_exactly(s: &mut UnixStream, n: usize) -> Vec<u8> {
    let mut got = vec![0u8; n];
    s.read_exact(&mut got).unwrap();
    got
}

fn ok(up: &Up, args: &[&str]) -> String {
    let o = up.run_within(args, Duration::from_secs(60));
    assert!(
        o.status.success(),
        "outboard {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
    stdout(&o)
}

#[test]
fn bytes_cross_the_line_both_ways_and_settings_take_effect() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(&machine(dir.path())));
    let mut far = far_end(dir.path());

    ok(&up, &["char", "write", "tty0", "hello", "--crlf"]);
    assert_eq!(read_exactly(&mut far, 7), b"hello\r\n");

    far.write_all(b"world").unwrap();
    let got = ok(
        &up,
        &["char", "read", "tty0", "--length", "5", "--idle", "10s"],
    );
    assert_eq!(got, "world");

    let info = ok(&up, &["char", "info", "tty0"]);
    assert!(info.contains("115200 baud 8N1, no flow control"), "{info}");
    assert!(info.contains("sent 7 bytes, received 5"), "{info}");
    assert!(info.contains("CTS DSR DCD"), "{info}");

    ok(&up, &["char", "set", "tty0", "9600,7E1"]);
    let info = ok(&up, &["char", "info", "tty0"]);
    assert!(info.contains("9600 baud 7E1"), "{info}");
    // Seven data bits: the eighth bit does not go out.
    let mut out = up.run_with_input(&["char", "write", "tty0"], &[0xc1]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(read_exactly(&mut far, 1), [0x41]);

    // A rate the device cannot make, and a malformed one, are refused with why.
    out = up.run(&["char", "set", "tty0", "100000"]);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("cannot make"), "{e}");
    out = up.run(&["char", "set", "tty0", "9600,9N1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("data bits"));
    let info = ok(&up, &["char", "info", "tty0"]);
    assert!(
        info.contains("9600 baud 7E1"),
        "a refused setting changed the line: {info}"
    );

    // tty1's line ends in a file.
    ok(&up, &["char", "write", "tty1", "to the file"]);
    let file = dir.path().join("line1.out");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read(&file).unwrap_or_default().len() < 11 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"to the file");

    // A read posted by a call with a larger buffer, answered to one with a smaller buffer:
    // nothing is lost, the rest comes with the next calls.
    let (mut c, _) = outboard_char_client::open_char(&up.control, "tty0").unwrap();
    let mut big = [0u8; 64];
    assert_eq!(
        c.read(&mut big, Some(Duration::from_millis(100))).unwrap(),
        0
    );
    far.write_all(b"abcdef").unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < 6 && Instant::now() < deadline {
        let mut small = [0u8; 2];
        let n = c.read(&mut small, Some(Duration::from_secs(1))).unwrap();
        got.extend_from_slice(&small[..n]);
    }
    assert_eq!(got, b"abcdef");

    // The registry shows them as char devices driven by the C driver.
    let tree = common::registry(&up).to_string();
    assert!(
        tree.contains("\"kind\":\"char-device\",\"name\":\"tty0\""),
        "{tree}"
    );
    assert!(tree.contains("uart16550"), "{tree}");
}

#[test]
fn tty_sends_what_comes_in_and_prints_what_the_line_sends_back() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(&machine(dir.path())));
    let mut far = far_end(dir.path());
    // The far end answers "ping" with "pong", as a device on the line would.
    let answerer = std::thread::spawn(move || {
        let got = read_exactly(&mut far, 4);
        far.write_all(b"pong\r\n").unwrap();
        got
    });
    let o = up.run_with_input(&["tty", "tty0"], b"ping");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(answerer.join().unwrap(), b"ping");
    assert!(stdout(&o).contains("pong"), "{}", stdout(&o));
}

/// The driver servers under `up` that serve `device`.
fn servers_of(up_pid: u32, device: &str) -> Vec<u32> {
    common::children_running(up_pid, "driver-host")
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&format!("{device}=")))
                .unwrap_or(false)
        })
        .collect()
}

/// Waits until the registry counts one restart and no longer names the dead server `dead`.
fn serving_again(up: &Up, dead: u32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let tree = common::registry(up).to_string();
        if tree.contains("\"restarts\":1") && !tree.contains(&format!("\"pid\":{dead}")) {
            return;
        }
        assert!(Instant::now() < deadline, "never came back: {tree}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What `docs/restart.md` promises a writer: bytes acknowledged are not lost, and none is sent
/// twice. The far end stops reading, so a 2 MiB write is held on the line (flow stopped: no
/// deadline); the driver server is killed under it. The write fails as interrupted, saying how
/// many bytes had been sent; the far end then reads a prefix of what was written — at least
/// those bytes, each once, in order (every 8-byte record numbered, so a repeat or a gap shows)
/// — followed directly by the client's next write.
#[test]
fn a_write_held_at_a_crash_fails_interrupted_and_no_byte_is_lost_or_sent_twice() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(&machine(dir.path())));
    let up_pid = up.child.as_ref().unwrap().id();
    let mut far = far_end(dir.path());
    let (mut c, _) = outboard_char_client::open_char(&up.control, "tty0").unwrap();
    let data: Vec<u8> = (0..(2 << 20) / 8)
        .flat_map(|i| format!("{i:07}\n").into_bytes())
        .collect();
    // The far end reads nothing: the line backs up and the write is held; two seconds into
    // it, the driver server is killed.
    // A killer that cannot kill would leave the write held for ever: it ends the test
    // binary instead of panicking on its own thread.
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        let old = servers_of(up_pid, "tty0");
        if old.len() != 1 || !common::signal_child_of(up_pid, old[0], Signal::KILL) {
            eprintln!("tty0's driver server: found {old:?}, could not kill it");
            std::process::abort();
        }
        old[0]
    });
    let result = c.write(&data);
    let dead = killer.join().unwrap();
    let why = match result {
        Err(outboard_char::CharError::Interrupted(why)) => why,
        Ok(()) => panic!("2 MiB went out with nobody reading"),
        Err(other) => panic!("the write in flight at the crash: {other:?}"),
    };
    // "the first N bytes were sent; ..."
    let sent: usize = why
        .strip_prefix("the first ")
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("how far it got: {why}"));
    serving_again(&up, dead);
    // The far end reads again (what backed up first), and the client's next write follows.
    let limit = data.len() + 5;
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        while !got.ends_with(b"AFTER") && got.len() <= limit {
            let n = far.read(&mut buf).unwrap();
            assert!(n > 0, "the line closed after {} bytes", got.len());
            got.extend_from_slice(&buf[..n]);
        }
        got
    });
    c.write(b"AFTER").unwrap();
    let got = reader.join().unwrap();
    assert!(got.ends_with(b"AFTER"), "more bytes than were written");
    let arrived = &got[..got.len() - 5];
    assert!(
        arrived.len() >= sent,
        "{sent} bytes were acknowledged as sent, {} arrived",
        arrived.len()
    );
    assert!(
        arrived == &data[..arrived.len()],
        "the {} bytes that arrived are not the first bytes written, each once",
        arrived.len()
    );
}

#[test]
fn a_killed_driver_server_loses_no_waiting_reader_and_keeps_the_clients_settings() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(&machine(dir.path())));
    let up_pid = up.child.as_ref().unwrap().id();
    let mut far = far_end(dir.path());
    let (mut c, _) = outboard_char_client::open_char(&up.control, "tty0").unwrap();
    let slow: LineSettings = "19200,8N2".parse().unwrap();
    c.set_line(&slow).unwrap();
    c.write(b"before").unwrap();
    assert_eq!(read_exactly(&mut far, 6), b"before");

    let old = servers_of(up_pid, "tty0");
    assert_eq!(old.len(), 1, "tty0's driver server");
    // A read is posted and waiting when the server dies; the bytes come once the new driver
    // serves (bytes that reach the device while no driver runs are lost with its FIFO at
    // the reset, as on hardware).
    let mut buf = [0u8; 16];
    assert_eq!(
        c.read(&mut buf, Some(Duration::from_millis(100))).unwrap(),
        0
    );
    assert!(common::signal_child_of(up_pid, old[0], Signal::KILL));
    serving_again(&up, old[0]);
    std::thread::sleep(Duration::from_millis(300));
    far.write_all(b"after").unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while got.len() < 5 && Instant::now() < deadline {
        let n = c.read(&mut buf, Some(Duration::from_secs(1))).unwrap();
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(got, b"after");
    // The new driver has this client's settings, and sends.
    assert_eq!(c.line().unwrap().line, slow);
    c.write(b"again").unwrap();
    assert_eq!(read_exactly(&mut far, 5), b"again");
}

#[test]
fn the_class_suite_passes_on_a_looped_back_line_under_up() {
    let dir = tempfile::tempdir().unwrap();
    // Each of the UART's register accesses is a message to its model, and on a loopback the
    // device always has work: under the suite's floods a debug build's driver server turns its
    // loop about every half second, near the default heartbeat's 1 s (a release build turns it
    // well within). The suite is what this test is about; the heartbeat is given room.
    let machine = r#"
name = "looped"

[[device]]
name = "tty0"
model = "serial"
line = "loopback"
heartbeat = "5s"
"#;
    let up = Up::start(dir.path(), Some(machine));
    let o = up.run_within(&["char", "selftest", "tty0"], Duration::from_secs(300));
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{out}{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        common::logs_of(&dir.path().join("rt"))
    );
    // A line per check, each passed, and the verdict.
    for c in outboard_char::conformance::CHECKS {
        assert!(
            out.lines()
                .any(|l| l.contains(c.name) && l.trim_start().starts_with("ok")),
            "{}: {out}",
            c.name
        );
    }
    assert!(out.trim_end().ends_with("suite passed"), "{out}");
    // The line is left as the suite found it.
    assert!(ok(&up, &["char", "info", "tty0"]).contains("115200 baud 8N1, no flow control"));
}
