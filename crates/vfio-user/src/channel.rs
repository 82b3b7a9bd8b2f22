//! Framed vfio-user messages over a connected `AF_UNIX` stream socket, with fd passing.
//!
//! A message is sent with one `sendmsg` carrying its fds as `SCM_RIGHTS`; the receiver reads the
//! 16-byte header, validates it, then reads exactly the rest of the message. Every read waits at
//! most until a deadline, so a peer that stops half-way through a message cannot hang us. Fds
//! arriving anywhere within a message are collected (and closed if the message is rejected),
//! never leaked.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::wire::{Header, WireError, HEADER_SIZE, MAX_FDS};

/// Why a message could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// The peer closed the connection.
    #[error("peer closed the connection")]
    Closed,
    /// The deadline passed.
    #[error("timed out waiting for the peer")]
    Timeout,
    /// The socket failed.
    #[error("socket: {0}")]
    Io(#[from] Errno),
    /// The peer sent bytes that are not a valid message.
    #[error("malformed message: {0}")]
    Wire(#[from] WireError),
    /// The peer sent more fds than one message may carry.
    #[error("too many file descriptors in one message (limit {MAX_FDS})")]
    TooManyFds,
}

/// A received message.
#[derive(Debug)]
pub struct Message {
    /// Its header.
    pub header: Header,
    /// Its payload (everything after the header).
    pub payload: Vec<u8>,
    /// File descriptors that came with it.
    pub fds: Vec<OwnedFd>,
}

/// One end of a vfio-user connection.
#[derive(Debug)]
pub struct Channel {
    fd: OwnedFd,
    /// How long a receive checks for the peer's message before it sleeps (see
    /// [`Channel::set_spin`]).
    spin: Duration,
}

impl Channel {
    /// Wraps a connected stream socket.
    pub fn new(fd: OwnedFd) -> Self {
        Self {
            fd,
            spin: Duration::ZERO,
        }
    }

    /// Makes a receive check for the peer's message for up to `spin` before it sleeps in the
    /// kernel. A command and its reply are a few microseconds of work on either side, but a
    /// sleeping process woken from another CPU costs tens of microseconds on a virtual
    /// machine (an inter-processor interrupt and the idle CPU's exit); a burst of commands —
    /// a device's bring-up is some sixty — pays that twice per command unless both sides are
    /// still awake when the next message comes.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// The socket, for an event loop to poll.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Sends one message with its fds. Partial sends are completed; fds travel with the first
    /// byte.
    pub fn send(
        &self,
        header: &Header,
        payload: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ChannelError> {
        debug_assert_eq!(header.size as usize, HEADER_SIZE + payload.len());
        let head = header.encode();
        let mut sent = 0usize;
        let total = HEADER_SIZE + payload.len();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut first = true;
        while sent < total {
            let iov: [IoSlice<'_>; 2] = if sent < HEADER_SIZE {
                [IoSlice::new(&head[sent..]), IoSlice::new(payload)]
            } else {
                [
                    IoSlice::new(&[]),
                    IoSlice::new(&payload[sent - HEADER_SIZE..]),
                ]
            };
            let mut cmsg = SendAncillaryBuffer::new(&mut space);
            if first
                && !fds.is_empty()
                && (fds.len() > MAX_FDS || !cmsg.push(SendAncillaryMessage::ScmRights(fds)))
            {
                return Err(ChannelError::TooManyFds);
            }
            match rustix::net::sendmsg(&self.fd, &iov, &mut cmsg, SendFlags::NOSIGNAL) {
                Ok(0) => return Err(ChannelError::Closed),
                Ok(n) => {
                    sent += n;
                    first = false;
                }
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => return Err(ChannelError::Timeout),
                Err(Errno::PIPE) | Err(Errno::CONNRESET) => return Err(ChannelError::Closed),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Waits until the socket is readable or the deadline passes.
    fn wait(&self, deadline: Instant) -> Result<(), ChannelError> {
        if !self.spin.is_zero() {
            let budget = self
                .spin
                .min(deadline.saturating_duration_since(Instant::now()));
            let mut pfd = [PollFd::new(&self.fd, PollFlags::IN)];
            if spin_until_ready(&mut pfd, budget)? {
                return Ok(());
            }
        }
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(ChannelError::Timeout);
            }
            let left = deadline - now;
            let ts = rustix::time::Timespec {
                tv_sec: left.as_secs() as _,
                tv_nsec: left.subsec_nanos() as _,
            };
            let mut pfd = [PollFd::new(&self.fd, PollFlags::IN)];
            match rustix::event::poll(&mut pfd, Some(&ts)) {
                Ok(0) => return Err(ChannelError::Timeout),
                Ok(_) => return Ok(()),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Reads exactly `buf.len()` bytes, collecting any fds.
    fn read_exact(
        &self,
        buf: &mut [u8],
        fds: &mut Vec<OwnedFd>,
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        let mut got = 0;
        while got < buf.len() {
            self.wait(deadline)?;
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
            let mut cmsg = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut buf[got..])];
            let r = match rustix::net::recvmsg(
                &self.fd,
                &mut iov,
                &mut cmsg,
                RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
            ) {
                Ok(r) => r,
                Err(Errno::INTR) | Err(Errno::AGAIN) => continue,
                Err(Errno::CONNRESET) => return Err(ChannelError::Closed),
                Err(e) => return Err(e.into()),
            };
            for msg in cmsg.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = msg {
                    fds.extend(received);
                }
            }
            if r.flags.contains(ReturnFlags::CTRUNC) || fds.len() > MAX_FDS {
                return Err(ChannelError::TooManyFds);
            }
            if r.bytes == 0 {
                return Err(ChannelError::Closed);
            }
            got += r.bytes;
        }
        Ok(())
    }

    /// Receives one whole message, waiting at most until `deadline`.
    pub fn recv(&self, deadline: Instant) -> Result<Message, ChannelError> {
        let mut fds = Vec::new();
        let mut head = [0u8; HEADER_SIZE];
        self.read_exact(&mut head, &mut fds, deadline)?;
        let header = Header::decode(&head)?;
        let mut payload = vec![0u8; header.payload_len()];
        self.read_exact(&mut payload, &mut fds, deadline)?;
        Ok(Message {
            header,
            payload,
            fds,
        })
    }

    /// Receives one message when the socket is known to be readable: the rest of the message
    /// must follow within `timeout`.
    pub fn recv_within(&self, timeout: Duration) -> Result<Message, ChannelError> {
        self.recv(Instant::now() + timeout)
    }

    /// Sets how long a blocking send may wait for the peer to drain its socket.
    pub fn set_send_timeout(&self, timeout: Duration) -> Result<(), ChannelError> {
        rustix::net::sockopt::set_socket_timeout(
            &self.fd,
            rustix::net::sockopt::Timeout::Send,
            Some(timeout),
        )?;
        Ok(())
    }
}

/// Checks `fds` for readiness without sleeping, over and over, for up to `budget`, giving the
/// CPU to anyone else runnable between checks (a peer on the same CPU must get to answer).
/// Whether one became ready; their `revents` say which.
pub(crate) fn spin_until_ready(fds: &mut [PollFd<'_>], budget: Duration) -> Result<bool, Errno> {
    let start = Instant::now();
    let now = rustix::time::Timespec::default();
    loop {
        match rustix::event::poll(fds, Some(&now)) {
            Ok(0) | Err(Errno::INTR) => {}
            Ok(_) => return Ok(true),
            Err(e) => return Err(e),
        }
        if start.elapsed() >= budget {
            return Ok(false);
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::cmd;
    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};

    fn pair() -> (Channel, Channel) {
        let (a, b) = socketpair(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        (Channel::new(a), Channel::new(b))
    }

    fn send_reset(chan: &Channel, id: u16) {
        chan.send(&Header::command(id, cmd::DEVICE_RESET, 0), &[], &[])
            .unwrap();
    }

    #[test]
    fn a_spinning_receive_takes_a_message_that_is_there_or_comes_after_its_spin() {
        let (mut ours, theirs) = pair();
        ours.set_spin(Duration::from_micros(50));
        send_reset(&theirs, 1);
        let deadline = Instant::now() + Duration::from_secs(5);
        assert_eq!(ours.recv(deadline).unwrap().header.msg_id, 1);
        // Long after the spin: the receive must have gone to sleep and still wake for it.
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            send_reset(&theirs, 2);
            theirs
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        assert_eq!(ours.recv(deadline).unwrap().header.msg_id, 2);
        drop(late.join().unwrap());
        assert!(matches!(
            ours.recv(Instant::now() + Duration::from_secs(5)),
            Err(ChannelError::Closed)
        ));
    }

    #[test]
    fn a_spin_ends_with_its_budget_when_nothing_comes() {
        let (ours, _theirs) = pair();
        let budget = Duration::from_millis(2);
        let start = Instant::now();
        let mut pfd = [PollFd::new(&ours.fd, PollFlags::IN)];
        assert!(!spin_until_ready(&mut pfd, budget).unwrap());
        assert!(start.elapsed() >= budget);
        // And a receive with a spin still honours its own, shorter deadline.
        let mut ours = ours;
        ours.set_spin(Duration::from_millis(50));
        let start = Instant::now();
        assert!(matches!(
            ours.recv(start + Duration::from_millis(5)),
            Err(ChannelError::Timeout)
        ));
    }
}
