//! Personalities (I/O Kit): what each driver can drive, how strongly it claims it, and how to
//! start it. The manager matches with these; the driver server starts the personality the
//! manager chose, by name — the match that was made is the one that runs.

use std::str::FromStr;

use outboard_env::{AnyDriver, DeviceEnv};
use outboard_hw::{DeviceSpec, HwError, PciFunction, PciIdentity};

use crate::null_blk::NullBlock;
use crate::virtio_blk::{BlkDriverOptions, VirtioBlk};
use crate::virtio_block::VirtioBlock;

/// Where a device is: a PCI function behind a backend, or a virtual device with no hardware
/// (its model's name and its parameters, which the model's personality reads).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attachment {
    /// A PCI function (vfio-user socket or VFIO address).
    Pci(DeviceSpec),
    /// A virtual device.
    Virtual {
        /// Its model (`null-blk`), which matching sees.
        model: String,
        /// What its personality is told (`null-blk`: the size).
        params: String,
    },
}

impl FromStr for Attachment {
    type Err = String;

    /// `virtual:MODEL[:PARAMS]`, `null:SIZE` (short for `virtual:null-blk:SIZE`), or a device
    /// spec (`vfio-user:PATH`, `vfio:BDF`).
    fn from_str(s: &str) -> Result<Self, String> {
        let (model, params) = if let Some(size) = s.strip_prefix("null:") {
            ("null-blk", size)
        } else if let Some(rest) = s.strip_prefix("virtual:") {
            rest.split_once(':').unwrap_or((rest, ""))
        } else {
            return s.parse().map(Attachment::Pci);
        };
        if model.is_empty() {
            return Err(format!("{s:?}: name the virtual device's model"));
        }
        let at = Attachment::Virtual {
            model: model.into(),
            params: params.into(),
        };
        // A virtual device's parameters are its personality's to judge, now, not at start.
        if model == "null-blk" {
            null_blk_size(params).map_err(|e| format!("{s:?}: {e}"))?;
        }
        Ok(at)
    }
}

impl std::fmt::Display for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Attachment::Pci(spec) => spec.fmt(f),
            Attachment::Virtual { model, params } if model == "null-blk" => {
                write!(f, "null:{params}")
            }
            Attachment::Virtual { model, params } => write!(f, "virtual:{model}:{params}"),
        }
    }
}

/// The null disk's size from its parameters: whole 512-byte sectors.
fn null_blk_size(params: &str) -> Result<u64, String> {
    match outboard_sys::units::parse_size(params) {
        Some(bytes) if bytes > 0 && bytes.is_multiple_of(512) => Ok(bytes),
        _ => Err("a null disk needs a size in whole 512-byte sectors (null:1G)".into()),
    }
}

/// What matching sees of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Identity<'a> {
    /// A PCI function's identity.
    Pci(PciIdentity),
    /// A virtual device, by model name (`null-blk`).
    Virtual(&'a str),
}

/// The device an active probe examines: read-only looks (configuration space, BAR sizes);
/// a probe changes nothing on the device.
#[derive(Debug, Clone, Copy)]
pub enum Probe<'a> {
    /// An opened PCI function.
    Pci(&'a PciFunction),
    /// A virtual device, by model name.
    Virtual(&'a str),
}

impl<'a> Probe<'a> {
    /// What passive matching sees of it.
    pub fn identity(&self) -> Identity<'a> {
        match self {
            Probe::Pci(f) => Identity::Pci(f.identity()),
            Probe::Virtual(model) => Identity::Virtual(model),
        }
    }
}

/// The winner of a match: the personality and the score its probe gave.
#[derive(Debug, Clone)]
pub struct Probed {
    /// The personality.
    pub personality: &'static Personality,
    /// Its probe score.
    pub score: u32,
    /// The drivers whose ids took the device but whose probes declined it, each with why
    /// ("picky declined: …"): what a user asks when another driver won.
    pub declined: Vec<String>,
}

/// The device a personality's `start` receives.
#[derive(Debug)]
pub enum Provider {
    /// An opened PCI function.
    Pci(PciFunction),
    /// A virtual device: its model and parameters.
    Virtual {
        /// Its model.
        model: String,
        /// Its parameters.
        params: String,
    },
}

/// What a driver is started with besides its device.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// The class device's name (`disk0`).
    pub name: String,
    /// Most device queues to use.
    pub queues: u16,
    /// Fault injection: the driver aborts its process whenever a request touches this
    /// sector, every time — a request that kills its driver (what quarantine is for). The
    /// virtio-blk driver honours it.
    pub abort_on: Option<u64>,
    /// Measurement (`outboard bench clock`, contested delivery in a driver server): a
    /// process-level thread holds the driver nearly all the time, doing counted work, and
    /// reports to this file what the driver's interrupts took from it
    /// (`legacy::contender`). Legacy clock drivers honour it.
    pub contend: Option<std::path::PathBuf>,
}

/// Why a driver could not be started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    /// Another client holds the device.
    #[error("{0}: another client drives this device")]
    Busy(String),
    /// The device could not be reached (no model at the socket, no such VFIO device).
    #[error("{0}")]
    Unreachable(String),
    /// No personality matches the device, or the named one does not.
    #[error("{0}")]
    NoMatch(String),
    /// The driver looked at the device and refused it, or failed to bring it up; the message
    /// says why (a device it cannot drive safely is refused here, before any I/O).
    #[error("{0}")]
    Refused(String),
}

/// Brings a driver up on a device: the driver behind its class's binding.
pub type StartFn = fn(Provider, &StartOptions) -> Result<Box<dyn AnyDriver>, StartError>;

/// What a driver can drive, and how strongly it claims it.
#[derive(Debug, Clone, Copy)]
pub struct Personality {
    /// Driver name.
    pub driver: &'static str,
    /// Class of device it publishes.
    pub class: &'static str,
    /// Initial probe score, which the active probe may change; the highest score wins.
    pub score: u32,
    /// Passive match on identity.
    pub matches: fn(&Identity<'_>) -> bool,
    /// Active probe of a passively matched device: its score, or why the driver declines it.
    pub probe: fn(&Probe<'_>, u32) -> Result<u32, String>,
    /// Brings the driver up on the device.
    pub start: StartFn,
    /// The driver faults it can inject (see [`DriverFault`]); one asked of a driver that
    /// cannot is refused, not ignored.
    pub faults: &'static [DriverFault],
    /// A C driver from a shared object (`crate::legacy::library`): it matches, probes and
    /// starts through its descriptor, not through the three functions above.
    pub library: Option<&'static crate::legacy::library::LibraryDriver>,
}

/// A fault a driver injects in itself, for testing what a crashing driver costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverFault {
    /// [`StartOptions::abort_on`]: it aborts its process whenever a request touches a sector.
    AbortOn,
    /// [`StartOptions::contend`]: a process-level thread can hold it (a legacy driver).
    Contend,
}

impl Personality {
    /// Whether its passive match takes a device of this identity.
    pub fn takes(&self, id: &Identity<'_>) -> bool {
        match self.library {
            Some(l) => l.takes(id),
            None => (self.matches)(id),
        }
    }

    /// Its active probe of a device its passive match took: its score, or why it declines.
    pub fn probe_device(&self, dev: &Probe<'_>) -> Result<u32, String> {
        match self.library {
            Some(l) => l.probe(dev, self.score),
            None => (self.probe)(dev, self.score),
        }
    }

    /// Brings it up on a device.
    pub fn start_device(
        &self,
        p: Provider,
        o: &StartOptions,
    ) -> Result<Box<dyn AnyDriver>, StartError> {
        match self.library {
            Some(l) => l.start(self.driver, p, o),
            None => (self.start)(p, o),
        }
    }

    /// Why `opts` asks this driver for a fault it cannot inject, if it does.
    pub fn refuses(&self, opts: &StartOptions) -> Option<String> {
        if opts.contend.is_some() && !self.faults.contains(&DriverFault::Contend) {
            return Some(format!(
                "contend: the {} driver has no process lock for a thread to hold (only legacy \
                 clock drivers do)",
                self.driver
            ));
        }
        (opts.abort_on.is_some() && !self.faults.contains(&DriverFault::AbortOn)).then(|| {
            format!(
                "driver_abort_on: the {} driver cannot abort on a sector (its requests name none)",
                self.driver
            )
        })
    }
}

/// A started driver and its environment.
#[derive(Debug)]
pub struct Started {
    /// The driver, behind its class's binding (the class's own code takes it out).
    pub driver: Box<dyn AnyDriver>,
    /// Its device's environment (DMA mappings for memory others own).
    pub env: DeviceEnv,
    /// The personality that was started.
    pub personality: &'static Personality,
}

/// Whether a function is a virtio-blk device (any virtio-blk driver's passive match).
pub(crate) fn virtio_blk_matches(id: &Identity<'_>) -> bool {
    matches!(id, Identity::Pci(id) if crate::virtio_blk::matches(id))
}

/// Any virtio-blk driver's active probe: the modern virtio structures it needs are there.
pub(crate) fn virtio_blk_probe(dev: &Probe<'_>, initial: u32) -> Result<u32, String> {
    let Probe::Pci(f) = dev else {
        return Err("virtio-blk drives PCI functions".into());
    };
    let caps = crate::virtio::transport::virtio_caps(f).map_err(|e| e.to_string())?;
    let bars = f.bar_sizes().map_err(|e| e.to_string())?;
    crate::virtio_blk::probe_score(&f.identity(), &caps, &bars, initial)
}

fn virtio_blk_start(p: Provider, o: &StartOptions) -> Result<Box<dyn AnyDriver>, StartError> {
    let Provider::Pci(f) = p else {
        return Err(StartError::NoMatch(
            "virtio-blk drives PCI functions".into(),
        ));
    };
    let opts = BlkDriverOptions {
        queues: o.queues.max(1),
        ..Default::default()
    };
    let chip = VirtioBlk::new(f, opts).map_err(|e| StartError::Refused(e.to_string()))?;
    Ok(outboard_block::bind(
        VirtioBlock::new(&o.name, chip).abort_on(o.abort_on),
    ))
}

fn null_blk_matches(id: &Identity<'_>) -> bool {
    *id == Identity::Virtual("null-blk")
}

/// Nothing to examine: a null disk is always what it says.
fn null_blk_probe(_: &Probe<'_>, initial: u32) -> Result<u32, String> {
    Ok(initial)
}

fn null_blk_start(p: Provider, o: &StartOptions) -> Result<Box<dyn AnyDriver>, StartError> {
    match p {
        Provider::Virtual { params, .. } => Ok(outboard_block::bind(NullBlock::new(
            &o.name,
            null_blk_size(&params).map_err(StartError::Refused)?,
        ))),
        Provider::Pci(_) => Err(StartError::NoMatch("null-blk drives no hardware".into())),
    }
}

static PERSONALITIES: &[Personality] = &[
    Personality {
        driver: "virtio-blk",
        class: outboard_block::CLASS,
        score: 1000,
        matches: virtio_blk_matches,
        probe: virtio_blk_probe,
        start: virtio_blk_start,
        faults: &[DriverFault::AbortOn],
        library: None,
    },
    Personality {
        driver: "null-blk",
        class: outboard_block::CLASS,
        score: 1000,
        matches: null_blk_matches,
        probe: null_blk_probe,
        start: null_blk_start,
        faults: &[],
        library: None,
    },
    crate::virtio_rng::PERSONALITY,
    crate::virtio_net::PERSONALITY,
    crate::legacy::clock::TIMER,
    crate::legacy::serial::UART16550,
    crate::native_c::clock::NATIVE_C_TIMER,
    crate::native_c::char::NATIVE_C_UART16550,
    crate::hosted::blk::PERSONALITY,
    crate::timer::PERSONALITY,
];

/// Every built-in driver's personality.
pub fn builtin() -> &'static [Personality] {
    PERSONALITIES
}

/// Every driver in this process's catalog: the built-in ones, then those loaded from
/// libraries (`crate::legacy::library`).
pub fn personalities() -> Vec<&'static Personality> {
    let mut all: Vec<&'static Personality> = PERSONALITIES.iter().collect();
    all.extend(crate::legacy::library::personalities());
    all
}

/// The drivers whose passive match takes `id`.
pub fn candidates<'a>(id: &'a Identity<'a>) -> impl Iterator<Item = &'static Personality> + 'a {
    personalities().into_iter().filter(move |p| p.takes(id))
}

/// What [`probe_driver`] says when no personality's passive match takes the device.
pub const NO_MATCH: &str = "no driver matches";

/// The best driver for a device (I/O Kit's matching): every personality whose passive match
/// takes its identity probes it, and the highest score wins. The error says why none did: no
/// passive match, or each candidate's reason for declining.
pub fn probe_driver(dev: &Probe<'_>) -> Result<Probed, String> {
    let id = dev.identity();
    let mut best: Option<(&'static Personality, u32)> = None;
    let mut declined = Vec::new();
    for personality in candidates(&id) {
        match personality.probe_device(dev) {
            Ok(score) if best.is_none_or(|(_, b)| score > b) => best = Some((personality, score)),
            Ok(_) => {}
            Err(why) => {
                tracing::info!("{} declined the device: {why}", personality.driver);
                declined.push(format!("{} declined: {why}", personality.driver));
            }
        }
    }
    match best {
        Some((personality, score)) => Ok(Probed {
            personality,
            score,
            declined,
        }),
        None if declined.is_empty() => Err(NO_MATCH.to_string()),
        None => Err(declined.join("; ")),
    }
}

/// The personality named `driver`.
pub fn by_name(driver: &str) -> Option<&'static Personality> {
    personalities().into_iter().find(|p| p.driver == driver)
}

fn open_function(spec: &DeviceSpec) -> Result<PciFunction, StartError> {
    PciFunction::open(spec).map_err(|e| match e {
        HwError::Busy { spec } => StartError::Busy(spec.to_string()),
        e @ HwError::Open { .. } => StartError::Unreachable(e.to_string()),
        e => StartError::Refused(format!("{spec}: {e}")),
    })
}

/// Starts a driver again from scratch: the driver and its environment, or why not.
pub type Restarter =
    std::sync::Arc<dyn Fn() -> Result<(Box<dyn AnyDriver>, DeviceEnv), String> + Send + Sync>;

/// How to start the personality `driver` on the device at `at` again, from scratch, after a
/// failure (a driver server's recovery runs it on a helper thread).
#[allow(clippy::type_complexity)]
pub fn restarter(
    at: &Attachment,
    driver: &'static str,
    opts: &StartOptions,
) -> std::sync::Arc<
    dyn Fn() -> Result<(Box<dyn AnyDriver>, DeviceEnv), Box<dyn std::error::Error + Send + Sync>>
        + Send
        + Sync,
> {
    let at = at.clone();
    let opts = opts.clone();
    std::sync::Arc::new(move || {
        start(&at, Some(driver), &opts)
            .map(|s| (s.driver, s.env))
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
    })
}

/// Starts the best-matching driver on the device at `at` for a colocated client (the driver
/// in the client's process): one queue, since a client in one thread has nothing to spread
/// over several.
pub fn start_colocated(name: &str, at: &Attachment) -> Result<Started, StartError> {
    let opts = StartOptions {
        name: name.into(),
        queues: 1,
        ..Default::default()
    };
    start(at, None, &opts)
}

/// Opens the device at `at` and starts `driver` on it — or, if `driver` is `None`, the
/// personality that matches best. A named personality must still match the device.
pub fn start(
    at: &Attachment,
    driver: Option<&str>,
    opts: &StartOptions,
) -> Result<Started, StartError> {
    let (provider, env) = match at {
        Attachment::Pci(spec) => {
            let f = open_function(spec)?;
            let env = DeviceEnv::for_function(&f);
            (Provider::Pci(f), env)
        }
        Attachment::Virtual { model, params } => (
            Provider::Virtual {
                model: model.clone(),
                params: params.clone(),
            },
            DeviceEnv::virtual_device(),
        ),
    };
    let (probe, described) = match &provider {
        Provider::Pci(f) => {
            let id = f.identity();
            (
                Probe::Pci(f),
                format!("{at} ({:04x}:{:04x})", id.vendor, id.device),
            )
        }
        Provider::Virtual { model, .. } => (Probe::Virtual(model), at.to_string()),
    };
    let personality = match driver {
        Some(name) => {
            let p = by_name(name)
                .ok_or_else(|| StartError::NoMatch(format!("no driver named {name:?}")))?;
            if !p.takes(&probe.identity()) {
                return Err(StartError::NoMatch(format!(
                    "driver {name} does not match {described}"
                )));
            }
            p.probe_device(&probe)
                .map_err(|why| StartError::Refused(format!("{described}: {name}: {why}")))?;
            p
        }
        None => {
            probe_driver(&probe)
                .map_err(|why| StartError::NoMatch(format!("{described}: {why}")))?
                .personality
        }
    };
    if let Some(why) = personality.refuses(opts) {
        return Err(StartError::Refused(format!("{described}: {why}")));
    }
    let driver = personality
        .start_device(provider, opts)
        .map_err(|e| match e {
            StartError::Refused(why) => StartError::Refused(format!("{described}: {why}")),
            e => e,
        })?;
    Ok(Started {
        driver,
        env,
        personality,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attachments_parse_and_print_back() {
        for s in ["null:4096", "vfio-user:/run/d.sock", "vfio:0000:00:04.0"] {
            assert_eq!(s.parse::<Attachment>().unwrap().to_string(), s);
        }
        assert_eq!(
            "null:1M".parse::<Attachment>().unwrap(),
            "null:1M".parse::<Attachment>().unwrap()
        );
        assert!("null:100".parse::<Attachment>().is_err());
        assert!("null:".parse::<Attachment>().is_err());
        assert!("nonsense:x".parse::<Attachment>().is_err());
    }

    #[test]
    fn the_null_disk_is_matched_by_null_blk_only() {
        let p = probe_driver(&Probe::Virtual("null-blk")).unwrap();
        assert_eq!(p.personality.driver, "null-blk");
        assert_eq!(p.score, 1000);
        assert_eq!(
            probe_driver(&Probe::Virtual("other")).unwrap_err(),
            "no driver matches"
        );
    }

    #[test]
    fn a_named_driver_that_does_not_match_is_refused_before_it_starts() {
        let at = "null:1M".parse::<Attachment>().unwrap();
        let opts = StartOptions {
            name: "n".into(),
            queues: 1,
            ..Default::default()
        };
        let e = start(&at, Some("virtio-blk"), &opts).unwrap_err();
        assert!(matches!(e, StartError::NoMatch(m) if m.contains("does not match")));
        let e = start(&at, Some("nvme"), &opts).unwrap_err();
        assert!(matches!(e, StartError::NoMatch(m) if m.contains("no driver named")));
        let s = start(&at, None, &opts).unwrap();
        assert_eq!(s.personality.driver, "null-blk");
        assert_eq!(s.driver.class(), "block");
    }
}
