//! C drivers built outside Outboard, as shared objects: loaded with `dlopen`, their descriptor
//! (`outboard_driver`, `include/outboard/driver.h`) read and checked, and their personality
//! added to the catalog beside the built-in ones.
//!
//! A library is loaded once per process and never unloaded (its descriptor, operations and
//! handlers must outlive every driver started from it). Its undefined `osenv_*` symbols
//! resolve against the `outboard` binary, which exports them.
//!
//! A process that only matches devices (the manager) need not run a library's code: it asks a
//! child (`outboard driver-lib PATH --json`) for the descriptor and registers the personality
//! as [`Described`], which matches and probes like the loaded one but cannot start.

use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use serde::{Deserialize, Serialize};

use super::descriptor::{CDriver, DescriptorError, RawDriver, ABI_VERSION};
use crate::personality::{Identity, Personality, Probe, Provider, StartError, StartOptions};

/// The symbol a driver library exports.
pub const SYMBOL: &str = "outboard_driver";

/// Why a library could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LibraryError {
    /// `dlopen` refused it.
    #[error("{path}: cannot load: {why}")]
    Load {
        /// The library.
        path: String,
        /// What `dlerror` said.
        why: String,
    },
    /// It exports no descriptor.
    #[error(
        "{path}: exports no `{SYMBOL}` (is it an Outboard driver? see include/outboard/driver.h)"
    )]
    NoDescriptor {
        /// The library.
        path: String,
    },
    /// Its descriptor is refused.
    #[error("{path}: {why}")]
    Descriptor {
        /// The library.
        path: String,
        /// Why.
        why: DescriptorError,
    },
    /// A driver of that name is already in the catalog.
    #[error("{path}: a driver named {name} is already in the catalog")]
    Duplicate {
        /// The library.
        path: String,
        /// The name.
        name: String,
    },
}

/// What a library's descriptor says, as a process that does not load it keeps it (and as
/// `outboard driver-lib --json` prints it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Described {
    /// The library's path.
    pub library: PathBuf,
    /// The descriptor's ABI version.
    pub abi_version: u32,
    /// The driver's name.
    pub name: String,
    /// Its class.
    pub class: String,
    /// Its PCI identities, `(vendor, device)`.
    pub ids: Vec<(u16, u16)>,
    /// Its score.
    pub score: u32,
}

/// A library driver in this process's catalog: loaded (it can start) or only described.
#[derive(Debug)]
pub struct LibraryDriver {
    /// What the descriptor says.
    pub described: Described,
    /// The descriptor itself, if the library is loaded here.
    pub loaded: Option<CDriver>,
}

impl LibraryDriver {
    /// Whether this driver takes a device of this identity.
    pub fn takes(&self, id: &Identity<'_>) -> bool {
        matches!(id, Identity::Pci(id) if self.described.ids.contains(&(id.vendor, id.device)))
    }

    /// The active probe: ABI version 1 has none, so the descriptor's score stands.
    pub fn probe(&self, _dev: &Probe<'_>, initial: u32) -> Result<u32, String> {
        Ok(initial)
    }

    /// Starts it on a device: through its class's bridge.
    pub fn start(
        &self,
        driver: &'static str,
        p: Provider,
        o: &StartOptions,
    ) -> Result<Box<dyn outboard_env::AnyDriver>, StartError> {
        let Some(c) = &self.loaded else {
            return Err(StartError::Refused(format!(
                "{driver}: its library {} is not loaded in this process",
                self.described.library.display()
            )));
        };
        super::start_c(driver, c, p, o)
    }
}

/// The library drivers registered in this process, as catalog entries (leaked: a catalog
/// entry lives as long as the process).
fn registered() -> &'static Mutex<Vec<&'static Personality>> {
    static LOADED: OnceLock<Mutex<Vec<&'static Personality>>> = OnceLock::new();
    LOADED.get_or_init(|| Mutex::new(Vec::new()))
}

/// The library drivers in the catalog.
pub fn personalities() -> Vec<&'static Personality> {
    registered()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
}

fn register(d: LibraryDriver) -> Result<&'static Personality, LibraryError> {
    let mut all = registered().lock().unwrap_or_else(|p| p.into_inner());
    let name = d.described.name.clone();
    let taken = crate::personality::builtin()
        .iter()
        .any(|p| p.driver == name)
        || all.iter().any(|p| p.driver == name);
    if taken {
        // Loading the same library twice is harmless: the first entry stands.
        if let Some(p) = all.iter().find(|p| {
            p.library
                .is_some_and(|l| l.described.library == d.described.library)
        }) {
            return Ok(p);
        }
        return Err(LibraryError::Duplicate {
            path: d.described.library.display().to_string(),
            name,
        });
    }
    let class: &'static str = match d.described.class.as_str() {
        outboard_clock::CLASS => outboard_clock::CLASS,
        outboard_char::CLASS => outboard_char::CLASS,
        other => Box::leak(other.to_string().into_boxed_str()),
    };
    let p: &'static Personality = Box::leak(Box::new(Personality {
        driver: Box::leak(name.into_boxed_str()),
        class,
        score: d.described.score,
        matches: |_| false,
        probe: |_, _| Err("a library driver probes through its entry".into()),
        start: |_, _| {
            Err(StartError::Refused(
                "a library driver starts through its entry".into(),
            ))
        },
        // A legacy clock driver has a process lock a measuring thread can hold.
        faults: if class == outboard_clock::CLASS {
            &[crate::personality::DriverFault::Contend]
        } else {
            &[]
        },
        library: Some(Box::leak(Box::new(d))),
    }));
    all.push(p);
    Ok(p)
}

/// Loads the driver library at `path` into this process and adds its driver to the catalog.
pub fn load(path: &Path) -> Result<&'static Personality, LibraryError> {
    // Absolute: a bare name would have dlopen search the library path instead.
    let path = &std::path::absolute(path).map_err(|e| LibraryError::Load {
        path: path.display().to_string(),
        why: e.to_string(),
    })?;
    let shown = path.display().to_string();
    let c_path =
        CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| LibraryError::Load {
            path: shown.clone(),
            why: "the path has a NUL byte".into(),
        })?;
    let raw = dlopen_descriptor(&c_path, &shown)?;
    // SAFETY: the symbol is the library's `struct outboard_driver` (driver.h), and the library
    // is never unloaded, so it and what it points to live for the rest of the process.
    let c = unsafe { CDriver::read(raw) }
        .and_then(|c| c.check_class().map(|()| c))
        .map_err(|why| LibraryError::Descriptor {
            path: shown.clone(),
            why,
        })?;
    register(LibraryDriver {
        described: Described {
            library: path.to_owned(),
            abi_version: ABI_VERSION,
            name: c.name.clone(),
            class: c.class.clone(),
            ids: c.ids.clone(),
            score: c.score,
        },
        loaded: Some(c),
    })
}

/// Adds a library's driver, as a child described it, to the catalog of a process that will
/// not start it (it matches and probes; its server loads the library).
pub fn register_described(d: Described) -> Result<&'static Personality, LibraryError> {
    register(LibraryDriver {
        described: d,
        loaded: None,
    })
}

fn dlerror() -> String {
    // SAFETY: dlerror returns a thread-local NUL-terminated message or NULL.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "no reason given".into()
    } else {
        // SAFETY: non-NULL: a valid C string until the next dl call on this thread.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

fn dlopen_descriptor(path: &CStr, shown: &str) -> Result<*const RawDriver, LibraryError> {
    // SAFETY: dlopen with a valid C string; the handle is kept (never dlclosed), which is what
    // keeps the descriptor alive. RTLD_NOW: an undefined symbol is an error now, not a crash
    // at the first call.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(LibraryError::Load {
            path: shown.into(),
            why: dlerror(),
        });
    }
    let sym = CString::new(SYMBOL).expect("no NUL");
    // SAFETY: a live handle and a valid C string.
    let p: *mut c_void = unsafe { libc::dlsym(handle, sym.as_ptr()) };
    if p.is_null() {
        return Err(LibraryError::NoDescriptor { path: shown.into() });
    }
    Ok(p as *const RawDriver)
}
