//! `outboard char` (the char class's client command), `outboard tty NAME` (a terminal on a
//! serial line) and `outboard device serial` (the PCI 16550 model).

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use outboard_char::{modem, CharDevice, CharError, LineSettings, LineStatus};

use crate::confine::ConfineArgs;

/// `outboard char`.
#[derive(Subcommand)]
pub enum CharCommand {
    /// The line's settings and counters.
    ///
    /// Example: outboard char info tty0
    Info(CharTarget),
    /// Send bytes: the text given, or standard input. Returns once the device has sent them.
    ///
    /// Example: echo hello | outboard char write tty0
    Write(CharWriteArgs),
    /// Receive bytes and print them: until --length bytes came, or nothing came for --idle.
    ///
    /// Example: outboard char read tty0 --length 5 --idle 2s
    Read(CharReadArgs),
    /// Set the rate, frame and flow control: BAUD[,FRAME][,FLOW], e.g. 9600,8N1 or
    /// 115200,8N1,rtscts.
    ///
    /// Example: outboard char set tty0 19200,7E1
    Set(CharSetArgs),
    /// Run the char class's conformance suite on a line whose far end sends back what it
    /// receives (an echo, or a plug joining TX to RX): every byte value, every frame and
    /// standard rate, refusals, bursts and floods far larger than the FIFO with and without
    /// RTS/CTS. It changes the settings and ends at 115200,8N1. Exits non-zero if a check fails.
    ///
    /// Example: outboard char selftest tty0
    Selftest(CharTarget),
}

/// The line to talk to.
#[derive(Args)]
pub struct CharTarget {
    /// Device name, e.g. tty0.
    device: String,
    /// Talk to the driver server listening here instead of asking the manager where the
    /// device is (a driver server started by hand, `outboard driver-host`).
    #[arg(long, value_name = "SOCKET")]
    server: Option<PathBuf>,
}

/// `outboard char write`.
#[derive(Args)]
pub struct CharWriteArgs {
    #[command(flatten)]
    target: CharTarget,
    /// What to send (without it: standard input, to its end).
    text: Option<String>,
    /// Send a line end (\r\n) after the text.
    #[arg(long)]
    crlf: bool,
}

/// `outboard char read`.
#[derive(Args)]
pub struct CharReadArgs {
    #[command(flatten)]
    target: CharTarget,
    /// Stop once this many bytes came.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    length: Option<u64>,
    /// Stop once nothing came for this long (e.g. 500ms, 2s).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = crate::up::parse_duration)]
    idle: Duration,
    /// Print bytes as hex.
    #[arg(long)]
    hex: bool,
}

/// `outboard char set`.
#[derive(Args)]
pub struct CharSetArgs {
    #[command(flatten)]
    target: CharTarget,
    /// BAUD[,FRAME][,FLOW]: e.g. 9600, 9600,8N1, 19200,7E2,rtscts.
    #[arg(value_parser = parse_settings)]
    settings: LineSettings,
}

fn parse_settings(s: &str) -> Result<LineSettings, String> {
    s.parse()
}

fn open(t: &CharTarget, control: &std::path::Path) -> Result<Box<dyn CharDevice>, String> {
    let opened: Result<Box<dyn CharDevice>, CharError> = match &t.server {
        Some(server) => outboard_char_client::CharClient::open(server, &t.device)
            .map(|c| Box::new(c) as Box<dyn CharDevice>),
        None => outboard_char_client::open_char(control, &t.device).map(|(d, _)| d),
    };
    opened.map_err(|e| format!("{}: {e}", t.device))
}

fn show(name: &str, s: &LineStatus) -> String {
    let c = &s.counters;
    let lines = [
        (modem::CTS, "CTS"),
        (modem::DSR, "DSR"),
        (modem::DCD, "DCD"),
        (modem::RI, "RI"),
    ]
    .iter()
    .filter(|(bit, _)| c.modem & bit != 0)
    .map(|(_, n)| *n)
    .collect::<Vec<_>>();
    let lines = if lines.is_empty() {
        "none".to_string()
    } else {
        lines.join(" ")
    };
    format!(
        "{name}: {}\n  sent {} bytes, received {}, dropped {}, overruns {}, errors {}\n  modem lines on: {lines}",
        s.line, c.sent, c.received, c.dropped, c.overruns, c.errors
    )
}

pub fn run(c: CharCommand, control: PathBuf) -> Result<ExitCode, String> {
    match c {
        CharCommand::Info(t) => {
            let mut d = open(&t, &control)?;
            let s = d.line().map_err(|e| format!("{}: {e}", t.device))?;
            println!("{}", show(&t.device, &s));
            println!(
                "  the device: up to {} baud, {}-byte FIFOs",
                d.info().max_baud,
                d.info().fifo
            );
        }
        CharCommand::Write(a) => {
            let mut d = open(&a.target, &control)?;
            let mut bytes = match a.text {
                Some(t) => t.into_bytes(),
                None => {
                    let mut v = Vec::new();
                    std::io::stdin()
                        .read_to_end(&mut v)
                        .map_err(|e| format!("standard input: {e}"))?;
                    v
                }
            };
            if a.crlf {
                bytes.extend_from_slice(b"\r\n");
            }
            d.write(&bytes)
                .map_err(|e| format!("{}: {e}", a.target.device))?;
            eprintln!("{}: sent {} bytes", a.target.device, bytes.len());
        }
        CharCommand::Read(a) => {
            let mut d = open(&a.target, &control)?;
            let want = a.length.unwrap_or(u64::MAX);
            let mut got = 0u64;
            let mut buf = vec![0u8; 4096];
            let mut out = std::io::stdout().lock();
            while got < want {
                let room = (want - got).min(buf.len() as u64) as usize;
                let n = d
                    .read(&mut buf[..room], Some(a.idle))
                    .map_err(|e| format!("{}: {e}", a.target.device))?;
                if n == 0 {
                    break;
                }
                got += n as u64;
                let r = if a.hex {
                    let hex: String = buf[..n].iter().map(|b| format!("{b:02x}")).collect();
                    out.write_all(hex.as_bytes())
                } else {
                    out.write_all(&buf[..n])
                };
                r.and_then(|()| out.flush())
                    .map_err(|e| format!("standard output: {e}"))?;
            }
            if a.hex {
                println!();
            }
            if a.length.is_some_and(|l| got < l) {
                eprintln!(
                    "{}: {got} of {want} bytes before {:?} of quiet",
                    a.target.device, a.idle
                );
                return Ok(ExitCode::FAILURE);
            }
        }
        CharCommand::Set(a) => {
            let mut d = open(&a.target, &control)?;
            d.set_line(&a.settings)
                .map_err(|e| format!("{}: {e}", a.target.device))?;
            println!("{}: {}", a.target.device, a.settings);
        }
        CharCommand::Selftest(t) => {
            let mut d = open(&t, &control)?;
            let mut rep = crate::hw::Report::default();
            println!(
                "{}: the char class's conformance suite (the line looped back)",
                t.device
            );
            // The first check, the class status, says whether the rest can run.
            for (i, c) in outboard_char::conformance::CHECKS.iter().enumerate() {
                let passed = rep
                    .step(c.name, || (c.run)(d.as_mut()).map(|detail| ((), detail)))
                    .is_some();
                if !passed && i == 0 {
                    break;
                }
            }
            return Ok(rep.verdict("suite"));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `outboard tty`.
#[derive(Args)]
pub struct TtyArgs {
    #[command(flatten)]
    target: CharTarget,
    /// Set the line first: BAUD[,FRAME][,FLOW].
    #[arg(long, value_name = "SETTINGS", value_parser = parse_settings)]
    set: Option<LineSettings>,
}

/// Standard input in raw mode while this lives (if it is a terminal), restored after.
struct RawInput(Option<rustix::termios::Termios>);

impl RawInput {
    fn enter() -> Self {
        let stdin = std::io::stdin();
        let Ok(saved) = rustix::termios::tcgetattr(stdin.as_fd()) else {
            return Self(None);
        };
        let mut raw = saved.clone();
        raw.make_raw();
        let _ =
            rustix::termios::tcsetattr(stdin.as_fd(), rustix::termios::OptionalActions::Now, &raw);
        Self(Some(saved))
    }
}

impl Drop for RawInput {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            let _ = rustix::termios::tcsetattr(
                std::io::stdin().as_fd(),
                rustix::termios::OptionalActions::Now,
                t,
            );
        }
    }
}

/// The byte that ends a tty session typed at a terminal: Ctrl-] (as telnet's escape).
const ESCAPE: u8 = 0x1d;

pub fn tty(a: TtyArgs, control: PathBuf) -> Result<ExitCode, String> {
    let mut d = open(&a.target, &control)?;
    let name = a.target.device.clone();
    let err = |e: CharError| format!("{name}: {e}");
    if let Some(s) = &a.set {
        d.set_line(s).map_err(err)?;
    }
    let status = d.line().map_err(err)?;
    let interactive = rustix::termios::isatty(std::io::stdin().as_fd());
    if interactive {
        eprintln!("{name}: {}; Ctrl-] ends\r", status.line);
    }
    let _raw = interactive.then(RawInput::enter);
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    let mut buf = vec![0u8; 4096];
    let mut input = vec![0u8; 4096];
    let mut input_open = true;
    // After standard input ends (not a terminal), what the line still sends within this long
    // is printed before the end.
    let linger = Duration::from_millis(500);
    let mut quiet_since: Option<Instant> = None;
    loop {
        let n = d
            .read(&mut buf, Some(Duration::from_millis(20)))
            .map_err(err)?;
        if n > 0 {
            out.write_all(&buf[..n])
                .and_then(|()| out.flush())
                .map_err(|e| format!("standard output: {e}"))?;
            quiet_since = None;
        }
        if input_open {
            let mut p = [rustix::event::PollFd::new(
                &stdin,
                rustix::event::PollFlags::IN,
            )];
            let ready = rustix::event::poll(&mut p, Some(&rustix::time::Timespec::default()))
                .map_err(|e| format!("standard input: {e}"))?;
            if ready > 0 {
                let k = rustix::io::read(stdin.as_fd(), &mut input)
                    .map_err(|e| format!("standard input: {e}"))?;
                let typed = &input[..k];
                let end = typed.iter().position(|b| interactive && *b == ESCAPE);
                let send = &typed[..end.unwrap_or(typed.len())];
                if !send.is_empty() {
                    d.write(send).map_err(err)?;
                }
                if end.is_some() {
                    break;
                }
                if k == 0 {
                    input_open = false;
                }
            }
        } else if n == 0 {
            let since = *quiet_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= linger {
                break;
            }
        }
    }
    if interactive {
        eprintln!("\r");
    }
    Ok(ExitCode::SUCCESS)
}

/// `outboard device serial`.
#[derive(Args, Debug)]
pub struct SerialArgs {
    #[command(flatten)]
    pub(crate) listen: outboard_manager::children::ModelListen,
    #[command(flatten)]
    pub(crate) own: outboard_manager::children::SerialOwn,
    #[command(flatten)]
    pub(crate) faults: outboard_manager::children::ModelFaults,
    #[command(flatten)]
    pub confine: ConfineArgs,
}

/// Serves the PCI 16550 model.
pub fn serve_model(a: SerialArgs) -> Result<ExitCode, String> {
    let line = outboard_devices::serial_line::Line::open(&a.own.line)
        .map_err(|e| format!("--line {}: {e}", a.own.line))?;
    let what = format!("pci-serial (16550A), line {}", line.describe());
    if let Some(p) = line.pty_path() {
        // Where a user attaches (screen, minicom, picocom).
        outboard_sys::errln!(
            "outboard: pci-serial: its line is the terminal {}",
            p.display()
        );
    }
    let model = outboard_devices::serial::Serial::new(line).map_err(|e| e.to_string())?;
    let _faults = crate::device::start_faults(a.faults, model.faults())?;
    crate::device::serve(model, &a.listen, &a.confine, &what)
}
