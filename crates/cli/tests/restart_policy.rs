//! The restart policy: a driver that serves between deaths is never given up, whatever the
//! kill rate; a device that is given up says why, fails its clients at once, keeps its bytes,
//! and comes back by hand (`outboard restart`) or on its own after a while.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{eventually, find_node, Up};
use rustix::process::Signal;

/// The default policy: no restart limits in the description.
const MACHINE: &str = r#"
name = "policy"
[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:16M"
"#;

/// Kills the driver servers `up` started, `kills` times, `every` apart; returns the kills
/// that found a server to kill.
fn kill_servers(up: &Up, kills: usize, every: Duration) -> usize {
    let up_pid = up.child.as_ref().unwrap().id();
    let mut done = 0;
    for _ in 0..kills {
        for pid in common::driver_servers(&up.control, None) {
            if common::signal_child_of(up_pid, pid, Signal::KILL) {
                done += 1;
            }
        }
        std::thread::sleep(every);
    }
    done
}

fn driver(up: &Up) -> serde_json::Value {
    let ls = up.run(&["ls", "--json"]);
    let Ok(tree) = serde_json::from_slice::<serde_json::Value>(&ls.stdout) else {
        let pid = up.child.as_ref().unwrap().id();
        let mut stacks = String::new();
        for t in std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
        {
            let p = t.path();
            stacks += &format!(
                "{:?}: {}\n{}\n",
                p.file_name().unwrap(),
                std::fs::read_to_string(p.join("wchan")).unwrap_or_default(),
                std::fs::read_to_string(p.join("stack")).unwrap_or_default()
            );
        }
        panic!(
            "ls --json failed: {}\nmanager threads:\n{stacks}",
            String::from_utf8_lossy(&ls.stderr),
        );
    };
    find_node(&tree, "driver").cloned().unwrap_or_default()
}

/// Checks that no client replayed a request (a planned hand-over: what was in the device
/// finished before the server ended; what waited in its ring went to the next one for the
/// first time); returns how many requests went on that way, and the longest pause a client
/// saw (its server gone → its session resumed).
fn nothing_replayed(reports: &[outboard_bench::verified::ClientReport]) -> (u64, Duration) {
    let replayed: u64 = reports.iter().map(|r| r.replayed).sum();
    let requeued: u64 = reports.iter().map(|r| r.requeued).sum();
    assert_eq!(replayed, 0, "{requeued} requeued");
    let longest = reports
        .iter()
        .flat_map(|r| r.resumes.iter().map(|(gone, back)| *back - *gone))
        .max()
        .unwrap_or_default();
    (requeued, longest)
}

fn state(n: &serde_json::Value) -> String {
    n["props"]["state"].as_str().unwrap_or_default().to_string()
}

/// Waits (at most 30 s) for disk0's driver to run again; `when` says when, if it does not.
fn wait_running(up: &Up, when: &str) {
    assert!(
        eventually(Duration::from_secs(30), || state(&driver(up))
            .starts_with("running")),
        "{when}: {:#}",
        driver(up)
    );
}

#[test]
fn a_driver_killed_every_10ms_under_verified_load_loses_and_fails_nothing_with_the_default_policy()
{
    let dir = tempfile::tempdir().unwrap();
    // The embedded default machine, as `outboard up` starts it.
    let up = Up::start(dir.path(), None);
    let (stop, clients) = common::under_load(&up, "disk0", 0..3, 16, 256);
    std::thread::sleep(Duration::from_millis(200));
    // A thousand kill attempts 10 ms apart (those that find a server between restarts).
    let kills = kill_servers(&up, 1000, Duration::from_millis(10));
    assert!(kills >= 300, "only {kills} kills landed");
    // It serves again afterwards.
    wait_running(&up, "after the kills");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let completed: u64 = common::verified_clean(clients)
        .iter()
        .map(|r| r.completed)
        .sum();
    assert!(completed > 500, "only {completed} requests completed");
    let d = driver(&up);
    assert!(!state(&d).contains("gave up"), "{d:#}");
    assert!(d["props"]["restarts"].as_u64().unwrap() >= 300, "{d:#}");
}

#[test]
fn a_given_up_device_says_why_fails_clients_at_once_keeps_its_bytes_and_comes_back_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    // restarts = 0: the first death gives it up (and no slow retry within the test).
    let up = Up::start(
        dir.path(),
        Some(&format!(
            "{MACHINE}restarts = 0\nretry_after_give_up = \"10m\"\n"
        )),
    );
    let data = common::pattern(21, 65536);
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "1M"], &data);
    assert!(w.status.success(), "{w:?}");
    let old = driver(&up)["props"]["pid"].as_u64().unwrap();
    assert_eq!(kill_servers(&up, 1, Duration::ZERO), 1);
    assert!(
        eventually(Duration::from_secs(10), || state(&driver(&up))
            .starts_with("gave up")),
        "{:#}",
        driver(&up)
    );
    let d = driver(&up);
    // The reason, the last exit, and no dead pid shown as current.
    assert!(
        state(&d).contains("restarts = 0") && state(&d).contains("outboard restart"),
        "{d:#}"
    );
    assert!(
        d["props"]["last-exit"]
            .as_str()
            .unwrap()
            .contains(&old.to_string()),
        "{d:#}"
    );
    assert!(d["props"].get("pid").is_none(), "{d:#}");
    // A client fails at once, with the reason.
    let t = Instant::now();
    let r = up.run(&["blk", "read", "disk0", "--length", "512"]);
    assert!(!r.status.success());
    let e = String::from_utf8_lossy(&r.stderr);
    assert!(e.contains("gave up"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // power does not wait 30 s to blame requests in flight.
    let t = Instant::now();
    let p = up.run(&["power", "disk0", "resume"]);
    assert!(!p.status.success());
    assert!(
        String::from_utf8_lossy(&p.stderr).contains("gave up"),
        "{p:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // Nor is a suspension recorded for later: the restart below would bring it back
    // suspended, and wait for it.
    let p = up.run(&["power", "disk0", "suspend"]);
    assert!(!p.status.success());
    let e = String::from_utf8_lossy(&p.stderr);
    assert!(
        e.contains("given up") && e.contains("outboard restart"),
        "{e}"
    );
    // Back by hand, with the bytes.
    let r = up.run_within(&["restart", "disk0"], Duration::from_secs(40));
    assert!(r.status.success(), "{r:?}");
    let r = up.run(&[
        "blk", "read", "disk0", "--offset", "1M", "--length", "65536",
    ]);
    assert!(r.status.success() && r.stdout == data, "{r:?}");
    let d = driver(&up);
    assert!(
        d["props"]["pid"].as_u64().is_some_and(|p| p != old),
        "{d:#}"
    );
}

#[test]
fn a_given_up_device_is_tried_again_on_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some(&format!(
            "{MACHINE}restarts = 0\nretry_after_give_up = \"1s\"\n"
        )),
    );
    assert_eq!(kill_servers(&up, 1, Duration::ZERO), 1);
    assert!(eventually(Duration::from_secs(10), || state(&driver(&up))
        .starts_with("gave up")));
    assert!(
        state(&driver(&up)).contains("trying again in 1s"),
        "{:#}",
        driver(&up)
    );
    wait_running(&up, "after the retry");
    let r = up.run(&["blk", "read", "disk0", "--length", "512"]);
    assert!(r.status.success(), "{r:?}");
}

#[test]
fn a_running_device_restarts_by_hand_and_its_clients_carry_on() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let (stop, client) = common::under_load(&up, "disk0", 1..2, 16, 128);
    std::thread::sleep(Duration::from_millis(200));
    let old = driver(&up)["props"]["pid"].as_u64().unwrap();
    for _ in 0..3 {
        let r = up.run_within(&["restart", "disk0"], Duration::from_secs(40));
        assert!(r.status.success(), "{r:?}");
    }
    stop.store(true, Ordering::Relaxed);
    common::verified_clean(client);
    let d = driver(&up);
    assert!(
        d["props"]["pid"].as_u64().is_some_and(|p| p != old),
        "{d:#}"
    );
}

/// `outboard restart --graceful` under load: the driver drains, a new server takes the
/// clients, and none sees an error; `--exe` runs the new server from another program (a live
/// upgrade), which must be one only its owner may change.
#[test]
fn a_graceful_restart_under_load_fails_nothing_and_can_change_the_program() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let (stop, clients) = common::under_load(&up, "disk0", 1..4, 16, 128);
    std::thread::sleep(Duration::from_millis(200));
    let pid = || driver(&up)["props"]["pid"].as_u64().unwrap();
    let mut old = pid();
    for _ in 0..3 {
        let r = up.run_within(&["restart", "disk0", "--graceful"], Duration::from_secs(40));
        assert!(r.status.success(), "{r:?}");
        let said = String::from_utf8_lossy(&r.stdout);
        assert!(said.contains("disk0: serving again after"), "{said}");
        println!("{}", said.trim());
        let now = pid();
        assert_ne!(now, old, "the server was not replaced");
        old = now;
        std::thread::sleep(Duration::from_millis(100));
    }
    // A new program: a copy of this one, only its owner may write it.
    let copy = dir.path().join("outboard-next");
    std::fs::copy(common::EXE, &copy).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = copy.to_str().unwrap();
    let r = up.run_within(
        &["restart", "disk0", "--graceful", "--exe", exe],
        Duration::from_secs(40),
    );
    assert!(r.status.success(), "{r:?}");
    let runs = std::fs::read_link(format!("/proc/{}/exe", pid())).unwrap();
    assert_eq!(runs, copy, "the new server runs the new program");
    // Refused, with the reason: a program others may change, a relative path.
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o757)).unwrap();
    let r = up.run(&["restart", "disk0", "--exe", exe]);
    assert!(!r.status.success());
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("others may change it"),
        "{r:?}"
    );
    let r = up.run(&["restart", "disk0", "--exe", "outboard-next"]);
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("absolute path"),
        "{r:?}"
    );
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let reports = common::verified_clean(clients);
    let completed: u64 = reports.iter().map(|r| r.completed).sum();
    assert!(completed > 1000, "the clients ran: {completed} requests");
    // Nothing was replayed: what was in the device finished before the server ended; what
    // waited in its ring went to the new server for the first time.
    let (requeued, longest) = nothing_replayed(&reports);
    println!(
        "graceful restarts: {completed} requests, 0 replayed, {requeued} sent on from the old \
         server's ring, longest resume {longest:?}"
    );
}

/// A request that kills whatever it reaches — the model (`faults`) or the driver itself
/// (`driver_abort_on`) — at sector 8192 (byte 4 MiB), every time: it fails alone after three
/// crashes that name it (isolated servers), a bystander at queue depth 16 sees no error, and
/// the device serves on.
fn poisoned_request_fails_alone(fault: &str) {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(&format!("{MACHINE}{fault}\n")));
    // Several clients at depth 16: each restart, they resume and replay at once, racing the
    // new server's report that it serves (with its heartbeat page, which names the request in
    // the device when it dies).
    let (stop, bystanders) = common::under_load(&up, "disk0", 1..5, 16, 64);
    let restarts = || driver(&up)["props"]["restarts"].as_u64().unwrap_or(0);
    for round in 0..2 {
        wait_running(&up, &format!("{fault}: round {round}"));
        std::thread::sleep(Duration::from_millis(200));
        let before = restarts();
        let t = Instant::now();
        let r = up.run_within(
            &["blk", "read", "disk0", "--offset", "4M", "--length", "4096"],
            Duration::from_secs(60),
        );
        let took = t.elapsed();
        assert!(!r.status.success(), "{fault}: the poisoned read succeeded");
        let e = String::from_utf8_lossy(&r.stderr);
        assert!(e.contains("crashed the driver 3 times"), "{fault}: {e}");
        // Four crashes at most: the first among everything in flight, which names nobody
        // (none if the server is still isolated from the last round), then three in an
        // isolated server that named it.
        // (A busy server's loop had not looked at its listener until a lull: the client
        // resumed after the isolation ended, its crash named nobody, and the series started
        // again — ten crashes and seconds, or more.)
        wait_running(&up, &format!("{fault}: after round {round}"));
        let crashes = restarts() - before;
        assert!(
            (1..=4).contains(&crashes),
            "{fault}: round {round}: {crashes} crashes"
        );
        println!("{fault}: the poisoned request failed after {took:?}");
    }
    // Everyone else carried on, and the device still serves.
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    // The bystanders saw no error.
    common::verified_clean(bystanders);
    let ok = up.run(&["blk", "read", "disk0", "--offset", "8M", "--length", "4096"]);
    assert!(ok.status.success(), "{fault}: {ok:?}");
    assert!(!state(&driver(&up)).contains("gave up"), "{fault}");
}

#[test]
fn a_request_that_crashes_the_device_every_time_fails_alone_after_three_crashes_that_name_it() {
    poisoned_request_fails_alone("faults = [\"abort-on=8192\"]");
}

/// A request that hangs the model every time: past the deadline the server ends, the model is
/// started again and the request replayed, as after a crash; the quarantine counts these ends.
#[test]
fn a_request_that_hangs_the_device_every_time_fails_alone_after_three_hangs_that_name_it() {
    poisoned_request_fails_alone("request_deadline = \"300ms\"\nfaults = [\"hang-on=8192\"]");
}

#[test]
fn a_request_that_crashes_the_driver_every_time_fails_alone_after_three_crashes_that_name_it() {
    poisoned_request_fails_alone("driver_abort_on = 8192");
}

#[test]
fn a_driver_that_hangs_now_and_then_but_serves_between_is_never_given_up() {
    let dir = tempfile::tempdir().unwrap();
    let machine = format!("{MACHINE}heartbeat = \"300ms\"\n");
    let up = Up::start(dir.path(), Some(&machine));
    let up_pid = up.child.as_ref().unwrap().id();
    let (stop, clients) = common::under_load(&up, "disk0", 0..2, 4, 256);
    // More hangs than the give-up budget allows crashes without progress.
    for round in 0..7 {
        wait_running(&up, &format!("round {round}"));
        // It serves a while, then stops answering (SIGSTOP: the heartbeat stops too).
        std::thread::sleep(Duration::from_millis(400));
        let servers = common::driver_servers(&up.control, None);
        assert_eq!(servers.len(), 1);
        assert!(common::signal_child_of(up_pid, servers[0], Signal::STOP));
        let killed = eventually(Duration::from_secs(10), || {
            !common::children_of(up_pid).contains(&servers[0])
        });
        // Never left stopped, whatever the outcome.
        common::signal_child_of(up_pid, servers[0], Signal::CONT);
        assert!(killed, "round {round}: the hung server was not killed");
    }
    wait_running(&up, "after the kills");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    common::verified_clean(clients);
    let d = driver(&up);
    assert!(!state(&d).contains("gave up"), "{d:#}");
}

/// Waits (at most `limit`) for a device model of `up` other than `old`; returns its pid.
fn next_model(up_pid: u32, old: u32, limit: Duration) -> Option<u32> {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Some(&p) = common::children_running(up_pid, "device")
            .iter()
            .find(|&&p| p != old)
        {
            return Some(p);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

#[test]
fn a_model_that_dies_or_hangs_while_it_restarts_neither_blocks_the_manager_nor_sticks() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let up_pid = up.child.as_ref().unwrap().id();
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "0"], b"kept bytes");
    assert!(w.status.success());
    for (round, sig) in [Signal::KILL, Signal::STOP].into_iter().enumerate() {
        let model = common::children_running(up_pid, "device")[0];
        assert!(common::signal_child_of(up_pid, model, Signal::KILL));
        // Its replacement, caught while it starts.
        let next = next_model(up_pid, model, Duration::from_secs(10)).expect("no new model");
        assert!(common::signal_child_of(up_pid, next, sig));
        // The manager answers meanwhile.
        let t = Instant::now();
        let ls = up.run_within(&["ls"], Duration::from_secs(30));
        assert!(ls.status.success());
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "round {round}: ls took {:?} while a model started",
            t.elapsed()
        );
        let back = eventually(Duration::from_secs(40), || {
            state(&driver(&up)).starts_with("running")
                && up
                    .run(&["blk", "read", "disk0", "--offset", "0", "--length", "10"])
                    .stdout
                    == b"kept bytes"
        });
        common::signal_child_of(up_pid, next, Signal::CONT);
        assert!(back, "round {round}: not back: {:#}", driver(&up));
    }
}

#[test]
fn restart_by_hand_works_even_where_automatic_restarts_are_off() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(&format!("{MACHINE}restarts = 0\n")));
    let w = up.run_with_input(&["blk", "write", "disk0", "--offset", "0"], b"by hand");
    assert!(w.status.success());
    let out = up.run_within(&["restart", "disk0"], Duration::from_secs(30));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_running(&up, "after the restart by hand");
    let r = up.run(&["blk", "read", "disk0", "--offset", "0", "--length", "7"]);
    assert_eq!(r.stdout, b"by hand");
}

/// The driver node that drives class device `device`.
fn driver_of(n: &serde_json::Value, device: &str) -> Option<serde_json::Value> {
    let drives = n["children"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["name"] == device));
    if n["kind"] == "driver" && drives {
        return Some(n.clone());
    }
    n["children"]
        .as_array()?
        .iter()
        .find_map(|c| driver_of(c, device))
}

/// `outboard move` under load: disk0's driver moves into the server disk1's driver runs in,
/// then into a new server of its own, then back into the one it started in. No client of
/// either disk sees an error or a replay; `ls` shows each driver where it runs; what cannot
/// move is refused with the reason.
#[test]
fn a_driver_moves_between_servers_under_load_without_an_error_or_a_replay() {
    const MACHINE: &str = r#"
name = "move"
[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:16M"
[[device]]
name = "disk1"
model = "virtio-blk"
backing = "mem:16M"
server = "shared"
[[device]]
name = "rng0"
model = "virtio-rng"
placement = "colocated"
"#;
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let up_pid = up.child.as_ref().unwrap().id();
    let (stop0, disk0) = common::under_load(&up, "disk0", 1..4, 16, 128);
    let (stop1, disk1) = common::under_load(&up, "disk1", 1..2, 16, 128);
    let placed = |device: &str| {
        let ls = up.run(&["ls", "--json"]);
        let tree: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
        let d = driver_of(&tree, device).unwrap();
        let server = d["props"]["server"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        (server, d["props"]["pid"].as_u64())
    };
    std::thread::sleep(Duration::from_millis(200));
    for (to, servers) in [("shared", 1), ("alone", 2), ("disk0-server", 2)] {
        let r = up.run_within(&["move", "disk0", "--server", to], Duration::from_secs(40));
        assert!(r.status.success(), "move into {to}: {r:?}");
        let said = String::from_utf8_lossy(&r.stdout);
        assert!(
            said.contains(&format!("serving from driver server {to:?}")),
            "{said}"
        );
        println!("{}", said.trim());
        assert!(
            eventually(Duration::from_secs(10), || {
                let (s0, pid0) = placed("disk0");
                let (s1, pid1) = placed("disk1");
                s0 == to && s1 == "shared" && pid0.is_some() && (pid0 == pid1) == (to == "shared")
            }),
            "after moving into {to}: disk0 {:?}, disk1 {:?}",
            placed("disk0"),
            placed("disk1")
        );
        let running = common::children_running(up_pid, "driver-host");
        assert_eq!(
            running.len(),
            servers,
            "after moving into {to}: {running:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Refused, with the reason.
    for (args, why) in [
        (["move", "disk0", "--server", "disk0-server"], "already"),
        (["move", "disk0", "--server", "../x"], "server name"),
        (["move", "rng0", "--server", "shared"], "colocated"),
        (["move", "disk9", "--server", "shared"], "no device named"),
    ] {
        let r = up.run(&args);
        assert!(!r.status.success(), "{args:?}");
        let e = String::from_utf8_lossy(&r.stderr);
        assert!(e.contains(why), "{args:?}: {e}");
    }
    std::thread::sleep(Duration::from_millis(200));
    stop0.store(true, Ordering::Relaxed);
    stop1.store(true, Ordering::Relaxed);
    let reports: Vec<_> = common::verified_clean(disk0)
        .into_iter()
        .chain(common::verified_clean(disk1))
        .collect();
    let completed: u64 = reports.iter().map(|r| r.completed).sum();
    assert!(completed > 1000, "the clients ran: {completed} requests");
    let (requeued, longest) = nothing_replayed(&reports);
    println!(
        "three moves: {completed} requests, 0 replayed, {requeued} sent on from the old \
         servers' rings, longest pause (server gone → session resumed) {longest:?}"
    );
}

/// A device that gets the first request after every restart wrong (its model corrupts its
/// first completion, at every start): each crash names whatever went into the isolated device
/// first. That was the oldest request of the client's replay, every time — and it was
/// quarantined at the third crash, though any request would have crashed the driver there.
/// A request named at a crash is now held back by the next server until another went
/// through: the crashes name one request, then another, and nothing is quarantined.
#[test]
fn a_device_that_fails_the_first_request_after_every_restart_gets_no_request_quarantined() {
    use outboard_block::{BlockDevice, BlockOp, BlockRequest};
    let dir = tempfile::tempdir().unwrap();
    let mut up = Up::start(
        dir.path(),
        Some(&format!("{MACHINE}faults = [\"corrupt-used=id\"]\n")),
    );
    let control = up.control.clone();
    // Eight writes at once; no server lives to answer one. (The thread ends when the machine
    // is gone and its session with it, or is left behind: it holds nothing.)
    std::thread::spawn(move || {
        let mut dev = outboard_bench::verified::open(&control, "disk0", 8).unwrap();
        for tag in 0..8u64 {
            dev.submit(&BlockRequest {
                op: BlockOp::Write,
                lba: tag * 8,
                blocks: 8,
                buf_offset: tag * 4096,
                tag,
            })
            .unwrap();
        }
        dev.kick().unwrap();
        let mut out = Vec::new();
        let _ = dev.wait(&mut out, Duration::from_secs(60));
    });
    // Enough crashes for a request named at each to have reached three several times over.
    let restarts = || driver(&up)["props"]["restarts"].as_u64().unwrap_or(0);
    assert!(
        eventually(Duration::from_secs(30), || restarts() >= 10),
        "{:#}",
        driver(&up)
    );
    let d = driver(&up);
    let out = up.interrupt();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        !log.contains("crashed the driver"),
        "an innocent request was quarantined:\n{log}"
    );
    // Each crash named a request (the log says so), alternating.
    assert!(log.contains("was in the device at this crash"), "{log}");
    assert!(d["props"]["quarantined"].is_null(), "{d:#}");
}

/// Reads sector 8192 through `dev` (a session of its own) and returns how it ended, within
/// 60 s.
fn read_poisoned(
    dev: &mut outboard_block_client::BlockClient,
) -> Result<u32, outboard_block::BlockError> {
    use outboard_block::{BlockDevice, BlockOp, BlockRequest};
    let sectors = 4096 / dev.info().block_size as u64;
    dev.submit(&BlockRequest {
        op: BlockOp::Read,
        lba: 8192,
        blocks: sectors as u32,
        buf_offset: 0,
        tag: 1,
    })
    .unwrap();
    dev.kick().unwrap();
    let mut out = Vec::new();
    dev.wait(&mut out, Duration::from_secs(60)).unwrap();
    out.remove(0).result
}

/// A quarantined request is failed once. Its fingerprint (operation and blocks) stayed with
/// the manager until a death that was no fault, so after another crash the next server failed
/// the session's next request like it without sending it — a later write of the same block,
/// say, that had done nothing. The server now records in its heartbeat page which quarantined
/// requests it answered, and the manager passes those on no more.
#[test]
fn a_quarantine_ends_once_the_request_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(
        dir.path(),
        Some(&format!("{MACHINE}faults = [\"abort-on=8192\"]\n")),
    );
    let up_pid = up.child.as_ref().unwrap().id();
    let restarts = || driver(&up)["props"]["restarts"].as_u64().unwrap_or(0);
    let mut dev = outboard_bench::verified::open(&up.control, "disk0", 1).unwrap();
    let first = read_poisoned(&mut dev);
    assert_eq!(first, Err(outboard_block::BlockError::Quarantined));
    // Another fault, which names nobody: the model aborts.
    wait_running(&up, "after the quarantine");
    let model = common::children_running(up_pid, "device")[0];
    let before = restarts();
    assert!(common::signal_child_of(up_pid, model, Signal::ABORT));
    assert!(eventually(Duration::from_secs(20), || restarts() > before));
    wait_running(&up, "after the model's crash");
    // The same request again is a new one: sent to the device, it crashes it again (and is
    // quarantined again, after crashes of its own), instead of failing unsent.
    let before = restarts();
    let again = read_poisoned(&mut dev);
    assert_eq!(again, Err(outboard_block::BlockError::Quarantined));
    assert!(
        restarts() > before,
        "failed without being sent: {:#}",
        driver(&up)
    );
}
