//! The block class served both ways — by a driver host over sessions (`separate`) and with the
//! driver in this process (`colocated`) — runs the same verified workloads.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use outboard_block::{BlockDevice, BlockDriver, BlockError, BlockOp, BlockRequest};
use outboard_block_client::Colocated;
use outboard_block_client::{BlockClient, SessionOptions, WaitMode};
use outboard_drivers::virtio_block::VirtioBlock;
use outboard_hw::backend::in_process::InProcess;

const BLOCKS: u64 = 32768; // 16 MiB of 512-byte blocks

const SIZE: &str = "16M";

fn disk() -> (VirtioBlock, Arc<InProcess>) {
    common::disk(SIZE)
}

use outboard_block::conformance::{self, pattern};

/// Queued verified I/O over blocks `first..first + count` (the conformance suite's).
fn verified_io(d: &mut impl BlockDevice, first: u64, count: u64, seed: u64) {
    conformance::verified_io(d, first, count, seed).unwrap();
}

/// The block class's conformance suite, on the 16 MiB disk every placement here serves.
fn suite(d: &mut impl BlockDevice) {
    assert_eq!(d.info().capacity, BLOCKS);
    assert_eq!(d.info().block_size, 512);
    if let Err(e) = conformance::run(d) {
        panic!("{e}");
    }
    // Outboard's model reads a discarded range as zeroes (the suite allows either).
    d.write_blocks(0, &pattern(5, 8192)).unwrap();
    let discard = BlockRequest {
        op: BlockOp::Discard,
        lba: 0,
        blocks: 4,
        buf_offset: 0,
        tag: 9,
    };
    d.execute(&discard).unwrap();
    let mut z = vec![1u8; 8192];
    d.read_blocks(0, &mut z).unwrap();
    assert!(z[..2048].iter().all(|&b| b == 0));
    assert_eq!(&z[2048..], &pattern(5, 8192)[2048..]);
}

#[test]
fn colocated_placement_passes_the_suite() {
    let (host, _) = disk();
    let env = host.env();
    let mut d = Colocated::with_driver(Box::new(host), &env, 4 << 20).unwrap();
    suite(&mut d);
}

#[test]
fn separate_placement_passes_the_suite_in_both_wait_modes() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let sock = srv.sock.clone();
    let mut d = BlockClient::open(&sock, "disk0", SessionOptions::default()).unwrap();
    suite(&mut d);
    d.set_mode(WaitMode::Adaptive(Duration::from_micros(50)));
    verified_io(&mut d, 10000, 1000, 4);
    drop(d);
    let stats = srv.stop();
    assert_eq!(stats.sessions_opened, 1);
}

/// The `virtio-drivers` crate's block driver, unmodified, on the same model: started on the
/// function, with the function's environment.
fn hosted_disk() -> (
    outboard_drivers::hosted::blk::HostedBlk,
    outboard_env::DeviceEnv,
) {
    let model = outboard_devices::virtio_blk(
        outboard_devices::backing::Backing::open(&format!("mem:{SIZE}"), None).unwrap(),
        Default::default(),
    )
    .unwrap();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    let f = outboard_hw::PciFunction::with_backend("in-process".into(), backend).unwrap();
    let env = outboard_env::DeviceEnv::for_function(&f);
    let probed = outboard_drivers::probe_driver(&outboard_drivers::Probe::Pci(&f)).unwrap();
    assert_eq!(
        probed.personality.driver, "virtio-blk",
        "the native driver still wins by default"
    );
    (
        outboard_drivers::hosted::blk::HostedBlk::start("disk0", f).unwrap(),
        env,
    )
}

#[test]
fn the_unmodified_virtio_drivers_block_driver_passes_the_suite_in_both_placements() {
    let (host, env) = hosted_disk();
    let mut d = Colocated::with_driver(Box::new(host), &env, 4 << 20).unwrap();
    suite(&mut d);
    drop(d);

    let dir = tempfile::tempdir().unwrap();
    let (host, env) = hosted_disk();
    let sock = dir.path().join("hosted.sock");
    let (stop, thread) = outboard_server::DriverHost::bind(
        &sock,
        vec![outboard_block_server::BlockDispatcher::served(host, env)],
    )
    .unwrap()
    .spawn();
    let mut d = BlockClient::open(&sock, "disk0", SessionOptions::default()).unwrap();
    suite(&mut d);
    d.set_mode(WaitMode::Adaptive(Duration::from_micros(50)));
    verified_io(&mut d, 10000, 1000, 4);
    drop(d);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    thread.join().unwrap().unwrap();
}

#[test]
fn buffers_are_mapped_into_the_device_zero_copy() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let (sock, backend) = (srv.sock.clone(), srv.backend.clone());
    let d = BlockClient::open(&sock, "disk0", SessionOptions::default()).unwrap();
    let ino = rustix::fs::fstat(d.buffers().fd().unwrap()).unwrap().st_ino;
    // The device model's own DMA map holds the client's buffer memfd itself: the device reads
    // and writes the client's memory, nothing is copied in between.
    let maps = backend.with_device(|_, ctx| ctx.dma.mappings());
    assert!(maps.iter().any(|m| m.2 == Some(ino)), "{maps:?}");
    drop(d);
    let unmapped = || {
        let maps = backend.with_device(|_, ctx| ctx.dma.mappings());
        !maps.iter().any(|m| m.2 == Some(ino))
    };
    assert!(
        common::eventually(Duration::from_secs(10), unmapped),
        "still mapped after the client left"
    );
    srv.stop();
}

#[test]
fn parallel_clients_on_disjoint_and_overlapping_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let sock = srv.sock.clone();
    let n = 4;
    // Disjoint: each client owns a range.
    let threads: Vec<_> = (0..n)
        .map(|c| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let mut d = BlockClient::open(&sock, "disk0", SessionOptions::default()).unwrap();
                verified_io(&mut d, c * 4000, 3000, 100 + c);
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    // Overlapping: everyone writes the same 64 blocks at once, 8 blocks per request, many
    // times. Each 8-block request lands whole: every 4 KiB of the result is one client's.
    let barrier = Arc::new(Barrier::new(n as usize));
    let threads: Vec<_> = (0..n)
        .map(|c| {
            let (sock, barrier) = (sock.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut d = BlockClient::open(&sock, "disk0", SessionOptions::default()).unwrap();
                barrier.wait();
                for _ in 0..20 {
                    for k in 0..8u64 {
                        d.write_blocks(20000 + k * 8, &pattern(1000 + c, 4096))
                            .unwrap();
                    }
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let mut d = BlockClient::open(&sock, "disk0", SessionOptions::default()).unwrap();
    let mut got = vec![0u8; 64 * 512];
    d.read_blocks(20000, &mut got).unwrap();
    for chunk in got.chunks(4096) {
        assert!(
            (0..n).any(|c| chunk == pattern(1000 + c, 4096).as_slice()),
            "a torn 4 KiB block"
        );
    }
    drop(d);
    let stats = srv.stop();
    assert_eq!(stats.sessions_opened, 2 * n + 1);
    assert_eq!(stats.sessions_released, 2 * n + 1);
}

#[test]
fn unknown_devices_and_bad_geometry_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let sock = srv.sock.clone();
    assert!(matches!(
        BlockClient::open(&sock, "disk9", SessionOptions::default()),
        Err(BlockError::NoSuchDevice(_))
    ));
    let bad = SessionOptions {
        depth: 3,
        ..Default::default()
    };
    assert!(matches!(
        BlockClient::open(&sock, "disk0", bad),
        Err(BlockError::Invalid(_))
    ));
    srv.stop();
}

/// A session's block lock holds back another session's write to those blocks until it is
/// released, and the held-back write then lands after the holder's (defect 8's mechanism).
#[test]
fn a_lock_orders_another_sessions_write_after_the_holders() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), "1M");
    let open = || BlockClient::open(&srv.sock, "disk0", SessionOptions::default()).unwrap();
    let (mut a, mut b) = (open(), open());
    a.lock_blocks(4, 1).unwrap();
    // B writes block 4 while A holds it: B's write waits.
    b.buffers().write(0, &[0xbb; 512]).unwrap();
    b.submit(&BlockRequest {
        op: BlockOp::Write,
        lba: 4,
        blocks: 1,
        buf_offset: 0,
        tag: 1,
    })
    .unwrap();
    b.kick().unwrap();
    let mut got = Vec::new();
    assert_eq!(
        b.wait(&mut got, Duration::from_millis(200)),
        Err(BlockError::Timeout)
    );
    // A's read-modify-write goes through under its lock, B's write lands after it.
    a.write_blocks(4, &[0xaa; 512]).unwrap();
    a.unlock_blocks(4, 1).unwrap();
    while got.is_empty() {
        b.wait(&mut got, Duration::from_secs(10)).unwrap();
    }
    assert_eq!(got[0].result, Ok(512));
    let mut back = [0u8; 512];
    a.read_blocks(4, &mut back).unwrap();
    assert_eq!(back, [0xbb; 512]);
    // Unlocking what one does not hold is an error; a dead session's locks die with it.
    assert!(matches!(a.unlock_blocks(4, 1), Err(BlockError::Invalid(_))));
    a.lock_blocks(8, 1).unwrap();
    drop(a);
    b.lock_blocks(8, 1).unwrap();
    b.unlock_blocks(8, 1).unwrap();
    drop(b);
    srv.stop();
}

/// A multi-queue device has every queue carrying I/O, and the data is right.
#[test]
fn every_queue_of_a_multi_queue_device_carries_io() {
    let (mut host, _backend) = common::disk_with_queues("4M", 4);
    assert_eq!(host.queues(), 4);
    let mem = Arc::new(outboard_shm::SharedMem::create("bufs", 256 * 4096).unwrap());
    let dma = host
        .driver()
        .function()
        .dma()
        .map_shared(mem.clone())
        .unwrap();
    let write = |i: u64| BlockRequest {
        op: BlockOp::Write,
        lba: i * 8,
        blocks: 8,
        buf_offset: i * 4096,
        tag: i,
    };
    for i in 0..256u64 {
        mem.write(i * 4096, &pattern(i, 4096)).unwrap();
    }
    let mut done = Vec::new();
    let mut run = |host: &mut VirtioBlock, reqs: Vec<BlockRequest>| {
        let mut next = 0;
        done.clear();
        while done.len() < reqs.len() {
            while next < reqs.len() && host.has_room() {
                host.submit(&reqs[next], dma.iova(), reqs[next].tag)
                    .unwrap();
                next += 1;
            }
            host.kick().unwrap();
            host.poll(&mut done).unwrap();
        }
        assert!(done.iter().all(|(_, r)| r.is_ok()), "{done:?}");
    };
    run(&mut host, (0..256).map(write).collect());
    mem.fill(0, 256 * 4096, 0).unwrap();
    run(
        &mut host,
        (0..256)
            .map(|i| BlockRequest {
                op: BlockOp::Read,
                ..write(i)
            })
            .collect(),
    );
    for i in 0..256u64 {
        let mut back = vec![0u8; 4096];
        mem.read(i * 4096, &mut back).unwrap();
        assert!(back == pattern(i, 4096), "block {i}");
    }
    let loads = host.requests_per_queue().to_vec();
    assert_eq!(loads.iter().sum::<u64>(), 512);
    assert!(
        loads.iter().all(|&n| n > 0),
        "every queue carried I/O: {loads:?}"
    );
    drop(dma);
}

/// Sessions through a driver server on a multi-queue device do verified I/O.
#[test]
fn a_driver_server_spreads_sessions_over_a_devices_queues() {
    let dir = tempfile::tempdir().unwrap();
    let (host, _backend) = common::disk_with_queues(SIZE, 4);
    let sock = dir.path().join("mq.sock");
    let (stop, t) = outboard_server::DriverHost::bind(
        &sock,
        vec![{
            let env = host.env();
            outboard_block_server::BlockDispatcher::served(host, env)
        }],
    )
    .unwrap()
    .spawn();
    let mut clients: Vec<_> = (0..3)
        .map(|_| BlockClient::open(&sock, "disk0", SessionOptions::default()).unwrap())
        .collect();
    for (i, c) in clients.iter_mut().enumerate() {
        verified_io(c, i as u64 * 2048, 256, i as u64);
    }
    drop(clients);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    t.join().unwrap().unwrap();
}

/// Defect found by QEMU's `qemu-img` through the NBD export: a request longer than the
/// device's largest segment (virtio-blk SIZE_MAX, 1 MiB for the emulated disk) went to the
/// device as one descriptor, and the driver refused it. The driver now cuts it into segments;
/// the device's largest transfer is in the status, and a longer request is refused up front.
#[test]
fn a_request_longer_than_the_devices_largest_segment_is_cut_into_segments() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let opts = SessionOptions {
        buffer_size: 64 << 20,
        ..Default::default()
    };
    let mut d = BlockClient::open(&srv.sock, "disk0", opts).unwrap();
    let max = d.info().max_transfer;
    assert!(max >= 3 << 20, "largest transfer {max}");
    let len = 3 << 20;
    let data = pattern(77, len);
    d.buffers().write(0, &data).unwrap();
    let bs = d.info().block_size as u64;
    let req = |op, tag| BlockRequest {
        op,
        lba: 8,
        blocks: (len as u64 / bs) as u32,
        buf_offset: 0,
        tag,
    };
    assert_eq!(d.execute(&req(BlockOp::Write, 1)), Ok(len as u32));
    d.buffers().fill(0, len, 0).unwrap();
    assert_eq!(d.execute(&req(BlockOp::Read, 2)), Ok(len as u32));
    let mut back = vec![0u8; len];
    d.buffers().read(0, &mut back).unwrap();
    assert!(back == data, "a segmented transfer came back different");
    // One block past the largest transfer is refused before it leaves the client.
    let mut info = d.info().clone();
    info.capacity = u64::MAX / 2;
    let mut too_long = req(BlockOp::Read, 3);
    too_long.blocks = (max as u64 / bs) as u32 + 1;
    assert!(matches!(
        outboard_block::validate(&too_long, &info, u64::MAX),
        Err(BlockError::Invalid(_))
    ));
    too_long.blocks -= 1;
    assert!(outboard_block::validate(&too_long, &info, u64::MAX).is_ok());
    drop(d);
    srv.stop();
}

/// `read_out` writes any byte range of the disk to a file straight from the buffer area:
/// unaligned starts and ends, ranges longer than the buffer area, the last byte; and refuses
/// a range past the end.
#[test]
fn read_out_writes_any_byte_range_to_a_file() {
    use std::io::{Read, Seek};
    use std::os::fd::AsFd;
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let opts = SessionOptions {
        buffer_size: 64 << 10,
        ..SessionOptions::default()
    };
    let mut d = BlockClient::open(&srv.sock, "disk0", opts).unwrap();
    let disk = pattern(42, 1 << 20);
    d.write_blocks(0, &disk).unwrap();
    let total = d.info().bytes();
    for (offset, len) in [
        (0u64, 1u64),
        (1, 511),
        (511, 2),
        (4095, 70_000),
        (100, 300_001),
        ((1 << 20) - 1, 1),
        (0, 1 << 20),
    ] {
        let mut f = tempfile::tempfile().unwrap();
        let range = d.info().byte_range(offset, len).unwrap();
        d.read_out(range, f.as_fd()).unwrap();
        f.rewind().unwrap();
        let mut got = Vec::new();
        f.read_to_end(&mut got).unwrap();
        assert_eq!(got.len() as u64, len, "{offset}+{len}");
        assert!(
            got == disk[offset as usize..(offset + len) as usize],
            "{offset}+{len}: the bytes differ"
        );
    }
    assert_eq!(
        d.info().byte_range(total - 1, 2),
        Err(outboard_block::BlockError::OutOfRange)
    );
    assert_eq!(
        d.info().byte_range(u64::MAX, 2),
        Err(outboard_block::BlockError::OutOfRange)
    );
    drop(d);
    srv.stop();
}
