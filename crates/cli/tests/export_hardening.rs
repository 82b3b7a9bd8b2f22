//! The NBD export against clients that try to take it down for everyone: one that hangs up on
//! replies it queued, and (under the manager) an export that dies anyway.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::nbd::{request_header, round_trip, Raw};
use common::{eventually, Up, EXE};

/// A 64 MiB disk in a driver server of its own.
const MACHINE: &str = r#"
name = "exports"
[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:64M"
placement = "separate"
"#;

/// `outboard export nbd disk0` on a socket in the machine's directory; killed on drop.
struct Export {
    child: Child,
    socket: PathBuf,
}

impl Export {
    fn start(up: &Up, extra: &[&str]) -> Self {
        Self::start_with(up, extra, |_| {})
    }

    /// Like [`Export::start`], with `customize` applied to the command (limits, stderr).
    fn start_with(up: &Up, extra: &[&str], customize: impl FnOnce(&mut Command)) -> Self {
        let socket = up.dir.join("disk0.nbd");
        let mut cmd = Command::new(EXE);
        cmd.args(["export", "nbd", "disk0", "--socket"])
            .arg(&socket)
            .args(extra)
            .env("OUTBOARD_CONTROL", &up.control)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        customize(&mut cmd);
        let child = cmd.spawn().expect("spawn outboard export");
        assert!(
            eventually(Duration::from_secs(20), || outboard_sys::is_live(&socket)),
            "the export did not start listening"
        );
        Self { child, socket }
    }

    /// Still running (not exited, for instance of a signal).
    fn alive(&mut self) -> Result<(), String> {
        match self.child.try_wait().unwrap() {
            None => Ok(()),
            Some(s) => Err(format!("the export exited: {s}")),
        }
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client that queues `n` reads of 1 MiB (as many as the socket takes within 2 s) and reads
/// no reply.
fn queue_reads(socket: &std::path::Path, n: u64) -> Raw {
    let mut c = Raw::go(socket);
    c.0.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    for i in 0..n {
        if c.0.write_all(&request_header(0, i, 0, 1 << 20)).is_err() {
            break;
        }
    }
    c
}

/// Queues `n` reads of 1 MiB and hangs up without reading a reply: the export's writes then
/// meet a closed socket.
fn hang_up_on_queued_reads(socket: &std::path::Path, n: u64) {
    let c = queue_reads(socket, n);
    // Let the export start answering into the full socket, then go.
    std::thread::sleep(Duration::from_millis(300));
    drop(c);
}

#[test]
fn a_client_that_hangs_up_on_queued_reads_does_not_take_the_export_down() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let mut ex = Export::start(&up, &[]);
    round_trip(&ex.socket, 0, 1);
    for round in 0..3 {
        hang_up_on_queued_reads(&ex.socket, 64);
        std::thread::sleep(Duration::from_millis(300));
        ex.alive()
            .unwrap_or_else(|e| panic!("after hang-up {round}: {e}"));
    }
    round_trip(&ex.socket, 1 << 20, 2);
}

#[test]
fn an_export_the_manager_started_is_restarted_when_it_dies_and_its_clients_are_corrected() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some(&format!("{MACHINE}\n[[export]]\ndevice = \"disk0\"\n")),
    );
    let up_pid = up.child.as_ref().unwrap().id();
    let running = || common::nbd::export_node(&up, "disk0")["props"]["state"] == "running";
    assert!(eventually(Duration::from_secs(20), running));
    let socket = common::nbd::export_socket(&up, "disk0");
    let held = Raw::go(&socket);
    assert!(eventually(Duration::from_secs(10), || {
        common::nbd::export_node(&up, "disk0")["props"]["clients"] == 1
    }));
    let exports = common::children_running(up_pid, "export");
    assert_eq!(exports.len(), 1, "one export child");
    assert!(common::signal_child_of(
        up_pid,
        exports[0],
        rustix::process::Signal::KILL
    ));
    // Restarted: a new process, no client counted that died with the old one.
    let back = || {
        let n = common::nbd::export_node(&up, "disk0");
        n["props"]["state"] == "running"
            && n["props"]["clients"] == 0
            && n["props"]["pid"] != serde_json::json!(exports[0])
            && n["props"]["restarts"] == 1
    };
    assert!(
        eventually(Duration::from_secs(20), back),
        "{:#}",
        common::nbd::export_node(&up, "disk0")
    );
    drop(held);
    round_trip(&socket, 0, 3);
}

#[test]
fn idle_clients_and_one_that_never_reads_leave_room_for_a_well_behaved_client() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let mut ex = Export::start(&up, &[]);
    // More idle connections, each past the handshake, than a session per connection allowed.
    let idle: Vec<Raw> = (0..40).map(|_| Raw::go(&ex.socket)).collect();
    // One that queues 1 MiB reads and never takes a reply.
    let deaf = queue_reads(&ex.socket, 64);
    for round in 0..8 {
        round_trip(&ex.socket, round << 20, 100 + round);
    }
    ex.alive().unwrap();
    drop((idle, deaf));
}

#[test]
fn connections_past_the_limit_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &["--max-connections", "3"]);
    let mut held: Vec<Raw> = (0..3).map(|_| Raw::go(&ex.socket)).collect();
    let mut c = Raw::connect(&ex.socket);
    c.hello();
    let mut d = 5u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"disk0");
    d.extend_from_slice(&0u16.to_be_bytes());
    c.option(7, &d);
    let (kind, msg) = c.option_reply();
    assert_eq!(kind, (1 << 31) + 2, "NBD_REP_ERR_POLICY");
    let msg = String::from_utf8_lossy(&msg);
    assert!(msg.contains("at most 3 connections"), "{msg}");
    drop(c);
    // Once one leaves, a new client is served.
    held.pop();
    assert!(eventually(Duration::from_secs(10), || {
        let mut c = Raw::connect(&ex.socket);
        c.hello();
        c.option(7, &d);
        loop {
            match c.option_reply().0 {
                1 => return true,
                3 => continue,
                _ => return false,
            }
        }
    }));
}

#[test]
fn a_client_that_never_finishes_negotiating_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &["--handshake-timeout", "1s"]);
    let mut c = Raw::connect(&ex.socket);
    c.hello();
    let t = std::time::Instant::now();
    assert!(c.closed(), "still open");
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(800) && waited < Duration::from_secs(8),
        "{waited:?}"
    );
}

#[test]
fn a_client_that_stops_taking_replies_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &["--write-timeout", "1s"]);
    let mut deaf = queue_reads(&ex.socket, 64);
    std::thread::sleep(Duration::from_secs(3));
    // What the export managed to send before it gave up, then the end.
    let mut got = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    deaf.0
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    loop {
        match std::io::Read::read(&mut deaf.0, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n as u64,
        }
    }
    assert!(got < 64 << 20, "every reply arrived ({got} bytes)");
    round_trip(&ex.socket, 0, 5);
}

#[test]
fn an_export_out_of_descriptors_backs_off_and_serves_again() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let log = dir.path().join("export.log");
    let err = std::fs::File::create(&log).unwrap();
    let mut ex = Export::start_with(
        &up,
        &["--handshake-timeout", "2s", "--max-files", "40"],
        |cmd| {
            cmd.stderr(err);
        },
    );
    let flood: Vec<_> = (0..100)
        .filter_map(|_| outboard_sys::connect_now(&ex.socket, rustix::net::SocketType::STREAM).ok())
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    ex.alive().unwrap();
    drop(flood);
    assert!(
        eventually(Duration::from_secs(15), || std::panic::catch_unwind(|| {
            round_trip(&ex.socket, 0, 6)
        })
        .is_ok()),
        "the export did not serve again"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let accept_lines = text.lines().filter(|l| l.contains("accept")).count();
    assert!(
        accept_lines <= 2,
        "{accept_lines} lines about accept:\n{text}"
    );
}

#[test]
fn plain_tcp_beyond_loopback_is_refused_without_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    // An address this host does not have: were it not refused, binding would fail harmlessly.
    let out = common::run_bounded(
        Command::new(EXE)
            .args(["export", "nbd", "disk0", "--listen", "10.213.9.1:10809"])
            .env("OUTBOARD_CONTROL", &up.control),
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("without TLS") && err.contains("--insecure"),
        "{err}"
    );
}

/// The export's threads now (from `/proc`): one per connection it is serving or refusing.
fn threads_of(child: &Child) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn connections_past_the_limit_get_no_thread_of_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let mut ex = Export::start(&up, &["--max-connections", "4"]);
    // Once it serves (a client served and gone), its own threads have started: the
    // negotiation watcher, the shared session's pump.
    round_trip(&ex.socket, 0, 6);
    std::thread::sleep(Duration::from_millis(100));
    let before = threads_of(&ex.child);
    // Silent connections: they never send a byte, so each would hold a thread until its
    // handshake time-out if the export gave every one of them a thread.
    let flood: Vec<_> = (0..80)
        .filter_map(|_| std::os::unix::net::UnixStream::connect(&ex.socket).ok())
        .collect();
    // Looked at within the second a refused connection is given to read why.
    std::thread::sleep(Duration::from_millis(300));
    let during = threads_of(&ex.child);
    // 4 served, and a few refusing at once.
    assert!(
        during <= before + 4 + 4,
        "{during} threads with 80 connections at a limit of 4 ({before} before)"
    );
    ex.alive().unwrap();
    drop(flood);
    assert!(eventually(Duration::from_secs(15), || {
        std::panic::catch_unwind(|| round_trip(&ex.socket, 0, 7)).is_ok()
    }));
}

#[test]
fn a_negotiation_trickled_a_byte_at_a_time_ends_at_the_handshake_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &["--handshake-timeout", "2s"]);
    let mut c = Raw::connect(&ex.socket);
    c.hello();
    // NBD_OPT_LIST again and again, one byte every 400 ms: each read is quick, the whole
    // negotiation is not.
    let option = [&b"IHAVEOPT"[..], &3u32.to_be_bytes(), &0u32.to_be_bytes()].concat();
    c.0.set_read_timeout(Some(Duration::from_millis(1)))
        .unwrap();
    let t = std::time::Instant::now();
    let mut cut = false;
    'trickle: while t.elapsed() < Duration::from_secs(12) {
        for b in &option {
            std::thread::sleep(Duration::from_millis(400));
            if c.0.write_all(&[*b]).is_err() {
                cut = true;
                break 'trickle;
            }
            // Drain replies; the end of the stream means the export closed it.
            let mut buf = [0u8; 4096];
            match std::io::Read::read(&mut c.0, &mut buf) {
                Ok(0) => {
                    cut = true;
                    break 'trickle;
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => {
                    cut = true;
                    break 'trickle;
                }
            }
        }
    }
    let waited = t.elapsed();
    assert!(
        cut,
        "a trickled negotiation was still open after {waited:?}"
    );
    assert!(waited < Duration::from_secs(6), "cut after {waited:?}");
}

#[test]
fn idle_export_connections_leave_the_device_to_its_other_clients() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &[]);
    let idle: Vec<Raw> = (0..40).map(|_| Raw::go(&ex.socket)).collect();
    // A client of the device that is not the export: the CLI, through its own session.
    let out = up.run_within(&["blk", "info", "disk0"], Duration::from_secs(30));
    assert!(
        out.status.success(),
        "with 40 idle NBD clients: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let w = up.run_with_input(
        &["blk", "write", "disk0", "--offset", "8192"],
        b"still here",
    );
    assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
    let r = up.run(&["blk", "read", "disk0", "--offset", "8192", "--length", "10"]);
    assert_eq!(r.stdout, b"still here");
    drop(idle);
}

#[test]
fn export_connections_carry_on_once_a_given_up_device_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let machine = format!("{MACHINE}restarts = 0\nretry_after_give_up = \"10m\"\n");
    let up = Up::start(dir.path(), Some(&machine));
    let ex = Export::start(&up, &[]);
    // Eight connections take the export's own sessions; the ninth shares its reserved one.
    let mut own: Vec<Raw> = (0..8).map(|_| Raw::go(&ex.socket)).collect();
    let mut shared = Raw::go(&ex.socket);
    let data = common::pattern(9, 4096);
    for c in own.iter_mut().take(1).chain([&mut shared]) {
        c.request(1, 1, 0, 4096, &data);
        assert_eq!(c.reply(0).0, 0);
    }
    let up_pid = up.child.as_ref().unwrap().id();
    let servers = common::children_running(up_pid, "driver-host");
    assert!(common::signal_child_of(
        up_pid,
        servers[0],
        rustix::process::Signal::KILL
    ));
    let given_up = || {
        let ls = up.run(&["ls"]);
        String::from_utf8_lossy(&ls.stdout).contains("gave up")
    };
    assert!(eventually(Duration::from_secs(20), given_up));
    // Meanwhile requests fail at once with an error (EIO), not a hang.
    for c in own.iter_mut().take(1).chain([&mut shared]) {
        let t = std::time::Instant::now();
        c.request(0, 2, 0, 4096, &[]);
        let (e, cookie, _) = c.reply(0);
        assert_eq!((e != 0, cookie), (true, 2));
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }
    let back = up.run_within(&["restart", "disk0"], Duration::from_secs(30));
    assert!(back.status.success(), "{back:?}");
    // The same connections read the bytes again.
    for (i, c) in own.iter_mut().take(1).chain([&mut shared]).enumerate() {
        let ok = eventually(Duration::from_secs(10), || {
            c.request(0, 3, 0, 4096, &[]);
            let (e, cookie, got) = c.reply(4096);
            cookie == 3 && e == 0 && got == data
        });
        assert!(ok, "connection {i} did not carry on");
    }
}

/// The manager's export reaches its device through the connection the manager gave it (it
/// may connect nowhere itself): when the driver server dies, the manager connects it to the
/// next one, and its clients see no error.
#[test]
fn a_managed_export_carries_its_clients_through_a_driver_restart() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some(&format!("{MACHINE}\n[[export]]\ndevice = \"disk0\"\n")),
    );
    let running = || common::nbd::export_node(&up, "disk0")["props"]["state"] == "running";
    assert!(eventually(Duration::from_secs(20), running));
    let mut c = Raw::go(&common::nbd::export_socket(&up, "disk0"));
    let data = common::pattern(12, 65536);
    c.request(1, 1, 0, data.len() as u32, &data);
    assert_eq!(c.reply(0).0, 0, "write");
    let up_pid = up.child.as_ref().unwrap().id();
    for round in 0..3u64 {
        let servers = common::driver_servers(&up.control, None);
        assert!(common::signal_child_of(
            up_pid,
            servers[0],
            rustix::process::Signal::KILL
        ));
        c.request(0, 2 + round, 0, data.len() as u32, &[]);
        let (e, cookie, got) = c.reply(data.len());
        assert_eq!((e, cookie), (0, 2 + round), "read after kill {round}");
        assert!(got == data, "read back differs after kill {round}");
    }
}

/// Everything at once, as the hardening promises: one client that never reads its replies,
/// thirty-two idle ones past the handshake, and so many connections that the export has no
/// descriptor left — a well-behaved client connected among them is still served byte-exact.
#[test]
fn a_well_behaved_client_is_served_beside_a_deaf_one_idle_ones_and_no_descriptors_left() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    const FILES: usize = 128;
    let mut ex = Export::start(
        &up,
        &[
            "--max-files",
            &FILES.to_string(),
            "--max-connections",
            "4096",
        ],
    );
    let pid = ex.child.id();
    let mut good = Raw::go(&ex.socket);
    let deaf = queue_reads(&ex.socket, 64);
    let idle: Vec<Raw> = (0..32).map(|_| Raw::go(&ex.socket)).collect();
    // Connections that say nothing, until the export cannot accept another (those left wait in
    // the listener's backlog, or are refused by a full one).
    let flood: Vec<_> = (0..200)
        .filter_map(|_| outboard_sys::connect_now(&ex.socket, rustix::net::SocketType::STREAM).ok())
        .collect();
    let open_fds = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    assert!(
        eventually(Duration::from_secs(5), || open_fds() >= FILES - 2),
        "the export holds {} of {FILES} descriptors",
        open_fds()
    );
    for round in 0..8u64 {
        let data = common::pattern(200 + round, 65536);
        let at = round << 20;
        good.request(1, 2 * round, at, data.len() as u32, &data);
        assert_eq!(good.reply(0), (0, 2 * round, Vec::new()), "write {round}");
        good.request(0, 2 * round + 1, at, data.len() as u32, &[]);
        let (e, cookie, got) = good.reply(data.len());
        assert_eq!((e, cookie), (0, 2 * round + 1), "read {round}");
        assert!(got == data, "read {round} differs");
    }
    ex.alive().unwrap();
    drop((flood, idle, deaf));
}

/// The manager's export of a colocated device drives it in its own process: the manager
/// connects it to the device's model, as it connects it to a driver server otherwise.
#[test]
fn a_managed_export_of_a_colocated_device_serves_it() {
    let dir = tempfile::tempdir().unwrap();
    let machine = MACHINE.replace("placement = \"separate\"", "placement = \"colocated\"");
    let up = Up::start(
        dir.path(),
        Some(&format!("{machine}\n[[export]]\ndevice = \"disk0\"\n")),
    );
    let running = || common::nbd::export_node(&up, "disk0")["props"]["state"] == "running";
    assert!(eventually(Duration::from_secs(20), running));
    round_trip(&common::nbd::export_socket(&up, "disk0"), 1 << 20, 13);
}

/// An export started by hand shows in the registry — its URI, its pid, its clients as they
/// come and go — for as long as it runs, and not after.
#[test]
fn an_export_started_by_hand_shows_in_the_registry_with_its_clients_while_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let mut ex = Export::start(&up, &[]);
    let node = || common::nbd::export_node(&up, "disk0");
    assert!(
        eventually(Duration::from_secs(10), || node()["props"]["state"]
            == "running"),
        "{}",
        node()
    );
    let n = node();
    assert_eq!(n["props"]["pid"], ex.child.id(), "{n}");
    assert_eq!(n["props"]["started"], "by hand", "{n}");
    assert!(
        n["props"]["uri"]
            .as_str()
            .is_some_and(|u| u.contains(&*ex.socket.to_string_lossy())),
        "{n}"
    );
    assert_eq!(n["props"]["clients"], 0, "{n}");
    let client = Raw::go(&ex.socket);
    assert!(
        eventually(Duration::from_secs(10), || node()["props"]["clients"] == 1),
        "{}",
        node()
    );
    drop(client);
    assert!(
        eventually(Duration::from_secs(10), || node()["props"]["clients"] == 0),
        "a client that left is still counted: {}",
        node()
    );
    ex.alive().unwrap();
    drop(ex);
    assert!(
        eventually(Duration::from_secs(10), || node().is_null()),
        "the export is gone, its node is not: {}",
        node()
    );
}
