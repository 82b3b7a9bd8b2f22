//! `outboard rng …` (the entropy class's client commands) and `outboard device virtio-rng`
//! (its device model).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use outboard_devices::virtio_pci::VirtioDevice;
use outboard_devices::virtio_rng::{Entropy, Seeded, VirtioRng};
use outboard_rng::EntropyDevice;

use crate::confine::ConfineArgs;

#[derive(Subcommand)]
pub enum RngCommand {
    /// Read random bytes from an entropy device, wherever its driver runs.
    ///
    /// Writes the bytes to standard output as they come (raw), or as hexadecimal with --hex.
    ///
    /// Example: outboard rng read rng0 --length 32 --hex
    Read(ReadArgs),
    /// Show the device's status: what it is and the most it gives at once.
    Info {
        /// Device name, e.g. rng0.
        device: String,
    },
}

#[derive(Args)]
pub struct ReadArgs {
    /// Device name, e.g. rng0.
    device: String,
    /// How many bytes (a count with an optional K/M suffix).
    #[arg(long, short = 'n', value_parser = outboard_manager::children::parse_size_arg, allow_negative_numbers = true)]
    length: u64,
    /// Print hexadecimal (two digits a byte, one line) instead of raw bytes.
    #[arg(long)]
    hex: bool,
    /// Talk to the driver server listening here instead of asking the manager where the
    /// device is (a driver server started by hand, `outboard driver-host`).
    #[arg(long, value_name = "SOCKET")]
    server: Option<PathBuf>,
    #[command(flatten)]
    wait: crate::blk::Wait,
}

/// Most bytes one command reads: a client asking for more wants a file, not this.
const MOST: u64 = 64 << 20;

pub fn run(c: RngCommand, control: PathBuf) -> Result<ExitCode, String> {
    match c {
        RngCommand::Info { device } => {
            let (d, placement) =
                outboard_rng_client::open_entropy(&control, &device).map_err(|e| e.to_string())?;
            let i = d.info();
            println!("{}", i.name);
            println!("  class        entropy");
            println!("  placement    {}", format!("{placement:?}").to_lowercase());
            println!("  max read     {} bytes", i.max_read);
            println!("  queue depth  {}", i.queue_depth);
        }
        RngCommand::Read(a) => {
            if a.length == 0 || a.length > MOST {
                return Err(format!("--length {}: from 1 byte to {MOST}", a.length));
            }
            let w = crate::watch::start(
                format!("rng read {}", a.device),
                control.clone(),
                a.server.is_none().then(|| a.device.clone()),
                "read",
                a.wait.timeout,
            );
            let progress = w.progress.with_total(a.length);
            let opened: Result<Box<dyn EntropyDevice>, _> = match &a.server {
                Some(server) => outboard_rng_client::RngClient::open(server, &a.device)
                    .map(|c| Box::new(c) as Box<dyn EntropyDevice>),
                None => outboard_rng_client::open_entropy(&control, &a.device).map(|(d, _)| d),
            };
            let mut d = opened.map_err(|e| format!("{}: {e}", a.device))?;
            let mut left = a.length as usize;
            let mut buf = vec![0u8; left.min(1 << 20)];
            let mut out = std::io::stdout().lock();
            while left > 0 {
                let piece = &mut buf[..left.min(1 << 20)];
                d.read(piece)
                    .map_err(|e| progress.cut_off(format!("{}: {e}", a.device)))?;
                progress.add(piece.len() as u64);
                let written = if a.hex {
                    let text: String = piece.iter().map(|b| format!("{b:02x}")).collect();
                    out.write_all(text.as_bytes())
                } else {
                    out.write_all(piece)
                };
                if let Err(e) = written {
                    if e.kind() == std::io::ErrorKind::BrokenPipe {
                        return Ok(ExitCode::SUCCESS);
                    }
                    return Err(format!("standard output: {e}"));
                }
                left -= piece.len();
            }
            if a.hex {
                let _ = writeln!(out);
            }
            let _ = out.flush();
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `outboard device virtio-rng`.
#[derive(Args, Debug)]
pub struct VirtioRngArgs {
    #[command(flatten)]
    pub(crate) listen: outboard_manager::children::ModelListen,
    #[command(flatten)]
    pub(crate) own: outboard_manager::children::VirtioRngOwn,
    #[command(flatten)]
    pub(crate) faults: outboard_manager::children::ModelFaults,
    #[command(flatten)]
    pub confine: ConfineArgs,
}

/// Serves a virtio-rng model.
pub fn serve_model(a: VirtioRngArgs) -> Result<ExitCode, String> {
    let (entropy, what) = match a.own.seed {
        Some(s) => (Entropy::Seeded(Seeded::new(s)), format!("seed {s}")),
        None => (Entropy::Os, "getrandom".to_string()),
    };
    let model = outboard_devices::virtio_pci::VirtioPci::new(VirtioRng::new(entropy))
        .map_err(|e| e.to_string())?;
    let _faults = crate::device::start_faults(a.faults, model.device().faults())?;
    crate::device::serve(
        model,
        &a.listen,
        &a.confine,
        &format!("virtio-rng ({what})"),
    )
}
