//! The manager's control socket against local users it does not serve and against a flood
//! of connections: only its own user (or root) is answered, and supervision goes on whatever
//! the flood.

mod common;

use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{eventually, Up, EXE};

#[test]
fn a_client_of_another_user_is_refused_at_the_control_socket() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), None);
    // Open the way to the socket, as a careless administrator might: only the manager's own
    // check of who connects stands between another user and the machine.
    for p in [dir.path(), &up.dir] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o711)).unwrap();
    }
    std::fs::set_permissions(&up.control, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = common::run_bounded(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(EXE)
            .args(["blk", "write", "disk0", "--offset", "0"])
            .env("OUTBOARD_CONTROL", &up.control),
        Duration::from_secs(20),
    );
    assert!(!out.status.success(), "another user was served: {out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("uid 65534"), "{err}");
    // Its own user still is.
    assert!(up.run(&["ls"]).status.success());
}

/// A non-blocking connection to `path` (SEQPACKET, as the control protocol), or `None` once
/// the manager's backlog is full.
fn connect(path: &std::path::Path) -> Option<OwnedFd> {
    outboard_sys::connect_now(path, rustix::net::SocketType::SEQPACKET).ok()
}

#[test]
fn a_connection_flood_at_a_low_descriptor_limit_does_not_stop_supervision() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start_with(dir.path(), None, |cmd| {
        // SAFETY: the closure runs between fork and exec and only calls setrlimit, which is
        // async-signal-safe; the limit is this child's own.
        unsafe {
            cmd.pre_exec(|| {
                let l = rustix::process::Rlimit {
                    current: Some(1024),
                    maximum: Some(1024),
                };
                rustix::process::setrlimit(rustix::process::Resource::Nofile, l)?;
                Ok(())
            });
        }
    });
    let up_pid = up.child.as_ref().unwrap().id();
    // More idle connections than the manager may hold descriptors.
    let mut flood = Vec::new();
    for _ in 0..1500 {
        match connect(&up.control) {
            Some(fd) => flood.push(fd),
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    assert!(flood.len() > 1000, "only {} connections", flood.len());
    // Its driver dies during the flood: it must be started again, not given up.
    let servers = common::children_running(up_pid, "driver-host");
    assert_eq!(servers.len(), 1);
    assert!(common::signal_child_of(
        up_pid,
        servers[0],
        rustix::process::Signal::KILL
    ));
    let serving = || {
        let r = common::run_bounded(
            Command::new(EXE)
                .args(["ls", "--json"])
                .env("OUTBOARD_CONTROL", &up.control)
                .stdout(Stdio::piped()),
            Duration::from_secs(10),
        );
        let reg: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap_or_default();
        common::find_node(&reg, "driver").is_some_and(|d| {
            d["props"]["restarts"] == 1
                && d["props"]["state"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("running"))
        })
    };
    assert!(
        eventually(Duration::from_secs(30), serving),
        "the driver was not restarted during the flood: {}",
        common::logs_of(&up.dir)
    );
    // Data still flows, during the flood and after it.
    let data = common::pattern(7, 4096);
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "8192"], &data);
    assert!(w.status.success(), "{w:?}");
    drop(flood);
    let r = up.run(&[
        "blk", "read", "disk0", "--offset", "8192", "--length", "4096",
    ]);
    assert!(r.status.success() && r.stdout == data, "{r:?}");
}

#[test]
fn a_client_does_not_talk_to_a_manager_of_another_user() {
    // Another user's machine, with its control socket where this user's client is pointed.
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::chown(dir.path(), Some(65534), Some(65534)).unwrap();
    let rt = dir.path().join("rt");
    let control = rt.join("control.sock");
    let mut theirs = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(EXE)
        .arg("up")
        .arg("--runtime-dir")
        .arg(&rt)
        .env("OUTBOARD_CONTROL", &control)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let up = eventually(Duration::from_secs(20), || outboard_sys::is_live(&control));
    let out = common::run_bounded(
        Command::new(EXE)
            .arg("ls")
            .env("OUTBOARD_CONTROL", &control),
        Duration::from_secs(10),
    );
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_child(&theirs),
        rustix::process::Signal::INT,
    );
    let _ = theirs.wait();
    assert!(up, "the other user's manager did not start");
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("served by uid 65534"), "{err}");
}

#[test]
fn up_refuses_a_runtime_directory_another_user_made_first_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let rt = dir.path().join("outboard-0");
    std::fs::create_dir(&rt).unwrap();
    std::fs::set_permissions(&rt, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(&rt, Some(65534), Some(65534)).unwrap();
    let out = common::run_bounded(
        Command::new(EXE)
            .arg("up")
            .arg("--runtime-dir")
            .arg(&rt)
            .env("OUTBOARD_CONTROL", rt.join("control.sock")),
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("owned by uid 65534"), "{err}");
    assert_eq!(std::fs::read_dir(&rt).unwrap().count(), 0);
}

#[test]
fn a_manager_whose_terminal_went_away_keeps_supervising() {
    let dir = tempfile::tempdir().unwrap();
    let machine = dir.path().join("machine.toml");
    std::fs::write(
        &machine,
        "name = \"m\"\n[[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\n\
         backing = \"mem:8M\"\nrestarts = 0\n",
    )
    .unwrap();
    let control = dir.path().join("rt/control.sock");
    let ls = || {
        common::run_bounded(
            Command::new(EXE)
                .arg("ls")
                .env("OUTBOARD_CONTROL", &control),
            Duration::from_secs(20),
        )
    };
    // Its stdout and stderr are pipes whose readers go away (a closed terminal, `| tee`
    // interrupted): with SIGPIPE ignored, each later message meets EPIPE.
    let mut up = Command::new(EXE)
        .arg("up")
        .arg("--machine")
        .arg(&machine)
        .env("OUTBOARD_CONTROL", &control)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    struct Stop(std::process::Child);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    assert!(eventually(Duration::from_secs(30), || ls()
        .status
        .success()));
    drop(up.stdout.take());
    drop(up.stderr.take());
    let up = Stop(up);
    let pid = up.0.id();
    let servers = common::children_running(pid, "driver-host");
    assert_eq!(servers.len(), 1);
    // With restarts = 0 this death gives the device up, which the manager says on stderr.
    assert!(common::signal_child_of(
        pid,
        servers[0],
        rustix::process::Signal::KILL
    ));
    let given_up = || String::from_utf8_lossy(&ls().stdout).contains("gave up");
    assert!(
        eventually(Duration::from_secs(20), given_up),
        "not given up"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(ls().status.success(), "the manager stopped answering");
    let back = common::run_bounded(
        Command::new(EXE)
            .args(["restart", "disk0"])
            .env("OUTBOARD_CONTROL", &control),
        Duration::from_secs(30),
    );
    assert!(back.status.success(), "{back:?}");
}

#[test]
fn a_control_group_admits_its_supplementary_members_and_no_one_else() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start_with(dir.path(), None, |c| {
        c.args(["--control-group", "4242"]);
    });
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let as_nobody = |groups: &str| {
        common::run_bounded(
            Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", groups])
                .arg(EXE)
                .arg("ls")
                .env("OUTBOARD_CONTROL", &up.control),
            Duration::from_secs(20),
        )
    };
    // A member through a supplementary group, the way `usermod -aG` makes members.
    let member = as_nobody("--groups=4242");
    assert!(member.status.success(), "{member:?}");
    let stranger = as_nobody("--clear-groups");
    assert!(!stranger.status.success(), "{stranger:?}");
}
