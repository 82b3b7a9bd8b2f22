//! A process confined the way driver servers and device models are cannot do what a
//! compromised driver would; the same process unconfined can (so the probe can tell).
//!
//! Each case runs in a child: this test binary again, running only `probe_child`.

use std::os::unix::net::UnixListener;
use std::process::{Child, Command, Stdio};

const MODE: &str = "OUTBOARD_PROBE_MODE";

/// As a child: a thread started before Landlock, then Landlock alone (no seccomp filter, so
/// only Landlock can refuse), then that older thread tries to read a file.
#[test]
fn older_thread_child() {
    let Ok(file) = std::env::var("OUTBOARD_OLDER_THREAD_FILE") else {
        return;
    };
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let older = std::thread::spawn(move || {
        wait.recv().unwrap();
        match std::fs::read(&file) {
            Ok(_) => "older thread: read the file".to_string(),
            Err(e) => format!("older thread: refused: {e}"),
        }
    });
    let (how, complete) = outboard_confine::sandbox::restrict().expect("landlock");
    println!("landlock {how} (complete: {complete})");
    go.send(()).unwrap();
    println!("{}", older.join().unwrap());
}

/// As a child: a thread older than Landlock that blocks the signal it is asked with and ends
/// before it ever takes it — it never answers, and holds nothing once it has ended.
#[test]
fn ending_thread_child() {
    if std::env::var("OUTBOARD_ENDING_THREAD").is_err() {
        return;
    }
    let (ready, started) = std::sync::mpsc::channel::<()>();
    let ending = std::thread::spawn(move || {
        // SAFETY: a signal set on this stack, initialised by sigemptyset before use; the mask
        // changes for this thread only.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGRTMIN());
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        }
        ready.send(()).unwrap();
        // Long enough to be asked, far shorter than the asker's two seconds.
        std::thread::sleep(std::time::Duration::from_millis(100));
    });
    started.recv().unwrap();
    match outboard_confine::sandbox::restrict() {
        Ok((how, _)) => println!("restricted: {how}"),
        Err(e) => println!("refused: {e}"),
    }
    ending.join().unwrap();
}

/// The probe itself, when this binary runs as a child; a no-op otherwise.
#[test]
fn probe_child() {
    let Ok(mode) = std::env::var(MODE) else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap();
    let targets = outboard_confine::probe::Targets {
        file: var("OUTBOARD_PROBE_FILE").into(),
        socket: var("OUTBOARD_PROBE_SOCKET").into(),
        pid: var("OUTBOARD_PROBE_PID").parse().unwrap(),
    };
    let role = match mode.as_str() {
        "confined" => Some(outboard_confine::Role::DriverServer { vfio: false }),
        "confined-model" => Some(outboard_confine::Role::DeviceModel),
        "confined-export" => Some(outboard_confine::Role::Export { dials: false }),
        _ => None,
    };
    if let Some(role) = role {
        let report = outboard_confine::confine(role, Default::default()).expect("confine");
        println!("{report}");
    }
    if mode == "confined-early" {
        // Confined early, then what a standby does before it serves (start a thread, name
        // it), then finished: from there, refused like any confined server.
        let early = outboard_confine::confine_early(
            outboard_confine::Role::DriverServer { vfio: false },
            Default::default(),
        )
        .expect("confine early");
        println!("before the finish, a thread: {}", thread_result());
        let report = early.finish().expect("finish");
        println!("{report}");
        println!("after the finish, a thread: {}", thread_result());
        println!("after the finish, prctl: {}", errno_of(prctl_name()));
        println!("after the finish, prlimit: {}", errno_of(lower_own_limit()));
    }
    let all = outboard_confine::probe::attempts(&targets, |a| println!("{a}"));
    println!(
        "refused {}/{}",
        all.iter().filter(|a| a.denied()).count(),
        all.len()
    );
}

/// Starts a named thread and joins it: "ok" or the error number.
fn thread_result() -> String {
    errno_of(
        std::thread::Builder::new()
            .name("bring-up".into())
            .spawn(|| ())
            .and_then(|t| t.join().map_err(|_| std::io::Error::other("panicked"))),
    )
}

fn errno_of(r: std::io::Result<()>) -> String {
    match r {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("errno {}", e.raw_os_error().unwrap_or(0)),
    }
}

/// `prctl(PR_SET_NAME)` of the calling thread.
fn prctl_name() -> std::io::Result<()> {
    // SAFETY: PR_SET_NAME reads a NUL-terminated name of at most 16 bytes from the pointer,
    // which points at a static string.
    let rc = unsafe { libc::prctl(libc::PR_SET_NAME, c"probe".as_ptr(), 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Reads this process's own core-file limit with `prlimit64` (the call the early filter
/// allows on the process itself; harmless if allowed).
fn lower_own_limit() -> std::io::Result<()> {
    // SAFETY: `prlimit` of this process (pid 0) writes one rlimit into `old`, which lives
    // across the call; no new limit is passed.
    let rc = unsafe {
        let mut old: libc::rlimit = std::mem::zeroed();
        libc::prlimit(0, libc::RLIMIT_CORE, std::ptr::null(), &mut old)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// As a child: confined as an export, then what an export needs and what it must not do.
#[test]
fn export_child() {
    let Ok(socket) = std::env::var("OUTBOARD_EXPORT_SOCKET") else {
        return;
    };
    let file = std::env::var("OUTBOARD_EXPORT_FILE").unwrap();
    let report = outboard_confine::confine(
        outboard_confine::Role::Export { dials: true },
        Default::default(),
    )
    .expect("confine");
    println!("{report}");
    let errno = |r: std::io::Result<()>| match r {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("errno {}", e.raw_os_error().unwrap_or(0)),
    };
    let last = || std::io::Error::last_os_error();
    println!(
        "thread: {}",
        errno(
            std::thread::Builder::new()
                .name("conn".into())
                .spawn(|| ())
                .and_then(|t| t.join().map_err(|_| std::io::Error::other("panicked")))
        )
    );
    println!(
        "unix connect: {}",
        errno(std::os::unix::net::UnixStream::connect(&socket).map(drop))
    );
    println!("open: {}", errno(std::fs::File::open(&file).map(drop)));
    // SAFETY: plain system calls on no memory of ours (descriptor -1, null pointers); a
    // fork that is let through exits at once in the child.
    unsafe {
        let r = |v: libc::c_long| if v < 0 { Err(last()) } else { Ok(()) };
        println!(
            "tcp socket: {}",
            errno(r(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) as _))
        );
        println!(
            "netlink socket: {}",
            errno(r(libc::socket(libc::AF_NETLINK, libc::SOCK_RAW, 0) as _))
        );
        let pid = libc::syscall(libc::SYS_clone, libc::SIGCHLD as libc::c_long, 0, 0, 0, 0);
        if pid == 0 {
            libc::_exit(0);
        }
        println!("fork: {}", errno(r(pid)));
        println!(
            "clone3: {}",
            errno(r(libc::syscall(
                libc::SYS_clone3,
                std::ptr::null::<u8>(),
                0
            )))
        );
        println!(
            "dumpable again: {}",
            errno(r(libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) as _))
        );
        println!(
            "ioctl FIFREEZE: {}",
            errno(r(libc::ioctl(-1, 0xc004_5877u64 as _, 0) as _))
        );
        println!(
            "fcntl F_SETOWN: {}",
            errno(r(libc::fcntl(-1, libc::F_SETOWN, 1) as _))
        );
    }
    // Then everything else a compromised driver would try (the probe's last attempt, execve,
    // would replace this process if let through: it comes last).
    let targets = outboard_confine::probe::Targets {
        file: file.into(),
        socket: socket.into(),
        pid: std::env::var("OUTBOARD_EXPORT_PID")
            .unwrap()
            .parse()
            .unwrap(),
    };
    for a in outboard_confine::probe::attempts(&targets, |_| ()) {
        println!("probe {a}");
    }
}

#[test]
fn an_export_starts_threads_and_reaches_unix_sockets_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("secret");
    std::fs::write(&file, "secret").unwrap();
    let socket = dir.path().join("server.sock");
    let _listener = UnixListener::bind(&socket).unwrap();
    let victim = Victim(Command::new("sleep").arg("30").spawn().unwrap());
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "export_child", "--nocapture", "--test-threads=1"])
        .env("OUTBOARD_EXPORT_SOCKET", &socket)
        .env("OUTBOARD_EXPORT_FILE", &file)
        .env("OUTBOARD_EXPORT_PID", victim.0.id().to_string())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).replace("test export_child ... ", "");
    let said = |what: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{what}: ")))
            .unwrap_or_else(|| panic!("no {what:?} line:\n{text}"))
            .to_string()
    };
    let eperm = format!("errno {}", libc::EPERM);
    assert!(said("confined").starts_with("seccomp allow-list"), "{text}");
    assert_eq!(said("thread"), "ok", "{text}");
    assert_eq!(said("unix connect"), "ok", "{text}");
    for refused in [
        "open",
        "tcp socket",
        "netlink socket",
        "fork",
        "dumpable again",
        "ioctl FIFREEZE",
        "fcntl F_SETOWN",
    ] {
        assert_eq!(said(refused), eperm, "{refused}\n{text}");
    }
    // Not EPERM: the C library falls back to clone only on ENOSYS.
    assert_eq!(said("clone3"), format!("errno {}", libc::ENOSYS), "{text}");
    // Every other attempt of the probe is refused: only a UNIX socket and its connection,
    // which an export started by hand needs, go through.
    let probes: Vec<&str> = text.lines().filter(|l| l.starts_with("probe ")).collect();
    assert_eq!(
        probes.len(),
        outboard_confine::probe::count(),
        "every attempt is reported:\n{text}"
    );
    for l in probes {
        let needed =
            l.starts_with("probe connect to ") || l.starts_with("probe create a UNIX socket");
        assert_eq!(l.contains(": ALLOWED"), needed, "{l}\n{text}");
    }
}

struct Victim(Child);
impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run(mode: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("secret");
    std::fs::write(&file, "secret").unwrap();
    let socket = dir.path().join("other-device.sock");
    let _listener = UnixListener::bind(&socket).unwrap();
    let victim = Victim(Command::new("sleep").arg("30").spawn().unwrap());
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "probe_child", "--nocapture", "--test-threads=1"])
        .env(MODE, mode)
        .env("OUTBOARD_PROBE_FILE", &file)
        .env("OUTBOARD_PROBE_SOCKET", &socket)
        .env("OUTBOARD_PROBE_PID", victim.0.id().to_string())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    // The test harness puts its own words before the first line.
    let text = String::from_utf8_lossy(&out.stdout).replace("test probe_child ... ", "");
    assert!(
        !dir.path().join("outboard-escape").exists() || mode != "confined",
        "a confined process created a file:\n{text}"
    );
    text
}

#[test]
fn a_confined_process_is_refused_every_escape() {
    refused_every_escape("confined");
}

/// A standby's confinement: begun before it waits (threads still allowed, and used), finished
/// before it serves — then refused every escape like a server confined at once, and the
/// calls the early filter still allowed are refused too.
#[test]
fn a_process_confined_early_and_finished_is_refused_every_escape_and_its_extras() {
    let out = refused_every_escape("confined-early");
    assert!(out.contains("before the finish, a thread: ok"), "{out}");
    for what in ["a thread", "prctl", "prlimit"] {
        assert!(
            out.contains(&format!("after the finish, {what}: errno 1")),
            "{what}:\n{out}"
        );
    }
    // The same report as a server confined at once: nproc=0 included.
    assert!(out.contains("nproc=0"), "{out}");
}

#[test]
fn a_confined_device_model_is_refused_every_escape() {
    refused_every_escape("confined-model");
}

/// The export the manager starts: it gets its connections from the manager, so even a UNIX
/// socket is out of its reach.
#[test]
fn a_confined_managed_export_is_refused_every_escape() {
    refused_every_escape("confined-export");
}

fn refused_every_escape(mode: &str) -> String {
    let out = run(mode);
    assert!(out.contains("confined: seccomp allow-list of"), "{out}");
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(": denied") || l.contains(": ALLOWED"))
        .collect();
    let n = outboard_confine::probe::count();
    assert_eq!(lines.len(), n, "every attempt is reported:\n{out}");
    for l in &lines {
        assert!(l.contains(": denied ("), "not refused: {l}\n{out}");
    }
    assert!(out.contains(&format!("refused {n}/{n}")), "{out}");
    // Refused by the allow-list, not by chance (a missing file, a dead socket).
    for what in [
        "open ",
        "connect to ",
        "create a UNIX socket",
        "ptrace pid",
        "execve",
        "stat /",
        "ioctl FIFREEZE",
        "ioctl FS_IOC_SETFLAGS",
        "ioctl SIOCSIFFLAGS",
        "ioctl TIOCSTI",
        "fcntl F_SETOWN",
        "fcntl F_SETSIG",
        "fcntl F_SETLEASE",
        "fcntl F_NOTIFY",
    ] {
        let l = lines.iter().find(|l| l.starts_with(what)).unwrap();
        assert!(l.contains("Operation not permitted"), "{l}\n{out}");
    }
    out
}

#[test]
fn the_same_process_unconfined_gets_through_so_the_probe_can_tell() {
    let out = run("free");
    for what in [
        "open ",
        "create a file in ",
        "connect to ",
        "create a UNIX socket",
        "signal pid",
        "ptrace pid",
        "stat /",
        // Aimed at descriptor -1: unfiltered, each reaches the kernel (EBADF).
        "ioctl FIFREEZE",
        "ioctl SIOCSIFFLAGS",
        "fcntl F_SETOWN",
        "fcntl F_NOTIFY",
        "start a process",
    ] {
        let l = out
            .lines()
            .find(|l| l.starts_with(what))
            .unwrap_or_else(|| panic!("no {what:?} line:\n{out}"));
        assert!(l.ends_with(": ALLOWED"), "{l}\n{out}");
    }
    // execve worked: the process became /bin/true before it could report the rest.
    assert!(!out.contains("refused "), "{out}");
}

#[test]
fn landlock_holds_on_threads_started_before_it() {
    if outboard_confine::sandbox::kernel_abi() < 1 {
        eprintln!("no Landlock in this kernel: nothing to check");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("secret");
    std::fs::write(&file, "secret").unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "older_thread_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("OUTBOARD_OLDER_THREAD_FILE", &file)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("older thread: refused"), "{text}");
    assert!(text.contains("complete: true"), "{text}");
}

#[test]
fn a_thread_that_ends_without_answering_does_not_fail_confinement() {
    if outboard_confine::sandbox::kernel_abi() < 1 {
        eprintln!("no Landlock in this kernel: nothing to check");
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "ending_thread_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("OUTBOARD_ENDING_THREAD", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("restricted: "), "{text}");
}
