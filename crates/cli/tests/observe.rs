//! What an operator sees of a running machine — `ls --json`, `top --once --json` and the
//! OpenMetrics endpoint — agrees with the I/O a test did, exactly, across a driver crash.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{find_node, registry, stdout, Up};

/// Writes and reads of this size, each one request to the device (a write is followed by a
/// flush: `blk write` makes it durable before it reports).
const CHUNK: usize = 65536;

fn write(up: &Up, seed: u64) {
    let data = common::pattern(seed, CHUNK);
    let r = up.run_with_input(&["blk", "write", "disk0", "--offset", "1M"], &data);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}

fn read(up: &Up) {
    let r = up.run(&["blk", "read", "disk0", "--offset", "1M", "--length", "64K"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(r.stdout.len(), CHUNK);
}

/// The metrics endpoint's answer, parsed by a scraper's own parser (prometheus_client's
/// OpenMetrics parser, which refuses what the format does not allow): (name, labels, value).
fn scrape(sock: &std::path::Path) -> Vec<(String, serde_json::Value, f64)> {
    let mut c = std::os::unix::net::UnixStream::connect(sock).expect("metrics socket");
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: outboard\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    c.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.contains("Content-Type: application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    let script = "import sys, json\n\
        from prometheus_client.openmetrics import parser\n\
        fams = parser.text_string_to_metric_families(sys.stdin.read())\n\
        print(json.dumps([[s.name, s.labels, s.value] for f in fams for s in f.samples]))\n";
    let mut py = std::process::Command::new("/usr/bin/python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 (test.sh installs python3-prometheus-client)");
    py.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let out = common::run_bounded_child(py, Duration::from_secs(30));
    assert!(
        out.status.success(),
        "the OpenMetrics parser refused the answer: {}\n{body}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the parser's samples")
}

fn metric(samples: &[(String, serde_json::Value, f64)], name: &str, device: &str) -> f64 {
    samples
        .iter()
        .find(|(n, l, _)| n == name && l["device"] == device && l.get("quantile").is_none())
        .unwrap_or_else(|| panic!("no {name} for {device} in {samples:?}"))
        .2
}

#[test]
fn ls_top_and_the_metrics_endpoint_agree_with_the_io_done_across_a_driver_crash() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("metrics.sock");
    let mut up = Up::start_with(dir.path(), None, |c| {
        c.arg("--metrics").arg(&sock);
    });
    for i in 0..4 {
        write(&up, i);
    }
    for _ in 0..3 {
        read(&up);
    }
    // A crash: the dead server's counts are carried, not lost.
    let tree = registry(&up);
    let pid = find_node(&tree, "driver").unwrap()["props"]["pid"]
        .as_u64()
        .unwrap() as u32;
    assert!(common::signal_child_of(
        up.child.as_ref().unwrap().id(),
        pid,
        rustix::process::Signal::KILL
    ));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = stdout(&up.run(&["ls"]));
        if text.contains("restarts=1") && text.contains("state=serving") {
            break;
        }
        assert!(Instant::now() < deadline, "no restart: {text}");
        std::thread::sleep(Duration::from_millis(50));
    }
    write(&up, 9);
    read(&up);
    let (writes, reads) = (5u64, 4u64);
    let requests = 2 * writes + reads;
    let bytes = (writes + reads) * CHUNK as u64;

    let tree = registry(&up);
    let disk = find_node(&tree, "block-device").unwrap();
    let p = &disk["props"];
    assert_eq!(p["requests"], requests, "{p}");
    assert_eq!(p["bytes"], bytes, "{p}");
    assert_eq!(
        (p["errors"].as_u64(), p["in-flight"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(
        p["capacity-bytes"],
        64u64 << 20,
        "the default disk's size in bytes: {p}"
    );
    // Every one of them entered the device; a sample of them was timed (all, at this pace,
    // but for one that went in within 20 µs of the last timing).
    let samples = p["latency-ns.samples"].as_u64().unwrap();
    assert!(requests / 2 <= samples && samples <= requests, "{p}");
    let (p50, p99, p999) = (
        p["latency-ns.p50"].as_u64().unwrap(),
        p["latency-ns.p99"].as_u64().unwrap(),
        p["latency-ns.p999"].as_u64().unwrap(),
    );
    assert!(
        1_000 < p50 && p50 <= p99 && p99 <= p999 && p999 < 10_000_000_000,
        "{p}"
    );
    let driver = find_node(&tree, "driver").unwrap();
    assert!(driver["props"]["cpu-seconds"].is_f64(), "{driver}");
    assert!(
        driver["props"]["rss-bytes"].as_u64().unwrap() > 1 << 20,
        "{driver}"
    );
    assert_ne!(driver["props"]["pid"].as_u64().unwrap() as u32, pid);

    let top = up.run(&["top", "--once", "--json", "--interval", "200ms"]);
    assert!(
        top.status.success(),
        "{}",
        String::from_utf8_lossy(&top.stderr)
    );
    let top: serde_json::Value = serde_json::from_slice(&top.stdout).unwrap();
    let d = &top["devices"][0];
    assert_eq!(
        (d["name"].as_str(), d["requests"].as_u64()),
        (Some("disk0"), Some(requests))
    );
    assert_eq!(
        (d["bytes"].as_u64(), d["restarts"].as_u64()),
        (Some(bytes), Some(1))
    );
    assert_eq!(d["latency"]["p99"].as_u64(), Some(p99));
    assert_eq!(d["iops"], 0.0, "nothing ran during the interval");
    let roles: Vec<&str> = top["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["role"].as_str())
        .collect();
    assert!(
        roles.contains(&"model disk0") && roles.contains(&"server disk0-server"),
        "{roles:?}"
    );

    let m = scrape(&sock);
    assert_eq!(
        metric(&m, "outboard_device_requests_total", "disk0"),
        requests as f64
    );
    assert_eq!(
        metric(&m, "outboard_device_bytes_total", "disk0"),
        bytes as f64
    );
    assert_eq!(metric(&m, "outboard_device_errors_total", "disk0"), 0.0);
    assert_eq!(metric(&m, "outboard_device_restarts_total", "disk0"), 1.0);
    assert_eq!(
        metric(&m, "outboard_device_latency_seconds_count", "disk0"),
        samples as f64
    );
    let q99 = m
        .iter()
        .find(|(n, l, _)| n == "outboard_device_latency_seconds" && l["quantile"] == "0.99")
        .expect("a p99 quantile")
        .2;
    assert!((q99 - p99 as f64 / 1e9).abs() < 1e-9, "{q99} vs {p99} ns");
    up.interrupt();
}

#[test]
fn a_metrics_endpoint_answers_bad_requests_with_an_error_and_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("metrics.sock");
    let mut up = Up::start_with(dir.path(), None, |c| {
        c.arg("--metrics").arg(&sock);
    });
    let ask = |request: &[u8]| {
        let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = c.write_all(request);
        let _ = c.shutdown(std::net::Shutdown::Write);
        let mut answer = String::new();
        let _ = c.read_to_string(&mut answer);
        answer
    };
    assert!(ask(b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    assert!(ask(b"GET /secrets HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    assert!(ask(&vec![b'x'; 20000]).starts_with("HTTP/1.1 431"));
    assert!(ask(b"GET /met").starts_with("HTTP/1.1 400"));
    // A client sending a byte at a time holds the endpoint no longer than its 2 s.
    let started = Instant::now();
    let mut slow = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut trickle = slow.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        for b in b"GET /metrics HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
            if trickle.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let mut answer = String::new();
    let _ = slow.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    writer.join().unwrap();
    let head = ask(b"HEAD /metrics HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        length > 100 && head.ends_with("\r\n\r\n"),
        "HEAD: a length, no body: {head}"
    );
    assert!(!scrape(&sock).is_empty(), "the endpoint still answers");
    // A second `up` cannot take a live endpoint's socket.
    let other = tempfile::tempdir().unwrap();
    let r = std::process::Command::new(common::EXE)
        .args(["up", "--metrics"])
        .arg(&sock)
        .env("OUTBOARD_CONTROL", other.path().join("control.sock"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!r.status.success());
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("listening there already"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    up.interrupt();
}
