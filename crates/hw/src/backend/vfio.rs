//! The Linux VFIO backend: a real PCI function bound to `vfio-pci`.
//!
//! Claims the device the documented way (kernel `Documentation/driver-api/vfio.rst`): open the
//! container `/dev/vfio/vfio`, check the API version and the TYPE1v2 IOMMU, open the function's
//! IOMMU group `/dev/vfio/<group>`, check it is viable, attach it to the container, set the IOMMU,
//! and get the device fd by BDF. Regions are read through the device fd at their offsets;
//! mmappable parts (whole BARs or sparse areas — the MSI-X table never is) are mmapped.
//! Interrupts are eventfds set with `VFIO_DEVICE_SET_IRQS`; DMA buffers are mapped into the IOMMU
//! with `VFIO_IOMMU_MAP_DMA` at the IOVAs `DmaSpace` chose.
//!
//! Direct ioctls (through `libc::ioctl`, with `vfio-bindings` for the structures) rather than
//! `vfio-ioctls`: that crate brings a VMM's view (KVM device fds, vm-memory guest regions) that a
//! driver host does not have; the dozen calls needed are simpler written here.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use outboard_shm::{Access, SharedMem};
use outboard_vfio_user::wire;
use vfio_bindings::bindings::vfio as sys;

use super::{irq_index, Backend};
use crate::region::{MappedArea, Trap};
use crate::{HwError, IrqKind, Region, Result};

const VFIO_TYPE: u64 = b';' as u64;
const fn io(nr: u64) -> u64 {
    (VFIO_TYPE << 8) | nr
}
const GET_API_VERSION: u64 = io(100);
const CHECK_EXTENSION: u64 = io(101);
const SET_IOMMU: u64 = io(102);
const GROUP_GET_STATUS: u64 = io(103);
const GROUP_SET_CONTAINER: u64 = io(104);
const GROUP_GET_DEVICE_FD: u64 = io(106);
const DEVICE_GET_INFO: u64 = io(107);
const DEVICE_GET_REGION_INFO: u64 = io(108);
const DEVICE_GET_IRQ_INFO: u64 = io(109);
const DEVICE_SET_IRQS: u64 = io(110);
const DEVICE_RESET: u64 = io(111);
const IOMMU_MAP_DMA: u64 = io(113);
const IOMMU_UNMAP_DMA: u64 = io(114);

fn os(what: &str) -> HwError {
    HwError::Backend(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// `ioctl` returning the kernel's non-negative result.
///
/// # Safety
/// `arg` must be what `request` expects on `fd` (a pointer to a correctly sized, initialised
/// structure the kernel may read and write, or an integer).
unsafe fn ioctl(fd: BorrowedFd<'_>, request: u64, arg: usize, what: &str) -> Result<i32> {
    // SAFETY: forwarded from the caller's contract.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg) };
    if r < 0 {
        Err(os(what))
    } else {
        Ok(r)
    }
}

struct Device {
    container: OwnedFd,
    _group: OwnedFd,
    device: File,
    regions: Vec<sys::vfio_region_info>,
    /// DMA mappings: IOVA → the process mapping whose address the IOMMU translates to.
    dma: Mutex<HashMap<u64, SharedMem>>,
    resettable: bool,
}

/// A PCI function bound to `vfio-pci`.
pub struct VfioBackend {
    dev: Arc<Device>,
}

struct VfioTrap {
    dev: Arc<Device>,
}

impl Device {
    fn region(&self, index: u32) -> Result<&sys::vfio_region_info> {
        self.regions
            .get(index as usize)
            .filter(|r| r.size > 0)
            .ok_or(HwError::NoSuchRegion(index as u8))
    }

    /// The device-fd offset of `[offset, offset + len)` in region `index`, checked.
    fn span(&self, index: u32, offset: u64, len: usize) -> Result<u64> {
        let r = self.region(index)?;
        if offset.checked_add(len as u64).is_none_or(|e| e > r.size) {
            return Err(HwError::Backend(format!(
                "region {index}: access at {offset:#x} out of range"
            )));
        }
        Ok(r.offset + offset)
    }

    fn read(&self, index: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        let at = self.span(index, offset, buf.len())?;
        self.device
            .read_exact_at(buf, at)
            .map_err(|e| HwError::Backend(format!("region {index} read: {e}")))
    }

    fn write(&self, index: u32, offset: u64, data: &[u8]) -> Result<()> {
        let at = self.span(index, offset, data.len())?;
        self.device
            .write_all_at(data, at)
            .map_err(|e| HwError::Backend(format!("region {index} write: {e}")))
    }
}

impl Trap for VfioTrap {
    fn read(&self, bar: u8, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.dev.read(bar as u32, offset, buf)
    }
    fn write(&self, bar: u8, offset: u64, data: &[u8], _posted: bool) -> Result<()> {
        self.dev.write(bar as u32, offset, data)
    }
}

impl VfioBackend {
    /// Claims the function at `bdf` (e.g. `0000:00:04.0`), which must be bound to `vfio-pci`.
    pub fn open(bdf: &str) -> Result<Self> {
        let bdf = &crate::host::canonical(bdf).map_err(|e| HwError::Backend(e.to_string()))?;
        let sys_dev = std::path::Path::new("/sys/bus/pci/devices").join(bdf);
        let group = crate::host::link_name(&sys_dev.join("iommu_group")).ok_or_else(|| {
            HwError::Backend(format!(
                "{bdf}: no IOMMU group; is the IOMMU on and the device present?"
            ))
        })?;
        let driver = crate::host::link_name(&sys_dev.join("driver"));
        if driver.as_deref() != Some("vfio-pci") {
            return Err(HwError::Backend(format!(
                "{bdf} is bound to {}, not vfio-pci",
                driver.as_deref().unwrap_or("no driver")
            )));
        }
        let open = |p: &str| -> Result<OwnedFd> {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .map(OwnedFd::from)
                .map_err(|e| HwError::Backend(format!("{p}: {e}")))
        };
        let container = open("/dev/vfio/vfio")?;
        let group_fd = open(&format!("/dev/vfio/{group}"))?;
        Self::claim(container, group_fd, bdf, &group)
    }

    /// Claims function `bdf` of the IOMMU group open as `group_fd` (`group`: its name, for
    /// messages), through the VFIO container open as `container`: what a process that was given
    /// both descriptors does (a confined driver server opens no path). Nothing is assumed of
    /// either: the API version, the IOMMU type and the group's viability are checked here.
    pub fn claim(container: OwnedFd, group_fd: OwnedFd, bdf: &str, group: &str) -> Result<Self> {
        // SAFETY: VFIO_GET_API_VERSION and VFIO_CHECK_EXTENSION take no pointer, only an integer.
        unsafe {
            if ioctl(
                container.as_fd(),
                GET_API_VERSION,
                0,
                "VFIO_GET_API_VERSION",
            )? != sys::VFIO_API_VERSION as i32
            {
                return Err(HwError::Backend("unknown VFIO API version".into()));
            }
            if ioctl(
                container.as_fd(),
                CHECK_EXTENSION,
                sys::VFIO_TYPE1v2_IOMMU as usize,
                "VFIO_CHECK_EXTENSION",
            )? != 1
            {
                return Err(HwError::Backend(
                    "the TYPE1v2 IOMMU is not available".into(),
                ));
            }
        }
        let mut status = sys::vfio_group_status {
            argsz: std::mem::size_of::<sys::vfio_group_status>() as u32,
            flags: 0,
        };
        // SAFETY: `status` is a live, correctly sized vfio_group_status with argsz set.
        unsafe {
            ioctl(
                group_fd.as_fd(),
                GROUP_GET_STATUS,
                &mut status as *mut _ as usize,
                "VFIO_GROUP_GET_STATUS",
            )?
        };
        if status.flags & sys::VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(HwError::Backend(format!(
                "IOMMU group {group} is not viable: bind every device in it to vfio-pci"
            )));
        }
        let cfd: i32 = container.as_raw_fd();
        // SAFETY: SET_CONTAINER reads an int (the container fd) through the pointer; SET_IOMMU
        // takes the IOMMU type as an integer.
        unsafe {
            ioctl(
                group_fd.as_fd(),
                GROUP_SET_CONTAINER,
                &cfd as *const i32 as usize,
                "VFIO_GROUP_SET_CONTAINER",
            )?;
            ioctl(
                container.as_fd(),
                SET_IOMMU,
                sys::VFIO_TYPE1v2_IOMMU as usize,
                "VFIO_SET_IOMMU",
            )?;
        }
        let name =
            std::ffi::CString::new(bdf).map_err(|_| HwError::Backend("BDF contains NUL".into()))?;
        // SAFETY: GET_DEVICE_FD reads a NUL-terminated string; `name` outlives the call.
        let raw = unsafe {
            ioctl(
                group_fd.as_fd(),
                GROUP_GET_DEVICE_FD,
                name.as_ptr() as usize,
                "VFIO_GROUP_GET_DEVICE_FD",
            )?
        };
        // SAFETY: the kernel just returned a new fd that nothing else owns.
        let device = unsafe { File::from_raw_fd(raw) };
        let mut info = sys::vfio_device_info {
            argsz: std::mem::size_of::<sys::vfio_device_info>() as u32,
            ..Default::default()
        };
        // SAFETY: `info` is a correctly sized vfio_device_info with argsz set.
        unsafe {
            ioctl(
                device.as_fd(),
                DEVICE_GET_INFO,
                &mut info as *mut _ as usize,
                "VFIO_DEVICE_GET_INFO",
            )?
        };
        if info.flags & sys::VFIO_DEVICE_FLAGS_PCI == 0 {
            return Err(HwError::Backend(format!("{bdf} is not a PCI device")));
        }
        let mut regions = Vec::new();
        for index in 0..info.num_regions.min(wire::region::NUM_PCI) {
            let mut r = sys::vfio_region_info {
                argsz: std::mem::size_of::<sys::vfio_region_info>() as u32,
                index,
                ..Default::default()
            };
            // SAFETY: `r` is a correctly sized vfio_region_info with argsz and index set.
            let found = unsafe {
                ioctl(
                    device.as_fd(),
                    DEVICE_GET_REGION_INFO,
                    &mut r as *mut _ as usize,
                    "VFIO_DEVICE_GET_REGION_INFO",
                )
            };
            if found.is_err() {
                // Regions a function lacks (the VGA region of a non-VGA device) answer EINVAL.
                r.size = 0;
            }
            regions.push(r);
        }
        let claimed = Self {
            dev: Arc::new(Device {
                container,
                _group: group_fd,
                device,
                regions,
                dma: Mutex::new(HashMap::new()),
                resettable: info.flags & sys::VFIO_DEVICE_FLAGS_RESET != 0,
            }),
        };
        // A function is reset before anything is mapped for it: whatever the last owner left
        // in it (a driver server killed mid-I/O, requests still queued) is gone before this
        // one's memory can be a target. vfio-pci also disables bus mastering and tries a reset
        // when the last owner's device descriptor is released; this one is ours, and a reset
        // that fails stops the claim (the function is then reported, not used).
        if claimed.dev.resettable {
            claimed.reset().map_err(|e| {
                HwError::Backend(format!("{bdf}: the reset before use failed: {e}"))
            })?;
            tracing::info!("{bdf}: reset (VFIO_DEVICE_RESET) before use");
        } else {
            tracing::info!(
                "{bdf}: VFIO offers no reset for this function (no FLR, PM or bus reset): its \
                 driver's own reset is all"
            );
        }
        Ok(claimed)
    }

    /// The sparse mmap areas of a region (re-asking with room for the capability list).
    fn sparse_areas(&self, index: u32, argsz: u32) -> Result<Vec<(u64, u64)>> {
        let mut buf = vec![0u64; (argsz as usize).div_ceil(8)];
        let bytes = buf.len() * 8;
        // The header of the buffer is a vfio_region_info asking for `bytes` of reply.
        let head = sys::vfio_region_info {
            argsz: bytes as u32,
            index,
            ..Default::default()
        };
        // SAFETY: `buf` is 8-byte aligned, at least as large as vfio_region_info, and we write
        // exactly one of them at its start.
        unsafe { std::ptr::write(buf.as_mut_ptr().cast::<sys::vfio_region_info>(), head) };
        // SAFETY: `buf` holds `bytes` writable bytes and declares that size in argsz.
        unsafe {
            ioctl(
                self.dev.device.as_fd(),
                DEVICE_GET_REGION_INFO,
                buf.as_mut_ptr() as usize,
                "VFIO_DEVICE_GET_REGION_INFO",
            )?
        };
        // SAFETY: reinterpreting initialised u64s as bytes; u8 has no invalid values.
        let raw = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), bytes) };
        // Same layout as the vfio-user reply (vfio-user borrowed it), so the same defensive
        // decoder walks the capability list.
        let info = wire::RegionInfo::decode(raw)
            .map_err(|e| HwError::Backend(format!("region {index} capabilities: {e}")))?;
        Ok(info.sparse.iter().map(|a| (a.offset, a.size)).collect())
    }
}

impl Backend for VfioBackend {
    fn behind_iommu(&self) -> bool {
        true
    }

    fn config_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.dev.read(wire::region::CONFIG, offset, buf)
    }

    fn config_write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.dev.write(wire::region::CONFIG, offset, data)
    }

    fn region_size(&self, bar: u8) -> Result<u64> {
        Ok(self.dev.regions.get(bar as usize).map_or(0, |r| r.size))
    }

    fn region(&self, bar: u8) -> Result<Region> {
        let r = *self.dev.region(bar as u32)?;
        let mut maps = Vec::new();
        if r.flags & sys::VFIO_REGION_INFO_FLAG_MMAP != 0 {
            let areas = if r.flags & sys::VFIO_REGION_INFO_FLAG_CAPS != 0
                && r.argsz as usize > std::mem::size_of::<sys::vfio_region_info>()
            {
                self.sparse_areas(bar as u32, r.argsz)?
            } else {
                vec![(0, r.size)]
            };
            let access = if r.flags & sys::VFIO_REGION_INFO_FLAG_WRITE != 0 {
                Access::ReadWrite
            } else {
                Access::ReadOnly
            };
            for (offset, size) in areas {
                if size == 0 || offset.checked_add(size).is_none_or(|e| e > r.size) {
                    continue;
                }
                let mem = SharedMem::map(
                    self.dev.device.as_fd(),
                    r.offset + offset,
                    size as usize,
                    access,
                )?;
                maps.push(MappedArea { offset, mem });
            }
        }
        Ok(Region::new(
            bar,
            r.size,
            maps,
            Vec::new(),
            Arc::new(VfioTrap {
                dev: self.dev.clone(),
            }),
        ))
    }

    fn irq_count(&self, kind: IrqKind) -> Result<u32> {
        let mut i = sys::vfio_irq_info {
            argsz: std::mem::size_of::<sys::vfio_irq_info>() as u32,
            index: irq_index(kind),
            ..Default::default()
        };
        // SAFETY: `i` is a correctly sized vfio_irq_info with argsz and index set.
        match unsafe {
            ioctl(
                self.dev.device.as_fd(),
                DEVICE_GET_IRQ_INFO,
                &mut i as *mut _ as usize,
                "VFIO_DEVICE_GET_IRQ_INFO",
            )
        } {
            Ok(_) => Ok(i.count),
            Err(_) => Ok(0),
        }
    }

    fn set_irqs(&self, kind: IrqKind, fds: &[BorrowedFd<'_>]) -> Result<()> {
        // struct vfio_irq_set followed by `count` s32 eventfds.
        let mut buf = Vec::with_capacity(20 + 4 * fds.len());
        let flags = if fds.is_empty() {
            sys::VFIO_IRQ_SET_DATA_NONE
        } else {
            sys::VFIO_IRQ_SET_DATA_EVENTFD
        } | sys::VFIO_IRQ_SET_ACTION_TRIGGER;
        for v in [
            (20 + 4 * fds.len()) as u32,
            flags,
            irq_index(kind),
            0,
            fds.len() as u32,
        ] {
            buf.extend_from_slice(&v.to_ne_bytes());
        }
        for fd in fds {
            buf.extend_from_slice(&fd.as_raw_fd().to_ne_bytes());
        }
        // SAFETY: `buf` is a complete vfio_irq_set with its trailing fd array, argsz = its size.
        unsafe {
            ioctl(
                self.dev.device.as_fd(),
                DEVICE_SET_IRQS,
                buf.as_mut_ptr() as usize,
                "VFIO_DEVICE_SET_IRQS",
            )
        }
        .map(|_| ())
        .map_err(|e| HwError::Irq(e.to_string()))
    }

    fn unmask_intx(&self) -> Result<()> {
        // struct vfio_irq_set with no data: unmask vector 0 of INTx.
        let mut buf = Vec::with_capacity(20);
        for v in [
            20u32,
            sys::VFIO_IRQ_SET_DATA_NONE | sys::VFIO_IRQ_SET_ACTION_UNMASK,
            irq_index(IrqKind::Intx),
            0,
            1,
        ] {
            buf.extend_from_slice(&v.to_ne_bytes());
        }
        // SAFETY: `buf` is a complete vfio_irq_set without data, argsz = its size.
        unsafe {
            ioctl(
                self.dev.device.as_fd(),
                DEVICE_SET_IRQS,
                buf.as_mut_ptr() as usize,
                "VFIO_DEVICE_SET_IRQS",
            )
        }
        .map(|_| ())
        .map_err(|e| HwError::Irq(e.to_string()))
    }

    fn dma_map(&self, iova: u64, size: u64, fd: BorrowedFd<'_>, offset: u64) -> Result<()> {
        let mem = SharedMem::map(fd, offset, size as usize, Access::ReadWrite)?;
        let map = sys::vfio_iommu_type1_dma_map {
            argsz: std::mem::size_of::<sys::vfio_iommu_type1_dma_map>() as u32,
            flags: sys::VFIO_DMA_MAP_FLAG_READ | sys::VFIO_DMA_MAP_FLAG_WRITE,
            vaddr: mem.as_ptr() as u64,
            iova,
            size,
        };
        // SAFETY: `map` is a correctly sized structure; the range it names is a live mapping
        // kept in `self.dev.dma` until it is unmapped from the IOMMU.
        unsafe {
            ioctl(
                self.dev.container.as_fd(),
                IOMMU_MAP_DMA,
                &map as *const _ as usize,
                "VFIO_IOMMU_MAP_DMA",
            )?
        };
        self.dev
            .dma
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(iova, mem);
        Ok(())
    }

    fn dma_unmap(&self, iova: u64, size: u64) -> Result<()> {
        let mut unmap = sys::vfio_iommu_type1_dma_unmap {
            argsz: std::mem::size_of::<sys::vfio_iommu_type1_dma_unmap>() as u32,
            flags: 0,
            iova,
            size,
            ..Default::default()
        };
        // SAFETY: a correctly sized structure the kernel may update with the unmapped size.
        unsafe {
            ioctl(
                self.dev.container.as_fd(),
                IOMMU_UNMAP_DMA,
                &mut unmap as *mut _ as usize,
                "VFIO_IOMMU_UNMAP_DMA",
            )?
        };
        // Only now, with the IOMMU entry gone, may the process mapping go.
        self.dev
            .dma
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&iova);
        Ok(())
    }

    fn reset(&self) -> Result<()> {
        if !self.dev.resettable {
            return Err(HwError::Backend("the device does not support reset".into()));
        }
        // SAFETY: VFIO_DEVICE_RESET takes no argument.
        unsafe {
            ioctl(
                self.dev.device.as_fd(),
                DEVICE_RESET,
                0,
                "VFIO_DEVICE_RESET",
            )
        }
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_linux() {
        // From <linux/vfio.h>: _IO(';', 100 + n).
        assert_eq!(GET_API_VERSION, 0x3b64);
        assert_eq!(DEVICE_GET_REGION_INFO, 15212);
        assert_eq!(IOMMU_UNMAP_DMA, 0x3b72);
    }

    #[test]
    fn opening_a_non_device_is_a_clear_error() {
        let e = VfioBackend::open("0000:ff:1f.7")
            .err()
            .expect("no such device");
        assert!(e.to_string().contains("no IOMMU group"), "{e}");
        assert!(VfioBackend::open("../../etc").is_err());
    }
}
