//! A TAP interface: a host network interface whose frames this process reads and writes, one
//! Ethernet frame a `read`/`write` on its descriptor (`IFF_TAP | IFF_NO_PI`: no packet
//! information header). It goes away when the descriptor closes.

use std::os::fd::{AsRawFd, OwnedFd};

const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
/// `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// `struct ifreq` as `TUNSETIFF` reads and writes it: the name, then the flags.
#[repr(C)]
struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Creates TAP interface `name` (or the next `tapN` if `name` is empty), non-blocking; returns
/// its descriptor and the name the kernel gave it.
pub fn open(name: &str) -> Result<(OwnedFd, String), String> {
    if name.len() >= libc::IFNAMSIZ || name.contains('/') || name.contains(char::is_whitespace) {
        return Err(format!(
            "{name:?}: an interface name has at most {} characters, no '/' or spaces",
            libc::IFNAMSIZ - 1
        ));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(|e| format!("/dev/net/tun: {e}"))?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: IFF_TAP | IFF_NO_PI,
        _pad: [0; 22],
    };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `IfReq` lays out (name,
    // then the flags of its union, padded to the union's size); `req` lives across the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) };
    if rc < 0 {
        return Err(format!(
            "creating TAP interface {name:?}: {}",
            std::io::Error::last_os_error()
        ));
    }
    let given: Vec<u8> = req
        .name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let fd = OwnedFd::from(file);
    let flags = rustix::fs::fcntl_getfl(&fd).map_err(|e| e.to_string())?;
    rustix::fs::fcntl_setfl(&fd, flags | rustix::fs::OFlags::NONBLOCK)
        .map_err(|e| e.to_string())?;
    Ok((fd, String::from_utf8_lossy(&given).into_owned()))
}

/// `SIOCSIFMTU`: sets an interface's MTU.
const SIOCSIFMTU: libc::c_ulong = 0x8922;

/// `struct ifreq` as `SIOCSIFMTU` reads it: the name, then the MTU as an `int`.
#[repr(C)]
struct IfMtu {
    name: [libc::c_char; libc::IFNAMSIZ],
    mtu: libc::c_int,
    _pad: [u8; 20],
}

/// Sets interface `name`'s MTU (a TAP interface starts at 1500 whatever the NIC behind it
/// carries); needs CAP_NET_ADMIN.
pub fn set_mtu(name: &str, mtu: u16) -> Result<(), String> {
    if name.len() >= libc::IFNAMSIZ {
        return Err(format!("{name:?}: not an interface name"));
    }
    let sock = rustix::net::socket(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::DGRAM,
        None,
    )
    .map_err(|e| format!("a socket to set {name}'s MTU: {e}"))?;
    let mut req = IfMtu {
        name: [0; libc::IFNAMSIZ],
        mtu: libc::c_int::from(mtu),
        _pad: [0; 20],
    };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: SIOCSIFMTU reads one `struct ifreq`, which `IfMtu` lays out (name, then the
    // `int` of its union, padded to the union's size); `req` lives across the call.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), SIOCSIFMTU, &mut req as *mut IfMtu) };
    if rc < 0 {
        return Err(format!(
            "setting {name}'s MTU to {mtu}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}
