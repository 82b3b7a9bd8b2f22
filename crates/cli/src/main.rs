//! `outboard`: user-level device drivers, every role as a subcommand.

mod blk;
mod blkbench;
mod device;
mod hw;
mod latency;
mod up;

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
    /// The manager's control socket [default: $XDG_RUNTIME_DIR/outboard/control.sock or
    /// /tmp/outboard-$UID/control.sock].
    #[arg(long, env = "OUTBOARD_CONTROL", global = true, value_name = "PATH")]
    control: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Bring a machine up: start its device models and driver servers, keep the registry,
    /// answer clients. Runs in the foreground; Ctrl-C stops everything.
    Up(up::UpArgs),
    /// Print the registry (machine, buses, functions, drivers, class devices) like ioreg.
    Ls(up::LsArgs),
    /// Use a block device by name: info, read, write.
    #[command(subcommand)]
    Blk(blk::BlkCommand),
    /// Run an emulated device model standalone, serving vfio-user on a socket.
    #[command(subcommand)]
    Device(device::DeviceCommand),
    /// Bring-up tools for one device: probe it, self-test its driver.
    #[command(subcommand)]
    Hw(hw::HwCommand),
    /// (internal) A driver server: drives devices and serves their class devices to sessions.
    /// The manager starts these; run one by hand to test a driver.
    DriverHost(up::DriverHostArgs),
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
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let control = cli
        .control
        .clone()
        .unwrap_or_else(outboard_manager::default_control);
    let result = match cli.command {
        Command::Up(a) => up::up(a, control, cli.verbose),
        Command::Ls(a) => up::ls(a, control),
        Command::Blk(c) => blk::run(c, control),
        Command::DriverHost(a) => up::driver_host(a),
        Command::Device(c) => device::run(c),
        Command::Hw(c) => hw::run(c),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("outboard: {e}");
            ExitCode::FAILURE
        }
    }
}
