//! What a connection runs over: a plain socket, whose payloads move between the socket and the
//! session's buffer area with no copy in user space, or TLS, which must decrypt and encrypt them
//! in user space (one copy each way, through rustls).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use outboard_shm::SharedMem;

/// A connection's byte stream.
pub trait Transport: Read + Write {
    /// The socket underneath (to wait on).
    fn fd(&self) -> BorrowedFd<'_>;

    /// Bytes already received and decrypted, waiting to be read without touching the socket.
    fn buffered(&mut self) -> bool {
        false
    }

    /// Whether a read would not block now.
    fn ready(&mut self) -> bool {
        self.buffered() || outboard_block::readable(self.fd(), Duration::ZERO).unwrap_or(true)
    }

    /// Reads up to `len` bytes into `mem` at `offset`; 0 at end of stream.
    fn recv_into(&mut self, mem: &SharedMem, offset: u64, len: usize) -> std::io::Result<usize> {
        let mut tmp = vec![0u8; len.min(256 << 10)];
        let n = self.read(&mut tmp)?;
        mem.write(offset, &tmp[..n])
            .map_err(std::io::Error::other)?;
        Ok(n)
    }

    /// Writes up to `len` bytes of `mem` at `offset`; returns how many.
    fn send_from(&mut self, mem: &SharedMem, offset: u64, len: usize) -> std::io::Result<usize> {
        let mut tmp = vec![0u8; len.min(256 << 10)];
        mem.read(offset, &mut tmp).map_err(std::io::Error::other)?;
        self.write_all(&tmp)?;
        Ok(tmp.len())
    }
}

macro_rules! plain_socket {
    ($t:ty) => {
        impl Transport for $t {
            fn fd(&self) -> BorrowedFd<'_> {
                self.as_fd()
            }
            fn recv_into(
                &mut self,
                mem: &SharedMem,
                offset: u64,
                len: usize,
            ) -> std::io::Result<usize> {
                mem.fill_from_fd(self.as_fd(), offset, len)
                    .map_err(std::io::Error::other)
            }
            fn send_from(
                &mut self,
                mem: &SharedMem,
                offset: u64,
                len: usize,
            ) -> std::io::Result<usize> {
                mem.drain_to_fd(self.as_fd(), offset, len)
                    .map_err(std::io::Error::other)
            }
        }
    };
}

plain_socket!(UnixStream);
plain_socket!(TcpStream);

impl<S: Read + Write + AsFd> Transport for rustls::StreamOwned<rustls::ServerConnection, S> {
    fn fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
    fn buffered(&mut self) -> bool {
        self.conn
            .process_new_packets()
            .map(|s| s.plaintext_bytes_to_read() > 0)
            .unwrap_or(true)
    }
}

impl<S: Read + Write + AsFd> Transport for openssl::ssl::SslStream<S> {
    fn fd(&self) -> BorrowedFd<'_> {
        self.get_ref().as_fd()
    }
    fn buffered(&mut self) -> bool {
        self.ssl().pending() > 0
    }
}
