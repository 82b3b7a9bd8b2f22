//! Restart with replay (docs/restart.md): the driver server, or the device model under it, is
//! killed at random instants while several clients write, read and flush at queue depth 16;
//! afterwards no request failed, every read was consistent with what had been acknowledged,
//! every acknowledged write is on the disk, and the registry counts the restarts.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{find_node, registry, Up};
use outboard_bench::verified::Workload;
use rustix::process::{Pid, Signal};

const MACHINE: &str = r#"
name = "restart"
[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:16M"
queues = 2
"#;

fn pid_of(up: &Up, kind: &str) -> Option<(i32, String)> {
    let node = find_node(&registry(up), kind)?.clone();
    Some((
        node["props"]["pid"].as_i64()? as i32,
        node["props"]["state"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    ))
}

/// Waits until the driver serves again with a pid other than `old`.
fn wait_serving(up: &Up, old: i32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some((pid, state)) = pid_of(up, "driver") {
            if pid != old && state.starts_with("running") {
                return;
            }
        }
        assert!(Instant::now() < deadline, "the driver did not come back");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn kill_repeatedly(target: &str, kills: usize) {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let (stop, clients) = common::under_load(&up, "disk0", 0..3, 16, 256);
    let mut rng = 0x1234_5678_9abc_def1u64;
    for _ in 0..kills {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(50 + rng % 250));
        let (server, _) = pid_of(&up, "driver").unwrap();
        let (victim, _) = pid_of(&up, target).unwrap();
        rustix::process::kill_process(Pid::from_raw(victim).unwrap(), Signal::KILL).unwrap();
        wait_serving(&up, server);
    }
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let mut completed = 0;
    let mut resumes = 0;
    let mut resent = 0;
    for r in common::verified_clean(clients) {
        completed += r.completed;
        resumes += r.resumes.len();
        resent += r.replayed + r.requeued;
    }
    assert!(completed > 1000, "only {completed} requests completed");
    assert!(resumes >= kills, "{resumes} resumes for {kills} kills");
    let reg = registry(&up);
    // The servers counted every resume and every request sent again (a resume whose new
    // server died before the replay was answered counts there and again at the next).
    let disk = &find_node(&reg, "block-device").unwrap()["props"];
    let counted = |k: &str| disk[k].as_u64().unwrap_or_else(|| panic!("no {k}: {disk}"));
    assert!(
        counted("resumes") >= resumes as u64,
        "{resumes} resumes: {disk}"
    );
    assert!(
        counted("replays") >= resent,
        "{resent} requests sent again: {disk}"
    );
    assert!(
        counted("requests") >= completed,
        "{completed} completed: {disk}"
    );
    let restarts = if target == "driver" {
        find_node(&reg, "driver").unwrap()["props"]["restarts"].as_u64()
    } else {
        find_node(&reg, "pci-function").unwrap()["props"]["restarts"].as_u64()
    };
    assert_eq!(restarts, Some(kills as u64), "{reg:#}");
    // The last restart, step by step, as the manager and the new server stamped it: in order,
    // on one clock, from the death noticed to serving again.
    let stamps: Vec<(String, u64)> = serde_json::from_value(
        find_node(&reg, "driver").unwrap()["props"]["last-restart-stamps"].clone(),
    )
    .unwrap_or_else(|e| panic!("no restart stamps ({e}): {reg:#}"));
    let steps: Vec<&str> = stamps.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(steps.first(), Some(&"down"), "{steps:?}");
    assert_eq!(steps.last(), Some(&"serving"), "{steps:?}");
    if target == "driver" {
        for step in ["respawn", "driver disk0", "listening"] {
            assert!(steps.contains(&step), "{step} missing: {steps:?}");
        }
        // A standby took the place (handed over), or none was ready and a server started.
        assert!(
            steps.contains(&"taken") != steps.contains(&"exec"),
            "{steps:?}"
        );
    }
    assert!(
        stamps.windows(2).all(|w| w[0].1 <= w[1].1),
        "stamps out of order: {stamps:?}"
    );
}

#[test]
fn killing_the_driver_server_at_random_loses_and_fails_nothing() {
    kill_repeatedly("driver", 12);
}

#[test]
fn killing_the_device_model_at_random_loses_and_fails_nothing() {
    kill_repeatedly("pci-function", 6);
}

fn standby_of(up: &Up) -> Option<u32> {
    let reg = registry(up);
    find_node(&reg, "driver")?["props"]["standby-pid"]
        .as_u64()
        .map(|p| p as u32)
}

/// The standby, once there is one (within 10 s).
fn wait_standby(up: &Up) -> Option<u32> {
    let mut standby = None;
    common::eventually(Duration::from_secs(10), || {
        standby = standby_of(up);
        standby.is_some()
    });
    standby
}

/// What a restart's steps were, by name.
fn last_restart_steps(up: &Up) -> Vec<String> {
    let reg = registry(up);
    let stamps: Vec<(String, u64)> = serde_json::from_value(
        find_node(&reg, "driver").unwrap()["props"]["last-restart-stamps"].clone(),
    )
    .unwrap_or_else(|e| panic!("no restart stamps ({e}): {reg:#}"));
    stamps.into_iter().map(|(s, _)| s).collect()
}

/// The manager keeps a standby driver server (started, confined, waiting): at the server's
/// death the standby takes its place — the same process serves next, with no exec on the
/// restart's path — the clients lose nothing, and a new standby waits for the next death.
#[test]
fn a_standby_takes_the_place_of_a_killed_driver_server() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let manager = up.child.as_ref().unwrap().id();
    let (stop, clients) = common::under_load(&up, "disk0", 0..2, 16, 256);
    for round in 0..3 {
        let standby = wait_standby(&up)
            .unwrap_or_else(|| panic!("no standby in round {round}: {:#}", registry(&up)));
        let (server, _) = pid_of(&up, "driver").unwrap();
        // One standby waiting, the one the registry names (a server that was a standby
        // still has `driver-standby` on its command line).
        let waiting: Vec<u32> = common::children_running(manager, "driver-standby")
            .into_iter()
            .filter(|&p| p != server as u32)
            .collect();
        assert_eq!(waiting, vec![standby], "round {round}");
        // It waits confined already (seccomp filter mode, no_new_privs), so that confining
        // is not on the restart's path.
        let status = || std::fs::read_to_string(format!("/proc/{standby}/status")).unwrap();
        assert!(
            common::eventually(Duration::from_secs(5), || {
                let s = status();
                s.contains("Seccomp:\t2") && s.contains("NoNewPrivs:\t1")
            }),
            "round {round}: the standby waits unconfined:\n{}",
            status()
        );
        std::thread::sleep(Duration::from_millis(100));
        assert!(common::signal_child_of(
            manager,
            server as u32,
            Signal::KILL
        ));
        wait_serving(&up, server);
        let (now, _) = pid_of(&up, "driver").unwrap();
        assert_eq!(now as u32, standby, "the standby took the place");
        // Its confinement finished: the early filter and the one that took threads away.
        let status = std::fs::read_to_string(format!("/proc/{now}/status")).unwrap();
        assert!(status.contains("Seccomp_filters:\t2"), "{status}");
        let steps = last_restart_steps(&up);
        assert!(steps.contains(&"taken".to_string()), "{steps:?}");
        assert!(!steps.contains(&"exec".to_string()), "{steps:?}");
    }
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let reports = common::verified_clean(clients);
    assert!(reports.iter().map(|r| r.completed).sum::<u64>() > 500);
    let last = wait_standby(&up).expect("a standby after the last restart");
    drop(up);
    assert!(
        common::wait_gone(last, Duration::from_secs(10)),
        "the standby outlived the machine"
    );
}

/// SIGKILLs the driver server of `up` (a child of `manager`) and waits until another serves;
/// returns the pid that serves now.
fn kill_server(up: &Up, manager: u32) -> u32 {
    let (server, _) = pid_of(up, "driver").unwrap();
    assert!(common::signal_child_of(
        manager,
        server as u32,
        Signal::KILL
    ));
    wait_serving(up, server);
    pid_of(up, "driver").unwrap().0 as u32
}

/// With the smallest descriptor limit a machine description allows, a standby confined
/// early still takes the place: it moved its hand-over socket (to 64) before it lowered its
/// limit (it died at its start, and every restart went the slow way).
#[test]
fn a_standby_under_a_small_descriptor_limit_takes_the_place() {
    let dir = tempfile::tempdir().unwrap();
    let machine = format!("{MACHINE}max_files = 32\n");
    let up = Up::start(dir.path(), Some(&machine));
    let manager = up.child.as_ref().unwrap().id();
    let standby = wait_standby(&up).expect("a standby");
    // Still there a moment later: it did not die at its start.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(standby_of(&up), Some(standby), "{:#}", registry(&up));
    assert_eq!(kill_server(&up, manager), standby);
}

/// A standby that dies while it waits (killed here) is noticed and replaced, and the new one
/// takes the server's place at its death.
#[test]
fn a_standby_that_dies_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let manager = up.child.as_ref().unwrap().id();
    let first = wait_standby(&up).expect("a standby");
    assert!(common::signal_child_of(manager, first, Signal::KILL));
    let mut second = None;
    assert!(
        common::eventually(Duration::from_secs(10), || {
            second = standby_of(&up).filter(|&p| p != first);
            second.is_some()
        }),
        "no new standby: {:#}",
        registry(&up)
    );
    let second = second.unwrap();
    assert!(
        common::wait_gone(first, Duration::from_secs(5)),
        "the dead standby was reaped"
    );
    assert_eq!(kill_server(&up, manager), second);
}

/// `standby = false`: no standby waits, and a restart starts a server afresh.
#[test]
fn without_a_standby_a_restart_starts_a_server() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(&format!("{MACHINE}standby = false\n")));
    let manager = up.child.as_ref().unwrap().id();
    let (server, _) = pid_of(&up, "driver").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(standby_of(&up), None, "{:#}", registry(&up));
    assert!(common::children_running(manager, "driver-standby").is_empty());
    assert!(common::signal_child_of(
        manager,
        server as u32,
        Signal::KILL
    ));
    wait_serving(&up, server);
    let steps = last_restart_steps(&up);
    assert!(steps.contains(&"exec".to_string()), "{steps:?}");
    assert_eq!(standby_of(&up), None);
}

/// A server that stops (SIGSTOP: its loop never turns) is found by its heartbeat, killed and
/// restarted within the bound (heartbeat + the manager's 50 ms check + start-up), and the
/// clients it held see no error.
#[test]
fn a_hung_driver_server_is_restarted_within_its_heartbeat() {
    let dir = tempfile::tempdir().unwrap();
    let machine = format!("{MACHINE}heartbeat = \"300ms\"\n");
    let up = Up::start(dir.path(), Some(&machine));
    let stop = Arc::new(AtomicBool::new(false));
    let w = Workload {
        depth: 16,
        blocks: 64,
        flush_every: 20,
    };
    let client = common::verified_clients(&up, "disk0", 0..1, w, &stop);
    std::thread::sleep(Duration::from_millis(200));
    let (server, _) = pid_of(&up, "driver").unwrap();
    let hung = Instant::now();
    rustix::process::kill_process(Pid::from_raw(server).unwrap(), Signal::STOP).unwrap();
    wait_serving(&up, server);
    let took = hung.elapsed();
    assert!(
        took < Duration::from_millis(300 + 50 + 2000),
        "restarted {took:?} after it hung"
    );
    assert!(
        took >= Duration::from_millis(300),
        "restarted before the heartbeat ran out"
    );
    let reg = registry(&up);
    let driver = find_node(&reg, "driver").unwrap();
    assert!(driver["props"]["last-hang"].is_string(), "{reg:#}");
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let r = common::verified_clean(client);
    assert_eq!(r[0].resumes.len(), 1);
}
