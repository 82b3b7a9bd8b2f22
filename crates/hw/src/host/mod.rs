//! The host's PCI functions as sysfs shows them, and handing one to `vfio-pci` and back — what
//! `dpdk-devbind.py --status`/`--bind` and SPDK's `setup.sh` do for their user-space drivers.
//!
//! Everything here reads or writes files under a [`HostView`]: the real `/sys` and `/proc`, or
//! a tree a test built (`--sysfs-root`), so the refusals can be tested on a machine whose own
//! functions must never be touched. Reading is harmless; the writes ([`HostView::bind`],
//! [`HostView::unbind`]) are made only after every refusal has been checked, and never to a
//! file that does not exist (a missing file is an error, not created).

mod bind;
mod usage;

use std::path::{Path, PathBuf};

pub use bind::{Bound, Unbound};

use crate::PciIdentity;

/// The kernel driver that hands a function to user space through VFIO.
pub const VFIO_PCI: &str = "vfio-pci";

/// Kernel drivers that leave a function's DMA to its owner: a function bound to one of these
/// (or to none) does not stop the rest of its IOMMU group from being used through VFIO.
const DMA_OWNER_SAFE: &[&str] = &[VFIO_PCI, "pci-stub", "pcieport"];

/// What went wrong looking at or moving a host function.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// No such function.
    #[error("no PCI function {0} (see `outboard hw list`)")]
    NoFunction(String),
    /// Not a PCI address.
    #[error("{0} is not a PCI address (domain:bus:device.function, e.g. 0000:03:00.0)")]
    NotAnAddress(String),
    /// The machine has no IOMMU groups, so VFIO cannot be used at all.
    #[error(
        "this machine has no IOMMU groups, so no function can be used through VFIO (turn the \
         IOMMU on: VT-d/AMD-Vi in the firmware and intel_iommu=on or amd_iommu=on on the kernel \
         command line); nothing was changed"
    )]
    NoIommu,
    /// The function is in no IOMMU group.
    #[error("{0} is in no IOMMU group: VFIO cannot take it; nothing was changed")]
    NoGroup(String),
    /// A bridge: its functions hang below it.
    #[error("{0} is a bridge ({1}): the functions behind it depend on it; it is never handed to a driver")]
    Bridge(String, &'static str),
    /// `vfio-pci` is not loaded.
    #[error("the vfio-pci driver is not loaded (modprobe vfio-pci); nothing was changed")]
    NoVfioPci,
    /// The kernel driver is using the function.
    #[error(
        "{bdf} is in use by its kernel driver {driver}: {}; stop using it first, or pass --force \
         to take it anyway; nothing was changed",
        uses.join("; ")
    )]
    InUse {
        /// The function.
        bdf: String,
        /// Its driver.
        driver: String,
        /// Each use found.
        uses: Vec<String>,
    },
    /// `unbind` of a function that is not bound to `vfio-pci`.
    #[error("{bdf} is not bound to vfio-pci (its driver: {}); nothing was changed", driver.as_deref().unwrap_or("none"))]
    NotVfio {
        /// The function.
        bdf: String,
        /// Its driver.
        driver: Option<String>,
    },
    /// A process holds the function's VFIO group open.
    #[error(
        "{bdf}'s VFIO group /dev/vfio/{group} is open in {}: stop it first (an Outboard driver \
         server: `outboard detach`); nothing was changed",
        holders.join(", ")
    )]
    Open {
        /// The function.
        bdf: String,
        /// Its group.
        group: u32,
        /// The processes holding it (`pid (command)`).
        holders: Vec<String>,
    },
    /// A sysfs write or read failed.
    #[error("{path}: {why}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The kernel did not do what was asked.
    #[error("{0}")]
    Unexpected(String),
}

/// Where the host's PCI functions are read and written: the real `/sys` and `/proc`, or a
/// tree a test made.
#[derive(Debug, Clone)]
pub struct HostView {
    sys: PathBuf,
    proc_: PathBuf,
    state: PathBuf,
    dev: PathBuf,
}

/// How usable a function's IOMMU group is through VFIO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Viability {
    /// The machine has no IOMMU groups (or the function is in none).
    NoGroup,
    /// Every member is bound to `vfio-pci`, a DMA-safe driver or none.
    Viable,
    /// These members (`bdf (driver)`) have kernel drivers that own their DMA.
    Blocked(Vec<String>),
}

/// One PCI function of the host.
#[derive(Debug, Clone)]
pub struct Function {
    /// Its address (`0000:00:04.0`).
    pub bdf: String,
    /// Its identity, from sysfs.
    pub identity: PciIdentity,
    /// Its kernel driver.
    pub driver: Option<String>,
    /// Its IOMMU group.
    pub iommu_group: Option<u32>,
    /// The other members of the group, with their drivers.
    pub group_peers: Vec<(String, Option<String>)>,
    /// How its kernel driver is using it: a mounted disk, an interface that is up, the
    /// console… (empty: nothing found).
    pub uses: Vec<String>,
}

impl Function {
    /// Whether VFIO can take the function's group as things stand (once this function is
    /// bound to `vfio-pci`).
    pub fn viability(&self) -> Viability {
        if self.iommu_group.is_none() {
            return Viability::NoGroup;
        }
        let blocking: Vec<String> = self
            .group_peers
            .iter()
            .filter_map(|(bdf, d)| match d {
                Some(d) if !DMA_OWNER_SAFE.contains(&d.as_str()) => Some(format!("{bdf} ({d})")),
                _ => None,
            })
            .collect();
        if blocking.is_empty() {
            Viability::Viable
        } else {
            Viability::Blocked(blocking)
        }
    }

    /// A bridge's kind, if it is one.
    pub fn bridge(&self) -> Option<&'static str> {
        (self.identity.class == 0x06)
            .then(|| outboard_spec::pci::class_name(self.identity.class, self.identity.subclass))
    }
}

impl HostView {
    /// The machine's own `/sys` and `/proc`; what `bind` remembers goes in `/run/outboard/pci`.
    pub fn real() -> Self {
        Self {
            sys: "/sys".into(),
            proc_: "/proc".into(),
            state: "/run/outboard/pci".into(),
            dev: "/dev".into(),
        }
    }

    /// A tree laid out like the root file system: `ROOT/sys`, `ROOT/proc`, `ROOT/dev`,
    /// `ROOT/run`.
    pub fn rooted(root: &Path) -> Self {
        Self {
            sys: root.join("sys"),
            proc_: root.join("proc"),
            state: root.join("run/outboard/pci"),
            dev: root.join("dev"),
        }
    }

    fn devices(&self) -> PathBuf {
        self.sys.join("bus/pci/devices")
    }

    /// How many IOMMU groups the kernel made (0: VFIO cannot be used).
    pub fn iommu_groups(&self) -> usize {
        std::fs::read_dir(self.sys.join("kernel/iommu_groups"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// Every PCI function that can be read, in address order (one that cannot — gone
    /// meanwhile, an attribute missing — is left out with a warning, not the whole list).
    pub fn functions(&self) -> Result<Vec<Function>, HostError> {
        let bdfs = names_in(&self.devices())?;
        // What the machine says of its classes and mounts is read once for all functions.
        let index = usage::Index::read(&self.sys, &self.proc_);
        Ok(bdfs
            .iter()
            .filter_map(|b| {
                self.function_in(b, &index)
                    .map_err(|e| tracing::warn!("{b}: left out: {e}"))
                    .ok()
            })
            .collect())
    }

    /// One function, by address.
    pub fn function(&self, bdf: &str) -> Result<Function, HostError> {
        self.function_in(bdf, &usage::Index::read(&self.sys, &self.proc_))
    }

    /// One function, its uses looked up in `index`.
    fn function_in(&self, bdf: &str, index: &usage::Index) -> Result<Function, HostError> {
        let bdf = canonical(bdf)?;
        let at = self.devices().join(&bdf);
        if !at.is_dir() {
            return Err(HostError::NoFunction(bdf));
        }
        let class = hex(&at, "class")?;
        let identity = PciIdentity {
            vendor: hex(&at, "vendor")? as u16,
            device: hex(&at, "device")? as u16,
            subsystem_vendor: hex(&at, "subsystem_vendor").unwrap_or(0) as u16,
            subsystem: hex(&at, "subsystem_device").unwrap_or(0) as u16,
            class: (class >> 16) as u8,
            subclass: (class >> 8) as u8,
            prog_if: class as u8,
            revision: hex(&at, "revision").unwrap_or(0) as u8,
        };
        let iommu_group = link_name(&at.join("iommu_group")).and_then(|g| g.parse().ok());
        let group_peers = match iommu_group {
            Some(g) => self
                .group_members(g)?
                .into_iter()
                .filter(|m| *m != bdf)
                .map(|m| {
                    let d = link_name(&self.devices().join(&m).join("driver"));
                    (m, d)
                })
                .collect(),
            None => Vec::new(),
        };
        Ok(Function {
            driver: link_name(&at.join("driver")),
            uses: index.uses(&at),
            bdf,
            identity,
            iommu_group,
            group_peers,
        })
    }

    fn group_members(&self, group: u32) -> Result<Vec<String>, HostError> {
        names_in(
            &self
                .sys
                .join(format!("kernel/iommu_groups/{group}/devices")),
        )
    }
}

/// A PCI address in sysfs's form (`0000:00:04.0`); a missing domain is `0000`.
pub fn canonical(bdf: &str) -> Result<String, HostError> {
    let bad = || HostError::NotAnAddress(bdf.to_string());
    let full = match bdf.matches(':').count() {
        1 => format!("0000:{bdf}"),
        2 => bdf.to_string(),
        _ => return Err(bad()),
    };
    let (head, func) = full.rsplit_once('.').ok_or_else(bad)?;
    let parts: Vec<&str> = head.split(':').collect();
    // The domain has 4 hex digits, or more behind a VMD controller (`10000:e0:06.0`).
    let hex = |p: &str, len: std::ops::RangeInclusive<usize>| {
        len.contains(&p.len()) && p.chars().all(|c| c.is_ascii_hexdigit())
    };
    let ok = parts.len() == 3
        && hex(parts[0], 4..=8)
        && hex(parts[1], 2..=2)
        && hex(parts[2], 2..=2)
        && hex(func, 1..=1);
    if !ok {
        return Err(bad());
    }
    // The device number has five bits, the function three.
    let dev = u8::from_str_radix(parts[2], 16).map_err(|_| bad())?;
    let f = u8::from_str_radix(func, 16).map_err(|_| bad())?;
    if dev > 0x1f || f > 7 {
        return Err(bad());
    }
    Ok(full.to_ascii_lowercase())
}

/// The names in directory `dir`, sorted.
fn names_in(dir: &Path) -> Result<Vec<String>, HostError> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    Ok(v)
}

fn io(path: &Path, e: std::io::Error) -> HostError {
    HostError::Io {
        path: path.to_path_buf(),
        why: e.to_string(),
    }
}

/// A sysfs attribute holding one hexadecimal number (`0x1af4`).
fn hex(dir: &Path, name: &str) -> Result<u32, HostError> {
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
    let t = text.trim();
    u32::from_str_radix(t.trim_start_matches("0x"), 16).map_err(|_| HostError::Io {
        path,
        why: format!("not a hexadecimal number: {t:?}"),
    })
}

/// The last component of a symbolic link's target (a driver's or group's name).
pub(crate) fn link_name(link: &Path) -> Option<String> {
    std::fs::read_link(link)
        .ok()
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
}

#[cfg(test)]
mod tests;
