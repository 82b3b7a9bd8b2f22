//! `outboard bench all --quick` runs every test and writes well-formed, complete results. This
//! checks the machinery, not the numbers (benchmarks report numbers; tests assert behaviour).

use std::process::Command;

#[test]
fn quick_bench_writes_complete_json_charts_and_report() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results");
    let o = Command::new(env!("CARGO_BIN_EXE_outboard"))
        .args(["bench", "all", "--quick", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report = std::fs::read_to_string(out.join("REPORT.md")).unwrap();
    let expect = [
        (
            "disk-read",
            vec!["kernel", "colocated", "separate", "ipc-only"],
            3,
            9,
        ),
        (
            "iops",
            vec![
                "kernel io_uring, 1 client",
                "colocated, 1 client",
                "separate, 1 client",
                "separate, 2 clients",
            ],
            1,
            2,
        ),
        (
            "null-rtt",
            vec![
                "eventfd ping-pong, one core",
                "session, blocking, one core",
                "eventfd ping-pong, two cores",
                "session, blocking, two cores",
                "cache-line ping-pong",
                "session, adaptive",
            ],
            2,
            1,
        ),
        (
            "trace",
            vec!["kernel", "colocated", "separate", "grouped", "nbd"],
            2,
            1,
        ),
        (
            "exports",
            ["Outboard", "nbdkit memory", "qemu-storage-daemon"]
                .iter()
                .flat_map(|server| {
                    [
                        "read QD1",
                        "read QD32",
                        "write QD1",
                        "write QD32",
                        "in",
                        "out",
                    ]
                    .map(|cell| format!("{server}, {cell}"))
                })
                .collect::<Vec<String>>()
                .leak()
                .iter()
                .map(String::as_str)
                .collect(),
            2,
            1,
        ),
        ("echo", vec!["kernel", "colocated", "separate", "tap"], 3, 6),
        (
            "combination",
            vec!["colocated", "etherapp", "diskether", "separate"],
            4,
            1,
        ),
        (
            "net-load",
            vec![
                "kernel",
                "colocated, 0 µs",
                "colocated, 100 µs",
                "separate, 0 µs",
                "separate, 100 µs",
            ],
            3,
            6,
        ),
        ("net-raw", vec!["kernel", "colocated", "separate"], 6, 6),
        (
            "clock",
            vec![
                "timerfd, a thread",
                "native work loop",
                "osenv, uncontested",
                "osenv, contested",
            ],
            4,
            2,
        ),
    ];
    for (test, configs, figures, points) in expect {
        let v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join(format!("{test}.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(v["test"], test);
        let runs = v["runs"].as_u64().unwrap();
        let kept = runs - v["discarded"].as_u64().unwrap();
        let unavailable: Vec<String> = v["unavailable"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u["config"].as_str().unwrap().to_string())
            .collect();
        for u in v["unavailable"].as_array().unwrap() {
            assert!(
                !u["reason"].as_str().unwrap().is_empty(),
                "an unavailable configuration says why"
            );
        }
        let figs = v["figures"].as_array().unwrap();
        assert_eq!(figs.len(), figures, "{test}");
        for f in figs {
            for key in ["title", "x_label", "y_label", "kind"] {
                assert!(f[key].is_string(), "{test}: figure lacks {key}");
            }
            // The clock's timer drivers in servers: their own series, a point per count of
            // drivers (1 and 2 in a quick run).
            let servers = test == "clock" && f["id"].as_str().unwrap().starts_with("servers");
            let server_configs = [
                "osenv (C driver), 1000 Hz each",
                "native, 1000 Hz each",
                "native (C driver), 1000 Hz each",
            ];
            let configs: Vec<&str> = if servers {
                server_configs.to_vec()
            } else {
                configs.clone()
            };
            for c in &configs {
                if unavailable.iter().any(|u| c.starts_with(u.as_str())) {
                    continue;
                }
                if f["kind"] == "bar" && f["id"] == "throughput" && !c.starts_with("session") {
                    continue;
                }
                // The exports' fio cells are in one figure, their nbdcopy runs in the other.
                if test == "exports" && (f["id"] == "iops") != c.contains("QD") {
                    continue;
                }
                // Echo's TCP chart is iperf3 through the host's stack: the kernel and TAP only,
                // one bar each.
                let tcp = test == "echo" && f["id"] == "tcp";
                if tcp && *c != "kernel" && *c != "tap" {
                    continue;
                }
                let s = f["series"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|s| s["label"] == *c)
                    .unwrap_or_else(|| panic!("{test}: no series {c}"));
                let pts = s["points"].as_array().unwrap();
                assert_eq!(pts.len(), if tcp { 1 } else { points }, "{test}/{c}");
                for p in pts {
                    let y = &p["y"];
                    let (med, min, max) = (
                        y["median"].as_f64().unwrap(),
                        y["min"].as_f64().unwrap(),
                        y["max"].as_f64().unwrap(),
                    );
                    assert!(
                        med.is_finite() && min <= med && med <= max,
                        "{test}/{c}: {y}"
                    );
                    assert_eq!(y["samples"].as_array().unwrap().len() as u64, kept);
                }
            }
            let png = out.join(format!("{test}-{}.png", f["id"].as_str().unwrap()));
            if report.contains(&format!("({test}-{}.png)", f["id"].as_str().unwrap())) {
                let bytes = std::fs::read(&png).unwrap();
                assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", png.display());
            }
        }
        let targets = v["targets"].as_array().unwrap();
        assert!(!targets.is_empty());
        for t in targets {
            assert!(
                report.contains(t["target"].as_str().unwrap()),
                "REPORT.md states {}",
                t["target"]
            );
            assert!(t["met"].is_boolean() || t["met"].is_null());
        }
    }
    // The restart test kills the NIC's driver servers too: a row per victim, with frames
    // counted, and its two charts.
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("restart.json")).unwrap()).unwrap();
    let rows = v["params"]["net_rows"].as_array().unwrap();
    let victims: Vec<&str> = rows.iter().map(|r| r["victim"].as_str().unwrap()).collect();
    assert_eq!(
        victims,
        [
            "net: sender's driver server killed",
            "net: receiver's driver server killed"
        ]
    );
    for r in rows {
        assert!(r["kills"].as_u64().unwrap() > 0, "{r}");
        assert!(r["sent"].as_u64().unwrap() > 0, "{r}");
        assert!(
            r["arrived"].as_u64().unwrap() <= r["sent"].as_u64().unwrap(),
            "{r}"
        );
    }
    for id in ["net-outage", "net-delivered"] {
        assert!(report.contains(&format!("(restart-{id}.png)")), "{id}");
    }
}

/// `--baseline` runs both builds in alternating rounds and pairs every point: here the same
/// program twice, so every point is measured by both and the ping-pongs are references.
#[test]
fn two_builds_compared_pair_every_point_and_name_the_references() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("compared");
    let exe = env!("CARGO_BIN_EXE_outboard");
    let o = Command::new(exe)
        .args([
            "bench",
            "null-rtt",
            "--quick",
            "--rounds",
            "2",
            "--baseline",
            exe,
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        said.contains("points of Outboard's code compared"),
        "{said}"
    );
    for build in ["baseline", "this"] {
        for round in 0..2 {
            let json = out.join(format!("{build}/round-{round}/null-rtt.json"));
            assert!(json.exists(), "{}", json.display());
        }
    }
    let c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("compare.json")).unwrap()).unwrap();
    let rows = c["rows"].as_array().unwrap();
    assert!(rows.len() >= 4, "{c:#}");
    for r in rows {
        assert_eq!(r["paired"].as_array().unwrap().len(), 2, "{r}");
        let reference = r["series"].as_str().unwrap().contains("ping-pong");
        assert_eq!(r["reference"], reference, "{r}");
        assert!(r["better"].is_string(), "{r}");
    }
    assert!(std::fs::read_to_string(out.join("COMPARE.md"))
        .unwrap()
        .contains("| null-rtt | latency (µs) |"));

    let missing = Command::new(exe)
        .args([
            "bench",
            "null-rtt",
            "--quick",
            "--baseline",
            "/nonexistent/outboard",
        ])
        .arg("--out")
        .arg(dir.path().join("none"))
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(
        String::from_utf8_lossy(&missing.stderr)
            .contains("/nonexistent/outboard: no such executable"),
        "{}",
        String::from_utf8_lossy(&missing.stderr)
    );
}
