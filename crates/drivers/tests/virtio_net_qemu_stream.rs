//! The stream wire against an independent implementation of its framing: QEMU's
//! `-netdev stream`. QEMU (no guest, no CPU: only its network layer runs) joins two stream
//! netdevs on a hub; an Outboard NIC model is plugged into each over a UNIX stream socket, and
//! frames sent by one NIC's driver arrive intact, in order, at the other's — having been
//! parsed and framed again by QEMU in between. Both ways round: the NIC connects to QEMU's
//! listening netdev, and QEMU's netdev (`server=off`) plugs into the NIC's listening cable.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// QEMU, ended when dropped.
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn connect(path: &Path) -> UnixStream {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("QEMU's stream socket {}: {e}", path.display()),
        }
    }
}

fn nic(mac: u8, path: &Path) -> Nic {
    let wire = Wire::stream(connect(path).into()).unwrap();
    let opts = NetOptions {
        mac: [2, 0, 0, 0, 0, mac],
        mtu: 1500,
        link_up: true,
    };
    let model = VirtioPci::new(NetModel::new(opts, Some(wire))).unwrap();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    let func = PciFunction::with_backend("in-process".into(), backend.clone()).unwrap();
    Nic {
        driver: VirtioNet::new("nic", func).unwrap(),
        backend,
    }
}

/// QEMU with no guest (only its network layer): two `-netdev stream` on UNIX sockets `a`
/// and `b`, joined on a hub; `listen`: QEMU listens (server=on), else it connects.
fn qemu_hub(listen: bool, a: &Path, b: &Path) -> Qemu {
    let server = if listen { "on" } else { "off" };
    let stream = |id: &str, p: &Path| {
        format!(
            "stream,id={id},server={server},addr.type=unix,addr.path={}",
            p.display()
        )
    };
    Qemu(
        Command::new("qemu-system-x86_64")
            .args(["-M", "none", "-nodefaults", "-display", "none"])
            .args(["-netdev", &stream("a", a), "-netdev", &stream("b", b)])
            .args(["-netdev", "hubport,id=ha,hubid=0,netdev=a"])
            .args(["-netdev", "hubport,id=hb,hubid=0,netdev=b"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("qemu-system-x86_64"),
    )
}

/// A NIC whose cable listens at `path` for QEMU to plug in.
fn listening_nic(mac: u8, path: &Path) -> Nic {
    let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
    let opts = NetOptions {
        mac: [2, 0, 0, 0, 0, mac],
        mtu: 1500,
        link_up: true,
    };
    let model = VirtioPci::new(NetModel::listening(opts, listener.into()).unwrap()).unwrap();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    let func = PciFunction::with_backend("in-process".into(), backend.clone()).unwrap();
    Nic {
        driver: VirtioNet::new("nic", func).unwrap(),
        backend,
    }
}

/// 200 frames of 60–1514 bytes from `a` to `b`, checked intact and in order.
fn exchange(a: &mut Nic, b: &mut Nic) {
    let frames: Vec<Vec<u8>> = (0..200)
        .map(|i| {
            let mut f = vec![0u8; 60 + (i * 7919) % (1514 - 60 + 1)];
            Seeded::new(i as u64).fill(&mut f);
            f
        })
        .collect();
    let mut got: Vec<Vec<u8>> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    for chunk in frames.chunks(16) {
        let refs: Vec<&[u8]> = chunk.iter().map(|f| &f[..]).collect();
        let mut sent = 0;
        while sent < refs.len() {
            a.backend.pump_input();
            sent += a.driver.send(&refs[sent..]).unwrap();
        }
        let want = got.len() + chunk.len();
        while got.len() < want {
            assert!(
                Instant::now() < deadline,
                "{} of {} frames arrived",
                got.len(),
                frames.len()
            );
            b.backend.pump_input();
            b.driver.recv(&mut got).unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert_eq!(got.len(), frames.len());
    for (i, (g, f)) in got.iter().zip(&frames).enumerate() {
        assert!(g == f, "frame {i} ({} bytes) differs", f.len());
    }
}

#[test]
fn qemus_stream_netdevs_plug_into_listening_nics_and_carry_frames() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    // The NICs listen first; QEMU connects to them (server=off).
    let mut a = listening_nic(1, &pa);
    let mut b = listening_nic(2, &pb);
    assert!(
        !a.driver.link_up().unwrap(),
        "no peer yet: the link is down"
    );
    let _qemu = qemu_hub(false, &pa, &pb);
    // QEMU plugs in: each link comes up.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(a.driver.link_up().unwrap() && b.driver.link_up().unwrap()) {
        assert!(Instant::now() < deadline, "QEMU never plugged in");
        a.backend.pump_input();
        b.backend.pump_input();
        std::thread::sleep(Duration::from_millis(10));
    }
    exchange(&mut a, &mut b);
}

#[test]
fn frames_cross_qemus_stream_netdevs_intact_and_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let _qemu = qemu_hub(true, &pa, &pb);
    let mut a = nic(1, &pa);
    let mut b = nic(2, &pb);
    exchange(&mut a, &mut b);
}
