//! The machine's driver libraries (`[[driver]] library = PATH`): C drivers built outside
//! Outboard. The manager matches devices against them but does not run their code: a child
//! (`outboard driver-lib PATH --json`) loads each library and prints its descriptor, and the
//! manager adds the personality it describes to the catalog. The driver server that drives a
//! device with one loads the library itself (`driver-host --driver-lib`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outboard_drivers::DescribedLibrary;

/// How long describing one library may take.
const PATIENCE: Duration = Duration::from_secs(10);

/// Why a library cannot be used, in words that name it.
pub type LibraryError = String;

/// Adds each library's driver to the catalog, in order; the first that cannot be used stops
/// the machine from starting, with why.
pub fn register_all(paths: &[impl AsRef<Path>]) -> Result<(), LibraryError> {
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
    let exe = std::env::current_exe().map_err(|e| format!("{shown}: this program's path: {e}"))?;
    let mut child = Command::new(exe)
        .arg("driver-lib")
        .arg(path)
        .arg("--json")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{shown}: cannot start its describer: {e}"))?;
    // Its output is read while it runs (a chatty library cannot fill a pipe and look hung);
    // it is waited for here, and killed if it takes too long.
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let stdout = drain(child.stdout.take().map(|o| Box::new(o) as _));
    let stderr = drain(child.stderr.take().map(|o| Box::new(o) as _));
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                // Our own child, not yet reaped: its pid is still ours to kill.
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{shown}: loading it took more than {PATIENCE:?} (its initialisers hang?)"
                ));
            }
            Err(e) => return Err(format!("{shown}: {e}")),
        }
    };
    let out = stdout.join().unwrap_or_default();
    let err = stderr.join().unwrap_or_default();
    if !status.success() {
        let said = String::from_utf8_lossy(&err);
        let said = said.trim().trim_start_matches("outboard: ");
        return Err(if said.is_empty() {
            format!("{shown}: loading it failed ({status})")
        } else {
            said.to_string()
        });
    }
    // The description is the last line: a library's initialisers may have printed before it.
    let last = String::from_utf8_lossy(&out);
    let last = last.lines().last().unwrap_or_default();
    serde_json::from_str(last).map_err(|e| format!("{shown}: its description does not parse: {e}"))
}
