//! `outboard`: user-level device drivers, every role as a subcommand.

mod device;
mod hw;
mod latency;

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
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run an emulated device model standalone, serving vfio-user on a socket.
    #[command(subcommand)]
    Device(device::DeviceCommand),
    /// Bring-up tools for one device: probe it, self-test its driver.
    #[command(subcommand)]
    Hw(hw::HwCommand),
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
    let result = match cli.command {
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
