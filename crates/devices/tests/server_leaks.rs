//! Clients that send fds with bad messages, or vanish mid-message, leave no fd behind in the
//! server. Its own test binary: `/proc/self/fd` is process-wide.

mod common;

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::Running;
use outboard_vfio_user::wire::{cmd, Header};
use outboard_vfio_user::Channel;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn rejected_fds_and_dropped_clients_leak_nothing() {
    let srv = Running::start();
    let baseline = open_fds();
    for _ in 0..20 {
        // Fds attached to a command that takes none.
        let c = Channel::new(UnixStream::connect(&srv.path).unwrap().into());
        let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::empty()).unwrap();
        c.send(
            &Header::command(1, cmd::DEVICE_GET_INFO, 0),
            &[],
            &[efd.as_fd(), efd.as_fd()],
        )
        .unwrap();
        let _ = c.recv_within(Duration::from_secs(1));
        drop((c, efd));
        // A truncated frame, then the client vanishes.
        let mut s = UnixStream::connect(&srv.path).unwrap();
        s.write_all(&Header::command(1, cmd::VERSION, 100).encode())
            .unwrap();
        drop(s);
    }
    assert!(
        common::eventually(Duration::from_secs(10), || open_fds() <= baseline),
        "fds leaked: {} > {baseline}",
        open_fds()
    );
    srv.stop();
}
