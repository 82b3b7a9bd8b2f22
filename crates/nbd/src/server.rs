//! The export server: listens on a UNIX socket or TCP, and gives every connection a thread of
//! its own and a session of its own with the device it chooses, or, once the driver server
//! has no room for more sessions, a part of the session the export reserved ([`crate::hub`]) —
//! so several connections and exports are served at once, and a slow, idle or hostile client
//! holds up only its own thread and its own share of buffers.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outboard_block::{BlockDevice, BlockError};

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

/// A bound, listening socket ([`Listener::bind`]), made before the server so that a process
/// can bind (a privileged port, say) and then give up its privileges before it starts any
/// thread.
pub enum Listener {
    /// The socket, and its path (removed when the server goes, if it is still ours).
    Unix(UnixListener, outboard_sys::SocketPath),
    /// A TCP socket.
    Tcp(TcpListener),
}

impl Listener {
    /// Binds and listens where `listen` says.
    pub fn bind(listen: &Listen) -> Result<Self, NbdError> {
        Ok(match listen {
            Listen::Unix(path) => {
                let (fd, claimed) =
                    outboard_sys::bind_listener(path, rustix::net::SocketType::STREAM, 64)
                        .map_err(|e| NbdError::Setup(e.to_string()))?;
                Listener::Unix(UnixListener::from(fd), claimed)
            }
            Listen::Tcp(addr) => Listener::Tcp(
                TcpListener::bind(addr).map_err(|e| NbdError::Setup(format!("{addr}: {e}")))?,
            ),
        })
    }
}

/// Who is told an export's clients (its name, their addresses) as they come and go.
pub type ClientsHook = Box<dyn Fn(&str, Vec<String>) + Send + Sync>;

/// The clients in transmission, per export, told to the manager as they come and go.
struct Clients {
    notify: Option<std::os::fd::OwnedFd>,
    hook: Option<ClientsHook>,
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
        if self.notify.is_none() && self.hook.is_none() {
            return;
        }
        let clients: Vec<String> = self
            .lock()
            .iter()
            .filter(|(_, e, _)| e == export)
            .map(|(_, _, p)| p.clone())
            .collect();
        if let Some(hook) = &self.hook {
            hook(export, clients.clone());
        }
        let Some(fd) = &self.notify else { return };
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

/// What is exported: each export's description, the block device behind it, and the session
/// its connections share (same index; `None` where each connection needs its own).
struct Exports {
    list: Vec<Export>,
    devices: Vec<String>,
    hubs: Vec<Option<Arc<crate::hub::Hub>>>,
}

/// What one connection may take, and how long it may take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; more are refused during negotiation, with the reason.
    pub max_connections: usize,
    /// Longest wait for each piece of a client's negotiation (greeting answer, option).
    pub handshake: Duration,
    /// A connection that sends no request for this long is closed (`None`: never).
    pub idle: Option<Duration>,
    /// A reply the client does not take for this long closes its connection.
    pub stuck_writer: Duration,
    /// Connections that get a session of their own with the driver server; the others share
    /// the export's reserved session. Each own session takes a buffer area in the driver
    /// server whether or not its connection sends anything, so without this bound idle
    /// connections would spend the server's whole budget and lock the device's other
    /// clients (the CLI, programs, other exports) out.
    pub own_sessions: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            handshake: Duration::from_secs(10),
            idle: None,
            stuck_writer: Duration::from_secs(30),
            own_sessions: 8,
        }
    }
}

/// Connections past the limit told why at once, each on a thread of its own for at most
/// [`REFUSAL_TIME`]; more than that are closed unanswered, so a flood costs no thread.
const REFUSERS: usize = 4;
const REFUSAL_TIME: Duration = Duration::from_secs(1);

/// How long accepting pauses after it failed (out of descriptors), and how often that is
/// logged at most.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// A bound export server.
pub struct NbdServer {
    listener: Listener,
    exports: Arc<Exports>,
    open: Opener,
    active: Arc<AtomicUsize>,
    /// Connections being refused (past the limit) now.
    refusing: Arc<AtomicUsize>,
    /// Connections with a session of their own now.
    own: Arc<AtomicUsize>,
    deadlines: Arc<crate::deadline::Deadlines>,
    clients: Arc<Clients>,
    tls: Option<crate::tls::Tls>,
    limits: Limits,
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        for h in self.exports.hubs.iter().flatten() {
            h.stop();
        }
    }
}

impl NbdServer {
    /// Binds, then opens each export's device once to learn what it is.
    pub fn bind(listen: &Listen, specs: &[ExportSpec], open: Opener) -> Result<Self, NbdError> {
        Self::on(Listener::bind(listen)?, specs, open)
    }

    /// Serves on a socket already bound: opens each export's device once to learn what it
    /// is (this starts a thread per shared session).
    pub fn on(listener: Listener, specs: &[ExportSpec], open: Opener) -> Result<Self, NbdError> {
        if specs.is_empty() {
            return Err(NbdError::Setup("nothing to export".into()));
        }
        let mut exports = Exports {
            list: Vec::new(),
            devices: Vec::new(),
            hubs: Vec::new(),
        };
        for s in specs {
            if exports.list.iter().any(|e| e.name == s.name) {
                return Err(NbdError::Setup(format!("two exports named {:?}", s.name)));
            }
            let setup = |e: BlockError| NbdError::Setup(format!("{}: {e}", s.device));
            // One session per device, shared by its connections; where the device keeps its
            // buffers in private memory (a driver in this process), one per connection.
            let (hub, multi_conn) = crate::hub::Hub::start(&s.device, &open).map_err(setup)?;
            let (info, area) = match &hub {
                Some(h) => (h.info().clone(), h.area()),
                None => {
                    let (dev, _) = open(&s.device).map_err(setup)?;
                    (dev.info().clone(), dev.buffers().len() as u64)
                }
            };
            let device_max = match info.max_transfer {
                0 => u32::MAX,
                m => m,
            };
            let max_payload = (MAX_PAYLOAD as u64)
                .min(area / 2 / 4096 * 4096)
                .min(device_max as u64) as u32;
            exports.devices.push(s.device.clone());
            exports.hubs.push(hub);
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
        Ok(Self {
            listener,
            exports: Arc::new(exports),
            open,
            active: Arc::new(AtomicUsize::new(0)),
            refusing: Arc::new(AtomicUsize::new(0)),
            own: Arc::new(AtomicUsize::new(0)),
            deadlines: Default::default(),
            clients: Arc::new(Clients {
                notify: None,
                hook: None,
                list: Default::default(),
                next: Default::default(),
            }),
            tls: None,
            limits: Limits::default(),
        })
    }

    /// Sets how many connections are served and how long each may wait or stall.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Requires TLS (`NBD_OPT_STARTTLS`) of every client, with `config`.
    pub fn tls(mut self, config: Arc<rustls::ServerConfig>) -> Self {
        self.tls = Some(crate::tls::Tls::Certificates(config));
        self
    }

    /// Requires TLS of every client, authenticated by a pre-shared key (`--tls-psk`).
    pub fn tls_psk(mut self, keys: crate::tls::PskKeys) -> Self {
        self.tls = Some(crate::tls::Tls::Psk(keys));
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

    /// Calls `hook` with an export's clients whenever they change (an export started by
    /// hand tells the manager so).
    pub fn on_clients(mut self, hook: ClientsHook) -> Self {
        if let Some(c) = Arc::get_mut(&mut self.clients) {
            c.hook = Some(hook);
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
        std::thread::scope(|scope| {
            scope.spawn(|| self.deadlines.watch(stop));
            self.accept_until(stop)
        })
    }

    fn accept_until(&self, stop: &AtomicBool) -> Result<(), NbdError> {
        let mut logged: Option<std::time::Instant> = None;
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
                // Out of descriptors (EMFILE) leaves the listener readable: trying again at
                // once would spin and flood the log. Pause, and say so once per interval.
                let now = std::time::Instant::now();
                if logged.is_none_or(|t| now.duration_since(t) >= ACCEPT_LOG_INTERVAL) {
                    tracing::warn!(
                        "accept: {e}; pausing (further accept errors within \
                         {ACCEPT_LOG_INTERVAL:?} are not logged)"
                    );
                    logged = Some(now);
                }
                std::thread::sleep(ACCEPT_BACKOFF);
            }
        }
        Ok(())
    }

    fn spawn<S: Transport + AsFd + Send + 'static>(&self, s: S, peer: String) {
        let limits = self.limits;
        // Decided before any thread starts, so a burst can neither overshoot the limit nor
        // make a thread per connection.
        let (slot, full) = if self.active.fetch_add(1, Ordering::Relaxed) < limits.max_connections {
            (Slot(self.active.clone()), None)
        } else {
            self.active.fetch_sub(1, Ordering::Relaxed);
            if self.refusing.fetch_add(1, Ordering::Relaxed) >= REFUSERS {
                self.refusing.fetch_sub(1, Ordering::Relaxed);
                tracing::debug!("{peer}: closed unanswered (at the connection limit)");
                return;
            }
            let why = format!(
                "the export serves at most {} connections at once; try again later",
                limits.max_connections
            );
            (Slot(self.refusing.clone()), Some(why))
        };
        let sh = Owned {
            exports: self.exports.clone(),
            open: self.open.clone(),
            own: self.own.clone(),
            deadlines: self.deadlines.clone(),
            clients: self.clients.clone(),
            tls: self.tls.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                let _slot = slot;
                match connection(s, &sh, &peer, limits, full) {
                    Ok(Some(stats)) => tracing::info!(
                        "{peer}: done ({} ok, {} errors, {} bytes)",
                        stats.ok,
                        stats.errors,
                        stats.bytes
                    ),
                    Ok(None) => tracing::debug!("{peer}: left during negotiation"),
                    Err(e) => tracing::warn!("{peer}: {e}"),
                }
            });
        // A thread that did not start dropped its closure, and with it the slot.
        if let Err(e) = spawned {
            tracing::error!("cannot start a connection thread: {e}");
        }
    }
}

/// A place counted in one of the server's counters, given back when dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a connection thread takes from the server.
struct Owned {
    exports: Arc<Exports>,
    open: Opener,
    own: Arc<AtomicUsize>,
    deadlines: Arc<crate::deadline::Deadlines>,
    clients: Arc<Clients>,
    tls: Option<crate::tls::Tls>,
}

fn readable(fd: &impl AsFd) -> bool {
    outboard_block::readable(fd.as_fd(), Duration::from_millis(200)).unwrap_or(false)
}

/// What a connection needs from the server.
struct Shared<'a> {
    exports: &'a Exports,
    open: &'a Opener,
    join: &'a dyn Fn(&str) -> ClientEntry,
    tls: Option<crate::tls::Tls>,
    /// Why every export is refused to this connection (the server is full).
    full: Option<String>,
    /// Connections with a session of their own, and how many may have one.
    own: (&'a Arc<AtomicUsize>, usize),
}

/// A connection's session with its export's device: its own, or its part of the shared one.
enum Session {
    /// A session of its own, counted in the server's own sessions while it lives.
    Own(Box<dyn BlockDevice>, Slot),
    Shared(crate::hub::HubDevice, crate::hub::HubBuffers),
}

/// Sets `SO_RCVTIMEO` (`None`: wait for ever) and `SO_SNDTIMEO` on a connection's socket.
fn timeouts(fd: std::os::fd::BorrowedFd<'_>, recv: Option<Duration>, send: Duration) {
    use rustix::net::sockopt::{set_socket_timeout, Timeout};
    let _ = set_socket_timeout(fd, Timeout::Recv, recv);
    let _ = set_socket_timeout(fd, Timeout::Send, Some(send));
}

/// One connection: negotiation (TLS started inside it if the client asks or the export
/// requires), a session with the chosen device, transmission.
fn connection<S: Transport + AsFd>(
    mut s: S,
    owned: &Owned,
    peer: &str,
    limits: Limits,
    full: Option<String>,
) -> Result<Option<crate::transmit::ConnStats>, NbdError> {
    // Negotiation, TLS's handshake included, must end within its time as a whole (a
    // client trickling a byte at a time passes every per-read time-out); a client that
    // stops taking replies is dropped. One refused for want of room gets a second to read
    // why and go.
    let handshake = match full {
        Some(_) => limits.handshake.min(REFUSAL_TIME),
        None => limits.handshake,
    };
    timeouts(s.as_fd(), Some(handshake), limits.stuck_writer);
    let negotiating = owned.deadlines.arm(s.as_fd(), handshake)?;
    let join = |export: &str| owned.clients.join(export, peer);
    let sh = Shared {
        exports: &owned.exports,
        open: &owned.open,
        join: &join,
        tls: owned.tls.clone(),
        full,
        own: (&owned.own, limits.own_sessions),
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
            let policy = TlsPolicy {
                active: true,
                ..policy
            };
            match sh.tls.clone().expect("offered only when configured") {
                crate::tls::Tls::Certificates(config) => {
                    let conn = rustls::ServerConnection::new(config)
                        .map_err(|e| NbdError::Setup(format!("TLS: {e}")))?;
                    let mut tls = rustls::StreamOwned::new(conn, s);
                    while tls.conn.is_handshaking() {
                        tls.conn
                            .complete_io(&mut tls.sock)
                            .map_err(|e| NbdError::Protocol(format!("TLS handshake: {e}")))?;
                    }
                    secured(tls, &sh, &mut dev, policy, no_zeroes, limits, negotiating)
                }
                crate::tls::Tls::Psk(keys) => {
                    let tls = keys.accept(s)?;
                    secured(tls, &sh, &mut dev, policy, no_zeroes, limits, negotiating)
                }
            }
        }
        outcome => {
            negotiating.done()?;
            timeouts(s.as_fd(), limits.idle, limits.stuck_writer);
            transmit(s, outcome, dev, &sh)
        }
    }
}

/// The rest of a connection once TLS is up: negotiation again, inside TLS, then transmission.
fn secured<S: Transport>(
    mut tls: S,
    sh: &Shared<'_>,
    dev: &mut Option<Session>,
    policy: TlsPolicy,
    no_zeroes: bool,
    limits: Limits,
    negotiating: crate::deadline::Armed,
) -> Result<Option<crate::transmit::ConnStats>, NbdError> {
    let outcome = negotiate_with(
        &mut tls,
        &sh.exports.list,
        &mut chooser(sh, dev),
        policy,
        no_zeroes,
    )?;
    negotiating.done()?;
    timeouts(tls.fd(), limits.idle, limits.stuck_writer);
    transmit(tls, outcome, dev.take(), sh)
}

/// Opens the chosen export's device before the client is told yes, so a busy or failed
/// device is refused during negotiation, with the reason.
fn chooser<'a>(
    sh: &'a Shared<'_>,
    dev: &'a mut Option<Session>,
) -> impl FnMut(usize) -> Result<(), String> + 'a {
    move |i| {
        if let Some(why) = &sh.full {
            return Err(why.clone());
        }
        let hub = &sh.exports.hubs[i];
        let share = |hub: &Arc<crate::hub::Hub>| -> Result<Session, String> {
            let (d, b) = hub.join().map_err(|e| e.to_string())?;
            Ok(Session::Shared(d, b))
        };
        // A session of its own is the fastest path, while this export has own sessions to
        // spare (where there is no shared session, a driver in this process, every
        // connection needs its own).
        let (count, most) = sh.own;
        let slot = Slot(count.clone());
        if count.fetch_add(1, Ordering::Relaxed) >= most {
            if let Some(hub) = hub {
                drop(slot);
                *dev = Some(share(hub)?);
                return Ok(());
            }
        }
        *dev = Some(match (sh.open)(&sh.exports.devices[i]) {
            Ok((d, _)) => Session::Own(d, slot),
            // The driver server's session budget is spent (other clients hold it): this
            // connection shares the session the export reserved, taking buffers per request.
            Err(BlockError::Busy(why)) => match hub {
                Some(hub) => {
                    tracing::debug!("{why}: sharing the export's session");
                    drop(slot);
                    share(hub)?
                }
                None => return Err(BlockError::Busy(why).to_string()),
            },
            Err(e) => return Err(e.to_string()),
        });
        Ok(())
    }
}

fn transmit<S: Transport>(
    s: S,
    outcome: Outcome,
    dev: Option<Session>,
    sh: &Shared<'_>,
) -> Result<Option<crate::transmit::ConnStats>, NbdError> {
    let Outcome::Go { export, structured } = outcome else {
        return Ok(None);
    };
    let dev = dev.ok_or_else(|| NbdError::Setup("no session after negotiation".into()))?;
    let _client = (sh.join)(&sh.exports.list[export].name);
    let e = &sh.exports.list[export];
    match dev {
        Session::Own(mut d, _slot) => Conn::new(s, d.as_mut(), e, structured).run(),
        Session::Shared(mut d, b) => {
            Conn::with_buffers(s, &mut d, e, structured, Box::new(b)).run()
        }
    }
    .map(Some)
}
