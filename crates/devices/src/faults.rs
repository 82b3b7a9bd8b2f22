//! Fault injection: bad hardware on demand (`docs/reliability.md`).
//!
//! Every device model carries a [`FaultHandle`]; a test, the machine description or the control
//! API (through the model's fault socket) arms faults in it while the device runs, and the
//! transport and the device fire them at the next matching event. Each armed fault fires as
//! many times as asked and is then spent; [`Fault::Clear`] disarms everything.
//!
//! Faults are written as `kind` or `kind=value`, the same on the command line
//! (`outboard device … --fault drop-irq=2`, `outboard fault disk0 stall=2s`) and in a machine
//! description (`faults = ["error=0-8"]`).

use std::fmt;
use std::ops::Range;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// One fault to arm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Requests touching these sectors complete with an I/O error (`error=START-END`).
    FailSectors(Range<u64>),
    /// The next N requests complete with an I/O error (`error-next=N`).
    FailNext(u32),
    /// The next N interrupts are not delivered (`drop-irq=N`).
    DropIrq(u32),
    /// The next N interrupts are delivered twice (`duplicate-irq=N`).
    DuplicateIrq(u32),
    /// N interrupts with nothing to report, at the next notification (`spurious-irq=N`).
    SpuriousIrq(u32),
    /// The next completion names a descriptor that is not in flight (`corrupt-used=id`).
    CorruptUsedId,
    /// The next completion claims fewer bytes than were written (`corrupt-used=len`).
    CorruptUsedLen,
    /// At its next notification the device stops answering for this long (`stall=2s`).
    Stall(Duration),
    /// The device sets DEVICE_NEEDS_RESET and raises a configuration interrupt
    /// (`needs-reset`).
    NeedsReset,
    /// The device model process aborts at its next notification (`crash`).
    Crash,
    /// The device model process aborts whenever a request touches this sector, every time:
    /// a request that kills its device (`abort-on=SECTOR`).
    AbortOn(u64),
    /// The device stops answering whenever a request touches this sector, every time (for an
    /// hour, or until its process is killed): a request that hangs its device
    /// (`hang-on=SECTOR`).
    HangOn(u64),
    /// A NIC's link goes down at its next notification and comes back up this long after,
    /// each with a configuration interrupt (`link-flap=200ms`).
    LinkFlap(Duration),
    /// A NIC reports each of its next N received frames as longer than the buffers it was
    /// given (a used length past them) — what a driver must catch (`long-frame=N`).
    LongFrame(u32),
    /// Disarms every fault (`clear`).
    Clear,
}

/// Every kind, as written, for help texts and campaigns.
pub const KINDS: &[&str] = &[
    "error=START-END",
    "error-next=N",
    "drop-irq=N",
    "duplicate-irq=N",
    "spurious-irq=N",
    "corrupt-used=id|len",
    "stall=DURATION",
    "needs-reset",
    "crash",
    "abort-on=SECTOR",
    "hang-on=SECTOR",
    "link-flap=DURATION",
    "long-frame=N",
    "clear",
];

fn count(v: Option<&str>, kind: &str) -> Result<u32, String> {
    match v {
        None => Ok(1),
        Some(v) => v
            .parse::<u32>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{kind}={v}: give a count of at least 1")),
    }
}

fn duration(v: &str) -> Option<Duration> {
    let (n, unit) = match v.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => v.split_at(i),
        None => (v, "ms"),
    };
    let n: u64 = n.parse().ok()?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        _ => return None,
    };
    (d <= Duration::from_secs(3600)).then_some(d)
}

impl FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, value) = match s.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v.trim())),
            None => (s.trim(), None),
        };
        let none = |f: Fault| match value {
            None => Ok(f),
            Some(v) => Err(format!("{kind} takes no value (got {v:?})")),
        };
        match kind {
            "error" => {
                let v = value.ok_or("error=START-END: which sectors?")?;
                let (a, b) = v
                    .split_once('-')
                    .ok_or_else(|| format!("error={v}: write a sector range START-END"))?;
                let (a, b) = (a.parse::<u64>(), b.parse::<u64>());
                match (a, b) {
                    (Ok(a), Ok(b)) if a < b => Ok(Fault::FailSectors(a..b)),
                    _ => Err(format!("error={v}: START-END with START < END")),
                }
            }
            "error-next" => Ok(Fault::FailNext(count(value, kind)?)),
            "drop-irq" => Ok(Fault::DropIrq(count(value, kind)?)),
            "duplicate-irq" => Ok(Fault::DuplicateIrq(count(value, kind)?)),
            "spurious-irq" => Ok(Fault::SpuriousIrq(count(value, kind)?)),
            "corrupt-used" => match value {
                Some("id") => Ok(Fault::CorruptUsedId),
                Some("len") => Ok(Fault::CorruptUsedLen),
                _ => Err("corrupt-used=id or corrupt-used=len".into()),
            },
            "stall" => value
                .and_then(duration)
                .map(Fault::Stall)
                .ok_or_else(|| "stall=DURATION, e.g. stall=500ms or stall=2s (at most 1 h)".into()),
            "needs-reset" => none(Fault::NeedsReset),
            "crash" => none(Fault::Crash),
            "abort-on" => value
                .and_then(|v| v.parse().ok())
                .map(Fault::AbortOn)
                .ok_or_else(|| "abort-on=SECTOR: which sector?".into()),
            "hang-on" => value
                .and_then(|v| v.parse().ok())
                .map(Fault::HangOn)
                .ok_or_else(|| "hang-on=SECTOR: which sector?".into()),
            "link-flap" => value
                .and_then(duration)
                .map(Fault::LinkFlap)
                .ok_or_else(|| "link-flap=DURATION, e.g. link-flap=200ms (at most 1 h)".into()),
            "long-frame" => Ok(Fault::LongFrame(count(value, kind)?)),
            "clear" => none(Fault::Clear),
            other => Err(format!(
                "unknown fault {other:?} (known: {})",
                KINDS.join(", ")
            )),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::FailSectors(r) => write!(f, "error={}-{}", r.start, r.end),
            Fault::FailNext(n) => write!(f, "error-next={n}"),
            Fault::DropIrq(n) => write!(f, "drop-irq={n}"),
            Fault::DuplicateIrq(n) => write!(f, "duplicate-irq={n}"),
            Fault::SpuriousIrq(n) => write!(f, "spurious-irq={n}"),
            Fault::CorruptUsedId => f.write_str("corrupt-used=id"),
            Fault::CorruptUsedLen => f.write_str("corrupt-used=len"),
            Fault::Stall(d) => write!(f, "stall={}ms", d.as_millis()),
            Fault::NeedsReset => f.write_str("needs-reset"),
            Fault::Crash => f.write_str("crash"),
            Fault::AbortOn(s) => write!(f, "abort-on={s}"),
            Fault::HangOn(s) => write!(f, "hang-on={s}"),
            Fault::LinkFlap(d) => write!(f, "link-flap={}ms", d.as_millis()),
            Fault::LongFrame(n) => write!(f, "long-frame={n}"),
            Fault::Clear => f.write_str("clear"),
        }
    }
}

/// How to corrupt a used-ring entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsedCorruption {
    /// A descriptor id that is not in flight.
    Id,
    /// A length shorter than what the device wrote.
    Len,
}

/// The faults armed in one device.
#[derive(Debug, Default, Clone)]
pub struct Faults {
    /// Requests touching these sectors fail with IOERR.
    pub fail_sectors: Option<Range<u64>>,
    /// Requests still to fail.
    pub fail_next: u32,
    /// Interrupts still to drop.
    pub drop_irqs: u32,
    /// Interrupts still to deliver twice.
    pub duplicate_irqs: u32,
    /// Spurious interrupts to raise at the next notification.
    pub spurious_irqs: u32,
    /// The next used entry's corruption.
    pub corrupt_used: Option<UsedCorruption>,
    /// A stall to take at the next notification.
    pub stall: Option<Duration>,
    /// Set DEVICE_NEEDS_RESET at the next notification.
    pub needs_reset: bool,
    /// Abort the process at the next notification.
    pub crash: bool,
    /// Abort the process whenever a request touches this sector.
    pub abort_on: Option<u64>,
    /// Stop answering whenever a request touches this sector.
    pub hang_on: Option<u64>,
    /// A link flap to take at the next notification: down for this long.
    pub link_flap: Option<Duration>,
    /// Received frames still to report longer than their buffers.
    pub long_frames: u32,
    /// Whether this model fires the faults of a disk's requests (`error`, `error-next`,
    /// `abort-on`, `hang-on`): the block model does. The transport's faults (interrupts, the used ring,
    /// stalls, needs-reset, crash) hold for every virtio model; a model without sectors
    /// (virtio-rng) refuses the rest rather than arm what it would never fire.
    pub sector_faults: bool,
    /// Whether this model fires the faults of a NIC (`link-flap`, `long-frame`).
    pub nic_faults: bool,
    /// Whether this model has no queues (the PCI timer): then `corrupt-used` and
    /// `needs-reset`, which are a virtio queue's and a virtio status's, are refused.
    pub queueless: bool,
}

impl Faults {
    /// Whether this model can fire `f`: why not, if it cannot.
    pub fn check(&self, f: &Fault) -> Result<(), String> {
        let sectors = matches!(
            f,
            Fault::FailSectors(_) | Fault::FailNext(_) | Fault::AbortOn(_) | Fault::HangOn(_)
        );
        let nic = matches!(f, Fault::LinkFlap(_) | Fault::LongFrame(_));
        let queue = matches!(
            f,
            Fault::CorruptUsedId | Fault::CorruptUsedLen | Fault::NeedsReset
        );
        let what = if sectors && !self.sector_faults {
            "no disk requests to fail"
        } else if nic && !self.nic_faults {
            "no link and no received frames"
        } else if queue && self.queueless {
            "no queues and no virtio status"
        } else {
            return Ok(());
        };
        let mut own = Vec::new();
        if self.sector_faults {
            own.push("error, error-next, abort-on, hang-on");
        }
        if self.nic_faults {
            own.push("link-flap, long-frame");
        }
        own.push(if self.queueless {
            "drop-irq, duplicate-irq, spurious-irq, stall, crash and clear"
        } else {
            "drop-irq, duplicate-irq, spurious-irq, corrupt-used, stall, needs-reset, crash and \
             clear"
        });
        Err(format!(
            "{f}: this device model has {what}; its faults are {}",
            own.join(", ")
        ))
    }

    /// Arms `f`.
    pub fn arm(&mut self, f: Fault) {
        match f {
            Fault::FailSectors(r) => self.fail_sectors = Some(r),
            Fault::FailNext(n) => self.fail_next = self.fail_next.saturating_add(n),
            Fault::DropIrq(n) => self.drop_irqs = self.drop_irqs.saturating_add(n),
            Fault::DuplicateIrq(n) => self.duplicate_irqs = self.duplicate_irqs.saturating_add(n),
            Fault::SpuriousIrq(n) => self.spurious_irqs = self.spurious_irqs.saturating_add(n),
            Fault::CorruptUsedId => self.corrupt_used = Some(UsedCorruption::Id),
            Fault::CorruptUsedLen => self.corrupt_used = Some(UsedCorruption::Len),
            Fault::Stall(d) => self.stall = Some(d),
            Fault::NeedsReset => self.needs_reset = true,
            Fault::Crash => self.crash = true,
            Fault::AbortOn(s) => self.abort_on = Some(s),
            Fault::HangOn(s) => self.hang_on = Some(s),
            Fault::LinkFlap(d) => self.link_flap = Some(d),
            Fault::LongFrame(n) => self.long_frames = self.long_frames.saturating_add(n),
            Fault::Clear => {
                *self = Faults {
                    sector_faults: self.sector_faults,
                    nic_faults: self.nic_faults,
                    queueless: self.queueless,
                    ..Faults::default()
                }
            }
        }
    }

    /// Takes one from a counter, if any is left.
    pub fn spend(counter: &mut u32) -> bool {
        if *counter > 0 {
            *counter -= 1;
            true
        } else {
            false
        }
    }
}

/// Fires the faults armed for a queueless model's next interrupt (`model` names it in the
/// log): `crash` aborts, `stall` sleeps here. Returns how many times the interrupt is raised
/// (0 when dropped, 2 when duplicated, else 1) and how many spurious ones go with it.
pub fn at_interrupt(h: &FaultHandle, model: &str) -> (u32, u32) {
    let (crash, stall, times, spurious) = {
        let mut f = lock(h);
        let times = if Faults::spend(&mut f.drop_irqs) {
            0
        } else if Faults::spend(&mut f.duplicate_irqs) {
            2
        } else {
            1
        };
        (
            f.crash,
            f.stall.take(),
            times,
            std::mem::take(&mut f.spurious_irqs),
        )
    };
    if crash {
        tracing::error!("{model}: fault: crash");
        std::process::abort();
    }
    if let Some(d) = stall {
        tracing::warn!("{model}: fault: stalling for {d:?}");
        std::thread::sleep(d);
    }
    (times, spurious)
}

/// Shared between the device model, its transport and whoever injects.
pub type FaultHandle = Arc<Mutex<Faults>>;

/// Locks a handle; a poisoned lock still holds valid counters.
pub fn lock(h: &FaultHandle) -> MutexGuard<'_, Faults> {
    h.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_parses_and_prints_back() {
        for s in [
            "error=0-8",
            "error-next=3",
            "drop-irq=2",
            "duplicate-irq=1",
            "spurious-irq=4",
            "corrupt-used=id",
            "corrupt-used=len",
            "stall=1500ms",
            "needs-reset",
            "crash",
            "abort-on=2048",
            "hang-on=4096",
            "link-flap=200ms",
            "long-frame=2",
            "clear",
        ] {
            let f: Fault = s.parse().unwrap();
            assert_eq!(f.to_string(), s);
        }
        assert_eq!(
            "stall=2s".parse::<Fault>(),
            Ok(Fault::Stall(Duration::from_secs(2)))
        );
        assert_eq!("drop-irq".parse::<Fault>(), Ok(Fault::DropIrq(1)));
        for bad in [
            "error=8-0",
            "error",
            "drop-irq=0",
            "stall=forever",
            "crash=1",
            "melt",
            "stall=9999s",
            "link-flap",
            "long-frame=0",
        ] {
            assert!(bad.parse::<Fault>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_model_refuses_the_faults_it_cannot_fire_and_says_which_it_can() {
        let disk = Faults {
            sector_faults: true,
            ..Faults::default()
        };
        let nic = Faults {
            nic_faults: true,
            ..Faults::default()
        };
        let flap = Fault::LinkFlap(Duration::from_millis(5));
        assert!(nic.check(&flap).is_ok());
        assert!(nic.check(&Fault::LongFrame(1)).is_ok());
        let e = disk.check(&flap).unwrap_err();
        assert!(e.contains("no link") && e.contains("error-next"), "{e}");
        let e = nic.check(&Fault::FailNext(1)).unwrap_err();
        assert!(
            e.contains("no disk requests") && e.contains("link-flap"),
            "{e}"
        );
        assert!(Faults::default().check(&Fault::LongFrame(1)).is_err());
        assert!(Faults::default()
            .check(&Fault::Stall(Duration::ZERO))
            .is_ok());
    }

    #[test]
    fn faults_arm_add_up_and_clear() {
        let mut f = Faults::default();
        f.arm(Fault::DropIrq(2));
        f.arm(Fault::DropIrq(1));
        assert_eq!(f.drop_irqs, 3);
        assert!(Faults::spend(&mut f.drop_irqs));
        assert_eq!(f.drop_irqs, 2);
        f.arm(Fault::Clear);
        assert_eq!(f.drop_irqs, 0);
        assert!(!Faults::spend(&mut f.drop_irqs));
    }
}

/// A fault socket: lets other processes arm faults in a running device model.
///
/// SEQPACKET, one message per fault, written as on the command line (`drop-irq=2`); each gets
/// the answer `ok` or `error: why`. Served on its own thread, so a slow or silent client
/// delays nothing but itself; the socket is removed when the server is dropped.
pub mod socket {
    use std::os::fd::{AsFd, OwnedFd};
    use std::path::Path;
    use std::thread::JoinHandle;
    use std::time::Duration;

    use rustix::event::{PollFd, PollFlags};
    use rustix::net::{RecvFlags, SendFlags, SocketFlags, SocketType};

    use super::{lock, Fault, FaultHandle};

    /// The serving thread and the socket path it owns.
    #[derive(Debug)]
    pub struct FaultSocket {
        _path: Option<outboard_sys::SocketPath>,
        _thread: JoinHandle<()>,
    }

    /// Serves `faults` at `path` until the process ends.
    pub fn serve(path: &Path, faults: FaultHandle) -> Result<FaultSocket, String> {
        let (listener, guard) = outboard_sys::bind_listener(path, SocketType::SEQPACKET, 8)
            .map_err(|e| e.to_string())?;
        let mut s = serve_listener(listener, faults)?;
        s._path = Some(guard);
        Ok(s)
    }

    /// Serves a SEQPACKET socket already listening (one the supervisor bound and passed).
    pub fn serve_listener(listener: OwnedFd, faults: FaultHandle) -> Result<FaultSocket, String> {
        let thread = std::thread::Builder::new()
            .name("fault-socket".into())
            .spawn(move || loop {
                let Ok(conn) = rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) else {
                    continue;
                };
                answer(&conn, &faults);
            })
            .map_err(|e| e.to_string())?;
        Ok(FaultSocket {
            _path: None,
            _thread: thread,
        })
    }

    /// Answers the messages of one client until it leaves or goes quiet for a second.
    fn answer(conn: &OwnedFd, faults: &FaultHandle) {
        let mut buf = [0u8; 256];
        loop {
            let mut p = [PollFd::new(&conn, PollFlags::IN)];
            let ts = rustix::time::Timespec {
                tv_sec: 1,
                tv_nsec: 0,
            };
            if !matches!(rustix::event::poll(&mut p, Some(&ts)), Ok(1)) {
                return;
            }
            let n = match rustix::net::recv(conn.as_fd(), &mut buf, RecvFlags::DONTWAIT) {
                Ok((0, _)) | Err(_) => return,
                Ok((n, _)) => n.min(buf.len()),
            };
            let reply = match std::str::from_utf8(&buf[..n])
                .map_err(|_| "not UTF-8".to_string())
                .and_then(|s| s.parse::<Fault>())
                .and_then(|f| lock(faults).check(&f).map(|()| f))
            {
                Ok(f) => {
                    tracing::warn!("fault injection: armed {f}");
                    lock(faults).arm(f);
                    "ok".to_string()
                }
                Err(e) => format!("error: {e}"),
            };
            if rustix::net::send(conn.as_fd(), reply.as_bytes(), SendFlags::DONTWAIT).is_err() {
                return;
            }
        }
    }

    /// Arms `fault` in the device model serving `path` (what `outboard fault` does).
    pub fn inject(path: &Path, fault: &str) -> Result<(), String> {
        let sock = rustix::net::socket_with(
            rustix::net::AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| e.to_string())?;
        let addr = rustix::net::SocketAddrUnix::new(path).map_err(|e| e.to_string())?;
        rustix::net::connect(&sock, &addr).map_err(|e| format!("{}: {e}", path.display()))?;
        rustix::net::send(&sock, fault.as_bytes(), SendFlags::empty())
            .map_err(|e| e.to_string())?;
        let mut p = [PollFd::new(&sock, PollFlags::IN)];
        let ts = rustix::time::Timespec {
            tv_sec: Duration::from_secs(5).as_secs() as _,
            tv_nsec: 0,
        };
        if !matches!(rustix::event::poll(&mut p, Some(&ts)), Ok(1)) {
            return Err("the device model did not answer".into());
        }
        let mut buf = [0u8; 512];
        let (n, _) =
            rustix::net::recv(&sock, &mut buf, RecvFlags::empty()).map_err(|e| e.to_string())?;
        match std::str::from_utf8(&buf[..n.min(buf.len())]) {
            Ok("ok") => Ok(()),
            Ok(other) => Err(other.trim_start_matches("error: ").to_string()),
            Err(_) => Err("garbled answer".into()),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn faults_are_armed_through_the_socket_and_bad_ones_refused() {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("f.sock");
            let h = FaultHandle::default();
            let _s = serve(&path, h.clone()).unwrap();
            inject(&path, "drop-irq=2").unwrap();
            assert_eq!(lock(&h).drop_irqs, 2);
            let e = inject(&path, "melt-down").unwrap_err();
            assert!(e.contains("unknown fault"), "{e}");
            inject(&path, "clear").unwrap();
            assert_eq!(lock(&h).drop_irqs, 0);
        }
    }
}
