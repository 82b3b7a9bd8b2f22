//! `outboard clock NAME` (the clock class's client command) and `outboard device timer` (the
//! PCI timer model).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use outboard_clock::{ClockDevice, ClockError, ClockTime};

use crate::confine::ConfineArgs;

/// `outboard clock`.
#[derive(Args)]
pub struct ClockArgs {
    /// Device name, e.g. clock0.
    device: String,
    /// Count this many ticks (one wait of one tick at a time, as a process woken by each tick
    /// would), then say how long they took and the rate that makes. Without it: print the
    /// time once.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    ticks: Option<u64>,
    /// With --ticks: print a line every this many ticks (default: one a second, the device's
    /// rate).
    #[arg(long, value_name = "N", requires = "ticks", value_parser = clap::value_parser!(u64).range(1..))]
    every: Option<u64>,
    /// Talk to the driver server listening here instead of asking the manager where the
    /// device is (a driver server started by hand, `outboard driver-host`).
    #[arg(long, value_name = "SOCKET")]
    server: Option<PathBuf>,
}

fn show(name: &str, t: &ClockTime) -> String {
    format!(
        "{name}: tick {} at {} Hz, device time {}.{:09} s",
        t.ticks,
        t.hz,
        t.device_ns / 1_000_000_000,
        t.device_ns % 1_000_000_000
    )
}

pub fn run(a: ClockArgs, control: PathBuf) -> Result<ExitCode, String> {
    let opened: Result<Box<dyn ClockDevice>, ClockError> = match &a.server {
        Some(server) => outboard_clock_client::ClockClient::open(server, &a.device)
            .map(|c| Box::new(c) as Box<dyn ClockDevice>),
        None => outboard_clock_client::open_clock(&control, &a.device).map(|(d, _)| d),
    };
    let err = |e: ClockError| format!("{}: {e}", a.device);
    let mut d = opened.map_err(err)?;
    let first = d.now().map_err(err)?;
    println!("{}", show(&a.device, &first));
    let Some(want) = a.ticks else {
        return Ok(ExitCode::SUCCESS);
    };
    let every = a.every.unwrap_or(u64::from(d.info().hz)).max(1);
    let started = Instant::now();
    let (mut counted, mut woken) = (0u64, 0u64);
    while counted < want {
        let before = counted;
        counted += u64::from(d.wait(1).map_err(err)?);
        woken += 1;
        if counted / every != before / every || counted >= want {
            println!(
                "{}: {counted} ticks, {:.3} s",
                a.device,
                started.elapsed().as_secs_f64()
            );
        }
    }
    let took = started.elapsed().as_secs_f64();
    let last = d.now().map_err(err)?;
    let device_s = last.device_ns.saturating_sub(first.device_ns) as f64 * 1e-9;
    println!(
        "{}: {counted} ticks in {took:.3} s ({:.1} Hz; the device says {} Hz and {device_s:.3} s \
         passed by its counter); woken {woken} times",
        a.device,
        counted as f64 / took.max(1e-9),
        last.hz,
    );
    Ok(ExitCode::SUCCESS)
}

/// `outboard device timer`.
#[derive(Args, Debug)]
pub struct TimerArgs {
    #[command(flatten)]
    pub(crate) listen: outboard_manager::children::ModelListen,
    #[command(flatten)]
    pub(crate) own: outboard_manager::children::TimerOwn,
    #[command(flatten)]
    pub(crate) faults: outboard_manager::children::ModelFaults,
    #[command(flatten)]
    pub confine: ConfineArgs,
}

/// Serves the PCI timer model.
pub fn serve_model(a: TimerArgs) -> Result<ExitCode, String> {
    let hz = a.own.hz;
    let model =
        outboard_devices::timer::Timer::new(1_000_000_000 / hz).map_err(|e| e.to_string())?;
    let _faults = crate::device::start_faults(a.faults, model.faults())?;
    crate::device::serve(model, &a.listen, &a.confine, &format!("timer ({hz} Hz)"))
}
