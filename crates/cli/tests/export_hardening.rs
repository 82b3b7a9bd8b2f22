//! The NBD export against clients that try to take it down for everyone: one that hangs up on
//! replies it queued, and (under the manager) an export that dies anyway.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::nbd::{request_header, Raw};
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
        let socket = up.dir.join("disk0.nbd");
        let child = Command::new(EXE)
            .args(["export", "nbd", "disk0", "--socket"])
            .arg(&socket)
            .args(extra)
            .env("OUTBOARD_CONTROL", &up.control)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn outboard export");
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

/// Writes a pattern at `offset` through a fresh connection and reads it back byte-exact.
fn round_trip(socket: &std::path::Path, offset: u64, seed: u64) {
    let mut c = Raw::go(socket);
    let data = common::pattern(seed, 65536);
    c.request(1, 1, offset, data.len() as u32, &data);
    assert_eq!(c.reply(0).0, 0, "write");
    c.request(0, 2, offset, data.len() as u32, &[]);
    let (e, cookie, got) = c.reply(data.len());
    assert_eq!((e, cookie), (0, 2), "read");
    assert!(got == data, "read back differs");
}

/// Queues `n` reads of 1 MiB and hangs up without reading a reply: the export's writes then
/// meet a closed socket.
fn hang_up_on_queued_reads(socket: &std::path::Path, n: u64) {
    let mut c = Raw::go(socket);
    c.0.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    for i in 0..n {
        if c.0.write_all(&request_header(0, i, 0, 1 << 20)).is_err() {
            break;
        }
    }
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

/// The `export` node named `name`.
fn export_node(up: &Up, name: &str) -> serde_json::Value {
    fn find(n: &serde_json::Value, name: &str) -> Option<serde_json::Value> {
        if n["kind"] == "export" && n["name"] == format!("nbd:{name}") {
            return Some(n.clone());
        }
        n["children"].as_array()?.iter().find_map(|c| find(c, name))
    }
    find(&common::registry(up), name).unwrap_or(serde_json::Value::Null)
}

#[test]
fn an_export_the_manager_started_is_restarted_when_it_dies_and_its_clients_are_corrected() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some(&format!("{MACHINE}\n[[export]]\ndevice = \"disk0\"\n")),
    );
    let up_pid = up.child.as_ref().unwrap().id();
    let running = || export_node(&up, "disk0")["props"]["state"] == "running";
    assert!(eventually(Duration::from_secs(20), running));
    let node = export_node(&up, "disk0");
    let socket = PathBuf::from(
        node["props"]["uri"]
            .as_str()
            .unwrap()
            .split_once("socket=")
            .unwrap()
            .1,
    );
    let held = Raw::go(&socket);
    assert!(eventually(Duration::from_secs(10), || {
        export_node(&up, "disk0")["props"]["clients"] == 1
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
        let n = export_node(&up, "disk0");
        n["props"]["state"] == "running"
            && n["props"]["clients"] == 0
            && n["props"]["pid"] != serde_json::json!(exports[0])
            && n["props"]["restarts"] == 1
    };
    assert!(
        eventually(Duration::from_secs(20), back),
        "{:#}",
        export_node(&up, "disk0")
    );
    drop(held);
    round_trip(&socket, 0, 3);
}
