//! The machine's driver libraries (`[[driver]] library = PATH`): C drivers built outside
//! Outboard. The manager matches devices against them but does not run their code: a child
//! (`outboard driver-lib PATH --json`) loads each library and prints its descriptor, and the
//! manager adds the personality it describes to the catalog. A library driver's active probe
//! runs in such a child too (`outboard driver-lib PATH --probe`, the device's configuration
//! snapshot on its standard input). The driver server that drives a device with one loads the
//! library itself (`driver-host --driver-lib`).

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outboard_drivers::{DescribedLibrary, ProbeAnswer, ProbeRequest};
use outboard_hw::ConfigSnapshot;

/// How long describing one library may take.
const PATIENCE: Duration = Duration::from_secs(10);

/// Why a library cannot be used, in words that name it.
pub type LibraryError = String;

/// Adds each library's driver to the catalog, in order; the first that cannot be used stops
/// the machine from starting, with why.
pub fn register_all(paths: &[impl AsRef<Path>]) -> Result<(), LibraryError> {
    outboard_drivers::set_remote_prober(probe_in_child);
    for p in paths {
        let d = describe(p.as_ref())?;
        let name = d.name.clone();
        outboard_drivers::register_described(d).map_err(|e| e.to_string())?;
        tracing::info!("driver library {}: driver {name}", p.as_ref().display());
    }
    Ok(())
}

/// What a library's descriptor says, from a child that loads it.
fn describe(path: &Path) -> Result<DescribedLibrary, LibraryError> {
    let shown = path.display();
    let last = ask_child(path, "--json", None).map_err(|why| match why {
        ChildFailed::Said(said) => said,
        ChildFailed::Other(why) => format!("{shown}: loading it {why}"),
    })?;
    let mut d = DescribedLibrary::parse(&last).map_err(|e| format!("{shown}: {e}"))?;
    // The library is the one asked about, whatever the child said.
    d.library = path.to_path_buf();
    Ok(d)
}

/// Runs the probe of library driver `d` on `snapshot` from `score` in a child that loads the
/// library (the manager runs none of a library's code): its bid, or why it declines: a probe
/// that crashes, hangs or answers nonsense declines, and the manager goes on.
fn probe_in_child(
    d: &DescribedLibrary,
    snapshot: &ConfigSnapshot,
    score: u32,
) -> Result<u32, String> {
    let request = serde_json::to_string(&ProbeRequest::new(snapshot, score))
        .map_err(|e| format!("the probe request: {e}"))?;
    let last = ask_child(&d.library, "--probe", Some(request)).map_err(|why| match why {
        ChildFailed::Said(said) => format!("its probe failed: {said}"),
        ChildFailed::Other(why) => format!("its probe {why}"),
    })?;
    ProbeAnswer::parse(&last)
}

/// How a child asked about a library failed.
enum ChildFailed {
    /// It exited unsuccessfully and said why.
    Said(String),
    /// It could not start, crashed without a word, or took too long: what happened, as a
    /// predicate ("took more than 10s").
    Other(String),
}

/// Most of a child's output kept (the rest is read and dropped, so it cannot block).
const KEEP: u64 = 64 << 10;

/// Runs `outboard driver-lib PATH FLAG`, `input` on its standard input: the last line it
/// answered (it answers on a standard output nothing else writes to).
///
/// The child runs a library's code, so it is held like a stranger: in a process group of its
/// own, which is killed when the child ends or takes too long (helpers the library started go
/// with it); its output is read while it runs and only the first 64 KiB kept.
fn ask_child(path: &Path, flag: &str, input: Option<String>) -> Result<String, ChildFailed> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe()
        .map_err(|e| ChildFailed::Other(format!("failed: this program's path: {e}")))?;
    let mut child = Command::new(exe)
        .arg("driver-lib")
        .arg(path)
        .arg(flag)
        .process_group(0)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| ChildFailed::Other(format!("could not start: {e}")))?;
    if let (Some(mut stdin), Some(text)) = (child.stdin.take(), input) {
        // A child that dies before reading is reported by its status below.
        std::thread::spawn(move || {
            let _ = std::io::Write::write_all(&mut stdin, text.as_bytes());
        });
    }
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = (&mut r).take(KEEP).read_to_end(&mut v);
                let _ = std::io::copy(&mut r, &mut std::io::sink());
            }
            let _ = tx.send(v);
        });
        rx
    };
    let stdout = drain(child.stdout.take().map(|o| Box::new(o) as _));
    let stderr = drain(child.stderr.take().map(|o| Box::new(o) as _));
    let pid = rustix::process::Pid::from_raw(child.id() as i32)
        .ok_or_else(|| ChildFailed::Other("failed: no process id".into()))?;
    let deadline = Instant::now() + PATIENCE;
    // Waited for without reaping it: until it is reaped, its pid (its group's id) cannot be
    // anyone else's, so the group may be killed.
    let ended = loop {
        let opts = rustix::process::WaitIdOptions::EXITED
            | rustix::process::WaitIdOptions::NOHANG
            | rustix::process::WaitIdOptions::NOWAIT;
        match rustix::process::waitid(rustix::process::WaitId::Pid(pid), opts) {
            Ok(Some(_)) => break true,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => break false,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(ChildFailed::Other(format!("failed: {e}"))),
        }
    };
    // Our own child's group, its leader not yet reaped.
    let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    let status = child
        .wait()
        .map_err(|e| ChildFailed::Other(format!("failed: {e}")))?;
    if !ended {
        return Err(ChildFailed::Other(format!(
            "took more than {PATIENCE:?} (it hangs?)"
        )));
    }
    // Its group is gone; a process that left it and still holds the pipes is not waited for.
    let collect = |rx: std::sync::mpsc::Receiver<Vec<u8>>| {
        rx.recv_timeout(Duration::from_secs(1)).map_err(|_| {
            ChildFailed::Other(
                "left a process behind that holds its output (a library that daemonises?)".into(),
            )
        })
    };
    let out = collect(stdout)?;
    let err = collect(stderr)?;
    if !status.success() {
        let said = outboard_drivers::shown_library_text(&String::from_utf8_lossy(&err));
        let said = said.trim_start_matches("outboard: ").to_string();
        return Err(if said.is_empty() {
            ChildFailed::Other(format!("failed ({status})"))
        } else {
            ChildFailed::Said(said)
        });
    }
    let out = String::from_utf8_lossy(&out);
    Ok(out.lines().last().unwrap_or_default().to_string())
}
