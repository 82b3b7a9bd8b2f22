//! Hot-plug: devices attached and detached while the machine runs. A detach stops new
//! requests ("device gone"), lets those in flight complete, and releases the device's
//! processes and the manager's descriptors for it; other devices' clients see nothing.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{registry, stdout, Up};
use outboard_block::BlockError;

const MACHINE: &str = r#"
name = "hotplug"
[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:4M"
[[device]]
name = "disk1"
model = "virtio-blk"
backing = "mem:4M"
attached = false
fault_injection = true
"#;

fn node_state(up: &Up, kind: &str, name: &str) -> Option<String> {
    fn find<'a>(n: &'a serde_json::Value, kind: &str, name: &str) -> Option<&'a serde_json::Value> {
        if n["kind"] == kind && n["name"] == name {
            return Some(n);
        }
        n["children"]
            .as_array()?
            .iter()
            .find_map(|c| find(c, kind, name))
    }
    let tree = registry(up);
    find(&tree, kind, name).map(|n| n["props"]["state"].as_str().unwrap_or("").to_string())
}

/// One request as a client saw it.
struct Done {
    submitted: Instant,
    result: Result<(), BlockError>,
}

fn client(control: PathBuf, name: &str, id: u64, stop: Arc<AtomicBool>) -> (Vec<Done>, u64) {
    let mut dev = outboard_block_client::open_block(&control, name).expect("open");
    let mut done = Vec::new();
    let mut wrong = 0;
    let lba = id * 64;
    let mut version = 0u64;
    let mut buf = vec![0u8; 4096];
    while !stop.load(Ordering::Relaxed) {
        version += 1;
        let data = common::pattern(id << 32 | version, 4096);
        let submitted = Instant::now();
        let result = dev.write_blocks(lba, &data);
        let ok = result.is_ok();
        done.push(Done { submitted, result });
        if !ok {
            continue;
        }
        let submitted = Instant::now();
        let result = dev.read_blocks(lba, &mut buf);
        if result.is_ok() && buf != data {
            wrong += 1;
        }
        done.push(Done { submitted, result });
    }
    (done, wrong)
}

/// Descriptors the manager holds, and memfd mappings in it.
fn manager_resources(up: &Up) -> (usize, usize) {
    let pid = up.child.as_ref().unwrap().id();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    (fds, maps.lines().filter(|l| l.contains("memfd:")).count())
}

fn pids_of(up: &Up, device: &str) -> Vec<i32> {
    let text = stdout(&up.run(&["ls"]));
    text.lines()
        .filter(|l| {
            l.contains(&format!("{device}@vfio-user"))
                || l.contains(&format!("server={device}-server"))
        })
        .filter_map(|l| l.split("pid=").nth(1))
        .filter_map(|p| p.split([',', '>']).next()?.parse().ok())
        .collect()
}

#[test]
fn attach_then_detach_under_load_fails_only_new_requests_and_leaks_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    assert_eq!(
        node_state(&up, "pci-function", "disk1@vfio-user").as_deref(),
        Some("detached")
    );
    let r = up.run(&["blk", "info", "disk1"]);
    assert!(!r.status.success());
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("gone"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    // Once the `blk info` connection above is closed on the manager's side too.
    let mut before = manager_resources(&up);
    let settle = Instant::now() + Duration::from_secs(3);
    while Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(100));
        let again = manager_resources(&up);
        if again == before {
            break;
        }
        before = again;
    }

    // Attach: the catalog matches, the driver starts, the class device appears.
    let a = up.run(&["attach", "disk1"]);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert!(stdout(&a).contains("block-device disk1"), "{}", stdout(&a));
    assert_eq!(
        node_state(&up, "block-device", "disk1").as_deref(),
        Some("serving")
    );
    let pids = pids_of(&up, "disk1");
    assert_eq!(pids.len(), 2, "a model and a driver server: {pids:?}");

    // Clients on both disks; disk1's requests are made to linger in the device, then it is
    // detached under them.
    let stop = Arc::new(AtomicBool::new(false));
    let spawn = |name: &'static str, id: u64| {
        let (c, s) = (up.control.clone(), stop.clone());
        std::thread::spawn(move || client(c, name, id, s))
    };
    let victims: Vec<_> = (0..4).map(|i| spawn("disk1", i)).collect();
    let bystander = spawn("disk0", 9);
    std::thread::sleep(Duration::from_millis(300));
    let f = up.run(&["fault", "disk1", "stall=600ms"]);
    assert!(f.status.success(), "{}", String::from_utf8_lossy(&f.stderr));
    std::thread::sleep(Duration::from_millis(100));
    let detach_started = Instant::now();
    let d = up.run_within(&["detach", "disk1"], Duration::from_secs(20));
    let detach_took = detach_started.elapsed();
    assert!(d.status.success(), "{}", String::from_utf8_lossy(&d.stderr));
    assert_eq!(stdout(&d).trim(), "disk1: detached");
    // Phase two waited for the stalled requests.
    assert!(detach_took >= Duration::from_millis(300), "{detach_took:?}");
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);

    let in_flight_cutoff = detach_started - Duration::from_millis(20);
    let mut completed_in_flight = 0;
    for v in victims {
        let (done, wrong) = v.join().unwrap();
        assert_eq!(wrong, 0, "a read returned wrong data");
        let first_gone = done
            .iter()
            .position(|d| d.result.is_err())
            .expect("requests after the detach fail");
        for d in &done[first_gone..] {
            assert!(
                matches!(d.result, Err(BlockError::DeviceGone)),
                "after the detach: {:?}",
                d.result
            );
        }
        for d in &done {
            if d.submitted < in_flight_cutoff {
                assert!(
                    d.result.is_ok(),
                    "a request in flight failed: {:?}",
                    d.result
                );
                completed_in_flight += 1;
            }
        }
        assert!(first_gone > 0, "the client did I/O before the detach");
    }
    assert!(completed_in_flight > 0);
    let (done, wrong) = bystander.join().unwrap();
    assert_eq!(wrong, 0);
    assert!(
        done.iter().all(|d| d.result.is_ok()),
        "the other disk's client suffered"
    );

    // Released: its processes are gone, the manager holds what it held before the attach.
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} of the detached device still exists"
        );
    }
    // (A control connection of an `ls` that just ended may not be closed yet: a leak stays.)
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut now = manager_resources(&up);
    while now != before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        now = manager_resources(&up);
    }
    assert_eq!(now, before, "(fds, memfd mappings) of the manager");
    assert_eq!(
        node_state(&up, "pci-function", "disk1@vfio-user").as_deref(),
        Some("detached")
    );
    assert!(!up.dir.join("disk1.vfio-user.sock").exists());
    let r = up.run(&["blk", "read", "disk1", "--offset", "0", "--length", "512"]);
    assert!(String::from_utf8_lossy(&r.stderr).contains("gone"));

    // And it comes back.
    let a = up.run(&["attach", "disk1"]);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let r = up.run(&["blk", "info", "disk1"]);
    assert!(r.status.success());
}

#[test]
fn new_devices_are_attached_from_a_description_and_bad_ones_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let file = dir.path().join("new.toml");
    std::fs::write(
        &file,
        "[[device]]\nname = \"disk2\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\n",
    )
    .unwrap();
    let a = up.run(&["attach", "--file", file.to_str().unwrap()]);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let data = common::pattern(3, 4096);
    let w = up.run_with_input(&["blk", "write", "disk2", "--offset", "0"], &data);
    assert!(w.status.success());
    let r = up.run(&["blk", "read", "disk2", "--offset", "0", "--length", "4096"]);
    assert_eq!(r.stdout, data);

    let refused = |args: &[&str], says: &str| {
        let o = up.run(args);
        assert!(!o.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    };
    // The same name again, a bad description, an unknown name, attached twice.
    refused(
        &["attach", "--file", file.to_str().unwrap()],
        "exists already",
    );
    std::fs::write(&file, "[[device]]\nname = \"disk3\"\nmodel = \"floppy\"\n").unwrap();
    refused(&["attach", "--file", file.to_str().unwrap()], "<attach>:");
    refused(&["attach", "nosuch"], "no device named \"nosuch\"");
    refused(&["attach", "disk0"], "attached already");
    refused(&["detach", "nosuch"], "no device named \"nosuch\"");
    // Nothing half-attached was left behind.
    assert!(node_state(&up, "block-device", "disk3").is_none());
    assert_eq!(
        node_state(&up, "block-device", "disk0").as_deref(),
        Some("serving")
    );
}

const SHARED: &str = r#"
name = "shared"
[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:4M"
server = "both"
[[device]]
name = "disk1"
model = "virtio-blk"
backing = "mem:4M"
server = "both"
"#;

/// A device whose driver server also serves another one: detaching it restarts the server
/// without it, and the other device's clients see only a delay (they resume and replay).
#[test]
fn detaching_one_device_of_a_shared_server_leaves_the_other_serving_without_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(SHARED));
    let stop = Arc::new(AtomicBool::new(false));
    let spawn = |name: &'static str, id: u64| {
        let (c, s) = (up.control.clone(), stop.clone());
        std::thread::spawn(move || client(c, name, id, s))
    };
    let stays = spawn("disk0", 1);
    let goes = spawn("disk1", 2);
    std::thread::sleep(Duration::from_millis(300));
    let d = up.run_within(&["detach", "disk1"], Duration::from_secs(20));
    assert!(d.status.success(), "{}", String::from_utf8_lossy(&d.stderr));
    // The other device is served again by the restarted server.
    let deadline = Instant::now() + Duration::from_secs(20);
    while node_state(&up, "block-device", "disk0").as_deref() != Some("serving") {
        assert!(Instant::now() < deadline, "disk0 is not served again");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let (done, wrong) = stays.join().unwrap();
    assert_eq!(wrong, 0);
    let failed: Vec<_> = done.iter().filter(|d| d.result.is_err()).collect();
    assert!(
        failed.is_empty(),
        "disk0's client saw {} errors, e.g. {:?}",
        failed.len(),
        failed[0].result
    );
    let (done, wrong) = goes.join().unwrap();
    assert_eq!(wrong, 0);
    let first_gone = done.iter().position(|d| d.result.is_err()).unwrap();
    assert!(first_gone > 0);
    for d in &done[first_gone..] {
        assert!(
            matches!(d.result, Err(BlockError::DeviceGone)),
            "after the detach: {:?}",
            d.result
        );
    }
    assert_eq!(
        node_state(&up, "pci-function", "disk1@vfio-user").as_deref(),
        Some("detached")
    );
    // The restarted server serves disk0 alone; disk1 cannot go back into it while it runs.
    let r = up.run(&["blk", "info", "disk0"]);
    assert!(r.status.success());
    let a = up.run(&["attach", "disk1"]);
    assert!(!a.status.success());
    assert!(String::from_utf8_lossy(&a.stderr).contains("runs for other devices"));
}
