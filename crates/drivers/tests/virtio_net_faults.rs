//! The virtio-net driver against a NIC model with faults injected, one kind at a time: a frame
//! the device describes wrongly is dropped and counted, never handed on cut or padded; a
//! completion naming no buffer stops the device with a reason; interrupts lost, doubled or
//! invented, and a device that stalls, lose nothing (the test polls as a busy server does, and
//! checks that each fault fired; that the server's loop wakes without the lost interrupt is
//! the transport's own test); a link that flaps is seen going down and
//! coming back. Two NICs on one wire in one process, as in `virtio_net_in_process.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_devices::faults::{lock, Fault, FaultHandle};
use outboard_devices::virtio_net::{NetOptions, VirtioNet as NetModel, Wire};
use outboard_devices::virtio_pci::{VirtioDevice, VirtioPci};
use outboard_devices::virtio_rng::Seeded;
use outboard_drivers::virtio_net::VirtioNet;
use outboard_hw::backend::in_process::InProcess;
use outboard_hw::PciFunction;

struct Nic {
    driver: VirtioNet,
    backend: Arc<InProcess>,
    faults: FaultHandle,
}

fn pair() -> (Nic, Nic) {
    let (a, b) = Wire::pair().unwrap();
    let nic = |last, wire| {
        let opts = NetOptions {
            mac: [2, 0, 0, 0, 0, last],
            mtu: 1500,
            link_up: true,
        };
        let model = VirtioPci::new(NetModel::new(opts, Some(wire))).unwrap();
        let faults = model.device().faults();
        let backend = Arc::new(InProcess::new(Box::new(model)));
        let func = PciFunction::with_backend("in-process".into(), backend.clone()).unwrap();
        Nic {
            driver: VirtioNet::new("nic", func).unwrap(),
            backend,
            faults,
        }
    };
    (nic(1, a), nic(2, b))
}

fn arm(nic: &Nic, fault: &str) {
    let f: Fault = fault.parse().unwrap();
    lock(&nic.faults).check(&f).unwrap();
    lock(&nic.faults).arm(f);
}

/// A frame of `len` bytes of the seeded stream `seed`.
fn frame(len: usize, seed: u64) -> Vec<u8> {
    let mut f = vec![0u8; len];
    Seeded::new(seed).fill(&mut f);
    f
}

/// Frames received by `to`, pumping its wire until `n` came or a second passed.
fn receive(to: &mut Nic, n: usize) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    let until = Instant::now() + Duration::from_secs(1);
    while got.len() < n && Instant::now() < until {
        to.backend.pump_input();
        to.driver.recv(&mut got).unwrap();
    }
    got
}

/// Sends `count` frames of assorted sizes (seeds from `seed`) one batch at a time.
fn frames(count: usize, seed: u64) -> Vec<Vec<u8>> {
    (0..count)
        .map(|i| frame(60 + (i * 331) % 1455, seed + i as u64))
        .collect()
}

fn send_all(from: &mut Nic, frames: &[Vec<u8>]) {
    for f in frames {
        assert_eq!(from.driver.send(&[f]).unwrap(), 1);
    }
}

/// `got` is `sent` with exactly the frames at `missing` left out, each whole and in order.
fn assert_sent_less(got: &[Vec<u8>], sent: &[Vec<u8>], missing: &[usize]) {
    let want: Vec<&Vec<u8>> = sent
        .iter()
        .enumerate()
        .filter(|(i, _)| !missing.contains(i))
        .map(|(_, f)| f)
        .collect();
    assert_eq!(got.len(), want.len(), "frames received");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g == w, "frame {i}: {} bytes for {}", g.len(), w.len());
    }
}

#[test]
fn a_frame_claimed_longer_than_its_buffer_is_dropped_and_counted_and_the_rest_flow() {
    let (mut a, mut b) = pair();
    arm(&b, "long-frame=1");
    let sent = frames(8, 10);
    send_all(&mut a, &sent);
    let got = receive(&mut b, 7);
    assert_sent_less(&got, &sent, &[0]);
    assert_eq!(b.driver.stats().rx_errors, 1);
    // Its buffers went back: the queue does not shrink by a fault.
    let more = frames(300, 1000);
    for chunk in more.chunks(30) {
        send_all(&mut a, chunk);
        assert_sent_less(&receive(&mut b, chunk.len()), chunk, &[]);
    }
}

#[test]
fn a_receive_completion_claiming_no_bytes_is_dropped_and_counted() {
    let (mut a, mut b) = pair();
    // The fault is fired at the receive queue's next notification (the driver posting
    // buffers again) and corrupts the completion after it.
    send_all(&mut a, &frames(1, 1));
    assert_eq!(receive(&mut b, 1).len(), 1);
    arm(&b, "corrupt-used=len");
    send_all(&mut a, &frames(1, 2));
    assert_eq!(
        receive(&mut b, 1).len(),
        1,
        "the fault fires when buffers are posted"
    );
    let sent = frames(5, 3);
    send_all(&mut a, &sent);
    let got = receive(&mut b, 4);
    assert_sent_less(&got, &sent, &[0]);
    assert_eq!(b.driver.stats().rx_errors, 1);
}

#[test]
fn a_completion_naming_no_buffer_in_flight_is_a_device_error() {
    let (mut a, mut b) = pair();
    send_all(&mut a, &frames(1, 1));
    assert_eq!(receive(&mut b, 1).len(), 1);
    arm(&b, "corrupt-used=id");
    send_all(&mut a, &frames(1, 2));
    assert_eq!(receive(&mut b, 1).len(), 1);
    send_all(&mut a, &frames(1, 3));
    b.backend.pump_input();
    let mut got = Vec::new();
    match b.driver.recv(&mut got) {
        Err(e) => assert!(e.to_string().contains("not in flight"), "{e}"),
        Ok(n) => panic!("a completion for no buffer was taken as {n} frames"),
    }
    assert!(got.is_empty(), "nothing was handed on");
    // On the transmit side too: the sender finds out at its next send.
    arm(&a, "corrupt-used=id");
    let first = a.driver.send(&[&frame(100, 4)]);
    let second = a.driver.send(&[&frame(100, 5)]);
    let err = first
        .err()
        .or(second.err())
        .expect("a transmit completion for no chain was noticed");
    assert!(err.to_string().contains("not in flight"), "{err}");
}

#[test]
fn lost_doubled_and_invented_interrupts_and_a_stall_lose_no_frame() {
    use outboard_env::{DeviceEvent, Driver};
    let (mut a, mut b) = pair();
    for (i, fault) in [
        "drop-irq=3",
        "duplicate-irq=3",
        "spurious-irq=3",
        "stall=150ms",
    ]
    .into_iter()
    .enumerate()
    {
        arm(&b, fault);
        arm(&a, fault);
        let t = Instant::now();
        let sent = frames(20, 100 * i as u64);
        send_all(&mut a, &sent);
        b.backend.pump_input();
        // The server handles whatever interrupt came, with or without anything behind it.
        for q in 0..2 {
            for nic in [&mut a, &mut b] {
                Driver::handle(&mut nic.driver, DeviceEvent::Interrupt(q)).unwrap();
            }
        }
        assert_sent_less(&receive(&mut b, sent.len()), &sent, &[]);
        // The fault fired (a fault is spent as it fires; interrupts the driver suppressed
        // never come, so not every one armed does): the frames came through it.
        let left: u32 = [&a, &b]
            .iter()
            .map(|nic| {
                let f = lock(&nic.faults);
                f.drop_irqs + f.duplicate_irqs + f.spurious_irqs + u32::from(f.stall.is_some())
            })
            .sum();
        let armed = if fault.starts_with("stall") { 2 } else { 6 };
        assert!(left < armed, "{fault} never fired");
        for nic in [&a, &b] {
            arm(nic, "clear");
        }
        if fault.starts_with("stall") {
            assert!(
                t.elapsed() >= Duration::from_millis(150),
                "{:?}",
                t.elapsed()
            );
        }
    }
    assert_eq!(a.driver.stats().rx_errors + b.driver.stats().rx_errors, 0);
}

#[test]
fn a_link_flap_is_seen_down_then_up_and_frames_flow_after_it() {
    use outboard_env::{DeviceEvent, Driver};
    let (mut a, mut b) = pair();
    arm(&b, "link-flap=200ms");
    // The flap starts at the device's next notification.
    send_all(&mut a, &frames(1, 1));
    assert_eq!(receive(&mut b, 1).len(), 1);
    let down = outboard_sys::wait::eventually(Duration::from_secs(5), || {
        b.backend.pump_input();
        !b.driver.link_up().unwrap()
    });
    assert!(down, "the link went down");
    // The driver learns it through the configuration interrupt, as a server would.
    b.driver.handle(DeviceEvent::ConfigChange).unwrap();
    assert!(!outboard_net::NetDriver::info(&b.driver).link_up);
    let up = outboard_sys::wait::eventually(Duration::from_secs(5), || {
        b.backend.pump_input();
        b.driver.link_up().unwrap()
    });
    assert!(up, "the link came back");
    b.driver.handle(DeviceEvent::ConfigChange).unwrap();
    assert!(outboard_net::NetDriver::info(&b.driver).link_up);
    let sent = frames(10, 50);
    send_all(&mut a, &sent);
    assert_sent_less(&receive(&mut b, sent.len()), &sent, &[]);
}

#[test]
fn a_nic_that_needs_a_reset_fails_the_driver_with_the_reason() {
    use outboard_env::{DeviceEvent, Driver};
    let (mut a, mut b) = pair();
    send_all(&mut a, &frames(1, 1));
    assert_eq!(receive(&mut b, 1).len(), 1);
    arm(&b, "needs-reset");
    send_all(&mut a, &frames(1, 2));
    receive(&mut b, 1);
    match b.driver.handle(DeviceEvent::ConfigChange) {
        Err(f) => assert!(matches!(f, outboard_env::Failure::NeedsReset), "{f}"),
        Ok(()) => panic!("a device that needs a reset went on"),
    }
}
