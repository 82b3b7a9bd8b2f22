//! The in-process backend: a device model in the same process, called directly.
//!
//! Every register access is a direct, synchronous call into the device model under one lock,
//! and there are no doorbell eventfds: a queue notification is a trapped write that the model
//! handles before the write returns. Tests built on it are therefore deterministic — the device
//! has finished its work when the driver's doorbell write returns — and fast. The DMA map and
//! interrupt logic are the very ones the vfio-user server uses ([`DeviceContext`]).

use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use outboard_shm::{Access, SharedMem};
use outboard_vfio_user::wire::{self, region};
use outboard_vfio_user::{DeviceBackend, DeviceContext};

use super::{irq_index, Backend};
use crate::region::{MappedArea, Trap};
use crate::{HwError, IrqKind, Region, Result};

type Device = Box<dyn DeviceBackend + Send>;

struct Shared {
    state: Mutex<(Device, DeviceContext)>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, (Device, DeviceContext)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn access(&self, index: u32, offset: u64, len: usize, need: u32) -> Result<()> {
        let st = self.lock();
        let regions = st.0.regions();
        let r = regions
            .iter()
            .find(|r| r.index == index)
            .ok_or(HwError::NoSuchRegion(index as u8))?;
        if r.flags & need == 0 {
            return Err(HwError::Backend(format!(
                "region {index} does not permit this access"
            )));
        }
        if offset.checked_add(len as u64).is_none_or(|e| e > r.size) {
            return Err(HwError::Backend(format!(
                "region {index}: access at {offset:#x} out of range"
            )));
        }
        Ok(())
    }

    fn read(&self, index: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.access(index, offset, buf.len(), region::FLAG_READ)?;
        let mut st = self.lock();
        let (dev, ctx) = &mut *st;
        dev.region_read(ctx, index, offset, buf)
            .map_err(|e| HwError::Backend(format!("region {index} read: {e}")))
    }

    fn write(&self, index: u32, offset: u64, data: &[u8]) -> Result<()> {
        self.access(index, offset, data.len(), region::FLAG_WRITE)?;
        let mut st = self.lock();
        let (dev, ctx) = &mut *st;
        dev.region_write(ctx, index, offset, data)
            .map_err(|e| HwError::Backend(format!("region {index} write: {e}")))
    }
}

impl Trap for Shared {
    fn read(&self, bar: u8, offset: u64, buf: &mut [u8]) -> Result<()> {
        Shared::read(self, region::BAR0 + bar as u32, offset, buf)
    }
    fn write(&self, bar: u8, offset: u64, data: &[u8], _posted: bool) -> Result<()> {
        Shared::write(self, region::BAR0 + bar as u32, offset, data)
    }
}

/// A device model running inside this process.
pub struct InProcess {
    shared: Arc<Shared>,
}

impl InProcess {
    /// Wraps a device model; it is reset first, as a server would.
    pub fn new(mut device: Device) -> Self {
        let mut ctx = DeviceContext::new(Duration::from_secs(1));
        device.reset(&mut ctx);
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new((device, ctx)),
            }),
        }
    }

    /// Lets the device model take the input waiting on its own descriptors (a NIC's wire),
    /// as its server's loop would when they became readable; how many were readable.
    pub fn pump_input(&self) -> usize {
        let mut st = self.shared.lock();
        let (dev, ctx) = &mut *st;
        let ready: Vec<usize> = dev
            .input_fds()
            .iter()
            .enumerate()
            .filter(|(_, fd)| {
                let mut p = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
                rustix::event::poll(&mut p, Some(&rustix::time::Timespec::default()))
                    .is_ok_and(|n| n > 0)
            })
            .map(|(i, _)| i)
            .collect();
        for &i in &ready {
            dev.input(ctx, i);
        }
        ready.len()
    }

    /// Runs `f` on the device model (fault injection, inspection).
    pub fn with_device<R>(
        &self,
        f: impl FnOnce(&mut dyn DeviceBackend, &mut DeviceContext) -> R,
    ) -> R {
        let mut st = self.shared.lock();
        let (dev, ctx) = &mut *st;
        f(dev.as_mut(), ctx)
    }
}

impl Backend for InProcess {
    fn config_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.shared.read(region::CONFIG, offset, buf)
    }

    fn config_write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.shared.write(region::CONFIG, offset, data)
    }

    fn region_size(&self, bar: u8) -> Result<u64> {
        let st = self.shared.lock();
        Ok(st
            .0
            .regions()
            .iter()
            .find(|r| r.index == region::BAR0 + bar as u32)
            .map(|r| r.size)
            .unwrap_or(0))
    }

    fn region(&self, bar: u8) -> Result<Region> {
        let st = self.shared.lock();
        let regions = st.0.regions();
        let r = regions
            .iter()
            .find(|r| r.index == region::BAR0 + bar as u32 && r.size > 0)
            .ok_or(HwError::NoSuchRegion(bar))?;
        let mut maps = Vec::new();
        if let Some(m) = &r.mmap {
            let access = if r.flags & region::FLAG_WRITE != 0 {
                Access::ReadWrite
            } else {
                Access::ReadOnly
            };
            let areas: Vec<(u64, u64)> = if m.areas.is_empty() {
                vec![(0, r.size)]
            } else {
                m.areas.iter().map(|a| (a.offset, a.size)).collect()
            };
            for (offset, size) in areas {
                let mem = SharedMem::map(m.fd, m.offset + offset, size as usize, access)?;
                maps.push(MappedArea { offset, mem });
            }
        }
        let size = r.size;
        drop(regions);
        drop(st);
        Ok(Region::new(
            bar,
            size,
            maps,
            Vec::new(),
            self.shared.clone(),
        ))
    }

    fn irq_count(&self, kind: IrqKind) -> Result<u32> {
        let st = self.shared.lock();
        Ok(st
            .0
            .irqs()
            .iter()
            .find(|i| i.index == irq_index(kind))
            .map(|i| i.count)
            .unwrap_or(0))
    }

    fn set_irqs(&self, kind: IrqKind, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let index = irq_index(kind);
        let total = self.irq_count(kind)?;
        let owned = fds
            .iter()
            .map(|f| f.try_clone_to_owned())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| HwError::Irq(e.to_string()))?;
        let set = wire::IrqSet {
            argsz: 0,
            flags: if fds.is_empty() {
                wire::irq::SET_DATA_NONE | wire::irq::SET_ACTION_TRIGGER
            } else {
                wire::irq::SET_DATA_EVENTFD | wire::irq::SET_ACTION_TRIGGER
            },
            index,
            start: 0,
            count: fds.len() as u32,
            data: Vec::new(),
        };
        let mut st = self.shared.lock();
        let (dev, ctx) = &mut *st;
        ctx.irqs
            .apply(total, &set, owned)
            .map_err(|e| HwError::Irq(e.to_string()))?;
        dev.irqs_changed(ctx, index);
        Ok(())
    }

    fn unmask_intx(&self) -> Result<()> {
        let index = irq_index(IrqKind::Intx);
        let total = self.irq_count(IrqKind::Intx)?;
        let set = wire::IrqSet {
            argsz: 0,
            flags: wire::irq::SET_DATA_NONE | wire::irq::SET_ACTION_UNMASK,
            index,
            start: 0,
            count: 1,
            data: Vec::new(),
        };
        let mut st = self.shared.lock();
        let (dev, ctx) = &mut *st;
        ctx.irqs
            .apply(total, &set, Vec::new())
            .map_err(|e| HwError::Irq(e.to_string()))?;
        dev.irqs_changed(ctx, index);
        Ok(())
    }

    fn dma_map(&self, iova: u64, size: u64, fd: BorrowedFd<'_>, offset: u64) -> Result<()> {
        let owned = fd
            .try_clone_to_owned()
            .map_err(|e| HwError::Backend(e.to_string()))?;
        let m = wire::DmaMap {
            argsz: wire::DmaMap::SIZE as u32,
            flags: wire::dma::FLAG_READ | wire::dma::FLAG_WRITE,
            offset,
            addr: iova,
            size,
        };
        self.shared
            .lock()
            .1
            .dma
            .map(&m, Some(owned))
            .map_err(|e| HwError::Backend(format!("DMA map: {e}")))
    }

    fn dma_unmap(&self, iova: u64, size: u64) -> Result<()> {
        let mut st = self.shared.lock();
        let (dev, ctx) = &mut *st;
        dev.before_unmap(ctx, iova, size);
        ctx.dma
            .unmap(iova, size)
            .map_err(|e| HwError::Backend(format!("DMA unmap: {e}")))
    }

    fn reset(&self) -> Result<()> {
        let mut st = self.shared.lock();
        let (dev, ctx) = &mut *st;
        dev.reset(ctx);
        Ok(())
    }
}
