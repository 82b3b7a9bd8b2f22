//! A NIC as an application uses it, wherever its driver runs: [`NetPort`] is what a session
//! with a driver server ([`crate::NetClient`]) and a driver in this process
//! ([`crate::ColocatedNic`]) both offer, so one program (the UDP stack, `outboard net`, the
//! TAP export, the benchmarks) runs over either placement.

use std::os::fd::BorrowedFd;
use std::time::Duration;

use outboard_net::bpf::Program;
use outboard_net::{NetError, NetInfo};

/// Frames out and in, and what a receiver may set.
pub trait NetPort: Send {
    /// The device's status when it was opened.
    fn info(&self) -> &NetInfo;
    /// The device's status now (link, counters).
    fn status_now(&mut self) -> Result<NetInfo, NetError>;
    /// Queues `frame` for sending; waits only for room. A frame that failed later is reported
    /// by a later `send` or [`NetPort::flush`].
    fn send(&mut self, frame: &[u8]) -> Result<(), NetError>;
    /// Waits until every frame queued so far is sent or failed; the first failure, if any.
    fn flush(&mut self) -> Result<(), NetError>;
    /// The next frame received, copied into `out` (its length), or `None` if none came within
    /// `timeout`.
    fn recv_into(&mut self, out: &mut [u8], timeout: Duration) -> Result<Option<usize>, NetError>;
    /// The next frame received, if one is there now.
    fn try_recv_into(&mut self, out: &mut [u8]) -> Result<Option<usize>, NetError>;
    /// Waits until a frame may have come or `timeout` passed.
    fn wait_for(&mut self, timeout: Duration) -> Result<(), NetError>;
    /// Waits until a frame may have come (false) or `also` became readable (true), or
    /// `timeout` passed (false) — one thread serving the NIC and another descriptor.
    fn wait_or(&mut self, also: BorrowedFd<'_>, timeout: Duration) -> Result<bool, NetError>;
    /// Attaches a packet filter (`None` removes it); a bad program is refused with why.
    fn set_filter(&mut self, program: Option<&Program>) -> Result<(), NetError>;
    /// Sets the receive mode ([`outboard_net::PROMISCUOUS`], [`outboard_net::ALL_MULTICAST`]).
    fn set_mode(&mut self, flags: u32) -> Result<(), NetError>;
    /// Joins exactly these multicast groups.
    fn set_groups(&mut self, groups: &[[u8; 6]]) -> Result<(), NetError>;
    /// Asks the NIC to hold receive interrupts back up to `usecs` (0: none): fewer wake-ups
    /// under load, at that much latency. The device's setting, for every user of the NIC.
    fn set_hold_off(&mut self, usecs: u32) -> Result<(), NetError>;
    /// The next frame received, or `None` if none came within `timeout`.
    fn recv(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, NetError> {
        let mut buf = vec![0u8; self.info().max_frame() as usize];
        Ok(self.recv_into(&mut buf, timeout)?.map(|n| {
            buf.truncate(n);
            buf
        }))
    }
    /// How often the port was put back after its driver restarted.
    fn resumes(&self) -> u64 {
        0
    }
}

/// Anything that can be used as a port: a port itself, or one already boxed (as open-by-name
/// returns it).
pub trait IntoPort {
    /// The port, boxed.
    fn into_port(self) -> Box<dyn NetPort>;
}

impl<P: NetPort + 'static> IntoPort for P {
    fn into_port(self) -> Box<dyn NetPort> {
        Box::new(self)
    }
}

impl IntoPort for Box<dyn NetPort> {
    fn into_port(self) -> Box<dyn NetPort> {
        self
    }
}
