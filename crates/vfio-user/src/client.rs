//! The client side: what a driver (through `outboard-hw`) uses to reach a device model.
//!
//! Every call sends one command and waits for the reply with the same message id and command,
//! at most until the configured timeout. An error reply becomes [`ClientError::Remote`] with the
//! server's errno. Posted writes ([`Client::region_write_posted`]) carry NO_REPLY; the server
//! handles commands in order, so the next replied command orders after them.
//!
//! If the server enables twin-socket mode, a thread serves its DMA_READ / DMA_WRITE commands
//! from memory registered with [`Client::dma_map_in_band`]; memory mapped with an fd never
//! needs it. The thread starts with the first such registration, not with the connection: a
//! server only reaches memory mapped in-band that way, so until then it has nothing to serve,
//! and a driver that maps all its memory with an fd (all of Outboard's) keeps one thread. A
//! killed process is gone only once each of its threads has been woken and has ended, so a
//! thread that never works still made each driver server's death take longer to notice.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use outboard_shm::SharedMem;
use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::caps::{self, Capabilities, TwinSocket};
use crate::channel::{Channel, ChannelError};
use crate::wire::{self, cmd, Header, WireError};
use crate::DEFAULT_SPIN;

/// Why a client operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server could not be reached.
    #[error("cannot connect to {path}: {errno}")]
    Connect {
        /// Socket path.
        path: String,
        /// Why.
        errno: Errno,
    },
    /// The connection failed or timed out.
    #[error("{command}: {source}")]
    Channel {
        /// The command in progress.
        command: &'static str,
        /// What happened.
        source: ChannelError,
    },
    /// The server answered with an error reply.
    #[error("{command} failed on the device: {}", Errno::from_raw_os_error(*.errno as i32))]
    Remote {
        /// The command.
        command: &'static str,
        /// The server's errno (0 if it gave none).
        errno: u32,
    },
    /// The server broke the protocol.
    #[error("protocol error in {command}: {why}")]
    Protocol {
        /// The command in progress.
        command: &'static str,
        /// What was wrong.
        why: String,
    },
    /// The request needs something the connection does not offer.
    #[error("{command}: {why}")]
    Unsupported {
        /// The command.
        command: &'static str,
        /// What is missing.
        why: String,
    },
    /// An earlier call failed in a way that leaves the stream's state unknown (a timeout, a
    /// lost or mismatched reply), so the connection was dropped; it cannot be used again.
    #[error("{command}: the connection to the device was dropped earlier: {why}")]
    Broken {
        /// The command attempted now.
        command: &'static str,
        /// The failure that broke the connection.
        why: String,
    },
}

impl ClientError {
    /// The server's errno, if this is an error reply.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            ClientError::Remote { errno, .. } => Some(Errno::from_raw_os_error(*errno as i32)),
            _ => None,
        }
    }
}

type Result<T> = std::result::Result<T, ClientError>;

/// Tunables.
#[derive(Debug, Clone, Copy)]
pub struct ClientOptions {
    /// How long any one call may take.
    pub timeout: Duration,
    /// Offer twin-socket mode (needed only for in-band DMA).
    pub twin_socket: bool,
    /// The most data one server-to-client message may carry (announced as
    /// `max_data_xfer_size`; larger in-band DMA messages are refused).
    pub max_data_xfer_size: u32,
    /// How long a call checks for its reply before it sleeps: a reply that comes within it
    /// costs no wake-up (see [`Channel::set_spin`]; zero: sleep at once).
    pub spin: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(5),
            twin_socket: true,
            max_data_xfer_size: wire::MAX_DATA_XFER,
            spin: DEFAULT_SPIN,
        }
    }
}

/// A region as described by the server, with its mmap fd if it has one.
#[derive(Debug)]
pub struct RegionInfo {
    /// Decoded region info.
    pub info: wire::RegionInfo,
    /// fd to mmap (when `FLAG_MMAP` is set).
    pub fd: Option<OwnedFd>,
}

/// An ioeventfd for part of a region.
#[derive(Debug)]
pub struct IoEventFd {
    /// Offset in the region.
    pub offset: u64,
    /// Access size (0: any).
    pub size: u64,
    /// Only a write of this value counts, if set.
    pub datamatch: Option<u64>,
    /// The eventfd to write instead of sending REGION_WRITE.
    pub fd: Arc<OwnedFd>,
}

struct InBand {
    iova: u64,
    mem: Arc<SharedMem>,
}

/// A connection to a vfio-user server.
pub struct Client {
    chan: Channel,
    next_id: u16,
    timeout: Duration,
    info: wire::DeviceInfo,
    peer: Capabilities,
    minor: u16,
    in_band: Arc<Mutex<Vec<InBand>>>,
    /// The twin socket the server gave, and the transfer limit this client announced, until
    /// the first in-band mapping starts the thread that serves it.
    twin_waiting: Option<(OwnedFd, u64)>,
    /// The thread serving the twin socket, and a duplicate of its socket to shut it down.
    twin: Option<(OwnedFd, JoinHandle<()>)>,
    /// Why the connection was given up, once it was. A reply that did not arrive in time may
    /// still arrive later, and would then be taken for the answer to the next command: every
    /// reply after it would be off by one. So a call that fails mid-exchange ends the
    /// connection for good.
    broken: Option<String>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("info", &self.info).finish()
    }
}

impl Client {
    /// Connects to the server at `path`, negotiates the version and reads the device info.
    pub fn connect(path: &Path, opts: ClientOptions) -> Result<Self> {
        let err = |errno| ClientError::Connect {
            path: path.display().to_string(),
            errno,
        };
        let addr = SocketAddrUnix::new(path).map_err(err)?;
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(err)?;
        rustix::net::connect(&fd, &addr).map_err(err)?;
        Self::from_fd(fd, opts)
    }

    /// Uses an already connected socket.
    pub fn from_fd(fd: OwnedFd, opts: ClientOptions) -> Result<Self> {
        let mut chan = Channel::new(fd);
        chan.set_spin(opts.spin);
        let _ = chan.set_send_timeout(opts.timeout);
        let mut c = Self {
            chan,
            next_id: 0,
            timeout: opts.timeout,
            info: wire::DeviceInfo::default(),
            peer: Capabilities::default(),
            minor: 0,
            in_band: Arc::default(),
            twin_waiting: None,
            twin: None,
            broken: None,
        };
        c.negotiate(opts.twin_socket, opts.max_data_xfer_size)?;
        let req = wire::DeviceInfo {
            argsz: wire::DeviceInfo::SIZE as u32,
            ..Default::default()
        };
        let (payload, _) = c.call(cmd::DEVICE_GET_INFO, &req.encode(), &[])?;
        c.info = wire::DeviceInfo::decode(&payload).map_err(|e| proto(cmd::DEVICE_GET_INFO, e))?;
        if c.info.flags & wire::device::FLAG_PCI == 0 {
            return Err(ClientError::Protocol {
                command: "DEVICE_GET_INFO",
                why: "not a PCI device".into(),
            });
        }
        Ok(c)
    }

    fn negotiate(&mut self, twin: bool, max_xfer: u32) -> Result<()> {
        let ours = Capabilities {
            max_data_xfer_size: max_xfer.clamp(1, wire::MAX_DATA_XFER) as u64,
            ..Capabilities::ours(twin.then_some(TwinSocket {
                supported: true,
                fd_index: None,
            }))
        };
        let v = wire::Version {
            major: caps::MAJOR,
            minor: caps::MINOR,
            json: caps::to_json(&ours),
        };
        let (payload, mut fds) = self.call(cmd::VERSION, &v.encode(), &[])?;
        let theirs = wire::Version::decode(&payload).map_err(|e| proto(cmd::VERSION, e))?;
        if theirs.major != caps::MAJOR || theirs.minor > caps::MINOR {
            return Err(ClientError::Protocol {
                command: "VERSION",
                why: format!("server answered version {}.{}", theirs.major, theirs.minor),
            });
        }
        self.minor = theirs.minor;
        self.peer = caps::parse(&theirs.json).map_err(|e| ClientError::Protocol {
            command: "VERSION",
            why: format!("capabilities: {e}"),
        })?;
        if let Some(t) = self.peer.twin_socket.clone().filter(|t| t.supported) {
            let idx = t.fd_index.ok_or_else(|| ClientError::Protocol {
                command: "VERSION",
                why: "twin socket enabled without an fd index".into(),
            })? as usize;
            if !twin || idx >= fds.len() {
                return Err(ClientError::Protocol {
                    command: "VERSION",
                    why: "inconsistent twin socket reply".into(),
                });
            }
            let fd = fds.swap_remove(idx);
            self.twin_waiting = Some((fd, ours.data_xfer_limit() as u64));
        }
        Ok(())
    }

    /// Starts the thread that serves the twin socket, if it waits for one.
    fn serve_twin_socket(&mut self) -> Result<()> {
        let Some((fd, limit)) = self.twin_waiting.take() else {
            return Ok(());
        };
        let failed = |why: String| ClientError::Protocol {
            command: "DMA_MAP",
            why,
        };
        let shutdown = fd
            .try_clone()
            .map_err(|e| failed(format!("cannot keep the twin socket: {e}")))?;
        let regions = self.in_band.clone();
        let handle = std::thread::Builder::new()
            .name("vfio-user-twin".into())
            .spawn(move || serve_twin(Channel::new(fd), regions, limit))
            .map_err(|e| failed(format!("cannot start the twin-socket thread: {e}")))?;
        self.twin = Some((shutdown, handle));
        Ok(())
    }

    /// Sends a command and waits for its reply. A failure that leaves the exchange unfinished
    /// breaks the connection (see [`ClientError::Broken`]); an error reply does not.
    fn call(
        &mut self,
        command: u16,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
        self.usable(command)?;
        let r = self.exchange(command, payload, fds);
        if let Err(e @ (ClientError::Channel { .. } | ClientError::Protocol { .. })) = &r {
            self.give_up(e.to_string());
        }
        r
    }

    /// Fails at once if the connection was given up.
    fn usable(&self, command: u16) -> Result<()> {
        match &self.broken {
            Some(why) => Err(ClientError::Broken {
                command: cmd::name(command),
                why: why.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Ends the connection: the server sees it close (and resets the device), and the socket
    /// reports a hang-up to whoever watches it ([`Client::socket`]).
    fn give_up(&mut self, why: String) {
        tracing::warn!("vfio-user: dropping the connection: {why}");
        let _ = rustix::net::shutdown(self.chan.fd(), rustix::net::Shutdown::Both);
        self.broken = Some(why);
    }

    /// Whether the connection was given up, and why.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    fn exchange(
        &mut self,
        command: u16,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
        let name = cmd::name(command);
        self.next_id = self.next_id.wrapping_add(1);
        let header = Header::command(self.next_id, command, payload.len());
        let chan_err = |source| ClientError::Channel {
            command: name,
            source,
        };
        self.chan.send(&header, payload, fds).map_err(chan_err)?;
        let msg = self
            .chan
            .recv(Instant::now() + self.timeout)
            .map_err(chan_err)?;
        let h = msg.header;
        if !h.is_reply() || h.msg_id != header.msg_id || h.command != command {
            return Err(ClientError::Protocol {
                command: name,
                why: format!(
                    "expected reply {} to {name}, got {} {} (command {})",
                    header.msg_id,
                    if h.is_reply() { "reply" } else { "command" },
                    h.msg_id,
                    cmd::name(h.command)
                ),
            });
        }
        if h.is_error() {
            return Err(ClientError::Remote {
                command: name,
                errno: h.error,
            });
        }
        Ok((msg.payload, msg.fds))
    }

    /// Device info (flags, region and IRQ counts).
    pub fn device_info(&self) -> wire::DeviceInfo {
        self.info
    }

    /// The server's capabilities.
    pub fn peer_capabilities(&self) -> &Capabilities {
        &self.peer
    }

    /// Negotiated minor version.
    pub fn minor_version(&self) -> u16 {
        self.minor
    }

    /// Describes region `index`. Whenever the reply's `argsz` is larger than the request's,
    /// the reply was cut short (its capability list, and with it possibly the region's fd, left
    /// out), so the request is made again with that size, as QEMU does; the fd is taken from
    /// whichever reply carries it. A region flagged mmappable that comes without an fd is
    /// reached by trapped accesses instead.
    pub fn region_info(&mut self, index: u32) -> Result<RegionInfo> {
        const MAX_ARGSZ: u32 = 64 << 10;
        // Room for a capability list of a few dozen sparse areas at once: a server whose
        // reply fits answers in one round trip instead of saying how much to ask for first.
        let mut argsz = 1024;
        let mut fd: Option<OwnedFd> = None;
        for _ in 0..3 {
            let (payload, mut fds) = self.call(
                cmd::DEVICE_GET_REGION_INFO,
                &wire::RegionInfo::encode_request(index, argsz),
                &[],
            )?;
            let mut info = wire::RegionInfo::decode(&payload)
                .map_err(|e| proto(cmd::DEVICE_GET_REGION_INFO, e))?;
            if fds.len() > 1 {
                return Err(ClientError::Protocol {
                    command: "DEVICE_GET_REGION_INFO",
                    why: format!("a region came with {} fds", fds.len()),
                });
            }
            if let Some(f) = fds.pop() {
                fd = Some(f);
            }
            if info.argsz > argsz {
                if info.argsz > MAX_ARGSZ {
                    return Err(ClientError::Protocol {
                        command: "DEVICE_GET_REGION_INFO",
                        why: format!("a region info of {} bytes", info.argsz),
                    });
                }
                argsz = info.argsz;
                continue;
            }
            if info.flags & wire::region::FLAG_MMAP == 0 {
                fd = None;
            } else if fd.is_none() {
                tracing::debug!("region {index}: mmappable but no fd came: trapping it");
                info.flags &= !wire::region::FLAG_MMAP;
                info.sparse.clear();
            }
            return Ok(RegionInfo { info, fd });
        }
        Err(ClientError::Protocol {
            command: "DEVICE_GET_REGION_INFO",
            why: "argsz kept growing".into(),
        })
    }

    /// The ioeventfds of region `index` (empty if the server offers none).
    pub fn region_io_fds(&mut self, index: u32) -> Result<Vec<IoEventFd>> {
        // Room for 16 sub-regions at once (one round trip for any device of ours).
        let mut argsz = (wire::IoFdsRequest::SIZE + 16 * wire::IoFdsReply::SUB_SIZE) as u32;
        for _ in 0..2 {
            let req = wire::IoFdsRequest {
                argsz,
                flags: 0,
                index,
                count: 0,
            };
            let (payload, fds) = match self.call(cmd::DEVICE_GET_REGION_IO_FDS, &req.encode(), &[])
            {
                Ok(r) => r,
                // Servers without ioeventfds (or without this command) are fine: trap instead.
                Err(ClientError::Remote { .. }) => return Ok(Vec::new()),
                Err(e) => return Err(e),
            };
            let reply = wire::IoFdsReply::decode(&payload)
                .map_err(|e| proto(cmd::DEVICE_GET_REGION_IO_FDS, e))?;
            if reply.subs.is_empty() && reply.count > 0 {
                argsz = reply.argsz;
                continue;
            }
            let fds: Vec<Arc<OwnedFd>> = fds.into_iter().map(Arc::new).collect();
            let mut out = Vec::new();
            for s in reply.subs {
                if s.kind != wire::IO_FD_TYPE_IOEVENTFD {
                    continue;
                }
                let fd = fds
                    .get(s.fd_index as usize)
                    .ok_or_else(|| ClientError::Protocol {
                        command: "DEVICE_GET_REGION_IO_FDS",
                        why: format!("fd index {} out of range", s.fd_index),
                    })?;
                out.push(IoEventFd {
                    offset: s.offset,
                    size: s.size,
                    datamatch: (s.flags & wire::IOEVENTFD_FLAG_DATAMATCH != 0)
                        .then_some(s.datamatch),
                    fd: fd.clone(),
                });
            }
            return Ok(out);
        }
        Err(ClientError::Protocol {
            command: "DEVICE_GET_REGION_IO_FDS",
            why: "argsz kept growing".into(),
        })
    }

    /// Reads `buf.len()` bytes of region `index` at `offset`, in pieces no larger than the
    /// server's `max_data_xfer_size`.
    pub fn region_read(&mut self, index: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        let limit = self.peer.data_xfer_limit();
        let mut at = offset;
        for piece in buf.chunks_mut(limit) {
            let req = wire::RegionAccess {
                offset: at,
                region: index,
                count: piece.len() as u32,
                data: Vec::new(),
            };
            let (payload, _) = self.call(cmd::REGION_READ, &req.encode(), &[])?;
            let reply = wire::RegionAccess::decode(&payload, true)
                .map_err(|e| proto(cmd::REGION_READ, e))?;
            if reply.data.len() != piece.len() {
                return Err(ClientError::Protocol {
                    command: "REGION_READ",
                    why: format!("asked for {} bytes, got {}", piece.len(), reply.data.len()),
                });
            }
            piece.copy_from_slice(&reply.data);
            at += piece.len() as u64;
        }
        Ok(())
    }

    /// Writes `data` to region `index` at `offset` and waits for the acknowledgement, in
    /// pieces no larger than the server's `max_data_xfer_size`.
    pub fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<()> {
        let limit = self.peer.data_xfer_limit();
        let mut at = offset;
        for piece in data.chunks(limit) {
            let req = wire::RegionAccess {
                offset: at,
                region: index,
                count: piece.len() as u32,
                data: piece.to_vec(),
            };
            self.call(cmd::REGION_WRITE, &req.encode(), &[])?;
            at += piece.len() as u64;
        }
        Ok(())
    }

    /// Writes without waiting (NO_REPLY): the server applies it before any later command.
    pub fn region_write_posted(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<()> {
        let req = wire::RegionAccess {
            offset,
            region: index,
            count: data.len() as u32,
            data: data.to_vec(),
        }
        .encode();
        self.usable(cmd::REGION_WRITE)?;
        self.next_id = self.next_id.wrapping_add(1);
        let mut header = Header::command(self.next_id, cmd::REGION_WRITE, req.len());
        header.flags |= wire::flags::NO_REPLY;
        let r = self
            .chan
            .send(&header, &req, &[])
            .map_err(|source| ClientError::Channel {
                command: "REGION_WRITE",
                source,
            });
        if let Err(e) = &r {
            // Part of the message may have gone out: the stream is no longer framed.
            self.give_up(e.to_string());
        }
        r
    }

    /// Describes IRQ type `index`.
    pub fn irq_info(&mut self, index: u32) -> Result<wire::IrqInfo> {
        let req = wire::IrqInfo {
            argsz: wire::IrqInfo::SIZE as u32,
            flags: 0,
            index,
            count: 0,
        };
        let (payload, _) = self.call(cmd::DEVICE_GET_IRQ_INFO, &req.encode(), &[])?;
        wire::IrqInfo::decode(&payload).map_err(|e| proto(cmd::DEVICE_GET_IRQ_INFO, e))
    }

    /// Attaches eventfds to vectors `start..start+fds.len()` of IRQ `index`, in as many
    /// SET_IRQS messages as the server's `max_msg_fds` requires (each a sub-range of vectors).
    pub fn set_irq_eventfds(
        &mut self,
        index: u32,
        start: u32,
        fds: &[BorrowedFd<'_>],
    ) -> Result<()> {
        let limit = self.peer.fds_limit();
        if limit == 0 && !fds.is_empty() {
            return Err(ClientError::Unsupported {
                command: "DEVICE_SET_IRQS",
                why: "the server accepts no file descriptors (max_msg_fds 0)".into(),
            });
        }
        for (i, piece) in fds.chunks(limit.max(1)).enumerate() {
            let s = wire::IrqSet {
                argsz: 0,
                flags: wire::irq::SET_DATA_EVENTFD | wire::irq::SET_ACTION_TRIGGER,
                index,
                start: start + (i * limit) as u32,
                count: piece.len() as u32,
                data: Vec::new(),
            };
            self.call(cmd::DEVICE_SET_IRQS, &s.encode(), piece)?;
        }
        Ok(())
    }

    /// Disables every vector of IRQ `index`.
    pub fn disable_irqs(&mut self, index: u32) -> Result<()> {
        let s = wire::IrqSet {
            argsz: 0,
            flags: wire::irq::SET_DATA_NONE | wire::irq::SET_ACTION_TRIGGER,
            index,
            start: 0,
            count: 0,
            data: Vec::new(),
        };
        self.call(cmd::DEVICE_SET_IRQS, &s.encode(), &[])?;
        Ok(())
    }

    /// Unmasks vector `vector` of IRQ `index` (INTx after its delivery: a level still
    /// asserted is raised again).
    pub fn unmask_irq(&mut self, index: u32, vector: u32) -> Result<()> {
        let s = wire::IrqSet {
            argsz: 0,
            flags: wire::irq::SET_DATA_NONE | wire::irq::SET_ACTION_UNMASK,
            index,
            start: vector,
            count: 1,
            data: Vec::new(),
        };
        self.call(cmd::DEVICE_SET_IRQS, &s.encode(), &[])?;
        Ok(())
    }

    /// Maps `size` bytes of `fd` from `offset` at `iova` into the device's DMA space.
    pub fn dma_map(
        &mut self,
        iova: u64,
        size: u64,
        flags: u32,
        fd: BorrowedFd<'_>,
        offset: u64,
    ) -> Result<()> {
        let m = wire::DmaMap {
            argsz: wire::DmaMap::SIZE as u32,
            flags,
            offset,
            addr: iova,
            size,
        };
        self.call(cmd::DMA_MAP, &m.encode(), &[fd])?;
        Ok(())
    }

    /// Maps `mem` at `iova` without passing its fd: the server reaches it with DMA_READ /
    /// DMA_WRITE over the twin socket, served by this client. Refused when no twin socket was
    /// negotiated: the server would then send those commands on the main socket, in the middle
    /// of this client's own exchanges. The first such mapping starts the thread that serves
    /// the twin socket (so a process that may start no thread once it is confined makes it
    /// before).
    pub fn dma_map_in_band(&mut self, iova: u64, mem: Arc<SharedMem>, flags: u32) -> Result<()> {
        // Before the map: the server may reach the memory as soon as it has it.
        self.serve_twin_socket()?;
        if self.twin.is_none() {
            return Err(ClientError::Unsupported {
                command: "DMA_MAP",
                why: "memory without an fd needs a twin socket, and none was negotiated (or \
                      its thread could not be started)"
                    .into(),
            });
        }
        let m = wire::DmaMap {
            argsz: wire::DmaMap::SIZE as u32,
            flags,
            offset: 0,
            addr: iova,
            size: mem.len() as u64,
        };
        // Served before the answer comes: the server may reach the memory as soon as it has
        // mapped it, before this client has read its reply.
        let at = {
            let mut regions = self.in_band.lock().expect("in-band lock");
            regions.push(InBand { iova, mem });
            regions.len() - 1
        };
        let mapped = self.call(cmd::DMA_MAP, &m.encode(), &[]);
        if mapped.is_err() {
            // Only this one: the twin thread only reads the list, and `&mut self` keeps
            // every other change out meanwhile.
            self.in_band.lock().expect("in-band lock").remove(at);
        }
        mapped.map(|_| ())
    }

    /// Removes a DMA mapping (address and size as mapped).
    pub fn dma_unmap(&mut self, iova: u64, size: u64) -> Result<()> {
        let u = wire::DmaUnmap {
            argsz: wire::DmaUnmap::SIZE as u32,
            flags: 0,
            addr: iova,
            size,
        };
        self.call(cmd::DMA_UNMAP, &u.encode(), &[])?;
        self.in_band
            .lock()
            .expect("in-band lock")
            .retain(|r| r.iova != iova);
        Ok(())
    }

    /// Resets the device.
    pub fn reset(&mut self) -> Result<()> {
        self.call(cmd::DEVICE_RESET, &[], &[])?;
        Ok(())
    }

    /// The command socket, e.g. to notice a server hang-up in an event loop. Outside a call the
    /// server never writes to it, so it turning readable means the device is lost: the server
    /// closed it, or this client gave the connection up.
    pub fn socket(&self) -> BorrowedFd<'_> {
        self.chan.fd()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = rustix::net::shutdown(self.chan.fd(), rustix::net::Shutdown::Both);
        if let Some((fd, handle)) = self.twin.take() {
            let _ = rustix::net::shutdown(fd.as_fd(), rustix::net::Shutdown::Both);
            let _ = handle.join();
        }
    }
}

fn proto(command: u16, e: WireError) -> ClientError {
    ClientError::Protocol {
        command: cmd::name(command),
        why: e.to_string(),
    }
}

/// Serves the server's DMA_READ / DMA_WRITE on the twin socket until it closes. A transfer
/// larger than the `limit` this client announced is refused (`EINVAL`).
fn serve_twin(chan: Channel, regions: Arc<Mutex<Vec<InBand>>>, limit: u64) {
    loop {
        let msg = match chan.recv(Instant::now() + Duration::from_secs(3600)) {
            Ok(m) => m,
            Err(ChannelError::Timeout) => continue,
            Err(_) => return,
        };
        let h = msg.header;
        let with_data = h.command == cmd::DMA_WRITE;
        let result = (|| -> std::result::Result<Vec<u8>, Errno> {
            if h.is_reply() || !msg.fds.is_empty() {
                return Err(Errno::INVAL);
            }
            if h.command != cmd::DMA_READ && h.command != cmd::DMA_WRITE {
                return Err(Errno::NOSYS);
            }
            let a = wire::DmaAccess::decode(&msg.payload, with_data).map_err(|_| Errno::INVAL)?;
            if a.count > limit {
                tracing::warn!(
                    "the server sent a {}-byte DMA past the {limit} bytes negotiated",
                    a.count
                );
                return Err(Errno::INVAL);
            }
            let regions = regions.lock().expect("in-band lock");
            let r = regions
                .iter()
                .find(|r| {
                    r.iova <= a.addr
                        && a.addr.saturating_add(a.count) <= r.iova + r.mem.len() as u64
                })
                .ok_or(Errno::FAULT)?;
            let off = a.addr - r.iova;
            if with_data {
                r.mem.write(off, &a.data).map_err(|_| Errno::FAULT)?;
                Ok(wire::DmaAccess {
                    data: Vec::new(),
                    ..a
                }
                .encode())
            } else {
                let mut data = vec![0u8; a.count as usize];
                r.mem.read(off, &mut data).map_err(|_| Errno::FAULT)?;
                Ok(wire::DmaAccess { data, ..a }.encode())
            }
        })();
        let sent = match result {
            Ok(p) => chan.send(&Header::reply(&h, p.len()), &p, &[]),
            Err(e) => chan.send(&Header::error_reply(&h, e.raw_os_error() as u32), &[], &[]),
        };
        if sent.is_err() {
            return;
        }
    }
}
