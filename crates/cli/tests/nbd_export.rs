//! The NBD export against independent NBD clients — libnbd's `nbdinfo` and `nbdcopy`, QEMU's
//! `qemu-img` and `qemu-io`, fio's `nbd` engine — and against hostile ones, on a machine
//! brought up with `outboard up`.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::nbd::Raw;
use common::{Up, EXE};

/// A 256 MiB disk in a driver server of its own.
const MACHINE: &str = r#"
name = "nbd"
[[device]]
name = "disk0"
model = "virtio-blk"
backing = "mem:256M"
placement = "separate"
"#;

const SIZE: u64 = 256 << 20;

/// `outboard export nbd` running against a machine; killed on drop.
struct Export {
    child: Child,
    socket: PathBuf,
}

impl Export {
    fn start(up: &Up, extra: &[&str]) -> Self {
        let socket = up.dir.join("disk0.nbd");
        let child = export_command(up, &[])
            .arg("--socket")
            .arg(&socket)
            .args(extra)
            .spawn()
            .expect("spawn outboard export");
        assert!(
            common::eventually(Duration::from_secs(20), || outboard_sys::is_live(&socket)),
            "the export did not start listening"
        );
        Self { child, socket }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///disk0?socket={}", self.socket.display())
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tool(cmd: &str, args: &[&str]) -> Output {
    let o = Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e} (is it installed? test.sh installs it)"));
    assert!(
        o.status.success(),
        "{cmd} {args:?}: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn random_image(path: &Path, len: u64, seed: u64) {
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = 1 << 20;
    for i in 0..len / chunk {
        f.write_all(&common::pattern(seed + i, chunk as usize))
            .unwrap();
    }
}

#[test]
fn nbdinfo_lists_the_export_with_its_size_block_sizes_and_abilities() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &[]);
    let o = tool("nbdinfo", &["--json", &ex.uri()]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let e = &v["exports"][0];
    assert_eq!(e["export-name"], "disk0", "{v}");
    assert_eq!(e["export-size"], SIZE, "{v}");
    assert_eq!(e["block_size_minimum"], 512, "{v}");
    assert_eq!(e["block_size_preferred"], 4096, "{v}");
    assert_eq!(e["block_size_maximum"], 4 << 20, "{v}");
    for yes in [
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_multi_conn",
        "can_cache",
    ] {
        assert_eq!(e[yes], true, "{yes}: {v}");
    }
    assert_eq!(e["is_read_only"], false, "{v}");
    // The list names it; a read-only export says so.
    let list = tool("nbdinfo", &["--list", "--json", &ex.uri()]);
    let v: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(v["exports"][0]["export-name"], "disk0", "{v}");
    drop(ex);
    let ro = Export::start(&up, &["--read-only"]);
    let o = tool("nbdinfo", &["--json", &ro.uri()]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["exports"][0]["is_read_only"], true, "{v}");
}

#[test]
fn nbdcopy_moves_a_random_image_in_and_out_byte_identical_and_qemu_img_agrees() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &[]);
    let src = dir.path().join("in.img");
    let back = dir.path().join("out.img");
    random_image(&src, SIZE, 7);
    tool("nbdcopy", &[src.to_str().unwrap(), &ex.uri()]);
    tool("nbdcopy", &[&ex.uri(), back.to_str().unwrap()]);
    let (a, b) = (std::fs::read(&src).unwrap(), std::fs::read(&back).unwrap());
    assert_eq!(a.len(), b.len());
    assert!(a == b, "the image came back different");
    tool(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            src.to_str().unwrap(),
            &ex.uri(),
        ],
    );
}

#[test]
fn qemu_io_reads_writes_discards_and_writes_zeroes() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &[]);
    let o = tool(
        "qemu-io",
        &[
            "-f",
            "raw",
            &ex.uri(),
            "-c",
            "write -P 0xab 0 1M",
            "-c",
            "read -P 0xab 0 1M",
            "-c",
            "write -P 0xcd -f 1M 64k",
            "-c",
            "read -P 0xcd 1M 64k",
            "-c",
            "write -z 4k 8k",
            "-c",
            "read -P 0 4k 8k",
            "-c",
            "read -P 0xab 12k 4k",
            "-c",
            "discard 64k 64k",
            "-c",
            "flush",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(!out.contains("error"), "{out}");
    // What qemu-io wrote is what the device holds, read through the other door.
    let r = up.run(&[
        "blk", "read", "disk0", "--offset", "1048576", "--length", "65536",
    ]);
    assert!(r.status.success());
    assert!(r.stdout.iter().all(|&b| b == 0xcd));
    // A read past the end is refused, and the export goes on.
    let past = Command::new("qemu-io")
        .args(["-f", "raw", &ex.uri(), "-c", &format!("read {SIZE} 4k")])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&past.stdout).to_string() + &String::from_utf8_lossy(&past.stderr);
    assert!(
        text.contains("out of bounds") || text.contains("Invalid") || !past.status.success(),
        "{text}"
    );
    tool(
        "qemu-io",
        &["-f", "raw", &ex.uri(), "-c", "read -P 0xab 0 4k"],
    );
}

#[test]
fn fio_nbd_engine_verified_random_writes_with_several_jobs_and_connections() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &[]);
    let uri = format!("--uri={}", ex.uri());
    let o = tool(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--bs=4k",
            "--size=16M",
            "--offset_increment=32M",
            "--numjobs=4",
            "--iodepth=16",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
            // fio would leave its verify state files in the working directory (the crate).
            "--verify_state_save=0",
            "--output-format=json",
        ],
    );
    let text = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value = serde_json::from_str(&text[text.find('{').unwrap()..]).unwrap();
    for job in v["jobs"].as_array().unwrap() {
        assert_eq!(job["error"], 0, "{job}");
        assert!(
            job["write"]["io_bytes"].as_u64().unwrap() >= 16 << 20,
            "{job}"
        );
    }
}

/// A well-behaved client writing and verifying through its own connection until `stop`.
fn verified_writer(socket: PathBuf, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> u64 {
    let mut c = Raw::go(&socket);
    let mut n = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let data = common::pattern(n, 4096);
        let at = (n % 64) * 4096;
        c.request(1, n, at, 4096, &data);
        assert_eq!(c.reply(0), (0, n, vec![]));
        c.request(0, n, at, 4096, &[]);
        let (e, cookie, got) = c.reply(4096);
        assert_eq!((e, cookie), (0, n));
        assert!(got == data, "read back differs at {at}");
        n += 1;
    }
    n
}

#[test]
fn hostile_clients_get_errors_or_are_cut_off_while_another_client_is_undisturbed() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &[]);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let good = {
        let (s, st) = (ex.socket.clone(), stop.clone());
        std::thread::spawn(move || verified_writer(s, st))
    };

    // Bad magic in the first option: the connection is closed.
    let mut c = Raw::connect(&ex.socket);
    c.hello();
    c.0.write_all(b"NOTNBD!!\0\0\0\x07\0\0\0\0").unwrap();
    assert!(c.closed(), "bad option magic");

    // An option whose length runs past what is sent, then a malformed GO: errors, not a hang.
    let mut c = Raw::connect(&ex.socket);
    c.hello();
    c.option(7, &[0, 0, 0, 200, b'x']);
    let (kind, msg) = c.option_reply();
    assert_eq!(
        kind,
        (1 << 31) + 3,
        "NBD_REP_ERR_INVALID: {}",
        String::from_utf8_lossy(&msg)
    );
    c.option(3, b"junk");
    assert_eq!(c.option_reply().0, (1 << 31) + 3, "LIST with data");
    c.option(0x4242, &[]);
    assert_eq!(c.option_reply().0, (1 << 31) + 1, "unknown option");
    // An option claiming 1 GiB of data: refused and closed.
    let mut b = b"IHAVEOPT".to_vec();
    b.extend_from_slice(&7u32.to_be_bytes());
    b.extend_from_slice(&(1u32 << 30).to_be_bytes());
    c.0.write_all(&b).unwrap();
    assert_eq!(c.option_reply().0, (1 << 31) + 9, "NBD_REP_ERR_TOO_BIG");
    assert!(c.closed());

    // An unknown export.
    let mut c = Raw::connect(&ex.socket);
    c.hello();
    let mut d = 4u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"nope");
    d.extend_from_slice(&0u16.to_be_bytes());
    c.option(7, &d);
    assert_eq!(c.option_reply().0, (1 << 31) + 6, "NBD_REP_ERR_UNKNOWN");

    // In transmission: past the end, unaligned, unknown command, huge lengths.
    let mut c = Raw::go(&ex.socket);
    c.request(0, 1, SIZE, 4096, &[]);
    assert_eq!(c.reply(0).0, 22, "read past the end: EINVAL");
    c.request(1, 2, SIZE - 512, 4096, &[0u8; 4096]);
    assert_eq!(c.reply(0).0, 28, "write past the end: ENOSPC");
    c.request(0, 3, 100, 512, &[]);
    assert_eq!(c.reply(0).0, 22, "unaligned: EINVAL");
    c.request(99, 4, 0, 0, &[]);
    assert_eq!(c.reply(0).0, 22, "unknown command: EINVAL");
    c.request(0, 5, 0, 64 << 20, &[]);
    assert_eq!(c.reply(0).0, 22, "a read longer than the maximum: EINVAL");
    // Still in step: a good request works.
    c.request(0, 6, 0, 512, &[]);
    assert_eq!(c.reply(512).0, 0);
    // A write claiming 1 GiB of payload cannot be skipped: the connection is closed.
    c.request(1, 7, 0, 1 << 30, &[]);
    assert_eq!(c.reply(0).0, 28, "a write past the end: ENOSPC");
    assert!(c.closed());

    // Garbage in place of a request: closed.
    let mut c = Raw::go(&ex.socket);
    c.0.write_all(&[0xff; 28]).unwrap();
    assert!(c.closed());

    // A client that half-closes mid-write, and one that never reads its replies.
    let mut c = Raw::go(&ex.socket);
    c.request(1, 8, 0, 4096, &[1u8; 100]);
    c.0.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(c.closed());
    // The deaf client's replies fill its socket; only its own connection waits on it.
    let mut deaf = Raw::go(&ex.socket);
    deaf.0
        .set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let t = Instant::now();
    for i in 0..2000u64 {
        let mut b = 0x25609513u32.to_be_bytes().to_vec();
        b.extend_from_slice(&[0, 0, 0, 0]);
        b.extend_from_slice(&i.to_be_bytes());
        b.extend_from_slice(&0u64.to_be_bytes());
        b.extend_from_slice(&(64u32 << 10).to_be_bytes());
        if deaf.0.write_all(&b).is_err() || t.elapsed() > Duration::from_secs(3) {
            break;
        }
    }

    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = good.join().expect("the well-behaved client failed");
    assert!(
        rounds > 10,
        "the well-behaved client made no progress ({rounds})"
    );
    drop(deaf);
}

/// The block class's client opens a remote disk by URI through the same API as a local one:
/// `outboard blk` reads and writes `nbd+unix://…` with no manager involved.
#[test]
fn a_remote_disk_opens_by_uri_through_the_block_api() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &[]);
    let uri = ex.uri();
    let data = common::pattern(11, 3 << 20);
    let file = dir.path().join("data");
    std::fs::write(&file, &data).unwrap();
    let nowhere = ["--control", "/nonexistent/control.sock"];
    let run = |args: &[&str]| {
        Command::new(EXE)
            .args(nowhere)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    blk_round_trip(&run, &uri, 1 << 20, &data, &file);
    // What went in through the remote door is on the local device.
    let local = up.run(&[
        "blk", "read", "disk0", "--offset", "1048576", "--length", "4096",
    ]);
    assert_eq!(local.stdout, data[..4096]);
    // A partial-block write over NBD (no range locks there) still lands.
    let p = Command::new(EXE)
        .args(nowhere)
        .args(["blk", "write", &uri, "--offset", "100"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(b"hello")?;
            c.wait_with_output()
        })
        .unwrap();
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let r = run(&["blk", "read", &uri, "--offset", "100", "--length", "5"]);
    assert_eq!(r.stdout, b"hello");
    let info = run(&["blk", "info", &uri]);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(text.contains(&format!("{SIZE} bytes")), "{text}");
    // An export that is not there is named in the error.
    let bad = uri.replace("///disk0", "///nope");
    let o = run(&["blk", "info", &bad]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("nope"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Two network namespaces joined by a veth pair, removed on drop.
struct Netns {
    a: String,
    b: String,
}

impl Netns {
    fn ip(args: &[&str]) {
        let o = Command::new("ip")
            .args(args)
            .output()
            .expect("ip (iproute2)");
        assert!(
            o.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }

    fn new() -> Self {
        let tag = std::process::id() % 100_000;
        let (a, b) = (format!("obexp{tag}"), format!("obcli{tag}"));
        let n = Self { a, b };
        Self::ip(&["netns", "add", &n.a]);
        Self::ip(&["netns", "add", &n.b]);
        let (va, vb) = (format!("obva{tag}"), format!("obvb{tag}"));
        Self::ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb]);
        Self::ip(&["link", "set", &va, "netns", &n.a]);
        Self::ip(&["link", "set", &vb, "netns", &n.b]);
        for (ns, dev, addr) in [(&n.a, &va, "10.213.7.1/24"), (&n.b, &vb, "10.213.7.2/24")] {
            Self::ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
            Self::ip(&["-n", ns, "link", "set", dev, "up"]);
            Self::ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        n
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and with it the other end.
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// Location transparency across machines' worth of separation: the export listens on TCP in
/// one network namespace, the client reads and writes from another, over a veth pair.
#[test]
fn a_remote_disk_across_network_namespaces_over_tcp() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED: network namespaces need root (test.sh runs as root in CI)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let net = Netns::new();
    // The export joins namespace A.
    // Plain TCP beyond loopback, in a namespace of the test's own: only with --insecure.
    let mut export = export_in(&net.a, &up, "10.213.7.1:10809", &["--insecure".into()]);
    let in_b = |args: &[&str]| {
        Command::new("ip")
            .args(["netns", "exec", &net.b])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let uri = "nbd://10.213.7.1:10809/disk0";
    let listening = common::eventually(Duration::from_secs(20), || {
        in_b(&[EXE, "blk", "info", uri]).status.success()
    });
    assert!(
        listening,
        "the export is not reachable across the namespaces"
    );
    let data = common::pattern(21, 1 << 20);
    let file = dir.path().join("data");
    std::fs::write(&file, &data).unwrap();
    let in_b_outboard = |a: &[&str]| in_b(&[&[EXE], a].concat());
    blk_round_trip(&in_b_outboard, uri, 4096, &data, &file);
    let info = in_b(&["nbdinfo", "--json", uri]);
    assert!(
        info.status.success(),
        "{}",
        String::from_utf8_lossy(&info.stderr)
    );
    // The same across the namespaces with TLS: a second export of the disk, certificates for
    // the namespace's address.
    let pki = dir.path().join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    certificates(&pki);
    let mut tls_export = export_in(&net.a, &up, "10.213.7.1:10810", &tls_args(&pki));
    let tls_uri = format!(
        "nbds://10.213.7.1:10810/disk0?tls-certificates={}",
        pki.display()
    );
    let plain = "nbd://10.213.7.1:10810/disk0";
    assert!(
        common::eventually(Duration::from_secs(20), || {
            in_b(&[EXE, "blk", "info", &tls_uri]).status.success()
        }),
        "the TLS export is not reachable across the namespaces"
    );
    blk_reads_back(&in_b_outboard, &tls_uri, 4096, &data);
    let info = in_b(&["nbdinfo", "--json", &tls_uri]);
    assert!(
        info.status.success(),
        "{}",
        String::from_utf8_lossy(&info.stderr)
    );
    // Without TLS, that export answers nothing but "TLS required".
    let refused = in_b(&[EXE, "blk", "info", plain]);
    assert!(!refused.status.success());
    let _ = tls_export.kill();
    let _ = tls_export.wait();
    // Not reachable from the host's own namespace: the traffic stayed on the veth pair.
    let host = Command::new(EXE)
        .args(["blk", "info", uri])
        .output()
        .unwrap();
    assert!(!host.status.success());
    let _ = export.kill();
    let _ = export.wait();
}

/// `[[export]]` tables: `outboard up` starts the exports, and `outboard ls` shows each with its
/// address and the clients connected to it.
#[test]
fn machine_description_exports_start_with_the_machine_and_show_their_clients() {
    let dir = tempfile::tempdir().unwrap();
    let machine = format!(
        "{MACHINE}\n[[export]]\ndevice = \"disk0\"\n\n[[export]]\ndevice = \"disk0\"\nname = \"golden\"\nread_only = true\n"
    );
    let up = Up::start(dir.path(), Some(&machine));
    let running = |name: &str| common::nbd::export_node(&up, name)["props"]["state"] == "running";
    assert!(
        common::eventually(Duration::from_secs(20), || running("disk0")
            && running("golden")),
        "{}",
        common::registry(&up)
    );
    let node = common::nbd::export_node(&up, "disk0");
    let uri = node["props"]["uri"].as_str().unwrap().to_string();
    let socket = PathBuf::from(uri.split_once("socket=").unwrap().1);
    assert_eq!(node["props"]["clients"], 0);
    // A client holding a connection shows; when it leaves, it no longer does.
    let held = Raw::go(&socket);
    assert!(common::eventually(Duration::from_secs(10), || {
        common::nbd::export_node(&up, "disk0")["props"]["clients"] == 1
    }));
    let ls = String::from_utf8_lossy(&up.run(&["ls"]).stdout).to_string();
    assert!(
        ls.contains("export nbd:disk0") && ls.contains("clients=1"),
        "{ls}"
    );
    drop(held);
    assert!(common::eventually(Duration::from_secs(10), || {
        common::nbd::export_node(&up, "disk0")["props"]["clients"] == 0
    }));
    // The read-only export refuses writes with EPERM.
    let golden = common::nbd::export_node(&up, "golden");
    let gsock = PathBuf::from(
        golden["props"]["uri"]
            .as_str()
            .unwrap()
            .split_once("socket=")
            .unwrap()
            .1,
    );
    let mut c = Raw::connect(&gsock);
    c.hello();
    let mut d = 6u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"golden");
    d.extend_from_slice(&0u16.to_be_bytes());
    c.option(7, &d);
    while c.option_reply().0 != 1 {}
    c.request(1, 1, 0, 512, &[0u8; 512]);
    assert_eq!(c.reply(0).0, 1, "EPERM");
}

/// A certificate authority and a server certificate it signed (for localhost, 127.0.0.1 and
/// the test namespace's address), written to `dir`: `ca-cert.pem` (the layout libnbd and QEMU
/// read), `server-cert.pem`, `server-key.pem`; and a second, unrelated authority in `other/`.
fn certificates(dir: &Path) {
    let ca = |name: &str| {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        (cert, key)
    };
    let (ca_cert, ca_key) = ca("Outboard test CA");
    let names = ["localhost", "127.0.0.1", "10.213.7.1"]
        .map(String::from)
        .to_vec();
    let mut p = rcgen::CertificateParams::new(names).unwrap();
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "outboard export");
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
    std::fs::write(dir.join("ca-cert.pem"), ca_cert.pem()).unwrap();
    std::fs::write(dir.join("server-cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("server-key.pem"), key.serialize_pem()).unwrap();
    // A client certificate each authority signed, where libnbd looks for one.
    let client = |dir: &Path, ca_cert: &rcgen::Certificate, ca_key: &rcgen::KeyPair| {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "outboard client");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, ca_cert, ca_key).unwrap();
        std::fs::write(dir.join("client-cert.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("client-key.pem"), key.serialize_pem()).unwrap();
    };
    client(dir, &ca_cert, &ca_key);
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let (other_ca, other_key) = ca("Someone else");
    std::fs::write(other.join("ca-cert.pem"), other_ca.pem()).unwrap();
    // Trusts the export's authority, but holds a certificate of another.
    let forged = dir.join("forged");
    std::fs::create_dir_all(&forged).unwrap();
    std::fs::write(forged.join("ca-cert.pem"), ca_cert.pem()).unwrap();
    client(&forged, &other_ca, &other_key);
    // Trusts the export's authority, holds no certificate.
    let anonymous = dir.join("anonymous");
    std::fs::create_dir_all(&anonymous).unwrap();
    std::fs::write(anonymous.join("ca-cert.pem"), ca_cert.pem()).unwrap();
}

/// `--tls-psk`: libnbd (GnuTLS) with the right identity and key is served; a wrong key or an
/// unknown identity is refused at the handshake.
#[test]
fn a_tls_psk_export_admits_only_clients_with_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.psk");
    std::fs::write(&keys, "alice:0123456789abcdef0123456789abcdef\n").unwrap();
    let wrong = dir.path().join("wrong.psk");
    std::fs::write(&wrong, "alice:ffffffffffffffffffffffffffffffff\n").unwrap();
    let up = Up::start(dir.path(), Some(MACHINE));
    let ex = Export::start(&up, &["--tls-psk", keys.to_str().unwrap()]);
    let uri = |user: &str, file: &Path| {
        format!(
            "nbds+unix://{user}@/disk0?socket={}&tls-psk-file={}",
            ex.socket.display(),
            file.display()
        )
    };
    // Plaintext is refused.
    let mut c = Raw::connect(&ex.socket);
    c.hello();
    c.option(3, &[]);
    assert_eq!(c.option_reply().0, (1 << 31) + 5, "NBD_REP_ERR_TLS_REQD");
    let o = tool("nbdinfo", &["--json", &uri("alice", &keys)]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["exports"][0]["export-size"], SIZE, "{v}");
    // Data moves through it: nbdcopy in and out.
    let data = common::pattern(41, 1 << 20);
    let file = dir.path().join("data");
    std::fs::write(&file, &data).unwrap();
    tool("nbdcopy", &[file.to_str().unwrap(), &uri("alice", &keys)]);
    let back = dir.path().join("back");
    tool("nbdcopy", &[&uri("alice", &keys), back.to_str().unwrap()]);
    assert!(std::fs::read(&back).unwrap()[..data.len()] == data[..]);
    let bob = dir.path().join("bob.psk");
    std::fs::write(&bob, "bob:0123456789abcdef0123456789abcdef\n").unwrap();
    for (who, file) in [("alice", &wrong), ("bob", &bob)] {
        let o = common::run_bounded(
            Command::new("nbdinfo").arg(uri(who, file)),
            Duration::from_secs(20),
        );
        assert!(!o.status.success(), "{who} with {file:?} was served: {o:?}");
    }
}

/// `--tls-verify-peer`: libnbd with a client certificate the authority signed is served; one
/// without a certificate, or with one another authority signed, is refused at the handshake.
#[test]
fn a_tls_export_that_verifies_peers_admits_only_certified_clients() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    certificates(&pki);
    let up = Up::start(dir.path(), Some(MACHINE));
    let mut args = tls_args(&pki);
    args.extend([
        "--tls-verify-peer".into(),
        pki.join("ca-cert.pem").display().to_string(),
    ]);
    let ex = Export::start(&up, &args.iter().map(String::as_str).collect::<Vec<_>>());
    let uri = |certs: &Path| {
        format!(
            "nbds+unix:///disk0?socket={}&tls-certificates={}",
            ex.socket.display(),
            certs.display()
        )
    };
    let o = tool("nbdinfo", &["--json", &uri(&pki)]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["exports"][0]["export-size"], SIZE, "{v}");
    for who in ["anonymous", "forged"] {
        let o = common::run_bounded(
            Command::new("nbdinfo").arg(uri(&pki.join(who))),
            Duration::from_secs(20),
        );
        assert!(!o.status.success(), "{who} was served: {o:?}");
    }
}

fn tls_args(pki: &Path) -> Vec<String> {
    vec![
        "--tls-cert".into(),
        pki.join("server-cert.pem").display().to_string(),
        "--tls-key".into(),
        pki.join("server-key.pem").display().to_string(),
    ]
}

/// An export with `--tls-cert`: a plaintext client is told TLS is required; nbdinfo (GnuTLS)
/// and Outboard's own client (rustls) negotiate STARTTLS and read and write; a client that does
/// not trust the server's authority is refused at the handshake.
#[test]
fn a_tls_export_requires_starttls_and_serves_libnbd_and_the_block_client() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    certificates(&pki);
    let up = Up::start(dir.path(), Some(MACHINE));
    let args = tls_args(&pki);
    let ex = Export::start(&up, &args.iter().map(String::as_str).collect::<Vec<_>>());
    // Plaintext: refused with NBD_REP_ERR_TLS_REQD, before anything else.
    let mut c = Raw::connect(&ex.socket);
    c.hello();
    c.option(3, &[]);
    assert_eq!(c.option_reply().0, (1 << 31) + 5, "NBD_REP_ERR_TLS_REQD");
    let uri = format!(
        "nbds+unix:///disk0?socket={}&tls-certificates={}",
        ex.socket.display(),
        pki.display()
    );
    let o = tool("nbdinfo", &["--json", &uri]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["exports"][0]["export-size"], SIZE, "{v}");
    let data = common::pattern(31, 1 << 20);
    let file = dir.path().join("data");
    std::fs::write(&file, &data).unwrap();
    blk_round_trip(&|a: &[&str]| up.run(a), &uri, 8192, &data, &file);
    let stranger = uri.replace(pki.to_str().unwrap(), pki.join("other").to_str().unwrap());
    let o = up.run(&["blk", "info", &stranger]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("TLS"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Writes `data` at byte `offset` of the disk at `uri` with `outboard blk write` (through `run`,
/// which says where and how `outboard` runs), and reads it back.
fn blk_round_trip(
    run: &dyn Fn(&[&str]) -> Output,
    uri: &str,
    offset: u64,
    data: &[u8],
    file: &Path,
) {
    std::fs::write(file, data).unwrap();
    let at = offset.to_string();
    let w = run(&[
        "blk",
        "write",
        uri,
        "-i",
        file.to_str().unwrap(),
        "--offset",
        &at,
    ]);
    assert!(
        w.status.success(),
        "{uri}: {}",
        String::from_utf8_lossy(&w.stderr)
    );
    blk_reads_back(run, uri, offset, data);
}

/// Reads `data.len()` bytes at `offset` of the disk at `uri` with `outboard blk read`, and
/// checks they are `data`.
fn blk_reads_back(run: &dyn Fn(&[&str]) -> Output, uri: &str, offset: u64, data: &[u8]) {
    let (at, len) = (offset.to_string(), data.len().to_string());
    let r = run(&["blk", "read", uri, "--offset", &at, "--length", &len]);
    assert!(
        r.status.success(),
        "{uri}: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(r.stdout == data, "{uri}: the data read back differs");
}

/// `outboard export nbd disk0` listening on `addr` inside network namespace `ns`, with
/// `extra` arguments; the machine's sockets are UNIX sockets in the file system, reachable from
/// any network namespace.
fn export_in(ns: &str, up: &Up, addr: &str, extra: &[String]) -> Child {
    export_command(up, &["ip", "netns", "exec", ns])
        .args(["--listen", addr])
        .args(extra)
        .spawn()
        .unwrap()
}

/// `outboard export nbd disk0` for `up`'s machine, run through `wrapper` (a program and its
/// arguments, or nothing); the caller adds where it listens.
fn export_command(up: &Up, wrapper: &[&str]) -> Command {
    let (program, before) = match wrapper.split_first() {
        Some((p, rest)) => (*p, rest),
        None => (EXE, &[][..]),
    };
    let mut c = Command::new(program);
    c.args(before);
    if !wrapper.is_empty() {
        c.arg(EXE);
    }
    c.args(["export", "nbd", "disk0"])
        .env("OUTBOARD_CONTROL", &up.control)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    c
}
