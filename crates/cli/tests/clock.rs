//! The clock class under the manager, as a user meets it: two PCI timer models at different
//! rates, each driven by the C timer driver in its own driver server, read with `outboard
//! clock`; the registry; a driver server killed under a client waiting for ticks; a client of
//! another class refused.

mod common;

use std::time::{Duration, Instant};

use common::{stdout, Up};
use rustix::process::Signal;

const MACHINE: &str = r#"
name = "clocks"

[[device]]
name = "clock0"
model = "timer"
hz = 1000

[[device]]
name = "clock1"
model = "timer"
hz = 250
"#;

fn clock(up: &Up, args: &[&str]) -> String {
    let mut all = vec!["clock"];
    all.extend_from_slice(args);
    let o = up.run_within(&all, Duration::from_secs(60));
    assert!(
        o.status.success(),
        "outboard {}: {}",
        all.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
    stdout(&o)
}

#[test]
fn timers_tick_at_their_rates_through_the_c_driver() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));

    let once = clock(&up, &["clock0"]);
    assert!(once.contains("at 1000 Hz"), "{once}");

    // 200 ticks at 250 Hz take 0.8 s by the device; counted one wait at a time, they cannot
    // take less, and on a machine this small they take less than ten times as long.
    let started = Instant::now();
    let out = clock(&up, &["clock1", "--ticks", "200"]);
    let took = started.elapsed();
    assert!(out.contains("200 ticks in"), "{out}");
    assert!(out.contains("the device says 250 Hz"), "{out}");
    assert!(took >= Duration::from_millis(790), "200 ticks in {took:?}");

    // The library answers the same, and the device's time moves on as the ticks do.
    let (mut c, _) = outboard_clock_client::open_clock(&up.control, "clock0").unwrap();
    assert_eq!(c.info().hz, 1000);
    let t0 = c.now().unwrap();
    let passed = c.wait(50).unwrap();
    assert!(passed >= 50, "a wait for 50 ticks came back after {passed}");
    let t1 = c.now().unwrap();
    assert!(t1.ticks >= t0.ticks + 50, "{t0:?} then {t1:?}");
    assert!(
        t1.device_ns >= t0.device_ns + 49_000_000,
        "50 ticks at 1 kHz in {} ns of device time",
        t1.device_ns - t0.device_ns
    );
    // A request the contract does not allow is refused with why, and the session goes on.
    let e = c.wait(0).unwrap_err();
    assert!(matches!(e, outboard_clock::ClockError::Invalid(_)), "{e}");
    assert!(c.wait(1).unwrap() >= 1);

    // The registry shows each as a clock device, served.
    let tree = common::registry(&up).to_string();
    for name in ["clock0", "clock1"] {
        assert!(
            tree.contains(&format!("\"kind\":\"clock-device\",\"name\":\"{name}\"")),
            "{name} in {tree}"
        );
    }
    assert!(tree.contains("legacy-timer"), "{tree}");

    // A client of another class is refused, saying which class the device is.
    let o = up.run(&["rng", "read", "clock0", "--length", "8"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("clock"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_killed_clock_driver_server_is_restarted_and_its_waiting_client_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let up_pid = up.child.as_ref().unwrap().id();
    let servers: Vec<u32> = common::children_running(up_pid, "driver-host")
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains("clock1="))
                .unwrap_or(false)
        })
        .collect();
    assert_eq!(servers.len(), 1, "clock1's driver server");
    // A client waits for 250 ticks (a second); its server dies half-way. The wait is sent
    // again to the next server and counts that driver's ticks: it comes back, with no error,
    // after at least its 250 ticks of the new driver.
    let control = up.control.clone();
    let (opened, is_open) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let (mut c, _) = outboard_clock_client::open_clock(&control, "clock1").unwrap();
        opened.send(()).unwrap();
        let started = Instant::now();
        (c.wait(250), started.elapsed())
    });
    is_open.recv_timeout(Duration::from_secs(30)).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    assert!(common::signal_child_of(up_pid, servers[0], Signal::KILL));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !waiter.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(waiter.is_finished(), "the waiting client never came back");
    let (passed, took) = waiter.join().unwrap();
    let passed = passed.expect("the wait failed across the restart");
    assert!(passed >= 250, "{passed}");
    assert!(
        took >= Duration::from_millis(1400),
        "{took:?}: the wait was not counted anew"
    );
    // And the clock serves new clients.
    let out = clock(&up, &["clock1", "--ticks", "10"]);
    assert!(out.contains("10 ticks in"), "{out}");
}

#[test]
fn a_clock_that_stops_ticking_is_caught_with_nobody_waiting_and_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let machine = r#"
name = "stopped"

[[device]]
name = "clock0"
model = "timer"
hz = 200
request_deadline = "1s"
fault_injection = true
"#;
    let up = Up::start(dir.path(), Some(machine));
    let restarts = |up: &Up| {
        let tree = common::registry(up).to_string();
        let at = tree.find("\"restarts\":").map(|i| i + 11);
        at.and_then(|i| {
            tree[i..]
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse::<u64>().ok())
        })
        .unwrap_or(0)
    };
    let before = restarts(&up);
    // One interrupt lost: STATUS.TICK stays set, the device raises no more, the count stops.
    // Nobody waits; the clock is watched all the same.
    let o = up.run(&["fault", "clock0", "drop-irq=1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while restarts(&up) == before && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        restarts(&up) > before,
        "a stopped clock was not restarted: {}",
        common::registry(&up)
    );
    // And it ticks again.
    let out = clock(&up, &["clock0", "--ticks", "20"]);
    assert!(out.contains("20 ticks in"), "{out}");
}
