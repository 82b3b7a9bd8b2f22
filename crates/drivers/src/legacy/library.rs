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
//! as [`Described`], which matches like the loaded one but cannot start; its active probe, if
//! it has one, runs in a child too ([`set_remote_prober`], `outboard driver-lib PATH
//! --probe`), on a [`ProbeRequest`] that carries the device's configuration snapshot.

use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use serde::{Deserialize, Serialize};

use outboard_hw::ConfigSnapshot;

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
    /// Whether it has an active probe (run where the library is loaded).
    #[serde(default)]
    pub probe: bool,
    /// Whether it is written for the native model (`native.h`), not the legacy one.
    #[serde(default)]
    pub native: bool,
}

/// What a process that has not loaded a library does to run its driver's probe: in
/// Outboard's manager, ask a child that loads it.
pub type RemoteProber = fn(&Described, &ConfigSnapshot, u32) -> Result<u32, String>;

static REMOTE_PROBER: OnceLock<RemoteProber> = OnceLock::new();

/// Sets how this process runs the probes of libraries it has not loaded (once; later calls
/// change nothing).
pub fn set_remote_prober(p: RemoteProber) {
    let _ = REMOTE_PROBER.set(p);
}

/// A probe asked of another process: the device as the probe sees it and the starting score.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeRequest {
    /// The configuration space snapshot, as hexadecimal (512 digits).
    pub header: String,
    /// The BARs' sizes.
    pub bar_sizes: [u64; 6],
    /// The score the probe starts from.
    pub score: u32,
}

/// Its answer: a bid, or why the driver declines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
pub enum ProbeAnswer {
    /// The driver bids this score.
    Bid(u32),
    /// The driver declines the device, for this reason.
    Declined(String),
}

impl Described {
    /// A description as `outboard driver-lib PATH --json` prints it (its last line).
    pub fn parse(line: &str) -> Result<Self, String> {
        serde_json::from_str(line).map_err(|e| format!("its description does not parse: {e}"))
    }
}

/// Longest text of a library's (a reason, what its child said) that Outboard shows.
const MAX_SHOWN: usize = 512;

/// Text that came from a library's code, made fit to show in a log line, an error or the
/// registry: control characters (newlines, escapes) as `\u{..}`, at most 512 characters.
pub fn shown(text: &str) -> String {
    let text = text.trim();
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == MAX_SHOWN {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

impl ProbeAnswer {
    /// An answer as `outboard driver-lib PATH --probe` prints it (its last line): the bid,
    /// or why the driver declines (as [`shown`] makes it).
    pub fn parse(line: &str) -> Result<u32, String> {
        match serde_json::from_str(line) {
            Ok(ProbeAnswer::Bid(score)) => Ok(score),
            Ok(ProbeAnswer::Declined(why)) => Err(shown(&why)),
            Err(e) => Err(format!("its probe's answer does not parse: {e}")),
        }
    }
}

impl ProbeRequest {
    /// A request as read from standard input, checked: its snapshot and starting score.
    pub fn parse(text: &str) -> Result<(ConfigSnapshot, u32), String> {
        let r: Self = serde_json::from_str(text)
            .map_err(|e| format!("the probe request does not parse: {e}"))?;
        Ok((r.snapshot()?, r.score))
    }

    /// The request for a probe of `snapshot` from `score`.
    pub fn new(snapshot: &ConfigSnapshot, score: u32) -> Self {
        Self {
            header: snapshot.header.iter().map(|b| format!("{b:02x}")).collect(),
            bar_sizes: snapshot.bar_sizes,
            score,
        }
    }

    /// The snapshot it carries, checked.
    pub fn snapshot(&self) -> Result<ConfigSnapshot, String> {
        let digits = self.header.as_bytes();
        if digits.len() != 2 * ConfigSnapshot::SIZE {
            return Err(format!(
                "the configuration snapshot has {} hexadecimal digits, not {}",
                digits.len(),
                2 * ConfigSnapshot::SIZE
            ));
        }
        let mut header = Box::new([0u8; ConfigSnapshot::SIZE]);
        // Two hexadecimal digits per byte, nothing else ("+f" is not a byte).
        let digit = |d: u8| {
            char::from(d).to_digit(16).map(|v| v as u8).ok_or_else(|| {
                format!(
                    "{:?} in the configuration snapshot is not hexadecimal",
                    char::from(d)
                )
            })
        };
        for (b, pair) in header.iter_mut().zip(digits.chunks(2)) {
            *b = (digit(pair[0])? << 4) | digit(pair[1])?;
        }
        Ok(ConfigSnapshot {
            header,
            bar_sizes: self.bar_sizes,
        })
    }
}

/// Answers `request` (the text of a [`ProbeRequest`]) with the probe of `driver`, a library
/// loaded in this process.
pub fn answer_probe(driver: &LibraryDriver, request: &str) -> ProbeAnswer {
    let Some(c) = &driver.loaded else {
        return ProbeAnswer::Declined("its library is not loaded in this process".into());
    };
    let bid = ProbeRequest::parse(request).and_then(|(s, score)| super::probe::run(c, s, score));
    match bid {
        Ok(score) => ProbeAnswer::Bid(score),
        Err(why) => ProbeAnswer::Declined(why),
    }
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

    /// Its active probe of a device its ids took: run here if the library is loaded, else
    /// by this process's [`RemoteProber`]; without a probe the descriptor's score stands.
    pub fn probe(&self, dev: &Probe<'_>, initial: u32) -> Result<u32, String> {
        if let Some(c) = &self.loaded {
            return super::probe::probe_c(c, dev, initial);
        }
        if !self.described.probe {
            return Ok(initial);
        }
        let Probe::Pci(f) = dev else {
            return Err(format!("{} drives PCI functions", self.described.name));
        };
        let snapshot = f
            .snapshot()
            .map_err(|e| format!("the device cannot be looked at: {e}"))?;
        match REMOTE_PROBER.get() {
            Some(remote) => remote(&self.described, &snapshot, initial),
            None => Err(format!(
                "its probe runs only where its library {} is loaded",
                self.described.library.display()
            )),
        }
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
        faults: if class == outboard_clock::CLASS && !d.described.native {
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
            probe: c.has_probe(),
            native: c.model == super::descriptor::Model::Native,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> ConfigSnapshot {
        let mut header = Box::new([0u8; ConfigSnapshot::SIZE]);
        for (i, b) in header.iter_mut().enumerate() {
            *b = i as u8;
        }
        ConfigSnapshot {
            header,
            bar_sizes: [4096, 0, 16, 0, 0, 1 << 40],
        }
    }

    #[test]
    fn a_probe_request_says_the_snapshot_again_and_a_malformed_one_is_refused_with_why() {
        let s = snapshot();
        let text = serde_json::to_string(&ProbeRequest::new(&s, 77)).unwrap();
        assert_eq!(ProbeRequest::parse(&text), Ok((s.clone(), 77)));

        let mut r = ProbeRequest::new(&s, 1);
        r.header.pop();
        let e = ProbeRequest::parse(&serde_json::to_string(&r).unwrap()).unwrap_err();
        assert!(e.contains("511 hexadecimal digits, not 512"), "{e}");
        let mut r = ProbeRequest::new(&s, 1);
        r.header.replace_range(0..2, "+f");
        let e = ProbeRequest::parse(&serde_json::to_string(&r).unwrap()).unwrap_err();
        assert!(e.contains("'+'") && e.contains("not hexadecimal"), "{e}");
        let e = ProbeRequest::parse(
            "{\"header\":\"\",\"bar_sizes\":[0,0,0,0,0,0],\"score\":1,\"x\":1}",
        )
        .unwrap_err();
        assert!(e.contains("does not parse"), "{e}");
    }

    #[test]
    fn a_probe_answer_is_a_bid_or_a_reason_and_anything_else_is_refused() {
        assert_eq!(ProbeAnswer::parse("{\"bid\":3000}"), Ok(3000));
        assert_eq!(
            ProbeAnswer::parse("{\"declined\":\"too old\"}"),
            Err("too old".to_string())
        );
        for bad in ["", "{\"bid\":-1}", "{\"bid\":1,\"declined\":\"x\"}", "3000"] {
            let e = ProbeAnswer::parse(bad).unwrap_err();
            assert!(e.contains("does not parse"), "{bad}: {e}");
        }
    }
}
