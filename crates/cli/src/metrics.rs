//! `outboard up --metrics ADDR|PATH`: the machine's counters over HTTP in the OpenMetrics text
//! format (what Prometheus and its kin scrape), on a TCP address (`127.0.0.1:9100`) or a UNIX
//! socket (a path).
//!
//! A thread of `outboard up` serves it, one connection at a time: it reads one request
//! (at most 8 KiB of head within 2 s in all, so a slow or hostile client holds it at most
//! that long),
//! asks the manager for the registry on the control socket — as `outboard ls` does, so the
//! numbers are the same — and answers. The manager's loop never waits for a scraper.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::sample::Sample;

/// Largest request head read.
const MAX_REQUEST: usize = 8192;
/// How long a client may take to send its request or read the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the endpoint listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A TCP address.
    Tcp(std::net::SocketAddr),
    /// A UNIX stream socket.
    Unix(PathBuf),
}

/// `ADDR` (host:port) or `PATH` (anything with a `/`).
pub fn parse_endpoint(s: &str) -> Result<Endpoint, String> {
    if s.contains('/') {
        return Ok(Endpoint::Unix(PathBuf::from(s)));
    }
    s.parse().map(Endpoint::Tcp).map_err(|_| {
        format!(
            "{s:?} is neither HOST:PORT (e.g. 127.0.0.1:9100, [::1]:9100) nor a socket path \
             (one with a /, e.g. ./metrics.sock)"
        )
    })
}

/// A stream a scraper connected on.
trait Conn: Read + Write {
    fn timeouts(&self, t: Duration) -> std::io::Result<()>;
}

impl Conn for std::net::TcpStream {
    fn timeouts(&self, t: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
}

impl Conn for std::os::unix::net::UnixStream {
    fn timeouts(&self, t: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
}

/// Binds `at` and serves it from a thread of its own for as long as the process runs; an
/// error if it cannot be bound (before `up` says it is up).
pub fn serve(at: &Endpoint, control: PathBuf) -> Result<(), String> {
    match at {
        Endpoint::Tcp(addr) => {
            let l =
                std::net::TcpListener::bind(addr).map_err(|e| format!("--metrics {addr}: {e}"))?;
            spawn(move || {
                for c in l.incoming().flatten() {
                    answer(c, &control);
                }
            })
        }
        Endpoint::Unix(path) => {
            let l = bind_unix(path)?;
            spawn(move || {
                for c in l.incoming().flatten() {
                    answer(c, &control);
                }
            })
        }
    }
}

fn spawn(f: impl FnOnce() + Send + 'static) -> Result<(), String> {
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(f)
        .map(drop)
        .map_err(|e| format!("--metrics: {e}"))
}

/// A stale socket file of a dead `up` is replaced; a live one (someone answers) is not.
fn bind_unix(path: &Path) -> Result<UnixListener, String> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!(
                "--metrics {}: something is listening there already",
                path.display()
            ));
        }
        std::fs::remove_file(path).map_err(|e| format!("--metrics {}: {e}", path.display()))?;
    }
    UnixListener::bind(path).map_err(|e| format!("--metrics {}: {e}", path.display()))
}

/// Reads the request head: up to the blank line, at most [`MAX_REQUEST`] bytes, within
/// [`IO_TIMEOUT`] in all (each read waits only what is left of it, so a client sending a
/// byte at a time cannot hold the endpoint).
fn read_head(c: &mut impl Conn) -> Result<String, u16> {
    let deadline = std::time::Instant::now() + IO_TIMEOUT;
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && !buf.windows(2).any(|w| w == b"\n\n") {
        if buf.len() > MAX_REQUEST {
            return Err(431);
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || c.timeouts(left).is_err() {
            return Err(408);
        }
        match c.read(&mut chunk) {
            Ok(0) => return Err(400),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(408)
            }
            Err(_) => return Err(400),
        }
    }
    String::from_utf8(buf).map_err(|_| 400)
}

/// What a request gets: (status, content type, body).
fn respond(head: &str, scrape: impl FnOnce() -> Result<String, String>) -> (u16, String, String) {
    let plain = "text/plain; charset=utf-8".to_string();
    let line = head.lines().next().unwrap_or("");
    let parts: Vec<&str> = line.split(' ').collect();
    let [method, target, version] = parts[..] else {
        return (400, plain, "bad request line\n".into());
    };
    if !version.starts_with("HTTP/1.") {
        return (505, plain, "HTTP/1.x only\n".into());
    }
    if method != "GET" && method != "HEAD" {
        return (405, plain, "GET only\n".into());
    }
    let path = target.split('?').next().unwrap_or("");
    if path != "/metrics" && path != "/" {
        return (404, plain, "the metrics are at /metrics\n".into());
    }
    match scrape() {
        Ok(body) => (
            200,
            "application/openmetrics-text; version=1.0.0; charset=utf-8".into(),
            body,
        ),
        Err(e) => (503, plain, format!("the manager did not answer: {e}\n")),
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Error",
    }
}

fn answer(mut c: impl Conn, control: &Path) {
    if c.timeouts(IO_TIMEOUT).is_err() {
        return;
    }
    let (status, kind, body, head_only) = match read_head(&mut c) {
        Ok(head) => {
            let (s, k, b) = respond(&head, || scrape(control));
            (s, k, b, head.starts_with("HEAD "))
        }
        Err(status) => (
            status,
            "text/plain".into(),
            format!("{}\n", reason(status)),
            false,
        ),
    };
    // A HEAD answer says the length a GET's body would have, and sends none.
    let _ = write!(
        c,
        "HTTP/1.1 {status} {}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        reason(status),
        body.len(),
        if head_only { "" } else { &body }
    );
}

fn scrape(control: &Path) -> Result<String, String> {
    let tree = outboard_manager::open::registry(control).map_err(|e| e.to_string())?;
    Ok(render(&Sample::of(&tree)))
}

/// A label value, escaped as the format asks.
fn label(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

/// One metric family being written.
struct Family<'a> {
    out: &'a mut String,
    name: &'a str,
}

impl<'a> Family<'a> {
    fn new(out: &'a mut String, name: &'static str, kind: &str, unit: &str, help: &str) -> Self {
        out.push_str(&format!("# TYPE {name} {kind}\n"));
        if !unit.is_empty() {
            out.push_str(&format!("# UNIT {name} {unit}\n"));
        }
        out.push_str(&format!("# HELP {name} {help}\n"));
        Self { out, name }
    }

    fn sample(&mut self, suffix: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        let l: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", label(v)))
            .collect();
        self.out.push_str(&format!(
            "{}{suffix}{{{}}} {value}\n",
            self.name,
            l.join(",")
        ));
    }
}

/// A family of per-device samples: name, type, unit, help, sample suffix, the value.
type DeviceFamily = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    fn(&crate::sample::Device) -> u64,
);

/// Writes `families`, a sample per device each, labelled with the device and its class.
fn per_device(out: &mut String, s: &Sample, families: &[DeviceFamily]) {
    for &(name, kind, unit, help, suffix, value) in families {
        let mut f = Family::new(out, name, kind, unit, help);
        for d in &s.devices {
            f.sample(
                suffix,
                &[("device", &d.name), ("class", &d.class)],
                value(d),
            );
        }
    }
}

/// A family of per-process samples: name, type, unit, help, sample suffix, the value.
type ProcessFamily = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    fn(&crate::sample::Process) -> f64,
);

/// A sample in the OpenMetrics text format.
pub fn render(s: &Sample) -> String {
    let mut out = String::new();
    let devices: [DeviceFamily; 3] = [
        (
            "outboard_device_requests",
            "counter",
            "",
            "Requests answered.",
            "_total",
            |d| d.requests,
        ),
        (
            "outboard_device_bytes",
            "counter",
            "bytes",
            "Bytes moved by the requests that succeeded.",
            "_total",
            |d| d.bytes,
        ),
        (
            "outboard_device_errors",
            "counter",
            "",
            "Requests answered with an error.",
            "_total",
            |d| d.errors,
        ),
    ];
    per_device(&mut out, s, &devices);
    {
        let mut f = Family::new(
            &mut out,
            "outboard_device_errors_by_kind",
            "counter",
            "",
            "Requests answered with an error, by the class's kind of error.",
        );
        for d in &s.devices {
            for (kind, n) in &d.errors_by_kind {
                f.sample(
                    "_total",
                    &[("device", &d.name), ("class", &d.class), ("kind", kind)],
                    n,
                );
            }
        }
    }
    let devices: [DeviceFamily; 5] = [
        (
            "outboard_device_in_flight",
            "gauge",
            "",
            "Requests taken by the driver server and not yet answered.",
            "",
            |d| d.in_flight,
        ),
        (
            "outboard_device_restarts",
            "counter",
            "",
            "Restarts of the device's driver server.",
            "_total",
            |d| d.restarts,
        ),
        (
            "outboard_device_resumes",
            "counter",
            "",
            "Client sessions resumed after a restart of the device's driver server.",
            "_total",
            |d| d.resumes,
        ),
        (
            "outboard_device_replays",
            "counter",
            "",
            "Requests clients sent again after a restart (the class's replay).",
            "_total",
            |d| d.replays,
        ),
        (
            "outboard_device_sessions",
            "gauge",
            "",
            "Client sessions open on the device.",
            "",
            |d| d.sessions,
        ),
    ];
    per_device(&mut out, s, &devices);
    {
        let mut f = Family::new(
            &mut out,
            "outboard_device_latency_seconds",
            "summary",
            "seconds",
            "Request latency in the driver server since the machine came up.",
        );
        for d in &s.devices {
            let labels = [("device", d.name.as_str()), ("class", d.class.as_str())];
            for (q, v) in [
                ("0.5", d.latency.p50),
                ("0.99", d.latency.p99),
                ("0.999", d.latency.p999),
            ] {
                if let Some(ns) = v {
                    let mut l = labels.to_vec();
                    l.push(("quantile", q));
                    f.sample("", &l, ns as f64 / 1e9);
                }
            }
            f.sample("_sum", &labels, d.latency.sum_ns as f64 / 1e9);
            f.sample("_count", &labels, d.latency.samples);
        }
    }
    let processes: [ProcessFamily; 2] = [
        (
            "outboard_process_cpu_seconds",
            "counter",
            "seconds",
            "CPU time (user and system) of each process of the machine.",
            "_total",
            |p| p.cpu_seconds,
        ),
        (
            "outboard_process_resident_memory_bytes",
            "gauge",
            "bytes",
            "Resident memory of each process of the machine.",
            "",
            |p| p.rss_bytes as f64,
        ),
    ];
    for (name, kind, unit, help, suffix, value) in processes {
        let mut f = Family::new(&mut out, name, kind, unit, help);
        for p in &s.processes {
            let pid = p.pid.to_string();
            f.sample(suffix, &[("role", &p.role), ("pid", &pid)], value(p));
        }
    }
    {
        let mut f = Family::new(
            &mut out,
            "outboard_export_clients",
            "gauge",
            "",
            "Clients connected to each export.",
        );
        for e in &s.exports {
            f.sample(
                "",
                &[("export", &e.name), ("device", &e.device), ("uri", &e.uri)],
                e.clients,
            );
        }
    }
    out.push_str("# EOF\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_addresses_or_paths() {
        assert_eq!(
            parse_endpoint("127.0.0.1:9100").unwrap(),
            Endpoint::Tcp("127.0.0.1:9100".parse().unwrap())
        );
        assert_eq!(
            parse_endpoint("./m.sock").unwrap(),
            Endpoint::Unix("./m.sock".into())
        );
        assert!(parse_endpoint("localhost")
            .unwrap_err()
            .contains("HOST:PORT"));
    }

    impl Conn for std::io::Cursor<Vec<u8>> {
        fn timeouts(&self, _: Duration) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn requests_get_the_right_status() {
        let ok = || Ok("x".to_string());
        assert_eq!(respond("GET /metrics HTTP/1.1\r\n", ok).0, 200);
        assert_eq!(respond("GET /other HTTP/1.1\r\n", ok).0, 404);
        assert_eq!(respond("POST /metrics HTTP/1.1\r\n", ok).0, 405);
        assert_eq!(respond("POST /other HTTP/1.1\r\n", ok).0, 405);
        assert_eq!(respond("GET /metrics SPDY/3\r\n", ok).0, 505);
        assert_eq!(respond("nonsense\r\n", ok).0, 400);
        assert_eq!(
            respond("GET /metrics HTTP/1.0\r\n", || Err("x".into())).0,
            503
        );
        let mut big = std::io::Cursor::new(vec![b'a'; MAX_REQUEST * 2]);
        assert_eq!(read_head(&mut big), Err(431));
        let mut cut = std::io::Cursor::new(b"GET / HTTP/1.1\r\n".to_vec());
        assert_eq!(read_head(&mut cut), Err(400));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), r#"a\"b\\c\nd"#);
    }
}
