//! Building drivers outside Outboard: `outboard sdk` installs the C headers and a `pkg-config`
//! file (they are built into the binary, so they install with it), and `outboard driver-lib`
//! loads a driver library and says what its descriptor declares, or why it is refused.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;

/// The headers a C driver is built against, by name.
const HEADERS: &[(&str, &str)] = &[
    ("osenv.h", include_str!("../../../include/outboard/osenv.h")),
    (
        "native.h",
        include_str!("../../../include/outboard/native.h"),
    ),
    (
        "driver.h",
        include_str!("../../../include/outboard/driver.h"),
    ),
    ("clock.h", include_str!("../../../include/outboard/clock.h")),
    ("char.h", include_str!("../../../include/outboard/char.h")),
];

/// `outboard sdk`.
#[derive(Args)]
pub struct SdkArgs {
    /// Install under this prefix: PREFIX/include/outboard/*.h and
    /// PREFIX/lib/pkgconfig/outboard-driver.pc (then `pkg-config --cflags outboard-driver`,
    /// with PKG_CONFIG_PATH=PREFIX/lib/pkgconfig if PREFIX is not a system one).
    #[arg(long, value_name = "PREFIX", default_value = "/usr/local")]
    prefix: PathBuf,
}

fn pc_file(prefix: &Path) -> String {
    format!(
        "prefix={}\nincludedir=${{prefix}}/include\n\nName: outboard-driver\nDescription: Headers \
         for Outboard drivers written in C: osenv.h (the legacy environment), native.h (the \
         native model), driver.h (the descriptor, ABI {}), clock.h, char.h\nVersion: {}\nCflags: -I${{includedir}}\nLibs:\n",
        prefix.display(),
        outboard_drivers::legacy::descriptor::ABI_VERSION,
        env!("CARGO_PKG_VERSION"),
    )
}

pub fn sdk(a: SdkArgs) -> Result<ExitCode, String> {
    let prefix = if a.prefix.is_relative() {
        std::env::current_dir()
            .map_err(|e| format!("the current directory: {e}"))?
            .join(&a.prefix)
    } else {
        a.prefix.clone()
    };
    let include = prefix.join("include/outboard");
    let pkgconfig = prefix.join("lib/pkgconfig");
    for d in [&include, &pkgconfig] {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    for (name, text) in HEADERS {
        let p = include.join(name);
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
        println!("{}", p.display());
    }
    let pc = pkgconfig.join("outboard-driver.pc");
    std::fs::write(&pc, pc_file(&prefix)).map_err(|e| format!("{}: {e}", pc.display()))?;
    println!("{}", pc.display());
    Ok(ExitCode::SUCCESS)
}

/// `outboard driver-lib`.
#[derive(Args)]
pub struct DriverLibArgs {
    /// The shared object (`cc -shared -fPIC $(pkg-config --cflags outboard-driver) …`).
    library: PathBuf,
    /// Print the descriptor as JSON (what the manager reads).
    #[arg(long)]
    json: bool,
    /// Run the driver's active probe on the device described on standard input (a JSON
    /// probe request: its configuration snapshot and starting score) and print the answer
    /// as JSON: what the manager asks, which runs no library's code itself.
    #[arg(long, conflicts_with = "json")]
    probe: bool,
}

pub fn driver_lib(a: DriverLibArgs) -> Result<ExitCode, String> {
    // A library that crashes while loading or probing is reported by this process's status;
    // it leaves no core file behind (best effort: the limit only ever goes down).
    let core = rustix::process::Resource::Core;
    let _ = rustix::process::setrlimit(
        core,
        rustix::process::Rlimit {
            current: Some(0),
            maximum: rustix::process::getrlimit(core).maximum,
        },
    );
    // What the manager asks for is read before the library's code runs, and answered on a
    // standard output nothing else writes to.
    let mut request = String::new();
    if a.probe {
        std::io::stdin()
            .lock()
            .take(64 * 1024)
            .read_to_string(&mut request)
            .map_err(|e| format!("the probe request: {e}"))?;
    }
    let mut answer_to = (a.probe || a.json)
        .then(outboard_sys::process::private_stdout)
        .transpose()?;
    let p = outboard_drivers::load_library(&a.library).map_err(|e| e.to_string())?;
    let library = p.library.expect("a library's personality");
    let d = &library.described;
    if let Some(out) = &mut answer_to {
        let json = if a.probe {
            serde_json::to_string(&outboard_drivers::answer_probe(library, &request))
        } else {
            serde_json::to_string(d)
        }
        .map_err(|e| e.to_string())?;
        writeln!(out, "{json}").map_err(|e| format!("the answer: {e}"))?;
        return Ok(ExitCode::SUCCESS);
    }
    let ids: Vec<String> = d
        .ids
        .iter()
        .map(|(v, dv)| format!("{v:04x}:{dv:04x}"))
        .collect();
    println!(
        "{} (driver library {}, driver ABI {})",
        d.name,
        d.library.display(),
        d.abi_version
    );
    println!("  class  {}", d.class);
    println!("  ids    {}", ids.join(", "));
    println!("  score  {}", d.score);
    println!(
        "  model  {}",
        if d.native {
            "native (native.h: called by the work loop)"
        } else {
            "legacy (osenv.h: a uniprocessor kernel's rules)"
        }
    );
    println!(
        "  probe  {}",
        if d.probe {
            "yes (it bids after a look at each device)"
        } else {
            "none (its score is its bid)"
        }
    );
    Ok(ExitCode::SUCCESS)
}
