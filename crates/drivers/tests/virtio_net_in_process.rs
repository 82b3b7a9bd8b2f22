//! The virtio-net driver against the virtio-net device model, two NICs on one wire, in one
//! process (deterministic: a doorbell write has been served when it returns, and the test
//! pumps each model's wire as its server would).

use std::sync::Arc;

use outboard_devices::virtio_net::{NetOptions, VirtioNet as NetModel, Wire};
use outboard_devices::virtio_pci::VirtioPci;
use outboard_devices::virtio_rng::Seeded;
use outboard_drivers::virtio_net::VirtioNet;
use outboard_hw::backend::in_process::InProcess;
use outboard_hw::PciFunction;

struct Nic {
    driver: VirtioNet,
    backend: Arc<InProcess>,
}

fn nic(opts: NetOptions, wire: Wire) -> Nic {
    let model = VirtioPci::new(NetModel::new(opts, Some(wire))).unwrap();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    let func = PciFunction::with_backend("in-process".into(), backend.clone()).unwrap();
    Nic {
        driver: VirtioNet::new("nic", func).unwrap(),
        backend,
    }
}

fn pair(mtu: u16) -> (Nic, Nic) {
    let (a, b) = Wire::pair().unwrap();
    let opts = |last| NetOptions {
        mac: [2, 0, 0, 0, 0, last],
        mtu,
        link_up: true,
    };
    (nic(opts(1), a), nic(opts(2), b))
}

/// A frame of `len` bytes of the seeded stream `seed`.
fn frame(len: usize, seed: u64) -> Vec<u8> {
    let mut f = vec![0u8; len];
    Seeded::new(seed).fill(&mut f);
    f
}

/// Frames received by `to`, pumping its wire until `n` came (bounded).
fn receive(to: &mut Nic, n: usize) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    for _ in 0..1000 {
        to.backend.pump_input();
        to.driver.recv(&mut got).unwrap();
        if got.len() >= n {
            break;
        }
    }
    got
}

#[test]
fn the_driver_reads_the_device_and_the_link() {
    let (a, b) = pair(1500);
    assert_eq!(a.driver.device_info().mac, [2, 0, 0, 0, 0, 1]);
    assert_eq!(b.driver.device_info().mtu, 1500);
    assert!(a.driver.device_info().mergeable);
    assert!(a.driver.link_up().unwrap());
    // The other end goes: the link goes down.
    drop(b);
    a.backend.pump_input();
    assert!(!a.driver.link_up().unwrap());
}

/// Sends frames of `sizes` from `from` to `to` in one batch and checks each arrives whole,
/// in order.
fn exchange(from: &mut Nic, to: &mut Nic, sizes: &[usize], seed: u64) {
    let frames: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| frame(len, seed * 100_000 + (len * 1000 + i) as u64))
        .collect();
    let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
    assert_eq!(from.driver.send(&refs).unwrap(), frames.len());
    let got = receive(to, frames.len());
    assert_eq!(got.len(), frames.len());
    for (g, f) in got.iter().zip(&frames) {
        assert!(
            g == f,
            "a frame of {} bytes came back as {} bytes",
            f.len(),
            g.len()
        );
    }
}

#[test]
fn frames_of_every_size_cross_intact_and_in_order_both_ways() {
    let (mut a, mut b) = pair(1500);
    let sizes: Vec<usize> = (0..600).map(|i| 60 + (i * 977) % (1514 - 60 + 1)).collect();
    let mut sizes = sizes;
    sizes.extend([60, 1514]);
    for chunk in sizes.chunks(32) {
        exchange(&mut a, &mut b, chunk, 1);
        exchange(&mut b, &mut a, chunk, 2);
    }
    assert_eq!(b.driver.stats().rx_frames, sizes.len() as u64);
    assert_eq!(a.driver.stats().rx_errors + b.driver.stats().rx_errors, 0);
}

#[test]
fn a_batch_of_frames_rings_the_doorbell_once() {
    let (mut a, mut b) = pair(1500);
    for round in 0..4u64 {
        let frames: Vec<Vec<u8>> = (0..32)
            .map(|i| frame(60 + i * 40, round * 100 + i as u64))
            .collect();
        let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
        let before = a.driver.stats().tx_doorbells;
        assert_eq!(a.driver.send(&refs).unwrap(), 32);
        assert_eq!(
            a.driver.stats().tx_doorbells - before,
            1,
            "32 frames, one notification"
        );
        assert_eq!(receive(&mut b, 32), frames);
    }
}

#[test]
fn jumbo_frames_span_mergeable_buffers() {
    let (mut a, mut b) = pair(9000);
    for len in [1515usize, 2048, 4000, 9014] {
        let f = frame(len, len as u64);
        assert_eq!(a.driver.send(&[&f]).unwrap(), 1);
        let got = receive(&mut b, 1);
        assert_eq!(got.len(), 1, "{len}");
        assert!(got[0] == f, "{len}");
    }
}

#[test]
fn the_driver_refuses_frames_the_link_cannot_carry() {
    let (mut a, _b) = pair(1500);
    assert!(a.driver.send(&[&[0u8; 13]]).is_err());
    assert!(a.driver.send(&[&vec![0u8; 1519]]).is_err());
    assert_eq!(
        a.driver.send(&[&vec![0u8; 1518]]).unwrap(),
        1,
        "a VLAN-tagged frame"
    );
}

/// Whether the driver's interrupt `event` has fired (its eventfd is readable), waiting up to
/// `wait`.
fn fired(nic: &Nic, event: outboard_env::DeviceEvent, wait: std::time::Duration) -> bool {
    use outboard_env::Driver;
    let sources = nic.driver.sources();
    let (_, fd) = sources
        .iter()
        .find(|(e, _)| *e == event)
        .expect("the event");
    outboard_sys::poll::readable([*fd], wait).unwrap()[0]
}

#[test]
fn a_receive_hold_off_delays_the_interrupt_not_the_frame() {
    use outboard_env::DeviceEvent;
    use outboard_net::NetDriver;
    use std::time::{Duration, Instant};
    let rx = DeviceEvent::Interrupt(1);
    let (mut a, mut b) = pair(1500);
    // Without a hold-off the interrupt comes with the frame.
    assert!(!b.driver.arm().unwrap());
    a.driver.send(&[&frame(100, 1)]).unwrap();
    b.backend.pump_input();
    assert!(fired(&b, rx, Duration::from_secs(1)));
    assert_eq!(receive(&mut b, 1).len(), 1);
    // 300 ms of hold-off, asked for over the control queue: the frame is there at once for a
    // driver that looks, the interrupt only when the hold-off is over.
    b.driver.set_hold_off(300_000).unwrap();
    while fired(&b, rx, Duration::ZERO) {
        use outboard_env::Driver;
        b.driver.handle(rx).unwrap();
        let mut buf = [0u8; 8];
        // Drain the eventfd the way the environment would.
        let sources = b.driver.sources();
        let _ = rustix::io::read(sources.iter().find(|(e, _)| *e == rx).unwrap().1, &mut buf);
    }
    assert!(!b.driver.arm().unwrap());
    let t0 = Instant::now();
    a.driver.send(&[&frame(100, 2)]).unwrap();
    b.backend.pump_input();
    assert!(!fired(&b, rx, Duration::from_millis(100)), "held back");
    let mut got = Vec::new();
    b.driver.recv(&mut got).unwrap();
    assert_eq!(got, vec![frame(100, 2)], "the frame did not wait");
    // The transport's timer ends the hold-off (the model's server polls it with the wire).
    let over = outboard_sys::wait::eventually(Duration::from_secs(5), || {
        b.backend.pump_input();
        fired(&b, rx, Duration::ZERO)
    });
    assert!(over, "the held interrupt came");
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t0.elapsed()
    );
}
