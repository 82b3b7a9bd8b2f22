//! The server side: a device model behind a listening socket.
//!
//! [`Server`] owns the listening socket, at most one client connection, and the device's
//! [`DeviceContext`] (DMA map and interrupt eventfds). A device model implements
//! [`DeviceBackend`]; the server decodes and validates every message before the backend sees
//! it, answers malformed commands with an error reply, and closes the connection only when the
//! byte stream itself can no longer be trusted (bad header, truncated frame, timeout).
//!
//! One connection at a time: while a client is connected the listener is not polled, so the next
//! client waits in the backlog. When a client goes away the DMA map and IRQ fds are dropped and
//! the device is reset, so a restarted driver finds the device as after power-on.
//!
//! The server is non-blocking in the sense an event loop needs: [`Server::poll_fds`] lists what
//! to wait on and [`Server::handle`] does one step; [`Server::run`] is a ready-made loop.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketFlags, SocketType};

use outboard_sys::{SockPathError, SocketPath};

use crate::caps::{self, Capabilities, TwinSocket};
use crate::channel::{spin_until_ready, Channel, ChannelError, Message};
use crate::dma::DmaMap;
use crate::wire::{self, cmd, Header, WireError};

/// Errors that stop a server (not per-message errors, which become error replies).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Binding or accepting failed.
    #[error("{op} {path}: {errno}")]
    Socket {
        /// What was attempted.
        op: &'static str,
        /// The socket path.
        path: String,
        /// Why it failed.
        errno: Errno,
    },
    /// The socket path could not be claimed.
    #[error(transparent)]
    Bind(#[from] SockPathError),
    /// Polling failed.
    #[error("poll: {0}")]
    Poll(Errno),
}

/// Description of one region for DEVICE_GET_REGION_INFO.
#[derive(Debug)]
pub struct RegionDesc<'a> {
    /// Region index (`wire::region::*`).
    pub index: u32,
    /// Size in bytes (0: region absent).
    pub size: u64,
    /// `wire::region::FLAG_READ | FLAG_WRITE`.
    pub flags: u32,
    /// mmappable parts, if any.
    pub mmap: Option<MmapDesc<'a>>,
}

/// The mmappable part of a region.
#[derive(Debug)]
pub struct MmapDesc<'a> {
    /// fd the client maps.
    pub fd: BorrowedFd<'a>,
    /// Base offset of the region in the fd.
    pub offset: u64,
    /// Areas the client may map (empty: the whole region).
    pub areas: Vec<wire::SparseArea>,
}

/// One ioeventfd the device offers for a region.
#[derive(Debug)]
pub struct IoFdDesc<'a> {
    /// Offset of the sub-region.
    pub offset: u64,
    /// Access size that triggers it.
    pub size: u64,
    /// The eventfd.
    pub fd: BorrowedFd<'a>,
    /// Only writes of this value trigger it.
    pub datamatch: Option<u64>,
}

/// Interrupt eventfds the client attached, by IRQ index and vector.
#[derive(Debug, Default)]
pub struct Irqs {
    fds: Vec<Vec<Option<OwnedFd>>>,
    masked: Vec<Vec<bool>>,
    pending: Vec<Vec<bool>>,
}

impl Irqs {
    fn slot(&mut self, index: u32, count: u32) {
        let i = index as usize;
        if self.fds.len() <= i {
            self.fds.resize_with(i + 1, Vec::new);
            self.masked.resize_with(i + 1, Vec::new);
            self.pending.resize_with(i + 1, Vec::new);
        }
        let n = count as usize;
        self.fds[i].resize_with(n, || None);
        self.masked[i].resize(n, false);
        self.pending[i].resize(n, false);
    }

    /// Applies a DEVICE_SET_IRQS request to an IRQ index with `total` vectors: attach or detach
    /// eventfds, trigger, mask or unmask (VFIO semantics).
    pub fn apply(&mut self, total: u32, s: &wire::IrqSet, fds: Vec<OwnedFd>) -> Result<(), Errno> {
        let data = s.flags & wire::irq::SET_DATA_MASK;
        let action = s.flags & wire::irq::SET_ACTION_MASK_ALL;
        if data == wire::irq::SET_DATA_NONE
            && s.count == 0
            && action == wire::irq::SET_ACTION_TRIGGER
        {
            // start = count = 0 with DATA_NONE disables every vector of the index.
            self.slot(s.index, 0);
            return Ok(());
        }
        if s.start as u64 + s.count as u64 > total as u64 {
            return Err(Errno::INVAL);
        }
        self.slot(s.index, total);
        let i = s.index as usize;
        let range = s.start as usize..(s.start + s.count) as usize;
        match (data, action) {
            (wire::irq::SET_DATA_EVENTFD, wire::irq::SET_ACTION_TRIGGER) => {
                if !fds.is_empty() && fds.len() != s.count as usize {
                    return Err(Errno::INVAL);
                }
                let mut fds = fds.into_iter();
                for v in range {
                    self.fds[i][v] = fds.next();
                }
            }
            (_, wire::irq::SET_ACTION_TRIGGER) => {
                for (n, v) in range.enumerate() {
                    if data == wire::irq::SET_DATA_NONE || s.data[n] != 0 {
                        self.trigger(s.index, v as u32);
                    }
                }
            }
            (_, wire::irq::SET_ACTION_MASK) | (_, wire::irq::SET_ACTION_UNMASK)
                if data != wire::irq::SET_DATA_EVENTFD =>
            {
                let mask = action == wire::irq::SET_ACTION_MASK;
                for (n, v) in range.enumerate() {
                    if data == wire::irq::SET_DATA_NONE || s.data[n] != 0 {
                        self.masked[i][v] = mask;
                        if !mask && std::mem::take(&mut self.pending[i][v]) {
                            self.trigger(s.index, v as u32);
                        }
                    }
                }
            }
            _ => return Err(Errno::NOTSUP),
        }
        Ok(())
    }

    /// Signals vector `vector` of IRQ `index`. Returns false if no eventfd is attached; a masked
    /// vector is remembered as pending and fires on unmask.
    pub fn trigger(&mut self, index: u32, vector: u32) -> bool {
        let (i, v) = (index as usize, vector as usize);
        if self
            .masked
            .get(i)
            .and_then(|m| m.get(v))
            .copied()
            .unwrap_or(false)
        {
            self.pending[i][v] = true;
            return true;
        }
        match self
            .fds
            .get(i)
            .and_then(|f| f.get(v))
            .and_then(|f| f.as_ref())
        {
            Some(fd) => {
                let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
                true
            }
            None => false,
        }
    }

    /// Whether vector `vector` of `index` is masked.
    pub fn masked(&self, index: u32, vector: u32) -> bool {
        self.masked
            .get(index as usize)
            .and_then(|m| m.get(vector as usize))
            .copied()
            .unwrap_or(false)
    }

    /// Masks vector `vector` of `index` from the device's side, as VFIO masks INTx when it
    /// delivers it: a level-triggered device raises it again once the client unmasks it.
    pub fn mask(&mut self, index: u32, vector: u32) {
        if let Some(m) = self
            .masked
            .get_mut(index as usize)
            .and_then(|m| m.get_mut(vector as usize))
        {
            *m = true;
        }
    }

    /// Number of vectors with an eventfd attached for `index`.
    pub fn enabled(&self, index: u32) -> usize {
        self.fds
            .get(index as usize)
            .map(|v| v.iter().filter(|f| f.is_some()).count())
            .unwrap_or(0)
    }

    /// Detaches everything.
    pub fn clear(&mut self) {
        self.fds.clear();
        self.masked.clear();
        self.pending.clear();
    }
}

/// What a device model may touch: the client's DMA regions and its interrupt eventfds.
#[derive(Debug)]
pub struct DeviceContext {
    /// Client memory.
    pub dma: DmaMap,
    /// Interrupts.
    pub irqs: Irqs,
}

impl DeviceContext {
    /// A context with nothing mapped; in-band DMA waits at most `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self {
            dma: DmaMap::new(timeout),
            irqs: Irqs::default(),
        }
    }

    /// Forgets the client: unmaps its memory and closes its eventfds.
    pub fn clear(&mut self) {
        self.dma.clear();
        self.irqs.clear();
    }
}

/// An emulated PCI device, as the server sees it.
///
/// Errors are errnos, sent back to the client in an error reply.
pub trait DeviceBackend {
    /// The device's regions (indices `0..wire::region::NUM_PCI`, more for device-specific ones).
    fn regions(&self) -> Vec<RegionDesc<'_>>;
    /// The device's IRQ types (`index`, `count`, `flags` used).
    fn irqs(&self) -> Vec<wire::IrqInfo>;
    /// Whether DEVICE_RESET is supported.
    fn resettable(&self) -> bool {
        true
    }
    /// Reads `buf.len()` bytes of region `index` at `offset` (bounds already checked).
    fn region_read(
        &mut self,
        ctx: &mut DeviceContext,
        index: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), Errno>;
    /// Writes `data` to region `index` at `offset` (bounds already checked).
    fn region_write(
        &mut self,
        ctx: &mut DeviceContext,
        index: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), Errno>;
    /// ioeventfds offered for region `index`.
    fn io_fds(&self, _index: u32) -> Vec<IoFdDesc<'_>> {
        Vec::new()
    }
    /// Every fd the server should poll on the device's behalf (ioeventfds, timerfds); when one
    /// becomes readable the server drains its 8-byte counter and calls [`DeviceBackend::event`]
    /// with its position in this list.
    fn event_fds(&self) -> Vec<BorrowedFd<'_>> {
        Vec::new()
    }
    /// An event fd fired.
    fn event(&mut self, _ctx: &mut DeviceContext, _id: usize) {}
    /// Descriptors the device reads input from itself (a NIC's wire or TAP interface): the
    /// server polls them for readability and calls [`DeviceBackend::input`] with each one's
    /// position in this list, without reading anything from them.
    fn input_fds(&self) -> Vec<BorrowedFd<'_>> {
        Vec::new()
    }
    /// Input descriptor `id` is readable.
    fn input(&mut self, _ctx: &mut DeviceContext, _id: usize) {}
    /// The client changed the interrupt set-up of IRQ `index`.
    fn irqs_changed(&mut self, _ctx: &mut DeviceContext, _index: u32) {}
    /// A DMA region is about to be unmapped; the device must stop using it.
    fn before_unmap(&mut self, _ctx: &mut DeviceContext, _iova: u64, _size: u64) {}
    /// Resets the device to its power-on state.
    fn reset(&mut self, ctx: &mut DeviceContext);
}

/// Tunables.
#[derive(Debug, Clone, Copy)]
pub struct ServerOptions {
    /// How long the rest of a message, a send, or an in-band DMA may take.
    pub timeout: Duration,
    /// How long the server checks for the client's next command after it answered one,
    /// before it sleeps: a client going through a burst of commands (a bring-up) then costs
    /// no wake-up per command (zero: sleep at once).
    pub spin: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(5),
            spin: crate::DEFAULT_SPIN,
        }
    }
}

/// What became ready, as returned alongside [`Server::poll_fds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A client is waiting to connect.
    Listener,
    /// The client sent something (or hung up).
    Connection,
    /// Device event fd `n` fired.
    Event(usize),
    /// Device input descriptor `n` is readable.
    Input(usize),
    /// A client that came while another one was being served sent its first message.
    TurnedAway(usize),
    /// The descriptor given to [`Server::wake_on`] is readable: [`Server::run`] looks at its
    /// stop flag at once.
    Wake,
}

/// Most clients kept waiting for their "busy" answer at once; more are closed at once.
const MAX_TURNED_AWAY: usize = 8;

/// Counters, for tests and logs.
#[derive(Debug, Default, Clone, Copy)]
pub struct ServerStats {
    /// Connections accepted.
    pub connections: u64,
    /// Commands handled.
    pub commands: u64,
    /// Commands answered with an error.
    pub errors: u64,
    /// Connections dropped because the stream was malformed.
    pub dropped: u64,
}

struct Connection {
    chan: Channel,
    negotiated: bool,
    /// What the client announced it accepts (defaults until VERSION).
    peer: Capabilities,
}

/// A vfio-user server for one device.
pub struct Server<B: DeviceBackend> {
    listener: OwnedFd,
    path: Option<SocketPath>,
    conn: Option<Connection>,
    /// Clients that connected while `conn` was served: each gets `EBUSY` for its first command
    /// (its VERSION), so it learns at once that the device is taken instead of timing out.
    turned_away: Vec<Channel>,
    backend: B,
    ctx: DeviceContext,
    opts: ServerOptions,
    stats: ServerStats,
    /// Until when [`Server::run_once`] checks for the next command without sleeping: set when
    /// a command was answered (the client is in a burst, or done).
    spin_until: Option<Instant>,
    /// Readable when whoever stops the server has set its stop flag ([`Server::wake_on`]).
    wake: Option<OwnedFd>,
}

type Reply = Result<(Vec<u8>, Vec<OwnedFd>), Errno>;

impl<B: DeviceBackend> Server<B> {
    /// Binds a listening socket at `path`. Only a stale socket there is replaced; a live one
    /// or anything that is not a socket is an error ([`ServerError::Bind`]) and left alone. The path is
    /// removed when the server is dropped, if it still names this server's socket.
    pub fn bind(path: &Path, backend: B, opts: ServerOptions) -> Result<Self, ServerError> {
        let (fd, guard) = outboard_sys::bind_listener(path, SocketType::STREAM, 8)?;
        let mut s = Self::from_listener(fd, backend, opts);
        s.path = Some(guard);
        Ok(s)
    }

    /// Serves on an already listening socket (e.g. inherited from a manager).
    pub fn from_listener(listener: OwnedFd, mut backend: B, opts: ServerOptions) -> Self {
        let mut ctx = DeviceContext::new(opts.timeout);
        backend.reset(&mut ctx);
        Self {
            listener,
            path: None,
            conn: None,
            turned_away: Vec::new(),
            backend,
            ctx,
            opts,
            stats: ServerStats::default(),
            spin_until: None,
            wake: None,
        }
    }

    /// The device model.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The device model, mutably (e.g. for fault injection in tests).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Counters.
    pub fn stats(&self) -> ServerStats {
        self.stats
    }

    /// Whether a client is connected.
    pub fn connected(&self) -> bool {
        self.conn.is_some()
    }

    /// Wakes the server whenever `fd` becomes readable (a byte written by the signal handler
    /// that sets [`Server::run`]'s stop flag, say), spinning or asleep: without it a stop
    /// flag set just after `run` looked at it is seen only when the wait ends, up to 100 ms
    /// later. What is readable is read and dropped.
    pub fn wake_on(&mut self, fd: OwnedFd) {
        self.wake = Some(fd);
    }

    /// The fds to wait on for readability, and what each one is.
    pub fn poll_fds(&self) -> Vec<(BorrowedFd<'_>, Source)> {
        let mut v = Vec::new();
        // The connection first: a client that just hung up is noticed before the next one is
        // judged busy.
        if let Some(c) = &self.conn {
            v.push((c.chan.fd(), Source::Connection));
        }
        v.push((self.listener.as_fd(), Source::Listener));
        for (i, c) in self.turned_away.iter().enumerate() {
            v.push((c.fd(), Source::TurnedAway(i)));
        }
        for (i, fd) in self.backend.event_fds().into_iter().enumerate() {
            v.push((fd, Source::Event(i)));
        }
        for (i, fd) in self.backend.input_fds().into_iter().enumerate() {
            v.push((fd, Source::Input(i)));
        }
        if let Some(fd) = &self.wake {
            v.push((fd.as_fd(), Source::Wake));
        }
        v
    }

    /// Handles one ready source. Per-client failures drop that client and return Ok.
    pub fn handle(&mut self, source: Source) -> Result<(), ServerError> {
        match source {
            Source::Listener => self.accept(),
            Source::Connection => {
                self.serve_one();
                Ok(())
            }
            Source::Event(id) => {
                if let Some(fd) = self.backend.event_fds().get(id) {
                    let mut counter = [0u8; 8];
                    let _ = rustix::io::read(fd, &mut counter);
                }
                self.backend.event(&mut self.ctx, id);
                Ok(())
            }
            Source::Input(id) => {
                self.backend.input(&mut self.ctx, id);
                Ok(())
            }
            Source::TurnedAway(i) => {
                self.turn_away(i);
                Ok(())
            }
            Source::Wake => {
                self.drain_wake();
                Ok(())
            }
        }
    }

    /// Reads what woke the server, without waiting; a descriptor that reports an error or its
    /// end is dropped, so that it does not wake the server again and again.
    fn drain_wake(&mut self) {
        let Some(fd) = &self.wake else { return };
        let mut buf = [0u8; 64];
        let now = rustix::time::Timespec::default();
        let ended = loop {
            let mut p = [PollFd::new(fd, PollFlags::IN)];
            match rustix::event::poll(&mut p, Some(&now)) {
                Ok(1) => {}
                _ => break false,
            }
            if !matches!(rustix::io::read(fd, &mut buf), Ok(n) if n > 0) {
                break true;
            }
        };
        if ended {
            self.wake = None;
        }
    }

    /// Serves what the current client sent before hanging up, then lets it go, if it has hung
    /// up: a new client must not be turned away by one that is already gone.
    fn finish_departed(&mut self) {
        loop {
            let Some(c) = &self.conn else { return };
            let fd = c.chan.fd();
            let mut p = [PollFd::new(&fd, PollFlags::IN | PollFlags::RDHUP)];
            let gone = match rustix::event::poll(&mut p, Some(&rustix::time::Timespec::default())) {
                Ok(_) => p[0].revents().intersects(PollFlags::HUP | PollFlags::RDHUP),
                Err(_) => false,
            };
            if !gone {
                return;
            }
            // Its last messages, then its end of file.
            self.serve_one();
        }
    }

    /// Answers a waiting second client's first command with `EBUSY` and closes it.
    fn turn_away(&mut self, i: usize) {
        if i >= self.turned_away.len() {
            return;
        }
        let chan = self.turned_away.swap_remove(i);
        // Its message is there (the socket is readable): a short wait is for the rest of it.
        if let Ok(m) = chan.recv_within(Duration::from_millis(100)) {
            if !m.header.is_reply() && !m.header.no_reply() {
                let _ = chan.send(
                    &Header::error_reply(&m.header, Errno::BUSY.raw_os_error() as u32),
                    &[],
                    &[],
                );
            }
        }
        tracing::info!("turned away a second client: the device is in use");
    }

    /// Waits up to `timeout` for something to happen and handles it.
    pub fn run_once(&mut self, timeout: Duration) -> Result<(), ServerError> {
        let spin = self
            .spin_until
            .take()
            .and_then(|until| until.checked_duration_since(Instant::now()));
        let ready: Vec<Source> = {
            let fds = self.poll_fds();
            let mut pfds: Vec<PollFd<'_>> = fds
                .iter()
                .map(|(fd, _)| PollFd::new(fd, PollFlags::IN))
                .collect();
            let began = Instant::now();
            let ready = match spin {
                Some(budget) => spin_until_ready(&mut pfds, budget.min(timeout)),
                None => Ok(false),
            };
            // The spin counts against the time-out.
            let left = timeout.saturating_sub(began.elapsed());
            let ts = rustix::time::Timespec {
                tv_sec: left.as_secs() as _,
                tv_nsec: left.subsec_nanos() as _,
            };
            let polled = match ready {
                Ok(true) => Ok(1),
                Ok(false) => rustix::event::poll(&mut pfds, Some(&ts)),
                Err(e) => Err(e),
            };
            match polled {
                Ok(_) => {}
                Err(Errno::INTR) => return Ok(()),
                Err(e) => return Err(ServerError::Poll(e)),
            }
            pfds.iter()
                .zip(fds.iter())
                .filter(|(p, _)| !p.revents().is_empty())
                .map(|(_, (_, s))| *s)
                .collect()
        };
        for s in ready {
            self.handle(s)?;
        }
        Ok(())
    }

    /// Serves until `stop` is set.
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), ServerError> {
        while !stop.load(Ordering::Relaxed) {
            self.run_once(Duration::from_millis(100))?;
        }
        Ok(())
    }

    fn accept(&mut self) -> Result<(), ServerError> {
        let fd = match rustix::net::accept_with(&self.listener, SocketFlags::CLOEXEC) {
            Ok(fd) => fd,
            Err(Errno::INTR) | Err(Errno::AGAIN) | Err(Errno::CONNABORTED) => return Ok(()),
            Err(errno) => {
                return Err(ServerError::Socket {
                    op: "accept",
                    path: self
                        .path
                        .as_ref()
                        .map(|p| p.path().display().to_string())
                        .unwrap_or_default(),
                    errno,
                })
            }
        };
        let chan = Channel::new(fd);
        let _ = chan.set_send_timeout(self.opts.timeout);
        self.finish_departed();
        if self.conn.is_some() {
            if self.turned_away.len() < MAX_TURNED_AWAY {
                self.turned_away.push(chan);
            }
            return Ok(());
        }
        self.stats.connections += 1;
        tracing::info!("client connected");
        self.conn = Some(Connection {
            chan,
            negotiated: false,
            peer: Capabilities::default(),
        });
        Ok(())
    }

    /// Forgets the client and resets the device.
    fn disconnect(&mut self, why: &str) {
        if self.conn.take().is_some() {
            tracing::info!("client disconnected: {why}");
        }
        self.ctx.clear();
        self.backend.reset(&mut self.ctx);
    }

    fn serve_one(&mut self) {
        let Some(conn) = &self.conn else { return };
        let msg = match conn.chan.recv_within(self.opts.timeout) {
            Ok(m) => m,
            Err(ChannelError::Closed) => return self.disconnect("closed"),
            Err(e) => {
                self.stats.dropped += 1;
                return self.disconnect(&format!("dropped: {e}"));
            }
        };
        if msg.header.is_reply() {
            self.stats.dropped += 1;
            return self.disconnect("unexpected reply on the command socket");
        }
        self.stats.commands += 1;
        let header = msg.header;
        let result = self.dispatch(msg);
        if header.no_reply() {
            if let Err(e) = result {
                self.stats.errors += 1;
                tracing::warn!("posted {} failed: {e}", cmd::name(header.command));
            }
            return;
        }
        let Some(conn) = &self.conn else { return };
        let sent = match result {
            Ok((payload, fds)) => {
                let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
                conn.chan
                    .send(&Header::reply(&header, payload.len()), &payload, &borrowed)
            }
            Err(errno) => {
                self.stats.errors += 1;
                tracing::debug!("{} failed: {errno}", cmd::name(header.command));
                conn.chan.send(
                    &Header::error_reply(&header, errno.raw_os_error() as u32),
                    &[],
                    &[],
                )
            }
        };
        match sent {
            Ok(()) if !self.opts.spin.is_zero() => {
                self.spin_until = Some(Instant::now() + self.opts.spin);
            }
            Ok(()) => {}
            Err(e) => self.disconnect(&format!("reply not sent: {e}")),
        }
    }

    fn dispatch(&mut self, msg: Message) -> Reply {
        let Message {
            header,
            payload,
            fds,
        } = msg;
        let negotiated = self.conn.as_ref().is_some_and(|c| c.negotiated);
        if header.command != cmd::VERSION && !negotiated {
            return Err(Errno::INVAL);
        }
        let max_fds = match header.command {
            cmd::DMA_MAP => 1,
            cmd::DEVICE_SET_IRQS => wire::MAX_FDS,
            _ => 0,
        };
        if fds.len() > max_fds {
            return Err(Errno::INVAL);
        }
        let bad = |e: WireError| {
            tracing::debug!("{e}");
            Errno::INVAL
        };
        match header.command {
            cmd::VERSION => self.version(&payload),
            cmd::DMA_MAP => {
                let m = wire::DmaMap::decode(&payload).map_err(bad)?;
                self.ctx.dma.map(&m, fds.into_iter().next())?;
                Ok((Vec::new(), Vec::new()))
            }
            cmd::DMA_UNMAP => {
                let u = wire::DmaUnmap::decode(&payload).map_err(bad)?;
                match u.flags {
                    0 => {
                        self.backend.before_unmap(&mut self.ctx, u.addr, u.size);
                        self.ctx.dma.unmap(u.addr, u.size)?;
                    }
                    // Everything at once (what QEMU and libvfio-user's client send at reset).
                    wire::dma::UNMAP_FLAG_ALL if u.addr == 0 && u.size == 0 => {
                        for (iova, size, _) in self.ctx.dma.mappings() {
                            self.backend.before_unmap(&mut self.ctx, iova, size);
                        }
                        self.ctx.dma.unmap_all();
                    }
                    // FLAG_ALL with a range, dirty bitmaps (no migration here), unknown bits.
                    _ => return Err(Errno::INVAL),
                }
                Ok((payload[..wire::DmaUnmap::SIZE].to_vec(), Vec::new()))
            }
            cmd::DEVICE_GET_INFO => {
                let req = wire::DeviceInfo::decode(&payload).map_err(bad)?;
                let _ = req;
                let mut flags = wire::device::FLAG_PCI;
                if self.backend.resettable() {
                    flags |= wire::device::FLAG_RESET;
                }
                let num_regions = self
                    .backend
                    .regions()
                    .iter()
                    .map(|r| r.index + 1)
                    .max()
                    .unwrap_or(0);
                let info = wire::DeviceInfo {
                    argsz: wire::DeviceInfo::SIZE as u32,
                    flags,
                    num_regions: num_regions.max(wire::region::NUM_PCI),
                    num_irqs: self.backend.irqs().len() as u32,
                };
                Ok((info.encode(), Vec::new()))
            }
            cmd::DEVICE_GET_REGION_INFO => {
                let req = wire::RegionInfo::decode(&payload).map_err(bad)?;
                if (req.argsz as usize) < wire::RegionInfo::SIZE {
                    return Err(Errno::INVAL);
                }
                let regions = self.backend.regions();
                let mut info = wire::RegionInfo {
                    index: req.index,
                    ..Default::default()
                };
                let mut fds = Vec::new();
                if let Some(r) = regions.iter().find(|r| r.index == req.index) {
                    info.size = r.size;
                    info.flags = r.flags;
                    if let Some(m) = &r.mmap {
                        info.flags |= wire::region::FLAG_MMAP;
                        info.offset = m.offset;
                        info.sparse = m.areas.clone();
                        fds.push(m.fd.try_clone_to_owned().map_err(|_| Errno::NOMEM)?);
                    }
                } else if req.index >= wire::region::NUM_PCI {
                    return Err(Errno::INVAL);
                }
                let reply = info.encode_reply(req.argsz);
                // The fd travels only with the whole reply, capability list included (as
                // libvfio-user sends it); a reply cut short says how much to ask for instead.
                if !wire::RegionInfo::is_whole_reply(&reply) {
                    fds.clear();
                }
                Ok((reply, fds))
            }
            cmd::DEVICE_GET_REGION_IO_FDS => {
                let req = wire::IoFdsRequest::decode(&payload).map_err(bad)?;
                if req.flags != 0 || req.count != 0 {
                    return Err(Errno::INVAL);
                }
                if !self.backend.regions().iter().any(|r| r.index == req.index) {
                    return Err(Errno::INVAL);
                }
                // A region without ioeventfds answers with none (count 0), as libvfio-user does.
                let descs = self.backend.io_fds(req.index);
                let mut subs = Vec::new();
                let mut fds = Vec::new();
                for (i, d) in descs.iter().enumerate() {
                    subs.push(wire::IoFdSubRegion {
                        offset: d.offset,
                        size: d.size,
                        fd_index: i as u32,
                        kind: wire::IO_FD_TYPE_IOEVENTFD,
                        flags: if d.datamatch.is_some() {
                            wire::IOEVENTFD_FLAG_DATAMATCH
                        } else {
                            0
                        },
                        datamatch: d.datamatch.unwrap_or(0),
                    });
                    fds.push(d.fd.try_clone_to_owned().map_err(|_| Errno::NOMEM)?);
                }
                let reply = wire::IoFdsReply::encode(req.index, &subs, req.argsz);
                // Fds only accompany a reply that lists the sub-regions they belong to.
                if reply.len() == wire::IoFdsRequest::SIZE {
                    fds.clear();
                }
                // One reply cannot be split: more fds than the client accepts in a message is
                // E2BIG, and the client reaches those doorbells by trapped writes instead.
                let limit = self.conn.as_ref().map_or(1, |c| c.peer.fds_limit());
                if fds.len() > limit {
                    return Err(Errno::TOOBIG);
                }
                Ok((reply, fds))
            }
            cmd::DEVICE_GET_IRQ_INFO => {
                let req = wire::IrqInfo::decode(&payload).map_err(bad)?;
                let info = self
                    .backend
                    .irqs()
                    .into_iter()
                    .find(|i| i.index == req.index)
                    .ok_or(Errno::INVAL)?;
                Ok((
                    wire::IrqInfo {
                        argsz: wire::IrqInfo::SIZE as u32,
                        ..info
                    }
                    .encode(),
                    Vec::new(),
                ))
            }
            cmd::DEVICE_SET_IRQS => {
                let s = wire::IrqSet::decode(&payload).map_err(bad)?;
                self.set_irqs(&s, fds)?;
                self.backend.irqs_changed(&mut self.ctx, s.index);
                Ok((Vec::new(), Vec::new()))
            }
            cmd::REGION_READ => {
                let a = wire::RegionAccess::decode(&payload, false).map_err(bad)?;
                self.check_region(a.region, a.offset, a.count, wire::region::FLAG_READ)?;
                let mut data = vec![0u8; a.count as usize];
                // A 0-byte access is a no-op: the device never sees it (reading some registers
                // has side effects, and no model has to handle an empty buffer).
                if a.count > 0 {
                    self.backend
                        .region_read(&mut self.ctx, a.region, a.offset, &mut data)?;
                }
                Ok((wire::RegionAccess { data, ..a }.encode(), Vec::new()))
            }
            cmd::REGION_WRITE => {
                let a = wire::RegionAccess::decode(&payload, true).map_err(bad)?;
                self.check_region(a.region, a.offset, a.count, wire::region::FLAG_WRITE)?;
                if a.count > 0 {
                    self.backend
                        .region_write(&mut self.ctx, a.region, a.offset, &a.data)?;
                }
                Ok((
                    wire::RegionAccess {
                        data: Vec::new(),
                        ..a
                    }
                    .encode(),
                    Vec::new(),
                ))
            }
            cmd::DEVICE_RESET => {
                if !self.backend.resettable() {
                    return Err(Errno::NOTSUP);
                }
                self.backend.reset(&mut self.ctx);
                Ok((Vec::new(), Vec::new()))
            }
            _ => Err(Errno::NOSYS),
        }
    }

    fn check_region(&self, index: u32, offset: u64, count: u32, need: u32) -> Result<(), Errno> {
        let regions = self.backend.regions();
        let r = regions
            .iter()
            .find(|r| r.index == index)
            .ok_or(Errno::INVAL)?;
        if r.flags & need == 0 {
            return Err(Errno::ACCESS);
        }
        // A 0-byte access inside the region is a no-op that succeeds, as in libvfio-user.
        match offset.checked_add(count as u64) {
            Some(end) if end <= r.size => Ok(()),
            _ => Err(Errno::INVAL),
        }
    }

    fn version(&mut self, payload: &[u8]) -> Reply {
        let v = wire::Version::decode(payload).map_err(|_| Errno::INVAL)?;
        if v.major != caps::MAJOR {
            // The spec says to close the connection; an error reply first tells the client why.
            return Err(Errno::NOTSUP);
        }
        let theirs = caps::parse(&v.json).map_err(|_| Errno::INVAL)?;
        // Server-initiated DMA messages must fit what the client accepts.
        self.ctx.dma.set_max_transfer(theirs.data_xfer_limit());
        let mut fds = Vec::new();
        let twin = if theirs.twin_socket.as_ref().is_some_and(|t| t.supported) {
            let (ours, client_end) = rustix::net::socketpair(
                AddressFamily::UNIX,
                SocketType::STREAM,
                SocketFlags::CLOEXEC,
                None,
            )?;
            let chan = Channel::new(ours);
            let _ = chan.set_send_timeout(self.opts.timeout);
            self.ctx.dma.set_twin(Some(chan));
            fds.push(client_end);
            Some(TwinSocket {
                supported: true,
                fd_index: Some(0),
            })
        } else {
            None
        };
        let reply = wire::Version {
            major: caps::MAJOR,
            minor: v.minor.min(caps::MINOR),
            json: caps::to_json(&Capabilities::ours(twin)),
        };
        if let Some(c) = self.conn.as_mut() {
            c.negotiated = true;
            c.peer = theirs;
        }
        Ok((reply.encode(), fds))
    }

    fn set_irqs(&mut self, s: &wire::IrqSet, fds: Vec<OwnedFd>) -> Result<(), Errno> {
        let info = self
            .backend
            .irqs()
            .into_iter()
            .find(|i| i.index == s.index)
            .ok_or(Errno::INVAL)?;
        self.ctx.irqs.apply(info.count, s, fds)
    }
}
