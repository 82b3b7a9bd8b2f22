//! The device model's vfio-user server against clients shaped as libvfio-user's headers and
//! QEMU's client define their messages.

mod common;

use std::time::Duration;

use common::{Raw, Running};
use outboard_devices::virtio_blk::BlkOptions;
use outboard_vfio_user::wire::{self, cmd, region};
use rustix::io::Errno;

fn errno(e: Errno) -> u32 {
    e.raw_os_error() as u32
}

use common::dma_map as map;

fn unmap(flags: u32, addr: u64, size: u64) -> Vec<u8> {
    wire::DmaUnmap {
        argsz: 24,
        flags,
        addr,
        size,
    }
    .encode()
}

/// QEMU and libvfio-user's sample client unmap everything with VFIO_DMA_UNMAP_FLAG_ALL
/// (address and size 0); the server used to answer EOPNOTSUPP and keep the mappings.
#[test]
fn unmap_all_removes_every_mapping() {
    let srv = Running::start();
    let mut c = Raw::connect(&srv.path);
    c.version();
    let mem = outboard_shm::SharedMem::create("dma", 3 << 16).unwrap();
    let fd = mem.fd().unwrap();
    c.call(cmd::DMA_MAP, &map(0x10000, 0x10000), &[fd]).unwrap();
    c.call(cmd::DMA_MAP, &map(0x40000, 0x10000), &[fd]).unwrap();
    let r = c
        .call(cmd::DMA_UNMAP, &unmap(wire::dma::UNMAP_FLAG_ALL, 0, 0), &[])
        .unwrap();
    assert_eq!(
        wire::DmaUnmap::decode(&r).unwrap().flags,
        wire::dma::UNMAP_FLAG_ALL
    );
    // Both are gone; a new mapping may take their place.
    for addr in [0x10000, 0x40000] {
        assert_eq!(
            c.call(cmd::DMA_UNMAP, &unmap(0, addr, 0x10000), &[]),
            Err(errno(Errno::NOENT))
        );
    }
    c.call(cmd::DMA_MAP, &map(0x10000, 0x20000), &[fd]).unwrap();
    drop(c);
    srv.stop();
}

/// A REGION_INFO too short for the capability list gets the full size in `argsz` and no fd;
/// the fd comes with the reply that carries the whole list (libvfio-user's sample client
/// failed with "Bad address" on an fd attached to a 32-byte reply).
#[test]
fn a_regions_fd_comes_only_with_its_whole_reply() {
    let srv = Running::start();
    let mut c = Raw::connect(&srv.path);
    c.version();
    let ask = |c: &mut Raw, argsz| {
        c.call_fds(
            cmd::DEVICE_GET_REGION_INFO,
            &wire::RegionInfo::encode_request(region::BAR0, argsz),
            &[],
        )
        .unwrap()
    };
    let (short, fds) = ask(&mut c, 32);
    let info = wire::RegionInfo::decode(&short).unwrap();
    assert!(info.argsz > 32, "the full size is announced");
    assert!(fds.is_empty(), "no fd with a cut-short reply");
    assert_eq!(
        info.flags & region::FLAG_CAPS,
        0,
        "no capability list was sent"
    );
    let (whole, fds) = ask(&mut c, info.argsz);
    let info = wire::RegionInfo::decode(&whole).unwrap();
    assert_eq!(fds.len(), 1);
    assert_ne!(info.flags & region::FLAG_CAPS, 0);
    assert_eq!(info.sparse.len(), 1);
    drop(c);
    srv.stop();
}

/// A client that accepts one fd per message does not get a 4-queue model's four ioeventfds
/// in one reply: the reply cannot be split, so it is E2BIG (the client traps those doorbells).
#[test]
fn io_fds_respect_the_clients_max_msg_fds() {
    let opts = BlkOptions {
        num_queues: 4,
        ..Default::default()
    };
    let srv = Running::start_model(Duration::from_secs(1), opts);
    let io_fds = |c: &mut Raw| {
        let req = wire::IoFdsRequest {
            argsz: 4096,
            flags: 0,
            index: region::BAR0,
            count: 0,
        };
        c.call_fds(cmd::DEVICE_GET_REGION_IO_FDS, &req.encode(), &[])
    };
    let mut c = Raw::connect(&srv.path);
    c.version_with(r#"{"capabilities":{"max_msg_fds":1}}"#)
        .unwrap();
    assert_eq!(io_fds(&mut c).unwrap_err(), errno(Errno::TOOBIG));
    drop(c);
    let mut c = Raw::connect(&srv.path);
    c.version_with(r#"{"capabilities":{"max_msg_fds":8}}"#)
        .unwrap();
    let (reply, fds) = io_fds(&mut c).unwrap();
    assert_eq!(fds.len(), 4);
    assert_eq!(wire::IoFdsReply::decode(&reply).unwrap().subs.len(), 4);
    // A region without ioeventfds answers with none, not an error.
    let req = wire::IoFdsRequest {
        argsz: 4096,
        flags: 0,
        index: region::CONFIG,
        count: 0,
    };
    let (reply, fds) = c
        .call_fds(cmd::DEVICE_GET_REGION_IO_FDS, &req.encode(), &[])
        .unwrap();
    assert!(fds.is_empty());
    assert_eq!(wire::IoFdsReply::decode(&reply).unwrap().count, 0);
    drop(c);
    srv.stop();
}

/// libvfio-user writes sizes as 64-bit JSON numbers: 2^32 and more must not be refused.
#[test]
fn version_accepts_sizes_past_32_bits() {
    let srv = Running::start();
    let mut c = Raw::connect(&srv.path);
    c.version_with(r#"{"capabilities":{"max_msg_fds":8,"max_data_xfer_size":4294967296}}"#)
        .unwrap();
    c.call(
        cmd::REGION_READ,
        &wire::RegionAccess {
            offset: 0,
            region: region::CONFIG,
            count: 4,
            data: vec![],
        }
        .encode(),
        &[],
    )
    .unwrap();
    drop(c);
    srv.stop();
}
