//! The virtio-blk driver against the virtio-blk device model, in one process (deterministic).

use std::sync::Arc;

use outboard_devices::backing::Backing;
use outboard_devices::virtio_blk::{BlkOptions, FaultHandle};
use outboard_drivers::virtio_blk::{BlkDriverOptions, BlkError, BlkOp, BlkRequest, VirtioBlk};
use outboard_hw::backend::in_process::InProcess;
use outboard_hw::PciFunction;

/// A memory-backed disk in-process, its driver, the device's fault handle and the backend
/// (to reach into the device like a bus analyser).
fn disk_with(
    size: &str,
    opts: BlkOptions,
    driver: BlkDriverOptions,
) -> (VirtioBlk, FaultHandle, Arc<InProcess>) {
    let model =
        outboard_devices::virtio_blk(Backing::open(&format!("mem:{size}"), None).unwrap(), opts)
            .unwrap();
    let faults = model.device().faults();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    let func = PciFunction::with_backend("in-process".into(), backend.clone()).unwrap();
    (VirtioBlk::new(func, driver).unwrap(), faults, backend)
}

fn disk(size: &str, opts: BlkOptions) -> (VirtioBlk, FaultHandle) {
    let (d, f, _) = disk_with(size, opts, BlkDriverOptions::default());
    (d, f)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) >> 1) as u8)
        .collect()
}

#[test]
fn negotiates_and_reports_geometry() {
    let (d, _) = disk("1M", BlkOptions::default());
    let info = d.info();
    assert_eq!(info.capacity, 2048);
    assert_eq!(info.block_size, 512);
    assert!(!info.read_only);
    assert!(info.msix);
    assert_eq!(info.queue_size, 256);
    use outboard_spec::virtio::feature;
    assert_ne!(info.features & feature::RING_EVENT_IDX, 0);
    assert_ne!(info.features & feature::RING_INDIRECT_DESC, 0);
}

#[test]
fn write_then_read_back_single_and_multi_block() {
    let (mut d, _) = disk("4M", BlkOptions::default());
    let buf = d.function().dma().alloc(1 << 20).unwrap();
    for (sector, len) in [(0u64, 512u32), (7, 4096), (100, 65536), (8191 - 127, 65536)] {
        let data = pattern(sector, len as usize);
        buf.write(0, &data).unwrap();
        assert_eq!(d.write(sector, &buf, 0, len).unwrap(), len as u64);
        buf.fill(0, len as usize, 0).unwrap();
        d.read(sector, &buf, 0, len).unwrap();
        let mut back = vec![0u8; len as usize];
        buf.read(0, &mut back).unwrap();
        assert_eq!(back, data, "sector {sector} len {len}");
    }
    d.flush().unwrap();
    assert_eq!(d.device_id().unwrap(), "outboard-blk");
}

#[test]
fn many_requests_in_flight_complete_with_their_tags() {
    let (mut d, _) = disk("8M", BlkOptions::default());
    let buf = d.function().dma().alloc(256 * 4096).unwrap();
    for i in 0..256u64 {
        buf.write(i * 4096, &pattern(i, 4096)).unwrap();
    }
    for i in 0..256u64 {
        let r = BlkRequest {
            op: BlkOp::Write,
            sector: i * 8,
            bufs: vec![(buf.iova_at(i * 4096, 4096).unwrap(), 4096)],
            tag: i,
        };
        d.submit(0, &r).unwrap();
    }
    // The queue is full now: one more is refused, not lost.
    let extra = BlkRequest {
        op: BlkOp::Flush,
        sector: 0,
        bufs: vec![],
        tag: 999,
    };
    assert_eq!(d.submit(0, &extra), Err(BlkError::QueueFull));
    d.kick(0).unwrap();
    let mut done = Vec::new();
    while done.len() < 256 {
        d.wait(0, &mut done, std::time::Duration::from_secs(5))
            .unwrap();
    }
    let mut tags: Vec<u64> = done.iter().map(|c| c.tag).collect();
    tags.sort();
    assert_eq!(tags, (0..256).collect::<Vec<_>>());
    assert!(done.iter().all(|c| c.result == Ok(4096)));
    buf.fill(0, 256 * 4096, 0).unwrap();
    for i in 0..256u64 {
        d.read(i * 8, &buf, i * 4096, 4096).unwrap();
        let mut back = vec![0u8; 4096];
        buf.read(i * 4096, &mut back).unwrap();
        assert_eq!(back, pattern(i, 4096));
    }
}

#[test]
fn errors_are_specific() {
    let (mut d, faults) = disk("1M", BlkOptions::default());
    let buf = d.function().dma().alloc(8192).unwrap();
    assert!(matches!(
        d.read(2048, &buf, 0, 512),
        Err(BlkError::OutOfRange { .. })
    ));
    assert!(matches!(
        d.read(2047, &buf, 0, 1024),
        Err(BlkError::OutOfRange { .. })
    ));
    assert!(matches!(d.read(0, &buf, 0, 100), Err(BlkError::Invalid(_))));
    assert!(matches!(
        d.read(0, &buf, 8000, 512),
        Err(BlkError::Invalid(_))
    ));
    // A device-side failure on a sector range comes back as an I/O error.
    faults.lock().unwrap().fail_sectors = Some(10..20);
    assert_eq!(d.read(12, &buf, 0, 512), Err(BlkError::Io));
    assert_eq!(d.read(20, &buf, 0, 512), Ok(512));
}

#[test]
fn dma_outside_the_map_is_an_io_error_not_a_crash() {
    let (mut d, _) = disk("1M", BlkOptions::default());
    let r = BlkRequest {
        op: BlkOp::Read,
        sector: 0,
        bufs: vec![(0xdead_0000, 512)],
        tag: 1,
    };
    assert_eq!(d.execute(r), Err(BlkError::Io));
    // The device keeps serving.
    let buf = d.function().dma().alloc(4096).unwrap();
    assert_eq!(d.read(0, &buf, 0, 512), Ok(512));
}

#[test]
fn read_only_disk_refuses_writes() {
    let (mut d, _) = disk(
        "1M",
        BlkOptions {
            read_only: true,
            ..Default::default()
        },
    );
    assert!(d.info().read_only);
    let buf = d.function().dma().alloc(4096).unwrap();
    assert_eq!(d.write(0, &buf, 0, 512), Err(BlkError::ReadOnly));
}

#[test]
fn discard_and_write_zeroes_zero_the_range() {
    let (mut d, _) = disk("1M", BlkOptions::default());
    let buf = d.function().dma().alloc(8192).unwrap();
    buf.fill(0, 8192, 0xaa).unwrap();
    d.write(0, &buf, 0, 8192).unwrap();
    d.execute(BlkRequest {
        op: BlkOp::WriteZeroes { sectors: 8 },
        sector: 0,
        bufs: vec![],
        tag: 0,
    })
    .unwrap();
    d.execute(BlkRequest {
        op: BlkOp::Discard { sectors: 8 },
        sector: 8,
        bufs: vec![],
        tag: 0,
    })
    .unwrap();
    d.read(0, &buf, 0, 8192).unwrap();
    let mut back = vec![1u8; 8192];
    buf.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0));
}

#[test]
fn dropping_the_driver_resets_the_device_before_releasing_memory() {
    let (mut d, _, backend) = disk_with("1M", BlkOptions::default(), BlkDriverOptions::default());
    let buf = d.function().dma().alloc(4096).unwrap();
    d.read(0, &buf, 0, 512).unwrap();
    drop(buf);
    drop(d);
    // Had the rings been unmapped under a live queue, the device would have set
    // DEVICE_NEEDS_RESET; instead it was reset first and reads as freshly powered on.
    let func = PciFunction::with_backend("in-process".into(), backend.clone()).unwrap();
    let t = outboard_drivers::virtio::Transport::new(&func).unwrap();
    assert!(
        t.status().unwrap().is_empty(),
        "status {:?}",
        t.status().unwrap()
    );
    backend.with_device(|_, ctx| assert!(ctx.dma.is_empty(), "every DMA mapping was released"));
}

#[test]
fn two_queues_carry_independent_io() {
    let two = BlkOptions {
        num_queues: 2,
        ..Default::default()
    };
    let (mut d, _, _) = disk_with(
        "2M",
        two,
        BlkDriverOptions {
            queues: 2,
            ..Default::default()
        },
    );
    assert_eq!(d.info().queues, 2);
    let buf = d.function().dma().alloc(2 * 4096).unwrap();
    for q in 0..2u64 {
        buf.write(q * 4096, &pattern(q + 40, 4096)).unwrap();
        let r = BlkRequest {
            op: BlkOp::Write,
            sector: q * 64,
            bufs: vec![(buf.iova_at(q * 4096, 4096).unwrap(), 4096)],
            tag: q,
        };
        d.submit(q as usize, &r).unwrap();
    }
    d.kick(0).unwrap();
    d.kick(1).unwrap();
    for q in 0..2 {
        let mut out = Vec::new();
        d.wait(q, &mut out, std::time::Duration::from_secs(5))
            .unwrap();
        assert_eq!(
            out,
            vec![outboard_drivers::virtio_blk::BlkCompletion {
                tag: q as u64,
                result: Ok(4096)
            }]
        );
    }
    buf.fill(0, 8192, 0).unwrap();
    d.read(64, &buf, 0, 4096).unwrap();
    let mut got = vec![0u8; 4096];
    buf.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(41, 4096), "queue 1's write landed");
}

#[test]
fn ring_indices_wrap_around() {
    let (mut d, _) = disk("1M", BlkOptions::default());
    let buf = d.function().dma().alloc(4096).unwrap();
    // 70,000 requests move both sides' free-running 16-bit indices past 65,535.
    for i in 0..70_000u32 {
        let sector = (i % 2048) as u64;
        if i % 10_000 == 0 {
            buf.write(0, &pattern(i as u64, 512)).unwrap();
            d.write(sector, &buf, 0, 512).unwrap();
            buf.fill(0, 512, 0).unwrap();
            d.read(sector, &buf, 0, 512).unwrap();
            let mut got = vec![0u8; 512];
            buf.read(0, &mut got).unwrap();
            assert_eq!(got, pattern(i as u64, 512), "at request {i}");
        } else {
            d.read(sector, &buf, 0, 512).unwrap();
        }
    }
}

#[test]
fn a_device_returning_a_bogus_descriptor_is_an_error_not_a_panic() {
    let (mut d, _, backend) = disk_with("1M", BlkOptions::default(), BlkDriverOptions::default());
    let buf = d.function().dma().alloc(4096).unwrap();
    d.read(0, &buf, 0, 512).unwrap();
    // Play a broken device: publish a used element naming descriptor 200, which is not in
    // flight.
    let (_, _, used) = d.queue_rings(0).unwrap();
    let corrupted = backend.with_device(|_, ctx| {
        let (mem, off) = ctx.dma.translate(used, 24, true).unwrap();
        assert_eq!(
            mem.read_u16(off + 2).unwrap(),
            1,
            "one request completed so far"
        );
        mem.write_u32(off + 4 + 8, 200).unwrap(); // used.ring[1].id
        mem.write_u16(off + 2, 2).unwrap(); // used.idx
        true
    });
    assert!(corrupted, "found the used ring");
    let mut out = Vec::new();
    let err = d.poll(0, &mut out).unwrap_err();
    assert!(
        matches!(err, BlkError::Device(ref m) if m.contains("not in flight")),
        "{err}"
    );
}

/// A client's memory the device reaches through DMA: a memfd the client still holds.
fn client_memfd(sealable: bool, len: u64) -> (Arc<outboard_shm::SharedMem>, std::os::fd::OwnedFd) {
    use rustix::fs::MemfdFlags;
    let flags = if sealable {
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING
    } else {
        MemfdFlags::CLOEXEC
    };
    let fd = rustix::fs::memfd_create("client", flags).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    let keep = fd.try_clone().unwrap();
    let mem =
        outboard_shm::SharedMem::map_owned(fd, 0, len as usize, outboard_shm::Access::ReadWrite)
            .unwrap();
    (Arc::new(mem), keep)
}

/// Reliability defect 3: DMA_MAP a memfd, shrink it to 0, ring a doorbell: the device model
/// died of SIGBUS. Now the model seals what it maps, and guards what it cannot seal.
#[test]
fn memory_its_owner_shrinks_cannot_kill_the_device_model() {
    let (mut d, _) = disk("1M", BlkOptions::default());
    // A sealable memfd: once the device maps it, its owner can no longer shrink it.
    let (mem, owner) = client_memfd(true, 65536);
    let buf = d.function().dma().map_shared(mem).unwrap();
    d.write(0, &buf, 0, 4096).unwrap();
    assert_eq!(
        rustix::fs::ftruncate(&owner, 0),
        Err(rustix::io::Errno::PERM)
    );
    d.read(0, &buf, 0, 4096).unwrap();

    // A memfd that cannot be sealed: shrinking it fails the request that touches it, with an
    // I/O error, and nothing else.
    let (mem, owner) = client_memfd(false, 65536);
    let bad = d.function().dma().map_shared(mem).unwrap();
    d.write(8, &bad, 0, 4096).unwrap();
    rustix::fs::ftruncate(&owner, 0).unwrap();
    assert!(matches!(d.read(8, &bad, 0, 4096), Err(BlkError::Io)));
    assert!(matches!(d.write(8, &bad, 0, 4096), Err(BlkError::Io)));
    // The device model lives on and serves healthy memory.
    let good = d.function().dma().alloc(4096).unwrap();
    good.write(0, b"after").unwrap();
    d.write(16, &good, 0, 512).unwrap();
    good.fill(0, 512, 0).unwrap();
    d.read(16, &good, 0, 512).unwrap();
    let mut back = [0u8; 5];
    good.read(0, &mut back).unwrap();
    assert_eq!(&back, b"after");
}

/// Matching runs the active probe on the real model: the modern virtio-pci structures are
/// found inside its BARs, and virtio-blk claims it with its full score.
#[test]
fn the_probe_of_a_modern_virtio_blk_model_claims_it() {
    let model = outboard_devices::virtio_blk(
        Backing::open("mem:1M", None).unwrap(),
        BlkOptions::default(),
    )
    .unwrap();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    let func = PciFunction::with_backend("in-process".into(), backend).unwrap();
    let p = outboard_drivers::probe_driver(&outboard_drivers::Probe::Pci(&func)).unwrap();
    assert_eq!(p.personality.driver, "virtio-blk");
    assert_eq!(p.score, 1000);
    // The probe only looked: the driver still brings the device up.
    VirtioBlk::new(func, BlkDriverOptions::default()).unwrap();
}
