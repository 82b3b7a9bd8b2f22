//! Helpers shared by the CLI's integration tests: start device models as real processes.

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub mod nbd;

/// A device model process, killed on drop.
pub struct DeviceProcess {
    pub child: Child,
    pub socket: PathBuf,
}

impl DeviceProcess {
    /// Starts `outboard device virtio-blk` with extra arguments and waits for its socket.
    pub fn virtio_blk(dir: &Path, backing: &str, extra: &[&str]) -> Self {
        Self::model(dir, "virtio-blk", backing, extra)
    }

    /// Starts `outboard device MODEL` with extra arguments and waits for its socket.
    pub fn model(dir: &Path, model: &str, backing: &str, extra: &[&str]) -> Self {
        let socket = dir.join("blk.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_outboard"))
            .args(["device", model, "--socket"])
            .arg(&socket)
            .args(["--backing", backing])
            .args(extra)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn outboard device");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            assert!(
                Instant::now() < deadline,
                "device model did not create its socket"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Self { child, socket }
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        )
        .expect("kill");
        self.child.wait().expect("wait")
    }
}

impl Drop for DeviceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A deterministic byte pattern distinct per seed (the block conformance suite's).
pub use outboard_block::conformance::pattern;

pub const EXE: &str = env!("CARGO_BIN_EXE_outboard");

/// A running `outboard up`, stopped with SIGINT on drop.
pub struct Up {
    pub child: Option<Child>,
    pub control: PathBuf,
    pub dir: PathBuf,
    /// What it wrote to stdout and stderr, read as it comes: a manager that logs a lot must
    /// never block on a full pipe.
    output: Vec<std::thread::JoinHandle<Vec<u8>>>,
}

/// Reads `r` to its end on a thread of its own.
fn drain(mut r: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = r.read_to_end(&mut all);
        all
    })
}

impl Up {
    pub fn start(dir: &Path, machine: Option<&str>) -> Self {
        Self::start_with(dir, machine, |_| {})
    }

    /// Like [`Up::start`], with `customize` applied to the `up` command (its options, limits).
    pub fn start_with(
        dir: &Path,
        machine: Option<&str>,
        customize: impl FnOnce(&mut Command),
    ) -> Self {
        let control = dir.join("rt/control.sock");
        let mut cmd = Command::new(EXE);
        cmd.arg("up");
        customize(&mut cmd);
        cmd.env("OUTBOARD_CONTROL", &control)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(m) = machine {
            let p = dir.join("machine.toml");
            std::fs::write(&p, m).unwrap();
            cmd.arg("--machine").arg(p);
        }
        let mut child = cmd.spawn().unwrap();
        let output = vec![
            drain(child.stdout.take().unwrap()),
            drain(child.stderr.take().unwrap()),
        ];
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut up = Self {
            child: Some(child),
            control,
            dir: dir.join("rt"),
            output,
        };
        loop {
            let ls = up.run(&["ls"]);
            if ls.status.success() {
                return up;
            }
            let exited = up.child.as_mut().unwrap().try_wait().unwrap().is_some();
            if exited || Instant::now() >= deadline {
                let out = up.interrupt();
                panic!(
                    "outboard up did not come up ({}); ls said: {}\nits stderr:\n{}\nlogs:\n{}",
                    if exited { "it exited" } else { "timed out" },
                    String::from_utf8_lossy(&ls.stderr),
                    String::from_utf8_lossy(&out.stderr),
                    logs_of(&up.dir)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn run(&self, args: &[&str]) -> Output {
        Command::new(EXE)
            .args(args)
            .env("OUTBOARD_CONTROL", &self.control)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Starts `outboard blk write DEVICE --offset OFFSET` with `data` on its standard input;
    /// wait for it with `wait_with_output`.
    pub fn spawn_write(&self, device: &str, offset: u64, data: &[u8]) -> Child {
        let mut c = Command::new(EXE)
            .args(["blk", "write", device, "--offset"])
            .arg(offset.to_string())
            .env("OUTBOARD_CONTROL", &self.control)
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(data).unwrap();
        c
    }

    /// Runs `outboard ARGS` against this machine; a run longer than `limit` is a hang.
    pub fn run_within(&self, args: &[&str], limit: Duration) -> Output {
        run_bounded(
            Command::new(EXE)
                .args(args)
                .env("OUTBOARD_CONTROL", &self.control),
            limit,
        )
    }

    pub fn run_with_input(&self, args: &[&str], input: &[u8]) -> Output {
        let mut c = Command::new(EXE)
            .args(args)
            .env("OUTBOARD_CONTROL", &self.control)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(input).unwrap();
        c.wait_with_output().unwrap()
    }

    pub fn interrupt(&mut self) -> Output {
        let child = self.child.take().unwrap();
        // It may have exited (and been reaped by a `try_wait`) already.
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(&child),
            rustix::process::Signal::INT,
        );
        let mut out = child.wait_with_output().unwrap();
        let mut streams = self.output.drain(..).map(|t| t.join().unwrap_or_default());
        out.stdout = streams.next().unwrap_or_default();
        out.stderr = streams.next().unwrap_or_default();
        out
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.interrupt();
        }
    }
}

/// Every log file in a runtime directory, for a failure message.
pub fn logs_of(dir: &Path) -> String {
    let mut all = String::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().extension().is_some_and(|x| x == "log") {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            all += &format!("--- {}\n{text}\n", e.path().display());
        }
    }
    all
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) {
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().nth(1))
                .and_then(|s| s.parse::<u32>().ok());
            if ppid == Some(pid) {
                out.push(p);
            }
        }
    }
    out
}

/// Waits (on the process's pidfd, not by polling) until `pid` has exited; false on timeout.
pub fn wait_gone(pid: u32, timeout: Duration) -> bool {
    let Some(p) = rustix::process::Pid::from_raw(pid as i32) else {
        return true;
    };
    let Ok(fd) = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) else {
        return true; // already gone (and reaped)
    };
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    let mut pfd = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    matches!(rustix::event::poll(&mut pfd, Some(&ts)), Ok(1))
}

/// The registry as JSON.
pub fn registry(up: &Up) -> serde_json::Value {
    serde_json::from_slice(&up.run(&["ls", "--json"]).stdout).expect("ls --json")
}

/// The driver servers of the machine on `control` (of `device` only, if given), as its
/// registry names them. A server that began as a standby has `driver-standby` on its command
/// line, so the command line does not tell which process serves.
#[allow(dead_code)]
pub fn driver_servers(control: &Path, device: Option<&str>) -> Vec<u32> {
    fn walk(n: &outboard_client::registry::Node, device: Option<&str>, out: &mut Vec<u32>) {
        let serves = |d: &str| n.children.iter().any(|c| c.name == d);
        if n.kind == "driver" && device.is_none_or(serves) {
            if let Some(pid) = n.props.get("pid").and_then(|p| p.as_u64()) {
                if !out.contains(&(pid as u32)) {
                    out.push(pid as u32);
                }
            }
        }
        for c in &n.children {
            walk(c, device, out);
        }
    }
    let mut out = Vec::new();
    if let Ok(tree) = outboard_client::manager::registry(control) {
        walk(&tree, device, &mut out);
    }
    out
}

/// The first node of `kind` in a registry tree.
pub fn find_node<'a>(n: &'a serde_json::Value, kind: &str) -> Option<&'a serde_json::Value> {
    if n["kind"] == kind {
        return Some(n);
    }
    n["children"]
        .as_array()?
        .iter()
        .find_map(|c| find_node(c, kind))
}

/// Runs a command, killing it if it takes longer than `limit` (a hang is a failure, reported
/// as such instead of hanging the test suite).
pub fn run_bounded(cmd: &mut Command, limit: Duration) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    run_bounded_child(child, limit)
}

/// Waits for a child started by the caller, killing it if it takes longer than `limit`.
pub fn run_bounded_child(child: std::process::Child, limit: Duration) -> Output {
    let pid = child.id();
    let killer = std::thread::spawn(move || {
        if !wait_gone(pid, limit) {
            if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            return true;
        }
        false
    });
    let out = child.wait_with_output().expect("wait");
    assert!(!killer.join().unwrap(), "pid {pid} hung for {limit:?}");
    out
}

/// Not every test binary that includes this module waits for a state.
#[allow(unused_imports)]
pub use outboard_sys::wait::eventually;

/// Sends `sig` to `pid` only while it is a child of `parent` (a process the test started and
/// holds): checked through a pidfd, which keeps naming that process even if the pid is
/// recycled, so nothing else is ever signalled. False if it is not (or no longer) such a child.
pub fn signal_child_of(parent: u32, pid: u32, sig: rustix::process::Signal) -> bool {
    let Some(p) = rustix::process::Pid::from_raw(pid as i32) else {
        return false;
    };
    let Ok(fd) = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) else {
        return false;
    };
    // Read after the pidfd pins the process: if the pid was recycled before the open, the
    // new process's parent is not `parent`.
    if !children_of(parent).contains(&pid) {
        return false;
    }
    rustix::process::pidfd_send_signal(&fd, sig).is_ok()
}

/// The children of `parent` whose command line contains `word` (e.g. `export`).
pub fn children_running(parent: u32, word: &str) -> Vec<u32> {
    children_of(parent)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).split('\0').any(|a| a == word))
                .unwrap_or(false)
        })
        .collect()
}

/// Verified clients of `device` on `up`, one thread each, numbered `ids` (each owns its own
/// blocks), running until `stop`.
pub fn verified_clients(
    up: &Up,
    device: &str,
    ids: std::ops::Range<u64>,
    w: outboard_bench::verified::Workload,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<outboard_bench::verified::ClientThread> {
    outboard_bench::verified::spawn_clients(&up.control, device, ids, w, stop).unwrap()
}

/// Verified clients `ids` on `device` at queue depth `depth` over its first `blocks` blocks,
/// flushing every 50 requests, and the flag that stops them.
#[allow(dead_code)]
pub fn under_load(
    up: &Up,
    device: &str,
    ids: std::ops::Range<u64>,
    depth: usize,
    blocks: u64,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    Vec<outboard_bench::verified::ClientThread>,
) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let w = outboard_bench::verified::Workload {
        depth,
        blocks,
        flush_every: 50,
    };
    let clients = verified_clients(up, device, ids, w, &stop);
    (stop, clients)
}

/// Joins verified clients and checks that none failed a request, read inconsistent data or
/// saw a duplicate; returns their reports.
pub fn verified_clean(
    clients: Vec<outboard_bench::verified::ClientThread>,
) -> Vec<outboard_bench::verified::ClientReport> {
    clients
        .into_iter()
        .map(|c| {
            let r = c
                .join()
                .unwrap()
                .unwrap_or_else(|e| panic!("a verified client stopped: {e}"));
            assert!(r.failed.is_empty(), "failed requests: {:?}", r.failed);
            assert!(
                r.mismatches.is_empty(),
                "inconsistent reads: {:?}",
                r.mismatches
            );
            assert_eq!(r.duplicates, 0, "duplicated requests");
            r
        })
        .collect()
}
