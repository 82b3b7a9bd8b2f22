//! `outboard export`: a machine's block devices for ordinary tools, over NBD.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::Subcommand;
use outboard_block_client::SessionOptions;
use outboard_client::api::Placement;
use outboard_nbd::{ExportSpec, Listen, NbdServer, Opener};

/// `outboard export …`.
#[derive(Subcommand)]
pub enum ExportCommand {
    /// Serve block devices to NBD clients (qemu, nbdcopy, nbdinfo, fio, the kernel) until
    /// Ctrl-C.
    ///
    /// Fixed newstyle negotiation with NBD_OPT_GO/INFO/LIST/ABORT/EXPORT_NAME, structured
    /// replies, the device's block size in NBD_INFO_BLOCK_SIZE; read, write, flush, FUA, trim,
    /// write-zeroes, cache. Each connection gets a session of its own with the device;
    /// once the driver server has no room for more, connections share one the export
    /// reserved, taking buffers per request in flight.
    ///
    /// Examples:
    ///   outboard export nbd disk0 --socket /tmp/disk0.nbd
    ///   nbdinfo 'nbd+unix:///disk0?socket=/tmp/disk0.nbd'
    ///   outboard export nbd disk0 disk1 --listen 127.0.0.1:10809
    ///   outboard export nbd disk0 --listen 127.0.0.1:10809 --tls-cert c.pem --tls-key k.pem \
    ///       --tls-verify-peer ca.pem
    ///
    /// A TCP address other than loopback needs TLS (or --insecure).
    #[command(verbatim_doc_comment)]
    Nbd(NbdArgs),
}

/// `outboard export nbd`.
#[derive(clap::Args)]
pub struct NbdArgs {
    /// Block devices to export, each under its own name (the first is also the default
    /// export, "").
    #[arg(required = true, value_name = "DEVICE")]
    devices: Vec<String>,
    /// Listen on a UNIX socket at PATH [default: nbd.sock in the runtime directory].
    #[arg(long, value_name = "PATH", conflicts_with = "listen")]
    socket: Option<PathBuf>,
    /// Listen on TCP, e.g. 127.0.0.1:10809 (NBD's port). An address other than loopback is
    /// refused without --tls-cert (anyone who reaches it could read and write the disk), unless
    /// --insecure is given.
    #[arg(long, value_name = "ADDR:PORT")]
    listen: Option<SocketAddr>,
    /// The export's name, when exporting one device [default: the device's name].
    #[arg(long)]
    name: Option<String>,
    /// Refuse writes (and trims, write-zeroes) from clients.
    #[arg(long)]
    read_only: bool,
    /// Require TLS (NBD_OPT_STARTTLS) with this certificate chain (PEM, leaf first); clients
    /// then use nbds:// URIs.
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require a client certificate signed by one of these certificate authorities (PEM), as
    /// qemu-nbd's and nbdkit's verify-peer: only clients holding such a certificate and its
    /// key get in. Without it, TLS authenticates the server only.
    #[arg(long, value_name = "CA_PEM", requires = "tls_cert")]
    tls_verify_peer: Option<PathBuf>,
    /// Require TLS with pre-shared keys from FILE instead of certificates: one
    /// `identity:hexkey` per line, as nbdkit's --tls-psk and GnuTLS's psktool write it.
    /// Clients use e.g. nbds://alice@host/disk0?tls-psk-file=FILE.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["tls_cert", "tls_key"])]
    tls_psk: Option<PathBuf>,
    /// Serve a TCP address other than loopback without TLS (a trusted network only).
    #[arg(long)]
    insecure: bool,
    /// Serve at most this many connections at once; more are refused during negotiation with
    /// the reason (NBD_REP_ERR_POLICY).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    max_connections: u64,
    /// Close a connection that has not finished negotiating after this long without a message
    /// (e.g. 10s).
    #[arg(long, default_value = "10s", value_parser = duration)]
    handshake_timeout: std::time::Duration,
    /// Close a connection that sends no request for this long [default: never, as qemu-nbd].
    #[arg(long, value_parser = duration)]
    idle_timeout: Option<std::time::Duration>,
    /// Close a connection whose client takes no reply data for this long.
    #[arg(long, default_value = "30s", value_parser = duration)]
    write_timeout: std::time::Duration,
    /// (internal) Report clients to the manager on this inherited descriptor.
    #[arg(long, hide = true, value_name = "FD")]
    notify_fd: Option<i32>,
}

fn duration(s: &str) -> Result<std::time::Duration, String> {
    outboard_manager::config::parse_duration(s).ok_or_else(|| format!("{s:?}: e.g. 500ms, 30s"))
}

/// Runs an export command.
pub fn run(c: ExportCommand, control: PathBuf) -> Result<ExitCode, String> {
    let ExportCommand::Nbd(a) = c;
    if a.name.is_some() && a.devices.len() > 1 {
        return Err("--name names one export: give one device, or let each keep its name".into());
    }
    let specs: Vec<ExportSpec> = a
        .devices
        .iter()
        .map(|d| ExportSpec {
            name: a.name.clone().unwrap_or_else(|| d.clone()),
            device: d.clone(),
            read_only: a.read_only,
        })
        .collect();
    if let Some(addr) = a.listen {
        if !addr.ip().is_loopback() && a.tls_cert.is_none() && a.tls_psk.is_none() && !a.insecure {
            return Err(format!(
                "refusing to serve {addr} without TLS: anyone who can reach it could read and \
                 write the disk. Add --tls-cert and --tls-key (and --tls-verify-peer CA_PEM to \
                 admit only clients with a certificate) or --tls-psk FILE, listen on \
                 127.0.0.1, or give --insecure on a network you trust"
            ));
        }
    }
    let listen = match (&a.socket, a.listen) {
        (_, Some(addr)) => Listen::Tcp(addr),
        (Some(p), None) => Listen::Unix(p.clone()),
        (None, None) => {
            Listen::Unix(outboard_client::manager::default_runtime_dir().join("nbd.sock"))
        }
    };
    let open: Opener = Arc::new(move |device: &str| {
        let opts = SessionOptions {
            buffer_size: outboard_nbd::server::SESSION_BUFFERS,
            ..Default::default()
        };
        let (d, placement) = outboard_block_client::open_block_with(&control, device, opts)?;
        Ok((d, placement == Placement::Separate))
    });
    let mut server = NbdServer::bind(&listen, &specs, open)
        .map_err(|e| e.to_string())?
        .limits(outboard_nbd::server::Limits {
            max_connections: a.max_connections as usize,
            handshake: a.handshake_timeout,
            idle: a.idle_timeout,
            stuck_writer: a.write_timeout,
        });
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => {
            let config = outboard_nbd::tls::server_config(cert, key, a.tls_verify_peer.as_deref())
                .map_err(|e| e.to_string())?;
            server = server.tls(config);
            true
        }
        _ => match &a.tls_psk {
            Some(file) => {
                let keys =
                    outboard_nbd::tls::PskKeys::from_file(file).map_err(|e| e.to_string())?;
                server = server.tls_psk(keys);
                true
            }
            None => false,
        },
    };
    if let Some(fd) = a.notify_fd {
        server = server.notify(outboard_sys::process::inherited_socket(fd)?);
    }
    for e in server.exports() {
        let s = if tls { "s" } else { "" };
        let uri = match &listen {
            Listen::Unix(p) => format!("nbd{s}+unix:///{}?socket={}", e.name, p.display()),
            Listen::Tcp(addr) => format!("nbd{s}://{addr}/{}", e.name),
        };
        println!(
            "exporting {} ({} bytes, {}-byte blocks{}) at {uri}",
            e.name,
            e.size,
            e.block_size,
            if e.read_only { ", read-only" } else { "" }
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).map_err(|e| e.to_string())?;
    }
    server.run(&stop).map_err(|e| e.to_string())?;
    Ok(ExitCode::SUCCESS)
}
