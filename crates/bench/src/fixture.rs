//! What a test runs against: a disk image, the device model and driver server processes, and
//! the kernel's loop device over the same image.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process, killed on drop.
pub struct Proc {
    child: Child,
    /// Its pid (for CPU accounting).
    pub pid: u32,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        );
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether a socket bound at `path` listens (`/proc/net/unix` flags it `__SO_ACCEPTCON`). A
/// socket file exists from `bind`, before `listen`: a client that connects in between is
/// refused, so the file alone does not say the server is ready. Looked up without connecting,
/// which a device model would take for its client.
fn listening(path: &Path) -> bool {
    const ACCEPTCON: u32 = 0x0001_0000;
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return true;
    };
    let want = path.to_string_lossy();
    table.lines().skip(1).any(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        cols.len() >= 8
            && cols[7] == want
            && u32::from_str_radix(cols[3], 16).is_ok_and(|f| f & ACCEPTCON != 0)
    })
}

/// Runs Outboard (`exe args…`) and waits for `ready` to exist: Outboard's sockets appear at
/// their paths only once they listen.
pub fn spawn(exe: &Path, args: &[String], ready: &Path) -> Result<Proc, String> {
    start(exe, args, ready, false)
}

/// Runs another program (`exe args…`) and waits for `ready` to exist and, for a socket, to
/// listen: it may bind at the path before it listens.
pub fn spawn_foreign(exe: &Path, args: &[String], ready: &Path) -> Result<Proc, String> {
    start(exe, args, ready, true)
}

/// Where a started program's diagnostics go: nowhere, or with `OUTBOARD_BENCH_LOGS=DIR` a
/// file of its own in `DIR` (`<program>-<pid of the bench>-<n>.log`), to find out afterwards
/// why a run went wrong.
fn log_for(exe: &Path) -> Result<Stdio, String> {
    static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let Some(dir) = std::env::var_os("OUTBOARD_BENCH_LOGS") else {
        return Ok(Stdio::null());
    };
    let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = exe
        .file_name()
        .map_or("program".into(), |n| n.to_string_lossy());
    let path = Path::new(&dir).join(format!("{name}-{}-{n}.log", std::process::id()));
    std::fs::File::create(&path)
        .map(Stdio::from)
        .map_err(|e| format!("OUTBOARD_BENCH_LOGS: {}: {e}", path.display()))
}

/// Removes a test's work directory; with `OUTBOARD_BENCH_LOGS=DIR`, its logs (the manager's
/// children's, `*.log` anywhere in it) are copied to `DIR/<its name>/` first.
pub fn remove_work_dir(dir: &Path) {
    if let Some(logs) = std::env::var_os("OUTBOARD_BENCH_LOGS") {
        let to = Path::new(&logs).join(dir.file_name().unwrap_or_default());
        copy_logs(dir, &to, 4);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Copies the `*.log` files under `from` (`depth` levels down at most) into `to`.
fn copy_logs(from: &Path, to: &Path, depth: u32) {
    for e in std::fs::read_dir(from).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() && depth > 0 {
            copy_logs(&p, &to.join(e.file_name()), depth - 1);
        } else if p.extension().is_some_and(|x| x == "log") {
            let _ = std::fs::create_dir_all(to);
            let _ = std::fs::copy(&p, to.join(e.file_name()));
        }
    }
}

fn start(exe: &Path, args: &[String], ready: &Path, foreign: bool) -> Result<Proc, String> {
    let _ = std::fs::remove_file(ready);
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_for(exe)?)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", exe.display()))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let is_ready = || {
        ready.exists()
            && (!foreign
                || !std::fs::metadata(ready)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                || listening(ready))
    };
    while !is_ready() {
        if let Ok(Some(st)) = child.try_wait() {
            return Err(format!("{args:?} exited early ({st})"));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err(format!("{args:?} did not become ready"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = child.id();
    Ok(Proc { child, pid })
}

/// The work directory and disk image shared by every configuration of a test.
pub struct Fixture {
    /// Work directory (removed on drop).
    pub dir: PathBuf,
    /// The image every configuration reads.
    pub image: PathBuf,
    /// Its size.
    pub bytes: u64,
    exe: PathBuf,
}

impl Fixture {
    /// Creates an image of `bytes` bytes filled with a pattern, and reads it once so every
    /// configuration starts from a warm page cache.
    pub fn new(exe: &Path, bytes: u64) -> Result<Self, String> {
        let dir =
            std::env::temp_dir().join(format!("outboard-bench-{}-{}", std::process::id(), bytes));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let image = dir.join("disk.img");
        let mut f = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&image)
            .map_err(|e| e.to_string())?;
        let chunk: Vec<u8> = (0..1 << 20)
            .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            f.write_all(&chunk[..n]).map_err(|e| e.to_string())?;
            left -= n as u64;
        }
        f.sync_all().map_err(|e| e.to_string())?;
        let mut sink = vec![0u8; 1 << 20];
        let mut r = std::fs::File::open(&image).map_err(|e| e.to_string())?;
        while r.read(&mut sink).map_err(|e| e.to_string())? > 0 {}
        Ok(Self {
            dir,
            image,
            bytes,
            exe: exe.to_owned(),
        })
    }

    /// Starts the virtio-blk device model over the image; returns it and its socket.
    pub fn device(&self) -> Result<(Proc, PathBuf), String> {
        let sock = self.dir.join("dev.sock");
        let args = [
            "device",
            "virtio-blk",
            "--socket",
            sock.to_str().unwrap(),
            "--backing",
            self.image.to_str().unwrap(),
        ];
        let p = spawn(&self.exe, &args.map(String::from), &sock)?;
        Ok((p, sock))
    }

    /// Starts a driver server for `device` (`NAME=SPEC`) with the given adaptive spin.
    pub fn host(&self, device: &str, spin_us: u64) -> Result<(Proc, PathBuf), String> {
        self.host_named("host", device, spin_us, &[])
    }

    /// [`Fixture::host`] on socket `NAME.sock`, with `extra` arguments.
    pub fn host_named(
        &self,
        name: &str,
        device: &str,
        spin_us: u64,
        extra: &[&str],
    ) -> Result<(Proc, PathBuf), String> {
        let sock = self.dir.join(format!("{name}.sock"));
        let mut args = vec![
            "driver-host".to_string(),
            "--listen".into(),
            sock.display().to_string(),
            "--device".into(),
            device.into(),
            "--spin-us".into(),
            spin_us.to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let p = spawn(&self.exe, &args, &sock)?;
        Ok((p, sock))
    }

    /// Attaches the image to a kernel loop device.
    pub fn loop_device(&self) -> Result<LoopDev, String> {
        LoopDev::attach(&self.image)
    }
}

impl LoopDev {
    /// Attaches `file` to a free loop device (needs root).
    pub fn attach(file: &Path) -> Result<LoopDev, String> {
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(file)
            .output()
            .map_err(|e| format!("losetup: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "losetup: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
        Ok(LoopDev { path })
    }
}

impl Fixture {
    /// The `outboard` executable.
    pub fn exe(&self) -> &Path {
        &self.exe
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        remove_work_dir(&self.dir);
    }
}

/// A loop device, detached on drop.
pub struct LoopDev {
    /// `/dev/loopN`.
    pub path: PathBuf,
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.path).output();
    }
}

/// Brings up a machine (`outboard up`) from `description` in `dir`, and waits until every one
/// of `sockets` (its exports) is listening.
pub fn machine(
    exe: &Path,
    dir: &Path,
    description: &str,
    sockets: &[PathBuf],
) -> Result<Proc, String> {
    let file = dir.join("machine.toml");
    std::fs::write(&file, description).map_err(|e| format!("{}: {e}", file.display()))?;
    let args = [
        "--control".to_string(),
        dir.join("control.sock").display().to_string(),
        "up".into(),
        "--machine".into(),
        file.display().to_string(),
        "--runtime-dir".into(),
        dir.join("rt").display().to_string(),
    ];
    let up = spawn(exe, &args, &dir.join("control.sock"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !sockets.iter().all(|s| outboard_sys::is_live(s)) {
        if Instant::now() > deadline {
            return Err("the machine's exports did not start listening".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(up)
}

/// Sends `sigs` to `pid` only if it is a child of `parent` (the machine the benchmark
/// started): through one pidfd, so the pid checked is the one signalled even if it is reused,
/// and a signal after one that killed it reaches nobody. Each signal after the first waits
/// until the one before was taken: two of a kind pending at once are one.
pub fn signal_child_of(
    parent: u32,
    pid: i32,
    sigs: &[rustix::process::Signal],
) -> Result<(), String> {
    let p = rustix::process::Pid::from_raw(pid).ok_or("no such pid")?;
    let fd = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty())
        .map_err(|e| format!("pidfd_open {pid}: {e}"))?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| e.to_string())?;
    let ppid = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u32>().ok());
    if ppid != Some(parent) {
        return Err(format!("pid {pid} is not the machine's child"));
    }
    for (i, sig) in sigs.iter().enumerate() {
        if i > 0 && !taken(pid, &fd, sigs[i - 1]) {
            // It died of the one before.
            return Ok(());
        }
        match rustix::process::pidfd_send_signal(&fd, *sig) {
            Ok(()) => {}
            // The one before killed it.
            Err(rustix::io::Errno::SRCH) if i > 0 => return Ok(()),
            Err(e) => return Err(format!("signal {pid}: {e}")),
        }
    }
    Ok(())
}

/// Waits (up to a second) until process `pid` (held by `fd`) has taken the `sig` sent to it:
/// no longer pending, and no longer caught (Rust's runtime resets SIGSEGV's handler in it).
/// False if it died meanwhile.
fn taken(pid: i32, fd: &std::os::fd::OwnedFd, sig: rustix::process::Signal) -> bool {
    let bit = 1u64 << (sig.as_raw() - 1);
    let field = |status: &str, name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        let mut p = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
        if rustix::event::poll(&mut p, Some(&rustix::time::Timespec::default())) == Ok(1) {
            return false;
        }
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return false;
        };
        let pending = field(&status, "SigPnd:") | field(&status, "ShdPnd:");
        if pending & bit == 0 && field(&status, "SigCgt:") & bit == 0 {
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    true
}

#[cfg(test)]
mod listening_tests {
    use super::listening;
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

    #[test]
    fn a_bound_socket_is_ready_only_once_it_listens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::bind(&fd, &SocketAddrUnix::new(&path).unwrap()).unwrap();
        assert!(path.exists());
        assert!(!listening(&path), "bound, not yet listening");
        rustix::net::listen(&fd, 4).unwrap();
        assert!(listening(&path));
    }
}
