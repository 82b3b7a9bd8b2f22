//! The entropy class under the manager, as a user meets it: virtio-rng devices separate,
//! grouped with a disk in one driver server, and colocated; their registry entries; the bytes
//! a seeded model gives, checked against its generator; a driver server killed under a
//! reader; a client asking a device of the other class.

mod common;

use std::time::Duration;

use common::{stdout, Up};
use outboard_devices::virtio_rng::Seeded;
use rustix::process::Signal;

const MACHINE: &str = r#"
name = "entropy"

[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:1M"
server = "shared"

[[device]]
name = "rng0"
model = "virtio-rng"
seed = 7
server = "shared"

[[device]]
name = "rng1"
model = "virtio-rng"
placement = "colocated"

[[device]]
name = "rng2"
model = "virtio-rng"
"#;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn read(up: &Up, device: &str, n: usize) -> String {
    let n = n.to_string();
    let o = up.run_within(
        &["rng", "read", device, "--length", &n, "--hex"],
        Duration::from_secs(30),
    );
    assert!(
        o.status.success(),
        "rng read {device}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout(&o).trim().to_string()
}

#[test]
fn entropy_devices_serve_separate_grouped_and_colocated() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));

    // The seeded model gives exactly its generator's stream, read by the unchanged driver
    // through a session: the first 48 bytes, then the next 48.
    let mut expected = [0u8; 96];
    Seeded::new(7).fill(&mut expected);
    assert_eq!(read(&up, "rng0", 48), hex(&expected[..48]));
    assert_eq!(read(&up, "rng0", 48), hex(&expected[48..]));

    // The colocated and the separate getrandom-backed devices give random bytes: the right
    // amount, two reads that differ.
    for d in ["rng1", "rng2"] {
        let (a, b) = (read(&up, d, 32), read(&up, d, 32));
        assert_eq!(a.len(), 64, "{d}: {a}");
        assert_ne!(a, b, "{d}: two reads gave the same bytes");
    }
    // More than one request's worth in one command.
    let o = up.run_within(
        &["rng", "read", "rng2", "--length", "300000"],
        Duration::from_secs(30),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout.len(), 300000);

    // The registry shows each with its own class and properties, beside the disk it shares
    // a server with.
    let tree = common::registry(&up);
    let text = tree.to_string();
    for name in ["rng0", "rng1", "rng2"] {
        assert!(
            text.contains(&format!("\"kind\":\"entropy-device\",\"name\":\"{name}\"")),
            "{name} in {text}"
        );
    }
    let rng0 = find(&tree, "entropy-device", "rng0").expect("rng0");
    assert_eq!(rng0["props"]["class"], "entropy");
    assert_eq!(rng0["props"]["max-read"], 65536);
    assert_eq!(rng0["props"]["state"], "serving");
    let disk0 = find(&tree, "block-device", "disk0").expect("disk0");
    assert_eq!(disk0["props"]["class"], "block");

    // A client of the other class is refused, saying which class the device is.
    let o = up.run(&["blk", "read", "rng0", "--length", "8"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("entropy"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = up.run(&["rng", "read", "disk0", "--length", "8"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("block"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // A program can tell it apart from a malformed request: the refusal's code comes along.
    match outboard_block_client::open_block(&up.control, "rng0") {
        Err(outboard_block::BlockError::Refused { code, reason }) => {
            assert_eq!(code, outboard_session::Code::WrongClass);
            assert!(reason.contains("entropy"), "{reason}");
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
}

#[test]
fn a_killed_entropy_driver_server_is_restarted_and_its_clients_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    assert_eq!(read(&up, "rng2", 16).len(), 32);
    let up_pid = up.child.as_ref().unwrap().id();
    let servers: Vec<u32> = common::children_running(up_pid, "driver-host")
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains("rng2="))
                .unwrap_or(false)
        })
        .collect();
    assert_eq!(servers.len(), 1, "rng2's driver server");
    // A reader whose request is in the session's ring when the server dies: the server is
    // stopped first, so the request waits there, then killed. The reader waits for the next
    // server and asks again (its class's policy), and gets its bytes.
    assert!(common::signal_child_of(up_pid, servers[0], Signal::STOP));
    let mut reader = std::process::Command::new(env!("CARGO_BIN_EXE_outboard"));
    reader
        .args(["rng", "read", "rng2", "--length", "64", "--hex"])
        .env("OUTBOARD_CONTROL", dir.path().join("rt/control.sock"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut reader = reader.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        reader.try_wait().unwrap().is_none(),
        "the reader finished while its server was stopped"
    );
    assert!(common::signal_child_of(up_pid, servers[0], Signal::KILL));
    let out = common::run_bounded_child(reader, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim().len(), 128);
    // And a new client gets bytes from the restarted server.
    assert_eq!(read(&up, "rng2", 16).len(), 32);
    let tree = common::registry(&up);
    let rng2 = find(&tree, "entropy-device", "rng2").unwrap();
    assert_eq!(rng2["props"]["state"], "serving");
    let pci = find(&tree, "pci-function", "rng2@vfio-user").expect("rng2's function");
    let restarts = pci["children"][0]["props"]["restarts"].as_u64();
    assert!(restarts >= Some(1), "{pci}");
}

fn find<'a>(n: &'a serde_json::Value, kind: &str, name: &str) -> Option<&'a serde_json::Value> {
    if n["kind"] == kind && n["name"] == name {
        return Some(n);
    }
    n["children"]
        .as_array()?
        .iter()
        .find_map(|c| find(c, kind, name))
}

/// `outboard up` on `machine`, which must fail: what it printed on stderr.
fn refused_at_up(machine: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("machine.toml");
    std::fs::write(&path, machine).unwrap();
    let out = common::run_bounded(
        std::process::Command::new(common::EXE)
            .arg("up")
            .arg("--machine")
            .arg(&path)
            .env("OUTBOARD_CONTROL", dir.path().join("rt/control.sock"))
            .stdin(std::process::Stdio::null()),
        Duration::from_secs(30),
    );
    assert!(!out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn an_nbd_export_of_an_entropy_device_is_refused_at_up() {
    let err = refused_at_up(
        "name = \"m\"\n[[device]]\nname = \"rng0\"\nmodel = \"virtio-rng\"\n\n\
         [[export]]\ndevice = \"rng0\"\n",
    );
    assert!(
        err.contains("entropy class") && err.contains("serves block devices"),
        "{err}"
    );
}

/// A driver fault its driver cannot inject is refused, not ignored (a test relying on it
/// would pass without it).
#[test]
fn a_driver_fault_the_entropy_driver_cannot_inject_is_refused_at_up() {
    let err = refused_at_up(
        "name = \"m\"\n[[device]]\nname = \"rng0\"\nmodel = \"virtio-rng\"\n\
         driver_abort_on = 8\n",
    );
    assert!(
        err.contains("rng0") && err.contains("the virtio-rng driver cannot abort on a sector"),
        "{err}"
    );
}

#[test]
fn an_entropy_model_refuses_the_faults_of_a_disk_and_takes_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some("name = \"m\"\n[[device]]\nname = \"rng0\"\nmodel = \"virtio-rng\"\nfault_injection = true\n"),
    );
    // It has no disk requests: armed, this would never fire ("armed" and no effect, before).
    let o = up.run(&["fault", "rng0", "error-next=1"]);
    assert!(!o.status.success(), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no disk requests"), "{err}");
    // A transport fault is its own, and it recovers from it.
    let o = up.run(&["fault", "rng0", "needs-reset"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(read(&up, "rng0", 16).len(), 32);
}
