//! The virtio-blk driver against a device model with faults injected, one kind at a time: it
//! returns a specific error or recovers, never hangs past its deadline, never panics, never
//! completes a request with wrong data. (The crash fault ends a process; it is exercised
//! through `outboard up` in the CLI's fault campaign.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_devices::backing::Backing;
use outboard_devices::faults::{lock, Fault, FaultHandle};
use outboard_drivers::virtio_blk::{BlkDriverOptions, BlkError, VirtioBlk};
use outboard_hw::backend::in_process::InProcess;
use outboard_hw::{DmaBuf, PciFunction};

fn disk() -> (VirtioBlk, FaultHandle, DmaBuf) {
    let model =
        outboard_devices::virtio_blk(Backing::open("mem:1M", None).unwrap(), Default::default())
            .unwrap();
    let faults = model.device().faults();
    let f = PciFunction::with_backend(
        "in-process".into(),
        Arc::new(InProcess::new(Box::new(model))),
    )
    .unwrap();
    let opts = BlkDriverOptions {
        timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let d = VirtioBlk::new(f, opts).unwrap();
    let buf = d.function().dma().alloc(8192).unwrap();
    (d, faults, buf)
}

/// Writes a pattern to sectors 0..8 and returns it.
fn seed(d: &mut VirtioBlk, buf: &DmaBuf) -> Vec<u8> {
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    buf.write(0, &data).unwrap();
    d.write(0, buf, 0, 4096).unwrap();
    data
}

/// Reads sectors 0..8 back into a cleared buffer.
fn read_back(d: &mut VirtioBlk, buf: &DmaBuf) -> Result<Vec<u8>, BlkError> {
    buf.fill(0, 4096, 0).unwrap();
    d.read(0, buf, 0, 4096)?;
    let mut v = vec![0u8; 4096];
    buf.read(0, &mut v).unwrap();
    Ok(v)
}

fn arm(f: &FaultHandle, s: &str) {
    lock(f).arm(s.parse::<Fault>().unwrap());
}

#[test]
fn injected_errors_fail_exactly_the_requests_they_hit() {
    let (mut d, f, buf) = disk();
    let data = seed(&mut d, &buf);
    arm(&f, "error-next=2");
    assert!(matches!(read_back(&mut d, &buf), Err(BlkError::Io)));
    assert!(matches!(read_back(&mut d, &buf), Err(BlkError::Io)));
    assert_eq!(read_back(&mut d, &buf).unwrap(), data);
    arm(&f, "error=4-5");
    assert!(matches!(read_back(&mut d, &buf), Err(BlkError::Io)));
    arm(&f, "clear");
    assert_eq!(read_back(&mut d, &buf).unwrap(), data);
}

#[test]
fn lost_duplicate_and_spurious_interrupts_change_nothing() {
    let (mut d, f, buf) = disk();
    let data = seed(&mut d, &buf);
    for fault in ["drop-irq=3", "duplicate-irq=3", "spurious-irq=3"] {
        arm(&f, fault);
        for _ in 0..4 {
            let t = Instant::now();
            assert_eq!(read_back(&mut d, &buf).unwrap(), data, "{fault}");
            assert!(
                t.elapsed() < Duration::from_millis(500),
                "{fault}: waited a deadline"
            );
        }
    }
}

#[test]
fn a_used_entry_with_a_short_length_fails_that_request_only() {
    let (mut d, f, buf) = disk();
    let data = seed(&mut d, &buf);
    arm(&f, "corrupt-used=len");
    match read_back(&mut d, &buf) {
        Err(BlkError::Device(m)) => assert!(m.contains("short transfer"), "{m}"),
        other => panic!("a short transfer was reported as {other:?}"),
    }
    assert_eq!(read_back(&mut d, &buf).unwrap(), data);
}

#[test]
fn a_used_entry_naming_no_request_is_a_device_error() {
    let (mut d, f, buf) = disk();
    seed(&mut d, &buf);
    arm(&f, "corrupt-used=id");
    match read_back(&mut d, &buf) {
        Err(BlkError::Device(m)) => assert!(m.contains("not in flight"), "{m}"),
        other => panic!("a bogus completion was reported as {other:?}"),
    }
}

#[test]
fn a_device_that_needs_a_reset_says_so_and_nothing_waits_past_the_deadline() {
    let (mut d, f, buf) = disk();
    seed(&mut d, &buf);
    assert!(!d.needs_reset().unwrap());
    arm(&f, "needs-reset");
    let t = Instant::now();
    // The configuration interrupt says why at once, well before the request's deadline.
    match read_back(&mut d, &buf) {
        Err(BlkError::Device(m)) => assert!(m.contains("needs a reset"), "{m}"),
        other => panic!("a device needing a reset was reported as {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_millis(500));
    assert!(d.needs_reset().unwrap());
}

#[test]
fn a_stalled_device_delays_and_then_answers_correctly() {
    let (mut d, f, buf) = disk();
    let data = seed(&mut d, &buf);
    arm(&f, "stall=200ms");
    let t = Instant::now();
    assert_eq!(read_back(&mut d, &buf).unwrap(), data);
    assert!(t.elapsed() >= Duration::from_millis(200));
}
