//! `outboard export`: a machine's block devices for ordinary tools, over NBD.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::Subcommand;
use outboard_block_client::SessionOptions;
use outboard_client::api::Placement;
use outboard_client::Control;
use outboard_manager::children::ExportNbdArgs;
use outboard_nbd::{ExportSpec, Listen, Listener, NbdServer, Opener};

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
    Nbd(Box<ExportNbdArgs>),
    /// Make a NIC a host network interface (TAP) until Ctrl-C: frames the host sends on the
    /// interface go out of the NIC, and every frame the NIC receives comes in on it, so the
    /// host's stack and ordinary tools (ping, iperf3, tcpdump) run over an Outboard driver.
    ///
    /// The interface is made down and without an address: bring it up (and move it to a
    /// network namespace) with ip(8). It goes away when the export ends.
    ///
    /// Example:
    ///   outboard export tap nic0 --name ob0 &
    ///   ip addr add 10.0.0.1/24 dev ob0; ip link set ob0 up
    #[command(verbatim_doc_comment)]
    Tap(outboard_manager::children::ExportTapArgs),
}

/// Runs an export command.
pub fn run(c: ExportCommand, control: PathBuf) -> Result<ExitCode, String> {
    let a = match c {
        ExportCommand::Nbd(a) => *a,
        ExportCommand::Tap(a) => return crate::net::export_tap(a, control),
    };
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
            // The same directory the manager would use, held to the same rule: only this
            // user may write it (else another could swap the socket under this user's clients).
            let dir = outboard_client::manager::default_runtime_dir();
            outboard_manager::runtime::private_dir(&dir).map_err(|e| e.to_string())?;
            Listen::Unix(dir.join("nbd.sock"))
        }
    };
    // Started by the manager, it asks it, and has it connect to driver servers, on the
    // connection it was given; started by hand, it uses the control socket.
    let control_path = control.clone();
    let control = match a.broker_fd {
        Some(fd) => Control::Broker(Arc::new(outboard_client::Broker::new(
            outboard_sys::process::inherited_socket(fd)?,
        ))),
        None => Control::Socket(control),
    };
    let dials = matches!(control, Control::Socket(_));
    let open: Opener = Arc::new(move |device: &str| {
        let opts = SessionOptions {
            buffer_size: outboard_nbd::server::SESSION_BUFFERS,
            ..Default::default()
        };
        let (d, placement) = outboard_block_client::open_block_via(&control, device, opts)?;
        Ok((d, placement == Placement::Separate))
    });
    // What needs privilege comes first: the keys (a file only root may read, say) and the
    // socket (a port below 1024). Then every capability goes, and the user becomes --user's if
    // given, before any thread starts (capabilities belong to each thread): the export parses
    // what any client sends, and a flaw in that must not come with root's capabilities or id.
    // (Started by root without --user it keeps uid 0; its confinement, below, keeps it from
    // opening any file, and a managed export from connecting anywhere.)
    let tls = match (&a.tls_cert, &a.tls_key, &a.tls_psk) {
        (Some(cert), Some(key), _) => Some(outboard_nbd::tls::Tls::Certificates(
            outboard_nbd::tls::server_config(cert, key, a.tls_verify_peer.as_deref())
                .map_err(|e| e.to_string())?,
        )),
        (_, _, Some(file)) => Some(outboard_nbd::tls::Tls::Psk(
            outboard_nbd::tls::PskKeys::from_file(file).map_err(|e| e.to_string())?,
        )),
        _ => None,
    };
    let listener = Listener::bind(&listen).map_err(|e| e.to_string())?;
    let dropped =
        outboard_confine::privileges::drop_privileges(a.user, None).map_err(|e| e.to_string())?;
    // Nothing regained through an exec of a set-uid program, no core file of a peer's data.
    rustix::thread::set_no_new_privs(true).map_err(|e| format!("PR_SET_NO_NEW_PRIVS: {e}"))?;
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(|e| format!("PR_SET_DUMPABLE: {e}"))?;
    tracing::info!("export: {dropped}, no_new_privs, not dumpable, before any thread");
    let mut server = NbdServer::on(listener, &specs, open)
        .map_err(|e| e.to_string())?
        .limits(outboard_nbd::server::Limits {
            max_connections: a.max_connections as usize,
            handshake: a.handshake_timeout,
            idle: a.idle_timeout,
            stuck_writer: a.write_timeout,
            ..Default::default()
        });
    let tls = match tls {
        Some(outboard_nbd::tls::Tls::Certificates(config)) => {
            server = server.tls(config);
            true
        }
        Some(outboard_nbd::tls::Tls::Psk(keys)) => {
            server = server.tls_psk(keys);
            true
        }
        None => false,
    };
    if let Some(fd) = a.notify_fd {
        server = server.notify(outboard_sys::process::inherited_socket(fd)?);
    }
    let uris: Vec<(String, String)> = server
        .exports()
        .iter()
        .map(|e| {
            let s = if tls { "s" } else { "" };
            let uri = match &listen {
                Listen::Unix(p) => format!("nbd{s}+unix:///{}?socket={}", e.name, p.display()),
                Listen::Tcp(addr) => format!("nbd{s}://{addr}/{}", e.name),
            };
            (e.name.clone(), uri)
        })
        .collect();
    if dials {
        server = register_by_hand(server, &control_path, &specs, &uris);
    }
    // From here it parses what any client sends: it opens no file and reaches nothing but
    // UNIX sockets (sessions with driver servers, the manager), on every thread.
    if !a.no_confine {
        let caps = outboard_confine::limits::Caps {
            files: a.max_files,
            memory: a.max_memory,
        };
        let report = confine_export("export", dials, caps, a.require_confinement)?;
        if !report.landlock_complete {
            outboard_sys::errln!(
                "outboard: warning: Landlock is not complete here (landlock {}); the seccomp \
                 filter still holds on every thread",
                report.landlock
            );
        }
    }
    for (e, (_, uri)) in server.exports().iter().zip(&uris) {
        outboard_sys::outln!(
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

/// An export started by hand registers each of its exports with the manager at `control`
/// (before it is confined: a connection of its own), which shows them in the registry, with
/// their clients as they come and go, for as long as the export runs. A manager that cannot
/// be told costs a warning, not the export.
fn register_by_hand(
    server: NbdServer,
    control: &std::path::Path,
    specs: &[ExportSpec],
    uris: &[(String, String)],
) -> NbdServer {
    let registered: Vec<outboard_client::manager::Registration> = uris
        .iter()
        .filter_map(|(name, uri)| {
            let device = &specs.iter().find(|s| &s.name == name)?.device;
            outboard_client::manager::Registration::new(control, name, device, uri)
                .map_err(|e| {
                    outboard_sys::errln!(
                        "outboard: warning: export {name} is not in the registry: {e}; it serves \
                         anyway"
                    )
                })
                .ok()
        })
        .collect();
    if registered.is_empty() {
        return server;
    }
    server.on_clients(Box::new(move |export, clients| {
        if let Some(r) = registered.iter().find(|r| r.name() == export) {
            if let Err(e) = r.clients(clients) {
                tracing::debug!("export {export}: the manager was not told its clients: {e}");
            }
        }
    }))
}

/// Confines an export (`who` names it in the log) for the rest of its life; with
/// `require`, a Landlock that is not complete here is an error rather than a warning.
pub fn confine_export(
    who: &str,
    dials: bool,
    caps: outboard_confine::limits::Caps,
    require: bool,
) -> Result<outboard_confine::Report, String> {
    let report = outboard_confine::confine(outboard_confine::Role::Export { dials }, caps)
        .map_err(|e| e.to_string())?;
    tracing::info!("{who}: {report}");
    if !report.landlock_complete && require {
        return Err(format!(
            "--require-confinement: Landlock is not complete here (landlock {})",
            report.landlock
        ));
    }
    Ok(report)
}
