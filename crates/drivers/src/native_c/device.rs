//! A native C driver's device (`outboard_dev` in `include/outboard/native.h`): its function,
//! its BARs' regions, its interrupt vectors and its DMA memory, as the `outboard_dev_*` calls
//! ([`super::abi`]) reach them. Safe Rust: every check the calls make is here.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use outboard_hw::{DmaBuf, HwError, Irq, IrqKind, PciFunction, Region};

/// `OUTBOARD_EPERM`.
pub const EPERM: i32 = -1;
/// `OUTBOARD_EIO`.
pub const EIO: i32 = -5;
/// `OUTBOARD_ENOMEM`.
pub const ENOMEM: i32 = -12;
/// `OUTBOARD_EBUSY`.
pub const EBUSY: i32 = -16;
/// `OUTBOARD_EINVAL`.
pub const EINVAL: i32 = -22;

/// Most interrupt vectors a native driver may enable.
pub const MAX_VECTORS: u32 = 48;
/// Largest DMA allocation.
pub const MAX_DMA: u64 = 64 << 20;

/// The device a native C driver's handle stands for.
pub struct NativeDevice {
    driver: &'static str,
    function: PciFunction,
    bars: [OnceLock<Bar>; 6],
    irqs: OnceLock<(IrqKind, Vec<Irq>)>,
    /// DMA blocks by the address the driver has them at.
    dma: Mutex<BTreeMap<usize, DmaBuf>>,
    /// Set when the device was given up: every call fails from then on.
    given_up: AtomicBool,
}

/// A BAR the driver reached: its region, and whether it is an I/O BAR (ports) or memory.
struct Bar {
    region: Region,
    io: bool,
}

/// Which accessors an access came through: memory BARs and I/O BARs each have their own.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Space {
    Memory,
    Io,
}

/// The BAR accessors of one width: memory (`$read`/`$write`) and, when named, I/O ones.
macro_rules! bar_accessors {
    ($($t:ty: $read:ident $write:ident $(, io $io_read:ident $io_write:ident)?;)*) => {$(
        #[doc = concat!("`outboard_dev_", stringify!($read), "`.")]
        pub fn $read(&self, bar: u32, offset: u64) -> Answer<$t> {
            self.access(Space::Memory, bar, offset, std::mem::size_of::<$t>())?
                .$read(offset)
                .map_err(|_| EIO)
        }

        #[doc = concat!("`outboard_dev_", stringify!($write), "`.")]
        pub fn $write(&self, bar: u32, offset: u64, value: $t) -> Answer<()> {
            self.access(Space::Memory, bar, offset, std::mem::size_of::<$t>())?
                .$write(offset, value)
                .map_err(|_| EIO)
        }

        $(
        #[doc = concat!("`outboard_dev_", stringify!($io_read), "`.")]
        pub fn $io_read(&self, bar: u32, offset: u64) -> Answer<$t> {
            self.access(Space::Io, bar, offset, std::mem::size_of::<$t>())?
                .$read(offset)
                .map_err(|_| EIO)
        }

        #[doc = concat!("`outboard_dev_", stringify!($io_write), "`.")]
        pub fn $io_write(&self, bar: u32, offset: u64, value: $t) -> Answer<()> {
            self.access(Space::Io, bar, offset, std::mem::size_of::<$t>())?
                .$write(offset, value)
                .map_err(|_| EIO)
        }
        )?
    )*};
}

/// What a call does with its result: an `OUTBOARD_E*` code on failure.
pub type Answer<T> = Result<T, i32>;

impl NativeDevice {
    /// Driver `driver`'s device `function`.
    pub fn new(driver: &'static str, function: PciFunction) -> Self {
        Self {
            driver,
            function,
            bars: Default::default(),
            irqs: OnceLock::new(),
            dma: Mutex::new(BTreeMap::new()),
            given_up: AtomicBool::new(false),
        }
    }

    /// The function (its loss descriptor, its abandonment).
    pub fn function(&self) -> &PciFunction {
        &self.function
    }

    /// The driver's name, for its log lines.
    pub fn driver(&self) -> &'static str {
        self.driver
    }

    fn live(&self) -> Answer<()> {
        if self.given_up.load(Ordering::Acquire) {
            Err(EIO)
        } else {
            Ok(())
        }
    }

    /// Gives the device up: every call fails from now on. True if the device is certain not
    /// to reach the driver's memory any more.
    pub fn give_up(&self) -> bool {
        self.given_up.store(true, Ordering::Release);
        self.function.abandon()
    }

    fn config_offset(offset: u32) -> Answer<u64> {
        if offset.is_multiple_of(4) && offset < 4096 {
            Ok(offset.into())
        } else {
            Err(EINVAL)
        }
    }

    /// `outboard_dev_config_read32`.
    pub fn config_read32(&self, offset: u32) -> Answer<u32> {
        self.live()?;
        self.function
            .config_read32(Self::config_offset(offset)?)
            .map_err(|_| EIO)
    }

    /// `outboard_dev_config_write32`: through the function's configuration policy.
    pub fn config_write32(&self, offset: u32, value: u32) -> Answer<()> {
        self.live()?;
        match self
            .function
            .config_write(Self::config_offset(offset)?, &value.to_le_bytes())
        {
            Ok(()) => Ok(()),
            Err(HwError::ConfigDenied { .. }) => Err(EPERM),
            Err(_) => Err(EIO),
        }
    }

    /// BAR `bar`'s region, for an access of `len` bytes at `offset` through `space`'s
    /// accessors: `OUTBOARD_EINVAL` for a BAR the device does not have, a BAR of the other
    /// space or an access outside it, `OUTBOARD_EIO` if the device cannot be reached (asked
    /// again next time).
    fn access(&self, space: Space, bar: u32, offset: u64, len: usize) -> Answer<&Region> {
        self.live()?;
        let slot = self.bars.get(bar as usize).ok_or(EINVAL)?;
        let b = match slot.get() {
            Some(b) => b,
            None => {
                let sizes = self.function.bar_sizes().map_err(|_| EIO)?;
                if sizes[bar as usize] == 0 {
                    return Err(EINVAL);
                }
                // Bit 0 of a BAR register says which space it decodes (PCI 3.0, 6.2.5.1).
                let register = self
                    .function
                    .config_read32(0x10 + 4 * u64::from(bar))
                    .map_err(|_| EIO)?;
                let region = self.function.region(bar as u8).map_err(|_| EIO)?;
                slot.get_or_init(|| Bar {
                    region,
                    io: register & 1 == 1,
                })
            }
        };
        let len = len as u64;
        let inside = (b.io == (space == Space::Io))
            && offset.is_multiple_of(len)
            && offset
                .checked_add(len)
                .is_some_and(|end| end <= b.region.size());
        if inside {
            Ok(&b.region)
        } else {
            Err(EINVAL)
        }
    }

    bar_accessors! {
        u8: read8 write8, io io_read8 io_write8;
        u16: read16 write16, io io_read16 io_write16;
        u32: read32 write32, io io_read32 io_write32;
        u64: read64 write64;
    }

    /// `outboard_dev_enable_irqs`: how many vectors were enabled.
    pub fn enable_irqs(&self, count: u32) -> Answer<u32> {
        self.live()?;
        if !(1..=MAX_VECTORS).contains(&count) {
            return Err(EINVAL);
        }
        if self.irqs.get().is_some() {
            return Err(EBUSY);
        }
        let f = &self.function;
        let kind = [IrqKind::MsiX, IrqKind::Msi, IrqKind::Intx]
            .into_iter()
            .find(|k| f.irq_count(*k).is_ok_and(|n| n > 0))
            .ok_or(EIO)?;
        let n = f.irq_count(kind).map_err(|_| EIO)?.min(count);
        let irqs = f.enable_irqs(kind, n).map_err(|e| {
            tracing::warn!("{}: its interrupts: {e}", self.driver);
            EIO
        })?;
        if kind == IrqKind::Intx {
            // A mask a dead predecessor left (delivered, never unmasked) goes first.
            self.unmask_intx();
        }
        let enabled = irqs.len() as u32;
        self.irqs.set((kind, irqs)).map_err(|_| EBUSY)?;
        Ok(enabled)
    }

    /// The enabled vectors, by number.
    pub fn irqs(&self) -> &[Irq] {
        self.irqs.get().map_or(&[], |(_, v)| v.as_slice())
    }

    /// The loop's event sources for the device: each enabled vector, and its loss.
    pub fn sources(&self) -> Vec<(outboard_env::DeviceEvent, std::os::fd::BorrowedFd<'_>)> {
        use outboard_env::DeviceEvent;
        let mut v: Vec<_> = self
            .irqs()
            .iter()
            .enumerate()
            .map(|(i, irq)| (DeviceEvent::Interrupt(i as u16), irq.fd()))
            .collect();
        if let Some(fd) = self.function.loss_fd() {
            v.push((DeviceEvent::Lost, fd));
        }
        v
    }

    /// Vector `v` fired: its event is taken (before the driver is called, so a firing while
    /// it runs is a new event).
    pub fn acknowledge(&self, v: u16) {
        if let Some(irq) = self.irqs().get(usize::from(v)) {
            irq.ack();
        }
    }

    /// After vector `v`'s event: INTx is a level masked as it is delivered, unmasked once
    /// handled (it interrupts again if the device still asserts it).
    pub fn end_of_interrupt(&self) {
        if matches!(self.irqs.get(), Some((IrqKind::Intx, _))) {
            self.unmask_intx();
        }
    }

    fn unmask_intx(&self) {
        if let Err(e) = (self.function.intx_unmasker())() {
            tracing::warn!("{}: cannot unmask INTx: {e}", self.driver);
        }
    }

    /// `outboard_dev_dma_alloc`: the block's address for the driver, and for the device.
    pub fn dma_alloc(&self, size: u64) -> Answer<(*mut u8, u64)> {
        self.live()?;
        if !(1..=MAX_DMA).contains(&size) {
            return Err(EINVAL);
        }
        let buf = self.function.dma().alloc(size as usize).map_err(|e| {
            tracing::warn!("{}: DMA memory: {e}", self.driver);
            ENOMEM
        })?;
        let va = buf.io_ptr(0, size as usize).map_err(|_| ENOMEM)?;
        let iova = buf.iova();
        self.dma
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(va as usize, buf);
        Ok((va, iova))
    }

    /// `outboard_dev_dma_free` (after a give-up too the block is not the driver's any more:
    /// it is freed, and the answer is `OUTBOARD_EIO` like every call's).
    pub fn dma_free(&self, va: usize) -> Answer<()> {
        let freed = self
            .dma
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&va)
            .map(drop)
            .ok_or(EINVAL);
        self.live().and(freed)
    }

    /// `outboard_dev_log`.
    pub fn log(&self, level: i32, message: &str) {
        let d = self.driver;
        match level {
            i32::MIN..=0 => tracing::error!("{d}: {message}"),
            1 => tracing::warn!("{d}: {message}"),
            2 => tracing::info!("{d}: {message}"),
            _ => tracing::debug!("{d}: {message}"),
        }
    }
}
