//! Power states: a suspended device finishes what is in flight and takes nothing new; its
//! clients' requests wait (they do not fail) and complete once it is resumed, also when its
//! driver server was restarted while it was suspended.

mod common;

use std::time::{Duration, Instant};

use common::{registry, stdout, Up};

fn device_state(up: &Up) -> String {
    common::find_node(&registry(up), "block-device").unwrap()["props"]["state"]
        .as_str()
        .unwrap()
        .to_string()
}

fn wait_state(up: &Up, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = device_state(up);
        if now == want {
            return;
        }
        assert!(Instant::now() < deadline, "state {now:?}, wanted {want:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_suspended_device_holds_new_requests_until_resumed_even_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let before = common::pattern(1, 4096);
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "0"], &before);
    assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));

    let s = up.run(&["power", "disk0", "suspend"]);
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    assert_eq!(stdout(&s).trim(), "disk0: suspended");
    assert_eq!(device_state(&up), "suspended");

    // A write submitted now waits.
    let after = common::pattern(2, 4096);
    let mut writer = up.spawn_write("disk0", 0, &after);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        writer.try_wait().unwrap().is_none(),
        "a write completed on a suspended device"
    );

    // The driver server dies meanwhile: its successor starts with the device quiesced, and
    // the client's replayed write still waits.
    let tree = registry(&up);
    let pid = common::find_node(&tree, "driver").unwrap()["props"]["pid"]
        .as_i64()
        .unwrap() as i32;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !stdout(&up.run(&["ls"])).contains("restarts=1") {
        assert!(
            Instant::now() < deadline,
            "the driver server was not restarted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_state(&up, "suspended");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        writer.try_wait().unwrap().is_none(),
        "a write completed on a suspended device after its server restarted"
    );
    // A read from another client waits too.
    let reader = std::process::Command::new(common::EXE)
        .args(["blk", "read", "disk0", "--offset", "0", "--length", "4096"])
        .env("OUTBOARD_CONTROL", &up.control)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut reader = reader;
    assert!(reader.try_wait().unwrap().is_none(), "a read completed");

    let s = up.run(&["power", "disk0", "resume"]);
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    assert_eq!(stdout(&s).trim(), "disk0: serving");
    let out = writer.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the waiting write failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The two clients' requests are unordered: the read sees the old or the new block.
    let read = reader.wait_with_output().unwrap();
    assert!(read.status.success());
    assert!(read.stdout == before || read.stdout == after);
    let r = up.run(&["blk", "read", "disk0", "--offset", "0", "--length", "4096"]);
    assert_eq!(r.stdout, after, "the write that waited landed once, intact");
}

#[test]
fn power_names_what_it_cannot_do() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let r = up.run(&["power", "nosuch", "suspend"]);
    assert!(!r.status.success());
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("no device named \"nosuch\""),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    let r = up.run(&["power", "disk0", "sideways"]);
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("possible values: suspend, resume"));
}

/// No silent hang: a client command on a suspended device says once, after a second without
/// progress, why it waits and what lets it through; `--timeout` ends it with exit status 124
/// and how far its transfer got.
#[test]
fn a_command_kept_waiting_says_why_and_its_timeout_ends_it_with_what_it_did() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let s = up.run(&["power", "disk0", "suspend"]);
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    let t = Instant::now();
    let r = up.run_within(
        &[
            "blk",
            "read",
            "disk0",
            "--length",
            "4096",
            "--timeout",
            "2s",
        ],
        Duration::from_secs(30),
    );
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(124), "{err}");
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(20),
        "{took:?}"
    );
    assert_eq!(
        err.matches("waiting: disk0 is suspended").count(),
        1,
        "said once: {err}"
    );
    assert!(err.contains("`outboard power disk0 resume`"), "{err}");
    assert!(
        err.contains("blk read disk0: timed out after 2s: 0 of 4096 bytes read"),
        "{err}"
    );
    assert!(r.stdout.is_empty());
    // What keeps it waiting shows in `blk info`, for people and for scripts.
    let info = up.run_within(&["blk", "info", "disk0"], Duration::from_secs(30));
    assert!(stdout(&info).contains("state        suspended"), "{info:?}");
    let info = up.run_within(&["blk", "info", "disk0", "--json"], Duration::from_secs(30));
    let j: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(j["state"], "suspended", "{j}");
    assert_eq!(j["capacity_bytes"], 64u64 << 20, "{j}");
    assert_eq!(j["block_size"], 512, "{j}");
    assert_eq!(j["read_only"], false, "{j}");
    let s = up.run(&["power", "disk0", "resume"]);
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
}

/// A transfer cut off by a detach says how many bytes it had moved.
#[test]
fn a_write_cut_off_by_a_detach_says_how_far_it_got() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let data = common::pattern(3, 4 << 20);
    // The write waits on the suspended device; the device is detached under it.
    let s = up.run(&["power", "disk0", "suspend"]);
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    let writer = up.spawn_write("disk0", 0, &data);
    std::thread::sleep(Duration::from_millis(300));
    let d = up.run_within(&["detach", "disk0"], Duration::from_secs(30));
    assert!(d.status.success(), "{}", String::from_utf8_lossy(&d.stderr));
    let out = common::run_bounded_child(writer, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("(after 0 of {} bytes written)", data.len())),
        "{err}"
    );
}
