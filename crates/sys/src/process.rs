//! Process plumbing: children that die with their parent, descriptors passed across exec,
//! the default SIGPIPE action. The `unsafe` that such plumbing needs lives here, each block with
//! the reason it is sound.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use rustix::io::Errno;
use rustix::process::Signal;

/// Most descriptors [`die_with_parent`] passes.
pub const MAX_PASSED: usize = 8;

/// Makes the child of `cmd` die (SIGKILL) when this process dies, even by SIGKILL, and find
/// `pass[i]` as fd `3 + i` (without close-on-exec). No other descriptor of this process
/// reaches the child beyond its standard three. The caller keeps `pass` open until the child
/// is spawned. At most [`MAX_PASSED`] descriptors.
pub fn die_with_parent(cmd: &mut Command, pass: &[BorrowedFd<'_>]) -> Result<(), String> {
    if pass.len() > MAX_PASSED {
        return Err(format!(
            "{} descriptors to pass; at most {MAX_PASSED}",
            pass.len()
        ));
    }
    let parent = rustix::process::getpid();
    let mut raw = [-1i32; MAX_PASSED];
    for (r, fd) in raw.iter_mut().zip(pass) {
        *r = fd.as_raw_fd();
    }
    let n = pass.len();
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-
    // safe calls are allowed; it makes raw system calls only (prctl, getppid, fcntl, dup2 and
    // close_range on descriptors the caller keeps open until after the spawn) and allocates
    // nothing: `raw` is a fixed array copied into the closure.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
            // The parent may have died before the line above took effect.
            if rustix::process::getppid() != Some(parent) {
                return Err(Errno::SRCH.into());
            }
            // Out of the way first: a source may sit where another one goes.
            let mut staged = [-1i32; MAX_PASSED];
            for i in 0..n {
                staged[i] = libc::fcntl(raw[i], libc::F_DUPFD_CLOEXEC, 3 + MAX_PASSED as i32);
                if staged[i] < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (i, &fd) in staged.iter().enumerate().take(n) {
                // A duplicate made by dup2 does not inherit close-on-exec.
                if libc::dup2(fd, 3 + i as i32) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Everything else this process holds stays here: descriptors inherited from
            // whoever started the manager, other children's channels, disks, the staged
            // copies. Marked close-on-exec rather than closed, so the exec-error pipe works.
            if libc::syscall(
                libc::SYS_close_range,
                (3 + n) as libc::c_uint,
                libc::c_uint::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            ) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// Descriptors taken over with [`inherited_socket`] or [`inherited_file`]: each is owned once.
static TAKEN: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

/// Takes ownership of fd `n` inherited from the parent, after checking that it is an open
/// socket (what a parent passes for a channel).
pub fn inherited_socket(n: i32) -> Result<OwnedFd, String> {
    inherited(n, rustix::fs::FileType::Socket, "a socket")
}

/// Takes ownership of fd `n` inherited from the parent, after checking that it is an open
/// regular file or memfd (what a parent passes as a disk's backing).
pub fn inherited_file(n: i32) -> Result<OwnedFd, String> {
    inherited(n, rustix::fs::FileType::RegularFile, "a file")
}

/// Takes ownership of fd `n` inherited from the parent, after checking that it is an open
/// character device (a TAP interface the parent made).
pub fn inherited_device(n: i32) -> Result<OwnedFd, String> {
    inherited(
        n,
        rustix::fs::FileType::CharacterDevice,
        "a character device",
    )
}

/// Takes the socket inherited as fd `n` and moves it to the lowest free number from `min`
/// up, leaving `n` free for a descriptor [`place`] puts there later (a standby's hand-over
/// socket, in the way of the numbers its hand-over fills).
pub fn inherited_socket_moved(n: i32, min: i32) -> Result<OwnedFd, String> {
    let fd = inherited(n, rustix::fs::FileType::Socket, "a socket")?;
    let moved = rustix::io::fcntl_dupfd_cloexec(&fd, min).map_err(|e| format!("fd {n}: {e}"))?;
    drop(fd);
    // The number is free again, to be taken once more.
    let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    taken.retain(|&t| t != n);
    Ok(moved)
}

fn inherited(n: i32, kind: rustix::fs::FileType, what: &str) -> Result<OwnedFd, String> {
    if n <= 2 {
        return Err(format!("fd {n}: not a descriptor a parent passes"));
    }
    // Held across the checks and the take: two threads cannot both take `n`.
    let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    if taken.contains(&n) {
        return Err(format!("fd {n}: taken over already"));
    }
    // SAFETY: only borrowed for the checks below; nothing is closed through it.
    let borrowed = unsafe { BorrowedFd::borrow_raw(n) };
    rustix::io::fcntl_getfd(borrowed).map_err(|e| format!("fd {n}: {e}"))?;
    let st = rustix::fs::fstat(borrowed).map_err(|e| format!("fd {n}: {e}"))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != kind {
        return Err(format!("fd {n}: not {what}"));
    }
    taken.push(n);
    // SAFETY: the fd is open (checked above) and was inherited across exec to be owned here:
    // no other owner exists in this process, since `TAKEN` lets each number be taken once.
    let fd = unsafe { OwnedFd::from_raw_fd(n) };
    // Not handed on to anything this process starts.
    rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)
        .map_err(|e| format!("fd {n}: {e}"))?;
    Ok(fd)
}

/// Puts each of `fds` at the number `slots` gives it, where a child started with them
/// would have found them, for [`inherited_socket`] and the like to take over: a standby
/// process handed descriptors over a socket after it started. Each slot must be above 2 and
/// free in this process (nothing is closed to make room). Call it while this process has one
/// thread, as at start-up: another thread could open a slot between the check and the copy.
pub fn place(fds: Vec<OwnedFd>, slots: &[i32]) -> Result<(), String> {
    if fds.len() != slots.len() {
        return Err(format!(
            "{} descriptors for {} places",
            fds.len(),
            slots.len()
        ));
    }
    // Out of the way first, above every slot: a descriptor may have arrived where another one
    // goes.
    let above = slots.iter().copied().max().unwrap_or(2).max(2) + 1;
    let staged = fds
        .iter()
        .map(|fd| rustix::io::fcntl_dupfd_cloexec(fd, above))
        .collect::<Result<Vec<OwnedFd>, _>>()
        .map_err(|e| format!("moving a received descriptor: {e}"))?;
    drop(fds);
    for (i, (fd, &slot)) in staged.iter().zip(slots).enumerate() {
        if slot <= 2 || slots[..i].contains(&slot) {
            return Err(format!("fd {slot}: not a place for a passed descriptor"));
        }
        // SAFETY: a plain system call on a number, which may well be closed (then it answers
        // EBADF); no Rust object is made for it, so nothing can be owned, borrowed or closed
        // through it.
        if unsafe { libc::fcntl(slot, libc::F_GETFD) } >= 0 {
            return Err(format!("fd {slot}: in use already"));
        }
        // SAFETY: a plain system call on numbers: `fd` is open and owned by `staged`, and
        // `slot` was checked to be free, so no owner of it exists in this process for the
        // copy to alias; the copy is owned by whoever takes `slot` over afterwards.
        if unsafe { libc::dup3(fd.as_raw_fd(), slot, libc::O_CLOEXEC) } < 0 {
            return Err(format!("fd {slot}: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Restores SIGPIPE's default action. Rust starts programs with it ignored, so a command-line
/// tool writing into a closed pipe (`outboard … | head -1`) would panic in `println!`; a Unix
/// filter ends quietly instead. Call it first thing in `main`, before any thread exists.
pub fn restore_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_DFL installs no handler code, so nothing
    // can run in signal context; done before other threads exist.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Ignores SIGPIPE, so that a write to a socket or pipe whose peer went returns `EPIPE` to the
/// code that can end just that connection. For processes that serve many peers; children
/// they start decide for themselves (each `outboard` role calls this or [`restore_sigpipe`]).
/// Call it first thing in `main`, before any thread exists.
pub fn ignore_sigpipe() {
    // SAFETY: SIG_IGN installs no handler code; done before other threads exist.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

/// The supplementary groups of the process at the other end of a UNIX socket, as the kernel
/// recorded them when it connected (`SO_PEERGROUPS`; the peer cannot forge them).
pub fn peer_groups(conn: std::os::fd::BorrowedFd<'_>) -> std::io::Result<Vec<u32>> {
    use std::os::fd::AsRawFd;
    let mut groups = vec![0u32; 64];
    loop {
        let mut len = (groups.len() * 4) as libc::socklen_t;
        // SAFETY: the buffer is `len` bytes of writable memory owned by `groups`; the kernel
        // writes at most `len` bytes and sets `len` to what it wrote (or needs, on ERANGE).
        let r = unsafe {
            libc::getsockopt(
                conn.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if r == 0 {
            groups.truncate(len as usize / 4);
            return Ok(groups);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) && (len as usize / 4) > groups.len() {
            groups.resize(len as usize / 4, 0);
            continue;
        }
        return Err(e);
    }
}

/// User and system clock ticks process `pid` has used, all its threads (`None` if it is
/// gone).
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    stat_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Nanoseconds of CPU process `pid` has used, all its threads, ended ones included (`None` if
/// it is gone). Read from the process's CPU clock, which the scheduler keeps to the
/// nanosecond, rather than `/proc/PID/stat`'s ticks (10 ms each): a 50 ms measurement read in
/// ticks is off by up to 40%. Falls back to the ticks where the clock cannot be read.
pub fn cpu_nanos(pid: u32) -> Option<u64> {
    process_clock_nanos(pid).or_else(|| {
        let per_tick = 1_000_000_000 / rustix::param::clock_ticks_per_second().max(1);
        Some(cpu_ticks(pid)? * per_tick)
    })
}

/// The same in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    Some(cpu_nanos(pid)? as f64 / 1e9)
}

/// `clock_gettime` of process `pid`'s CPU-time clock (`clock_getcpuclockid`).
fn process_clock_nanos(pid: u32) -> Option<u64> {
    let pid = libc::pid_t::try_from(pid).ok()?;
    let mut clock: libc::clockid_t = 0;
    // SAFETY: writes one clockid_t into `clock`, which lives across the call.
    if unsafe { libc::clock_getcpuclockid(pid, &mut clock) } != 0 {
        return None;
    }
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec into `now`, which lives across the call.
    if unsafe { libc::clock_gettime(clock, &mut now) } != 0 {
        return None;
    }
    Some(u64::try_from(now.tv_sec).ok()? * 1_000_000_000 + u64::try_from(now.tv_nsec).ok()?)
}

/// Process `pid`'s resident memory in bytes (`None` if it is gone).
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    statm_resident_pages(&statm).map(|p| p * rustix::param::page_size() as u64)
}

/// utime + stime from a `/proc/PID/stat` line: fields 14 and 15, counted after the command
/// name, which may hold spaces and parentheses (the fields go on after the last `)`).
fn stat_ticks(stat: &str) -> Option<u64> {
    let after = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state).
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Resident pages, the second field of `/proc/PID/statm`.
fn statm_resident_pages(statm: &str) -> Option<u64> {
    statm.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod usage_tests {
    use super::*;

    #[test]
    fn stat_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 5 1000 77";
        assert_eq!(stat_ticks(stat), Some(300));
        assert_eq!(stat_ticks("42 (x"), None);
        assert_eq!(stat_ticks("42 (x) S 1"), None);
        assert_eq!(statm_resident_pages("1000 77 10 1 0 20 0"), Some(77));
        assert_eq!(statm_resident_pages("1"), None);
    }

    #[test]
    fn this_process_has_usage() {
        assert!(resident_bytes(std::process::id()).unwrap() > 0);
        assert!(cpu_seconds(std::process::id()).is_some());
    }

    #[test]
    fn another_process_s_cpu_is_read_to_below_a_tick() {
        // A child that spins a few milliseconds and then sleeps: once its clock stands still,
        // the clock holds what it used to the nanosecond (ticks count whole 10 ms), agrees
        // with the ticks, and a process that has gone reads as gone.
        let mut child = Command::new("sh")
            .args([
                "-c",
                "i=0; while [ $i -lt 3000 ]; do i=$((i+1)); done; sleep 5",
            ])
            .spawn()
            .unwrap();
        let pid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut last = process_clock_nanos(pid).expect("the child's CPU clock");
        while std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let now = process_clock_nanos(pid).unwrap();
            if now == last {
                break; // the loop ended: the child sleeps
            }
            last = now;
        }
        let ticks = cpu_ticks(pid).unwrap() * 1_000_000_000
            / rustix::param::clock_ticks_per_second() as u64;
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(last > 0, "the spinning child used no CPU");
        assert_ne!(last % 10_000_000, 0, "{last} ns is a whole number of ticks");
        assert!(
            last.abs_diff(ticks) <= 20_000_000,
            "clock {last} ns, ticks {ticks} ns"
        );
        assert_eq!(process_clock_nanos(pid), None, "a reaped child's clock");
    }
}

#[cfg(test)]
mod place_tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn descriptors_land_where_they_are_sent_and_an_open_number_is_refused() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        // Numbers this test process does not use; given in the opposite order to how they
        // were made.
        place(vec![b.into(), a.into()], &[931, 930]).unwrap();
        let mut a = std::os::unix::net::UnixStream::from(inherited_socket(930).unwrap());
        let mut b = std::os::unix::net::UnixStream::from(inherited_socket(931).unwrap());
        a.write_all(b"x").unwrap();
        let mut got = [0u8; 1];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"x");
        let (c, _d) = std::os::unix::net::UnixStream::pair().unwrap();
        let err = place(vec![c.into()], &[a.as_raw_fd()]).unwrap_err();
        assert!(err.contains("in use already"), "{err}");
        let (e, _f) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(place(vec![e.into()], &[2]).is_err());
        // A socket moved out of the way leaves its number free, to be placed and taken again.
        let (g, _h) = std::os::unix::net::UnixStream::pair().unwrap();
        place(vec![g.into()], &[932]).unwrap();
        let moved = inherited_socket_moved(932, 950).unwrap();
        assert!(moved.as_raw_fd() >= 950);
        let (i, _j) = std::os::unix::net::UnixStream::pair().unwrap();
        place(vec![i.into()], &[932]).unwrap();
        assert!(inherited_socket(932).is_ok());
        assert!(place(Vec::new(), &[940]).is_err());
    }
}

/// Keeps this process's standard output for one consumer: returns it as a file, and points
/// descriptor 1 at standard error from now on, so that whatever else the process prints (code
/// it loads, C's stdio flushing at exit) cannot be mixed into what the consumer reads.
pub fn private_stdout() -> Result<std::fs::File, String> {
    let saved = rustix::io::fcntl_dupfd_cloexec(rustix::stdio::stdout(), 3)
        .map_err(|e| format!("standard output: {e}"))?;
    rustix::stdio::dup2_stdout(rustix::stdio::stderr())
        .map_err(|e| format!("standard output to standard error: {e}"))?;
    Ok(std::fs::File::from(saved))
}
