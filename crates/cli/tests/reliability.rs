//! Failures stay in their process; bad input never destroys anything; nothing hangs.
//! One test per defect of the reliability review, each reproducing it first.

mod common;

use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{find_node, registry, run_bounded, wait_gone, Up, EXE};
use rustix::process::{Pid, Signal};

fn signal(pid: u64, sig: Signal) {
    rustix::process::kill_process(Pid::from_raw(pid as i32).unwrap(), sig).unwrap();
}

/// The pid of the (first) device model.
fn model_pid(up: &Up) -> u64 {
    find_node(&registry(up), "pci-function").expect("a device model")["props"]["pid"]
        .as_u64()
        .expect("its pid")
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Defect 2: creating a socket deleted whatever file was at the path.
#[test]
fn a_socket_path_never_replaces_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("machine.toml");
    std::fs::write(&victim, "precious").unwrap();
    let limit = Duration::from_secs(30);
    let up = run_bounded(
        Command::new(EXE)
            .arg("up")
            .arg("--runtime-dir")
            .arg(dir.path().join("rt"))
            .arg("--control")
            .arg(&victim),
        limit,
    );
    assert!(!up.status.success());
    assert!(
        stderr(&up).contains("refusing to replace a regular file"),
        "{}",
        stderr(&up)
    );
    let dev = run_bounded(
        Command::new(EXE)
            .args(["device", "virtio-blk", "--backing", "mem:1M", "--socket"])
            .arg(&victim),
        limit,
    );
    assert!(!dev.status.success(), "{}", stderr(&dev));
    let host = run_bounded(
        Command::new(EXE)
            .args(["driver-host", "--device", "n=null:1M", "--listen"])
            .arg(&victim),
        limit,
    );
    assert!(!host.status.success(), "{}", stderr(&host));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
}

/// Defect 4: a second manager on the same runtime directory took over the first one's disks.
#[test]
fn a_second_manager_on_the_same_runtime_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let w = up.run_with_input(
        &["blk", "write", "disk0", "--offset", "4096"],
        b"first manager",
    );
    assert!(w.status.success(), "{}", stderr(&w));
    let second = run_bounded(
        Command::new(EXE)
            .arg("up")
            .env("OUTBOARD_CONTROL", &up.control),
        Duration::from_secs(30),
    );
    assert!(!second.status.success());
    assert!(
        stderr(&second).contains("in use by another `outboard up`"),
        "{}",
        stderr(&second)
    );
    // The first manager still serves its own disk, data intact.
    let r = up.run(&["blk", "read", "disk0", "--offset", "4096", "--length", "13"]);
    assert_eq!(r.stdout, b"first manager", "{}", stderr(&r));
}

/// Defect 6: SIGKILL of the manager orphaned its children.
#[test]
fn a_killed_manager_takes_its_children_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut up = Up::start(dir.path(), None);
    let pid = up.child.as_ref().unwrap().id();
    let kids = common::children_of(pid);
    assert_eq!(
        kids.len(),
        3,
        "a device model, a driver server and its standby"
    );
    up.child.as_mut().unwrap().kill().unwrap();
    up.child.take().unwrap().wait().unwrap();
    for k in kids {
        assert!(
            wait_gone(k, Duration::from_secs(10)),
            "child {k} outlived its manager"
        );
    }
    // Nothing is left running on the old paths: a new manager starts on the same directory.
    let up = Up::start(dir.path(), None);
    assert!(up.run(&["blk", "info", "disk0"]).status.success());
}

/// Defect 7: server names were not validated; `control` replaced the manager's socket.
#[test]
fn a_server_named_control_does_not_replace_the_control_socket() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some("[[device]]\nname = \"d\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\nserver = \"control\"\n"),
    );
    assert!(up.run(&["ls"]).status.success());
    assert!(up.run(&["blk", "info", "d"]).status.success());
    let o = run_bounded(
        Command::new(EXE).args(["up", "--machine"]).arg({
            let p = dir.path().join("bad.toml");
            std::fs::write(&p, "[[device]]\nname = \"d\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\nserver = \"../escaped\"\n").unwrap();
            p
        }).env("OUTBOARD_CONTROL", dir.path().join("rt2/control.sock")),
        Duration::from_secs(30),
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains(":5: server name"), "{}", stderr(&o));
    assert!(!dir.path().join("escaped.server.sock").exists());
}

/// Defect 5: a driver server did not notice its device model died. Now the manager restarts
/// the model on the same backing (a memory disk is held by the manager, so its bytes survive),
/// then the driver server, and a client after that reads what was written before.
#[test]
fn a_dead_device_model_is_restarted_on_its_backing_and_keeps_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "8192"], b"kept");
    assert!(w.status.success(), "{}", stderr(&w));
    let model = model_pid(&up);
    signal(model, Signal::KILL);
    let back = common::eventually(Duration::from_secs(20), || {
        let r = up.run_within(
            &["blk", "read", "disk0", "--offset", "8192", "--length", "4"],
            Duration::from_secs(10),
        );
        r.status.success() && r.stdout == b"kept"
    });
    assert!(back, "the model did not come back with its data");
    assert_ne!(model_pid(&up), model);
    let tree = registry(&up);
    let f = find_node(&tree, "pci-function").unwrap();
    assert_eq!(f["props"]["restarts"], 1, "{tree:#}");
    let d = find_node(&tree, "driver").unwrap();
    assert_eq!(d["props"]["restarts"], 1, "{tree:#}");
}

/// Defect 1: a device model stalled past the vfio-user timeout wedged its driver server for
/// good, every later reply off by one. Now the driver server gives the device up and ends; the
/// manager resets the model (starts it again on its backing) and the server, and the client
/// whose read was caught in the stall gets its data, late but right.
#[test]
fn a_stalled_device_model_is_reset_and_its_client_sees_only_a_delay() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "8192"], b"kept");
    assert!(w.status.success(), "{}", stderr(&w));
    let model = model_pid(&up);
    signal(model, Signal::STOP);
    let r = up.run_within(
        &["blk", "read", "disk0", "--offset", "8192", "--length", "4"],
        Duration::from_secs(60),
    );
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(!stderr(&r).contains("expected reply"), "{}", stderr(&r));
    assert_eq!(r.stdout, b"kept");
    assert_ne!(model_pid(&up), model);
    let tree = registry(&up);
    assert_eq!(
        find_node(&tree, "pci-function").unwrap()["props"]["restarts"],
        1,
        "{tree:#}"
    );
}

#[test]
fn a_driver_ended_by_its_device_failing_says_why_in_the_registry() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some(
            "name = \"m\"\n[[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\n\
         backing = \"mem:8M\"\nfault_injection = true\n",
        ),
    );
    let f = up.run(&["fault", "disk0", "needs-reset"]);
    assert!(f.status.success(), "{}", stderr(&f));
    // The next request meets the device asking for a reset; the server ends for a restart.
    let r = up.run_within(
        &["blk", "read", "disk0", "--length", "512"],
        Duration::from_secs(60),
    );
    assert!(r.status.success(), "{}", stderr(&r));
    let last = || {
        let tree = registry(&up);
        find_node(&tree, "driver").unwrap()["props"]["last-exit"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    // Its last exit says what happened to the device, not only an exit status.
    assert!(
        common::eventually(Duration::from_secs(10), || last()
            .contains("its device failed: disk0:")),
        "{}",
        last()
    );
}

/// Defect 10: an idle control connection stalled the manager (1 s each, crash detection too).
#[test]
fn idle_control_connections_do_not_stall_the_manager() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    // Twenty silent clients: at 1 s each the manager used to be busy for 20 s, beyond every
    // client's 10 s timeout.
    let idle: Vec<_> = (0..20)
        .map(|_| outboard_session::control::connect(&up.control).unwrap())
        .collect();
    let ls = run_bounded(
        Command::new(EXE)
            .arg("ls")
            .env("OUTBOARD_CONTROL", &up.control),
        Duration::from_secs(8),
    );
    assert!(ls.status.success(), "{}", stderr(&ls));
    drop(idle);
}

/// Defect 10: a client that never reads its replies wedged the driver server.
#[test]
fn a_client_that_never_reads_cannot_wedge_a_driver_server() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let tree = registry(&up);
    let server = find_node(&tree, "driver").unwrap()["props"]["server-socket"]
        .as_str()
        .unwrap()
        .to_string();
    let rude = outboard_session::control::connect(std::path::Path::new(&server)).unwrap();
    let req = br#"{"op":"status","device":"disk0"}"#;
    for _ in 0..100_000 {
        match rustix::net::send(&rude, req, rustix::net::SendFlags::DONTWAIT) {
            Ok(_) => {}
            Err(_) => break,
        }
    }
    // Another client is served as usual.
    let data = common::pattern(5, 8192);
    let w = up
        .spawn_write("disk0", 1 << 20, &data)
        .wait_with_output()
        .unwrap();
    assert!(w.status.success(), "{}", stderr(&w));
    let r = up.run_within(
        &["blk", "read", "disk0", "--offset", "1M", "--length", "8192"],
        Duration::from_secs(10),
    );
    assert!(r.stdout == data);
    let _ = rude.as_fd();
}

/// Defect 12: a second client of a colocated device waited 5 s for `VERSION: timed out`.
#[test]
fn a_second_client_of_a_colocated_device_is_told_it_is_busy() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some("[[device]]\nname = \"c\"\nmodel = \"virtio-blk\"\nbacking = \"mem:8M\"\nplacement = \"colocated\"\n"),
    );
    // The first client holds the device: it blocks writing to a pipe nobody reads.
    let mut holder = Command::new(EXE)
        .args(["blk", "read", "c"])
        .env("OUTBOARD_CONTROL", &up.control)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    std::io::Read::read_exact(holder.stdout.as_mut().unwrap(), &mut first).unwrap();
    let second = up.run_within(&["blk", "info", "c"], Duration::from_secs(4));
    assert!(!second.status.success());
    assert!(stderr(&second).contains("busy"), "{}", stderr(&second));
    holder.kill().unwrap();
    holder.wait().unwrap();
}

/// Defect 12: distinct failures got the same "no such device".
#[test]
fn a_manager_that_is_not_running_is_not_reported_as_a_missing_device() {
    let dir = tempfile::tempdir().unwrap();
    let o = run_bounded(
        Command::new(EXE)
            .args(["blk", "info", "disk0"])
            .env("OUTBOARD_CONTROL", dir.path().join("nothing.sock")),
        Duration::from_secs(10),
    );
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(!e.contains("no such device"), "{e}");
    assert!(e.contains("is `outboard up` running?"), "{e}");
}

/// Defect 12: small ones in the command line.
#[test]
fn the_command_line_refuses_bad_input_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    // An overflowing length was read as a tiny one and exited 0 with no output.
    let r = up.run(&[
        "blk",
        "read",
        "disk0",
        "--offset",
        "5",
        "--length",
        "18446744073709551613",
    ]);
    assert!(!r.status.success());
    assert!(stderr(&r).contains("past the end"), "{}", stderr(&r));
    // --create with a bad size left a file behind after refusing it.
    let img = dir.path().join("ten.img");
    let o = run_bounded(
        Command::new(EXE)
            .args(["device", "virtio-blk", "--create", "10", "--socket"])
            .arg(dir.path().join("x.sock"))
            .arg("--backing")
            .arg(&img),
        Duration::from_secs(10),
    );
    assert!(!o.status.success());
    assert!(
        !img.exists(),
        "a refused --create left {} behind",
        img.display()
    );
    // Logs to a pipe carry no colour codes.
    let o = up.run_within(&["-v", "blk", "info", "disk0"], Duration::from_secs(10));
    assert!(!o.stderr.contains(&0x1b), "{}", stderr(&o));
}

/// Defect 12: `outboard … | head` panicked on the broken pipe.
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let mut c = Command::new(EXE)
        .args(["blk", "read", "disk0"])
        .env("OUTBOARD_CONTROL", &up.control)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(c.stdout.take());
    let o = c.wait_with_output().unwrap();
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}

/// Defect 12: the log of a crashed process was deleted at shutdown. A restarted process's
/// log goes on after its predecessor's, and outlives the machine.
#[test]
fn a_crash_log_outlives_the_machine() {
    let dir = tempfile::tempdir().unwrap();
    let mut up = Up::start(dir.path(), None);
    let tree = registry(&up);
    let pid = find_node(&tree, "driver").unwrap()["props"]["pid"]
        .as_u64()
        .unwrap();
    signal(pid, Signal::KILL);
    assert!(wait_gone(pid as u32, Duration::from_secs(10)));
    let restarted = common::eventually(Duration::from_secs(20), || {
        let tree = registry(&up);
        find_node(&tree, "driver").unwrap()["props"]["restarts"] == 1
            && find_node(&tree, "block-device").unwrap()["props"]["state"] == "serving"
    });
    assert!(restarted);
    let out = up.interrupt();
    let err = String::from_utf8_lossy(&out.stderr);
    let log = err
        .split("; log ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no log named in {err}"));
    let text = std::fs::read_to_string(log).unwrap_or_else(|e| panic!("{log}: {e}"));
    assert_eq!(
        text.matches("listening on").count(),
        2,
        "both incarnations' lines are kept:\n{text}"
    );
}

/// Defect 8: concurrent unaligned writes to disjoint byte ranges that share blocks lost
/// acknowledged data (each client read-modify-wrote the shared blocks).
#[test]
fn concurrent_unaligned_writes_to_shared_blocks_all_land() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let writers = 12u64;
    let piece = 300u64;
    for round in 0..6u64 {
        let base = (1 << 20) + round * 8192;
        let procs: Vec<_> = (0..writers)
            .map(|i| {
                let data = common::pattern(round * 100 + i, piece as usize);
                up.spawn_write("disk0", base + i * piece, &data)
            })
            .collect();
        for p in procs {
            let o = p.wait_with_output().unwrap();
            assert!(o.status.success(), "{}", stderr(&o));
        }
        let r = up.run(&[
            "blk",
            "read",
            "disk0",
            "--offset",
            &base.to_string(),
            "--length",
            &(writers * piece).to_string(),
        ]);
        for i in 0..writers {
            let at = (i * piece) as usize;
            assert!(
                r.stdout[at..at + piece as usize]
                    == common::pattern(round * 100 + i, piece as usize)[..],
                "round {round}: writer {i}'s acknowledged bytes were lost"
            );
        }
    }
}

#[test]
fn a_read_past_the_end_is_refused_before_its_output_file_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    let out = dir.path().join("precious");
    std::fs::write(&out, b"do not truncate").unwrap();
    for args in [
        &["--offset", "999999999999"][..],
        &["--offset", "4096", "--length", "99999999999"][..],
    ] {
        let mut all = vec!["blk", "read", "disk0"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", out.to_str().unwrap()]);
        let r = up.run(&all);
        assert!(!r.status.success(), "{args:?}");
        assert!(stderr(&r).contains("run past the end"), "{}", stderr(&r));
        assert_eq!(std::fs::read(&out).unwrap(), b"do not truncate");
    }
}

/// A request a stalled device held is answered only once the device can no longer carry it
/// out. Answered at the deadline while the model slept on, the client took its buffer back and
/// wrote other bytes there; the model woke, carried the old write out with those bytes, and a
/// block the client never wrote them to held them (the fault campaign's "no valid stamp").
/// A driver server run by hand (not restartable) answers "timed out" once the model is back and
/// has reset; the block then holds what the write carried, or what it held before.
#[test]
fn a_write_a_stalled_device_held_is_answered_only_once_the_device_cannot_carry_it_out() {
    use outboard_block::{BlockDevice, BlockError, BlockOp, BlockRequest};
    let dir = tempfile::tempdir().unwrap();
    let faults = dir.path().join("faults.sock");
    let model = common::DeviceProcess::virtio_blk(
        dir.path(),
        "mem:1M",
        &["--faults-socket", faults.to_str().unwrap()],
    );
    let listen = dir.path().join("host.sock");
    let host = Command::new(EXE)
        .args(["driver-host", "--deadline-ms", "300", "--listen"])
        .arg(&listen)
        .arg("--device")
        .arg(format!("disk0=vfio-user:{}", model.socket.display()))
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _host = common::DeviceProcess {
        child: host,
        socket: listen.clone(),
    };
    assert!(outboard_sys::wait::eventually(
        Duration::from_secs(10),
        || { outboard_sys::is_live(&listen) && outboard_sys::is_live(&faults) }
    ));
    let opts = outboard_block_client::SessionOptions {
        depth: 2,
        buffer_size: 8192,
        ..Default::default()
    };
    let mut d = outboard_block_client::BlockClient::open(&listen, "disk0", opts).unwrap();
    let sectors = 4096 / d.info().block_size;
    let written = common::pattern(1, 4096);
    let theirs = common::pattern(2, 4096);
    // Arm the stall: the model sleeps at the write's doorbell, past the deadline.
    let arm = rustix::net::socket(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        None,
    )
    .unwrap();
    rustix::net::connect(&arm, &rustix::net::SocketAddrUnix::new(&faults).unwrap()).unwrap();
    rustix::net::send(&arm, b"stall=2s", rustix::net::SendFlags::empty()).unwrap();
    let mut ok = [0u8; 16];
    let (n, _) = rustix::net::recv(&arm, &mut ok, rustix::net::RecvFlags::empty()).unwrap();
    assert_eq!(&ok[..n], b"ok");
    d.buffers().write(0, &written).unwrap();
    let t = std::time::Instant::now();
    d.submit(&BlockRequest {
        op: BlockOp::Write,
        lba: 0,
        blocks: sectors,
        buf_offset: 0,
        tag: 1,
    })
    .unwrap();
    d.kick().unwrap();
    let mut out = Vec::new();
    while out.is_empty() {
        assert!(t.elapsed() < Duration::from_secs(20), "no answer");
        let _ = d.wait(&mut out, Duration::from_secs(1));
    }
    let answered = t.elapsed();
    assert_eq!(out[0].result, Err(BlockError::Timeout), "{out:?}");
    // The buffer is the client's again: it reuses it at once, as any client would.
    d.buffers().write(0, &theirs).unwrap();
    // Read block 0 once the device serves again (after the stall, whenever the answer came).
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(t.elapsed()));
    let mut back = vec![0u8; 4096];
    let read = outboard_sys::wait::eventually(Duration::from_secs(20), || {
        d.read_blocks(0, &mut back).is_ok()
    });
    assert!(read, "the device did not serve again");
    assert!(
        back == written || back.iter().all(|b| *b == 0),
        "block 0 holds bytes the client never wrote to it (answered after {answered:?})"
    );
    assert!(
        answered >= Duration::from_secs(2),
        "answered after {answered:?}, while the device still held the write"
    );
}
