//! A user-space UDP/IP stack over a NIC: `smoltcp` with the NIC as its Ethernet device, so an
//! application speaks UDP through Outboard's driver without the host's stack. [`Nic`] is the
//! `smoltcp` device; [`Udp`] is one interface with one UDP socket, enough for request/reply
//! and streams of datagrams (the evaluation's echo and combination tests).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::socket::udp;
use smoltcp::wire::{EthernetAddress, HardwareAddress, IpAddress, IpCidr, IpEndpoint};

use crate::port::IntoPort;
use crate::NetPort;
use outboard_net::NetError;

/// A NIC as `smoltcp`'s Ethernet device, wherever its driver runs.
pub struct Nic {
    port: Box<dyn NetPort>,
    /// A received frame is read here; a frame to send is built here (each as long as the
    /// longest frame of the NIC's MTU).
    frame: Vec<u8>,
    outgoing: Vec<u8>,
    /// Frames `smoltcp` sent that the NIC refused (they are lost, as on a wire).
    pub dropped: u64,
}

impl Nic {
    /// The NIC behind a port.
    pub fn new(port: Box<dyn NetPort>) -> Self {
        let longest = port.info().max_frame() as usize;
        Self {
            port,
            frame: vec![0u8; longest],
            outgoing: vec![0u8; longest],
            dropped: 0,
        }
    }

    /// The port.
    pub fn port(&mut self) -> &mut dyn NetPort {
        self.port.as_mut()
    }
}

/// A received frame, lent to `smoltcp`.
pub struct Rx<'a>(&'a [u8]);

/// Room for one frame to send.
pub struct Tx<'a> {
    port: &'a mut dyn NetPort,
    buf: &'a mut [u8],
    dropped: &'a mut u64,
}

impl phy::RxToken for Rx<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(self.0)
    }
}

impl phy::TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        // Built here, then written once into the session's transmit slot.
        let len = len.min(self.buf.len());
        let r = f(&mut self.buf[..len]);
        match self.port.send(&self.buf[..len]) {
            Ok(()) => {}
            // An earlier frame's fate across a driver restart: UDP does not retry; count it.
            Err(_) => *self.dropped += 1,
        }
        r
    }
}

impl phy::Device for Nic {
    type RxToken<'a> = Rx<'a>;
    type TxToken<'a> = Tx<'a>;

    fn receive(
        &mut self,
        _: smoltcp::time::Instant,
    ) -> Option<(Self::RxToken<'_>, Self::TxToken<'_>)> {
        let n = self.port.try_recv_into(&mut self.frame).ok()??;
        Some((
            Rx(&self.frame[..n]),
            Tx {
                port: self.port.as_mut(),
                buf: &mut self.outgoing,
                dropped: &mut self.dropped,
            },
        ))
    }

    fn transmit(&mut self, _: smoltcp::time::Instant) -> Option<Self::TxToken<'_>> {
        Some(Tx {
            port: self.port.as_mut(),
            buf: &mut self.outgoing,
            dropped: &mut self.dropped,
        })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut c = DeviceCapabilities::default();
        c.medium = Medium::Ethernet;
        // For Ethernet, smoltcp counts the header in: the longest frame.
        c.max_transmission_unit = self.port.info().max_frame() as usize;
        c
    }
}

/// A UDP peer: its address and port.
pub type Peer = (Ipv4Addr, u16);

fn now(epoch: Instant) -> smoltcp::time::Instant {
    smoltcp::time::Instant::from_micros(epoch.elapsed().as_micros() as i64)
}

/// One IPv4 interface on a NIC with one UDP socket.
pub struct Udp {
    nic: Nic,
    iface: Interface,
    sockets: SocketSet<'static>,
    socket: SocketHandle,
    epoch: Instant,
}

impl Udp {
    /// Gives the NIC the address `addr/prefix` and binds a UDP socket to `port` on it.
    pub fn bind(
        nic: impl IntoPort,
        addr: Ipv4Addr,
        prefix: u8,
        port: u16,
    ) -> Result<Self, NetError> {
        let mut nic = Nic::new(nic.into_port());
        let mac = EthernetAddress(nic.port().info().mac);
        let epoch = Instant::now();
        let mut iface = Interface::new(
            Config::new(HardwareAddress::Ethernet(mac)),
            &mut nic,
            now(epoch),
        );
        iface.update_ip_addrs(|a| {
            let _ = a.push(IpCidr::new(IpAddress::Ipv4(addr), prefix));
        });
        let buffer =
            || udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 256], vec![0u8; 256 * 1536]);
        let mut sock = udp::Socket::new(buffer(), buffer());
        sock.bind(port)
            .map_err(|e| NetError::Invalid(format!("UDP port {port}: {e}")))?;
        let mut sockets = SocketSet::new(Vec::new());
        let socket = sockets.add(sock);
        Ok(Self {
            nic,
            iface,
            sockets,
            socket,
            epoch,
        })
    }

    /// Moves the stack along: takes frames in, sends what is queued.
    pub fn poll(&mut self) {
        self.iface
            .poll(now(self.epoch), &mut self.nic, &mut self.sockets);
    }

    /// Queues `data` for `to` (sent by the next poll, after ARP if the address is new). If the
    /// socket's buffer is full, sends what it holds first and waits for room (up to the port's
    /// own time-outs): a sender faster than the NIC is paced, not refused.
    pub fn send_to(&mut self, data: &[u8], to: Peer) -> Result<(), NetError> {
        let end = IpEndpoint::new(IpAddress::Ipv4(to.0), to.1);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let sent = self
                .sockets
                .get_mut::<udp::Socket>(self.socket)
                .send_slice(data, end);
            match sent {
                Ok(()) => break,
                Err(udp::SendError::BufferFull) if Instant::now() < deadline => {
                    self.poll();
                    // Still full: the stack waits for something (an ARP answer).
                    if !self.sockets.get::<udp::Socket>(self.socket).can_send() {
                        self.nic.port().wait_for(Duration::from_millis(1))?;
                    }
                }
                Err(udp::SendError::BufferFull) => return Err(NetError::Timeout),
                Err(e) => return Err(NetError::Invalid(format!("UDP send: {e}"))),
            }
        }
        self.poll();
        Ok(())
    }

    /// Sends everything queued and waits until the NIC has sent it.
    pub fn flush(&mut self) -> Result<(), NetError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.sockets.get::<udp::Socket>(self.socket).send_queue() > 0 {
            if Instant::now() >= deadline {
                return Err(NetError::Timeout);
            }
            self.poll();
            if self.sockets.get::<udp::Socket>(self.socket).send_queue() > 0 {
                self.nic.port().wait_for(Duration::from_millis(1))?;
            }
        }
        self.nic.port().flush()
    }

    /// The next datagram (its length and sender), or `None` if none came within `timeout`.
    pub fn recv_from(
        &mut self,
        buf: &mut [u8],
        timeout: Duration,
    ) -> Result<Option<(usize, Peer)>, NetError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.poll();
            let s = self.sockets.get_mut::<udp::Socket>(self.socket);
            if s.can_recv() {
                let (n, meta) = s
                    .recv_slice(buf)
                    .map_err(|e| NetError::Invalid(format!("UDP receive: {e}")))?;
                let IpAddress::Ipv4(from) = meta.endpoint.addr;
                return Ok(Some((n, (from, meta.endpoint.port))));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            // Sleep until a frame comes or the stack's next timer (ARP retries) is due.
            let due = self
                .iface
                .poll_delay(now(self.epoch), &self.sockets)
                .map_or(left, |d| Duration::from_micros(d.total_micros()).min(left));
            self.nic
                .port()
                .wait_for(due.max(Duration::from_micros(50)))?;
        }
    }

    /// Frames the NIC refused on the way out.
    pub fn dropped(&self) -> u64 {
        self.nic.dropped
    }
}
