//! The physical floor of this machine, measured in the same run as the sessions: an eventfd
//! ping-pong and a shared cache-line ping-pong between two processes.
//!
//! The peer is `outboard bench-peer`, started with the eventfds or the memfd inherited (the
//! only fds created here without CLOEXEC).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Instant;

use outboard_shm::{Access, SharedMem};
use rustix::event::EventfdFlags;

use crate::placement::Pinned;

fn read1(fd: BorrowedFd<'_>) -> Result<(), String> {
    let mut b = [0u8; 8];
    rustix::io::read(fd, &mut b)
        .map(|_| ())
        .map_err(|e| format!("eventfd read: {e}"))
}

fn write1(fd: BorrowedFd<'_>) -> Result<(), String> {
    rustix::io::write(fd, &1u64.to_ne_bytes())
        .map(|_| ())
        .map_err(|e| format!("eventfd write: {e}"))
}

/// Round trips (µs) of an eventfd ping-pong with a peer process placed by `pin`: each is two
/// blocking wake-ups.
pub fn eventfd(exe: &Path, n: usize, pin: &Pinned) -> Result<Vec<f64>, String> {
    let ping = rustix::event::eventfd(0, EventfdFlags::empty()).map_err(|e| e.to_string())?;
    let pong = rustix::event::eventfd(0, EventfdFlags::empty()).map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args([
            "bench-peer",
            "eventfd",
            &ping.as_raw_fd().to_string(),
            &pong.as_raw_fd().to_string(),
            &n.to_string(),
        ])
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    if let Err(e) = pin.peer(child.id()) {
        let _ = child.kill();
        return Err(e);
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        write1(ping.as_fd())?;
        read1(pong.as_fd())?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    child.wait().map_err(|e| e.to_string())?;
    Ok(v)
}

fn shared_line() -> Result<(OwnedFd, SharedMem), String> {
    let fd = rustix::fs::memfd_create("outboard-pingpong", rustix::fs::MemfdFlags::empty())
        .map_err(|e| e.to_string())?;
    rustix::fs::ftruncate(&fd, 4096).map_err(|e| e.to_string())?;
    let mem = SharedMem::map(fd.as_fd(), 0, 4096, Access::ReadWrite).map_err(|e| e.to_string())?;
    Ok((fd, mem))
}

/// Round trips (µs) of a cache line bounced between this process and a peer placed by `pin`,
/// both spinning.
pub fn cacheline(exe: &Path, n: usize, pin: &Pinned) -> Result<Vec<f64>, String> {
    let (fd, mem) = shared_line()?;
    let word = mem.atomic_u32(0).map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args([
            "bench-peer",
            "cacheline",
            &fd.as_raw_fd().to_string(),
            &n.to_string(),
        ])
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    if let Err(e) = pin.peer(child.id()) {
        let _ = child.kill();
        return Err(e);
    }
    let mut v = Vec::with_capacity(n);
    for i in 0..n as u32 {
        let t = Instant::now();
        // Release/Acquire pairs with the peer's: each value is a message.
        word.store(2 * i + 1, Ordering::Release);
        while word.load(Ordering::Acquire) != 2 * i + 2 {
            std::hint::spin_loop();
        }
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    child.wait().map_err(|e| e.to_string())?;
    Ok(v)
}

/// The peer side (`outboard bench-peer KIND FD… N`).
pub fn peer(args: &[String]) -> Result<(), String> {
    let num = |i: usize| -> Result<i32, String> {
        args.get(i)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bench-peer: bad argument {i}"))
    };
    match args.first().map(String::as_str) {
        Some("eventfd") => {
            let (rx, tx, n) = (num(1)?, num(2)?, num(3)?);
            // SAFETY: the parent passed these inherited eventfds by number for this process's
            // use only; they stay open for its whole life.
            let (rx, tx) = unsafe { (BorrowedFd::borrow_raw(rx), BorrowedFd::borrow_raw(tx)) };
            for _ in 0..n {
                read1(rx)?;
                write1(tx)?;
            }
            Ok(())
        }
        Some("cacheline") => {
            let (fd, n) = (num(1)?, num(2)?);
            // SAFETY: as above, an inherited memfd passed by number.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let mem = SharedMem::map(fd, 0, 4096, Access::ReadWrite).map_err(|e| e.to_string())?;
            let word = mem.atomic_u32(0).map_err(|e| e.to_string())?;
            for i in 0..n as u32 {
                while word.load(Ordering::Acquire) != 2 * i + 1 {
                    std::hint::spin_loop();
                }
                word.store(2 * i + 2, Ordering::Release);
            }
            Ok(())
        }
        Some("udp-echo" | "udp-load") => crate::netload::peer(args),
        Some("raw-source" | "raw-sink" | "raw-echo") => crate::netraw::peer(args),
        Some("timerfd") => crate::clock_servers::floor_peer(args),
        _ => Err(
            "bench-peer: eventfd RX TX N | cacheline MEMFD N | udp-echo … | udp-load … | \
             timerfd HZ SOCKET"
                .into(),
        ),
    }
}
