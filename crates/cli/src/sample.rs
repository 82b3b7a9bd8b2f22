//! One look at what a running machine has done, read from its registry (`outboard ls --json`
//! carries the counters): the numbers `outboard top` and the metrics endpoint show.

use outboard_manager::registry::Node;
use serde::Serialize;

/// A class device's numbers, as of one sample.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Device {
    /// Class device name.
    pub name: String,
    /// Its class.
    pub class: String,
    /// Its state word.
    pub state: String,
    /// Its driver.
    pub driver: String,
    /// Its placement (`separate`, `grouped`, …).
    pub placement: String,
    /// Its driver server's name and pid, if it runs in one.
    pub server: String,
    /// The driver server's pid.
    pub server_pid: Option<u64>,
    /// Restarts of its driver server.
    pub restarts: u64,
    /// Requests answered.
    pub requests: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Requests answered with an error.
    pub errors: u64,
    /// Errors by kind.
    pub errors_by_kind: Vec<(String, u64)>,
    /// Requests in the server now.
    pub in_flight: u64,
    /// Sessions resumed after a restart of its driver server.
    pub resumes: u64,
    /// Requests their clients sent again after a restart.
    pub replays: u64,
    /// Latency since the machine came up.
    pub latency: Latency,
    /// Sessions open now.
    pub sessions: u64,
}

/// Request latency in the driver server, since the machine came up (ns).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Latency {
    /// Median.
    pub p50: Option<u64>,
    /// 99th percentile.
    pub p99: Option<u64>,
    /// 99.9th percentile.
    pub p999: Option<u64>,
    /// Sum of the samples.
    pub sum_ns: u64,
    /// Samples.
    pub samples: u64,
}

/// A process of the machine.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Process {
    /// What it is (`model disk0`, `server disk0-server`, `export nbd:disk0`).
    pub role: String,
    /// Its pid.
    pub pid: u64,
    /// CPU time so far, seconds.
    pub cpu_seconds: f64,
    /// Resident memory, bytes.
    pub rss_bytes: u64,
}

/// An export and its clients.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Export {
    /// Its name (`nbd:disk0`).
    pub name: String,
    /// The device it serves.
    pub device: String,
    /// Where clients connect.
    pub uri: String,
    /// Clients connected now.
    pub clients: u64,
    /// Their addresses.
    pub peers: String,
}

/// Everything one sample holds.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Sample {
    /// Class devices.
    pub devices: Vec<Device>,
    /// Processes.
    pub processes: Vec<Process>,
    /// Exports.
    pub exports: Vec<Export>,
}

fn text(n: &Node, key: &str) -> String {
    match n.props.get(key) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => String::new(),
    }
}

fn num(n: &Node, key: &str) -> u64 {
    n.props
        .get(key)
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
}

impl Sample {
    /// The numbers in `tree`.
    pub fn of(tree: &Node) -> Self {
        let mut s = Self::default();
        s.walk(tree, None);
        s
    }

    fn walk(&mut self, n: &Node, driver: Option<&Node>) {
        if let Some(pid) = n.props.get("pid").and_then(serde_json::Value::as_u64) {
            let role = match n.kind.as_str() {
                "pci-function" => format!("model {}", n.name.trim_end_matches("@vfio-user")),
                "driver" if n.props.contains_key("server") => {
                    format!("server {}", text(n, "server"))
                }
                kind => format!("{kind} {}", n.name),
            };
            self.processes.push(Process {
                role,
                pid,
                cpu_seconds: n
                    .props
                    .get("cpu-seconds")
                    .and_then(serde_json::Value::as_f64)
                    .unwrap_or(0.0),
                rss_bytes: num(n, "rss-bytes"),
            });
        }
        if n.kind.ends_with("-device") {
            self.devices.push(self.device(n, driver));
            for c in n.children.iter().filter(|c| c.kind == "export") {
                self.exports.push(Export {
                    name: c.name.clone(),
                    device: n.name.clone(),
                    uri: text(c, "uri"),
                    clients: num(c, "clients"),
                    peers: text(c, "peers"),
                });
            }
        }
        let driver = if n.kind == "driver" { Some(n) } else { driver };
        for c in &n.children {
            self.walk(c, driver);
        }
    }

    fn device(&self, n: &Node, driver: Option<&Node>) -> Device {
        let of_driver = |key: &str| driver.map(|d| text(d, key)).unwrap_or_default();
        let pct = |q: &str| {
            n.props
                .get(&format!("latency-ns.{q}"))
                .and_then(|v| v.as_u64())
        };
        Device {
            name: n.name.clone(),
            class: text(n, "class"),
            state: text(n, "state")
                .split_whitespace()
                .next()
                .unwrap_or("")
                .into(),
            driver: driver.map(|d| d.name.clone()).unwrap_or_default(),
            placement: of_driver("placement"),
            server: of_driver("server"),
            server_pid: driver.and_then(|d| d.props.get("pid")?.as_u64()),
            restarts: driver.map_or(0, |d| num(d, "restarts")),
            requests: num(n, "requests"),
            bytes: num(n, "bytes"),
            errors: num(n, "errors"),
            errors_by_kind: n
                .props
                .iter()
                .filter_map(|(k, v)| Some((k.strip_prefix("errors.")?.to_string(), v.as_u64()?)))
                .collect(),
            in_flight: num(n, "in-flight"),
            resumes: num(n, "resumes"),
            replays: num(n, "replays"),
            latency: Latency {
                p50: pct("p50"),
                p99: pct("p99"),
                p999: pct("p999"),
                sum_ns: num(n, "latency-ns.sum"),
                samples: num(n, "latency-ns.samples"),
            },
            sessions: n.children.iter().filter(|c| c.kind == "session").count() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registry_gives_its_devices_processes_and_exports() {
        let tree = Node::new("machine", "m").child(
            Node::new("pci-function", "disk0@vfio-user")
                .with("pid", 10)
                .with("cpu-seconds", 1.5)
                .child(
                    Node::new("driver", "virtio-blk")
                        .with("pid", 11)
                        .with("server", "disk0-server")
                        .with("placement", "separate")
                        .with("restarts", 2)
                        .child(
                            Node::new("block-device", "disk0")
                                .with("class", "block")
                                .with("state", "serving")
                                .with("requests", 7)
                                .with("bytes", 4096)
                                .with("errors.io", 1)
                                .with("latency-ns.p50", 900)
                                .child(Node::new("session", "3"))
                                .child(
                                    Node::new("export", "nbd:disk0")
                                        .with("uri", "nbd://x")
                                        .with("clients", 1),
                                ),
                        ),
                ),
        );
        let s = Sample::of(&tree);
        let d = &s.devices[0];
        assert_eq!((d.name.as_str(), d.requests, d.bytes), ("disk0", 7, 4096));
        assert_eq!((d.server_pid, d.restarts, d.sessions), (Some(11), 2, 1));
        assert_eq!(d.errors_by_kind, vec![("io".to_string(), 1)]);
        assert_eq!((d.latency.p50, d.latency.p99), (Some(900), None));
        let roles: Vec<&str> = s.processes.iter().map(|p| p.role.as_str()).collect();
        assert_eq!(roles, ["model disk0", "server disk0-server"]);
        assert_eq!(s.exports[0].uri, "nbd://x");
    }
}
