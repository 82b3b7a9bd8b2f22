//! `outboard`: user-level device drivers, every role as a subcommand.

mod blk;
mod blkbench;
mod classes;
mod clock;
mod confine;
mod device;
mod export;
mod hw;
mod latency;
mod manual;
mod metrics;
mod net;
mod pci;
mod rng;
mod sample;
mod sdk;
mod sdnotify;
mod serial;
mod top;
mod up;
mod watch;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Outboard runs device drivers as ordinary, isolated user processes.
///
/// A driver gets exactly one device — a PCI function through Linux VFIO, or an emulated device
/// model reached over vfio-user — and serves it through device-independent interfaces.
#[derive(Parser)]
#[command(name = "outboard", version, propagate_version = true)]
struct Cli {
    /// More log output (-v: info, -vv: debug, -vvv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// `--control` before the command (`outboard --control PATH ls`), as earlier versions
    /// took it: still accepted, not shown; each command that talks to the manager shows its
    /// own.
    #[arg(long, value_name = "PATH", hide = true)]
    control: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

/// `--control`, on the commands that talk to a running machine's manager (and `up`, which
/// is one).
#[derive(clap::Args)]
struct ControlArg {
    /// The manager's control socket [default: $OUTBOARD_CONTROL, else
    /// $XDG_RUNTIME_DIR/outboard/control.sock or /tmp/outboard-$UID/control.sock].
    #[arg(long, global = true, value_name = "PATH")]
    control: Option<std::path::PathBuf>,
}

impl ControlArg {
    /// The socket asked for: this command's `--control`, else one given before the
    /// command, else `$OUTBOARD_CONTROL`.
    fn asked(&self, before: &Option<std::path::PathBuf>) -> Option<std::path::PathBuf> {
        self.control
            .clone()
            .or_else(|| before.clone())
            .or_else(|| std::env::var_os("OUTBOARD_CONTROL").map(Into::into))
    }

    /// The socket: the one asked for, else the default.
    fn or(&self, before: &Option<std::path::PathBuf>) -> std::path::PathBuf {
        self.asked(before)
            .unwrap_or_else(outboard_manager::default_control)
    }
}

/// A command's own arguments and `--control`.
#[derive(clap::Args)]
struct Ctl<A: clap::Args> {
    #[command(flatten)]
    args: A,
    #[command(flatten)]
    ctl: ControlArg,
}

/// A family of commands (`blk read`, `blk write`, …) and `--control`, which each of them
/// takes.
#[derive(clap::Args)]
struct CtlFamily<C: clap::Subcommand> {
    #[command(subcommand)]
    command: C,
    #[command(flatten)]
    ctl: ControlArg,
}

#[derive(Subcommand)]
enum Command {
    /// Bring a machine up: start its device models and driver servers, keep the registry,
    /// answer clients. Runs in the foreground; Ctrl-C stops everything.
    Up(Ctl<up::UpArgs>),
    /// Print the registry (machine, buses, functions, drivers, class devices) like ioreg, with
    /// what each device has done (requests, bytes, errors, latency) and each process's CPU
    /// time and memory.
    Ls(Ctl<up::LsArgs>),
    /// Watch the machine live, like spdk_top: per device IOPS, bandwidth, queue depth, latency
    /// percentiles, errors, restarts, sessions; per process CPU and memory; exports and their
    /// clients. Refreshes each second; --once --json for scripts.
    Top(Ctl<top::TopArgs>),
    /// Use a block device by name: info, read, write.
    Blk(CtlFamily<blk::BlkCommand>),
    /// Entropy devices (class `entropy`): read random bytes, whatever the placement.
    Rng(CtlFamily<rng::RngCommand>),
    /// Clocks (class `clock`): the time, and ticks counted as a process woken by each sees
    /// them. Example: outboard clock clock0 --ticks 1000
    Clock(Ctl<clock::ClockArgs>),
    /// Serial lines (class `char`): send and receive bytes, the line's settings and counters.
    /// Example: echo hello | outboard char write tty0
    Char(CtlFamily<serial::CharCommand>),
    /// A terminal on a serial line: what is typed goes out, what comes in is printed; Ctrl-]
    /// ends. With standard input not a terminal, it is sent and the session ends after the
    /// line goes quiet. Example: outboard tty tty0 --set 115200,8N1
    Tty(Ctl<serial::TtyArgs>),
    /// NICs (class `net`): status, counters, send and receive Ethernet frames.
    Net(CtlFamily<net::NetCommand>),
    /// Serve a machine's block devices to ordinary tools (NBD).
    Export(CtlFamily<export::ExportCommand>),
    /// Inject faults into a running device's model: bad hardware on demand, to see what its
    /// driver and clients do.
    ///
    /// Faults: error=START-END (sectors fail), error-next=N, drop-irq=N, duplicate-irq=N,
    /// spurious-irq=N, corrupt-used=id|len, stall=DURATION (e.g. 500ms, 2s), needs-reset,
    /// crash, abort-on=SECTOR and hang-on=SECTOR (every request touching it crashes or hangs
    /// the model), clear (disarm all); a NIC also link-flap=DURATION (down that long, then up) and
    /// long-frame=N (frames reported longer than their buffers). Disk-only and NIC-only faults
    /// are refused by the other models. Example: outboard fault disk0 drop-irq=3 error-next=1
    Fault(Ctl<FaultArgs>),
    /// Suspend a class device (its driver finishes what is in flight and takes nothing new;
    /// clients' requests wait, they do not fail) or resume it. Waits until the device is
    /// quiet. Example: outboard power disk0 suspend
    Power(Ctl<up::PowerArgs>),
    /// Start a device's driver again: one the manager gave up (a crash loop whose cause is
    /// gone now), or a running one. Clients carry on: their requests are replayed. A memory
    /// disk keeps its bytes. Waits until it serves. Example: outboard restart disk0
    Restart(Ctl<up::RestartArgs>),
    /// Move a device's driver, live, into another driver server: one that runs for other
    /// devices (they share it from then on) or a new one of its own. Both servers finish what
    /// is in their devices first; clients carry on with nothing sent twice. Waits until the
    /// device serves from its new server. The machine description is not changed: the next
    /// `up` places it as it says. Example: outboard move disk1 --server disk0-server
    Move(Ctl<up::MoveArgs>),
    /// Hot-plug a device into the running machine: one its description declares with
    /// `attached = false` (or detached earlier), by name, new ones described in a file of
    /// `[[device]]` tables, or a PCI function bound to vfio-pci. The catalog matches its
    /// driver, which starts; its class device appears in the registry. Examples: outboard
    /// attach disk1; outboard attach --file d.toml; outboard attach --pci 0000:03:00.0
    Attach(Ctl<up::AttachArgs>),
    /// Hot-unplug a device: its driver takes no new request (those get "device gone"),
    /// finishes the ones in flight, then the driver server and device model stop and the
    /// device shows as detached. Waits until it is. With --unbind, a PCI function is then
    /// given back to its kernel driver. Example: outboard detach disk1
    Detach(Ctl<up::DetachArgs>),
    /// Stop the machine, as Ctrl-C on `outboard up` does (for a service: systemd's ExecStop):
    /// every export, driver server and device model stops, their sockets go. Waits until
    /// the control socket is gone. Only the manager's user or root may.
    Down(Ctl<up::DownArgs>),
    /// Run an emulated device model standalone, serving vfio-user on a socket.
    #[command(subcommand)]
    Device(device::DeviceCommand),
    /// The host's PCI functions (list, bind to vfio-pci, unbind) and bring-up tools for one
    /// device: probe it, self-test its driver.
    #[command(subcommand)]
    Hw(hw::HwCommand),
    /// Print a shell completion script: outboard completions bash > /etc/bash_completion.d/outboard
    Completions(manual::CompletionsArgs),
    /// Print the manual page (roff), or write one per command with --dir: outboard man --dir
    /// /usr/local/share/man/man1
    Man(manual::ManArgs),
    /// Run the evaluation suite: configurations side by side, repeated runs, JSON, charts and
    /// bench-results/REPORT.md with each target and how far this run is from it.
    Bench(BenchArgs),
    /// (internal) The peer process of the ping-pong measurements.
    #[command(hide = true)]
    BenchPeer {
        /// eventfd RX TX N | cacheline MEMFD N
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Install the headers and pkg-config file for building a C driver outside Outboard
    /// (include/outboard/{osenv,native,driver,clock,char}.h, outboard-driver.pc). Example:
    /// outboard sdk --prefix ~/.local && PKG_CONFIG_PATH=~/.local/lib/pkgconfig
    /// cc -shared -fPIC $(pkg-config --cflags outboard-driver) -o libmine.so mine.c
    Sdk(sdk::SdkArgs),
    /// Load a C driver library and show what its descriptor declares (name, class, PCI ids,
    /// score, whether it has an active probe), or why it is refused (another driver ABI
    /// version, a malformed descriptor).
    /// Example: outboard driver-lib ./libmine.so
    DriverLib(sdk::DriverLibArgs),
    /// (internal) A driver server: drives devices and serves their class devices to sessions.
    /// The manager starts these; run one by hand to test a driver.
    DriverHost(up::DriverHostArgs),
    /// (internal) A standby driver server: started and confined ahead of need, it waits for
    /// the manager to hand it the place of a driver server that died.
    #[command(hide = true)]
    DriverStandby(outboard_manager::standby::StandbyArgs),
}

/// `outboard fault`.
#[derive(clap::Args)]
struct FaultArgs {
    /// Device name, e.g. disk0.
    device: String,
    /// Faults to arm, in order.
    #[arg(required = true, value_name = "FAULT")]
    faults: Vec<String>,
}

fn fault(a: FaultArgs, control: std::path::PathBuf) -> Result<ExitCode, String> {
    let socket =
        outboard_manager::open::faults_socket(&control, &a.device).map_err(|e| e.to_string())?;
    for f in &a.faults {
        outboard_devices::faults::socket::inject(&socket, f)
            .map_err(|e| format!("{}: {f}: {e}", a.device))?;
        println!("{}: armed {f}", a.device);
    }
    Ok(ExitCode::SUCCESS)
}

/// Which tests, and how.
#[derive(clap::Args)]
struct BenchArgs {
    /// Tests to run: disk-read, iops, null-rtt, counters (what the per-device counters cost: null round trip and 4 KiB IOPS with and without them), trace (the 1992 HP disk trace), exports (NBD against nbdkit and qemu-storage-daemon), restart (SIGKILL the driver or its model under a verified workload), faults (a campaign of every fault kind under verified load), echo (UDP round trips between two NICs: kernel veth, colocated, separate, TAP), combination (a disk read out of a NIC as UDP, in four placements), net-load (UDP echo under a rising offered load, 0 and 100 µs interrupt hold-off), net-raw (Ethernet frames received, sent and echoed, 60–1514 bytes), clock (CPU time per clock interrupt: timerfd, native work loop, osenv uncontested and contested, 100 Hz to 20 kHz), or all.
    #[arg(required = true, value_parser = ["disk-read", "iops", "null-rtt", "counters", "trace", "exports", "restart", "faults", "echo", "combination", "net-load", "net-raw", "clock", "all"])]
    tests: Vec<String>,
    /// A short smoke run (small sizes, 2 runs): checks the machinery, not the numbers.
    #[arg(long)]
    quick: bool,
    /// Runs per measurement, the first discarded as warm-up [default: 11; --quick: 2].
    #[arg(long, value_parser = clap::value_parser!(u64).range(2..), allow_negative_numbers = true)]
    runs: Option<u64>,
    /// Data size: bytes read per run (disk-read), or disk size (iops, exports), e.g. 64M, 1G.
    #[arg(long, value_parser = |s: &str| outboard_devices::backing::parse_size(s).ok_or("not a size"))]
    size: Option<u64>,
    /// Faults the fault campaign injects, one after another [default: 240; --quick: 24].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), allow_negative_numbers = true)]
    faults: Option<u64>,
    /// Disks the fault campaign injects into at once, each with its own driver server and
    /// model and ⌈4/N⌉ verified clients (at least one); the faults are shared out among them
    /// [default: 1; 4 with more than 1,000 faults].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=16), allow_negative_numbers = true)]
    fault_disks: Option<u64>,
    /// The fault kinds the campaign injects, by name, comma-separated [default: all]:
    /// kill-server, segv-server, stop-server, kill-model, segv-model, stop-model, stall,
    /// corrupt-id, corrupt-len, io-error, poison-driver, poison-model.
    #[arg(long, value_name = "KINDS", value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(outboard_bench::faults::FAULT_KINDS))]
    fault_kinds: Option<Vec<String>>,
    /// Where results go.
    #[arg(long, default_value = "bench-results")]
    out: std::path::PathBuf,
    /// Compare this build with another: both `outboard` executables run the tests in
    /// alternating rounds (ABBA, so drift falls on both alike), each round into OUT/baseline/ or
    /// OUT/this/, and OUT/COMPARE.md gives every point's change with the references' moves as
    /// the run's noise.
    #[arg(long, value_name = "EXE")]
    baseline: Option<std::path::PathBuf>,
    /// With --baseline: rounds per build.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(1..1000), allow_negative_numbers = true)]
    rounds: u64,
    /// With --baseline: how much worse, in percent, a point may be before it counts as worse.
    #[arg(long, value_name = "PERCENT", default_value_t = 5.0, value_parser = percent)]
    tolerance: f64,
}

fn percent(s: &str) -> Result<f64, String> {
    match s.trim_end_matches('%').parse::<f64>() {
        Ok(p) if (0.0..100.0).contains(&p) => Ok(p),
        _ => Err("a percentage from 0 to 100, e.g. 5".into()),
    }
}

fn bench(a: BenchArgs) -> Result<ExitCode, String> {
    let tests: Vec<&str> = if a.tests.iter().any(|t| t == "all") {
        outboard_bench::TESTS.to_vec()
    } else {
        a.tests.iter().map(String::as_str).collect()
    };
    if let Some(baseline) = &a.baseline {
        return bench_against(baseline, &tests, &a);
    }
    outboard_bench::run(
        &tests,
        outboard_bench::Options {
            exe: std::env::current_exe().map_err(|e| e.to_string())?,
            runs: a.runs.unwrap_or(0) as usize,
            quick: a.quick,
            size: a.size,
            faults: a.faults,
            fault_disks: a.fault_disks,
            fault_kinds: a.fault_kinds.clone(),
            out: a.out.clone(),
        },
    )?;
    println!("results: {}", a.out.join("REPORT.md").display());
    Ok(ExitCode::SUCCESS)
}

/// `bench --baseline EXE`: both builds, alternating rounds, one comparison.
fn bench_against(
    baseline: &std::path::Path,
    tests: &[&str],
    a: &BenchArgs,
) -> Result<ExitCode, String> {
    use outboard_bench::compare;
    // What both builds' bench get, written as each parses it.
    let mut args = Vec::new();
    if a.quick {
        args.push("--quick".to_string());
    }
    for (flag, value) in [
        ("--runs", a.runs),
        ("--size", a.size),
        ("--faults", a.faults),
        ("--fault-disks", a.fault_disks),
    ] {
        if let Some(v) = value {
            args.extend([flag.to_string(), v.to_string()]);
        }
    }
    if let Some(kinds) = &a.fault_kinds {
        args.extend(["--fault-kinds".to_string(), kinds.join(",")]);
    }
    let comparison = compare::compare(&compare::Options {
        baseline: baseline.to_path_buf(),
        this: std::env::current_exe().map_err(|e| e.to_string())?,
        tests: tests.iter().map(|t| t.to_string()).collect(),
        args,
        rounds: a.rounds as usize,
        tolerance: a.tolerance / 100.0,
        out: a.out.clone(),
        round_limit: std::time::Duration::from_secs(4 * 3600),
    })?;
    println!("{}", compare::summary(&comparison));
    println!("every point: {}", a.out.join("COMPARE.md").display());
    Ok(ExitCode::SUCCESS)
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour only for a person at a terminal: a log file or a pipe gets plain text.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| LogWriter)
        .with_ansi(LOG_FILE.get().is_none() && std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Where `outboard up --log FILE` sends the manager's log instead of standard error.
static LOG_FILE: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();

/// Opens `path` for `--log`: appended to, created owner-only.
fn open_log(path: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("--log {}: {e}", path.display()))?;
    let _ = LOG_FILE.set(f);
    Ok(())
}

/// Standard error (or `--log`'s file) for the log, where a failed write is dropped: the
/// subscriber would report one with `eprintln!`, which panics when stderr is a closed pipe — a
/// manager whose terminal went away would die on its next log line instead of supervising on.
struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = match LOG_FILE.get() {
            Some(mut f) => f.write_all(buf),
            None => std::io::stderr().write_all(buf),
        };
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Command {
    /// Commands that serve others for a long time: a peer that hangs up must cost them that
    /// connection (a write gets `EPIPE`), never the process (SIGPIPE's default action).
    fn serves_others(&self) -> bool {
        matches!(
            self,
            Command::Up(_)
                | Command::Export(_)
                | Command::DriverHost(_)
                | Command::DriverStandby(_)
                | Command::Device(_)
        )
    }
}

/// When `main` began (`CLOCK_MONOTONIC` ns): a driver server reports its start-up from here.
static MAIN_NS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// When `main` began, for a start-up account.
pub fn main_ns() -> u64 {
    *MAIN_NS.get_or_init(outboard_session::control::monotonic_ns)
}

fn main() -> ExitCode {
    main_ns();
    let cli = Cli::parse();
    if cli.command.serves_others() {
        outboard_sys::process::ignore_sigpipe();
    } else {
        // A filter (`outboard blk read … | head -c 10`) ends quietly when its reader goes.
        outboard_sys::process::restore_sigpipe();
    }
    if let Command::Up(a) = &cli.command {
        if let Some(path) = a.args.log_file() {
            if let Err(e) = open_log(path) {
                outboard_sys::errln!("outboard: {e}");
                return ExitCode::from(2);
            }
        }
    }
    init_logging(cli.verbose);
    let before = cli.control.clone();
    let result = match cli.command {
        // Its control socket goes in its runtime directory unless --control (or
        // OUTBOARD_CONTROL) says where.
        Command::Up(a) => {
            let control = up::control_of(&a.args, a.ctl.asked(&before));
            up::up(a.args, control, cli.verbose)
        }
        Command::Ls(a) => up::ls(a.args, a.ctl.or(&before)),
        Command::Top(a) => top::run(a.args, a.ctl.or(&before)),
        Command::Blk(c) => blk::run(c.command, c.ctl.or(&before)),
        Command::Rng(c) => rng::run(c.command, c.ctl.or(&before)),
        Command::Clock(a) => clock::run(a.args, a.ctl.or(&before)),
        Command::Char(c) => serial::run(c.command, c.ctl.or(&before)),
        Command::Tty(a) => serial::tty(a.args, a.ctl.or(&before)),
        Command::Net(c) => net::run(c.command, c.ctl.or(&before)),
        Command::Fault(a) => fault(a.args, a.ctl.or(&before)),
        Command::Power(a) => up::power(a.args, a.ctl.or(&before)),
        Command::Restart(a) => up::restart(a.args, a.ctl.or(&before)),
        Command::Move(a) => up::move_device(a.args, a.ctl.or(&before)),
        Command::Attach(a) => up::attach(a.args, a.ctl.or(&before)),
        Command::Detach(a) => up::detach(a.args, a.ctl.or(&before)),
        Command::Down(a) => up::down(a.args, a.ctl.or(&before)),
        Command::Export(c) => export::run(c.command, c.ctl.or(&before)),
        Command::DriverHost(a) => up::driver_host(a),
        Command::Sdk(a) => sdk::sdk(a),
        Command::DriverLib(a) => sdk::driver_lib(a),
        Command::DriverStandby(a) => up::driver_standby(a),
        Command::Bench(a) => bench(a),
        Command::BenchPeer { args } => {
            outboard_bench::pingpong::peer(&args).map(|()| ExitCode::SUCCESS)
        }
        Command::Device(c) => device::run(c),
        Command::Hw(c) => hw::run(c),
        Command::Completions(a) => manual::completions(a, <Cli as clap::CommandFactory>::command()),
        Command::Man(a) => manual::man(a, <Cli as clap::CommandFactory>::command()),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // An error may carry words a driver server, model or manager reported: shown
            // escaped, line by line, so they cannot draw on the terminal.
            let e: Vec<_> = e
                .lines()
                .map(|l| outboard_client::registry::printable(l).into_owned())
                .collect();
            outboard_sys::errln!("outboard: {}", e.join("\n"));
            ExitCode::FAILURE
        }
    }
}
