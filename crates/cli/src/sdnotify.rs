//! systemd's readiness protocol (`sd_notify(3)`), the sender's half: a datagram of
//! `KEY=VALUE` lines to the socket `$NOTIFY_SOCKET` names (a path, or `@name` for an abstract
//! socket). Written here rather than taken from a crate: it is one `sendto`.

use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `READY=1`) to the service manager, if one asked (`NOTIFY_SOCKET`).
/// A service manager that is gone or answers an error changes nothing: the machine runs on.
pub fn notify(state: &str) {
    let Some(to) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&to, state) {
        tracing::warn!("NOTIFY_SOCKET {}: {e}", to.to_string_lossy());
    }
}

fn send(to: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let sock = UnixDatagram::unbound()?;
    let bytes = to.as_bytes();
    match bytes.strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.send_to_addr(state.as_bytes(), &addr)?;
        }
        None => {
            sock.send_to(state.as_bytes(), std::path::Path::new(to))?;
        }
    }
    Ok(())
}
