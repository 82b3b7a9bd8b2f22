//! The thesis's *contested* clock test inside a driver server: a process-level thread that
//! holds a legacy driver (its process lock) nearly all the time, doing counted work, so that
//! the driver's interrupts find a thread in the driver and stop it (`docs/legacy.md`). Asked
//! for by `outboard bench clock` (`driver-host --contend NAME=PATH`), never by a machine.
//!
//! What the interrupts cost the thread they stop is the thread's CPU time beyond the work it
//! did, priced at the rate it worked before it entered the driver (work units per CPU second,
//! measured on the same thread outside the driver), less what its own bookkeeping costs per
//! stretch (entering and leaving the driver, the report, the pause: measured in the same
//! calibration). It writes its totals to PATH — CPU nanoseconds since it entered, and the
//! nanoseconds of them the interrupts took (signed: the calibration's noise can make it
//! negative early on) — as 24 bytes: the two totals and a third, their wrapping sum, so that
//! a reader can tell a torn read.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use outboard_env::legacy::Cpu;

/// How long the thread stays in the driver at a stretch: the server's loop, which enters the
/// driver to answer a client, waits about this long (it may miss a pause and wait another).
const INSIDE: Duration = Duration::from_millis(10);
/// How long it stays out between stretches, so the loop's thread gets the lock.
const OUTSIDE: Duration = Duration::from_micros(50);
/// Calibration: stretches of work outside any driver.
const CALIBRATION_STRETCHES: u32 = 10;
/// Calibration: rounds of the bookkeeping alone.
const CALIBRATION_ROUNDS: u32 = 100;

/// The contending thread; stopped and joined on drop.
pub(crate) struct Contender {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Contender {
    /// Starts the thread on `cpu`'s driver, reporting to `path` (created or truncated).
    pub(crate) fn start(cpu: Arc<Cpu>, path: &Path) -> Result<Self, String> {
        let file = File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        // A whole report from the start: a reader never finds the file empty.
        report(&file, 0, 0);
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("contender".into())
            .spawn(move || contend(&cpu, &file, &s))
            .map_err(|e| format!("the contending thread: {e}"))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Contender {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads what a contender last wrote to `path`: (CPU ns since it entered, ns of it the
/// interrupts took); `None` if the file holds no whole report (after a few tries: a read may
/// meet a write half done).
pub fn read_report(path: &Path) -> Option<(u64, i64)> {
    for _ in 0..100 {
        if let Ok(b) = std::fs::read(path) {
            let word = |i: usize| -> Option<u64> {
                Some(u64::from_le_bytes(
                    b.get(i * 8..i * 8 + 8)?.try_into().ok()?,
                ))
            };
            if let (Some(cpu), Some(lost), Some(sum)) = (word(0), word(1), word(2)) {
                if cpu.wrapping_add(lost) == sum {
                    return Some((cpu, lost as i64));
                }
            }
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    None
}

fn thread_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// A unit of work that takes the same time every time.
pub fn work_unit(x: &mut u64) {
    for _ in 0..64 {
        *x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
    }
    std::hint::black_box(*x);
}

/// One stretch of work units for `INSIDE`; how many.
fn stretch(x: &mut u64) -> u64 {
    let end = Instant::now() + INSIDE;
    let mut units = 0;
    while Instant::now() < end {
        for _ in 0..64 {
            work_unit(x);
        }
        units += 64;
    }
    units
}

fn report(file: &File, cpu: u64, lost: i64) {
    let lost = lost as u64;
    let mut b = [0u8; 24];
    b[..8].copy_from_slice(&cpu.to_le_bytes());
    b[8..16].copy_from_slice(&lost.to_le_bytes());
    b[16..].copy_from_slice(&cpu.wrapping_add(lost).to_le_bytes());
    // Best effort: a report that could not be written leaves the previous one.
    let _ = file.write_all_at(&b, 0);
}

fn contend(cpu: &Arc<Cpu>, file: &File, stop: &AtomicBool) {
    let mut x = 1u64;
    // Calibration, outside the driver: the work rate, and the bookkeeping of a stretch
    // (report, sleep) beyond its work, both in CPU time of this thread.
    let (mut units, t0) = (0u64, thread_cpu_ns());
    for _ in 0..CALIBRATION_STRETCHES {
        units += stretch(&mut x);
    }
    let work_ns = (thread_cpu_ns() - t0).max(1);
    let ns_per_unit = work_ns as f64 / units.max(1) as f64;
    // Everything a stretch does besides its work: entering and leaving the driver (briefly:
    // an interrupt that lands meanwhile is counted here, a few among a hundred rounds), the
    // report, the pause.
    let t1 = thread_cpu_ns();
    for _ in 0..CALIBRATION_ROUNDS {
        drop(cpu.enter());
        report(file, 0, 0);
        std::thread::sleep(OUTSIDE);
    }
    let bookkeeping_ns = (thread_cpu_ns() - t1) as f64 / f64::from(CALIBRATION_ROUNDS);
    tracing::info!(
        "contender: {ns_per_unit:.2} ns per work unit, {bookkeeping_ns:.0} ns of bookkeeping \
         per stretch"
    );
    let (start, mut units, mut stretches) = (thread_cpu_ns(), 0u64, 0u64);
    while !stop.load(Ordering::SeqCst) {
        {
            let _inside = cpu.enter();
            units += stretch(&mut x);
        }
        stretches += 1;
        let used = thread_cpu_ns() - start;
        let earned = units as f64 * ns_per_unit + stretches as f64 * bookkeeping_ns;
        report(file, used, (used as f64 - earned) as i64);
        std::thread::sleep(OUTSIDE);
    }
}
