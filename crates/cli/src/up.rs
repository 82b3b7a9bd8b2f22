//! `outboard up`, `outboard ls` and the internal `driver-host` role.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::Args;
use outboard_drivers::{Attachment, StartOptions};
use outboard_manager::config::Machine;
use outboard_manager::registry::{Detail, State};
use outboard_manager::{Manager, ManagerOptions};
use outboard_server::{DriverHost, Served};

#[derive(Args)]
pub struct UpArgs {
    /// Machine description (TOML). Without it, the embedded default: one 64 MiB emulated
    /// virtio-blk disk, disk0, with its driver in its own server.
    #[arg(long, value_name = "FILE")]
    machine: Option<PathBuf>,
    /// Directory for sockets and logs, the control socket's included unless --control says
    /// where [default: the control socket's directory: $XDG_RUNTIME_DIR/outboard or
    /// /tmp/outboard-$UID].
    #[arg(long, value_name = "DIR")]
    runtime_dir: Option<PathBuf>,
    /// Print the built-in default machine description and exit.
    #[arg(long)]
    print_default: bool,
    /// Append the manager's log to FILE (created owner-only) instead of standard error; each
    /// child keeps its own log in the runtime directory.
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// Serve the counters (per device requests, bytes, errors, latency, restarts; per process
    /// CPU and memory) in the OpenMetrics text format at /metrics, for Prometheus and its kin:
    /// on a TCP address (127.0.0.1:9100; anyone who can reach it may read them) or a UNIX
    /// socket (a path with a /).
    #[arg(long, value_name = "ADDR|PATH", value_parser = crate::metrics::parse_endpoint)]
    metrics: Option<crate::metrics::Endpoint>,
    /// Let members of this group (a name or a number) use the control socket too. Without
    /// it, only the user running `outboard up` and root are answered (the manager checks each
    /// client's credentials); the socket is 0600 and the runtime directory 0700.
    #[arg(long, value_name = "GROUP", value_parser = parse_group)]
    control_group: Option<u32>,
    /// Run device models, driver servers and exports as this user (a name from /etc/passwd,
    /// or UID:GID, resolved once, here), best one made for Outboard alone (`useradd --system
    /// outboard`): a user that other daemons share, like nobody, could signal or trace them.
    /// They get their disks and sockets as descriptors (an export its connections to driver
    /// servers, from the manager), so they need no access of their own. Without it they
    /// keep this user's id, with no capabilities.
    #[arg(long, value_name = "USER")]
    user: Option<outboard_confine::privileges::User>,
    /// Children refuse to serve unless every confinement layer holds in full (Landlock on
    /// every thread); by default a kernel without some of it gets a warning in their logs.
    #[arg(long)]
    require_confinement: bool,
    /// Give every emulated device a fault socket, for `outboard fault` (bad hardware on
    /// demand). Without it only devices with `fault_injection = true` have one.
    #[arg(long)]
    faults: bool,
}

/// A group by number, or by name from /etc/group.
fn parse_group(s: &str) -> Result<u32, String> {
    if let Ok(gid) = s.parse() {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group").map_err(|e| format!("/etc/group: {e}"))?;
    groups
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            Some((f.next()?, f.nth(1)?))
        })
        .find(|(name, _)| *name == s)
        .and_then(|(_, gid)| gid.parse().ok())
        .ok_or_else(|| format!("no group named {s:?} in /etc/group"))
}

#[derive(Args)]
pub struct LsArgs {
    /// Print the registry as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct AttachArgs {
    /// A device the machine description declares (`attached = false`) or that was detached;
    /// with --pci, the new device's name (default: pci and the function's address, e.g.
    /// pci03-00-0).
    #[arg(required_unless_present_any = ["file", "pci"], conflicts_with = "file")]
    device: Option<String>,
    /// New devices: a file of `[[device]]` tables, as in a machine description. Each gets a
    /// driver server of its own.
    #[arg(long, value_name = "FILE")]
    file: Option<PathBuf>,
    /// A new device that is this PCI function of the machine, bound to vfio-pci (as
    /// `pci = "ADDRESS"` in a [[device]] table): checked, probed and matched like one in
    /// the machine description, with a driver server of its own.
    #[arg(long, value_name = "ADDRESS", conflicts_with = "file")]
    pci: Option<String>,
}

#[derive(Args)]
pub struct RestartArgs {
    /// Class device name, e.g. disk0.
    device: String,
    /// Drain first: the running driver finishes what is in its device and takes nothing
    /// more, then a new server takes its clients, who resume with nothing to replay (no
    /// request is sent twice). Waits at most 10 s for the drain, then restarts anyway.
    #[arg(long)]
    graceful: bool,
    /// Run the new server, and its later restarts, from this program instead of the
    /// manager's own (a live upgrade): an absolute path to an executable that only its owner,
    /// root or the manager's user, may write. Only that user or root may ask.
    #[arg(long, value_name = "PATH")]
    exe: Option<PathBuf>,
    /// How long to wait for it to serve again.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    timeout: std::time::Duration,
}

#[derive(Args)]
pub struct MoveArgs {
    /// Class device name, e.g. disk1.
    device: String,
    /// The driver server to run it in: the name of one that runs (see `server` in
    /// `outboard ls`), or a new name for a server of its own.
    #[arg(long, value_name = "NAME")]
    server: String,
    /// How long to wait for it to serve from its new server.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    timeout: std::time::Duration,
}

#[derive(Args)]
pub struct DetachArgs {
    /// Class device name, e.g. disk1.
    device: String,
    /// For a PCI function of this machine: once detached, give it back from vfio-pci to the
    /// kernel driver it came from (as `outboard hw unbind` does).
    #[arg(long)]
    unbind: bool,
    /// How long to wait for requests in flight to finish.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    timeout: std::time::Duration,
}

#[derive(Args)]
pub struct PowerArgs {
    /// Class device name, e.g. disk0.
    device: String,
    /// The power state to go to.
    state: PowerState,
    /// How long to wait for a suspending device to finish what is in flight.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    timeout: std::time::Duration,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum PowerState {
    /// Quiesce: finish in-flight requests, take no new ones until resumed.
    Suspend,
    /// Back in service: requests that waited are taken.
    Resume,
}

pub(crate) fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    outboard_manager::config::parse_duration(s).ok_or_else(|| format!("{s:?}: e.g. 500ms, 30s"))
}

pub use outboard_manager::children::DriverHostArgs;

/// The most device queues a driver server drives per device: requests are spread over them.
const MAX_QUEUES: u16 = 16;

/// The signals that stop a long-running command.
const STOP_SIGNALS: [i32; 2] = [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT];

/// A flag that SIGTERM or SIGINT sets, for a loop to look at between turns.
pub fn stop_flag() -> Result<Arc<AtomicBool>, String> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in STOP_SIGNALS {
        signal_hook::flag::register(sig, stop.clone()).map_err(|e| e.to_string())?;
    }
    Ok(stop)
}

/// [`stop_flag`], and a descriptor that becomes readable once the flag is set (the signal's
/// handler sets the flag, then writes a byte): a loop that sleeps in `poll` waits on it too and
/// stops at once, not when its wait ends.
pub fn stop_flag_and_wake() -> Result<(Arc<AtomicBool>, std::os::fd::OwnedFd), String> {
    let stop = stop_flag()?;
    let (reader, writer) = std::os::unix::net::UnixStream::pair().map_err(|e| e.to_string())?;
    writer.set_nonblocking(true).map_err(|e| e.to_string())?;
    for sig in STOP_SIGNALS {
        // After the flag's action (actions run in the order they were registered).
        let w = writer.try_clone().map_err(|e| e.to_string())?;
        signal_hook::low_level::pipe::register(sig, w).map_err(|e| e.to_string())?;
    }
    Ok((stop, reader.into()))
}

impl UpArgs {
    /// Where `--log` sends the manager's log, if given.
    pub fn log_file(&self) -> Option<&std::path::Path> {
        self.log.as_deref()
    }
}

/// `outboard down`.
#[derive(Args)]
pub struct DownArgs {
    /// How long to wait for the machine to be gone.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    timeout: std::time::Duration,
}

/// Asks the manager at `control` to stop, and waits until its control socket is gone.
pub fn down(a: DownArgs, control: PathBuf) -> Result<ExitCode, String> {
    outboard_client::manager::down(&control).map_err(|r| r.to_string())?;
    if !outboard_sys::wait::eventually(a.timeout, || !control.exists()) {
        return Err(format!(
            "the manager said it stops, but {} is still there after {:?}",
            control.display(),
            a.timeout
        ));
    }
    outboard_sys::outln!("outboard: stopped");
    Ok(ExitCode::SUCCESS)
}

/// The control socket of `outboard up`: where --control (or `OUTBOARD_CONTROL`) says, else
/// `control.sock` in --runtime-dir if given, else the default.
pub fn control_of(a: &UpArgs, control: Option<PathBuf>) -> PathBuf {
    control
        .or_else(|| a.runtime_dir.as_ref().map(|d| d.join("control.sock")))
        .unwrap_or_else(outboard_manager::default_control)
}

pub fn up(a: UpArgs, control: PathBuf, verbose: u8) -> Result<ExitCode, String> {
    if a.print_default {
        print!("{}", outboard_manager::config::DEFAULT_MACHINE);
        return Ok(ExitCode::SUCCESS);
    }
    let machine = match &a.machine {
        Some(p) => Machine::load(p).map_err(|e| e.to_string())?,
        None => Machine::default_machine(),
    };
    let stop = stop_flag()?;
    let runtime_dir = a.runtime_dir.unwrap_or_else(|| {
        control
            .parent()
            .map(PathBuf::from)
            .unwrap_or_else(outboard_manager::default_runtime_dir)
    });
    let opts = ManagerOptions {
        runtime_dir,
        control: control.clone(),
        exe: std::env::current_exe().map_err(|e| e.to_string())?,
        verbose,
        control_group: a.control_group,
        child_user: a.user,
        require_confinement: a.require_confinement,
        fault_injection: a.faults,
    };
    let (abi, landlock) = outboard_confine::sandbox::kernel_support();
    if abi < 8 {
        outboard_sys::errln!(
            "outboard: note: this kernel has Landlock ABI {abi}: {landlock}. Each child's log \
             says what it got; --require-confinement makes children refuse to serve with less"
        );
    }
    let mut m = Manager::start(machine, opts).map_err(|e| e.to_string())?;
    if let Some(at) = &a.metrics {
        if let Err(e) = crate::metrics::serve(at, control.clone()) {
            m.shutdown();
            return Err(e);
        }
    }
    let mut devices = Vec::new();
    class_devices(m.registry(), &mut devices);
    outboard_sys::outln!("{}", m.registry().render());
    outboard_sys::outln!("outboard is up; control socket {}", control.display());
    outboard_sys::outln!("Try, in another terminal:");
    // Set once for the commands that follow (a prefix on each would go to `echo`, not to
    // `outboard`, in a pipeline).
    if control != outboard_manager::default_control() {
        outboard_sys::outln!("  export OUTBOARD_CONTROL={}", control.display());
    }
    outboard_sys::outln!("  outboard ls");
    // One device of each class, with what its class's commands look like.
    let mut shown = Vec::new();
    for (class, name) in &devices {
        if !shown.contains(class) {
            shown.push(class.clone());
            for line in crate::classes::try_lines(class, name) {
                outboard_sys::outln!("  {line}");
            }
        }
    }
    outboard_sys::outln!("Ctrl-C (or outboard down) stops every device and driver.");
    crate::sdnotify::notify(&format!(
        "READY=1\nSTATUS=serving {} device(s); control socket {}\nMAINPID={}",
        devices.len(),
        control.display(),
        std::process::id()
    ));
    let ran = m.run(&stop).map_err(|e| e.to_string());
    crate::sdnotify::notify("STOPPING=1");
    ran?;
    m.shutdown();
    outboard_sys::outln!("outboard: stopped");
    Ok(ExitCode::SUCCESS)
}

/// Every class device in the registry, as (class, name), in registry order.
fn class_devices(n: &outboard_manager::registry::Node, out: &mut Vec<(String, String)>) {
    if let Some(class) = n.kind.strip_suffix("-device") {
        out.push((class.to_string(), n.name.clone()));
    }
    for c in &n.children {
        class_devices(c, out);
    }
}

/// Reads each served class device's status from its driver server now, so `ls` shows what
/// the class reports at this moment (a NIC's link and counters), not what it was at start.
/// A server that does not answer within a second leaves the node as the manager has it.
fn refresh_status(n: &mut outboard_manager::registry::Node) {
    let server = (n.kind == "driver")
        .then(|| n.props.get("server-socket").and_then(|s| s.as_str()))
        .flatten()
        .map(PathBuf::from);
    for c in &mut n.children {
        if let (Some(sock), true) = (&server, c.kind.ends_with("-device")) {
            let serving = c.state() == Some(outboard_client::registry::State::Serving);
            if let Some(status) = serving
                .then(|| {
                    outboard_client::Channel::status(
                        sock,
                        &c.name,
                        std::time::Duration::from_secs(1),
                    )
                    .ok()
                })
                .flatten()
            {
                c.set_status(&status);
            }
        }
        refresh_status(c);
    }
}

pub fn ls(a: LsArgs, control: PathBuf) -> Result<ExitCode, String> {
    let mut tree = outboard_manager::open::registry(&control).map_err(|e| e.to_string())?;
    refresh_status(&mut tree);
    if a.json {
        outboard_sys::outln!(
            "{}",
            serde_json::to_string_pretty(&tree).map_err(|e| e.to_string())?
        );
    } else {
        print!("{}", tree.render());
    }
    Ok(ExitCode::SUCCESS)
}

pub fn attach(a: AttachArgs, control: PathBuf) -> Result<ExitCode, String> {
    let (device, text) = match (&a.pci, &a.file) {
        (Some(address), _) => {
            let bdf = outboard_hw::host::canonical(address).map_err(|e| e.to_string())?;
            let name = a
                .device
                .clone()
                .unwrap_or_else(|| format!("pci{}", bdf[5..].replace([':', '.'], "-")));
            (
                None,
                // The name as a quoted string: a quote in it is the manager's name check's
                // to refuse, not a parse error.
                Some(format!("[[device]]\nname = {name:?}\npci = \"{bdf}\"\n")),
            )
        }
        (None, Some(f)) => (
            None,
            Some(std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?),
        ),
        (None, None) => (a.device.clone(), None),
    };
    let node = outboard_client::manager::attach(&control, device.as_deref(), text.as_deref())
        .map_err(|e| e.to_string())?;
    outboard_sys::outln!("{}", node.render().trim_end());
    Ok(ExitCode::SUCCESS)
}

pub fn detach(a: DetachArgs, control: PathBuf) -> Result<ExitCode, String> {
    // Which function to give back, asked before it is detached (and refused before, for a
    // device that is none).
    let function = if a.unbind {
        Some(function_of(&control, &a.device)?)
    } else {
        None
    };
    let first = outboard_client::manager::detach(&control, &a.device);
    let code = settle(&control, &a.device, a.timeout, first, |r| match r {
        Err(r) if r.code == outboard_session::Code::DeviceGone => Ok(Some("detached".into())),
        Err(e) => Err(e.to_string()),
        Ok(_) => Ok(None),
    })?;
    if let Some(bdf) = function {
        give_back(&bdf)?;
    }
    Ok(code)
}

/// The address of device `name`'s PCI function, from the registry's `pci` bus.
fn function_of(control: &std::path::Path, name: &str) -> Result<String, String> {
    let tree = outboard_client::manager::registry(control).map_err(|e| e.to_string())?;
    tree.find("pci-function", &format!("{name}@pci"))
        .and_then(|f| f.props.get("address"))
        .and_then(|a| a.as_str())
        .map(str::to_owned)
        .ok_or_else(|| {
            format!("--unbind: {name} is not a PCI function of this machine; nothing was done")
        })
}

/// Gives function `bdf` back from vfio-pci to its kernel driver once its driver server has
/// let go of its VFIO group (the server stops a moment after the device shows detached).
fn give_back(bdf: &str) -> Result<(), String> {
    let host = outboard_hw::host::HostView::real();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match host.unbind(bdf) {
            Ok(u) => {
                outboard_sys::outln!(
                    "{bdf} given back from vfio-pci to {}",
                    u.driver.as_deref().unwrap_or("no driver (none took it)")
                );
                return Ok(());
            }
            Err(outboard_hw::host::HostError::Open { .. })
                if std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => return Err(format!("detached, but not given back: {e}")),
        }
    }
}

pub fn power(a: PowerArgs, control: PathBuf) -> Result<ExitCode, String> {
    let suspend = matches!(a.state, PowerState::Suspend);
    let want = if suspend {
        State::Suspended
    } else {
        State::Serving
    };
    let first = outboard_client::manager::power(&control, &a.device, suspend);
    settle(&control, &a.device, a.timeout, first, |r| match r {
        Ok(n) if n.state() == Some(want) => Ok(Some(want.to_string())),
        Ok(_) => Ok(None),
        Err(e) => Err(e.to_string()),
    })
}

pub fn restart(a: RestartArgs, control: PathBuf) -> Result<ExitCode, String> {
    let started = std::time::Instant::now();
    let first =
        outboard_client::manager::restart_with(&control, &a.device, a.graceful, a.exe.as_deref());
    // Its own answer says `restarting`: wait until it says more.
    let first = first.map(|mut n| {
        n.set_state(State::Restarting, Detail::None);
        n
    });
    settle(&control, &a.device, a.timeout, first, |r| match r {
        Ok(n) if n.state() == Some(State::Serving) => Ok(Some(format!(
            "{} again after {:.1} ms",
            State::Serving,
            started.elapsed().as_secs_f64() * 1e3
        ))),
        Ok(n) if n.state() == Some(State::GaveUp) => Err(state_of(n).to_string()),
        Ok(_) => Ok(None),
        Err(e) => Err(e.to_string()),
    })
}

pub fn move_device(a: MoveArgs, control: PathBuf) -> Result<ExitCode, String> {
    let started = std::time::Instant::now();
    let first = outboard_client::manager::move_device(&control, &a.device, &a.server);
    settle(&control, &a.device, a.timeout, first, |r| match r {
        Ok(n) if n.state() == Some(State::Serving) => Ok(Some(format!(
            "serving from driver server {:?} after {:.1} ms",
            a.server,
            started.elapsed().as_secs_f64() * 1e3
        ))),
        Ok(n) if n.state() == Some(State::GaveUp) => Err(state_of(n).to_string()),
        Ok(_) => Ok(None),
        Err(e) => Err(e.to_string()),
    })
}

fn state_of(n: &outboard_manager::registry::Node) -> &str {
    n.props.get("state").and_then(|s| s.as_str()).unwrap_or("")
}

/// After a command that changes a device's state: polls its status, from the command's own
/// answer on, until `settled` says it got there (and what to print), or `timeout` passes.
fn settle(
    control: &std::path::Path,
    device: &str,
    timeout: std::time::Duration,
    first: Result<outboard_manager::registry::Node, outboard_session::Refusal>,
    settled: impl Fn(
        &Result<outboard_manager::registry::Node, outboard_session::Refusal>,
    ) -> Result<Option<String>, String>,
) -> Result<ExitCode, String> {
    let deadline = std::time::Instant::now() + timeout;
    let mut now = first;
    loop {
        if let Some(done) = settled(&now).map_err(|e| format!("{device}: {e}"))? {
            outboard_sys::outln!("{device}: {done}");
            return Ok(ExitCode::SUCCESS);
        }
        if let Ok(n) = &now {
            // Nothing will change by waiting: say so at once.
            if n.state() == Some(State::GaveUp) {
                return Err(format!("{device}: {}", state_of(n)));
            }
        }
        if std::time::Instant::now() > deadline {
            let state = now.as_ref().map(state_of).unwrap_or_default();
            return Err(format!(
                "{device}: still {state:?} after {timeout:?} (requests in flight have not finished)"
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        now = outboard_client::manager::status(control, device);
    }
}

pub fn driver_host(a: DriverHostArgs) -> Result<ExitCode, String> {
    // When each step of the start-up ended, for the manager's account of a restart.
    let mut startup = vec![
        ("exec".to_string(), crate::main_ns()),
        (
            "arguments".to_string(),
            outboard_session::control::monotonic_ns(),
        ),
    ];
    let vfio = a.devices.iter().any(|d| {
        d.split_once('=')
            .is_some_and(|(_, s)| s.starts_with("vfio:") || s.starts_with("vfio-fd:"))
    });
    // Before any thread exists: none ever holds a capability.
    a.confine.drop_privileges(vfio).map_err(|e| e.to_string())?;
    startup.push((
        "privileges".into(),
        outboard_session::control::monotonic_ns(),
    ));
    serve_devices(a, startup, vfio, None)
}

/// `outboard driver-standby`: drops its privileges as a driver server without a VFIO function
/// does, then waits for the manager to hand it a dead server's place, and serves it.
pub fn driver_standby(s: outboard_manager::standby::StandbyArgs) -> Result<ExitCode, String> {
    use outboard_manager::standby::{take_socket, wait_for_place, StandbyError};
    // Its privileges dropped before it waits, as a server's are before it starts drivers.
    // With --confine-early the rest of its confinement comes now too, threads still allowed
    // (a driver may start one while it starts: an in-band vfio-user mapping does) until it
    // serves; otherwise where a server's does,
    // once its drivers have started.
    s.confine
        .drop_privileges(false)
        .map_err(|e| e.to_string())?;
    // Before the limits are lowered: the socket moves to a number that may be above them.
    let take = take_socket(s.take_fd).map_err(|e| e.to_string())?;
    let early = if s.confine_early {
        s.confine
            .apply_early(outboard_confine::Role::DriverServer { vfio: false })
            .map_err(|e| e.to_string())?
    } else {
        None
    };
    match wait_for_place(take, &s.confine, early.is_some()) {
        Ok((a, taken)) => serve_devices(a, vec![("taken".to_string(), taken)], false, early),
        // Stopped before it was needed: nothing went wrong.
        Err(StandbyError::NotNeeded) => Ok(ExitCode::SUCCESS),
        Err(e) => Err(e.to_string()),
    }
}

/// A driver server from the point where its privileges are dropped: starts its drivers,
/// serves their devices until stopped. `startup`: the steps so far, with when each ended;
/// `early`: the confinement it began before it had its place (a standby's), finished where a
/// server is confined.
fn serve_devices(
    a: DriverHostArgs,
    mut startup: Vec<(String, u64)>,
    vfio: bool,
    early: Option<outboard_confine::Early>,
) -> Result<ExitCode, String> {
    let mut step =
        |name: &str| startup.push((name.into(), outboard_session::control::monotonic_ns()));
    let stop = stop_flag()?;
    // Driver libraries first (before confinement, which would forbid mapping their code):
    // their drivers join the catalog the --driver names are looked up in.
    for lib in &a.driver_libs {
        let p = outboard_drivers::load_library(lib).map_err(|e| e.to_string())?;
        tracing::info!("driver library {}: driver {}", lib.display(), p.driver);
    }
    if !a.driver_libs.is_empty() {
        step("libraries");
    }
    let mut served: Vec<Served> = Vec::new();
    let mut names = Vec::new();
    for d in &a.drivers {
        let (name, _) = d
            .split_once('=')
            .ok_or_else(|| format!("--driver {d:?}: use NAME=DRIVER"))?;
        if !a
            .devices
            .iter()
            .any(|x| x.split_once('=').is_some_and(|(n, _)| n == name))
        {
            return Err(format!("--driver {d:?}: no --device named {name:?}"));
        }
    }
    for d in &a.devices {
        let (name, spec) = d
            .split_once('=')
            .ok_or_else(|| format!("--device {d:?}: use NAME=SPEC"))?;
        let at: Attachment = spec.parse().map_err(|e| format!("--device {d:?}: {e}"))?;
        let driver = a
            .drivers
            .iter()
            .filter_map(|x| x.split_once('='))
            .find(|(n, _)| *n == name)
            .map(|(_, drv)| drv);
        let abort_on = a
            .driver_abort_on
            .iter()
            .filter_map(|x| x.split_once('='))
            .find(|(n, _)| *n == name)
            .map(|(_, s)| {
                s.parse::<u64>()
                    .map_err(|_| format!("--driver-abort-on {name}={s}: give a sector number"))
            })
            .transpose()?;
        let contend = a
            .contend
            .iter()
            .filter_map(|x| x.split_once('='))
            .find(|(n, _)| *n == name)
            .map(|(_, path)| std::path::PathBuf::from(path));
        let opts = StartOptions {
            name: name.to_string(),
            queues: MAX_QUEUES,
            abort_on,
            contend,
        };
        served.push(crate::classes::serve(&at, driver, opts).map_err(|e| format!("{name}: {e}"))?);
        names.push(name.to_string());
        step(&format!("driver {name}"));
    }
    let (mut server, listening) = match (&a.listen, a.listen_fd) {
        (Some(path), _) => (
            DriverHost::bind(path, served).map_err(|e| e.to_string())?,
            path.display().to_string(),
        ),
        (None, Some(fd)) => {
            let listener = outboard_sys::process::inherited_socket(fd)
                .map_err(|e| format!("--listen-fd: {e}"))?;
            (
                DriverHost::new(listener, served).map_err(|e| e.to_string())?,
                format!("fd {fd}"),
            )
        }
        (None, None) => return Err("give --listen or --listen-fd".into()),
    };
    for n in &a.quiesce {
        if !server.quiesce(n, true) {
            return Err(format!("--quiesce {n:?}: no --device named so"));
        }
    }
    server.resume_grace(std::time::Duration::from_millis(a.resume_grace_ms));
    server.set_spin(std::time::Duration::from_micros(a.spin_us));
    if a.no_counters {
        server.without_counters();
    }
    server.set_deadline(std::time::Duration::from_millis(a.deadline_ms));
    // A confined server cannot open its device again: a failure ends it, for its supervisor.
    server.set_restartable(a.restartable || a.confine.confined());
    outboard_sys::errln!(
        "outboard: driver server for {} listening on {listening}",
        names.join(", ")
    );
    if let Some(fd) = a.notify_fd {
        server
            .set_notify(outboard_manager::supervisor::inherited_fd(fd).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        step("listening");
        server
            .announce_serving(startup)
            .map_err(|e| e.to_string())?;
        if a.isolate_ms > 0 {
            server.isolate(std::time::Duration::from_millis(a.isolate_ms));
        }
    }
    for h in &a.hold_back {
        server.hold_back(*h);
    }
    for q in &a.quarantine {
        server.quarantine(*q);
    }
    let confined = match early {
        Some(early) => a.confine.finish(early),
        None => a
            .confine
            .apply(outboard_confine::Role::DriverServer { vfio }),
    };
    if let Some(code) = confined.map_err(|e| e.to_string())? {
        return Ok(code);
    }
    server.run(&stop).map_err(|e| e.to_string())?;
    outboard_sys::errln!("outboard: driver server stopped ({:?})", server.stats());
    Ok(ExitCode::SUCCESS)
}
