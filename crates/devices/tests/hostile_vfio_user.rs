//! Malformed vfio-user input against the virtio-blk device model's server: every bad message
//! gets an error reply or a closed connection, the server never panics or hangs, keeps serving
//! the next client, and leaks no fds.

mod common;

use common::{Raw, Running};

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use outboard_vfio_user::wire::{self, cmd, Header};
use proptest::prelude::*;
use rustix::io::Errno;

fn einval() -> u32 {
    Errno::INVAL.raw_os_error() as u32
}

fn region_read(offset: u64, region: u32, count: u32) -> Vec<u8> {
    wire::RegionAccess {
        offset,
        region,
        count,
        data: vec![],
    }
    .encode()
}

#[test]
fn malformed_commands_get_error_replies_and_the_connection_survives() {
    let srv = Running::start();
    let mut c = Raw::connect(&srv.path);
    // Before VERSION, nothing else is accepted.
    assert_eq!(c.call(cmd::DEVICE_GET_INFO, &[0; 16], &[]), Err(einval()));
    // VERSION with malformed JSON, then a wrong major, then a good one.
    let bad = wire::Version {
        major: 0,
        minor: 1,
        json: "{not json".into(),
    };
    assert_eq!(c.call(cmd::VERSION, &bad.encode(), &[]), Err(einval()));
    let wrong_major = wire::Version {
        major: 9,
        minor: 0,
        json: "{}".into(),
    };
    assert!(c.call(cmd::VERSION, &wrong_major.encode(), &[]).is_err());
    c.version();

    // Unknown command with a payload: ENOSYS, and the payload is consumed.
    assert_eq!(
        c.call(99, &[1, 2, 3, 4, 5], &[]),
        Err(Errno::NOSYS.raw_os_error() as u32)
    );
    // Truncated payloads.
    assert_eq!(c.call(cmd::REGION_READ, &[0; 8], &[]), Err(einval()));
    assert_eq!(c.call(cmd::DMA_MAP, &[0; 31], &[]), Err(einval()));
    // Out-of-range and zero-length accesses, unknown regions.
    assert_eq!(
        c.call(cmd::REGION_READ, &region_read(0x3ffe, 0, 4), &[]),
        Err(einval())
    );
    assert_eq!(
        c.call(cmd::REGION_READ, &region_read(u64::MAX - 1, 0, 4), &[]),
        Err(einval())
    );
    // A 0-byte access inside a region is a no-op that succeeds (docs/vfio-user-conformance.md).
    let empty = c
        .call(cmd::REGION_READ, &region_read(0, 0, 0), &[])
        .unwrap();
    assert_eq!(empty.len(), 16, "the access header, no data");
    // Found by the fuzzer: a 0-byte read of the ISR register (BAR0 0x1000) panicked the model.
    let empty = c
        .call(cmd::REGION_READ, &region_read(0x1000, 0, 0), &[])
        .unwrap();
    assert_eq!(empty.len(), 16);
    c.call(cmd::REGION_WRITE, &region_read(0x1000, 0, 0), &[])
        .unwrap();
    assert_eq!(
        c.call(cmd::REGION_READ, &region_read(0, 6, 4), &[]),
        Err(einval())
    );
    assert_eq!(
        c.call(cmd::REGION_READ, &region_read(0, 0, 2_000_000), &[]),
        Err(einval())
    );
    // Write whose count disagrees with its data.
    let mut w = region_read(0, 0, 8);
    w.extend_from_slice(&[1, 2, 3]);
    assert_eq!(c.call(cmd::REGION_WRITE, &w, &[]), Err(einval()));
    // SET_IRQS with contradictory flags, or too many vectors.
    let set = |flags, start, count| {
        wire::IrqSet {
            argsz: 20,
            flags,
            index: wire::irq::MSIX,
            start,
            count,
            data: vec![],
        }
        .encode()
    };
    let both =
        wire::irq::SET_DATA_NONE | wire::irq::SET_DATA_EVENTFD | wire::irq::SET_ACTION_TRIGGER;
    assert_eq!(
        c.call(cmd::DEVICE_SET_IRQS, &set(both, 0, 1), &[]),
        Err(einval())
    );
    let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::empty()).unwrap();
    let trig = wire::irq::SET_DATA_EVENTFD | wire::irq::SET_ACTION_TRIGGER;
    assert_eq!(
        c.call(cmd::DEVICE_SET_IRQS, &set(trig, 1, 5), &[efd.as_fd()]),
        Err(einval())
    );
    assert_eq!(
        c.call(cmd::DEVICE_SET_IRQS, &set(trig, u32::MAX, 2), &[]),
        Err(einval())
    );
    // Fds missing or extra: two fds for DMA_MAP (at most one), an fd with GET_INFO (none),
    // one fd for two vectors.
    let map = common::dma_map;
    let mem = outboard_shm::SharedMem::create("m", 8192).unwrap();
    let fd = mem.fd().unwrap();
    assert_eq!(
        c.call(cmd::DMA_MAP, &map(0, 4096), &[fd, fd]),
        Err(einval())
    );
    assert_eq!(c.call(cmd::DEVICE_GET_INFO, &[0; 16], &[fd]), Err(einval()));
    assert_eq!(
        c.call(cmd::DEVICE_SET_IRQS, &set(trig, 0, 2), &[efd.as_fd()]),
        Err(einval())
    );
    // DMA ranges: empty, wrapping, larger than the fd, overlapping, unmapping what was not.
    assert_eq!(c.call(cmd::DMA_MAP, &map(0, 0), &[fd]), Err(einval()));
    assert_eq!(
        c.call(cmd::DMA_MAP, &map(u64::MAX - 10, 4096), &[fd]),
        Err(einval())
    );
    assert_eq!(c.call(cmd::DMA_MAP, &map(0, 1 << 20), &[fd]), Err(einval()));
    c.call(cmd::DMA_MAP, &map(0x10000, 8192), &[fd]).unwrap();
    assert_eq!(
        c.call(cmd::DMA_MAP, &map(0x11000, 8192), &[fd]),
        Err(Errno::EXIST.raw_os_error() as u32)
    );
    let unmap = wire::DmaUnmap {
        argsz: 24,
        flags: 0,
        addr: 0x10000,
        size: 4096,
    };
    assert_eq!(
        c.call(cmd::DMA_UNMAP, &unmap.encode(), &[]),
        Err(Errno::NOENT.raw_os_error() as u32),
        "unmapping a range that is not mapped"
    );
    let bitmap = wire::DmaUnmap {
        flags: wire::dma::UNMAP_FLAG_GET_DIRTY_BITMAP,
        ..unmap
    };
    assert_eq!(c.call(cmd::DMA_UNMAP, &bitmap.encode(), &[]), Err(einval()));
    let all_with_range = wire::DmaUnmap {
        flags: wire::dma::UNMAP_FLAG_ALL,
        ..unmap
    };
    assert_eq!(
        c.call(cmd::DMA_UNMAP, &all_with_range.encode(), &[]),
        Err(einval())
    );
    let unknown = wire::DmaUnmap { flags: 8, ..unmap };
    assert_eq!(
        c.call(cmd::DMA_UNMAP, &unknown.encode(), &[]),
        Err(einval())
    );

    // After all that, the connection still works.
    let mut id = [0u8; 4];
    let r = c
        .call(
            cmd::REGION_READ,
            &region_read(0, wire::region::CONFIG, 4),
            &[],
        )
        .unwrap();
    id.copy_from_slice(&r[16..20]);
    assert_eq!(id, [0xf4, 0x1a, 0x42, 0x10]);
    drop(c);
    let stats = srv.stop();
    assert_eq!(stats.dropped, 0);
    assert!(stats.errors >= 20, "{stats:?}");
}

#[test]
fn broken_framing_closes_the_connection_and_the_next_client_is_served() {
    let srv = Running::start();
    // A header claiming more than the size limit.
    {
        let mut s = UnixStream::connect(&srv.path).unwrap();
        let mut h = Header::command(1, cmd::VERSION, 0);
        h.size = wire::MAX_MESSAGE_SIZE + 1;
        s.write_all(&h.encode()).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(s.read(&mut b).unwrap(), 0, "server closes");
    }
    // A header smaller than a header.
    {
        let mut s = UnixStream::connect(&srv.path).unwrap();
        let mut h = Header::command(1, cmd::VERSION, 0);
        h.size = 4;
        s.write_all(&h.encode()).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(s.read(&mut b).unwrap(), 0);
    }
    // A truncated frame: the header promises 100 bytes, 10 arrive, then silence.
    {
        let mut s = UnixStream::connect(&srv.path).unwrap();
        let h = Header::command(1, cmd::VERSION, 84);
        s.write_all(&h.encode()).unwrap();
        s.write_all(&[0; 10]).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(
            s.read(&mut b).unwrap(),
            0,
            "server gives up after its timeout"
        );
    }
    // A reply where a command belongs.
    {
        let c = Raw::connect(&srv.path);
        let h = Header::reply(&Header::command(1, cmd::VERSION, 0), 0);
        c.chan.send(&h, &[], &[]).unwrap();
        assert!(c.closed());
    }
    // Fds attached to a command that takes none, before negotiation: refused and closed.
    {
        let c = Raw::connect(&srv.path);
        let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::empty()).unwrap();
        let fds = [efd.as_fd(), efd.as_fd(), efd.as_fd()];
        c.chan.send(&Header::command(1, 77, 0), &[], &fds).unwrap();
        let reply = c.chan.recv_within(Duration::from_secs(1)).unwrap();
        assert!(reply.header.is_error());
    }
    // The next well-behaved client is served.
    let mut c = Raw::connect(&srv.path);
    c.version();
    let info = c
        .call(
            cmd::DEVICE_GET_INFO,
            &[16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            &[],
        )
        .unwrap();
    assert_eq!(wire::DeviceInfo::decode(&info).unwrap().num_irqs, 5);
    drop(c);
    // Counted when each was dropped, before the clients above saw their connections close.
    let stats = srv.stop();
    assert!(stats.dropped >= 4, "{stats:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// Arbitrary bytes after a valid handshake: the server answers or hangs up, never
    /// panics, and serves a fresh client afterwards.
    #[test]
    fn garbage_streams_never_kill_the_server(garbage in proptest::collection::vec(any::<u8>(), 0..600)) {
        let srv = Running::start();
        {
            let mut c = Raw::connect(&srv.path);
            c.version();
            let mut s = UnixStream::from(c.chan.fd().try_clone_to_owned().unwrap());
            let _ = s.write_all(&garbage);
            let _ = s.shutdown(std::net::Shutdown::Write);
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
        }
        let mut c = Raw::connect(&srv.path);
        c.version();
        let r = c.call(cmd::REGION_READ, &region_read(0, wire::region::CONFIG, 2), &[]);
        prop_assert!(r.is_ok());
        drop(c);
        srv.stop();
    }
}
