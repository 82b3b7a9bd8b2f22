//! The net class end to end: two virtio-net device models joined by a wire, each served over
//! vfio-user on a thread of its own (as a model process would), both NICs driven by the
//! virtio-net driver in one driver server, and clients on sessions. Frames cross the wire
//! intact and in order, sessions sharing a NIC are told apart by their filters, and bad
//! requests fail alone.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use outboard_devices::faults::{lock, FaultHandle};
use outboard_devices::virtio_net::{NetOptions as ModelOptions, VirtioNet as NetModel, Wire};
use outboard_devices::virtio_pci::{VirtioDevice, VirtioPci};
use outboard_devices::virtio_rng::Seeded;
use outboard_drivers::virtio_net::VirtioNet;
use outboard_drivers::Attachment;
use outboard_hw::{DeviceSpec, PciFunction};
use outboard_net::bpf::Program;
use outboard_net::{NetError, NetOp, NetRequest, Sqe, PROMISCUOUS};
use outboard_net_client::{ColocatedNic, NetClient, NetOptions, NetPort};
use outboard_net_server::NetDispatcher;
use outboard_server::{DriverHost, HostStats};

const A: [u8; 6] = [2, 0, 0, 0, 0, 1];
const B: [u8; 6] = [2, 0, 0, 0, 0, 2];

struct Model {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
    faults: FaultHandle,
}

/// Serves a NIC model of `mtu` over vfio-user at `path` on a thread.
fn model(path: &Path, mac: [u8; 6], mtu: u16, wire: Wire) -> Model {
    let opts = ModelOptions {
        mac,
        mtu,
        link_up: true,
    };
    let nic = NetModel::new(opts, Some(wire));
    let faults = nic.faults();
    let dev = VirtioPci::new(nic).unwrap();
    let mut server =
        outboard_vfio_user::Server::bind(path, dev, outboard_vfio_user::ServerOptions::default())
            .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let thread = std::thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            server.run_once(Duration::from_millis(10)).unwrap();
        }
    });
    Model {
        stop,
        thread,
        faults,
    }
}

struct Rig {
    _dir: tempfile::TempDir,
    sock: PathBuf,
    host: (
        Arc<AtomicBool>,
        JoinHandle<Result<HostStats, outboard_server::HostError>>,
    ),
    models: Vec<Model>,
    /// The models' vfio-user sockets, by NIC.
    paths: Vec<(&'static str, PathBuf)>,
}

impl Rig {
    /// Two NICs on one wire, `nic0` (address A) and `nic1` (address B), in one driver server.
    fn start() -> Self {
        Self::serving(&["nic0", "nic1"])
    }

    /// Two NICs on one wire; the driver server drives those in `served`, the others are left
    /// for a colocated driver.
    fn serving(served: &[&str]) -> Self {
        Self::serving_mtu(served, 1500)
    }

    /// Like [`Rig::serving`], with NICs of `mtu`.
    fn serving_mtu(served: &[&str], mtu: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (wa, wb) = Wire::pair().unwrap();
        let pa = dir.path().join("a.sock");
        let pb = dir.path().join("b.sock");
        let models = vec![model(&pa, A, mtu, wa), model(&pb, B, mtu, wb)];
        let paths = vec![("nic0", pa), ("nic1", pb)];
        let served = paths
            .iter()
            .filter(|(name, _)| served.contains(name))
            .map(|&(name, ref p)| {
                let f = PciFunction::open(&DeviceSpec::VfioUser(p.clone())).unwrap();
                let d = VirtioNet::new(name, f).unwrap();
                let env = outboard_env::DeviceEnv::for_function(d.function());
                NetDispatcher::served(d, env)
            })
            .collect();
        let sock = dir.path().join("host.sock");
        let host = DriverHost::bind(&sock, served).unwrap().spawn();
        Rig {
            _dir: dir,
            sock,
            host,
            models,
            paths,
        }
    }

    fn open(&self, nic: &str) -> NetClient {
        NetClient::open(&self.sock, nic, NetOptions::default()).unwrap()
    }

    /// `nic` driven in this process.
    fn colocated(&self, nic: &str) -> ColocatedNic {
        let (_, p) = self.paths.iter().find(|(n, _)| *n == nic).unwrap();
        ColocatedNic::open(nic, &Attachment::Pci(DeviceSpec::VfioUser(p.clone()))).unwrap()
    }

    fn stop(self) {
        self.host.0.store(true, Ordering::Relaxed);
        self.host.1.join().unwrap().unwrap();
        for m in self.models {
            m.stop.store(true, Ordering::Relaxed);
            m.thread.join().unwrap();
        }
    }
}

/// A frame from `src` to `dst` of `len` bytes: Ethernet type `ethertype`, then the seeded
/// stream `seed`.
fn frame(dst: [u8; 6], src: [u8; 6], ethertype: u16, len: usize, seed: u64) -> Vec<u8> {
    let mut f = vec![0u8; len];
    Seeded::new(seed).fill(&mut f[14..]);
    f[..6].copy_from_slice(&dst);
    f[6..12].copy_from_slice(&src);
    f[12..14].copy_from_slice(&ethertype.to_be_bytes());
    f
}

/// `ldh [12]; jeq #ethertype, accept, drop`.
fn only(ethertype: u16) -> Program {
    Program::from_text(&format!(
        "{{ 0x28, 0, 0, 12 }}, {{ 0x15, 0, 1, {ethertype:#x} }}, {{ 0x6, 0, 0, 0xffff }}, {{ 0x6, 0, 0, 0 }}"
    ))
    .unwrap()
}

const WAIT: Duration = Duration::from_secs(5);

/// Ten frames from `a` to `b` of which the device claims the first two are longer than
/// their buffers (`long-frame=2` on `b`'s model): what `b` received, and the eight it should.
fn two_long_frames_in_ten(
    a: &mut NetClient,
    b: &mut NetClient,
    faults: &FaultHandle,
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    lock(faults).arm("long-frame=2".parse().unwrap());
    for i in 0..10 {
        a.send(&frame(B, A, 0x88b5, 100 + i, i as u64)).unwrap();
        if i == 0 {
            // One at a time at first, so the two faulty ones are the first two.
            a.flush().unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    a.flush().unwrap();
    let mut got = Vec::new();
    while let Some(f) = b.recv(Duration::from_millis(500)).unwrap() {
        got.push(f);
    }
    let want = (2..10)
        .map(|i| frame(B, A, 0x88b5, 100 + i, i as u64))
        .collect();
    (got, want)
}

#[test]
fn frames_of_every_size_cross_the_wire_intact_and_in_order() {
    let rig = Rig::start();
    let mut a = rig.open("nic0");
    let mut b = rig.open("nic1");
    assert_eq!(a.info().mac, A);
    assert_eq!(b.info().mtu, 1500);
    assert!(a.info().link_up);
    // Every size from the smallest Ethernet frame to the largest, each once (far more than
    // the posted buffers and transmit slots at once: they are reused under load).
    let sizes: Vec<usize> = (60..=1514).chain([1514, 60, 1514]).collect();
    let frames: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| frame(B, A, 0x88b5, n, i as u64))
        .collect();
    // A NIC has no flow control: frames beyond the receiver's posted buffers are dropped (and
    // counted). The sender keeps at most 64 frames ahead of what the receiver has read, half
    // its posted buffers, so the stream is under load and still lossless by design.
    let read = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = read.clone();
    let want = frames.len();
    let receiver = std::thread::spawn(move || {
        let mut got = Vec::new();
        while got.len() < want {
            match b.recv(WAIT).unwrap() {
                Some(f) => got.push(f),
                None => break,
            }
            seen.store(got.len(), Ordering::Release);
        }
        (b, got)
    });
    for (i, chunk) in frames.chunks(64).enumerate() {
        let deadline = std::time::Instant::now() + WAIT;
        while read.load(Ordering::Acquire) < i * 64 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        for f in chunk {
            a.send(f).unwrap();
        }
        a.flush().unwrap();
    }
    let (_b, got) = receiver.join().unwrap();
    assert_eq!(got.len(), frames.len(), "every frame arrived");
    for (i, (g, f)) in got.iter().zip(&frames).enumerate() {
        assert!(g == f, "frame {i} ({} bytes) differs", f.len());
    }
    let status = NetClient::status(&rig.sock, "nic0").unwrap();
    assert_eq!(status.counters.tx_frames, frames.len() as u64);
    rig.stop();
}

/// Frames of every size up to the MTU the device reports (jumbo: 9000), alternating between
/// two Ethernet types, reach the two sessions whose filters take them — each its own, whole
/// and in order — under load, while a third session's filter takes none.
#[test]
fn jumbo_frames_of_every_size_reach_several_filtered_sessions_whole_and_in_order() {
    let rig = Rig::serving_mtu(&["nic0", "nic1"], 9000);
    let mut a = rig.open("nic0");
    let mut odd = rig.open("nic1");
    let mut even = rig.open("nic1");
    let mut none = rig.open("nic1");
    let mtu = usize::from(odd.info().mtu);
    assert_eq!(mtu, 9000, "the MTU the device reports");
    even.set_filter(Some(&only(0x88b5))).unwrap();
    odd.set_filter(Some(&only(0x88b6))).unwrap();
    none.set_filter(Some(&only(0x88b7))).unwrap();
    let sizes: Vec<usize> = (60..=mtu + 14).step_by(61).chain([mtu + 14, 60]).collect();
    let frames: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| frame(B, A, 0x88b5 + (i % 2) as u16, n, i as u64))
        .collect();
    // Each receiver reads on a thread of its own; the sender keeps at most 32 frames ahead of
    // the slower one (a NIC has no flow control: the posted buffers bound what may be in
    // flight).
    let receive = |mut c: NetClient, want: usize| {
        let read = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = read.clone();
        let t = std::thread::spawn(move || {
            let mut got = Vec::new();
            while got.len() < want {
                match c.recv(WAIT).unwrap() {
                    Some(f) => got.push(f),
                    None => break,
                }
                seen.store(got.len(), Ordering::Release);
            }
            got
        });
        (read, t)
    };
    let evens = frames.iter().step_by(2).count();
    let (read_even, even_t) = receive(even, evens);
    let (read_odd, odd_t) = receive(odd, frames.len() - evens);
    for (i, chunk) in frames.chunks(32).enumerate() {
        let deadline = std::time::Instant::now() + WAIT;
        let behind = || {
            let done = read_even.load(Ordering::Acquire) + read_odd.load(Ordering::Acquire);
            done + 32 < i * 32
        };
        while behind() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        for f in chunk {
            a.send(f).unwrap();
        }
        a.flush().unwrap();
    }
    let (got_even, got_odd) = (even_t.join().unwrap(), odd_t.join().unwrap());
    let want_even: Vec<&Vec<u8>> = frames.iter().step_by(2).collect();
    let want_odd: Vec<&Vec<u8>> = frames.iter().skip(1).step_by(2).collect();
    assert_eq!(
        got_even.len(),
        want_even.len(),
        "every 0x88b5 frame arrived"
    );
    assert_eq!(got_odd.len(), want_odd.len(), "every 0x88b6 frame arrived");
    for (g, w) in got_even
        .iter()
        .zip(&want_even)
        .chain(got_odd.iter().zip(&want_odd))
    {
        assert!(g == *w, "a {}-byte frame differs", w.len());
    }
    assert_eq!(none.recv(Duration::from_millis(100)).unwrap(), None);
    rig.stop();
}

#[test]
fn sessions_sharing_a_nic_get_the_frames_their_filters_take() {
    let rig = Rig::start();
    let mut a = rig.open("nic0");
    let mut one = rig.open("nic1");
    let mut two = rig.open("nic1");
    let mut all = rig.open("nic1");
    let mut deaf = rig.open("nic1");
    one.set_filter(Some(&only(0x88b5))).unwrap();
    two.set_filter(Some(&only(0x88b6))).unwrap();
    deaf.set_filter(Some(&only(0x88b7))).unwrap();
    // `all` has no filter: frames to its NIC's address and broadcast; not another station's
    // until it asks for promiscuous mode.
    for i in 0..20u64 {
        let t = if i % 2 == 0 { 0x88b5 } else { 0x88b6 };
        a.send(&frame(B, A, t, 100 + i as usize, i)).unwrap();
    }
    a.send(&frame([2, 0, 0, 0, 0, 9], A, 0x88b5, 64, 99))
        .unwrap();
    a.flush().unwrap();
    let drain = |c: &mut NetClient| {
        let mut v = Vec::new();
        while let Some(f) = c.recv(Duration::from_millis(300)).unwrap() {
            v.push(f);
        }
        v
    };
    let (g1, g2, ga, gd) = (
        drain(&mut one),
        drain(&mut two),
        drain(&mut all),
        drain(&mut deaf),
    );
    assert_eq!(g1.len(), 10);
    assert!(g1.iter().all(|f| f[12..14] == [0x88, 0xb5] && f[..6] == B));
    assert_eq!(g2.len(), 10);
    assert!(g2.iter().all(|f| f[12..14] == [0x88, 0xb6]));
    assert_eq!(
        ga.len(),
        20,
        "no filter: every frame to the NIC, not the other station's"
    );
    assert!(gd.is_empty());
    // The frame to another station no session took: counted as unclaimed and dropped.
    let s = NetClient::status(&rig.sock, "nic1").unwrap();
    assert_eq!(s.counters.rx_frames, 21);
    assert_eq!(s.counters.rx_unclaimed, 1);
    // A multicast group: only the session that joined it gets its frames (its filter still
    // applies); sessions that did not join see none.
    let group = [0x01, 0x00, 0x5e, 0x00, 0x00, 0x42];
    two.set_groups(&[group]).unwrap();
    a.send(&frame(group, A, 0x88b6, 80, 200)).unwrap();
    a.send(&frame(group, A, 0x88b5, 81, 201)).unwrap();
    a.flush().unwrap();
    let g2 = drain(&mut two);
    assert_eq!(g2.len(), 1, "the group's 0x88b6 frame, not its 0x88b5 one");
    assert_eq!(g2[0], frame(group, A, 0x88b6, 80, 200));
    assert!(drain(&mut all).is_empty(), "not joined: no group frames");
    assert!(drain(&mut one).is_empty(), "not joined: no group frames");
    two.set_groups(&[]).unwrap();
    a.send(&frame(group, A, 0x88b6, 82, 202)).unwrap();
    a.flush().unwrap();
    assert!(drain(&mut two).is_empty(), "left the group");
    all.set_mode(PROMISCUOUS).unwrap();
    a.send(&frame([2, 0, 0, 0, 0, 9], A, 0x88b5, 64, 100))
        .unwrap();
    a.flush().unwrap();
    assert_eq!(
        drain(&mut all).len(),
        1,
        "promiscuous: another station's frame too"
    );
    rig.stop();
}

#[test]
fn bad_requests_and_filters_fail_alone_with_their_reasons() {
    let rig = Rig::start();
    let mut a = rig.open("nic0");
    let mut b = rig.open("nic1");
    let mut hostile = rig.open("nic0");
    // Programs the checker refuses, each with its reason.
    let bad: &[(&[u8], &str)] = &[
        (&[0x06, 0, 0, 0, 0, 0, 0], "8-byte instructions"),
        (&[0x05, 0, 0, 0, 0xff, 0, 0, 0], "past the end"),
        (&[0x28, 0, 0, 0, 12, 0, 0, 0], "ret"),
        (
            &[0x60, 0, 0, 0, 3, 0, 0, 0, 0x16, 0, 0, 0, 0, 0, 0, 0],
            "before it is written",
        ),
    ];
    for (bytes, why) in bad {
        match hostile.set_filter_bytes(bytes) {
            Err(NetError::BadFilter(r)) if r.contains(why) => {}
            other => panic!("{why}: {other:?}"),
        }
    }
    // Programs the checker takes that fail at run time: a load past the end of every frame,
    // a division by an X of zero. Each ends the program and rejects the frame (as the
    // kernel's filter does; the accept after it is never reached), the session lives on, and
    // the other sessions keep their traffic.
    let mut odd = rig.open("nic1");
    for (text, what) in [
        (
            "{ 0x20, 0, 0, 100000 }, { 0x06, 0, 0, 0xffff }",
            "a load past the end",
        ),
        (
            "{ 0x00, 0, 0, 1000 }, { 0x01, 0, 0, 0 }, { 0x3c, 0, 0, 0 }, { 0x06, 0, 0, 0xffff }",
            "a division by zero",
        ),
    ] {
        let p = Program::from_text(text).unwrap_or_else(|e| panic!("{what}: {e}"));
        odd.set_filter(Some(&p))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let f = frame(B, A, 0x88b5, 120, 3);
        a.send(&f).unwrap();
        a.flush().unwrap();
        assert_eq!(b.recv(WAIT).unwrap().as_deref(), Some(&f[..]), "{what}");
        assert_eq!(
            odd.recv(Duration::from_millis(100)).unwrap(),
            None,
            "{what}"
        );
    }
    // Frames the server refuses: too short, too long.
    assert!(
        hostile.send(&[0u8; 13]).is_ok(),
        "queued; refused by the server"
    );
    assert!(matches!(hostile.flush(), Err(NetError::Invalid(_))));
    assert!(matches!(
        hostile.send(&[0u8; 1600]),
        Err(NetError::Invalid(_))
    ));
    // Garbage entries by hand: each is answered with its error, under its tag.
    let ch = hostile.channel();
    let mut garbage = [0xa5u8; 32];
    garbage[8..16].copy_from_slice(&(1u64 << 61 | 999).to_le_bytes());
    assert!(ch.stage(0, &garbage).unwrap());
    let past = NetRequest {
        op: NetOp::Receive,
        tag: 1 << 61 | 1000,
        buf_offset: u64::MAX - 4,
        length: 100,
    };
    assert!(ch.stage(0, &Sqe::encode(&past).0).unwrap());
    ch.kick();
    let mut answers = Vec::new();
    let deadline = std::time::Instant::now() + WAIT;
    while answers.len() < 2 && std::time::Instant::now() < deadline {
        while let Some(c) = ch.completion::<NetError>(0).unwrap() {
            answers.push(c);
        }
        let _ = ch.wait(deadline);
    }
    assert!(answers.contains(&(
        1 << 61 | 999,
        Err(NetError::Invalid("unknown opcode 165".into()))
    )));
    assert!(answers.contains(&(1 << 61 | 1000, Err(NetError::BadBuffer))));
    // The good session on the same NIC is untouched.
    let f = frame(B, A, 0x88b5, 200, 7);
    a.send(&f).unwrap();
    a.flush().unwrap();
    assert_eq!(b.recv(WAIT).unwrap().as_deref(), Some(&f[..]));
    rig.stop();
}

#[test]
fn a_session_that_never_posts_buffers_costs_only_its_own_frames() {
    let rig = Rig::start();
    let mut a = rig.open("nic0");
    let mut b = rig.open("nic1");
    // A session that takes every frame and gives its buffers back without posting more.
    let mut greedy = rig.open("nic1");
    let ch = greedy.channel();
    let reclaim = NetRequest {
        op: NetOp::Reclaim,
        tag: 1 << 61 | 1,
        buf_offset: 0,
        length: 0,
    };
    assert!(ch.stage(0, &Sqe::encode(&reclaim).0).unwrap());
    ch.kick();
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..300u64 {
        a.send(&frame(B, A, 0x88b5, 64, i)).unwrap();
        if i % 50 == 49 {
            a.flush().unwrap();
            for _ in 0..50 {
                assert!(b.recv(WAIT).unwrap().is_some(), "frame {i}");
            }
        }
    }
    let s = NetClient::status(&rig.sock, "nic1").unwrap();
    assert_eq!(s.counters.rx_frames, 300);
    assert_eq!(
        s.counters.rx_no_buffer, 300,
        "the greedy session's copies were dropped"
    );
    assert_eq!(s.counters.rx_delivered, 300);
    rig.stop();
}

#[test]
fn udp_datagrams_of_every_size_echo_through_smoltcp_over_two_nics() {
    let rig = Rig::start();
    let (a, b) = (rig.open("nic0"), rig.open("nic1"));
    udp_echo(a, b);
    rig.stop();
}

#[test]
fn the_same_udp_echo_runs_with_one_nic_driven_in_the_application() {
    let rig = Rig::serving(&["nic1"]);
    let a = rig.colocated("nic0");
    assert_eq!(a.info().mac, A);
    // nic0's model has its driver: a second one is refused, not started beside it.
    let (_, p) = &rig.paths[0];
    let again = ColocatedNic::open("nic0", &Attachment::Pci(DeviceSpec::VfioUser(p.clone())));
    assert!(matches!(again, Err(NetError::Busy(_))), "{:?}", again.err());
    udp_echo(a, rig.open("nic1"));
    rig.stop();
}

#[test]
fn a_colocated_nic_applies_the_address_rule_filters_and_their_checks() {
    let rig = Rig::serving(&["nic1"]);
    let mut a = rig.colocated("nic0");
    let mut b = rig.open("nic1");
    let other = [2, 0, 0, 0, 0, 9];
    // Not its address: dropped, until promiscuous.
    b.send(&frame(other, B, 0x88b5, 60, 1)).unwrap();
    b.send(&frame(A, B, 0x88b5, 61, 2)).unwrap();
    assert_eq!(a.recv(WAIT).unwrap().map(|f| f.len()), Some(61));
    a.set_mode(PROMISCUOUS).unwrap();
    b.send(&frame(other, B, 0x88b5, 62, 3)).unwrap();
    assert_eq!(a.recv(WAIT).unwrap().map(|f| f.len()), Some(62));
    // A filter: only its type gets through.
    a.set_filter(Some(&only(0x88b6))).unwrap();
    b.send(&frame(A, B, 0x88b5, 63, 4)).unwrap();
    b.send(&frame(A, B, 0x88b6, 64, 5)).unwrap();
    assert_eq!(a.recv(WAIT).unwrap(), Some(frame(A, B, 0x88b6, 64, 5)));
    // The checks a server makes: an unknown mode, too many groups.
    assert!(matches!(a.set_mode(0x80), Err(NetError::Invalid(_))));
    let groups = vec![[1, 0, 0x5e, 0, 0, 1]; 65];
    assert!(matches!(a.set_groups(&groups), Err(NetError::Invalid(_))));
    // Frames out of the colocated NIC arrive, and what it counted says so.
    for i in 0..100 {
        a.send(&frame(B, A, 0x88b5, 60 + i, i as u64)).unwrap();
    }
    a.flush().unwrap();
    for i in 0..100 {
        assert_eq!(
            b.recv(WAIT).unwrap(),
            Some(frame(B, A, 0x88b5, 60 + i, i as u64))
        );
    }
    let c = a.status_now().unwrap().counters;
    assert_eq!((c.tx_frames, c.rx_delivered, c.rx_unclaimed), (100, 3, 2));
    rig.stop();
}

#[test]
fn a_nics_own_faults_are_caught_by_the_driver_and_traffic_goes_on() {
    let rig = Rig::start();
    let mut a = rig.open("nic0");
    let mut b = rig.open("nic1");
    let nic1 = &rig.models[1].faults;
    // Two frames the device claims are longer than their buffers: dropped and counted by the
    // driver, and the frames around them arrive whole and in order.
    let (got, want) = two_long_frames_in_ten(&mut a, &mut b, nic1);
    assert_eq!(got.len(), 8, "8 of 10 frames arrive");
    assert!(got == want, "whole and in order");
    let s = NetClient::status(&rig.sock, "nic1").unwrap();
    assert_eq!(s.counters.rx_device_errors, 2);
    // A link flap: the class sees the link go down and come back, and frames flow after.
    lock(nic1).arm("link-flap=300ms".parse().unwrap());
    b.send(&frame(A, B, 0x88b5, 60, 0)).unwrap(); // a notification starts it
    let link = || NetClient::status(&rig.sock, "nic1").unwrap().link_up;
    assert!(
        outboard_sys::wait::eventually(WAIT, || !link()),
        "link down"
    );
    assert!(outboard_sys::wait::eventually(WAIT, link), "link up again");
    let f = frame(B, A, 0x88b5, 200, 99);
    a.send(&f).unwrap();
    assert_eq!(b.recv(WAIT).unwrap(), Some(f));
    rig.stop();
}

/// 70 UDP datagrams of 64…1472 bytes from `a` echoed by `b`, each checked.
fn udp_echo(a: impl NetPort + 'static, b: impl NetPort + 'static) {
    use outboard_net_client::Udp;
    use std::net::Ipv4Addr;
    let (ip_a, ip_b) = (Ipv4Addr::new(10, 9, 0, 1), Ipv4Addr::new(10, 9, 0, 2));
    let mut a = Udp::bind(a, ip_a, 24, 4000).unwrap();
    let mut b = Udp::bind(b, ip_b, 24, 7).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    // The echo server: every datagram back to where it came from.
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        let mut n_echoed = 0;
        while !s.load(Ordering::Relaxed) {
            if let Some((n, from)) = b.recv_from(&mut buf, Duration::from_millis(100)).unwrap() {
                b.send_to(&buf[..n], from).unwrap();
                n_echoed += 1;
            }
        }
        n_echoed
    });
    let mut buf = [0u8; 2048];
    let sizes: Vec<usize> = [64usize, 128, 256, 512, 1024, 1280, 1472]
        .iter()
        .flat_map(|&n| std::iter::repeat_n(n, 10))
        .collect();
    for (i, &n) in sizes.iter().enumerate() {
        let mut d = vec![0u8; n];
        Seeded::new(i as u64).fill(&mut d);
        a.send_to(&d, (ip_b, 7)).unwrap();
        let (got, from) = a.recv_from(&mut buf, WAIT).unwrap().expect("an echo");
        assert_eq!(from, (ip_b, 7));
        assert!(
            buf[..got] == d[..],
            "datagram {i} ({n} bytes) came back different"
        );
    }
    stop.store(true, Ordering::Relaxed);
    assert_eq!(echo.join().unwrap(), sizes.len());
    assert_eq!(a.dropped(), 0);
}

fn owning(rig: &Rig, nic: &str) -> Result<NetClient, NetError> {
    let opts = NetOptions {
        own_receive: true,
        ..NetOptions::default()
    };
    NetClient::open(&rig.sock, nic, opts)
}

#[test]
fn a_session_owning_the_receive_path_gets_frames_written_in_place_intact_and_in_order() {
    let rig = Rig::start();
    let mut a = rig.open("nic0");
    let mut b = owning(&rig, "nic1").unwrap();
    assert!(b.owns_receive());
    // Every size, more frames than buffers: each buffer is written by the device, read in
    // place, and lent again.
    let sizes: Vec<usize> = (60..=1514).step_by(11).chain([1514, 60]).collect();
    let frames: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| frame(B, A, 0x88b5, n, 1000 + i as u64))
        .collect();
    let mut got = Vec::new();
    for chunk in frames.chunks(32) {
        for f in chunk {
            a.send(f).unwrap();
        }
        a.flush().unwrap();
        while got.len() < frames.len() {
            match b.recv(Duration::from_millis(500)).unwrap() {
                Some(f) => got.push(f),
                None => break,
            }
        }
    }
    assert_eq!(got.len(), frames.len(), "every frame arrived");
    for (i, (g, f)) in got.iter().zip(&frames).enumerate() {
        assert!(g == f, "frame {i} ({} bytes) differs", f.len());
    }
    // Another station's frame is not the owner's: its buffer goes back to the device.
    a.send(&frame([2, 0, 0, 0, 0, 9], A, 0x88b5, 64, 7))
        .unwrap();
    // The owner's filter still decides.
    b.set_filter(Some(&only(0x88b6))).unwrap();
    a.send(&frame(B, A, 0x88b5, 80, 8)).unwrap();
    let wanted = frame(B, A, 0x88b6, 90, 9);
    a.send(&wanted).unwrap();
    a.flush().unwrap();
    assert_eq!(b.recv(WAIT).unwrap().as_deref(), Some(&wanted[..]));
    assert_eq!(b.recv(Duration::from_millis(300)).unwrap(), None);
    let c = NetClient::status(&rig.sock, "nic1").unwrap().counters;
    assert_eq!(c.rx_in_place, frames.len() as u64 + 1, "{c:?}");
    assert_eq!(c.rx_delivered, c.rx_in_place, "no frame was copied: {c:?}");
    assert_eq!(c.rx_unclaimed, 2, "{c:?}");
    rig.stop();
}

#[test]
fn while_the_receive_path_is_owned_others_send_but_cannot_receive_and_get_it_back_after() {
    let rig = Rig::start();
    let mut a = rig.open("nic0");
    let owner = owning(&rig, "nic1").unwrap();
    // A second owner, and a session that posts buffers, are refused with the reason.
    match owning(&rig, "nic1") {
        Err(NetError::Busy(why)) => assert!(why.contains("owns"), "{why}"),
        Err(e) => panic!("a second owner: {e}"),
        Ok(_) => panic!("a second owner was let in"),
    }
    let mut other = rig.open("nic1");
    match other.recv(WAIT) {
        Err(NetError::Busy(why)) => assert!(why.contains("owns"), "{why}"),
        r => panic!("a receive buffer on an owned NIC: {r:?}"),
    }
    // It sends all the same.
    let f = frame(A, B, 0x88b5, 200, 1);
    other.send(&f).unwrap();
    other.flush().unwrap();
    assert_eq!(a.recv(WAIT).unwrap().as_deref(), Some(&f[..]));
    // A NIC where a session receives already cannot be owned.
    let _listener = rig.open("nic0");
    match owning(&rig, "nic0") {
        Err(NetError::Busy(why)) => assert!(why.contains("shared"), "{why}"),
        r => panic!("owning a shared receive path: {:?}", r.map(|_| ())),
    }
    // The owner leaves: the driver's own buffers are back in the device, and a new session
    // receives by copy.
    drop(owner);
    drop(other);
    let deadline = std::time::Instant::now() + WAIT;
    let mut late = loop {
        let mut c = rig.open("nic1");
        let f = frame(B, A, 0x88b5, 300, 2);
        a.send(&f).unwrap();
        a.flush().unwrap();
        match c.recv(Duration::from_millis(500)) {
            Ok(Some(g)) => {
                assert_eq!(g, f);
                break c;
            }
            r => assert!(
                std::time::Instant::now() < deadline,
                "nic1 never received by copy again: {r:?}"
            ),
        }
    };
    let c = NetClient::status(&rig.sock, "nic1").unwrap().counters;
    assert!(c.rx_delivered > c.rx_in_place, "{c:?}");
    assert!(late.recv(Duration::from_millis(100)).is_ok());
    rig.stop();
}

/// Not a check: a fixed workload for counting the driver server's instructions per frame by
/// hand (`docs/net.md`, "Instructions per frame"): `FRAMES` (default 10000) frames of
/// `FRAME_SIZE` bytes (default 64) from nic0 to nic1 through one driver server, received by
/// copy or in place (`OWN=1`).
#[test]
#[ignore]
fn workload_for_counting_instructions_per_frame() {
    let n: usize = std::env::var("FRAMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let own = std::env::var("OWN").is_ok_and(|v| v == "1");
    let size: usize = std::env::var("FRAME_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let rig = Rig::start();
    let mut a = rig.open("nic0");
    let mut b = if own {
        owning(&rig, "nic1").unwrap()
    } else {
        rig.open("nic1")
    };
    let f = frame(B, A, 0x88b5, size, 1);
    let mut got = 0;
    for chunk in 0..n.div_ceil(32) {
        for _ in 0..32.min(n - chunk * 32) {
            a.send(&f).unwrap();
        }
        a.flush().unwrap();
        while got < (chunk + 1) * 32 && got < n {
            match b.recv(WAIT).unwrap() {
                Some(_) => got += 1,
                None => break,
            }
        }
    }
    eprintln!("{got} of {n} frames arrived");
    rig.stop();
}

#[test]
fn a_device_error_in_a_lent_buffer_is_dropped_and_counted_and_the_owner_receives_on() {
    let rig = Rig::start();
    let mut a = rig.open("nic0");
    let mut b = owning(&rig, "nic1").unwrap();
    let nic1 = &rig.models[1].faults;
    // Two frames the device claims are longer than the client's buffers: the driver catches
    // them; the buffers go back to the device and the owner never sees an error.
    let (got, want) = two_long_frames_in_ten(&mut a, &mut b, nic1);
    assert!(
        got == want,
        "8 of 10 frames, whole and in order: got {}",
        got.len()
    );
    let c = NetClient::status(&rig.sock, "nic1").unwrap().counters;
    assert_eq!(c.rx_device_errors, 2, "{c:?}");
    assert_eq!(c.rx_in_place, 8, "{c:?}");
    rig.stop();
}
