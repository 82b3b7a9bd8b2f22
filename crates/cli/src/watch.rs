//! A client command's watch: no silent hang. While the command waits on a device, a thread
//! beside it says once on stderr why the device keeps it waiting (suspended, restarting,
//! given up: the registry's state, asked after a second without progress), and ends the
//! command at `--timeout` with what it had done: how many bytes of how many it moved.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The exit status of a command ended by `--timeout` (as `timeout(1)`'s).
pub const TIMED_OUT: i32 = 124;

/// How long without progress before the device's state is asked and told.
const QUIET: Duration = Duration::from_secs(1);

/// A command's progress, shared with its watch.
#[derive(Debug)]
pub struct Progress {
    /// What the command does, for messages (`blk write disk0`).
    what: String,
    /// Bytes to move (0: not a transfer, or not known yet).
    total: AtomicU64,
    /// Bytes moved so far.
    done: AtomicU64,
    /// "read" or "written".
    verb: &'static str,
    finished: AtomicBool,
}

impl Progress {
    /// Says how many bytes the transfer moves, once the command knows.
    pub fn with_total(&self, total: u64) -> &Self {
        self.total.store(total, Ordering::Relaxed);
        self
    }

    fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Counts `n` more bytes moved.
    pub fn add(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }

    /// How far it got, for a message: `3145728 of 10485760 bytes written`.
    pub fn so_far(&self) -> String {
        format!(
            "{} of {} bytes {}",
            self.done.load(Ordering::Relaxed),
            self.total(),
            self.verb
        )
    }

    /// `e` with how far the transfer got, if it is one and moved anything before it failed.
    pub fn cut_off(&self, e: String) -> String {
        if self.total() == 0 {
            return e;
        }
        format!("{e} (after {})", self.so_far())
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.progress.finished.store(true, Ordering::Relaxed);
    }
}

/// A running watch; it ends when dropped.
pub struct Watch {
    /// The command's progress: the command counts into it.
    pub progress: Arc<Progress>,
}

/// Watches `what` on `device` (asked about at `control`), ended at `timeout` if given. A
/// transfer says how many bytes it moves ([`Progress::with_total`]; `verb`: "read",
/// "written") and counts them.
pub fn start(
    what: String,
    control: PathBuf,
    device: Option<String>,
    verb: &'static str,
    timeout: Option<Duration>,
) -> Watch {
    let progress = Arc::new(Progress {
        what,
        total: AtomicU64::new(0),
        done: AtomicU64::new(0),
        verb,
        finished: AtomicBool::new(false),
    });
    let p = progress.clone();
    // The watch only reads and prints; a command that ends first leaves it sleeping, and the
    // process's exit ends it.
    let _ = std::thread::Builder::new()
        .name("watch".into())
        .spawn(move || watch(&p, &control, device.as_deref(), timeout));
    Watch { progress }
}

fn watch(p: &Progress, control: &std::path::Path, device: Option<&str>, timeout: Option<Duration>) {
    let started = Instant::now();
    let mut last = (0, started);
    let mut told = false;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        if p.finished.load(Ordering::Relaxed) {
            return;
        }
        let now = Instant::now();
        let done = p.done.load(Ordering::Relaxed);
        if done != last.0 {
            last = (done, now);
        }
        if let Some(t) = timeout.filter(|t| now.duration_since(started) >= *t) {
            let moved = if p.total() > 0 {
                format!(": {}", p.so_far())
            } else {
                String::new()
            };
            outboard_sys::errln!("outboard: {}: timed out after {t:?}{moved}", p.what);
            std::process::exit(TIMED_OUT);
        }
        if !told && now.duration_since(last.1) >= QUIET {
            told = true;
            if let Some(why) = device.and_then(|d| waiting_on(control, d)) {
                outboard_sys::errln!("outboard: {}: waiting: {why}", p.what);
            }
        }
    }
}

/// Why `device` keeps its clients waiting, if its registry entry says: suspended, being
/// restarted, given up, detaching.
fn waiting_on(control: &std::path::Path, device: &str) -> Option<String> {
    let node = outboard_client::manager::status(control, device).ok()?;
    let state = node.props.get("state")?.as_str()?.to_string();
    let word = state.split([':', ' ']).next().unwrap_or_default();
    let hint = match word {
        "serving" | "running" | "linked" | "starting" => return None,
        "suspended" | "suspending" => {
            format!("its requests wait until `outboard power {device} resume`")
        }
        "restarting" | "failed" => "its driver is being restarted; requests are sent again".into(),
        "gave" => format!("`outboard restart {device}` tries again now"),
        _ => "requests wait".into(),
    };
    Some(format!("{device} is {state}; {hint}"))
}
