//! `outboard up` end to end: the default machine, the registry, block I/O by name from many
//! processes, crash reporting, clean shutdown, configuration errors, the colocated placement.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::pattern;

use common::{children_of, stdout, Up, EXE};

#[test]
fn the_default_machine_serves_disk0_and_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let mut up = Up::start(dir.path(), None);
    let ls = up.run(&["ls"]);
    let text = stdout(&ls);
    assert!(text.contains("block-device disk0"), "{text}");
    assert!(text.contains("ids=1af4:1042"), "{text}");
    assert!(text.contains("driver virtio-blk"), "{text}");
    let json: serde_json::Value =
        serde_json::from_slice(&up.run(&["ls", "--json"]).stdout).unwrap();
    assert_eq!(json["kind"], "machine");
    let info = stdout(&up.run(&["blk", "info", "disk0"]));
    assert!(info.contains("67108864 bytes"), "{info}");

    // A file round-trips byte for byte, at an offset that is not block aligned.
    let data = pattern(9, 200_001);
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "1000"], &data);
    assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
    let r = up.run(&[
        "blk", "read", "disk0", "--offset", "1000", "--length", "200001",
    ]);
    assert!(r.status.success());
    assert!(r.stdout == data, "read differs from what was written");
    // The bytes around it are untouched (read-modify-write did not clobber them).
    let before = up.run(&["blk", "read", "disk0", "--offset", "512", "--length", "488"]);
    assert!(before.stdout.iter().all(|&b| b == 0));
    // Errors are clear.
    let bad = up.run(&["blk", "read", "disk0", "--offset", "64M", "--length", "1"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("past the end"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    let none = up.run(&["blk", "info", "disk7"]);
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("no device named"),
        "{}",
        String::from_utf8_lossy(&none.stderr)
    );

    // Ctrl-C leaves no process and no socket behind.
    let pid = up.child.as_ref().unwrap().id();
    let kids = children_of(pid);
    assert_eq!(
        kids.len(),
        3,
        "a device model, a driver server and its standby"
    );
    let out = up.interrupt();
    assert!(out.status.success());
    assert!(stdout(&out).contains("outboard: stopped"));
    for k in kids {
        assert!(
            !Path::new(&format!("/proc/{k}")).exists()
                || std::fs::read_to_string(format!("/proc/{k}/stat"))
                    .unwrap()
                    .contains(") Z"),
            "child {k} still running"
        );
    }
    assert!(
        !up.dir.exists(),
        "runtime directory removed: {:?}",
        std::fs::read_dir(&up.dir).map(|d| d.count())
    );
}

#[test]
fn client_processes_in_parallel_do_verified_io() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let n = 6u64;
    // Each process writes its own 256 KiB range, then all read back and compare.
    let writers: Vec<_> = (0..n)
        .map(|i| up.spawn_write("disk0", i * 300_000 + 17, &pattern(i, 262_144)))
        .collect();
    for w in writers {
        let o = w.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let readers: Vec<_> = (0..n)
        .map(|i| {
            Command::new(EXE)
                .args([
                    "blk",
                    "read",
                    "disk0",
                    "--offset",
                    &(i * 300_000 + 17).to_string(),
                    "--length",
                    "262144",
                ])
                .env("OUTBOARD_CONTROL", &up.control)
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, r) in readers.into_iter().enumerate() {
        let o = r.wait_with_output().unwrap();
        assert!(o.status.success());
        assert!(
            o.stdout == pattern(i as u64, 262_144),
            "process {i}'s range differs"
        );
    }
}

#[test]
fn a_client_process_killed_mid_io_does_not_disturb_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    for _ in 0..3 {
        let mut reader = Command::new(EXE)
            .args(["blk", "read", "disk0", "-o", "/dev/null"])
            .env("OUTBOARD_CONTROL", &up.control)
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(30));
        reader.kill().unwrap();
        reader.wait().unwrap();
    }
    let data = pattern(77, 65536);
    assert!(up
        .run_with_input(&["blk", "write", "disk0", "--offset", "8M"], &data)
        .status
        .success());
    let r = up.run(&[
        "blk", "read", "disk0", "--offset", "8M", "--length", "65536",
    ]);
    assert!(r.stdout == data);
    let text = stdout(&up.run(&["ls"]));
    assert!(!text.contains("crashed"), "{text}");
}

fn kill_driver(up: &Up) -> i32 {
    let tree: serde_json::Value =
        serde_json::from_slice(&up.run(&["ls", "--json"]).stdout).unwrap();
    let driver = &tree["children"][0]["children"][0]["children"][0];
    let pid = driver["props"]["pid"].as_u64().unwrap() as i32;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    pid
}

#[test]
fn a_crashed_driver_server_is_reported_and_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let mut up = Up::start(dir.path(), None);
    kill_driver(&up);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = stdout(&up.run(&["ls"]));
        if text.contains("restarts=1") && text.contains("state=serving") {
            assert!(text.contains("last-restart-ms="), "{text}");
            break;
        }
        assert!(Instant::now() < deadline, "no restart: {text}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = up.run(&["blk", "info", "disk0"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let out = up.interrupt();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("exited (signal: 9"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Past its restart limit a driver is given up, and then its clients get a specific error
/// at once.
#[test]
fn a_driver_past_its_restart_limit_is_given_up_and_clients_are_told() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some("[[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\nrestarts = 0\n"),
    );
    kill_driver(&up);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = stdout(&up.run(&["ls"]));
        if text.contains("state=gave up") {
            break;
        }
        assert!(Instant::now() < deadline, "not given up: {text}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let t = Instant::now();
    let r = up.run(&["blk", "read", "disk0", "--length", "512"]);
    assert!(!r.status.success());
    let e = String::from_utf8_lossy(&r.stderr);
    assert!(e.contains("device failed") && e.contains("gave up"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn bad_machine_descriptions_name_file_line_and_problem() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.toml");
    std::fs::write(&p, "name = \"x\"\n[[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\nbacking = \"mem:64M\"\nplacement = \"sideways\"\n").unwrap();
    let o = Command::new(EXE)
        .args(["up", "--machine"])
        .arg(&p)
        .env("OUTBOARD_CONTROL", dir.path().join("c.sock"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("{}:6:", p.display())), "{err}");
    assert!(err.contains("placement"), "{err}");
}

#[test]
fn the_colocated_placement_links_the_driver_into_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let machine = "name = \"colo\"\n[[device]]\nname = \"fast0\"\nmodel = \"virtio-blk\"\nbacking = \"mem:8M\"\nplacement = \"colocated\"\n";
    let up = Up::start(dir.path(), Some(machine));
    let text = stdout(&up.run(&["ls"]));
    assert!(text.contains("placement=colocated"), "{text}");
    let data = pattern(3, 10_000);
    assert!(up
        .run_with_input(&["blk", "write", "fast0", "--offset", "3"], &data)
        .status
        .success());
    let r = up.run(&["blk", "read", "fast0", "--offset", "3", "--length", "10000"]);
    assert!(r.stdout == data);
}

#[test]
fn blk_bench_runs_both_placements_and_reports_every_row() {
    let o = Command::new(EXE)
        .args(["blk", "bench", "--size", "8M", "--seconds", "0.1"])
        .output()
        .unwrap();
    let text = stdout(&o);
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for row in [
        "sequential 64 KiB reads",
        "random 4 KiB reads, QD32",
        "null request round trip, blocking",
        "adaptive",
    ] {
        assert!(text.contains(row), "missing {row}: {text}");
    }
}

#[test]
fn a_null_block_device_is_a_real_device_type() {
    let dir = tempfile::tempdir().unwrap();
    let machine =
        "name = \"ipc\"\n[[device]]\nname = \"null0\"\nmodel = \"null-blk\"\nsize = \"1G\"\n";
    let up = Up::start(dir.path(), Some(machine));
    let text = stdout(&up.run(&["ls"]));
    assert!(
        text.contains("bus virtual")
            && text.contains("driver null-blk")
            && text.contains("block-device null0"),
        "{text}"
    );
    let info = stdout(&up.run(&["blk", "info", "null0"]));
    assert!(info.contains("1073741824 bytes"), "{info}");
    // Requests complete (without moving data); range checks still apply.
    assert!(up
        .run(&["blk", "read", "null0", "--length", "4096"])
        .status
        .success());
    assert!(!up
        .run(&["blk", "read", "null0", "--offset", "1G", "--length", "1"])
        .status
        .success());
}

/// `outboard ARGS --runtime-dir RT` (ARGS: `up` by default) with no `OUTBOARD_CONTROL`,
/// `customize` applied; killed on drop.
fn up_in(rt: &Path, args: &[&str], customize: impl FnOnce(&mut Command)) -> common::DeviceProcess {
    let mut c = Command::new(EXE);
    c.args(if args.is_empty() { &["up"][..] } else { args })
        .arg("--runtime-dir")
        .arg(rt)
        .env_remove("OUTBOARD_CONTROL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    customize(&mut c);
    common::DeviceProcess {
        child: c.spawn().unwrap(),
        socket: rt.join("control.sock"),
    }
}

/// `outboard up --runtime-dir DIR` puts its control socket in DIR too, unless `--control` (or
/// `OUTBOARD_CONTROL`) says where: a second machine in a directory of its own is reached there.
#[test]
fn the_runtime_directory_holds_the_control_socket_unless_told_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let rt = dir.path().join("rt");
    // Where the default would put it, kept inside the test's own directory.
    let xdg = dir.path().join("xdg");
    std::fs::create_dir(&xdg).unwrap();
    let mut up = up_in(&rt, &[], |c| {
        c.env("XDG_RUNTIME_DIR", &xdg);
    });
    let control = rt.join("control.sock");
    let default = xdg.join("outboard/control.sock");
    assert!(
        outboard_sys::wait::eventually(Duration::from_secs(30), || {
            outboard_sys::is_live(&control) || outboard_sys::is_live(&default) || !up.alive()
        }),
        "outboard up did not come up"
    );
    assert!(
        outboard_sys::is_live(&control),
        "no control socket in the runtime directory (the default's: {})",
        default.exists()
    );
    let ls = Command::new(EXE)
        .arg("--control")
        .arg(&control)
        .arg("ls")
        .env_remove("OUTBOARD_CONTROL")
        .output()
        .unwrap();
    assert!(ls.status.success(), "{ls:?}");
    assert!(String::from_utf8_lossy(&ls.stdout).contains("disk0"));
    assert!(!default.exists());
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&up.child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    assert!(
        outboard_sys::wait::eventually(Duration::from_secs(20), || !up.alive()),
        "outboard up did not stop"
    );
    assert!(!control.exists(), "the control socket outlived the machine");
}

/// `outboard up --print-default` prints the machine it runs without a description, with every
/// key a disk takes commented out at its default: a file to start from.
#[test]
fn print_default_shows_every_key_of_a_disk_at_its_default() {
    let out = Command::new(EXE)
        .args(["up", "--print-default"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    for key in [
        "# read_only = false",
        "# queues = 1",
        "# request_deadline = \"30s\"",
        "# restarts = 5",
        "# heartbeat = \"1s\"",
        "# max_files = 4096",
        "# [[export]]",
    ] {
        assert!(text.contains(key), "{key:?} missing from:\n{text}");
    }
    assert!(text.contains("backing = \"mem:64M\"\n") || text.contains("backing = \"mem:64M\" "));
}

/// Shell completions and manual pages are made from the command line itself: bash takes the
/// script, and every command has its page with its options.
#[test]
fn completions_and_manual_pages_come_from_the_command_line() {
    let run = |args: &[&str]| {
        let out = Command::new(EXE)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let bash = run(&["completions", "bash"]);
    assert!(bash.contains("_outboard") && bash.contains("blk"), "{bash}");
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("outboard.bash");
    std::fs::write(&script, &bash).unwrap();
    let syntax = Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .unwrap();
    assert!(syntax.status.success(), "{syntax:?}");
    assert!(run(&["completions", "zsh"]).starts_with("#compdef outboard"));
    let bad = Command::new(EXE)
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("bash"),
        "{bad:?}"
    );
    let page = run(&["man"]);
    assert!(page.contains(".TH outboard 1"), "{page}");
    let pages = dir.path().join("man1");
    run(&["man", "--dir", pages.to_str().unwrap()]);
    let read = std::fs::read_to_string(pages.join("outboard-blk-read.1")).unwrap();
    assert!(
        read.contains("timeout") && read.contains("offset"),
        "{read}"
    );
    for page in [
        "outboard.1",
        "outboard-up.1",
        "outboard-export-nbd.1",
        "outboard-completions.1",
    ] {
        assert!(pages.join(page).exists(), "{page}");
    }
    // The internal peer of the ping-pong measurements has no page.
    assert!(!pages.join("outboard-bench-peer.1").exists());
}

/// `--control` shows on the commands that talk to the manager and on no other; it is taken
/// after the command (also inside a family: `blk read … --control`), before it as earlier
/// versions took it, and an explicit one beats `$OUTBOARD_CONTROL`.
#[test]
fn control_shows_only_on_commands_that_talk_to_the_manager() {
    let help = |args: &[&str]| {
        let out = Command::new(EXE)
            .args(args)
            .arg("--help")
            .env_remove("OUTBOARD_CONTROL")
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    for uses in [
        &["up"][..],
        &["ls"],
        &["top"],
        &["blk", "read"],
        &["rng", "read"],
        &["net", "stats"],
        &["export", "nbd"],
        &["fault"],
        &["power"],
        &["restart"],
        &["move"],
        &["attach"],
        &["detach"],
        &["down"],
    ] {
        assert!(help(uses).contains("--control <PATH>"), "{uses:?}");
    }
    for not in [
        &[][..],
        &["hw", "probe"],
        &["device", "virtio-blk"],
        &["bench"],
        &["completions"],
        &["man"],
        &["driver-host"],
    ] {
        assert!(!help(not).contains("--control"), "{not:?}");
    }
    let said = |args: &[&str]| {
        let out = Command::new(EXE)
            .args(args)
            .env("OUTBOARD_CONTROL", "/nonexistent/from-env.sock")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    for args in [
        &["ls", "--control", "/nonexistent/after.sock"][..],
        &["--control", "/nonexistent/after.sock", "ls"],
        &[
            "blk",
            "info",
            "disk0",
            "--control",
            "/nonexistent/after.sock",
        ],
        &[
            "blk",
            "--control",
            "/nonexistent/after.sock",
            "info",
            "disk0",
        ],
    ] {
        let err = said(args);
        assert!(err.contains("/nonexistent/after.sock"), "{args:?}: {err}");
    }
    let err = said(&["ls"]);
    assert!(err.contains("/nonexistent/from-env.sock"), "{err}");
}

/// A negative number is a bad value, said as such (not "unexpected argument"), and a
/// default is shown once.
#[test]
fn negative_numbers_are_refused_as_values_and_defaults_are_shown_once() {
    for args in [
        &["blk", "read", "disk0", "--offset", "-5"][..],
        &["blk", "read", "disk0", "--length", "-1"],
        &["rng", "read", "rng0", "--length", "-1"],
        &["bench", "faults", "--faults", "-3"],
    ] {
        let out = Command::new(EXE)
            .args(args)
            .env("OUTBOARD_CONTROL", "/nonexistent/control.sock")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("invalid value '-"), "{args:?}: {err}");
    }
    let help = Command::new(EXE)
        .args(["bench", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let runs = help.lines().find(|l| l.contains("--runs")).unwrap();
    assert_eq!(runs.matches("default").count(), 1, "{runs}");
}

/// As a service: `outboard up` tells the service manager it is ready (`READY=1` on
/// `$NOTIFY_SOCKET`, sd_notify's protocol; a socket of the test's here) and that it stops;
/// `outboard down` stops every process it started and removes every socket; with `--log`
/// the manager's log goes to a file of its own.
#[test]
fn as_a_service_up_says_ready_and_down_stops_everything() {
    let dir = tempfile::tempdir().unwrap();
    let rt = dir.path().join("rt");
    let log = dir.path().join("manager.log");
    let notify = dir.path().join("notify.sock");
    let service_manager = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    service_manager
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut up = up_in(&rt, &["-v", "up", "--log", log.to_str().unwrap()], |c| {
        c.env("NOTIFY_SOCKET", &notify);
    });
    let pid = up.child.id();
    let mut said = [0u8; 512];
    let n = service_manager
        .recv(&mut said)
        .expect("READY=1 within 30 s");
    let ready = String::from_utf8_lossy(&said[..n]).to_string();
    assert!(ready.contains("READY=1"), "{ready}");
    assert!(ready.contains(&format!("MAINPID={pid}")), "{ready}");
    let control = rt.join("control.sock");
    assert!(
        outboard_sys::is_live(&control),
        "ready before its control socket listens"
    );
    let children = children_of(pid);
    assert!(!children.is_empty(), "no model or driver server");
    let down = common::run_bounded(
        Command::new(EXE).arg("--control").arg(&control).arg("down"),
        Duration::from_secs(40),
    );
    assert!(down.status.success(), "{down:?}");
    assert_eq!(stdout(&down).trim(), "outboard: stopped");
    assert!(
        outboard_sys::wait::eventually(Duration::from_secs(20), || !up.alive()),
        "outboard up did not stop"
    );
    assert_eq!(up.child.wait().unwrap().code(), Some(0));
    let n = service_manager.recv(&mut said).expect("STOPPING=1");
    assert!(String::from_utf8_lossy(&said[..n]).contains("STOPPING=1"));
    for c in children {
        assert!(
            common::wait_gone(c, Duration::from_secs(10)),
            "child {c} outlived the machine"
        );
    }
    let sockets: Vec<_> = std::fs::read_dir(&rt)
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    e.file_type()
                        .is_ok_and(|t| std::os::unix::fs::FileTypeExt::is_socket(&t))
                })
                .map(|e| e.file_name())
                .collect()
        })
        .unwrap_or_default();
    assert!(sockets.is_empty(), "left behind: {sockets:?}");
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("outboard down: stopping the machine"),
        "{logged}"
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&log).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
}

/// The systemd unit in contrib/ starts and stops Outboard with arguments this build takes.
#[test]
fn the_service_unit_runs_commands_this_build_accepts() {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../contrib/outboard.service"
    ))
    .unwrap();
    assert!(unit.contains("Type=notify"));
    for key in ["ExecStart=", "ExecStop="] {
        let line = unit.lines().find(|l| l.starts_with(key)).unwrap();
        let mut words = line[key.len()..].split_whitespace();
        assert_eq!(words.next(), Some("/usr/local/bin/outboard"), "{line}");
        // --help after the arguments: clap checks every argument before it, then prints help.
        let out = Command::new(EXE)
            .args(words)
            .arg("--help")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{line}: {out:?}");
    }
}
