//! The export server: listens on a UNIX socket or TCP, and gives every connection a thread
//! and a session of its own with the device it chooses — so several connections and exports
//! are served at once, and a slow or hostile client holds up only its own thread.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outboard_class::{BlockDevice, BlockError};

use crate::negotiate::{negotiate_with, Export, Outcome, TlsPolicy};
use crate::transmit::Conn;
use crate::transport::Transport;
use crate::NbdError;

/// Largest request payload offered (`NBD_INFO_BLOCK_SIZE`'s maximum).
pub const MAX_PAYLOAD: u32 = 4 << 20;
/// Each connection's session buffer area: room for several maximal requests in flight.
pub const SESSION_BUFFERS: u64 = 32 << 20;

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A UNIX socket at this path (created; an existing socket file is replaced, any other
    /// file is refused).
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

/// One export to serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSpec {
    /// The name clients ask for.
    pub name: String,
    /// The block device behind it.
    pub device: String,
    /// Refuse writes even if the device takes them.
    pub read_only: bool,
}

/// Opens a session with a block device by name: the device, and whether several sessions may
/// be open on it at once (a driver linked into this process serves one).
pub type Opener =
    Arc<dyn Fn(&str) -> Result<(Box<dyn BlockDevice>, bool), BlockError> + Send + Sync>;

enum Listener {
    /// The socket, and its path (removed when the server goes, if it is still ours).
    Unix(UnixListener, outboard_sys::SocketPath),
    Tcp(TcpListener),
}

/// The clients in transmission, per export, told to the manager as they come and go.
struct Clients {
    notify: Option<std::os::fd::OwnedFd>,
    /// (id, export, peer).
    list: std::sync::Mutex<Vec<(u64, String, String)>>,
    next: std::sync::atomic::AtomicU64,
}

impl Clients {
    fn join(self: &Arc<Self>, export: &str, peer: &str) -> ClientEntry {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().push((id, export.to_string(), peer.to_string()));
        self.report(export);
        ClientEntry {
            clients: self.clone(),
            id,
            export: export.to_string(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(u64, String, String)>> {
        // A panicking connection thread cannot leave the list half-changed: push and retain
        // are whole operations, so a poisoned lock's data is still right.
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn report(&self, export: &str) {
        let Some(fd) = &self.notify else { return };
        let clients = self
            .lock()
            .iter()
            .filter(|(_, e, _)| e == export)
            .map(|(_, _, p)| p.clone())
            .collect();
        let ev = outboard_session::control::Event::ExportClients {
            export: export.to_string(),
            clients,
        };
        if let Err(e) = outboard_session::control::try_send(fd.as_fd(), &ev, &[]) {
            tracing::warn!("cannot tell the manager about clients: {e}");
        }
    }
}

/// A client in transmission; leaves the list when dropped.
struct ClientEntry {
    clients: Arc<Clients>,
    id: u64,
    export: String,
}

impl Drop for ClientEntry {
    fn drop(&mut self) {
        self.clients.lock().retain(|(id, _, _)| *id != self.id);
        self.clients.report(&self.export);
    }
}

/// What is exported: each export's description, and the block device behind it (same index).
struct Exports {
    list: Vec<Export>,
    devices: Vec<String>,
}

/// A bound export server.
pub struct NbdServer {
    listener: Listener,
    exports: Arc<Exports>,
    open: Opener,
    active: Arc<AtomicUsize>,
    clients: Arc<Clients>,
    tls: Option<Arc<rustls::ServerConfig>>,
}

impl NbdServer {
    /// Opens each export's device once to learn what it is, then binds.
    pub fn bind(listen: &Listen, specs: &[ExportSpec], open: Opener) -> Result<Self, NbdError> {
        if specs.is_empty() {
            return Err(NbdError::Setup("nothing to export".into()));
        }
        let mut exports = Exports {
            list: Vec::new(),
            devices: Vec::new(),
        };
        for s in specs {
            if exports.list.iter().any(|e| e.name == s.name) {
                return Err(NbdError::Setup(format!("two exports named {:?}", s.name)));
            }
            let (dev, multi_conn) =
                open(&s.device).map_err(|e| NbdError::Setup(format!("{}: {e}", s.device)))?;
            let info = dev.info();
            let area = dev.buffers().len() as u64;
            let device_max = match info.max_transfer {
                0 => u32::MAX,
                m => m,
            };
            let max_payload = (MAX_PAYLOAD as u64)
                .min(area / 2 / 4096 * 4096)
                .min(device_max as u64) as u32;
            exports.devices.push(s.device.clone());
            exports.list.push(Export {
                name: s.name.clone(),
                description: format!("Outboard block device {}", s.device),
                size: info.capacity * info.block_size as u64,
                block_size: info.block_size,
                max_payload: max_payload / info.block_size * info.block_size,
                read_only: s.read_only || info.read_only,
                multi_conn,
            });
        }
        let listener = match listen {
            Listen::Unix(path) => {
                let (fd, claimed) =
                    outboard_sys::bind_listener(path, rustix::net::SocketType::STREAM, 64)
                        .map_err(|e| NbdError::Setup(e.to_string()))?;
                Listener::Unix(UnixListener::from(fd), claimed)
            }
            Listen::Tcp(addr) => Listener::Tcp(
                TcpListener::bind(addr).map_err(|e| NbdError::Setup(format!("{addr}: {e}")))?,
            ),
        };
        Ok(Self {
            listener,
            exports: Arc::new(exports),
            open,
            active: Arc::new(AtomicUsize::new(0)),
            clients: Arc::new(Clients {
                notify: None,
                list: Default::default(),
                next: Default::default(),
            }),
            tls: None,
        })
    }

    /// Requires TLS (`NBD_OPT_STARTTLS`) of every client, with `config`.
    pub fn tls(mut self, config: Arc<rustls::ServerConfig>) -> Self {
        self.tls = Some(config);
        self
    }

    /// Reports clients coming and going on `notify` (the manager's event channel), starting
    /// with an empty list per export now: the manager takes that as "listening".
    pub fn notify(mut self, notify: std::os::fd::OwnedFd) -> Self {
        if let Some(c) = Arc::get_mut(&mut self.clients) {
            c.notify = Some(notify);
        }
        for e in &self.exports.list {
            self.clients.report(&e.name);
        }
        self
    }

    /// What is exported.
    pub fn exports(&self) -> Vec<Export> {
        self.exports.list.clone()
    }

    /// Where it listens (`unix:PATH` or `tcp:ADDR:PORT`, with the port actually bound).
    pub fn address(&self) -> String {
        match &self.listener {
            Listener::Unix(_, p) => format!("unix:{}", p.path().display()),
            Listener::Tcp(l) => l
                .local_addr()
                .map(|a| format!("tcp:{a}"))
                .unwrap_or_else(|e| format!("tcp:? ({e})")),
        }
    }

    /// Connections being served now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Accepts and serves connections until `stop` is set.
    pub fn run(&self, stop: &AtomicBool) -> Result<(), NbdError> {
        while !stop.load(Ordering::Relaxed) {
            let ready = match &self.listener {
                Listener::Unix(l, _) => readable(l),
                Listener::Tcp(l) => readable(l),
            };
            if !ready {
                continue;
            }
            let accepted = match &self.listener {
                Listener::Unix(l, _) => l.accept().map(|(s, _)| self.spawn(s, "unix".into())),
                Listener::Tcp(l) => l.accept().map(|(s, peer)| {
                    let _ = s.set_nodelay(true);
                    self.spawn(s, peer.to_string())
                }),
            };
            if let Err(e) = accepted {
                tracing::warn!("accept: {e}");
            }
        }
        Ok(())
    }

    fn spawn<S: Transport + AsFd + Send + 'static>(&self, s: S, peer: String) {
        let exports = self.exports.clone();
        let open = self.open.clone();
        let active = self.active.clone();
        let clients = self.clients.clone();
        let tls = self.tls.clone();
        active.fetch_add(1, Ordering::Relaxed);
        let spawned = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                let join = |export: &str| clients.join(export, &peer);
                match connection(s, &exports, &open, &join, tls) {
                    Ok(Some(stats)) => tracing::info!(
                        "{peer}: done ({} ok, {} errors, {} bytes)",
                        stats.ok,
                        stats.errors,
                        stats.bytes
                    ),
                    Ok(None) => tracing::debug!("{peer}: left during negotiation"),
                    Err(e) => tracing::warn!("{peer}: {e}"),
                }
                active.fetch_sub(1, Ordering::Relaxed);
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start a connection thread: {e}");
            self.active.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

fn readable(fd: &impl AsFd) -> bool {
    outboard_class::block::readable(fd.as_fd(), Duration::from_millis(200)).unwrap_or(false)
}

/// What a connection needs from the server.
struct Shared<'a> {
    exports: &'a Exports,
    open: &'a Opener,
    join: &'a dyn Fn(&str) -> ClientEntry,
    tls: Option<Arc<rustls::ServerConfig>>,
}

/// One connection: negotiation (TLS started inside it if the client asks or the export
/// requires), a session with the chosen device, transmission.
fn connection<S: Transport + AsFd>(
    mut s: S,
    exports: &Exports,
    open: &Opener,
    join: &dyn Fn(&str) -> ClientEntry,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> Result<Option<crate::transmit::ConnStats>, NbdError> {
    let sh = Shared {
        exports,
        open,
        join,
        tls,
    };
    let policy = TlsPolicy {
        available: sh.tls.is_some(),
        required: sh.tls.is_some(),
        active: false,
    };
    let mut dev = None;
    let first = negotiate_with(
        &mut s,
        &sh.exports.list,
        &mut chooser(&sh, &mut dev),
        policy,
        false,
    )?;
    match first {
        Outcome::StartTls { no_zeroes } => {
            let config = sh.tls.clone().expect("offered only when configured");
            let conn = rustls::ServerConnection::new(config)
                .map_err(|e| NbdError::Setup(format!("TLS: {e}")))?;
            let mut tls = rustls::StreamOwned::new(conn, s);
            while tls.conn.is_handshaking() {
                tls.conn
                    .complete_io(&mut tls.sock)
                    .map_err(|e| NbdError::Protocol(format!("TLS handshake: {e}")))?;
            }
            let policy = TlsPolicy {
                active: true,
                ..policy
            };
            let outcome = negotiate_with(
                &mut tls,
                &sh.exports.list,
                &mut chooser(&sh, &mut dev),
                policy,
                no_zeroes,
            )?;
            transmit(tls, outcome, dev, &sh)
        }
        outcome => transmit(s, outcome, dev, &sh),
    }
}

/// Opens the chosen export's device before the client is told yes, so a busy or failed
/// device is refused during negotiation, with the reason.
fn chooser<'a>(
    sh: &'a Shared<'_>,
    dev: &'a mut Option<Box<dyn BlockDevice>>,
) -> impl FnMut(usize) -> Result<(), String> + 'a {
    move |i| {
        let (d, _) = (sh.open)(&sh.exports.devices[i]).map_err(|e| e.to_string())?;
        *dev = Some(d);
        Ok(())
    }
}

fn transmit<S: Transport>(
    s: S,
    outcome: Outcome,
    dev: Option<Box<dyn BlockDevice>>,
    sh: &Shared<'_>,
) -> Result<Option<crate::transmit::ConnStats>, NbdError> {
    let Outcome::Go { export, structured } = outcome else {
        return Ok(None);
    };
    let mut dev = dev.ok_or_else(|| NbdError::Setup("no session after negotiation".into()))?;
    let _client = (sh.join)(&sh.exports.list[export].name);
    Conn::new(s, dev.as_mut(), &sh.exports.list[export], structured)
        .run()
        .map(Some)
}
