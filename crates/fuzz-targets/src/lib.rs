//! Every parser of outside input, as a fuzz target: `fn(&[u8])` that must never panic, hang or
//! leak, whatever the bytes.
//!
//! | target | outside input | peer that sends it |
//! |---|---|---|
//! | [`vfio_user_server`] | a vfio-user command stream | a client of a device model |
//! | [`vfio_user_client`] | a vfio-user reply stream | a device model, to a driver |
//! | [`session_ring`] | ring indices and entries in shared memory | a session's client |
//! | [`control_message`] | control-channel messages, fault-socket messages | clients of servers, the manager and device models |
//! | [`machine_description`] | a machine description (TOML) | the user |
//! | [`nbd_stream`] | an NBD client's whole stream: negotiation, then requests and payloads | any NBD client |
//! | [`packet_filter`] | a classic BPF program (as attached, and as `tcpdump -dd` text) and a frame to run it on | a net session's client, the user |
//! | [`net_stream`] | frames in QEMU's `-netdev stream` framing | the NIC model's peer on a stream cable (a QEMU VM, another NIC) |
//! | [`driver_library_messages`] | a driver library's description and probe answer; a probe request | a child running a driver library's code, to the manager; the manager, to that child |
//!
//! `cargo fuzz run <target>` (in `fuzz/`) explores; `fuzz/corpus/<target>/` keeps what it
//! found, and `tests/corpus.rs` replays that corpus on stable in every test run.
#![deny(missing_docs)]

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::OnceLock;
use std::time::Duration;

use outboard_devices::backing::Backing;
use outboard_devices::virtio_blk::BlkOptions;
use outboard_session::completion::Completion;
use outboard_session::reason::{self, REASON_SIZE};
use outboard_session::region::{Direction, Geometry, Region};
use outboard_vfio_user::{Client, ClientOptions, Server, ServerOptions};
use rustix::net::{AddressFamily, SocketFlags, SocketType};

/// A fuzz target: must return normally for every input.
pub type Target = fn(&[u8]);

/// Names of the targets, as `fuzz/fuzz_targets/` and `fuzz/corpus/` call them.
pub const TARGETS: &[(&str, Target)] = &[
    ("vfio_user_server", vfio_user_server),
    ("vfio_user_client", vfio_user_client),
    ("session_ring", session_ring),
    ("control_message", control_message),
    ("machine_description", machine_description),
    ("nbd_stream", nbd_stream),
    ("packet_filter", packet_filter),
    ("net_stream", net_stream),
    ("driver_library_messages", driver_library_messages),
];

fn stream_pair() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .expect("socketpair")
}

/// Sends `data` as a client's whole command stream to a virtio-blk device model, then hangs
/// up, while the model serves it; the model must answer or drop the client, never panic.
/// The model lives across inputs, so a state one input leaves behind meets the next one.
pub fn vfio_user_server(data: &[u8]) {
    type Model = outboard_devices::virtio_pci::VirtioPci<outboard_devices::virtio_blk::VirtioBlk>;
    static SERVER: OnceLock<std::sync::Mutex<(Server<Model>, tempdir::Dir)>> = OnceLock::new();
    let server = SERVER.get_or_init(|| {
        let dir = tempdir::Dir::new();
        let model = outboard_devices::virtio_blk(
            Backing::open("mem:64K", None).expect("memory backing"),
            BlkOptions::default(),
        )
        .expect("model");
        let s = Server::bind(
            &dir.path.join("fuzz.sock"),
            model,
            ServerOptions {
                timeout: Duration::from_millis(50),
                // The fuzzer drives one message at a time: nothing to wait for.
                spin: Duration::ZERO,
            },
        )
        .expect("bind");
        std::sync::Mutex::new((s, dir))
    });
    let mut guard = server.lock().unwrap_or_else(|p| p.into_inner());
    let (server, dir) = &mut *guard;
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .expect("socket");
    let addr = rustix::net::SocketAddrUnix::new(dir.path.join("fuzz.sock")).expect("addr");
    rustix::net::connect(&sock, &addr).expect("connect");
    server.run_once(Duration::from_millis(50)).expect("accept");
    let mut sent = 0;
    let mut reply = vec![0u8; 1 << 16];
    // Feed the stream, draining replies so the model never blocks on a full socket.
    for _ in 0..10_000 {
        if sent < data.len() {
            match rustix::io::write(&sock, &data[sent..]) {
                Ok(n) => sent += n,
                Err(rustix::io::Errno::AGAIN) => {}
                Err(_) => break,
            }
            if sent == data.len() {
                let _ = rustix::net::shutdown(&sock, rustix::net::Shutdown::Write);
            }
        }
        while let Ok(n) = rustix::io::read(&sock, &mut reply) {
            if n == 0 {
                break;
            }
        }
        if !server.connected() {
            break;
        }
        server.run_once(Duration::ZERO).expect("serve");
    }
    drop(sock);
    while server.connected() {
        server
            .run_once(Duration::from_millis(1))
            .expect("disconnect");
    }
}

/// Plays a device model whose replies are `data`, to a driver's vfio-user client that
/// connects and then asks for everything a driver asks for at bring-up.
pub fn vfio_user_client(data: &[u8]) {
    let (ours, theirs) = stream_pair();
    // The "server" writes its whole reply stream up front and hangs up: the client reads
    // replies (or garbage) and then end of file, so nothing waits on a timer.
    let writer = {
        let data = data.to_vec();
        std::thread::spawn(move || {
            let mut f = std::fs::File::from(theirs);
            let _ = f.write_all(&data);
        })
    };
    let opts = ClientOptions {
        timeout: Duration::from_millis(100),
        twin_socket: false,
        spin: Duration::ZERO,
        ..Default::default()
    };
    if let Ok(mut c) = Client::from_fd(ours, opts) {
        for index in 0..10 {
            let _ = c.region_info(index);
            let _ = c.region_io_fds(index);
            let _ = c.irq_info(index);
        }
        let mut buf = [0u8; 64];
        let _ = c.region_read(7, 0, &mut buf);
        let _ = c.dma_unmap(0x1000, 0x1000);
    }
    let _ = writer.join();
}

/// A hostile client's writes to a session's shared ring memory, interleaved with the server's
/// ring operations: indices and entries are garbage, the server must notice, never misbehave.
///
/// Input: a sequence of operations, each one byte of opcode and its operands.
pub fn session_ring(data: &[u8]) {
    let mut g = Geometry::of_class(&outboard_block::RINGS, 8, 64 << 10);
    g.rings[1].entries = 16;
    let Ok(region) = Region::create(g.clone()) else {
        return;
    };
    let info = outboard_block::BlockInfo {
        name: "fuzz".into(),
        capacity: 128,
        block_size: 512,
        read_only: false,
        queue_depth: 8,
        max_transfer: 0,
        supports: Default::default(),
    };
    let rng_info = outboard_rng::EntropyInfo {
        name: "fuzz".into(),
        max_read: 4096,
        queue_depth: 8,
    };
    let net_info = outboard_net::NetInfo {
        name: "fuzz".into(),
        mac: [2, 0, 0, 0, 0, 1],
        mtu: 1500,
        link_up: true,
        queue_depth: 8,
        counters: Default::default(),
    };
    let clock_info = outboard_clock::ClockInfo {
        name: "fuzz".into(),
        hz: 1000,
        max_wait: 3_600_000,
    };
    let char_info = outboard_char::CharInfo {
        name: "fuzz".into(),
        max_baud: 115_200,
        fifo: 16,
    };
    let mut sq = region.consumers(Direction::ToServer).remove(0);
    let mut cq = region.producers(Direction::ToClient).remove(0);
    let size = g.control_size();
    let mut i = 0;
    while i < data.len() {
        let op = data[i];
        i += 1;
        match op % 4 {
            // The client writes 4 bytes anywhere in the control region.
            0 if i + 6 <= data.len() => {
                let at = u16::from_le_bytes([data[i], data[i + 1]]) as u64 % (size - 3);
                let v = u32::from_le_bytes(data[i + 2..i + 6].try_into().expect("4 bytes"));
                let _ = region.control.write_u32(at & !3, v);
                i += 6;
            }
            // The server takes an entry and validates it as the block class does.
            1 => {
                let mut e = [0u8; 32];
                if let Ok(true) = sq.pop(&mut e) {
                    if let Ok(r) = outboard_block::Sqe(e).decode() {
                        let _ = outboard_block::validate(&r, &info, g.buffer_size);
                    }
                    // The same bytes as the entropy class's entry, validated as its
                    // dispatcher does.
                    let rng = outboard_rng::Sqe(e[..16].try_into().expect("16 bytes")).decode();
                    let _ = outboard_rng::validate(&rng, &rng_info, g.buffer_size);
                    // And as the net class's.
                    if let Ok(r) = outboard_net::Sqe(e).decode() {
                        let _ = outboard_net::validate(&r, &net_info, g.buffer_size);
                    }
                    // And as the clock class's; its time record as a client reads it.
                    let (_, clock) =
                        outboard_clock::Sqe(e[..16].try_into().expect("16 bytes")).decode();
                    if let Ok(r) = clock {
                        let _ = outboard_clock::validate(&r, &clock_info);
                    }
                    let _ = outboard_clock::decode_time(&e);
                    // And as the char class's; its line record as a client reads it.
                    let (_, line) = outboard_char::Sqe(e).decode();
                    if let Ok(r) = line {
                        let _ = outboard_char::validate(&r, &char_info, g.buffer_size);
                    }
                    let _ = outboard_char::decode_line(&e);
                }
            }
            // The server completes a request.
            2 => {
                let _ = cq.push(&[op; 16]);
            }
            // The client reads what a hostile server wrote: a completion, and the reason the
            // completion says went ahead of it.
            _ => {
                let _ = sq.available();
                let _ = cq.free();
                if let Some(e) = data.get(i..i + REASON_SIZE as usize) {
                    let words = reason::decode(e.try_into().expect("a reason's size"));
                    let c = Completion::decode(e[..16].try_into().expect("16 bytes"));
                    let _ = c.result::<outboard_block::BlockError>(words.clone().map(|w| w.1));
                    let _ = c.result::<outboard_rng::EntropyError>(words.clone().map(|w| w.1));
                    let _ = c.result::<outboard_net::NetError>(words.clone().map(|w| w.1));
                    let _ = c.result::<outboard_clock::ClockError>(words.map(|w| w.1));
                }
            }
        }
    }
}

/// One control-channel message as a server (driver host or manager) receives it.
pub fn control_message(data: &[u8]) {
    use outboard_session::control;
    let (a, b) = rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .expect("socketpair");
    if data.len() <= control::MAX_MESSAGE
        && rustix::net::send(&a, data, rustix::net::SendFlags::DONTWAIT).is_err()
    {
        return;
    }
    let _ = control::recv::<control::Request>(b.as_fd(), Some(Duration::ZERO));
    // The other messages on control channels: replies (to clients), events (to the manager),
    // the manager's own requests.
    let _ = serde_json::from_slice::<control::Reply>(data);
    let _ = serde_json::from_slice::<control::Event>(data);
    let _ = serde_json::from_slice::<outboard_manager::api::Request>(data);
    let _ = serde_json::from_slice::<outboard_manager::api::Reply>(data);
    // A device model's fault socket takes faults as text.
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(f) = text.parse::<outboard_devices::faults::Fault>() {
            // What parses prints back as something that parses to the same fault.
            assert_eq!(
                f.to_string().parse::<outboard_devices::faults::Fault>(),
                Ok(f)
            );
        }
    }
}

/// A machine description as the user writes it.
pub fn machine_description(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = outboard_manager::config::Machine::parse(text, "fuzz.toml");
    }
}

/// What passes between the manager and a child that runs a driver library's code: the
/// description and probe answer the child prints (its last line; the library's code may have
/// written anything), and the probe request the child reads. Each parser answers; a request
/// that parses carries exactly a 256-byte snapshot and says the same when written again.
pub fn driver_library_messages(data: &[u8]) {
    use outboard_drivers::{DescribedLibrary, ProbeAnswer, ProbeRequest};
    let text = String::from_utf8_lossy(data);
    let last = text.lines().last().unwrap_or_default();
    let _ = DescribedLibrary::parse(last);
    let _ = ProbeAnswer::parse(last);
    if let Ok((snapshot, score)) = ProbeRequest::parse(&text) {
        let again = serde_json::to_string(&ProbeRequest::new(&snapshot, score)).expect("JSON");
        assert_eq!(ProbeRequest::parse(&again), Ok((snapshot, score)));
    }
}

/// A packet filter as a net client attaches it, then the frame it runs on: the first byte says
/// how long the program is (in 8-byte instructions), the rest is the frame. The checker must
/// answer, and a program it takes must end on the frame without reading outside it. The same
/// bytes as text go through the `tcpdump -dd` reader.
pub fn packet_filter(data: &[u8]) {
    use outboard_net::bpf::{Program, INSN_SIZE};
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let len = (usize::from(n) * INSN_SIZE).min(rest.len());
    let (program, frame) = rest.split_at(len);
    if let Ok(p) = Program::parse(program) {
        let _ = p.run(frame);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(p) = Program::from_text(text) {
            let _ = p.run(frame);
        }
    }
}

/// A peer's byte stream on a NIC model's stream cable (QEMU's `-netdev stream` framing: a
/// 4-byte big-endian length before each frame), written in pieces and then closed. The model
/// must take the frames the link carries, drop and count the rest, and unplug the cable at a
/// length no link carries or at the end — never panic or hang. The first byte of the input
/// sets the size of the pieces, so frames straddle reads.
pub fn net_stream(data: &[u8]) {
    use outboard_devices::virtio_net::{NetOptions, VirtioNet, Wire};
    use outboard_devices::virtio_pci::VirtioDevice;
    let Some((&piece, data)) = data.split_first() else {
        return;
    };
    let data = &data[..data.len().min(64 << 10)];
    let (ours, theirs) = stream_pair();
    let Ok(wire) = Wire::stream(ours) else {
        return;
    };
    let mut nic = VirtioNet::new(NetOptions::default(), Some(wire));
    let piece = usize::from(piece).max(1) * 16;
    for chunk in data.chunks(piece) {
        // A stream socket pair holds far more than 64 KiB: every write is taken whole. Once
        // the NIC has unplugged the cable the write fails (without SIGPIPE, which libFuzzer's
        // process does not ignore).
        let sent = rustix::net::send(&theirs, chunk, rustix::net::SendFlags::NOSIGNAL);
        if sent.is_err() {
            break;
        }
        nic.input(0);
    }
    drop(theirs);
    // At most one frame of 4 bytes' framing per 4 bytes, 64 a call: bounded.
    for _ in 0..(data.len() / 4 / 64 + 2) {
        if nic.input_fds().is_empty() {
            break;
        }
        nic.input(0);
    }
    assert!(
        nic.input_fds().is_empty(),
        "the cable is unplugged once the peer has hung up"
    );
}

/// An NBD client's whole stream, sent to the export's negotiation and then its transmission
/// phase over a null disk; the export must answer, refuse or hang up — never panic or hang.
pub fn nbd_stream(data: &[u8]) {
    use std::os::unix::net::UnixStream;
    let (a, b) = stream_pair();
    let (mut client, server) = (UnixStream::from(a), UnixStream::from(b));
    let export = outboard_nbd::Export {
        name: "fuzz".into(),
        description: String::new(),
        size: 1 << 20,
        block_size: 512,
        max_payload: 64 << 10,
        read_only: false,
        multi_conn: false,
    };
    let serve = std::thread::spawn(move || {
        let mut s = server;
        let exports = [export];
        if let Ok(outboard_nbd::Outcome::Go { export, structured }) =
            outboard_nbd::negotiate(&mut s, &exports)
        {
            let driver = outboard_drivers::null_blk::NullBlock::new("fuzz", 1 << 20);
            let env = outboard_env::DeviceEnv::virtual_device();
            if let Ok(mut dev) =
                outboard_block_client::Colocated::with_driver(Box::new(driver), &env, 256 << 10)
            {
                let _ =
                    outboard_nbd::transmit::Conn::new(s, &mut dev, &exports[export], structured)
                        .run();
            }
        }
    });
    // The export's answers are drained meanwhile, so it never waits on a full socket.
    let mut reader = client.try_clone().expect("clone");
    let drain = std::thread::spawn(move || {
        let mut sink = [0u8; 64 << 10];
        while matches!(std::io::Read::read(&mut reader, &mut sink), Ok(n) if n > 0) {}
    });
    let _ = client.write_all(data);
    let _ = client.shutdown(std::net::Shutdown::Write);
    serve.join().expect("the export panicked");
    let _ = client.shutdown(std::net::Shutdown::Both);
    drain.join().expect("drain");
}

/// A temporary directory without a dependency for it (the fuzz build links only this crate).
mod tempdir {
    use std::path::PathBuf;

    /// Removed on drop.
    pub struct Dir {
        /// Its path.
        pub path: PathBuf,
    }

    impl Dir {
        pub fn new() -> Self {
            let path = std::env::temp_dir().join(format!(
                "outboard-fuzz-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0)
            ));
            std::fs::create_dir_all(&path).expect("temp dir");
            Self { path }
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}
