//! A reply that arrives after its call timed out must not be taken for the next call's reply:
//! the client gives the connection up instead, and says so on every later call.

mod common;

use std::sync::mpsc::{channel, Receiver};
use std::sync::Mutex;
use std::time::Duration;

use outboard_vfio_user::wire::{self, region};
use outboard_vfio_user::{
    Client, ClientError, ClientOptions, DeviceBackend, DeviceContext, RegionDesc,
};
use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;

/// A device whose register 0x10 answers only when the test says so: a stalled device model.
struct Stalling {
    release: Mutex<Receiver<()>>,
}

impl DeviceBackend for Stalling {
    fn regions(&self) -> Vec<RegionDesc<'_>> {
        common::bar0_and_config()
    }
    fn irqs(&self) -> Vec<wire::IrqInfo> {
        vec![]
    }
    fn region_read(
        &mut self,
        _: &mut DeviceContext,
        _index: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), Errno> {
        if offset == 0x10 {
            let _ = self.release.lock().unwrap().recv();
        }
        buf.fill(offset as u8);
        Ok(())
    }
    fn region_write(
        &mut self,
        _: &mut DeviceContext,
        _: u32,
        _: u64,
        _: &[u8],
    ) -> Result<(), Errno> {
        Ok(())
    }
    fn reset(&mut self, _: &mut DeviceContext) {}
}

#[test]
fn a_late_reply_breaks_the_connection_instead_of_shifting_every_later_reply() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stall.sock");
    let (release, rx) = channel();
    let backend = Stalling {
        release: Mutex::new(rx),
    };
    let srv = common::serve(&path, backend);
    let opts = ClientOptions {
        timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let mut c = Client::connect(&path, opts).unwrap();
    let mut b = [0u8; 4];
    c.region_read(region::BAR0, 0x20, &mut b).unwrap();
    assert_eq!(b, [0x20; 4]);

    // The device stalls past the timeout; then it wakes up and answers the old call.
    let e = c.region_read(region::BAR0, 0x10, &mut b).unwrap_err();
    assert!(matches!(e, ClientError::Channel { .. }), "{e}");
    release.send(()).unwrap();

    // The next call must not read that late reply as its own: the connection is gone.
    let e = c.region_read(region::BAR0, 0x20, &mut b).unwrap_err();
    assert!(matches!(e, ClientError::Broken { .. }), "{e}");
    assert!(e.to_string().contains("timed out"), "{e}");
    assert!(c.broken().is_some());
    // Whoever watches the socket sees the loss at once.
    let sock = c.socket();
    let mut p = [PollFd::new(&sock, PollFlags::IN)];
    assert_eq!(rustix::event::poll(&mut p, None).unwrap(), 1);
    assert!(p[0].revents().contains(PollFlags::HUP));
    drop(c);

    // The device model itself is fine: a new connection works.
    let mut c = Client::connect(&path, ClientOptions::default()).unwrap();
    c.region_read(region::BAR0, 0x20, &mut b).unwrap();
    assert_eq!(b, [0x20; 4]);
    drop(c);
    srv.stop();
}
