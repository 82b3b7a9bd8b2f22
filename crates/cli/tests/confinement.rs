//! Least privilege: the driver servers and device models `outboard up` starts are confined
//! (seccomp allow-list, Landlock, no_new_privs, limits), hold only their own descriptors, still
//! serve, and refuse what a compromised driver or model would try.

mod common;

use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};

use common::{find_node, registry, DeviceProcess, Up, EXE};

const MACHINE: &str = r#"
name = "confined"
[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:8M"
[[device]]
name = "disk1"
model = "virtio-blk"
backing = "mem:8M"
"#;

fn status(pid: u64, field: &str) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

/// No capability in any set, on any thread of `pid` (each thread's status says its own).
fn assert_no_capabilities(pid: u64, what: &str) {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let tid = task.unwrap().file_name().to_string_lossy().into_owned();
        let st = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap();
        for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            let line = st.lines().find(|l| l.starts_with(set)).unwrap();
            assert!(
                line.ends_with("0000000000000000"),
                "{what} thread {tid}: {line}"
            );
        }
    }
}

/// What each descriptor of `pid` refers to.
fn fds(pid: u64) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.display().to_string())
        .collect()
}

#[test]
fn the_processes_a_machine_starts_are_confined_and_hold_only_their_own_descriptors() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let tree = registry(&up);
    let model = find_node(&tree, "pci-function").unwrap()["props"]["pid"]
        .as_u64()
        .unwrap();
    let server = find_node(&tree, "driver").unwrap()["props"]["pid"]
        .as_u64()
        .unwrap();
    for (what, pid) in [("device model", model), ("driver server", server)] {
        assert_eq!(status(pid, "NoNewPrivs"), "1", "{what}");
        assert_no_capabilities(pid, what);
        assert_eq!(status(pid, "Seccomp"), "2", "{what}: seccomp filter mode");
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        let core = limits.lines().find(|l| l.starts_with("Max core")).unwrap();
        assert_eq!(core.split_whitespace().nth(4), Some("0"), "{what}: {core}");
        let log = std::fs::read_to_string(up.dir.join(if what == "device model" {
            "disk0.device.log"
        } else {
            "disk0-server.server.log"
        }))
        .unwrap();
        assert!(
            log.contains("confined: seccomp allow-list of"),
            "{what}: {log}"
        );
        // Only what it was given: standard streams (null and its log), sockets it was passed
        // or accepted, eventfds, timers, memory areas. No path but its log: never a socket
        // file (its own, another device's, the manager's), never another process's log.
        let log_name = if what == "device model" {
            "disk0.device.log"
        } else {
            "disk0-server.server.log"
        };
        for target in fds(pid) {
            let own = target == "/dev/null"
                || target.starts_with("socket:")
                || target.starts_with("anon_inode:")
                || target.starts_with("/memfd:")
                || target.ends_with(log_name);
            assert!(own, "{what} (pid {pid}) holds {target}");
        }
    }
    // And it all still serves.
    let data = common::pattern(7, 8192);
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "4096"], &data);
    assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
    let r = up.run(&[
        "blk", "read", "disk0", "--offset", "4096", "--length", "8192",
    ]);
    assert_eq!(r.stdout, data);
}

/// Runs `outboard ARGS --check-confinement FILE SOCKET PID` aimed at another device's
/// socket, a file, and a bystander process; returns its report.
fn check(dir: &std::path::Path, args: &[&str]) -> (bool, String) {
    let secret = dir.join("secret");
    std::fs::write(&secret, "not for drivers").unwrap();
    let other = dir.join("other-device.sock");
    let _other = UnixListener::bind(&other).unwrap();
    let mut bystander = Command::new("sleep").arg("30").spawn().unwrap();
    let out = Command::new(EXE)
        .args(args)
        .arg("--check-confinement")
        .arg(&secret)
        .arg(&other)
        .arg(bystander.id().to_string())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let _ = bystander.kill();
    let _ = bystander.wait();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn assert_all_refused(what: &str, ok: bool, text: &str) {
    assert!(ok, "{what}: an attempt got through:\n{text}");
    let attempts: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(": denied (") || l.contains(": ALLOWED"))
        .collect();
    for (prefix, how) in [
        ("open ", "Operation not permitted"),
        ("create a file in ", "Operation not permitted"),
        ("connect to ", "Operation not permitted"),
        ("create a UNIX socket", "Operation not permitted"),
        ("create a TCP socket", "Operation not permitted"),
        ("ptrace pid ", "Operation not permitted"),
        ("signal pid ", "Operation not permitted"),
        ("start a process", "Operation not permitted"),
        ("execve ", "Operation not permitted"),
        ("map executable memory", "Operation not permitted"),
        ("stat /", "Operation not permitted"),
        ("ioctl FIFREEZE", "Operation not permitted"),
        ("ioctl FS_IOC_SETFLAGS", "Operation not permitted"),
        ("ioctl SIOCSIFFLAGS", "Operation not permitted"),
        ("ioctl TIOCSTI", "Operation not permitted"),
        ("fcntl F_SETOWN", "Operation not permitted"),
        ("fcntl F_SETSIG", "Operation not permitted"),
        ("fcntl F_SETLEASE", "Operation not permitted"),
        ("fcntl F_NOTIFY", "Operation not permitted"),
    ] {
        let line = attempts
            .iter()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("{what}: no {prefix:?} attempt:\n{text}"));
        assert!(line.contains(how), "{what}: {line}");
    }
    let n = outboard_confine::probe::count();
    assert!(
        text.contains(&format!("{n} of {n} attempts refused")),
        "{what}:\n{text}"
    );
}

#[test]
fn a_confined_driver_server_cannot_escape() {
    let dir = tempfile::tempdir().unwrap();
    let model = DeviceProcess::virtio_blk(dir.path(), "mem:1M", &[]);
    let device = format!("d0=vfio-user:{}", model.socket.display());
    let listen = dir.path().join("server.sock");
    let (ok, text) = check(
        dir.path(),
        &[
            "driver-host",
            "--listen",
            listen.to_str().unwrap(),
            "--device",
            &device,
        ],
    );
    assert!(text.contains("confined: seccomp"), "{text}");
    assert_all_refused("driver server", ok, &text);
}

#[test]
fn a_confined_device_model_cannot_escape() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("model.sock");
    let (ok, text) = check(
        dir.path(),
        &[
            "device",
            "virtio-blk",
            "--socket",
            socket.to_str().unwrap(),
            "--backing",
            "mem:1M",
        ],
    );
    assert!(text.contains("confined: seccomp"), "{text}");
    assert_all_refused("device model", ok, &text);
}

#[test]
fn children_run_as_the_user_they_are_given_and_still_serve() {
    let dir = tempfile::tempdir().unwrap();
    let machine = format!("{MACHINE}\n[[export]]\ndevice = \"disk0\"\n");
    let up = common::Up::start_with(dir.path(), Some(&machine), |c| {
        c.args(["--user", "nobody"]);
    });
    let running = || common::nbd::export_node(&up, "disk0")["props"]["state"] == "running";
    assert!(common::eventually(
        std::time::Duration::from_secs(20),
        running
    ));
    let tree = registry(&up);
    let export = common::nbd::export_node(&up, "disk0");
    let pids = [
        ("pci-function", find_node(&tree, "pci-function").unwrap()),
        ("driver", find_node(&tree, "driver").unwrap()),
        ("export", &export),
    ]
    .map(|(kind, n)| (kind, n["props"]["pid"].as_u64().unwrap()));
    for (kind, pid) in pids {
        let uid = status(pid, "Uid");
        assert!(
            uid.split_whitespace().all(|u| u == "65534"),
            "{kind}: Uid {uid}"
        );
        assert_eq!(status(pid, "CapBnd"), "0000000000000000", "{kind}");
    }
    let data = common::pattern(9, 8192);
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "0"], &data);
    assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
    let r = up.run(&["blk", "read", "disk0", "--offset", "0", "--length", "8192"]);
    assert_eq!(r.stdout, data);
    // The export, as nobody, reaches the device through the connection the manager made.
    common::nbd::round_trip(&common::nbd::export_socket(&up, "disk0"), 1 << 20, 9);
}

/// A read-only file system the test mounts under its own folder (a small tmpfs), unmounted
/// on drop.
struct ReadOnlyMount(std::path::PathBuf);

impl ReadOnlyMount {
    /// Mounts a tmpfs at `at`, lets `fill` write into it, then remounts it read-only.
    fn new(at: &std::path::Path, fill: impl FnOnce(&std::path::Path)) -> Self {
        std::fs::create_dir_all(at).unwrap();
        let run = |args: &[&str]| {
            let o = std::process::Command::new("mount")
                .args(args)
                .arg(at)
                .output()
                .unwrap();
            assert!(o.status.success(), "mount {args:?}: {o:?}");
        };
        run(&["-t", "tmpfs", "-o", "size=8m", "outboard-test"]);
        let m = Self(at.to_owned());
        fill(at);
        run(&["-o", "remount,ro"]);
        m
    }
}

impl Drop for ReadOnlyMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn a_read_only_disk_opens_its_backing_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::pattern(11, 1 << 20);
    let ro = dir.path().join("ro");
    let _mount = ReadOnlyMount::new(&ro, |at| {
        std::fs::write(at.join("golden.img"), &data).unwrap()
    });
    let machine = format!(
        "name = \"ro\"\n[[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\nbacking = \"{}\"\nread_only = true\n",
        ro.join("golden.img").display()
    );
    let up = common::Up::start(dir.path(), Some(&machine));
    let r = up.run(&[
        "blk", "read", "disk0", "--offset", "4096", "--length", "4096",
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(r.stdout == data[4096..8192]);
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "0"], b"x");
    assert!(!w.status.success(), "a write to a read-only disk succeeded");
}

#[test]
fn children_get_the_memory_and_descriptor_caps_of_their_device() {
    let dir = tempfile::tempdir().unwrap();
    let machine = "name = \"caps\"\n[[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\n\
                   backing = \"mem:8M\"\nmax_memory = \"2G\"\nmax_files = 256\n";
    let up = common::Up::start(dir.path(), Some(machine));
    let tree = registry(&up);
    for kind in ["pci-function", "driver"] {
        let pid = find_node(&tree, kind).unwrap()["props"]["pid"]
            .as_u64()
            .unwrap();
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        let soft = |name: &str| {
            let l = limits.lines().find(|l| l.starts_with(name)).unwrap();
            l[25..].split_whitespace().next().unwrap().to_string()
        };
        assert_eq!(
            soft("Max address space"),
            (2u64 << 30).to_string(),
            "{kind}"
        );
        assert_eq!(soft("Max open files"), "256", "{kind}");
    }
    // And the default caps the address space too.
    let dir = tempfile::tempdir().unwrap();
    let up = common::Up::start(dir.path(), Some(MACHINE));
    let pid = find_node(&registry(&up), "driver").unwrap()["props"]["pid"]
        .as_u64()
        .unwrap();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    assert!(
        limits.contains(&(16u64 << 30).to_string()),
        "no default address-space cap:\n{limits}"
    );
    // The data path still works under the caps.
    let data = common::pattern(3, 65536);
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "0"], &data);
    assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
}

#[test]
fn a_fault_socket_exists_only_where_fault_injection_is_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let up = common::Up::start(dir.path(), Some(MACHINE));
    let names: Vec<String> = std::fs::read_dir(&up.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.contains("faults")),
        "a fault socket without being asked: {names:?}"
    );
    let f = up.run(&["fault", "disk0", "error-next=1"]);
    assert!(!f.status.success());
    let err = String::from_utf8_lossy(&f.stderr);
    assert!(
        err.contains("fault_injection = true") && err.contains("--faults"),
        "{err}"
    );
    drop(up);
    let dir = tempfile::tempdir().unwrap();
    let up = common::Up::start_with(dir.path(), Some(MACHINE), |c| {
        c.arg("--faults");
    });
    let f = up.run(&["fault", "disk0", "error-next=1"]);
    assert!(f.status.success(), "{}", String::from_utf8_lossy(&f.stderr));
    let r = up.run(&["blk", "read", "disk0", "--offset", "0", "--length", "512"]);
    assert!(
        !r.status.success(),
        "the armed error did not reach the read"
    );
    // The device's own words reach the client, not only the code: the model's IOERR status,
    // as the driver read it, crossed the server's reasons ring.
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains("I/O error") && err.contains("VIRTIO_BLK_S_IOERR"),
        "{err}"
    );
}

#[test]
fn require_confinement_serves_where_all_of_it_holds_and_refuses_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    // The fault socket's thread starts before confinement: it restricts itself on a signal
    // (before Linux 7.0 Landlock has no all-threads flag), so what decides is whether the
    // kernel has every right and scope asked for (ABI 6: the signal and socket scopes).
    let mut child = std::process::Command::new(common::EXE)
        .args(["device", "virtio-blk", "--backing", "mem:1M", "--socket"])
        .arg(dir.path().join("blk.sock"))
        .arg("--faults-socket")
        .arg(dir.path().join("faults.sock"))
        .args(["--confine", "--require-confinement"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let abi = outboard_confine::sandbox::kernel_abi();
    if abi < 6 {
        let out = common::run_bounded_child(child, std::time::Duration::from_secs(20));
        assert!(!out.status.success(), "served with less: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--require-confinement"), "{err}");
        return;
    }
    let live = common::eventually(std::time::Duration::from_secs(10), || {
        outboard_sys::is_live(&dir.path().join("blk.sock"))
    });
    let _ = child.kill();
    let _ = child.wait();
    assert!(live, "a model with an older thread did not serve");
    // A whole machine (a driver server's vfio-user twin-socket thread is older too).
    let up = Up::start_with(dir.path(), Some(MACHINE), |c| {
        c.arg("--require-confinement");
    });
    let w = up.run_with_input(&["blk", "write", "disk1", "--offset", "512"], b"confined");
    assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
    let r = up.run(&["blk", "read", "disk1", "--offset", "512", "--length", "8"]);
    assert_eq!(r.stdout, b"confined");
}

#[test]
fn an_export_keeps_no_capability_and_is_filtered_on_every_thread() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some(&format!("{MACHINE}\n[[export]]\ndevice = \"disk0\"\n")),
    );
    let running = || common::nbd::export_node(&up, "disk0")["props"]["state"] == "running";
    assert!(common::eventually(
        std::time::Duration::from_secs(20),
        running
    ));
    let pid = common::nbd::export_node(&up, "disk0")["props"]["pid"]
        .as_u64()
        .unwrap();
    // The export parses whatever a client sends: a flaw there must not come with root's
    // capabilities.
    assert_eq!(status(pid, "NoNewPrivs"), "1", "export");
    assert_no_capabilities(pid, "export");
    // And its own allow-list on every thread, those started before it too (TSYNC).
    let threads: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .collect();
    assert!(threads.len() > 1, "the export serves with threads");
    for task in threads {
        let st = std::fs::read_to_string(task.path().join("status")).unwrap();
        let seccomp = st.lines().find_map(|l| l.strip_prefix("Seccomp:"));
        assert_eq!(seccomp.map(str::trim), Some("2"), "{st}");
    }
}
