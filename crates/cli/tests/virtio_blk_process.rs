//! The virtio-blk driver drives the device model running as a separate process over vfio-user.

mod common;

use std::os::unix::fs::FileExt;

use common::{pattern, DeviceProcess};
use outboard_drivers::virtio_blk::{BlkDriverOptions, BlkOp, BlkRequest, VirtioBlk};
use outboard_hw::{DeviceSpec, PciFunction};

const DISK: u64 = 16 << 20;

/// Runs `outboard ARGS… PATH` (the bring-up tools take the socket last).
fn outboard(args: &[&str], path: impl AsRef<std::path::Path>) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_outboard"))
        .args(args)
        .arg(path.as_ref())
        .output()
        .unwrap()
}

fn open(dev: &DeviceProcess) -> VirtioBlk {
    let f = PciFunction::open(&DeviceSpec::VfioUser(dev.socket.clone())).expect("open device");
    VirtioBlk::new(f, BlkDriverOptions::default()).expect("bring up")
}

#[test]
fn patterns_across_a_file_backed_disk_reach_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    let dev = DeviceProcess::virtio_blk(dir.path(), img.to_str().unwrap(), &["--create", "16M"]);
    let mut d = open(&dev);
    assert_eq!(d.info().capacity * 512, DISK);

    // Requests of 1..=128 sectors at scattered places, up to 64 in flight at once.
    let mut plan = Vec::new();
    let mut sector = 0u64;
    let mut i = 0u64;
    while sector < DISK / 512 {
        let sectors = [1u64, 8, 3, 128, 16, 64, 2, 32][i as usize % 8];
        let sectors = sectors.min(DISK / 512 - sector);
        plan.push((sector, sectors));
        sector += sectors + (i % 5) * 7;
        i += 1;
    }
    let buf = d.function().dma().alloc(64 * 65536).unwrap();
    let reqs = |op: BlkOp, chunk: &[(u64, u64)]| -> Vec<BlkRequest> {
        chunk
            .iter()
            .enumerate()
            .map(|(slot, &(sector, sectors))| BlkRequest {
                op,
                sector,
                bufs: vec![(
                    buf.iova_at(slot as u64 * 65536, sectors * 512).unwrap(),
                    (sectors * 512) as u32,
                )],
                tag: slot as u64,
            })
            .collect()
    };
    for chunk in plan.chunks(64) {
        for (slot, &(sector, sectors)) in chunk.iter().enumerate() {
            buf.write(
                slot as u64 * 65536,
                &pattern(sector, (sectors * 512) as usize),
            )
            .unwrap();
        }
        let done = d.execute_batch(0, &reqs(BlkOp::Write, chunk), 64).unwrap();
        assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    }
    d.flush().unwrap();

    // Read everything back through the driver, many in flight.
    for chunk in plan.chunks(64) {
        buf.fill(0, 64 * 65536, 0).unwrap();
        let done = d.execute_batch(0, &reqs(BlkOp::Read, chunk), 64).unwrap();
        assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
        for (slot, &(sector, sectors)) in chunk.iter().enumerate() {
            let mut got = vec![0u8; (sectors * 512) as usize];
            buf.read(slot as u64 * 65536, &mut got).unwrap();
            assert!(
                got == pattern(sector, got.len()),
                "sector {sector} x {sectors} differs"
            );
        }
    }

    // The backing file holds the same bytes, read independently of Outboard.
    let file = std::fs::File::open(&img).unwrap();
    for &(sector, sectors) in &plan {
        let mut got = vec![0u8; (sectors * 512) as usize];
        file.read_exact_at(&mut got, sector * 512).unwrap();
        assert!(
            got == pattern(sector, got.len()),
            "file differs at sector {sector}"
        );
    }
    drop(d);
    assert!(dev.terminate().success());
}

#[test]
fn a_restarted_driver_reconnects_and_finds_a_reset_device() {
    let dir = tempfile::tempdir().unwrap();
    let mut dev = DeviceProcess::virtio_blk(dir.path(), "mem:4M", &[]);
    let mut d = open(&dev);
    let buf = d.function().dma().alloc(4096).unwrap();
    buf.write(0, &pattern(7, 4096)).unwrap();
    d.write(100, &buf, 0, 4096).unwrap();
    drop(buf);
    drop(d); // the connection closes with the device running

    // The device was reset when the old driver went away: status reads 0 before anyone
    // touches it, so the new driver starts from power-on state.
    let f = PciFunction::open(&DeviceSpec::VfioUser(dev.socket.clone())).unwrap();
    let t = outboard_drivers::virtio::Transport::new(&f).unwrap();
    assert!(t.status().unwrap().is_empty());
    drop(t);
    drop(f);

    let mut d = open(&dev);
    let buf = d.function().dma().alloc(4096).unwrap();
    d.read(100, &buf, 0, 4096).unwrap();
    let mut got = vec![0u8; 4096];
    buf.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(7, 4096), "data survives a driver reconnect");
    assert!(dev.alive());
}

#[test]
fn the_bring_up_tools_work_on_a_device_process() {
    let dir = tempfile::tempdir().unwrap();
    let dev = DeviceProcess::virtio_blk(dir.path(), "mem:8M", &[]);
    let out = outboard(&["hw", "probe", "--vfio-user"], &dev.socket);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1af4:1042"), "{text}");
    assert!(text.contains("driver: virtio-blk"), "{text}");
    assert!(text.contains("virtio notify BAR0+0x3000"), "{text}");
    assert!(text.contains("MSI-X 2"), "{text}");
    assert!(text.contains("VERSION_1"), "{text}");

    let out = outboard(&["hw", "selftest", "--write", "--vfio-user"], &dev.socket);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("read back, compare"), "{text}");
    assert!(text.contains("selftest passed"), "{text}");
}

#[test]
fn selftest_and_probe_explain_what_they_cannot_do() {
    // A read-only disk passes the read-only self-test and says why it skipped the write test.
    let dir = tempfile::tempdir().unwrap();
    let dev = DeviceProcess::virtio_blk(dir.path(), "mem:1M", &["--read-only"]);
    let out = outboard(&["hw", "selftest", "--write", "--vfio-user"], &dev.socket);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("the disk is read-only"), "{text}");
    // A socket nobody serves is a clear error, not a hang.
    let out = outboard(
        &["hw", "probe", "--vfio-user"],
        dir.path().join("nothing.sock"),
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot connect"));
}

/// Every device model runs standalone with the same options (vfio-user interop issue): the
/// null-blk model is a virtio-blk disk that reads zeros and drops writes, with faults too.
#[test]
fn the_null_blk_model_runs_standalone() {
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_outboard"))
        .args(["device", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("virtio-blk") && help.contains("null-blk"),
        "{help}"
    );
    let dir = tempfile::tempdir().unwrap();
    let dev = DeviceProcess::model(
        dir.path(),
        "null-blk",
        "null:64M",
        &["--fault", "drop-irq=1"],
    );
    let out = outboard(&["hw", "probe", "--vfio-user"], &dev.socket);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1af4:1042"), "{text}");
    let mut d = open(&dev);
    assert_eq!(d.info().capacity, (64 << 20) / 512);
    let buf = d.function().dma().alloc(4096).unwrap();
    buf.write(0, &[0xaa; 4096]).unwrap();
    d.write(0, &buf, 0, 4096).unwrap();
    d.read(0, &buf, 0, 4096).unwrap();
    let mut back = [1u8; 4096];
    buf.read(0, &mut back).unwrap();
    assert_eq!(
        back, [0u8; 4096],
        "a null disk reads zeros whatever was written"
    );
    drop(d);
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_outboard"))
        .args(["device", "null-blk", "--backing", "mem:1M", "--socket"])
        .arg(dir.path().join("x.sock"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("null:SIZE"));
}
