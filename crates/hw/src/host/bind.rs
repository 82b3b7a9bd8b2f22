//! Moving a function to `vfio-pci` and giving it back, the way the kernel documents it
//! (Documentation/driver-api/vfio.rst, and the `driver_override` attribute): set the override,
//! unbind the current driver, ask the bus to probe again. Every refusal is checked before the
//! first write; the driver a function came from is remembered so that `unbind` can return it.

use std::path::{Path, PathBuf};

use super::{io, HostError, HostView, VFIO_PCI};

/// What `bind` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bound {
    /// It was already bound to `vfio-pci`; nothing was written.
    Already,
    /// Moved from this driver (none: it had no driver).
    From(Option<String>),
}

/// What `unbind` did: the driver the function has now (none: no driver took it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unbound {
    /// Its driver now.
    pub driver: Option<String>,
    /// The driver it was given back to, if one was remembered.
    pub remembered: Option<String>,
}

impl HostView {
    /// Binds `bdf` to `vfio-pci`. Refused, before anything is written, when the machine has no
    /// IOMMU groups, the function is a bridge or in no group, `vfio-pci` is not loaded, or (not
    /// `force`) its kernel driver is using it.
    pub fn bind(&self, bdf: &str, force: bool) -> Result<Bound, HostError> {
        // First of all, so that a machine without VFIO is never written to.
        if self.iommu_groups() == 0 {
            return Err(HostError::NoIommu);
        }
        let f = self.function(bdf)?;
        if f.driver.as_deref() == Some(VFIO_PCI) {
            return Ok(Bound::Already);
        }
        if let Some(kind) = f.bridge() {
            return Err(HostError::Bridge(f.bdf, kind));
        }
        if f.iommu_group.is_none() {
            return Err(HostError::NoGroup(f.bdf));
        }
        if !self.sys.join("bus/pci/drivers").join(VFIO_PCI).is_dir() {
            return Err(HostError::NoVfioPci);
        }
        if !force && !f.uses.is_empty() {
            return Err(HostError::InUse {
                bdf: f.bdf,
                driver: f.driver.unwrap_or_else(|| "none".into()),
                uses: f.uses,
            });
        }
        if let Some(d) = &f.driver {
            self.remember(&f.bdf, d)?;
        }
        let at = self.devices().join(&f.bdf);
        write(&at.join("driver_override"), VFIO_PCI)?;
        if f.driver.is_some() {
            write(&at.join("driver/unbind"), &f.bdf)?;
        }
        write(&self.sys.join("bus/pci/drivers_probe"), &f.bdf)?;
        let now = super::link_name(&at.join("driver"));
        if now.as_deref() != Some(VFIO_PCI) {
            // Put it back as it was: no override, its driver (or the kernel's choice).
            let _ = write(&at.join("driver_override"), "\n");
            if now.is_none() {
                let _ = self.give_to(&f.bdf, f.driver.as_deref());
            }
            let _ = std::fs::remove_file(self.state.join(&f.bdf));
            let back = super::link_name(&at.join("driver"));
            return Err(HostError::Unexpected(format!(
                "vfio-pci did not take {} (unbound from {}); it was put back and its driver \
                 is now {}",
                f.bdf,
                f.driver.as_deref().unwrap_or("none"),
                back.as_deref().unwrap_or("none")
            )));
        }
        Ok(Bound::From(f.driver))
    }

    /// Takes `bdf` from `vfio-pci` and gives it back to the driver it came from (or lets the
    /// kernel pick one). Refused when it is not bound to `vfio-pci` or a process holds its
    /// VFIO group open (the kernel would wait for that process to let go).
    pub fn unbind(&self, bdf: &str) -> Result<Unbound, HostError> {
        let f = self.function(bdf)?;
        if f.driver.as_deref() != Some(VFIO_PCI) {
            return Err(HostError::NotVfio {
                bdf: f.bdf,
                driver: f.driver,
            });
        }
        if let Some(group) = f.iommu_group {
            // The kernel would wait in the unbind for whoever holds the function. Held means
            // its group cannot be opened (VFIO lets one process have it); the processes with
            // it open are named when they can be found.
            let mut holders = self.holders(&format!("/dev/vfio/{group}"));
            if holders.is_empty() && self.group_busy(group) {
                holders.push("a process (not found in /proc)".into());
            }
            if !holders.is_empty() {
                return Err(HostError::Open {
                    bdf: f.bdf,
                    group,
                    holders,
                });
            }
        }
        let remembered = self.remembered(&f.bdf);
        let at = self.devices().join(&f.bdf);
        // An empty override lets every driver match again.
        write(&at.join("driver_override"), "\n")?;
        write(&at.join("driver/unbind"), &f.bdf)?;
        self.give_to(&f.bdf, remembered.as_deref())?;
        let _ = std::fs::remove_file(self.state.join(&f.bdf));
        Ok(Unbound {
            driver: super::link_name(&at.join("driver")),
            remembered,
        })
    }

    /// Binds `bdf` to `driver` if it takes it, or else lets the kernel choose.
    fn give_to(&self, bdf: &str, driver: Option<&str>) -> Result<(), HostError> {
        let given = driver.is_some_and(|d| {
            write(&self.sys.join("bus/pci/drivers").join(d).join("bind"), bdf).is_ok()
        });
        if !given {
            write(&self.sys.join("bus/pci/drivers_probe"), bdf)?;
        }
        Ok(())
    }

    /// Whether VFIO group `group` is open somewhere: opening it is refused (`EBUSY`) while a
    /// process holds it (whatever that process kept: the group, or only the device). Opened and
    /// closed at once, which changes nothing; a group file that is not there is not busy.
    fn group_busy(&self, group: u32) -> bool {
        let path = self.dev.join(format!("vfio/{group}"));
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
        {
            Ok(_) => false,
            Err(e) => e.raw_os_error() == Some(libc::EBUSY),
        }
    }

    /// The processes (`pid (command)`) with `device` open.
    fn holders(&self, device: &str) -> Vec<String> {
        let mut found = Vec::new();
        let Ok(procs) = std::fs::read_dir(&self.proc_) else {
            return found;
        };
        for p in procs.filter_map(|e| e.ok()) {
            let pid = p.file_name().to_string_lossy().into_owned();
            if !pid.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
                continue;
            };
            let open = fds
                .filter_map(|e| e.ok())
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == Path::new(device)));
            if open {
                let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
                found.push(format!("{pid} ({})", comm.trim()));
            }
        }
        found.sort();
        found
    }

    fn remember(&self, bdf: &str, driver: &str) -> Result<(), HostError> {
        std::fs::create_dir_all(&self.state).map_err(|e| io(&self.state, e))?;
        let path = self.state.join(bdf);
        std::fs::write(&path, driver).map_err(|e| io(&path, e))
    }

    /// The driver `bind` took the function from, if it remembered one.
    pub fn remembered(&self, bdf: &str) -> Option<String> {
        let bdf = super::canonical(bdf).ok()?;
        let d = std::fs::read_to_string(self.state.join(bdf)).ok()?;
        let d = d.trim();
        // A driver's name, not a path: the file is ours, but a stray one must not send the
        // bind elsewhere in sysfs.
        (!d.is_empty() && !d.contains('/') && d != "." && d != "..").then(|| d.to_string())
    }
}

/// Writes `value` to an existing sysfs attribute (never creates one); truncating as `echo >`
/// does, which sysfs ignores and a test's plain file needs.
fn write(path: &PathBuf, value: &str) -> Result<(), HostError> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(|e| io(path, e))?;
    f.write_all(value.as_bytes()).map_err(|e| io(path, e))
}
