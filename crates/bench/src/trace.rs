//! Test 6: the thesis's disk trace test (§5.2.4) — one week of disk activity on an HP-UX
//! workstation in 1992 (HP Labs' `ajw.1week.srt`, 44,519 I/Os on two disks), replayed with its
//! dependencies: each request is issued at its start event and waited for at its completion
//! event, with no think time, so the trace's ordering and parallelism are kept while the driver
//! may reorder within them.
//!
//! The trace format (SRT 1.3): a text header ending at the first form feed, then 56-byte
//! records of fourteen big-endian 32-bit words. Sector numbers are in 256-byte units; the thesis
//! halved them for 512-byte sectors, and so does this replay.

use std::path::Path;
use std::time::{Duration, Instant};

use outboard_block::{BlockCompletion, BlockDevice, BlockError, BlockOp, BlockRequest};
use outboard_client::BufferPool;

/// One I/O of the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceIo {
    /// Which disk (0 or 1).
    pub disk: usize,
    /// A read (else a write).
    pub read: bool,
    /// Byte offset on the disk.
    pub offset: u64,
    /// Bytes.
    pub bytes: u32,
    /// When it was enqueued, µs from the trace's start.
    pub start_us: u64,
    /// When it completed, µs from the trace's start.
    pub done_us: u64,
}

const RECORD: usize = 56;

/// Parses an SRT 1.3 trace; every record is checked (size, type, length, disk).
pub fn parse(data: &[u8]) -> Result<Vec<TraceIo>, String> {
    let body = data
        .iter()
        .position(|&b| b == 0x0c)
        .map(|i| &data[i + 1..])
        .ok_or("no form feed ends the trace's header")?;
    if !body.len().is_multiple_of(RECORD) {
        return Err(format!(
            "{} bytes of records is not whole {RECORD}-byte records",
            body.len()
        ));
    }
    let mut out = Vec::with_capacity(body.len() / RECORD);
    let mut first: Option<u64> = None;
    for (i, r) in body.chunks_exact(RECORD).enumerate() {
        let w = |k: usize| u32::from_be_bytes(r[4 * k..4 * k + 4].try_into().expect("4 bytes"));
        let bad = |why: &str| format!("record {i}: {why}");
        if w(0) as usize != RECORD {
            return Err(bad(&format!("size {}", w(0))));
        }
        if w(1) & 0xffff != 1 {
            return Err(bad(&format!("type {} is not a short I/O", w(1) & 0xffff)));
        }
        let bytes = w(6);
        if bytes == 0 || !bytes.is_multiple_of(512) || bytes > 1 << 20 {
            return Err(bad(&format!("{bytes} bytes")));
        }
        let disk = ((w(8) >> 8) & 0xff) as usize;
        if disk > 1 {
            return Err(bad(&format!("disk {disk}")));
        }
        let enqueued = w(2) as u64 * 1_000_000 + w(3) as u64;
        let t0 = *first.get_or_insert(enqueued);
        let start_us = enqueued
            .checked_sub(t0)
            .ok_or_else(|| bad("records are not in enqueue order"))?;
        out.push(TraceIo {
            disk,
            read: w(11) & 1 != 0,
            // 256-byte sectors, halved for 512-byte ones.
            offset: (w(7) as u64 / 2) * 512,
            bytes,
            start_us,
            done_us: start_us + w(5) as u64,
        });
    }
    Ok(out)
}

/// The bytes each disk must hold (the furthest byte the trace touches, in whole MiB).
pub fn disk_sizes(ios: &[TraceIo]) -> [u64; 2] {
    let mut s = [1u64 << 20; 2];
    for io in ios {
        let end = (io.offset + io.bytes as u64).div_ceil(1 << 20) << 20;
        s[io.disk] = s[io.disk].max(end);
    }
    s
}

/// A start or completion event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Issue request `i`.
    Start(usize),
    /// Wait until request `i` has completed.
    Complete(usize),
}

/// Every request's start and completion events, in time order (at equal times, starts first,
/// so a request that took no time is issued before it is waited for).
pub fn events(ios: &[TraceIo]) -> Vec<Event> {
    let mut ev: Vec<(u64, u8, usize)> = ios
        .iter()
        .enumerate()
        .flat_map(|(i, io)| [(io.start_us, 0, i), (io.done_us, 1, i)])
        .collect();
    ev.sort_unstable();
    ev.into_iter()
        .map(|(_, kind, i)| {
            if kind == 0 {
                Event::Start(i)
            } else {
                Event::Complete(i)
            }
        })
        .collect()
}

/// The most requests outstanding at once.
pub fn max_outstanding(events: &[Event]) -> usize {
    let (mut now, mut max) = (0usize, 0usize);
    for e in events {
        match e {
            Event::Start(_) => {
                now += 1;
                max = max.max(now);
            }
            Event::Complete(_) => now -= 1,
        }
    }
    max
}

/// What a replay keeps per request and per disk.
struct Replay {
    /// Each disk's buffer area, handed out per request.
    pools: Vec<BufferPool>,
    /// Request `i` has completed.
    done: Vec<bool>,
    /// Request `i`'s piece of its disk's buffer area while it is in flight.
    bufs: Vec<Option<outboard_client::Buffer>>,
    out: Vec<BlockCompletion>,
}

impl Replay {
    /// Takes the completions of disk `k` (waiting for one if `block`), marking their requests
    /// done and giving their buffers back.
    fn reap(&mut self, disk: &mut dyn BlockDevice, k: usize, block: bool) -> Result<(), String> {
        self.out.clear();
        if block {
            disk.wait(&mut self.out, Duration::from_secs(60))
        } else {
            disk.poll(&mut self.out)
        }
        .map_err(|x| x.to_string())?;
        for c in &self.out {
            let i = c.tag as usize;
            c.result.clone().map_err(|x| format!("request {i}: {x}"))?;
            self.done[i] = true;
            if let Some(b) = self.bufs[i].take() {
                self.pools[k].free(b);
            }
        }
        Ok(())
    }
}

/// Replays `events` of `ios` on the two disks; returns the elapsed time.
pub fn replay(
    disks: &mut [&mut dyn BlockDevice; 2],
    ios: &[TraceIo],
    events: &[Event],
) -> Result<Duration, String> {
    let e = |x: BlockError| x.to_string();
    let mut st = Replay {
        pools: disks
            .iter()
            .map(|d| BufferPool::new(d.buffers().len() as u64, 4096))
            .collect(),
        done: vec![false; ios.len()],
        bufs: vec![None; ios.len()],
        out: Vec::new(),
    };
    let t0 = Instant::now();
    for ev in events {
        match *ev {
            Event::Start(i) => {
                let io = ios[i];
                let k = io.disk;
                let bs = disks[k].info().block_size as u64;
                let buf = loop {
                    if let Some(b) = st.pools[k].alloc(io.bytes as u64) {
                        break b;
                    }
                    st.reap(&mut *disks[k], k, true)?;
                };
                st.bufs[i] = Some(buf);
                let r = BlockRequest {
                    op: if io.read {
                        BlockOp::Read
                    } else {
                        BlockOp::Write
                    },
                    lba: io.offset / bs,
                    blocks: (io.bytes as u64).div_ceil(bs) as u32,
                    buf_offset: buf.offset,
                    tag: i as u64,
                };
                loop {
                    match disks[k].submit(&r) {
                        Ok(()) => break,
                        Err(BlockError::QueueFull) => {
                            disks[k].kick().map_err(e)?;
                            st.reap(&mut *disks[k], k, true)?;
                        }
                        Err(x) => return Err(format!("request {i}: {x}")),
                    }
                }
                disks[k].kick().map_err(e)?;
            }
            Event::Complete(i) => {
                let k = ios[i].disk;
                st.reap(&mut *disks[k], k, false)?;
                while !st.done[i] {
                    st.reap(&mut *disks[k], k, true)?;
                }
            }
        }
    }
    Ok(t0.elapsed())
}

/// Reads the trace at `path`.
pub fn load(path: &Path) -> Result<Vec<TraceIo>, String> {
    parse(&std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?)
}

/// Pids of `pid` and all its descendants (a machine from `outboard up`).
fn tree(pid: u32) -> Vec<u32> {
    let mut all = vec![pid];
    let parent_of = |p: u32| -> Option<u32> {
        let s = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        // The command may hold spaces and parentheses: the fields after the last ')' count.
        s.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    let procs: Vec<u32> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let mut i = 0;
    while i < all.len() {
        let p = all[i];
        all.extend(procs.iter().filter(|&&c| parent_of(c) == Some(p)));
        i += 1;
    }
    all
}

/// Replays `runs` times on two disks, with CPU counted over `pids`; (elapsed s, CPU s) each.
fn measure(
    ctx: &crate::Context,
    disks: &mut [&mut dyn BlockDevice; 2],
    ios: &[TraceIo],
    events: &[Event],
    pids: &[u32],
) -> Result<(crate::stats::Summary, crate::stats::Summary), String> {
    let (mut t, mut c) = (Vec::new(), Vec::new());
    for _ in 0..ctx.runs {
        let meter = crate::cpu::CpuMeter::start(pids);
        let elapsed = replay(disks, ios, events)?.as_secs_f64();
        t.push(elapsed);
        c.push(meter.stop().processes * elapsed);
        ctx.progress.inc(1);
    }
    let w = crate::tests::WARM_UP;
    Ok((
        crate::stats::Summary::of(&t, w),
        crate::stats::Summary::of(&c, w),
    ))
}

fn model(
    exe: &Path,
    dir: &Path,
    name: &str,
    bytes: u64,
) -> Result<(crate::fixture::Proc, std::path::PathBuf), String> {
    let sock = dir.join(format!("{name}.sock"));
    let args = [
        "device".to_string(),
        "virtio-blk".into(),
        "--socket".into(),
        sock.display().to_string(),
        "--backing".into(),
        format!("mem:{bytes}"),
    ];
    Ok((crate::fixture::spawn(exe, &args, &sock)?, sock))
}

fn host(
    exe: &Path,
    dir: &Path,
    name: &str,
    devices: &[(&str, &Path)],
) -> Result<(crate::fixture::Proc, std::path::PathBuf), String> {
    let sock = dir.join(format!("{name}.sock"));
    let mut args = vec![
        "driver-host".to_string(),
        "--listen".into(),
        sock.display().to_string(),
        "--spin-us".into(),
        "20".into(),
    ];
    for (n, model) in devices {
        args.extend([
            "--device".into(),
            format!("{n}=vfio-user:{}", model.display()),
        ]);
    }
    Ok((crate::fixture::spawn(exe, &args, &sock)?, sock))
}

/// The kernel's path: two RAM-backed files (in `/dev/shm`) on loop devices, opened with
/// O_DIRECT and driven through io_uring. Needs root (for `losetup`).
fn kernel_disks(
    sizes: [u64; 2],
) -> Result<
    (
        Vec<crate::fixture::LoopDev>,
        crate::uring::UringDisk,
        crate::uring::UringDisk,
    ),
    String,
> {
    let mut loops = Vec::new();
    let mut disks = Vec::new();
    for (i, size) in sizes.iter().enumerate() {
        let file =
            Path::new("/dev/shm").join(format!("outboard-trace-{}-{i}.img", std::process::id()));
        std::fs::File::create(&file)
            .and_then(|f| f.set_len(*size))
            .map_err(|e| format!("{}: {e}", file.display()))?;
        let lo = crate::fixture::LoopDev::attach(&file);
        // The loop device keeps the file open: its name can go at once.
        let _ = std::fs::remove_file(&file);
        let lo = lo?;
        disks.push(crate::uring::UringDisk::open(&lo.path, *size, 4 << 20)?);
        loops.push(lo);
    }
    let k1 = disks.pop().expect("two disks");
    let k0 = disks.pop().expect("two disks");
    Ok((loops, k0, k1))
}

/// Where the trace is: `OUTBOARD_TRACE`, else `data/ajw.1week.srt` next to the sources or the
/// current directory.
fn trace_path() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("OUTBOARD_TRACE") {
        return p.into();
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/ajw.1week.srt");
    if built.exists() {
        return built;
    }
    Path::new("data/ajw.1week.srt").into()
}

/// Test 6: replays the trace in each configuration.
pub fn trace_test(ctx: &crate::Context) -> Result<crate::model::TestResult, String> {
    use crate::model::{Figure, Machine, Point, Series, Target, TestResult, Unavailable};
    use outboard_block_client::{BlockClient, Colocated, NbdClient, SessionOptions};
    use outboard_drivers::Attachment;
    use outboard_hw::DeviceSpec;

    let mut ios = load(&trace_path())?;
    if ctx.quick {
        ios.truncate(3000);
    }
    let events = events(&ios);
    let sizes = disk_sizes(&ios);
    let exe = &ctx.exe;
    let dir = std::env::temp_dir().join(format!("outboard-bench-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let me = std::process::id();
    let e = |x: BlockError| x.to_string();
    let mut results: Vec<(&str, crate::stats::Summary, crate::stats::Summary)> = Vec::new();
    let mut unavailable = Vec::new();
    ctx.progress.set_message("trace: kernel");
    match kernel_disks(sizes) {
        Ok((_loops, mut k0, mut k1)) => {
            let (t, c) = measure(ctx, &mut [&mut k0, &mut k1], &ios, &events, &[me])?;
            results.push(("kernel", t, c));
        }
        Err(reason) => unavailable.push(Unavailable {
            config: "kernel".into(),
            reason,
        }),
    }
    let (m0, s0) = model(exe, &dir, "disk0", sizes[0])?;
    let (m1, s1) = model(exe, &dir, "disk1", sizes[1])?;
    let models = [m0.pid, m1.pid];
    {
        ctx.progress.set_message("trace: colocated");
        let open = |n: &str, s: &Path| {
            Colocated::open(
                n,
                &Attachment::Pci(DeviceSpec::VfioUser(s.to_owned())),
                4 << 20,
            )
        };
        let mut d0 = open("disk0", &s0).map_err(e)?;
        let mut d1 = open("disk1", &s1).map_err(e)?;
        let (t, c) = measure(
            ctx,
            &mut [&mut d0, &mut d1],
            &ios,
            &events,
            &[me, models[0], models[1]],
        )?;
        results.push(("colocated", t, c));
    }
    {
        ctx.progress.set_message("trace: separate");
        let (h0, k0) = host(exe, &dir, "host0", &[("disk0", &s0)])?;
        let (h1, k1) = host(exe, &dir, "host1", &[("disk1", &s1)])?;
        let mut d0 = BlockClient::open(&k0, "disk0", SessionOptions::default()).map_err(e)?;
        let mut d1 = BlockClient::open(&k1, "disk1", SessionOptions::default()).map_err(e)?;
        let pids = [me, models[0], models[1], h0.pid, h1.pid];
        let (t, c) = measure(ctx, &mut [&mut d0, &mut d1], &ios, &events, &pids)?;
        results.push(("separate", t, c));
    }
    {
        ctx.progress.set_message("trace: grouped");
        let (h, k) = host(exe, &dir, "grouped", &[("disk0", &s0), ("disk1", &s1)])?;
        let mut d0 = BlockClient::open(&k, "disk0", SessionOptions::default()).map_err(e)?;
        let mut d1 = BlockClient::open(&k, "disk1", SessionOptions::default()).map_err(e)?;
        let pids = [me, models[0], models[1], h.pid];
        let (t, c) = measure(ctx, &mut [&mut d0, &mut d1], &ios, &events, &pids)?;
        results.push(("grouped", t, c));
    }
    drop((m0, m1));
    {
        ctx.progress.set_message("trace: nbd");
        let nbd = |n: &str| dir.join(format!("{n}.nbd"));
        let mut text = "name = \"trace\"\n".to_string();
        for (n, size) in [("disk0", sizes[0]), ("disk1", sizes[1])] {
            text += &format!(
                "[[device]]\nname = \"{n}\"\nmodel = \"virtio-blk\"\nbacking = \"mem:{size}\"\n\
                 [[export]]\ndevice = \"{n}\"\nsocket = \"{}\"\n",
                nbd(n).display()
            );
        }
        let up = crate::fixture::machine(exe, &dir, &text, &[nbd("disk0"), nbd("disk1")])?;
        let uri = |n: &str| format!("nbd+unix:///{n}?socket={}", nbd(n).display());
        let mut d0 = NbdClient::open(&uri("disk0"), 4 << 20).map_err(e)?;
        let mut d1 = NbdClient::open(&uri("disk1"), 4 << 20).map_err(e)?;
        let mut pids = tree(up.pid);
        pids.push(me);
        let (t, c) = measure(ctx, &mut [&mut d0, &mut d1], &ios, &events, &pids)?;
        results.push(("nbd", t, c));
    }
    crate::fixture::remove_work_dir(&dir);
    let bar = |id: &str,
               title: &str,
               y: &str,
               pick: &dyn Fn(
        &(&str, crate::stats::Summary, crate::stats::Summary),
    ) -> crate::stats::Summary| Figure {
        id: id.into(),
        title: title.into(),
        x_label: String::new(),
        y_label: y.into(),
        log_x: false,
        log_y: false,
        kind: "bar".into(),
        references: Vec::new(),
        series: results
            .iter()
            .map(|r| Series {
                label: r.0.into(),
                points: vec![Point { x: 0.0, y: pick(r) }],
            })
            .collect(),
    };
    let elapsed = bar(
        "elapsed",
        &format!("Trace replay, {} I/Os (elapsed)", ios.len()),
        "seconds",
        &|r| r.1.clone(),
    );
    let cpu = bar(
        "cpu",
        "Trace replay (CPU time, all processes)",
        "CPU seconds",
        &|r| r.2.clone(),
    );
    let med = |label: &str| results.iter().find(|r| r.0 == label).map(|r| r.1.median);
    let fastest = results
        .iter()
        .map(|r| r.1.median)
        .fold(f64::INFINITY, f64::min);
    let mut targets = Vec::new();
    if let (Some(s), Some(c)) = (med("separate"), med("colocated")) {
        targets.push(Target {
            target: "trace replay: separate within 5% of colocated elapsed time".into(),
            measured: format!("{:.3}× ({s:.2} s vs {c:.2} s)", s / c),
            met: Some(s <= 1.05 * c),
        });
    }
    targets.push(Target {
        target: "thesis: Fluke's configurations 7–13% slower than the fastest".into(),
        measured: results
            .iter()
            .map(|r| format!("{} {:+.1}%", r.0, (r.1.median / fastest - 1.0) * 100.0))
            .collect::<Vec<_>>()
            .join(", "),
        met: None,
    });
    Ok(TestResult {
        test: "trace".into(),
        title: "Disk trace replay".into(),
        reference: "Fluke thesis §5.2.4, Figs 5.7–5.8; EVALUATION.md test 6".into(),
        runs: ctx.runs,
        discarded: crate::tests::WARM_UP,
        params: serde_json::json!({
            "ios": ios.len(),
            "max_outstanding": max_outstanding(&events),
            "disk_bytes": sizes,
        }),
        figures: vec![elapsed, cpu],
        unavailable,
        targets,
        machine: Machine::here(),
    })
}

/// Progress steps (runs) of the test.
pub fn steps(ctx: &crate::Context) -> u64 {
    4 * ctx.runs as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        sec: u32,
        usec: u32,
        stop: u32,
        bytes: u32,
        sect: u32,
        disk: u32,
        read: bool,
    ) -> Vec<u8> {
        [
            56,
            (4 << 16) | 1,
            sec,
            usec,
            0,
            stop,
            bytes,
            sect,
            disk << 8,
            0,
            0,
            read as u32,
            0,
            0,
        ]
        .iter()
        .flat_map(|w: &u32| w.to_be_bytes())
        .collect()
    }

    #[test]
    fn records_parse_with_halved_sectors_and_bad_ones_are_refused() {
        let mut t = b"header\x0c".to_vec();
        t.extend(record(10, 0, 500, 8192, 100, 0, true));
        t.extend(record(10, 200, 0, 1024, 7, 1, false));
        let ios = parse(&t).unwrap();
        assert_eq!(ios.len(), 2);
        assert_eq!(
            ios[0],
            TraceIo {
                disk: 0,
                read: true,
                offset: 50 * 512,
                bytes: 8192,
                start_us: 0,
                done_us: 500
            }
        );
        assert_eq!(
            (ios[1].disk, ios[1].read, ios[1].offset, ios[1].start_us),
            (1, false, 3 * 512, 200)
        );
        // Events: start 0, start 1 and its zero-time completion (start first), then 0's.
        let ev = events(&ios);
        assert_eq!(
            ev,
            vec![
                Event::Start(0),
                Event::Start(1),
                Event::Complete(1),
                Event::Complete(0)
            ]
        );
        assert_eq!(max_outstanding(&ev), 2);
        assert_eq!(disk_sizes(&ios), [1 << 20, 1 << 20]);
        assert!(parse(b"no form feed").is_err());
        assert!(parse(&t[..t.len() - 1]).is_err());
        let mut bad = b"h\x0c".to_vec();
        bad.extend(record(1, 0, 1, 100, 0, 0, true));
        assert!(parse(&bad).unwrap_err().contains("100 bytes"));
        let mut late = b"h\x0c".to_vec();
        late.extend(record(5, 0, 1, 512, 0, 0, true));
        late.extend(record(4, 0, 1, 512, 0, 0, true));
        assert!(parse(&late).is_err());
    }

    /// The kept trace is what its README says: 44,519 I/Os, 13,040 reads, two disks, up to 104
    /// outstanding.
    #[test]
    fn the_hp_trace_parses_to_what_its_provenance_says() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/ajw.1week.srt");
        let ios = load(&path).unwrap();
        assert_eq!(ios.len(), 44_519);
        assert_eq!(ios.iter().filter(|io| io.read).count(), 13_040);
        assert_eq!(max_outstanding(&events(&ios)), 104);
        let sizes = disk_sizes(&ios);
        assert!((300 << 20..400 << 20).contains(&sizes[0]), "{sizes:?}");
        assert!(sizes[1] <= 4 << 20, "{sizes:?}");
    }
}
