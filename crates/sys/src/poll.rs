//! Waiting for descriptors to become readable, with a time-out: for a thread that serves a
//! device and a socket (or a TAP interface) at once.

use std::io;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};

fn timespec(t: Duration) -> rustix::time::Timespec {
    rustix::time::Timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as _,
        tv_nsec: t.subsec_nanos() as _,
    }
}

/// Whether each of `fds` became readable (or hung up) within `timeout`; all false on a time-out
/// or a signal.
pub fn readable<const N: usize>(
    fds: [BorrowedFd<'_>; N],
    timeout: Duration,
) -> io::Result<[bool; N]> {
    let mut p = fds.map(|fd| PollFd::from_borrowed_fd(fd, PollFlags::IN));
    match rustix::event::poll(&mut p, Some(&timespec(timeout))) {
        Ok(_) => Ok(p.map(|p| !p.revents().is_empty())),
        Err(rustix::io::Errno::INTR) => Ok([false; N]),
        Err(e) => Err(e.into()),
    }
}

/// Whether `a` and whether `b` became readable within `timeout`.
pub fn either(a: BorrowedFd<'_>, b: BorrowedFd<'_>, timeout: Duration) -> io::Result<(bool, bool)> {
    readable([a, b], timeout).map(|[x, y]| (x, y))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn tells_which_descriptor_has_data() {
        let (mut a, a2) = UnixStream::pair().unwrap();
        let (_b, b2) = UnixStream::pair().unwrap();
        assert_eq!(
            either(a2.as_fd(), b2.as_fd(), Duration::from_millis(10)).unwrap(),
            (false, false)
        );
        a.write_all(b"x").unwrap();
        assert_eq!(
            either(a2.as_fd(), b2.as_fd(), Duration::from_secs(5)).unwrap(),
            (true, false)
        );
    }
}
