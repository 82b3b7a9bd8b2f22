//! `outboard device …`: device models as standalone vfio-user servers.
//!
//! Follows the vfio-user backend program conventions: `--socket-path` or `--fd`, no
//! daemonizing, SIGTERM honoured.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use outboard_devices::backing::Backing;
use outboard_devices::faults::socket::FaultSocket;
use outboard_devices::faults::{lock, FaultHandle};
use outboard_devices::virtio_blk::BlkOptions;
use outboard_vfio_user::{DeviceBackend, Server, ServerOptions};

use crate::confine::ConfineArgs;
use outboard_manager::children::{DiskOptions, ModelFaults, ModelListen, VirtioBlkOwn};

#[derive(Subcommand)]
pub enum DeviceCommand {
    /// A virtio-blk disk (virtio 1.x over PCI, vendor 0x1af4 device 0x1042).
    ///
    /// Example: outboard device virtio-blk --socket /tmp/blk.sock --backing mem:64M
    VirtioBlk(VirtioBlkArgs),
    /// A virtio-blk disk that stores nothing: reads return zeros, writes are dropped.
    ///
    /// The same device to a driver as virtio-blk, for measuring and exercising the path to
    /// it. (In a machine description, `null-blk` instead runs no device at all: the driver
    /// server answers for it, to measure the session path alone.)
    ///
    /// Example: outboard device null-blk --socket /tmp/null.sock --backing null:1G
    NullBlk(NullBlkArgs),
    /// A virtio-rng entropy source (virtio 1.x over PCI, vendor 0x1af4 device 0x1044).
    ///
    /// Example: outboard device virtio-rng --socket /tmp/rng.sock
    VirtioRng(crate::rng::VirtioRngArgs),
    /// A virtio-net NIC (virtio 1.x over PCI, vendor 0x1af4 device 0x1041): one receive and
    /// one transmit queue, mergeable receive buffers, link status; its cable is a socket
    /// inherited from whoever starts it (the manager joins two NICs on a `wire`).
    ///
    /// Example: outboard device virtio-net --socket /tmp/nic.sock --mac 02:00:00:00:00:01
    VirtioNet(crate::net::VirtioNetArgs),
    /// Outboard's PCI timer (vendor 0x1234 device 0x0b71): a periodic interrupt on MSI-X
    /// vector 0 and a free-running nanosecond counter (docs/timer.md has its registers).
    ///
    /// Example: outboard device timer --socket /tmp/timer.sock --hz 1000
    Timer(crate::clock::TimerArgs),
    /// A PCI 16550A UART compatible with QEMU's pci-serial (vendor 0x1b36 device 0x0002):
    /// one I/O BAR, FIFOs, the interrupt on INTx; its line's far end a pty, a Unix socket or a
    /// file (docs/serial.md).
    ///
    /// Example: outboard device serial --socket /tmp/uart.sock --line pty
    Serial(crate::serial::SerialArgs),
}

#[derive(Args)]
pub struct NullBlkArgs {
    #[command(flatten)]
    listen: ModelListen,
    /// The disk's size, as null:SIZE (SIZE with an optional K/M/G/T suffix).
    #[arg(long, value_name = "null:SIZE", default_value = "null:1G")]
    backing: String,
    #[command(flatten)]
    disk: DiskOptions,
    #[command(flatten)]
    faults: ModelFaults,
    #[command(flatten)]
    confine: ConfineArgs,
}

#[derive(Args, Debug)]
pub struct VirtioBlkArgs {
    #[command(flatten)]
    listen: ModelListen,
    #[command(flatten)]
    own: VirtioBlkOwn,
    #[command(flatten)]
    faults: ModelFaults,
    #[command(flatten)]
    confine: ConfineArgs,
}

/// Arms the initial faults and starts the fault socket, if asked for.
pub(crate) fn start_faults(
    a: ModelFaults,
    handle: FaultHandle,
) -> Result<Option<FaultSocket>, String> {
    for f in a.faults {
        let mut faults = lock(&handle);
        faults.check(&f)?;
        faults.arm(f);
    }
    match (a.faults_socket, a.faults_fd) {
        (Some(p), _) => outboard_devices::faults::socket::serve(&p, handle).map(Some),
        (None, Some(fd)) => {
            let listener = outboard_sys::process::inherited_socket(fd)
                .map_err(|e| format!("--faults-fd: {e}"))?;
            outboard_devices::faults::socket::serve_listener(listener, handle).map(Some)
        }
        (None, None) => Ok(None),
    }
}

pub fn run(c: DeviceCommand) -> Result<ExitCode, String> {
    // Before any thread exists (the fault socket's, the twin socket's): none ever holds a
    // capability.
    let confine = match &c {
        DeviceCommand::VirtioBlk(a) => &a.confine,
        DeviceCommand::NullBlk(a) => &a.confine,
        DeviceCommand::VirtioRng(a) => &a.confine,
        DeviceCommand::VirtioNet(a) => &a.confine,
        DeviceCommand::Timer(a) => &a.confine,
        DeviceCommand::Serial(a) => &a.confine,
    };
    confine.drop_privileges(false).map_err(|e| e.to_string())?;
    match c {
        DeviceCommand::VirtioBlk(a) => {
            let backing = Backing::open_with(&a.own.backing, a.own.create, a.own.disk.read_only)
                .map_err(|e| e.to_string())?;
            disk(
                "virtio-blk",
                backing,
                a.own.disk,
                a.faults,
                &a.listen,
                &a.confine,
            )
        }
        DeviceCommand::NullBlk(a) => {
            if !a.backing.starts_with("null:") {
                return Err(format!(
                    "--backing {:?}: a null-blk disk stores nothing; give null:SIZE",
                    a.backing
                ));
            }
            let backing = Backing::open(&a.backing, None).map_err(|e| e.to_string())?;
            disk("null-blk", backing, a.disk, a.faults, &a.listen, &a.confine)
        }
        DeviceCommand::VirtioRng(a) => crate::rng::serve_model(a),
        DeviceCommand::VirtioNet(a) => crate::net::serve_model(a),
        DeviceCommand::Timer(a) => crate::clock::serve_model(a),
        DeviceCommand::Serial(a) => crate::serial::serve_model(a),
    }
}

/// Serves a virtio-blk disk model over `backing`.
fn disk(
    name: &str,
    backing: Backing,
    o: DiskOptions,
    faults: ModelFaults,
    listen: &ModelListen,
    confine: &ConfineArgs,
) -> Result<ExitCode, String> {
    if o.serial.len() > 20 {
        return Err("--serial is limited to 20 bytes".into());
    }
    let what = format!("{} bytes, {}", backing.len(), backing.describe());
    let model = outboard_devices::virtio_blk(
        backing,
        BlkOptions {
            read_only: o.read_only,
            num_queues: o.queues,
            serial: o.serial,
        },
    )
    .map_err(|e| e.to_string())?;
    let _faults = start_faults(faults, model.device().faults())?;
    serve(model, listen, confine, &format!("{name} ({what})"))
}

/// Serves `model` until SIGINT or SIGTERM.
pub fn serve<B: DeviceBackend>(
    model: B,
    listen: &ModelListen,
    confine: &ConfineArgs,
    what: &str,
) -> Result<ExitCode, String> {
    let (stop, wake) = crate::up::stop_flag_and_wake()?;
    let opts = ServerOptions::default();
    let mut server = match (&listen.socket, listen.fd) {
        (Some(path), _) => Server::bind(path, model, opts).map_err(|e| e.to_string())?,
        (None, Some(fd)) => {
            let fd =
                outboard_sys::process::inherited_socket(fd).map_err(|e| format!("--fd: {e}"))?;
            Server::from_listener(fd, model, opts)
        }
        (None, None) => return Err("give --socket or --fd".into()),
    };
    // A stop that lands while the server spins after a command, or just before it sleeps, is
    // seen at once.
    server.wake_on(wake);
    let where_ = listen.socket.as_ref().map_or_else(
        || format!("fd {}", listen.fd.unwrap_or(-1)),
        |p| p.display().to_string(),
    );
    outboard_sys::errln!("outboard: {what} serving vfio-user on {where_}");
    if let Some(code) = confine
        .apply(outboard_confine::Role::DeviceModel)
        .map_err(|e| e.to_string())?
    {
        return Ok(code);
    }
    // Ready: the manager waits for this, not for a socket (it bound the sockets itself).
    // The channel stays open while the model runs.
    let _notify = listen
        .notify_fd
        .map(|fd| {
            let notify = outboard_sys::process::inherited_socket(fd)?;
            outboard_session::control::send(
                std::os::fd::AsFd::as_fd(&notify),
                &outboard_session::control::Event::Serving {
                    startup: Vec::new(),
                },
                &[],
            )
            .map_err(|e| e.to_string())?;
            Ok::<_, String>(notify)
        })
        .transpose()
        .map_err(|e| format!("--notify-fd: {e}"))?;
    server.run(&stop).map_err(|e| e.to_string())?;
    outboard_sys::errln!("outboard: stopped");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Cli, Command};
    use clap::Parser;
    use outboard_manager::children::{ModelArgs, ModelOwn, TimerOwn, VirtioRngOwn};

    /// `outboard device …` as this binary parses what the manager wrote.
    fn parse_back(m: &ModelArgs) -> DeviceCommand {
        let line: Vec<String> = std::iter::once("outboard".to_string())
            .chain(m.command_line())
            .collect();
        match Cli::try_parse_from(&line) {
            Ok(Cli {
                command: Command::Device(d),
                ..
            }) => d,
            Ok(_) => panic!("{line:?}: not a device model"),
            Err(e) => panic!("{line:?}: {e}"),
        }
    }

    fn described(own: ModelOwn) -> ModelArgs {
        ModelArgs {
            listen: ModelListen {
                socket: None,
                fd: Some(4),
                notify_fd: Some(3),
            },
            faults: ModelFaults {
                faults: vec!["error-next=2".parse().unwrap(), "stall=2s".parse().unwrap()],
                faults_socket: None,
                faults_fd: Some(5),
            },
            own,
            confine: ConfineArgs {
                confine: true,
                check_confinement: None,
                user: Some("65534:65534".parse().unwrap()),
                require_confinement: false,
                max_files: 256,
                max_memory: Some(1 << 30),
            },
        }
    }

    #[test]
    fn every_model_the_manager_describes_parses_back_the_same() {
        let disks = [
            VirtioBlkOwn {
                backing: "fd:6".into(),
                create: None,
                disk: DiskOptions {
                    read_only: false,
                    queues: 1,
                    serial: outboard_manager::children::DEFAULT_SERIAL.into(),
                },
            },
            VirtioBlkOwn {
                backing: "/srv/disk.img".into(),
                create: Some(1 << 20),
                disk: DiskOptions {
                    read_only: true,
                    queues: 4,
                    serial: "abc".into(),
                },
            },
        ];
        for own in disks {
            let m = described(ModelOwn::VirtioBlk(own.clone()));
            let DeviceCommand::VirtioBlk(back) = parse_back(&m) else {
                panic!("not virtio-blk")
            };
            assert_eq!(back.listen, m.listen);
            assert_eq!(back.own, own);
            assert_eq!(back.faults, m.faults);
            assert_eq!(back.confine, m.confine);
        }
        for seed in [None, Some(7), Some(u64::MAX)] {
            let m = described(ModelOwn::VirtioRng(VirtioRngOwn { seed }));
            let DeviceCommand::VirtioRng(back) = parse_back(&m) else {
                panic!("not virtio-rng")
            };
            assert_eq!(back.listen, m.listen);
            assert_eq!(back.own, VirtioRngOwn { seed });
            assert_eq!(back.faults, m.faults);
            assert_eq!(back.confine, m.confine);
        }
        for hz in [1, 1000, 100_000] {
            let m = described(ModelOwn::Timer(TimerOwn { hz }));
            let DeviceCommand::Timer(back) = parse_back(&m) else {
                panic!("not timer")
            };
            assert_eq!(back.listen, m.listen);
            assert_eq!(back.own, TimerOwn { hz });
            assert_eq!(back.faults, m.faults);
        }
    }
}
