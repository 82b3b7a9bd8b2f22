//! `outboard top`: what the machine is doing, refreshed each interval — per device its
//! driver and placement, IOPS, bandwidth, errors, requests in flight, latency percentiles,
//! restarts and sessions; per process its CPU and memory; the exports and their clients.
//! Like `spdk_top`, as a plain table redrawn in place; `--once --json` for scripts.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use serde::Serialize;

use crate::sample::{Device, Sample};

/// `outboard top`.
#[derive(Args)]
pub struct TopArgs {
    /// Time between samples (rates are over it).
    #[arg(long, default_value = "1s", value_parser = crate::up::parse_duration)]
    interval: Duration,
    /// Order devices by this column, largest first (name: alphabetical).
    #[arg(long, value_enum, default_value_t = SortBy::Iops)]
    sort: SortBy,
    /// Take two samples one interval apart, print once and exit.
    #[arg(long)]
    once: bool,
    /// Print JSON (with --once) instead of a table.
    #[arg(long, requires = "once")]
    json: bool,
    /// Stop after this many refreshes (without it, until Ctrl-C).
    #[arg(long, value_name = "N")]
    iterations: Option<u64>,
}

/// The columns `--sort` may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SortBy {
    /// Device name.
    Name,
    /// Requests per second.
    Iops,
    /// Bytes per second.
    Bandwidth,
    /// 99th percentile latency.
    Latency,
    /// Errors per second.
    Errors,
    /// Requests in flight.
    Queue,
    /// Restarts of its driver.
    Restarts,
}

/// A device over one interval.
#[derive(Debug, Clone, Serialize)]
pub struct Rates {
    /// What the device is and its totals at the end of the interval.
    #[serde(flatten)]
    pub device: Device,
    /// Requests answered per second over the interval.
    pub iops: f64,
    /// Bytes per second over the interval.
    pub bytes_per_second: f64,
    /// Errors per second over the interval.
    pub errors_per_second: f64,
}

/// A process over one interval.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessRates {
    /// The process.
    #[serde(flatten)]
    pub process: crate::sample::Process,
    /// Its CPU use over the interval, percent of one CPU.
    pub cpu_percent: f64,
}

/// What `top` shows: two samples' difference.
#[derive(Debug, Clone, Serialize)]
pub struct View {
    /// Seconds between the samples.
    pub interval_seconds: f64,
    /// Devices, sorted.
    pub devices: Vec<Rates>,
    /// Processes.
    pub processes: Vec<ProcessRates>,
    /// Exports.
    pub exports: Vec<crate::sample::Export>,
}

/// The view of what happened between `before` and `after`, `dt` apart.
pub fn view(before: &Sample, after: &Sample, dt: Duration, sort: SortBy) -> View {
    let secs = dt.as_secs_f64().max(1e-9);
    let rate = |a: u64, b: u64| a.saturating_sub(b) as f64 / secs;
    let mut devices: Vec<Rates> = after
        .devices
        .iter()
        .map(|d| {
            // A device that was not there before (or restarted its counts) rates from zero.
            let was = before.devices.iter().find(|b| b.name == d.name);
            let (r, b, e) = was.map_or((0, 0, 0), |w| (w.requests, w.bytes, w.errors));
            Rates {
                device: d.clone(),
                iops: rate(d.requests, r.min(d.requests)),
                bytes_per_second: rate(d.bytes, b.min(d.bytes)),
                errors_per_second: rate(d.errors, e.min(d.errors)),
            }
        })
        .collect();
    let key = |r: &Rates| -> f64 {
        match sort {
            SortBy::Name => 0.0,
            SortBy::Iops => r.iops,
            SortBy::Bandwidth => r.bytes_per_second,
            SortBy::Latency => r.device.latency.p99.unwrap_or(0) as f64,
            SortBy::Errors => r.errors_per_second,
            SortBy::Queue => r.device.in_flight as f64,
            SortBy::Restarts => r.device.restarts as f64,
        }
    };
    devices.sort_by(|a, b| {
        key(b)
            .total_cmp(&key(a))
            .then_with(|| a.device.name.cmp(&b.device.name))
    });
    let processes = after
        .processes
        .iter()
        .map(|p| {
            let was = before
                .processes
                .iter()
                .find(|b| b.pid == p.pid)
                .map_or(p.cpu_seconds, |b| b.cpu_seconds);
            ProcessRates {
                process: p.clone(),
                cpu_percent: ((p.cpu_seconds - was).max(0.0) / secs * 100.0).min(100.0 * 1024.0),
            }
        })
        .collect();
    View {
        interval_seconds: secs,
        devices,
        processes,
        exports: after.exports.clone(),
    }
}

fn si(v: f64, unit: &str) -> String {
    let (v, p) = match v {
        v if v >= 1e9 => (v / 1e9, "G"),
        v if v >= 1e6 => (v / 1e6, "M"),
        v if v >= 1e3 => (v / 1e3, "k"),
        v => (v, ""),
    };
    format!("{v:.1} {p}{unit}")
}

fn latency(ns: Option<u64>) -> String {
    match ns {
        None => "-".into(),
        Some(n) if n >= 1_000_000 => format!("{:.1} ms", n as f64 / 1e6),
        Some(n) => format!("{:.1} µs", n as f64 / 1e3),
    }
}

fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n => format!("{:.1} KiB", n as f64 / 1024.0),
    }
}

/// Columns as text, each padded to its widest cell.
pub(crate) fn table(head: &[&str], rows: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&width)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        padded.join("  ").trim_end().to_string() + "\n"
    };
    let mut out = line(head.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r.clone()));
    }
    out
}

/// The view as tables.
pub fn render(v: &View) -> String {
    let rows: Vec<Vec<String>> = v
        .devices
        .iter()
        .map(|r| {
            let d = &r.device;
            vec![
                d.name.clone(),
                d.class.clone(),
                d.state.clone(),
                d.driver.clone(),
                d.placement.clone(),
                format!("{:.0}", r.iops),
                si(r.bytes_per_second, "B/s"),
                d.in_flight.to_string(),
                latency(d.latency.p50),
                latency(d.latency.p99),
                latency(d.latency.p999),
                format!("{:.0}", r.errors_per_second),
                d.restarts.to_string(),
                d.replays.to_string(),
                d.sessions.to_string(),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "DEVICE",
            "CLASS",
            "STATE",
            "DRIVER",
            "PLACEMENT",
            "IOPS",
            "BANDWIDTH",
            "QUEUE",
            "P50",
            "P99",
            "P999",
            "ERR/S",
            "RESTARTS",
            "SESSIONS",
        ],
        &rows,
    );
    out.push('\n');
    let procs: Vec<Vec<String>> = v
        .processes
        .iter()
        .map(|p| {
            vec![
                p.process.role.clone(),
                p.process.pid.to_string(),
                format!("{:.1}", p.cpu_percent),
                bytes(p.process.rss_bytes),
            ]
        })
        .collect();
    out.push_str(&table(&["PROCESS", "PID", "CPU%", "RSS"], &procs));
    if !v.exports.is_empty() {
        out.push('\n');
        let ex: Vec<Vec<String>> = v
            .exports
            .iter()
            .map(|e| {
                vec![
                    e.name.clone(),
                    e.device.clone(),
                    e.uri.clone(),
                    e.clients.to_string(),
                    e.peers.clone(),
                ]
            })
            .collect();
        out.push_str(&table(
            &["EXPORT", "DEVICE", "URI", "CLIENTS", "PEERS"],
            &ex,
        ));
    }
    out.push_str("\nlatency percentiles are since the machine came up; rates over the interval\n");
    out
}

fn sample(control: &std::path::Path) -> Result<(Sample, Instant), String> {
    let tree = outboard_manager::open::registry(control).map_err(|e| e.to_string())?;
    Ok((Sample::of(&tree), Instant::now()))
}

/// `outboard top`.
pub fn run(a: TopArgs, control: PathBuf) -> Result<ExitCode, String> {
    if a.interval.is_zero() {
        return Err("--interval must be longer than zero".into());
    }
    let mut before = sample(&control)?;
    let mut shown = 0u64;
    loop {
        std::thread::sleep(a.interval);
        let after = sample(&control)?;
        let v = view(&before.0, &after.0, after.1 - before.1, a.sort);
        if a.once {
            if a.json {
                let text = serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?;
                outboard_sys::outln!("{text}");
            } else {
                print!("{}", render(&v));
            }
            return Ok(ExitCode::SUCCESS);
        }
        // Home and clear, then the tables: redrawn in place.
        print!("\x1b[H\x1b[2J{}", render(&v));
        use std::io::Write;
        let _ = std::io::stdout().flush();
        shown += 1;
        if a.iterations.is_some_and(|n| shown >= n) {
            return Ok(ExitCode::SUCCESS);
        }
        before = after;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::Device;

    fn dev(name: &str, requests: u64, bytes: u64) -> Device {
        Device {
            name: name.into(),
            class: "block".into(),
            state: "serving".into(),
            driver: "virtio-blk".into(),
            placement: "separate".into(),
            server: "s".into(),
            server_pid: Some(1),
            restarts: 0,
            requests,
            bytes,
            errors: 0,
            errors_by_kind: Vec::new(),
            in_flight: 0,
            resumes: 0,
            replays: 0,
            latency: crate::sample::Latency {
                p50: Some(1500),
                ..Default::default()
            },
            sessions: 1,
        }
    }

    #[test]
    fn rates_are_over_the_interval_and_sorted_by_the_column_asked() {
        let before = Sample {
            devices: vec![dev("a", 100, 0), dev("b", 100, 0)],
            ..Default::default()
        };
        let after = Sample {
            devices: vec![dev("a", 300, 4096), dev("b", 1100, 0), dev("c", 50, 0)],
            ..Default::default()
        };
        let v = view(&before, &after, Duration::from_secs(2), SortBy::Iops);
        let got: Vec<(&str, f64)> = v
            .devices
            .iter()
            .map(|r| (r.device.name.as_str(), r.iops))
            .collect();
        assert_eq!(got, [("b", 500.0), ("a", 100.0), ("c", 25.0)]);
        let v = view(&before, &after, Duration::from_secs(2), SortBy::Bandwidth);
        assert_eq!(v.devices[0].device.name, "a");
        assert_eq!(v.devices[0].bytes_per_second, 2048.0);
        let text = render(&v);
        assert!(text.contains("DEVICE") && text.contains("1.5 µs"), "{text}");
    }
}
