//! The net class under the manager, as a user meets it: two NICs joined by a wire in a
//! machine description, their registry entries, `net send` on one and `net recv` on the other
//! (with a `tcpdump -dd` filter and without), the counters, a filter the checker refuses, and
//! descriptions that cannot be.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{find_node, registry, stdout, Up};

const MACHINE: &str = r#"
name = "lan"

[[device]]
name = "nic0"
model = "virtio-net"
mac = "02:00:00:00:00:01"
wire = "cable"

[[device]]
name = "nic1"
model = "virtio-net"
mac = "02:00:00:00:00:02"
wire = "cable"
"#;

/// `ldh [12]; jeq #0x88b5, accept, drop` as `tcpdump -dd` prints a program.
const ONLY_88B5: &str = "{ 0x28, 0, 0, 0x0000000c },\n{ 0x15, 0, 1, 0x000088b5 },\n{ 0x6, 0, 0, 0x00040000 },\n{ 0x6, 0, 0, 0x00000000 },\n";

/// `ldh [12]; jeq #0x88b6, accept, drop` as `tcpdump -dd` prints a program.
const ONLY_88B6: &str = "{ 0x28, 0, 0, 0x0000000c },\n{ 0x15, 0, 1, 0x000088b6 },\n{ 0x6, 0, 0, 0x00040000 },\n{ 0x6, 0, 0, 0x00000000 },\n";

/// Starts `outboard net recv ARGS` and waits until it says it listens (its session is open, so
/// nothing sent after this is missed); bounded. Panics with what it said if it ended first.
fn listening(up: &Up, args: &[&str]) -> std::process::Child {
    try_listening(up, args)
        .unwrap_or_else(|said| panic!("net recv ended before it listened: {said}"))
}

/// As [`listening`], but a `net recv` that ends before it listens (its device is between two
/// models) is an error carrying what it said.
fn try_listening(up: &Up, args: &[&str]) -> Result<std::process::Child, String> {
    let mut c = Command::new(env!("CARGO_BIN_EXE_outboard"))
        .args(["net", "recv"])
        .args(args)
        .env("OUTBOARD_CONTROL", up.dir.join("control.sock"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(c.stderr.take().unwrap());
    let mut line = String::new();
    let mut said = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !line.contains("listening") {
        line.clear();
        assert!(Instant::now() < deadline, "net recv never listened");
        if err.read_line(&mut line).unwrap() == 0 {
            let _ = c.wait();
            return Err(said);
        }
        said.push_str(&line);
    }
    // Keep draining its stderr so it never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    Ok(c)
}

fn send(up: &Up, args: &[&str]) {
    let mut a = vec!["net", "send"];
    a.extend_from_slice(args);
    let o = up.run_within(&a, Duration::from_secs(20));
    assert!(
        o.status.success(),
        "{a:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Kills nic1's model (address 02:00:00:00:00:02) and waits, bounded, until a frame from nic0
/// reaches a client of nic1 again — through the model started in its place, which is checked.
fn kill_nic1s_model_and_see_frames_again(up: &Up) {
    let up_pid = up.child.as_ref().unwrap().id();
    let models = children_with(up_pid, "virtio-net", "02:00:00:00:00:02");
    assert_eq!(models.len(), 1, "nic1's model");
    assert!(common::signal_child_of(
        up_pid,
        models[0],
        rustix::process::Signal::KILL
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // Opened while the model is being started again, the session may be refused: try
        // again until the deadline.
        let recv = match try_listening(up, &["nic1", "--count", "1", "--timeout", "2s"]) {
            Ok(recv) => recv,
            Err(said) => {
                assert!(
                    Instant::now() < deadline,
                    "net recv on nic1 never listened again after its model was killed: {said}"
                );
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
        };
        send(
            up,
            &["nic0", "--to", "02:00:00:00:00:02", "--payload", "after"],
        );
        let o = common::run_bounded_child(recv, Duration::from_secs(20));
        if o.status.success() && stdout(&o).contains("> 02:00:00:00:00:02") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "nic1 never carried a frame again: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // It is a new model that carried it.
    let now = children_with(up_pid, "virtio-net", "02:00:00:00:00:02");
    assert_eq!(now.len(), 1);
    assert_ne!(now[0], models[0], "nic1's model was started again");
}

#[test]
fn two_nics_on_a_wire_carry_frames_from_send_to_recv() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));

    // The registry shows each NIC with its class's own properties.
    let reg = registry(&up);
    let nic = find_node(&reg, "net-device").expect("a net-device in the registry");
    let props = nic["props"].to_string();
    for p in [
        "\"class\":\"net\"",
        "\"mac\":\"02:00:00:00:00:0",
        "\"link-up\":true",
        "\"mtu\":1500",
    ] {
        assert!(props.contains(p), "{p} in {props}");
    }
    let info = up.run(&["net", "info", "nic1"]);
    assert!(
        stdout(&info).contains("address      02:00:00:00:00:02"),
        "{}",
        stdout(&info)
    );
    assert!(stdout(&info).contains("link         up"));

    // Frames to nic1's address and broadcast arrive whole; one to another station does not.
    let recv = listening(&up, &["nic1", "--count", "3", "--hex", "--timeout", "10s"]);
    send(
        &up,
        &[
            "nic0",
            "--to",
            "02:00:00:00:00:09",
            "--payload",
            "not for nic1",
        ],
    );
    send(
        &up,
        &[
            "nic0",
            "--to",
            "02:00:00:00:00:02",
            "--payload",
            "hello nic1",
            "--count",
            "2",
        ],
    );
    send(&up, &["nic0", "--payload", "to everyone"]);
    let o = common::run_bounded_child(recv, Duration::from_secs(30));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().filter(|l| l.contains("bytes")).collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[0].starts_with("60 bytes 02:00:00:00:00:01 > 02:00:00:00:00:02 type 0x88b5"));
    assert!(lines[2].contains("> ff:ff:ff:ff:ff:ff"));
    let hello: String = b"hello nic1".iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        out.contains(&format!("02000000000202000000000188b5{hello}")),
        "{out}"
    );

    // `ls` shows the counters as they are now, read from the NIC's server.
    fn named<'a>(n: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
        if n["kind"] == "net-device" && n["name"] == name {
            return Some(n);
        }
        n["children"]
            .as_array()?
            .iter()
            .find_map(|c| named(c, name))
    }
    let reg = registry(&up);
    let nic1 = named(&reg, "nic1").expect("nic1 in the registry");
    let count = |k: &str| {
        nic1["props"][k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k}: {nic1}"))
    };
    assert!(count("counters.rx-frames") >= 4, "{nic1}");
    assert!(count("counters.rx-delivered") >= 3, "{nic1}");
    assert_eq!(count("counters.rx-device-errors"), 0);
    assert!(stdout(&up.run(&["ls"])).contains("counters.rx-frames"));

    // A receive hold-off is the device's: asked for by one client, within bounds.
    let o = up.run(&["net", "hold-off", "nic1", "100us"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout(&o).contains("up to 100 µs"));
    let o = up.run(&["net", "hold-off", "nic1", "5s"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("at most 1s"));

    // A filter from `tcpdump -dd` output: only type 0x88b6 gets through.
    let filter = dir.path().join("only-88b6.bpf");
    std::fs::write(&filter, ONLY_88B6).unwrap();
    let recv = listening(
        &up,
        &[
            "nic1",
            "--filter",
            filter.to_str().unwrap(),
            "--count",
            "1",
            "--timeout",
            "10s",
        ],
    );
    send(
        &up,
        &["nic0", "--to", "02:00:00:00:00:02", "--ethertype", "0x88b5"],
    );
    send(
        &up,
        &["nic0", "--to", "02:00:00:00:00:02", "--ethertype", "0x88b6"],
    );
    let o = common::run_bounded_child(recv, Duration::from_secs(30));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout(&o).contains("type 0x88b6"), "{}", stdout(&o));

    // The counters say what happened to every frame nic1 saw.
    let s = up.run(&["net", "stats", "nic1", "--json"]);
    let s: serde_json::Value = serde_json::from_slice(&s.stdout).unwrap();
    assert_eq!(s["counters"]["rx_frames"], 6);
    assert_eq!(s["counters"]["rx_delivered"], 4);
    let s0 = up.run(&["net", "stats", "nic0", "--json"]);
    let s0: serde_json::Value = serde_json::from_slice(&s0.stdout).unwrap();
    assert_eq!(s0["counters"]["tx_frames"], 6);

    // A program the checker refuses: the command says which instruction and why.
    std::fs::write(&filter, "{ 0x15, 5, 0, 0x800 },\n{ 0x6, 0, 0, 0 },\n").unwrap();
    let o = up.run_within(
        &["net", "recv", "nic1", "--filter", filter.to_str().unwrap()],
        Duration::from_secs(20),
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("instruction 0") && err.contains("past the end"),
        "{err}"
    );
    // Nothing came within the time: a clear error, not a hang.
    let o = up.run_within(
        &["net", "recv", "nic1", "--timeout", "300ms"],
        Duration::from_secs(20),
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("0 of 1 frame(s)"));
}

#[test]
fn udp_echoes_between_a_colocated_nic_and_outboard_net_echo() {
    use outboard_net_client::{open_nic, NetOptions, Udp};
    use std::net::Ipv4Addr;
    let dir = tempfile::tempdir().unwrap();
    let machine = MACHINE.replace(
        "name = \"nic0\"\n",
        "name = \"nic0\"\nplacement = \"colocated\"\n",
    );
    let up = Up::start(dir.path(), Some(&machine));
    let info = stdout(&up.run(&["net", "info", "nic0"]));
    assert!(info.contains("placement    colocated"), "{info}");
    // The echo on nic1, in a server, for as many datagrams as are sent.
    let mut echo = Command::new(env!("CARGO_BIN_EXE_outboard"))
        .args([
            "net",
            "echo",
            "nic1",
            "--address",
            "10.7.0.2/24",
            "--count",
            "21",
        ])
        .env("OUTBOARD_CONTROL", up.dir.join("control.sock"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(echo.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(
        line.contains("echoing UDP on 10.7.0.2:7 (separate)"),
        "{line}"
    );
    // nic0's driver runs here.
    let (port, placement) =
        open_nic(&up.dir.join("control.sock"), "nic0", NetOptions::default()).unwrap();
    assert_eq!(format!("{placement:?}"), "Colocated");
    let mut udp = Udp::bind(port, Ipv4Addr::new(10, 7, 0, 1), 24, 5000).unwrap();
    let mut buf = [0u8; 2048];
    for (i, n) in (0..21).map(|i| (i, 1 + i * 70)) {
        let d: Vec<u8> = (0..n).map(|b| (b * 7 + i) as u8).collect();
        udp.send_to(&d, (Ipv4Addr::new(10, 7, 0, 2), 7)).unwrap();
        let (got, from) = udp
            .recv_from(&mut buf, Duration::from_secs(10))
            .unwrap()
            .unwrap_or_else(|| {
                let reg = registry(&up).to_string();
                panic!("no echo of datagram {i} ({n} bytes): {reg}")
            });
        assert_eq!(from, (Ipv4Addr::new(10, 7, 0, 2), 7));
        assert!(
            buf[..got] == d[..],
            "datagram {i} of {n} bytes came back different"
        );
    }
    let o = common::run_bounded_child(echo, Duration::from_secs(10));
    assert!(o.status.success(), "net echo: {}", o.status);
}

#[test]
fn descriptions_that_cannot_be_are_refused_with_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let check = |machine: &str, words: &str| {
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, machine).unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_outboard"))
            .args(["up", "--machine"])
            .arg(&p)
            .env("OUTBOARD_CONTROL", dir.path().join("c.sock"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!o.status.success(), "{machine}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(words), "{words:?} in {err}");
    };
    let nic = |name: &str, extra: &str| {
        format!("[[device]]\nname = \"{name}\"\nmodel = \"virtio-net\"\n{extra}\n")
    };
    check(
        &nic("n", "mac = \"01:00:00:00:00:01\""),
        "multicast address",
    );
    check(&nic("n", "mac = \"02:00:00:00:01\""), "not a MAC address");
    check(&nic("n", "mtu = 9001"), "68 to 9000");
    check(&nic("n", "link = \"sideways\""), "up or down");
    check(
        &nic("n", "seed = 3"),
        "seed is not a key of a virtio-net device",
    );
    let three = [
        nic("a", "wire = \"w\""),
        nic("b", "wire = \"w\""),
        nic("c", "wire = \"w\""),
    ]
    .concat();
    check(&three, "a wire has two ends");
    check(
        &nic("n", "wire = \"w\"\ntap = \"t0\""),
        "wire and tap: a NIC has one cable",
    );
    check(&nic("n", "tap = \"a/b\""), "tap = \"a/b\": 1 to 15 letters");
    let two = [nic("a", "tap = \"t0\""), nic("b", "tap = \"t0\"")].concat();
    check(&two, "another NIC's already");
}

#[test]
fn a_nic_whose_model_is_killed_comes_back_on_the_same_cable() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    // The manager starts the model again with its end of the cable, and the driver brings
    // the NIC back.
    kill_nic1s_model_and_see_frames_again(&up);
    let reg = registry(&up).to_string();
    assert!(
        reg.contains("\"restarts\":1") || reg.contains("\"restarts\":\"1\""),
        "{reg}"
    );
}

/// The children of `up_pid` running `word` (`driver-host`, `virtio-net`) whose command line
/// also holds `mention`.
fn children_with(up_pid: u32, word: &str, mention: &str) -> Vec<u32> {
    common::children_running(up_pid, word)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(mention))
                .unwrap_or(false)
        })
        .collect()
}

/// The driver server of `nic`, as the registry of the machine on `control` names it.
fn server_of(control: &Path, nic: &str) -> Vec<u32> {
    common::driver_servers(control, Some(nic))
}

/// Kills `nic`'s driver server (a child of `up_pid`) every 100 ms until `stop` is set; the
/// thread's value is how many kills landed.
fn kill_every_100ms(
    up_pid: u32,
    control: PathBuf,
    nic: &'static str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<u32> {
    std::thread::spawn(move || {
        let mut kills = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
            for pid in server_of(&control, nic) {
                if common::signal_child_of(up_pid, pid, rustix::process::Signal::KILL) {
                    kills += 1;
                }
            }
        }
        kills
    })
}

/// What a stream from nic0 to nic1 came to while `victim`'s driver server was killed every
/// 100 ms: frames sent, sequence numbers received in order, frames interrupted, kills, and the
/// resumes of the sender and the receiver.
struct Stream {
    sent: u64,
    /// The first frame sent after the kills stopped.
    calm_from: u64,
    got: Vec<u64>,
    /// Frames of another EtherType (one after every 16th) that reached the receiver, whose
    /// packet filter takes only the stream's: the filter must survive each restart.
    strays: u64,
    interrupted: u64,
    /// Frames nic1 received and dropped for want of a posted buffer (its client fell behind:
    /// a NIC has no flow control).
    no_buffer: u64,
    kills: u32,
    resumes: (u64, u64),
}

fn stream_while_killing(victim: &'static str) -> Stream {
    use outboard_net::NetError;
    use outboard_net_client::{open_nic, NetOptions};
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let up_pid = up.child.as_ref().unwrap().id();
    let control = up.dir.join("control.sock");

    let (mut rx, _) = open_nic(&control, "nic1", NetOptions::default()).unwrap();
    rx.set_filter(Some(
        &outboard_net::bpf::Program::from_text(ONLY_88B5).unwrap(),
    ))
    .unwrap();
    let receiver = std::thread::spawn(move || {
        let (mut seqs, mut strays) = (Vec::new(), 0u64);
        while let Some(f) = rx.recv(Duration::from_secs(4)).unwrap() {
            if f[12..14] == [0x88, 0xb5] {
                seqs.push(u64::from_be_bytes(f[14..22].try_into().unwrap()));
            } else {
                strays += 1;
            }
        }
        (seqs, strays, rx.resumes())
    });
    let (mut tx, _) = open_nic(&control, "nic0", NetOptions::default()).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let killer = kill_every_100ms(up_pid, up.control.clone(), victim, stop.clone());
    let (mut sent, mut interrupted) = (0u64, 0u64);
    // 3 s under kills, then 2 s of calm: what is sent in the calm must get through.
    let mut calm_from = None;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if calm_from.is_none() && start.elapsed() >= Duration::from_secs(3) {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            calm_from = Some(sent);
        }
        let mut f = vec![0u8; 64];
        f[..6].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        f[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
        f[14..22].copy_from_slice(&sent.to_be_bytes());
        loop {
            match tx.send(&f) {
                Ok(()) => break,
                // An earlier frame the dead server had taken: it may have gone out.
                Err(NetError::Interrupted) => interrupted += 1,
                Err(e) => panic!("frame {sent}: {e}"),
            }
        }
        sent += 1;
        if sent % 16 == 0 {
            // A decoy the receiver's filter refuses.
            f[12..14].copy_from_slice(&0x88b6u16.to_be_bytes());
            while let Err(e) = tx.send(&f) {
                // An earlier frame (maybe the stream's) the dead server had taken.
                assert!(matches!(e, NetError::Interrupted), "decoy: {e}");
                interrupted += 1;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let kills = killer.join().unwrap();
    loop {
        match tx.flush() {
            Ok(()) => break,
            Err(NetError::Interrupted) => interrupted += 1,
            Err(e) => panic!("flush: {e}"),
        }
    }
    let (got, strays, rx_resumes) = receiver.join().unwrap();
    let stats = up.run(&["net", "stats", "nic1", "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    Stream {
        no_buffer: stats["counters"]["rx_no_buffer"].as_u64().unwrap(),
        sent,
        calm_from: calm_from.expect("the calm began"),
        got,
        strays,
        interrupted,
        kills,
        resumes: (tx.resumes(), rx_resumes),
    }
}

#[test]
fn a_stream_goes_on_while_the_senders_driver_server_is_killed_every_100ms() {
    let Stream {
        sent,
        calm_from: _,
        got,
        strays,
        interrupted,
        no_buffer,
        kills,
        resumes,
    } = stream_while_killing("nic0");
    eprintln!(
        "{sent} frames sent, {} arrived, {interrupted} interrupted, {no_buffer} dropped by nic1 \
         for want of a buffer, {kills} kills, resumes {resumes:?}",
        got.len()
    );
    assert!(kills >= 10, "only {kills} kills");
    assert!(resumes.0 >= 5, "the sender resumed {} times", resumes.0);
    assert_eq!(strays, 0, "the receiver's filter let decoys through");
    // In order and never twice; everything not interrupted arrived (the receiver's driver was
    // never touched; a receiving client that falls behind loses what finds no buffer, counted
    // by nic1), and nothing arrived that was not sent.
    assert!(
        got.windows(2).all(|w| w[0] < w[1]),
        "out of order or duplicated"
    );
    assert!(got.iter().all(|&s| s < sent));
    assert!(
        got.len() as u64 + interrupted + no_buffer >= sent,
        "{} of {sent} frames arrived, {interrupted} interrupted, {no_buffer} found no buffer \
         ({kills} kills)",
        got.len()
    );
}

#[test]
fn a_stream_goes_on_while_the_receivers_driver_server_is_killed_every_100ms() {
    let Stream {
        sent,
        calm_from,
        got,
        strays,
        interrupted,
        no_buffer: _,
        kills,
        resumes,
    } = stream_while_killing("nic1");
    eprintln!(
        "{sent} frames sent, {} arrived, {interrupted} interrupted, {kills} kills, resumes {resumes:?}",
        got.len()
    );
    assert!(kills >= 10, "only {kills} kills");
    assert!(resumes.1 >= 5, "the receiver resumed {} times", resumes.1);
    assert_eq!(
        strays, 0,
        "the receiver's filter, set again on each new server, let decoys through"
    );
    assert_eq!(interrupted, 0, "the sender's driver was never touched");
    // Frames that reached nic1 while no driver ran are lost (a NIC being reset); what arrives
    // is in order, never twice, and the stream goes on to its end.
    assert!(
        got.windows(2).all(|w| w[0] < w[1]),
        "out of order or duplicated"
    );
    assert!(got.iter().all(|&s| s < sent));
    assert!(
        got.len() as u64 >= sent / 4,
        "{} of {sent} arrived",
        got.len()
    );
    // The stream goes on: once the kills stop, the receiver's session (resumed on the last
    // server) gets frames again. Frames that reached nic1 while no driver ran, and frames
    // past its posted buffers, are dropped and counted: a NIC has no flow control.
    assert!(
        got.iter().any(|&s| s >= calm_from),
        "nothing sent after the kills stopped arrived (calm from frame {calm_from})"
    );
}

/// A datagram's payload: its sequence number, then bytes that follow from it (so a datagram
/// damaged or mixed with another is caught).
fn datagram(seq: u64) -> Vec<u8> {
    let mut d = seq.to_be_bytes().to_vec();
    d.extend((0..200u64).map(|i| (seq.wrapping_mul(31).wrapping_add(i * 7) % 251) as u8));
    d
}

#[test]
fn a_verified_udp_stream_goes_on_while_the_receivers_driver_server_is_killed_every_100ms() {
    use outboard_net_client::{open_nic, NetOptions, Udp};
    use std::net::Ipv4Addr;
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let up_pid = up.child.as_ref().unwrap().id();
    let control = up.dir.join("control.sock");
    let (rx, _) = open_nic(&control, "nic1", NetOptions::default()).unwrap();
    let mut rx = Udp::bind(rx, Ipv4Addr::new(10, 9, 0, 2), 24, 9000).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let receiver = {
        let done = done.clone();
        std::thread::spawn(move || {
            let (mut seqs, mut bad) = (Vec::new(), 0u64);
            let mut buf = [0u8; 2048];
            loop {
                match rx.recv_from(&mut buf, Duration::from_millis(500)).unwrap() {
                    Some((n, _)) => {
                        let seq = u64::from_be_bytes(buf[..8].try_into().unwrap());
                        if buf[..n] != datagram(seq)[..] {
                            bad += 1;
                        }
                        seqs.push(seq);
                    }
                    None if done.load(std::sync::atomic::Ordering::Relaxed) => break,
                    None => {}
                }
            }
            (seqs, bad)
        })
    };
    let (tx, _) = open_nic(&control, "nic0", NetOptions::default()).unwrap();
    let mut tx = Udp::bind(tx, Ipv4Addr::new(10, 9, 0, 1), 24, 9001).unwrap();
    let to = (Ipv4Addr::new(10, 9, 0, 2), 9000);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let killer = kill_every_100ms(up_pid, up.control.clone(), "nic1", stop.clone());
    // 3 s under kills, then 2 s of calm; what is sent from 1 s into the calm (the last
    // server killed is back by then) must all arrive.
    let (mut sent, mut calm_from) = (0u64, None);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if calm_from.is_none() && start.elapsed() >= Duration::from_secs(3) {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if calm_from.is_none() && start.elapsed() >= Duration::from_secs(4) {
            calm_from = Some(sent);
        }
        tx.send_to(&datagram(sent), to).unwrap();
        sent += 1;
        std::thread::sleep(Duration::from_micros(500));
    }
    tx.flush().unwrap();
    let kills = killer.join().unwrap();
    std::thread::sleep(Duration::from_secs(1));
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let (got, bad) = receiver.join().unwrap();
    let calm_from = calm_from.unwrap();
    eprintln!(
        "UDP: {sent} datagrams sent, {} arrived, {kills} kills of the receiver's server",
        got.len()
    );
    assert!(kills >= 10, "only {kills} kills");
    assert_eq!(bad, 0, "datagrams arrived damaged");
    // Never twice, never out of order, nothing that was not sent; the stream goes on: what
    // was sent once the kills stopped arrives (frames that reach a NIC while no driver runs
    // are lost, as the guarantee allows).
    assert!(
        got.windows(2).all(|w| w[0] < w[1]),
        "out of order or duplicated"
    );
    assert!(got.iter().all(|&s| s < sent));
    let calm = got.iter().filter(|&&s| s >= calm_from).count() as u64;
    assert_eq!(
        calm,
        sent - calm_from,
        "a second after the kills stopped: {calm} of {} datagrams arrived",
        sent - calm_from
    );
}

/// A network namespace this test made, removed when dropped.
struct Netns(String);

impl Netns {
    fn new(name: String) -> Self {
        let o = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "ip netns add {name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Netns(name)
    }

    /// Runs `args` in the namespace, bounded.
    fn run(&self, args: &[&str], limit: Duration) -> std::process::Output {
        common::run_bounded(
            Command::new("ip")
                .args(["netns", "exec", &self.0])
                .args(args),
            limit,
        )
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// A process this test started (an `outboard export tap`, QEMU), ended when dropped (an
/// export's interface goes with it).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Exports `nic` as interface `ifname` and moves the interface into `ns` with `addr`, up.
fn tap_into(up: &Up, nic: &str, ifname: &str, ns: &Netns, addr: &str) -> KillOnDrop {
    let mut c = Command::new(env!("CARGO_BIN_EXE_outboard"))
        .args(["export", "tap", nic, "--name", ifname])
        .env("OUTBOARD_CONTROL", up.dir.join("control.sock"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(c.stderr.take().unwrap());
    let export = KillOnDrop(c);
    let mut line = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !line.contains("exported as") {
        line.clear();
        assert!(
            Instant::now() < deadline,
            "export tap never made its interface"
        );
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "export tap ended: {line}"
        );
    }
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    adopt(ns, ifname, addr);
    export
}

#[test]
fn ping_and_iperf3_between_namespaces_whose_only_link_is_two_outboard_nics() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let id = std::process::id() % 100_000;
    let (a, b) = (
        Netns::new(format!("ob-a-{id}")),
        Netns::new(format!("ob-b-{id}")),
    );
    let (ia, ib) = (format!("oba{id}"), format!("obb{id}"));
    let _ea = tap_into(&up, "nic0", &ia, &a, "10.77.0.1/24");
    let _eb = tap_into(&up, "nic1", &ib, &b, "10.77.0.2/24");

    // ARP and ICMP through: host stack → TAP → export → session → driver → model → wire →
    // model → driver → session → export → TAP → host stack, and back.
    let o = a.run(
        &["ping", "-c", "5", "-i", "0.2", "-W", "3", "10.77.0.2"],
        Duration::from_secs(30),
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "ping: {out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("5 received"), "{out}");
    eprintln!("{}", out.lines().last().unwrap_or_default());

    // TCP through it: iperf3 for two seconds (test.sh installs it).
    assert!(
        Command::new("iperf3").arg("--version").output().is_ok(),
        "iperf3 is not installed (apt-get install iperf3; test.sh does)"
    );
    let mut server = Command::new("ip")
        .args([
            "netns",
            "exec",
            &b.0,
            "iperf3",
            "-s",
            "-1",
            "-B",
            "10.77.0.2",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The server listens a moment after it starts: a refused client tries again (bounded).
    // iperf3 3.12 with -J exits 0 when it cannot connect (the error is in its report), so the
    // refusal is read from the report, whatever the exit status.
    let mut o = None;
    for _ in 0..50 {
        let run = a.run(
            &["iperf3", "-c", "10.77.0.2", "-t", "2", "-J"],
            Duration::from_secs(30),
        );
        let refused = String::from_utf8_lossy(&run.stdout).contains("Connection refused");
        o = Some(run);
        if !refused {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = server.kill();
    let _ = server.wait();
    let o = o.unwrap();
    assert!(
        o.status.success(),
        "iperf3: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(j["error"].is_null(), "iperf3: {}", j["error"]);
    let Some(bps) = j["end"]["sum_received"]["bits_per_second"].as_f64() else {
        panic!(
            "iperf3 reported no received rate; its report:\n{}\nstderr: {}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    };
    eprintln!("iperf3 over two Outboard NICs: {:.1} Mbit/s", bps / 1e6);
    assert!(bps > 1e6, "{bps} bit/s");
}

/// Moves interface `ifname` (in the host's namespace) into `ns` with `addr`, up.
fn adopt(ns: &Netns, ifname: &str, addr: &str) {
    let o = Command::new("ip")
        .args(["link", "set", ifname, "netns", &ns.0])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for args in [
        vec!["ip", "addr", "add", addr, "dev", ifname],
        vec!["ip", "link", "set", ifname, "up"],
        vec!["ip", "link", "set", "lo", "up"],
    ] {
        let o = ns.run(&args, Duration::from_secs(10));
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

fn ping(ns: &Netns, to: &str, n: u32) -> bool {
    let n = n.to_string();
    let o = ns.run(
        &["ping", "-c", &n, "-i", "0.2", "-W", "3", to],
        Duration::from_secs(30),
    );
    o.status.success() && String::from_utf8_lossy(&o.stdout).contains(&format!("{n} received"))
}

#[test]
fn exports_declared_in_the_machine_make_the_interfaces_and_outlive_an_export_crash() {
    let dir = tempfile::tempdir().unwrap();
    let id = std::process::id() % 100_000;
    let (ia, ib) = (format!("obma{id}"), format!("obmb{id}"));
    // nic1's export owns its NIC's receive path: frames are written into its buffers.
    let machine = format!(
        "{MACHINE}\n[[export]]\ndevice = \"nic0\"\nprotocol = \"tap\"\ninterface = \"{ia}\"\n\n[[export]]\ndevice = \"nic1\"\nprotocol = \"tap\"\ninterface = \"{ib}\"\nown = true\n"
    );
    let up = Up::start(dir.path(), Some(&machine));
    let exists = |i: &str| std::path::Path::new("/sys/class/net").join(i).exists();
    assert!(
        common::eventually(Duration::from_secs(20), || exists(&ia) && exists(&ib)),
        "up made both interfaces"
    );
    let reg = registry(&up).to_string();
    assert!(reg.contains(&format!("tap:{ia}")), "{reg}");
    let (a, b) = (
        Netns::new(format!("ob-ma-{id}")),
        Netns::new(format!("ob-mb-{id}")),
    );
    adopt(&a, &ia, "10.78.0.1/24");
    adopt(&b, &ib, "10.78.0.2/24");
    assert!(
        common::eventually(Duration::from_secs(20), || ping(&a, "10.78.0.2", 1)),
        "ping through the declared exports"
    );
    // nic1's export crashes: the manager keeps the interface (its address stays in the
    // namespace), starts the export again, and the link carries traffic again.
    let up_pid = up.child.as_ref().unwrap().id();
    let exports = children_with(up_pid, "export", &ib);
    assert_eq!(exports.len(), 1, "nic1's export");
    // It serves confined: a seccomp filter, no new privileges, no capabilities.
    let status = std::fs::read_to_string(format!("/proc/{}/status", exports[0])).unwrap();
    for line in ["Seccomp:\t2", "NoNewPrivs:\t1", "CapEff:\t0000000000000000"] {
        assert!(status.contains(line), "{line} in {status}");
    }
    assert!(common::signal_child_of(
        up_pid,
        exports[0],
        rustix::process::Signal::KILL
    ));
    assert!(
        common::eventually(Duration::from_secs(30), || {
            let now = children_with(up_pid, "export", &ib);
            now.len() == 1 && now[0] != exports[0]
        }),
        "the export was started again"
    );
    assert!(
        common::eventually(Duration::from_secs(30), || ping(&a, "10.78.0.2", 3)),
        "ping after the export came back"
    );
    // The export started again took the receive path again (the dead one's went back when
    // its session closed), and nic1's frames reach it in place.
    // nic1's driver server is killed: the confined export resumes its session on the new
    // server (through the manager), takes the receive path again, and traffic goes on.
    let serving = children_with(up_pid, "export", &ib);
    let servers = server_of(&up.control, "nic1");
    assert_eq!(servers.len(), 1, "nic1's driver server");
    assert!(common::signal_child_of(
        up_pid,
        servers[0],
        rustix::process::Signal::KILL
    ));
    assert!(
        common::eventually(Duration::from_secs(30), || ping(&a, "10.78.0.2", 3)),
        "ping after nic1's driver server came back"
    );
    assert_eq!(
        children_with(up_pid, "export", &ib),
        serving,
        "the same export serves: it resumed, it did not die"
    );
    let stats = stdout(&up.run(&["net", "stats", "nic1"]));
    let in_place: u64 = stats
        .lines()
        .find_map(|l| l.trim().strip_prefix("of them in place"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{stats}"));
    assert!(in_place >= 3, "{stats}");
}

#[test]
fn a_nic_whose_cable_is_a_tap_interface_talks_to_the_hosts_stack_and_keeps_it_across_a_model_crash()
{
    let dir = tempfile::tempdir().unwrap();
    let id = std::process::id() % 100_000;
    let ifname = format!("obc{id}");
    let machine = format!(
        "[[device]]\nname = \"nic0\"\nmodel = \"virtio-net\"\nmac = \"02:00:00:00:00:05\"\ntap = \"{ifname}\"\n"
    );
    let up = Up::start(dir.path(), Some(&machine));
    let reg = registry(&up).to_string();
    assert!(reg.contains(&format!("tap:{ifname}")), "{reg}");
    let ns = Netns::new(format!("ob-c-{id}"));
    adopt(&ns, &ifname, "10.79.0.1/24");
    let index = |ns: &Netns| {
        let o = ns.run(
            &["cat", &format!("/sys/class/net/{ifname}/ifindex")],
            Duration::from_secs(10),
        );
        stdout(&o).trim().to_string()
    };
    let before = index(&ns);
    assert!(before.parse::<u32>().is_ok(), "ifindex {before:?}");
    // smoltcp behind the driver answers ARP and ICMP for its address: the host's own ping,
    // through the TAP interface, the model, the driver server and the session.
    let echo = Command::new(env!("CARGO_BIN_EXE_outboard"))
        .args(["net", "echo", "nic0", "--address", "10.79.0.2/24"])
        .env("OUTBOARD_CONTROL", up.dir.join("control.sock"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _echo = KillOnDrop(echo);
    assert!(
        common::eventually(Duration::from_secs(20), || ping(&ns, "10.79.0.2", 3)),
        "the host's ping answered through a TAP-cabled NIC"
    );
    // The model crashes: the manager starts it again on the same interface (same index, its
    // address and namespace kept), and the host reaches the NIC again.
    let up_pid = up.child.as_ref().unwrap().id();
    let models = children_with(up_pid, "virtio-net", "02:00:00:00:00:05");
    assert_eq!(models.len(), 1, "nic0's model");
    assert!(common::signal_child_of(
        up_pid,
        models[0],
        rustix::process::Signal::KILL
    ));
    assert!(
        common::eventually(Duration::from_secs(30), || {
            let now = children_with(up_pid, "virtio-net", "02:00:00:00:00:05");
            now.len() == 1 && now[0] != models[0]
        }),
        "the model was started again"
    );
    assert!(
        common::eventually(Duration::from_secs(30), || ping(&ns, "10.79.0.2", 3)),
        "ping after the model came back"
    );
    assert_eq!(index(&ns), before, "the same interface");
}

#[test]
fn jumbo_frames_cross_two_outboard_nics_between_namespaces_whole() {
    let dir = tempfile::tempdir().unwrap();
    let id = std::process::id() % 100_000;
    let (ia, ib) = (format!("obja{id}"), format!("objb{id}"));
    let jumbo = MACHINE.replace("wire = \"cable\"", "wire = \"cable\"\nmtu = 9000");
    let machine = format!(
        "{jumbo}\n[[export]]\ndevice = \"nic0\"\nprotocol = \"tap\"\ninterface = \"{ia}\"\n\n[[export]]\ndevice = \"nic1\"\nprotocol = \"tap\"\ninterface = \"{ib}\"\n"
    );
    let up = Up::start(dir.path(), Some(&machine));
    let info = up.run(&["net", "info", "nic1"]);
    assert!(stdout(&info).contains("9000"), "{}", stdout(&info));
    let exists = |i: &str| std::path::Path::new("/sys/class/net").join(i).exists();
    assert!(
        common::eventually(Duration::from_secs(20), || exists(&ia) && exists(&ib)),
        "up made both interfaces"
    );
    let (a, b) = (
        Netns::new(format!("ob-ja-{id}")),
        Netns::new(format!("ob-jb-{id}")),
    );
    adopt(&a, &ia, "10.80.0.1/24");
    adopt(&b, &ib, "10.80.0.2/24");
    // The manager gave each interface the NIC's MTU.
    let mtu = a.run(
        &["cat", &format!("/sys/class/net/{ia}/mtu")],
        Duration::from_secs(10),
    );
    assert_eq!(stdout(&mtu).trim(), "9000");
    // 8,972 bytes of ICMP payload: a 9,000-byte IP packet in one 9,014-byte frame each way,
    // not fragmented (-M do), through sessions, drivers, models and the wire.
    assert!(
        common::eventually(Duration::from_secs(30), || {
            let o = a.run(
                &[
                    "ping",
                    "-M",
                    "do",
                    "-s",
                    "8972",
                    "-c",
                    "3",
                    "-i",
                    "0.2",
                    "-W",
                    "3",
                    "10.80.0.2",
                ],
                Duration::from_secs(30),
            );
            o.status.success() && stdout(&o).contains("3 received")
        }),
        "jumbo pings through two Outboard NICs"
    );
}

#[test]
fn tap_exports_that_cannot_be_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let check = |machine: &str, words: &str| {
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, machine).unwrap();
        let o = common::run_bounded(
            Command::new(env!("CARGO_BIN_EXE_outboard"))
                .args(["up", "--machine"])
                .arg(&p)
                .env("OUTBOARD_CONTROL", dir.path().join("c.sock")),
            Duration::from_secs(60),
        );
        assert!(!o.status.success(), "{machine}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(words), "{words:?} in {err}");
    };
    let tap = |extra: &str| {
        format!("{MACHINE}\n[[export]]\ndevice = \"nic0\"\nprotocol = \"tap\"\n{extra}\n")
    };
    check(
        &tap("listen = \"127.0.0.1:10809\""),
        "listen is an NBD export's",
    );
    check(&tap("interface = \"a-very-long-name0\""), "1 to 15 letters");
    check(&tap("interface = \"a/b\""), "1 to 15 letters");
    check(
        &format!("{MACHINE}\n[[export]]\ndevice = \"nic0\"\ninterface = \"x\"\n"),
        "interface is a TAP export's",
    );
    check(
        &format!("{MACHINE}\n[[export]]\ndevice = \"nic0\"\nprotocol = \"iscsi\"\n"),
        "\"nbd\" or \"tap\"",
    );
    // A disk is no NIC: refused when the machine comes up, with the class.
    let disk = "[[device]]\nname = \"disk0\"\nmodel = \"virtio-blk\"\nbacking = \"mem:1M\"\n\n[[export]]\ndevice = \"disk0\"\nprotocol = \"tap\"\n";
    check(disk, "a TAP export NICs");
}

/// `net send` of three frames carrying `payload` from nic0 to nic1, and `net recv` on nic1
/// sees all three.
fn three_frames_from_nic0_reach_nic1(up: &Up, payload: &str) {
    let recv = listening(up, &["nic1", "--count", "3", "--hex", "--timeout", "10s"]);
    send(
        up,
        &[
            "nic0",
            "--to",
            "02:00:00:00:00:02",
            "--payload",
            payload,
            "--count",
            "3",
        ],
    );
    let o = common::run_bounded_child(recv, Duration::from_secs(30));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let hex: String = payload.bytes().map(|b| format!("{b:02x}")).collect();
    assert_eq!(stdout(&o).matches(&hex).count(), 3, "{}", stdout(&o));
}

/// QEMU with no guest (only its network layer): two `-netdev stream` on UNIX sockets `a`
/// and `b`, joined on a hub. `listen`: QEMU listens on them (server=on); otherwise it
/// connects to them (server=off). Ended when dropped.
fn qemu_hub(listen: bool, a: &std::path::Path, b: &std::path::Path) -> KillOnDrop {
    let server = if listen { "on" } else { "off" };
    let stream = |id: &str, p: &std::path::Path| {
        format!(
            "stream,id={id},server={server},addr.type=unix,addr.path={}",
            p.display()
        )
    };
    KillOnDrop(
        Command::new("qemu-system-x86_64")
            .args(["-M", "none", "-nodefaults", "-display", "none"])
            .args(["-netdev", &stream("a", a), "-netdev", &stream("b", b)])
            .args(["-netdev", "hubport,id=ha,hubid=0,netdev=a"])
            .args(["-netdev", "hubport,id=hb,hubid=0,netdev=b"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("qemu-system-x86_64"),
    )
}

#[test]
fn qemu_plugs_its_stream_netdevs_into_listening_nics_under_the_manager() {
    // The other way round: the NICs' cables listen (the manager binds the sockets), and
    // QEMU's netdevs connect to them (server=off), joined on QEMU's hub.
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("la.sock"), dir.path().join("lb.sock"));
    let machine = format!(
        "[[device]]\nname = \"nic0\"\nmodel = \"virtio-net\"\nmac = \"02:00:00:00:00:01\"\nstream_listen = \"{}\"\n\n\
         [[device]]\nname = \"nic1\"\nmodel = \"virtio-net\"\nmac = \"02:00:00:00:00:02\"\nstream_listen = \"{}\"\n",
        pa.display(),
        pb.display()
    );
    let up = Up::start(dir.path(), Some(&machine));
    let info = stdout(&up.run(&["net", "info", "nic1"]));
    assert!(info.contains("link         down"), "no peer yet: {info}");
    let _qemu = qemu_hub(false, &pa, &pb);
    assert!(
        common::eventually(Duration::from_secs(20), || {
            stdout(&up.run(&["net", "info", "nic1"])).contains("link         up")
        }),
        "QEMU plugged in: the link came up"
    );
    three_frames_from_nic0_reach_nic1(&up, "into qemu");
}

#[test]
fn nics_on_qemus_stream_netdevs_exchange_frames_through_qemu() {
    // QEMU (no guest: only its network layer) joins two `-netdev stream` servers on a hub;
    // each Outboard NIC's model connects to one, so every frame crosses QEMU's parser.
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("qa.sock"), dir.path().join("qb.sock"));
    let _qemu = qemu_hub(true, &pa, &pb);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(pa.exists() && pb.exists()) {
        assert!(Instant::now() < deadline, "QEMU never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    let machine = format!(
        "[[device]]\nname = \"nic0\"\nmodel = \"virtio-net\"\nmac = \"02:00:00:00:00:01\"\nstream = \"{}\"\n\n\
         [[device]]\nname = \"nic1\"\nmodel = \"virtio-net\"\nmac = \"02:00:00:00:00:02\"\nstream = \"{}\"\n",
        pa.display(),
        pb.display()
    );
    let up = Up::start(dir.path(), Some(&machine));
    three_frames_from_nic0_reach_nic1(&up, "via qemu");

    // nic1's model is killed: its successor connects to QEMU anew, and frames flow again.
    kill_nic1s_model_and_see_frames_again(&up);
}
