//! Outboard's hardware layer: how a driver reaches its one device.
//!
//! A driver sees a [`PciFunction`] and nothing else: its identity, mediated configuration
//! space, [`Region`]s (BARs) with bounds-checked typed accessors, a [`DmaSpace`] that hands out
//! buffers by IOVA, interrupt vectors as [`Irq`] eventfds, and reset. Behind it sits a backend:
//!
//! - **vfio-user** ([`backend::vfio_user`]): an emulated device model in another process;
//! - **in-process** ([`backend::in_process`]): a device model in the same process, called
//!   directly and synchronously, for fast deterministic tests;
//! - **Linux VFIO** ([`backend::vfio`]): a real PCI function bound to `vfio-pci`.
//!
//! Drivers never mmap, open `/sys` or issue ioctls; a register access is the same call whether
//! it lands in mmapped memory, becomes a vfio-user message, or is an ioeventfd doorbell.
#![deny(missing_docs)]

pub mod backend;
mod config;
mod dma;
pub mod host;
mod irq;
mod region;

use std::path::PathBuf;
use std::sync::Arc;

pub use config::{Capability, ConfigPolicy};
pub use dma::{DmaBuf, DmaSpace};
pub use irq::Irq;
pub use outboard_shm::{SharedMem, ShmError};
pub use region::{Region, RegionKind};

use backend::Backend;
use outboard_spec::pci;

/// What went wrong reaching hardware.
#[derive(Debug, thiserror::Error)]
pub enum HwError {
    /// The device could not be opened.
    #[error("cannot open {spec}: {why}")]
    Open {
        /// The device spec.
        spec: String,
        /// Why.
        why: String,
    },
    /// The device is in use by another driver (a vfio-user server answered `EBUSY`).
    #[error("{spec} is in use by another driver")]
    Busy {
        /// The device spec.
        spec: String,
    },
    /// The backend (vfio-user server, VFIO ioctl) failed.
    #[error("{0}")]
    Backend(String),
    /// The device is gone: its vfio-user server closed the connection (a model that died).
    /// Nothing done with it can succeed until the device is brought back.
    #[error("the device is gone: {0}")]
    Gone(String),
    /// A region access outside the region.
    #[error("access of {len} bytes at {offset:#x} is outside BAR{bar} ({size:#x} bytes)")]
    OutOfBounds {
        /// BAR number.
        bar: u8,
        /// Offset.
        offset: u64,
        /// Access size.
        len: u64,
        /// Region size.
        size: u64,
    },
    /// The region does not exist.
    #[error("BAR{0} is not implemented by the device")]
    NoSuchRegion(u8),
    /// The configuration write was refused by mediation.
    #[error("configuration write of {len} bytes at {offset:#x} is not permitted: {why}")]
    ConfigDenied {
        /// Offset.
        offset: u64,
        /// Length.
        len: usize,
        /// The rule.
        why: &'static str,
    },
    /// Interrupt set-up failed.
    #[error("interrupts: {0}")]
    Irq(String),
    /// Shared memory failed.
    #[error(transparent)]
    Shm(#[from] outboard_shm::ShmError),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, HwError>;

/// Where a device is, as a user names it on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// A device model's vfio-user socket.
    VfioUser(PathBuf),
    /// A connection to a device model's vfio-user socket, inherited as this descriptor (what
    /// the manager gives a confined driver server). It can be opened once.
    VfioUserFd(i32),
    /// A PCI function bound to `vfio-pci`, by BDF (`0000:00:04.0`).
    Vfio(String),
    /// A PCI function bound to `vfio-pci` whose VFIO container (`/dev/vfio/vfio`) and IOMMU
    /// group (`/dev/vfio/N`) are inherited as these descriptors: what the manager gives a
    /// driver server, which then opens no path. They can be claimed once.
    VfioFd {
        /// The container's descriptor.
        container: i32,
        /// The group's descriptor.
        group: i32,
        /// The function's address.
        bdf: String,
    },
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    /// `vfio-user:PATH`, `vfio:BDF`, or a bare path (a vfio-user socket).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if let Some(n) = s.strip_prefix("vfio-user-fd:") {
            n.parse()
                .ok()
                .filter(|n| *n > 2)
                .map(DeviceSpec::VfioUserFd)
                .ok_or_else(|| format!("{s:?}: vfio-user-fd takes a descriptor number above 2"))
        } else if let Some(rest) = s.strip_prefix("vfio-fd:") {
            // vfio-fd:CONTAINER,GROUP:BDF
            let bad = || format!("{s:?}: use vfio-fd:CONTAINER,GROUP:BDF (descriptors above 2)");
            let (fds, bdf) = rest.split_once(':').ok_or_else(bad)?;
            let (c, g) = fds.split_once(',').ok_or_else(bad)?;
            let fd = |n: &str| n.parse::<i32>().ok().filter(|n| *n > 2);
            match (fd(c), fd(g)) {
                (Some(container), Some(group)) if container != group && !bdf.is_empty() => {
                    Ok(DeviceSpec::VfioFd {
                        container,
                        group,
                        bdf: bdf.to_string(),
                    })
                }
                _ => Err(bad()),
            }
        } else if let Some(p) = s.strip_prefix("vfio-user:") {
            Ok(DeviceSpec::VfioUser(PathBuf::from(p)))
        } else if let Some(b) = s.strip_prefix("vfio:") {
            Ok(DeviceSpec::Vfio(b.to_string()))
        } else if !s.is_empty() && !s.contains(':') {
            Ok(DeviceSpec::VfioUser(PathBuf::from(s)))
        } else {
            Err(format!(
                "{s:?} is not a device (use vfio-user:PATH or vfio:BDF)"
            ))
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::VfioUser(p) => write!(f, "vfio-user:{}", p.display()),
            DeviceSpec::VfioUserFd(n) => write!(f, "vfio-user-fd:{n}"),
            DeviceSpec::Vfio(bdf) => write!(f, "vfio:{bdf}"),
            DeviceSpec::VfioFd {
                container,
                group,
                bdf,
            } => write!(f, "vfio-fd:{container},{group}:{bdf}"),
        }
    }
}

/// Interrupt types of a PCI function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IrqKind {
    /// Legacy pin interrupt.
    Intx,
    /// Message signalled interrupts.
    Msi,
    /// MSI-X.
    MsiX,
}

impl IrqKind {
    /// All kinds, in VFIO index order.
    pub const ALL: [IrqKind; 3] = [IrqKind::Intx, IrqKind::Msi, IrqKind::MsiX];
}

impl std::fmt::Display for IrqKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IrqKind::Intx => "INTx",
            IrqKind::Msi => "MSI",
            IrqKind::MsiX => "MSI-X",
        })
    }
}

/// Identity of a PCI function, from its configuration header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciIdentity {
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Subsystem vendor ID.
    pub subsystem_vendor: u16,
    /// Subsystem ID.
    pub subsystem: u16,
    /// Base class.
    pub class: u8,
    /// Subclass.
    pub subclass: u8,
    /// Programming interface.
    pub prog_if: u8,
    /// Revision ID.
    pub revision: u8,
}

/// One PCI function, reached through some backend.
pub struct PciFunction {
    spec: String,
    backend: Arc<dyn Backend>,
    identity: PciIdentity,
    policy: ConfigPolicy,
    dma: DmaSpace,
    /// The standard configuration space (256 bytes) as read once at open: the capability
    /// list and the capabilities' own fields never change, so walking them again costs no
    /// more trips to the device (over vfio-user each read is a round trip to the model, and
    /// they were a third of a driver's start-up messages).
    header: Box<[u8; pci::CONFIG_SPACE_SIZE]>,
    /// The capability list, walked once over `header`.
    caps: Vec<Capability>,
    /// The BARs' sizes, asked once (they are fixed; a probe and a start both want them).
    bar_sizes: std::sync::OnceLock<[u64; 6]>,
}

/// Copies `buf.len()` bytes at `offset` of a configuration space snapshot.
fn snapshot_read(head: &[u8; pci::CONFIG_SPACE_SIZE], offset: u64, buf: &mut [u8]) -> Result<()> {
    let at = usize::try_from(offset).unwrap_or(usize::MAX);
    match at.checked_add(buf.len()).and_then(|end| head.get(at..end)) {
        Some(bytes) => {
            buf.copy_from_slice(bytes);
            Ok(())
        }
        None => Err(HwError::Backend(format!(
            "configuration read of {} bytes at {offset:#x} is past the standard header",
            buf.len()
        ))),
    }
}

/// What an active probe may look at of a PCI function, taken without asking the device
/// again: its standard configuration space as read at open and its BARs' sizes. A probe run on
/// it cannot change the device, and it can be handed to another process (the manager runs no
/// driver library's code: a child probes for it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigSnapshot {
    /// The first 256 bytes of configuration space.
    pub header: Box<[u8; pci::CONFIG_SPACE_SIZE]>,
    /// Each BAR's size in bytes (0 where absent).
    pub bar_sizes: [u64; 6],
}

impl ConfigSnapshot {
    /// Bytes of configuration space a snapshot holds.
    pub const SIZE: usize = pci::CONFIG_SPACE_SIZE;

    /// The configuration dword at `offset` (4-aligned), if it lies in the snapshot.
    pub fn dword(&self, offset: u64) -> Option<u32> {
        let mut b = [0u8; 4];
        (offset.is_multiple_of(4) && snapshot_read(&self.header, offset, &mut b).is_ok())
            .then(|| u32::from_le_bytes(b))
    }
}

impl std::fmt::Debug for PciFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciFunction")
            .field("spec", &self.spec)
            .field("identity", &self.identity)
            .finish()
    }
}

impl PciFunction {
    /// Why opening `spec` failed: busy stays busy (another client drives the device), the
    /// rest is a failure to open.
    fn open_failed(spec: &DeviceSpec, e: HwError) -> HwError {
        match e {
            HwError::Busy { .. } => HwError::Busy {
                spec: spec.to_string(),
            },
            e => HwError::Open {
                spec: spec.to_string(),
                why: e.to_string(),
            },
        }
    }

    /// Opens the device named by `spec`.
    pub fn open(spec: &DeviceSpec) -> Result<Self> {
        match spec {
            DeviceSpec::VfioUser(path) => {
                let b = backend::vfio_user::VfioUserBackend::connect(path)
                    .map_err(|e| Self::open_failed(spec, e))?;
                Self::with_backend(spec.to_string(), Arc::new(b))
            }
            DeviceSpec::VfioUserFd(n) => {
                let fd =
                    outboard_sys::process::inherited_socket(*n).map_err(|e| HwError::Open {
                        spec: spec.to_string(),
                        why: e,
                    })?;
                // A model that serves another client says so the same way whichever way
                // its socket was reached (a caller may then share the client it has).
                let b = backend::vfio_user::VfioUserBackend::from_fd(fd)
                    .map_err(|e| Self::open_failed(spec, e))?;
                Self::with_backend(spec.to_string(), Arc::new(b))
            }
            DeviceSpec::Vfio(bdf) => {
                let b = backend::vfio::VfioBackend::open(bdf).map_err(|e| HwError::Open {
                    spec: spec.to_string(),
                    why: e.to_string(),
                })?;
                Self::with_backend(spec.to_string(), Arc::new(b))
            }
            DeviceSpec::VfioFd {
                container,
                group,
                bdf,
            } => {
                let failed = |why: String| HwError::Open {
                    spec: spec.to_string(),
                    why,
                };
                let c = outboard_sys::process::inherited_device(*container).map_err(failed)?;
                let g = outboard_sys::process::inherited_device(*group).map_err(failed)?;
                let label = format!("(descriptor {group})");
                let b = backend::vfio::VfioBackend::claim(c, g, bdf, &label)
                    .map_err(|e| failed(e.to_string()))?;
                Self::with_backend(spec.to_string(), Arc::new(b))
            }
        }
    }

    /// Wraps a backend (used by the in-process backend and tests).
    pub fn with_backend(spec: String, backend: Arc<dyn Backend>) -> Result<Self> {
        let mut head = Box::new([0u8; pci::CONFIG_SPACE_SIZE]);
        backend.config_read(0, &mut head[..])?;
        let u16_at = |o: usize| u16::from_le_bytes([head[o], head[o + 1]]);
        let identity = PciIdentity {
            vendor: u16_at(pci::VENDOR_ID as usize),
            device: u16_at(pci::DEVICE_ID as usize),
            subsystem_vendor: u16_at(pci::SUBSYSTEM_VENDOR_ID as usize),
            subsystem: u16_at(pci::SUBSYSTEM_ID as usize),
            class: head[pci::CLASS_BASE as usize],
            subclass: head[pci::CLASS_SUB as usize],
            prog_if: head[pci::CLASS_PROG_IF as usize],
            revision: head[pci::REVISION_ID as usize],
        };
        if identity.vendor == 0xffff {
            return Err(HwError::Open {
                spec,
                why: "configuration space reads as all ones (no device)".into(),
            });
        }
        let caps = config::walk_capabilities(|o, b| snapshot_read(&head, o, b))?;
        let dma = DmaSpace::new(backend.clone());
        Ok(Self {
            spec,
            backend,
            identity,
            policy: ConfigPolicy::for_capabilities(&caps),
            dma,
            header: head,
            caps,
            bar_sizes: std::sync::OnceLock::new(),
        })
    }

    /// How the device was named.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// Identity from the configuration header.
    pub fn identity(&self) -> PciIdentity {
        self.identity
    }

    /// Reads configuration space.
    pub fn config_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.backend.config_read(offset, buf)
    }

    /// Reads a configuration byte.
    pub fn config_read8(&self, offset: u64) -> Result<u8> {
        let mut b = [0u8; 1];
        self.config_read(offset, &mut b)?;
        Ok(b[0])
    }

    /// Reads a configuration word.
    pub fn config_read16(&self, offset: u64) -> Result<u16> {
        let mut b = [0u8; 2];
        self.config_read(offset, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// Reads a configuration dword.
    pub fn config_read32(&self, offset: u64) -> Result<u32> {
        let mut b = [0u8; 4];
        self.config_read(offset, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Writes configuration space, subject to mediation ([`ConfigPolicy`]).
    pub fn config_write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.policy.check(offset, data.len())?;
        self.backend.config_write(offset, data)
    }

    /// Sets bits in the command register (memory decode, bus master); others are refused.
    pub fn enable_command(&self, bits: u16) -> Result<()> {
        let allowed = pci::COMMAND_MEMORY
            | pci::COMMAND_BUS_MASTER
            | pci::COMMAND_IO
            | pci::COMMAND_INTX_DISABLE;
        if bits & !allowed != 0 {
            return Err(HwError::ConfigDenied {
                offset: pci::COMMAND,
                len: 2,
                why: "only decode, bus-master and INTx-disable bits may be set",
            });
        }
        let cmd = self.config_read16(pci::COMMAND)? | bits;
        self.config_write(pci::COMMAND, &cmd.to_le_bytes())
    }

    /// The capability list, as walked at open (bounded, so a looping list cannot hang us).
    pub fn capabilities(&self) -> Result<Vec<Capability>> {
        Ok(self.caps.clone())
    }

    /// Reads the standard configuration space (the first 256 bytes) as it was at open,
    /// without asking the device: for what does not change, such as a capability's own
    /// fields. Registers a device or driver changes (command, status, MSI-X control) are
    /// read with [`PciFunction::config_read`].
    pub fn config_read_at_open(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        snapshot_read(&self.header, offset, buf)
    }

    /// What an active probe looks at: the header as read at open and the BARs' sizes.
    pub fn snapshot(&self) -> Result<ConfigSnapshot> {
        Ok(ConfigSnapshot {
            header: self.header.clone(),
            bar_sizes: self.bar_sizes()?,
        })
    }

    /// BAR `bar` as a region.
    pub fn region(&self, bar: u8) -> Result<Region> {
        if bar > 5 {
            return Err(HwError::NoSuchRegion(bar));
        }
        self.backend.region(bar)
    }

    /// Sizes of all BARs (0 where absent), without mapping them; asked of the device once.
    pub fn bar_sizes(&self) -> Result<[u64; 6]> {
        if let Some(s) = self.bar_sizes.get() {
            return Ok(*s);
        }
        let mut s = [0u64; 6];
        for (bar, size) in s.iter_mut().enumerate() {
            *size = self.backend.region_size(bar as u8)?;
        }
        Ok(*self.bar_sizes.get_or_init(|| s))
    }

    /// The device's DMA address space.
    pub fn dma(&self) -> &DmaSpace {
        &self.dma
    }

    /// Number of vectors of an interrupt type.
    pub fn irq_count(&self, kind: IrqKind) -> Result<u32> {
        self.backend.irq_count(kind)
    }

    /// Enables `count` vectors of `kind`, each delivered to its own eventfd.
    pub fn enable_irqs(&self, kind: IrqKind, count: u32) -> Result<Vec<Irq>> {
        let max = self.irq_count(kind)?;
        if count == 0 || count > max {
            return Err(HwError::Irq(format!(
                "{kind}: asked for {count} vectors, device has {max}"
            )));
        }
        let irqs: Vec<Irq> = (0..count).map(Irq::new).collect::<Result<_>>()?;
        let fds: Vec<_> = irqs.iter().map(|i| i.fd()).collect();
        self.backend.set_irqs(kind, &fds)?;
        Ok(irqs)
    }

    /// Something that unmasks the function's INTx after a delivery, for whoever handles it
    /// (VFIO masks INTx as it delivers it; see `Backend::unmask_intx`).
    pub fn intx_unmasker(&self) -> impl Fn() -> Result<()> + Send + Sync + 'static {
        let b = self.backend.clone();
        move || b.unmask_intx()
    }

    /// Disables every vector of `kind`.
    pub fn disable_irqs(&self, kind: IrqKind) -> Result<()> {
        self.backend.set_irqs(kind, &[])
    }

    /// Resets the function.
    pub fn reset(&self) -> Result<()> {
        self.backend.reset()
    }

    /// Whether the device's DMA goes through an IOMMU (VFIO): a device that would bypass the
    /// IOMMU's translation (e.g. virtio without ACCESS_PLATFORM) cannot be driven safely.
    pub fn behind_iommu(&self) -> bool {
        self.backend.behind_iommu()
    }

    /// Turns readable or hung up when the device is lost (its model died, or the connection
    /// was given up after a failure); an event source for the driver's loop. `None` when the
    /// backend cannot tell.
    pub fn loss_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.backend.loss_fd()
    }

    /// Gives the device up after a failure without waiting on it, so that it stops reaching
    /// memory through its DMA mappings (vfio-user: the connection is closed and the model
    /// resets the device when it sees that; VFIO: a function reset). Returns whether the
    /// device is certain not to reach them any more.
    pub fn abandon(&self) -> bool {
        self.backend.abandon()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse_and_bad_ones_say_why() {
        let ok = |s: &str| s.parse::<DeviceSpec>().unwrap();
        assert_eq!(
            ok("vfio-user:/tmp/a.sock"),
            DeviceSpec::VfioUser("/tmp/a.sock".into())
        );
        assert_eq!(
            ok("/tmp/a.sock"),
            DeviceSpec::VfioUser("/tmp/a.sock".into())
        );
        assert_eq!(
            ok("vfio:0000:00:04.0"),
            DeviceSpec::Vfio("0000:00:04.0".into())
        );
        assert_eq!(
            ok("vfio-fd:5,6:0000:00:04.0"),
            DeviceSpec::VfioFd {
                container: 5,
                group: 6,
                bdf: "0000:00:04.0".into()
            }
        );
        assert_eq!(
            ok("vfio-fd:5,6:0000:00:04.0").to_string(),
            "vfio-fd:5,6:0000:00:04.0"
        );
        for bad in [
            "vfio-fd:5:0000:00:04.0",
            "vfio-fd:5,5:0000:00:04.0",
            "vfio-fd:2,6:0000:00:04.0",
            "vfio-fd:5,6:",
            "vfio-fd:5,x:0000:00:04.0",
        ] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad} accepted");
        }
        assert_eq!(ok("vfio-user-fd:5"), DeviceSpec::VfioUserFd(5));
        assert_eq!(ok("vfio-user-fd:5").to_string(), "vfio-user-fd:5");
        for bad in ["vfio-user-fd:2", "vfio-user-fd:x", "vfio-user-fd:", "nbd:x"] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn an_inherited_connection_is_taken_once_and_must_be_a_socket() {
        use std::os::fd::{AsRawFd, IntoRawFd};
        // Opened first, so its number is not one the socket had (numbers are taken once).
        let file = std::fs::File::open("/dev/null").unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        drop(b);
        let n = a.into_raw_fd();
        // The first open takes the descriptor (and fails: nobody is at the other end).
        let first = PciFunction::open(&DeviceSpec::VfioUserFd(n)).unwrap_err();
        assert!(!first.to_string().contains("taken over"), "{first}");
        let again = PciFunction::open(&DeviceSpec::VfioUserFd(n)).unwrap_err();
        assert!(again.to_string().contains("taken over already"), "{again}");
        let f = file.as_raw_fd();
        let not_socket = PciFunction::open(&DeviceSpec::VfioUserFd(f)).unwrap_err();
        assert!(
            not_socket.to_string().contains("not a socket"),
            "{not_socket}"
        );
    }
}
