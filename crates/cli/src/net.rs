//! `outboard net …` (the network class's client commands) and `outboard device virtio-net`
//! (its device model).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use outboard_devices::virtio_net::{NetOptions as ModelOptions, VirtioNet, Wire};
use outboard_devices::virtio_pci::VirtioDevice;
use outboard_manager::children::ExportTapArgs;
use outboard_net::bpf::Program;
use outboard_net::{mac_text, NetInfo, PROMISCUOUS};
use outboard_net_client::{NetClient, NetOptions, NetPort};

use crate::confine::ConfineArgs;

#[derive(Subcommand)]
pub enum NetCommand {
    /// Show a NIC's status: its address, MTU, link and where its driver runs.
    ///
    /// Example: outboard net info nic0
    Info(NicArgs),
    /// Show what a NIC's server counted: frames sent and received, delivered to sessions,
    /// dropped because no session took them or had no buffer, truncated.
    ///
    /// Example: outboard net stats nic0 --json
    Stats {
        #[command(flatten)]
        nic: NicArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Send Ethernet frames from a NIC.
    ///
    /// Each frame goes to --to (default: broadcast) from the NIC's own address, with Ethernet
    /// type --ethertype, carrying --payload (padded with zeros to the 60-byte minimum).
    ///
    /// Example: outboard net send nic0 --to 02:00:00:00:00:02 --payload hello --count 3
    Send(SendArgs),
    /// Receive Ethernet frames on a NIC and print them, one line each.
    ///
    /// Takes frames to the NIC's address and broadcast (every frame with --promiscuous), and
    /// of those only what --filter accepts: a classic BPF program as `tcpdump -dd` prints it.
    ///
    /// Example: tcpdump -dd udp > udp.bpf; outboard net recv nic1 --filter udp.bpf --count 10
    Recv(RecvArgs),
    /// Answer UDP datagrams on a NIC: every datagram to --port goes back to its sender.
    ///
    /// Runs a user-space UDP/IP stack (smoltcp) over the NIC with --address, wherever the
    /// NIC's driver runs (in this process if the machine places it colocated), until stopped.
    /// The other end of `outboard bench echo`; also a quick check that a NIC carries IP.
    ///
    /// Example: outboard net echo nic1 --address 10.0.0.2/24 --port 7
    Echo(EchoArgs),
    /// Hold a NIC's receive interrupts back: the device interrupts once the hold-off has
    /// passed since the first frame (or a quarter of its receive ring came), not per frame —
    /// fewer wake-ups under load, at that much latency. 0 turns it off. The device's setting,
    /// for every client of the NIC (virtio's VIRTIO_NET_CTRL_NOTF_COAL).
    ///
    /// Example: outboard net hold-off nic0 100us
    HoldOff {
        #[command(flatten)]
        nic: NicArgs,
        /// How long, e.g. 100us, 1ms, 0.
        #[arg(value_parser = parse_micros)]
        duration: u32,
    },
}

/// `100us`, `2ms`, `0` as microseconds (at most one second).
fn parse_micros(s: &str) -> Result<u32, String> {
    let bad = || format!("{s:?} is not a hold-off (e.g. 100us, 2ms, 0; at most 1s)");
    let (n, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "us"),
    };
    let n: u64 = n.parse().map_err(|_| bad())?;
    let us = match unit {
        "us" | "µs" => n,
        "ms" => n.saturating_mul(1000),
        "s" => n.saturating_mul(1_000_000),
        _ => return Err(bad()),
    };
    u32::try_from(us)
        .ok()
        .filter(|&u| u <= outboard_net::MAX_HOLD_OFF_US)
        .ok_or_else(bad)
}

#[derive(Args)]
pub struct EchoArgs {
    #[command(flatten)]
    nic: NicArgs,
    /// The NIC's IPv4 address and prefix length.
    #[arg(long, value_name = "ADDR/PREFIX")]
    address: String,
    /// The UDP port to answer on.
    #[arg(long, default_value_t = 7)]
    port: u16,
    /// Stop after answering this many datagrams (default: never).
    #[arg(long)]
    count: Option<u64>,
    /// Answer nothing: only count what arrives (the discard service).
    #[arg(long)]
    discard: bool,
    /// Stop once nothing arrived for this long after the first datagram, e.g. 1s (default:
    /// never).
    #[arg(long, value_parser = crate::up::parse_duration)]
    idle: Option<Duration>,
    /// Ask the NIC to hold receive interrupts back this long first (see `net hold-off`).
    #[arg(long, value_parser = parse_micros, value_name = "DURATION")]
    hold_off: Option<u32>,
    #[command(flatten)]
    own: OwnArg,
}

/// `10.0.0.2/24` as an address and a prefix length.
pub fn parse_cidr(s: &str) -> Result<(std::net::Ipv4Addr, u8), String> {
    let bad = || format!("{s:?} is not an IPv4 address with a prefix length, e.g. 10.0.0.2/24");
    let (a, p) = s.split_once('/').ok_or_else(bad)?;
    let addr = a.parse().map_err(|_| bad())?;
    let prefix: u8 = p.parse().map_err(|_| bad())?;
    if !(1..=32).contains(&prefix) {
        return Err(bad());
    }
    Ok((addr, prefix))
}

#[derive(Args)]
pub struct NicArgs {
    /// NIC name, e.g. nic0.
    nic: String,
    /// Talk to the driver server listening here instead of asking the manager where the NIC
    /// is (a driver server started by hand, `outboard driver-host`).
    #[arg(long, value_name = "SOCKET")]
    server: Option<PathBuf>,
}

#[derive(Args)]
pub struct SendArgs {
    #[command(flatten)]
    nic: NicArgs,
    /// Destination address.
    #[arg(long, value_name = "MAC", default_value = "ff:ff:ff:ff:ff:ff")]
    to: String,
    /// Ethernet type (0x88b5 is the IEEE's for local experiments).
    #[arg(long, value_name = "TYPE", default_value = "0x88b5", value_parser = parse_u16)]
    ethertype: u16,
    /// The payload, as text.
    #[arg(long, default_value = "outboard")]
    payload: String,
    /// How many frames.
    #[arg(long, default_value_t = 1)]
    count: u64,
}

#[derive(Args)]
pub struct RecvArgs {
    #[command(flatten)]
    nic: NicArgs,
    /// Stop after this many frames.
    #[arg(long, default_value_t = 1)]
    count: u64,
    /// Give up this long after the last frame (or the start), e.g. 5s, 500ms.
    #[arg(long, default_value = "5s", value_parser = crate::up::parse_duration)]
    timeout: Duration,
    /// A packet filter: a file holding `tcpdump -dd` (or -ddd) output; `-` reads it from
    /// standard input.
    #[arg(long, value_name = "FILE")]
    filter: Option<PathBuf>,
    /// Every frame on the wire, whatever its destination.
    #[arg(long)]
    promiscuous: bool,
    /// Also print each frame's bytes in hexadecimal.
    #[arg(long)]
    hex: bool,
    #[command(flatten)]
    own: OwnArg,
}

/// Receiving in place.
#[derive(Args, Debug, Default, Clone, Copy)]
pub struct OwnArg {
    /// Take the NIC's receive path: the device writes each frame straight into this
    /// command's buffers, with no copy in the driver server. Refused while another session
    /// receives on the NIC (and, while held, other sessions may send but not receive). A NIC
    /// driven in this process (colocated) has no server to copy: nothing changes.
    #[arg(long)]
    pub own: bool,
}

fn parse_u16(s: &str) -> Result<u16, String> {
    let v = match s.strip_prefix("0x") {
        Some(h) => u16::from_str_radix(h, 16),
        None => s.parse(),
    };
    v.map_err(|_| format!("{s:?} is not a 16-bit number (e.g. 0x88b5)"))
}

fn open(a: &NicArgs, control: &std::path::Path) -> Result<(Box<dyn NetPort>, String), String> {
    open_with(a, control, OwnArg::default())
}

fn open_with(
    a: &NicArgs,
    control: &std::path::Path,
    own: OwnArg,
) -> Result<(Box<dyn NetPort>, String), String> {
    let opts = NetOptions {
        own_receive: own.own,
        ..NetOptions::default()
    };
    let opened = match &a.server {
        Some(s) => NetClient::open(s, &a.nic, opts)
            .map(|c| (Box::new(c) as Box<dyn NetPort>, "server".to_string())),
        None => outboard_net_client::open_nic(control, &a.nic, opts)
            .map(|(c, p)| (c, format!("{p:?}").to_lowercase())),
    };
    opened.map_err(|e| format!("{}: {e}", a.nic))
}

fn describe(i: &NetInfo, placement: &str) {
    println!("{}", i.name);
    println!("  class        net");
    println!("  placement    {placement}");
    println!("  address      {}", i.mac_text());
    println!(
        "  mtu          {} bytes (frames up to {})",
        i.mtu,
        i.max_frame()
    );
    println!("  link         {}", if i.link_up { "up" } else { "down" });
    println!("  queue depth  {}", i.queue_depth);
}

pub fn run(c: NetCommand, control: PathBuf) -> Result<ExitCode, String> {
    match c {
        NetCommand::Info(a) => {
            let (mut d, placement) = open(&a, &control)?;
            let now = d.status_now().map_err(|e| format!("{}: {e}", a.nic))?;
            describe(&now, &placement);
        }
        NetCommand::Stats { nic, json } => {
            let (mut d, _) = open(&nic, &control)?;
            let s = d.status_now().map_err(|e| format!("{}: {e}", nic.nic))?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&s).expect("serialisable")
                );
            } else {
                let c = s.counters;
                println!(
                    "{}  ({}, link {})",
                    s.name,
                    s.mac_text(),
                    if s.link_up { "up" } else { "down" }
                );
                for (what, n) in [
                    ("sent frames", c.tx_frames),
                    ("sent bytes", c.tx_bytes),
                    ("received frames", c.rx_frames),
                    ("received bytes", c.rx_bytes),
                    ("delivered to sessions", c.rx_delivered),
                    ("of them in place", c.rx_in_place),
                    ("taken by no session", c.rx_unclaimed),
                    ("no buffer posted", c.rx_no_buffer),
                    ("truncated", c.rx_truncated),
                    ("device errors", c.rx_device_errors),
                ] {
                    println!("  {what:<22} {n}");
                }
            }
        }
        NetCommand::Send(a) => {
            let to = outboard_manager::children::parse_address(&a.to)?;
            let (mut d, _) = open(&a.nic, &control)?;
            let mut frame = Vec::with_capacity(64);
            frame.extend_from_slice(&to);
            frame.extend_from_slice(&d.info().mac);
            frame.extend_from_slice(&a.ethertype.to_be_bytes());
            frame.extend_from_slice(a.payload.as_bytes());
            if frame.len() < 60 {
                frame.resize(60, 0);
            }
            if frame.len() > d.info().max_frame() as usize {
                return Err(format!(
                    "a payload of {} bytes: {} takes frames of up to {} bytes",
                    a.payload.len(),
                    a.nic.nic,
                    d.info().max_frame()
                ));
            }
            for _ in 0..a.count {
                d.send(&frame).map_err(|e| format!("{}: {e}", a.nic.nic))?;
            }
            d.flush().map_err(|e| format!("{}: {e}", a.nic.nic))?;
            eprintln!(
                "{}: sent {} frame(s) of {} bytes",
                a.nic.nic,
                a.count,
                frame.len()
            );
        }
        NetCommand::Echo(a) => echo(a, &control)?,
        NetCommand::HoldOff { nic, duration } => {
            let (mut d, _) = open(&nic, &control)?;
            d.set_hold_off(duration)
                .map_err(|e| format!("{}: {e}", nic.nic))?;
            println!(
                "{}: receive interrupts held back up to {duration} µs",
                nic.nic
            );
        }
        NetCommand::Recv(a) => {
            let filter = match &a.filter {
                None => None,
                Some(path) => {
                    let text = if path.as_os_str() == "-" {
                        std::io::read_to_string(std::io::stdin())
                    } else {
                        std::fs::read_to_string(path)
                    }
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                    Some(
                        Program::from_text(&text)
                            .map_err(|e| format!("{}: {e}", path.display()))?,
                    )
                }
            };
            let (mut d, _) = open_with(&a.nic, &control, a.own)?;
            if let Some(p) = &filter {
                d.set_filter(Some(p))
                    .map_err(|e| format!("{}: {e}", a.nic.nic))?;
            }
            if a.promiscuous {
                d.set_mode(PROMISCUOUS)
                    .map_err(|e| format!("{}: {e}", a.nic.nic))?;
            }
            eprintln!("{}: listening ({})", a.nic.nic, d.info().mac_text());
            let mut got = 0;
            let mut last = Instant::now();
            while got < a.count {
                let left = a.timeout.saturating_sub(last.elapsed());
                match d.recv(left).map_err(|e| format!("{}: {e}", a.nic.nic))? {
                    Some(f) => {
                        got += 1;
                        last = Instant::now();
                        print_frame(&f, a.hex);
                    }
                    None => {
                        return Err(format!(
                            "{}: {got} of {} frame(s) within {:?} of the last",
                            a.nic.nic, a.count, a.timeout
                        ))
                    }
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Answers datagrams until `count` are answered (or forever).
fn echo(a: EchoArgs, control: &std::path::Path) -> Result<(), String> {
    let (addr, prefix) = parse_cidr(&a.address)?;
    let (mut d, placement) = open_with(&a.nic, control, a.own)?;
    let name = a.nic.nic;
    if let Some(us) = a.hold_off {
        d.set_hold_off(us).map_err(|e| format!("{name}: {e}"))?;
    }
    let mut udp = outboard_net_client::Udp::bind(d, addr, prefix, a.port)
        .map_err(|e| format!("{name}: {e}"))?;
    eprintln!("{name}: echoing UDP on {addr}:{} ({placement})", a.port);
    let mut buf = vec![0u8; 65536];
    let (mut answered, mut bytes) = (0u64, 0u64);
    let mut last = None::<Instant>;
    while a.count.is_none_or(|c| answered < c) {
        let wait = match (a.idle, last) {
            (Some(idle), Some(t)) => idle.saturating_sub(t.elapsed()),
            _ => Duration::from_secs(1),
        };
        match udp
            .recv_from(&mut buf, wait)
            .map_err(|e| format!("{name}: {e}"))?
        {
            Some((n, from)) => {
                if !a.discard {
                    udp.send_to(&buf[..n], from)
                        .map_err(|e| format!("{name}: {e}"))?;
                }
                answered += 1;
                bytes += n as u64;
                last = Some(Instant::now());
            }
            None if a.idle.is_some() && last.is_some() => break,
            None => {}
        }
    }
    // The last answers may still be in the session's ring: they go before the session does.
    udp.flush().map_err(|e| format!("{name}: {e}"))?;
    println!("{answered} datagrams, {bytes} bytes");
    Ok(())
}

fn print_frame(f: &[u8], hex: bool) {
    let mac = |b: &[u8]| mac_text(b.try_into().expect("6 bytes"));
    let ethertype = u16::from_be_bytes([f[12], f[13]]);
    println!(
        "{} bytes {} > {} type {ethertype:#06x}",
        f.len(),
        mac(&f[6..12]),
        mac(&f[..6])
    );
    if hex {
        let text: String = f.iter().map(|b| format!("{b:02x}")).collect();
        println!("  {text}");
    }
}

/// `outboard device virtio-net`.
#[derive(Args, Debug)]
pub struct VirtioNetArgs {
    #[command(flatten)]
    pub(crate) listen: outboard_manager::children::ModelListen,
    #[command(flatten)]
    pub(crate) own: outboard_manager::children::VirtioNetOwn,
    #[command(flatten)]
    pub(crate) faults: outboard_manager::children::ModelFaults,
    #[command(flatten)]
    pub confine: ConfineArgs,
}

/// `fd:N` (a descriptor the manager passed) as `N`; anything else (a path, an interface
/// name) as `None`.
fn inherited_fd_number(flag: &str, value: &str) -> Result<Option<i32>, String> {
    value
        .strip_prefix("fd:")
        .map(|n| {
            n.parse()
                .map_err(|_| format!("{flag} {value:?}: fd:N, N a number"))
        })
        .transpose()
}

/// Serves a virtio-net model.
pub fn serve_model(a: VirtioNetArgs) -> Result<ExitCode, String> {
    let mac = outboard_manager::children::parse_mac(&a.own.mac)?;
    let wire = match &a.own.wire {
        None if a.own.tap.is_some() => {
            let tap = a.own.tap.as_deref().expect("checked");
            let fd = match inherited_fd_number("--tap", tap)? {
                Some(n) => outboard_sys::process::inherited_device(n)
                    .map_err(|e| format!("--tap {tap}: {e}"))?,
                None => {
                    outboard_sys::tap::open(tap)
                        .map_err(|e| format!("--tap {tap}: {e}"))?
                        .0
                }
            };
            Some(Wire::tap(fd).map_err(|e| format!("--tap {tap}: {e}"))?)
        }
        None if a.own.stream.is_some() => {
            let path = a.own.stream.as_ref().expect("checked");
            let s = std::os::unix::net::UnixStream::connect(path)
                .map_err(|e| format!("--stream {}: {e}", path.display()))?;
            Some(Wire::stream(s.into()).map_err(|e| format!("--stream {}: {e}", path.display()))?)
        }
        None => None,
        Some(w) => {
            let n: i32 = w
                .strip_prefix("fd:")
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| format!("--wire {w:?}: give fd:N, an inherited SEQPACKET socket"))?;
            let fd = outboard_sys::process::inherited_socket(n)
                .map_err(|e| format!("--wire {w}: {e}"))?;
            Some(Wire::new(fd).map_err(|e| format!("--wire {w}: {e}"))?)
        }
    };
    let what = format!(
        "virtio-net ({}, mtu {}, {})",
        a.own.mac,
        a.own.mtu,
        match (&wire, &a.own.tap, &a.own.stream_listen) {
            (Some(_), Some(_), _) => "on a TAP interface",
            (Some(_), None, _) => "on a wire",
            (None, _, Some(_)) => "listening for a peer",
            (None, _, None) => "no cable",
        }
    );
    let opts = ModelOptions {
        mac,
        mtu: a.own.mtu,
        link_up: !a.own.link_down,
    };
    // A cable plugged in from the other end: the listening socket (and, if bound here, its
    // path, removed when the model ends).
    let mut _bound = None;
    let nic = match &a.own.stream_listen {
        Some(l) => {
            let fd = match inherited_fd_number("--stream-listen", l)? {
                Some(n) => outboard_sys::process::inherited_socket(n)
                    .map_err(|e| format!("--stream-listen {l}: {e}"))?,
                None => {
                    let (fd, path) = outboard_sys::sockpath::bind_listener(
                        std::path::Path::new(l),
                        rustix::net::SocketType::STREAM,
                        1,
                    )
                    .map_err(|e| format!("--stream-listen: {e}"))?;
                    _bound = Some(path);
                    fd
                }
            };
            VirtioNet::listening(opts, fd).map_err(|e| format!("--stream-listen {l}: {e}"))?
        }
        None => VirtioNet::new(opts, wire),
    };
    let model = outboard_devices::virtio_pci::VirtioPci::new(nic).map_err(|e| e.to_string())?;
    let _faults = crate::device::start_faults(a.faults, model.device().faults())?;
    crate::device::serve(model, &a.listen, &a.confine, &what)
}

/// Joins NIC `a.nic` and a new TAP interface until the process ends: each frame the host
/// writes to the interface is sent on the NIC, each frame the NIC receives (promiscuous: the
/// host's interface has an address of its own) is written to the interface.
pub fn export_tap(a: ExportTapArgs, control: PathBuf) -> Result<ExitCode, String> {
    use outboard_client::Control;
    use std::os::fd::AsFd;
    // Started by the manager it gets the interface made and its questions answered on
    // descriptors it inherits; started by hand it makes the interface and asks the control
    // socket.
    let made_here = a.tap_fd.is_none();
    let (tap, ifname) = match a.tap_fd {
        Some(fd) => {
            let tap = outboard_sys::process::inherited_device(fd)?;
            let flags = rustix::fs::fcntl_getfl(&tap).map_err(|e| e.to_string())?;
            rustix::fs::fcntl_setfl(&tap, flags | rustix::fs::OFlags::NONBLOCK)
                .map_err(|e| e.to_string())?;
            (tap, a.name.clone())
        }
        None => outboard_sys::tap::open(&a.name)?,
    };
    let control = match a.broker_fd {
        Some(fd) => Control::Broker(std::sync::Arc::new(outboard_client::Broker::new(
            outboard_sys::process::inherited_socket(fd)?,
        ))),
        None => Control::Socket(control),
    };
    let (mut nic, _) = outboard_client::open_via(
        &control,
        &a.nic,
        &outboard_net_client::Net(NetOptions {
            own_receive: a.own,
            ..NetOptions::default()
        }),
    )
    .map_err(|e| format!("{}: {e}", a.nic))?;
    // An interface made here carries the NIC's frames whole (the manager sets the MTU of
    // those it makes).
    if made_here && nic.info().mtu != 1500 {
        outboard_sys::tap::set_mtu(&ifname, nic.info().mtu)?;
    }
    // What needed privilege (the interface) is done: every capability goes before any
    // frame is read.
    let dropped =
        outboard_confine::privileges::drop_privileges(None, None).map_err(|e| e.to_string())?;
    rustix::thread::set_no_new_privs(true).map_err(|e| format!("PR_SET_NO_NEW_PRIVS: {e}"))?;
    tracing::info!("export tap: {dropped}, no_new_privs");
    // From here it reads frames the host and the NIC send: it opens no file and reaches
    // nothing but its session (and, started by hand, the manager's socket) — the NBD export's
    // confinement.
    if !a.no_confine {
        let dials = matches!(control, Control::Socket(_));
        crate::export::confine_export(
            "export tap",
            dials,
            outboard_confine::limits::Caps::default(),
            a.require_confinement,
        )?;
    }
    nic.set_mode(PROMISCUOUS)
        .map_err(|e| format!("{}: {e}", a.nic))?;
    eprintln!("{}: exported as {ifname}", a.nic);
    let max = nic.info().max_frame() as usize;
    let mut buf = vec![0u8; 65536];
    let (mut to_nic, mut to_host, mut dropped) = (0u64, 0u64, 0u64);
    loop {
        // The host's frames, as many as wait, out of the NIC.
        loop {
            match rustix::io::read(&tap, &mut buf) {
                Ok(n) if (14..=max).contains(&n) => match nic.send(&buf[..n]) {
                    Ok(()) => to_nic += 1,
                    // An earlier frame that may not have gone out: the host's stack retries.
                    Err(outboard_net::NetError::Interrupted) => dropped += 1,
                    Err(e) => return Err(format!("{}: {e}", a.nic)),
                },
                Ok(_) => dropped += 1,
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(format!("{ifname}: {e}")),
            }
        }
        // The NIC's frames into the host.
        while let Some(n) = nic
            .try_recv_into(&mut buf)
            .map_err(|e| format!("{}: {e}", a.nic))?
        {
            match rustix::io::write(&tap, &buf[..n]) {
                Ok(_) => to_host += 1,
                // The interface is down or its queue is full: the frame is lost, as on a wire.
                Err(_) => dropped += 1,
            }
        }
        tracing::trace!(to_nic, to_host, dropped, "tap export");
        nic.wait_or(tap.as_fd(), Duration::from_secs(1))
            .map_err(|e| format!("{}: {e}", a.nic))?;
    }
}
