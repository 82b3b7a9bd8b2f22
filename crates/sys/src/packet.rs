//! A raw packet socket (`AF_PACKET`, `SOCK_RAW`) bound to one interface: whole Ethernet frames
//! in and out of the kernel's driver for it, below its IP stack — how the raw-frame benchmark
//! measures the kernel's side (`packet(7)`). Frames this socket sends are not read back.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `ETH_P_ALL`: every protocol.
const ETH_P_ALL: u16 = 0x0003;
/// `PACKET_IGNORE_OUTGOING` (Linux 4.20): do not deliver this host's own frames.
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;

/// A packet socket bound to an interface.
#[derive(Debug)]
pub struct PacketSocket {
    fd: OwnedFd,
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

impl PacketSocket {
    /// Opens a packet socket on interface `ifname` (in this process's network namespace);
    /// needs `CAP_NET_RAW`.
    pub fn open(ifname: &str) -> io::Result<Self> {
        let name = CString::new(ifname).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: `name` is a valid NUL-terminated string for the call's duration.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if index == 0 {
            return Err(io::Error::last_os_error());
        }
        let proto = ETH_P_ALL.to_be();
        // SAFETY: plain socket(2); the descriptor is owned at once below.
        let raw = check(unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::c_int::from(proto),
            )
        })?;
        // SAFETY: `raw` is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let one: libc::c_int = 1;
        // SAFETY: setsockopt reads one int from `one`, which lives across the call.
        check(unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_IGNORE_OUTGOING,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        })?;
        // SAFETY: an all-zero sockaddr_ll is valid; the fields that matter are set next.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as libc::c_ushort;
        sll.sll_protocol = proto;
        sll.sll_ifindex = index as libc::c_int;
        // SAFETY: bind reads `size_of::<sockaddr_ll>()` bytes from `sll`, which lives across
        // the call.
        check(unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        })?;
        Ok(Self { fd })
    }

    /// Sends one frame (blocking while the interface's queue is full).
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        rustix::net::send(&self.fd, frame, rustix::net::SendFlags::empty())?;
        Ok(())
    }

    /// The next frame into `buf` if one waits (its length), without blocking.
    pub fn try_recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        match rustix::net::recv(&self.fd, buf, rustix::net::RecvFlags::DONTWAIT) {
            Ok((n, _)) => Ok(Some(n)),
            Err(rustix::io::Errno::AGAIN) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

impl AsFd for PacketSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
