//! Network namespaces and veth pairs a benchmark makes for itself and removes when dropped:
//! the kernel's side of the network tests runs between two namespaces, so no traffic ever
//! leaves this machine or touches its own interfaces.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A network namespace, deleted when dropped.
pub struct Netns {
    /// Its name.
    pub name: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let o = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

impl Netns {
    /// Makes namespace `name` with its loopback up.
    pub fn new(name: String) -> Result<Self, String> {
        ip(&["netns", "add", &name])?;
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Runs `ip ARGS` inside the namespace.
    pub fn ip(&self, args: &[&str]) -> Result<(), String> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Moves interface `ifname` (in the host's namespace) here, gives it `cidr` and brings it up.
    pub fn adopt(&self, ifname: &str, cidr: &str) -> Result<(), String> {
        ip(&["link", "set", ifname, "netns", &self.name])?;
        self.ip(&["addr", "add", cidr, "dev", ifname])?;
        self.ip(&["link", "set", ifname, "up"])
    }

    /// A command that runs `program` inside the namespace.
    pub fn command(&self, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c.stdin(Stdio::null());
        c
    }

    /// Starts `program args…` inside the namespace with its output discarded (a peer
    /// server a measurement talks to), stopped when the result is dropped.
    pub fn serve_quietly(&self, program: &str, args: &[&str]) -> Result<Running, String> {
        self.command(Path::new(program))
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map(Running)
            .map_err(|e| format!("{program}: {e}"))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// Two namespaces joined by a veth pair: `a` is 10.x.0.1/24, `b` 10.x.0.2/24.
pub struct VethPair {
    /// The first end's namespace.
    pub a: Netns,
    /// The second end's namespace.
    pub b: Netns,
}

impl VethPair {
    /// Two namespaces named after `tag`, joined by a veth pair on subnet 10.`subnet`.0.0/24.
    pub fn new(tag: &str, subnet: u8) -> Result<Self, String> {
        let a = Netns::new(format!("{tag}-a"))?;
        let b = Netns::new(format!("{tag}-b"))?;
        ip(&[
            "link",
            "add",
            "ob-veth-a",
            "netns",
            &a.name,
            "type",
            "veth",
            "peer",
            "name",
            "ob-veth-b",
            "netns",
            &b.name,
        ])?;
        a.ip(&[
            "addr",
            "add",
            &format!("10.{subnet}.0.1/24"),
            "dev",
            "ob-veth-a",
        ])?;
        b.ip(&[
            "addr",
            "add",
            &format!("10.{subnet}.0.2/24"),
            "dev",
            "ob-veth-b",
        ])?;
        a.ip(&["link", "set", "ob-veth-a", "up"])?;
        b.ip(&["link", "set", "ob-veth-b", "up"])?;
        Ok(Self { a, b })
    }
}

/// A child ended when dropped.
pub struct Running(pub Child);

impl Running {
    /// Waits up to `limit` for the child to end, then the line it printed next on its piped
    /// standard output; `what` names it in errors.
    pub fn last_line(mut self, limit: Duration, what: &str) -> Result<String, String> {
        let deadline = Instant::now() + limit;
        while self.0.try_wait().map_err(|e| e.to_string())?.is_none() {
            if Instant::now() > deadline {
                return Err(format!("{what} never finished"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut line = String::new();
        if let Some(s) = self.0.stdout.take() {
            let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(s), &mut line);
        }
        Ok(line)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for `c` with a limit; killed and an error if it takes longer.
pub fn output_within(c: &mut Command, limit: Duration) -> Result<Output, String> {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{:?}: {e}", c.get_program()))?;
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().map_err(|e| e.to_string()),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{:?} took longer than {limit:?}", c.get_program()));
            }
        }
    }
}

/// Whether interface `ifname` exists in the host's namespace.
pub fn interface_exists(ifname: &str) -> bool {
    Path::new("/sys/class/net").join(ifname).exists()
}
