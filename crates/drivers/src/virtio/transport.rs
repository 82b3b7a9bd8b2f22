//! Virtio over PCI, driver side (virtio v1.2 §4.1): find the structures through the vendor
//! capabilities, negotiate features, set up queues and vectors.
//!
//! Nothing here knows whether the function is an Outboard device model or QEMU's device behind
//! VFIO: it only uses [`PciFunction`] and [`Region`].

use std::time::{Duration, Instant};

use outboard_hw::{PciFunction, Region};
use outboard_spec::pci;
use outboard_spec::virtio::{cap, common, DeviceStatus};

use super::VirtioError;

/// Where one virtio structure lives.
#[derive(Debug, Clone)]
pub struct Structure {
    /// The BAR's region.
    pub region: Region,
    /// Offset within the BAR.
    pub offset: u64,
    /// Length.
    pub length: u32,
}

/// A virtio capability as found in configuration space (for probe output too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioCap {
    /// Offset of the capability in configuration space.
    pub at: u8,
    /// `cfg_type`.
    pub cfg_type: u8,
    /// BAR.
    pub bar: u8,
    /// Offset within the BAR.
    pub offset: u32,
    /// Length.
    pub length: u32,
    /// `notify_off_multiplier` (notify capability only).
    pub multiplier: u32,
}

/// Reads every virtio vendor capability of `func`.
pub fn virtio_caps(func: &PciFunction) -> Result<Vec<VirtioCap>, VirtioError> {
    let mut out = Vec::new();
    for c in func.capabilities()? {
        if c.id != pci::CAP_ID_VENDOR {
            continue;
        }
        let at = c.offset as u64;
        let mut raw = [0u8; cap::NOTIFY_SIZE as usize];
        // A virtio capability's fields are fixed: read as they were at open, no trip to
        // the device.
        func.config_read_at_open(at, &mut raw)?;
        let le32 = |o: u64| {
            u32::from_le_bytes(raw[o as usize..o as usize + 4].try_into().expect("4 bytes"))
        };
        let cfg_type = raw[cap::CFG_TYPE as usize];
        out.push(VirtioCap {
            at: c.offset,
            cfg_type,
            bar: raw[cap::BAR as usize],
            offset: le32(cap::OFFSET),
            length: le32(cap::LENGTH),
            multiplier: if cfg_type == cap::NOTIFY_CFG {
                le32(cap::NOTIFY_OFF_MULTIPLIER)
            } else {
                0
            },
        });
    }
    Ok(out)
}

/// The modern virtio-pci transport of one function.
#[derive(Debug)]
pub struct Transport {
    common: Structure,
    notify: Structure,
    notify_multiplier: u32,
    isr: Structure,
    device: Option<Structure>,
}

impl Transport {
    /// Locates the common, notify, ISR and device structures (§4.1.4: the first capability of
    /// each type whose BAR the driver can use).
    pub fn new(func: &PciFunction) -> Result<Self, VirtioError> {
        let caps = virtio_caps(func)?;
        // Each BAR is set up once, however many structures it holds (usually all four):
        // over vfio-user, setting one up is several round trips to the model.
        let mut bars: Vec<(u8, Region)> = Vec::new();
        let mut find = |t: u8| -> Result<Option<(Structure, u32)>, VirtioError> {
            if let Some(c) = caps.iter().find(|c| c.cfg_type == t && c.bar <= 5) {
                let region = match bars.iter().find(|(b, _)| *b == c.bar) {
                    Some((_, r)) => r.clone(),
                    None => {
                        let r = func.region(c.bar)?;
                        bars.push((c.bar, r.clone()));
                        r
                    }
                };
                if (c.offset as u64)
                    .checked_add(c.length as u64)
                    .is_none_or(|e| e > region.size())
                {
                    return Err(VirtioError::Device(format!(
                        "{} structure {:#x}+{:#x} lies outside BAR{}",
                        cap::name(t),
                        c.offset,
                        c.length,
                        c.bar
                    )));
                }
                return Ok(Some((
                    Structure {
                        region,
                        offset: c.offset as u64,
                        length: c.length,
                    },
                    c.multiplier,
                )));
            }
            Ok(None)
        };
        let missing = |what: &str| {
            VirtioError::Device(format!(
                "no virtio {what} capability: not a modern virtio device"
            ))
        };
        let (common, _) = find(cap::COMMON_CFG)?.ok_or_else(|| missing("common"))?;
        if (common.length as u64) < common::SIZE {
            return Err(VirtioError::Device(
                "common configuration is too short".into(),
            ));
        }
        let (notify, notify_multiplier) =
            find(cap::NOTIFY_CFG)?.ok_or_else(|| missing("notify"))?;
        let (isr, _) = find(cap::ISR_CFG)?.ok_or_else(|| missing("ISR"))?;
        let device = find(cap::DEVICE_CFG)?.map(|(s, _)| s);
        Ok(Self {
            common,
            notify,
            notify_multiplier,
            isr,
            device,
        })
    }

    fn c8(&self, off: u64) -> Result<u8, VirtioError> {
        Ok(self.common.region.read8(self.common.offset + off)?)
    }
    fn c16(&self, off: u64) -> Result<u16, VirtioError> {
        Ok(self.common.region.read16(self.common.offset + off)?)
    }
    fn c32(&self, off: u64) -> Result<u32, VirtioError> {
        Ok(self.common.region.read32(self.common.offset + off)?)
    }
    fn w8(&self, off: u64, v: u8) -> Result<(), VirtioError> {
        Ok(self.common.region.write8(self.common.offset + off, v)?)
    }
    fn w16(&self, off: u64, v: u16) -> Result<(), VirtioError> {
        Ok(self.common.region.write16(self.common.offset + off, v)?)
    }
    fn w32(&self, off: u64, v: u32) -> Result<(), VirtioError> {
        Ok(self.common.region.write32(self.common.offset + off, v)?)
    }
    fn w64(&self, off: u64, v: u64) -> Result<(), VirtioError> {
        // Two 32-bit writes, low then high: the width every transport accepts (§4.1.3.1).
        self.w32(off, v as u32)?;
        self.w32(off + 4, (v >> 32) as u32)
    }

    /// Device status.
    pub fn status(&self) -> Result<DeviceStatus, VirtioError> {
        Ok(DeviceStatus::from_bits_retain(
            self.c8(common::DEVICE_STATUS)?,
        ))
    }

    /// Adds status bits.
    pub fn add_status(&self, bits: DeviceStatus) -> Result<(), VirtioError> {
        let s = self.status()? | bits;
        self.w8(common::DEVICE_STATUS, s.bits())
    }

    /// Resets the device and waits for it to read back 0 (§4.1.4.3.2), at most a second.
    pub fn reset(&self) -> Result<(), VirtioError> {
        self.w8(common::DEVICE_STATUS, 0)?;
        let deadline = Instant::now() + Duration::from_secs(1);
        while self.c8(common::DEVICE_STATUS)? != 0 {
            if Instant::now() > deadline {
                return Err(VirtioError::Device("device did not complete reset".into()));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    /// Features the device offers.
    pub fn device_features(&self) -> Result<u64, VirtioError> {
        self.w32(common::DEVICE_FEATURE_SELECT, 0)?;
        let lo = self.c32(common::DEVICE_FEATURE)? as u64;
        self.w32(common::DEVICE_FEATURE_SELECT, 1)?;
        let hi = self.c32(common::DEVICE_FEATURE)? as u64;
        Ok(lo | hi << 32)
    }

    /// Accepts `device & supported`, sets FEATURES_OK and checks the device kept it (§3.1.1
    /// steps 4–6). Returns the negotiated set.
    pub fn negotiate(&self, supported: u64) -> Result<u64, VirtioError> {
        let offered = self.device_features()?;
        let accepted = offered & supported;
        self.write_driver_features(accepted)?;
        self.add_status(DeviceStatus::FEATURES_OK)?;
        if !self.status()?.contains(DeviceStatus::FEATURES_OK) {
            return Err(VirtioError::Negotiation { offered, accepted });
        }
        Ok(accepted)
    }

    /// Writes the features the driver accepts, without setting `FEATURES_OK` (for a driver
    /// that sets the status itself).
    pub fn write_driver_features(&self, accepted: u64) -> Result<(), VirtioError> {
        self.w32(common::DRIVER_FEATURE_SELECT, 0)?;
        self.w32(common::DRIVER_FEATURE, accepted as u32)?;
        self.w32(common::DRIVER_FEATURE_SELECT, 1)?;
        self.w32(common::DRIVER_FEATURE, (accepted >> 32) as u32)
    }

    /// Sets the device status to `bits` exactly.
    pub fn set_status(&self, bits: DeviceStatus) -> Result<(), VirtioError> {
        self.w8(common::DEVICE_STATUS, bits.bits())
    }

    /// The configuration generation (§4.1.4.3).
    pub fn config_generation(&self) -> Result<u8, VirtioError> {
        self.c8(common::CONFIG_GENERATION)
    }

    /// Number of queues the device has.
    pub fn num_queues(&self) -> Result<u16, VirtioError> {
        self.c16(common::NUM_QUEUES)
    }

    /// Selects queue `index` and returns its maximum size (0: queue absent).
    pub fn queue_max_size(&self, index: u16) -> Result<u16, VirtioError> {
        self.w16(common::QUEUE_SELECT, index)?;
        self.c16(common::QUEUE_SIZE)
    }

    /// Programs and enables queue `index` (§4.1.5.1.3). Returns its notify address.
    pub fn setup_queue(
        &self,
        index: u16,
        size: u16,
        desc: u64,
        avail: u64,
        used: u64,
        vector: u16,
    ) -> Result<Doorbell, VirtioError> {
        self.w16(common::QUEUE_SELECT, index)?;
        self.w16(common::QUEUE_SIZE, size)?;
        self.w16(common::QUEUE_MSIX_VECTOR, vector)?;
        if self.c16(common::QUEUE_MSIX_VECTOR)? != vector {
            return Err(VirtioError::Device(format!(
                "queue {index} refused MSI-X vector {vector}"
            )));
        }
        self.w64(common::QUEUE_DESC, desc)?;
        self.w64(common::QUEUE_DRIVER, avail)?;
        self.w64(common::QUEUE_DEVICE, used)?;
        let off = self.c16(common::QUEUE_NOTIFY_OFF)? as u64 * self.notify_multiplier as u64;
        if off + 2 > self.notify.length as u64 {
            return Err(VirtioError::Device(format!(
                "queue {index} notify offset {off:#x} outside the notify area"
            )));
        }
        self.w16(common::QUEUE_ENABLE, 1)?;
        Ok(Doorbell {
            region: self.notify.region.clone(),
            offset: self.notify.offset + off,
            queue: index,
        })
    }

    /// Resets queue `index` alone (§2.6.1; the driver negotiated `RING_RESET`): the device
    /// forgets its buffers. Waits, bounded, until the device reads back that it is done.
    pub fn reset_queue(&self, index: u16) -> Result<(), VirtioError> {
        if u64::from(self.common.length) < common::SIZE_V1_2 {
            return Err(VirtioError::Device(
                "the common configuration has no queue_reset".into(),
            ));
        }
        self.w16(common::QUEUE_SELECT, index)?;
        self.w16(common::QUEUE_RESET, 1)?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while self.c16(common::QUEUE_RESET)? != 1 {
            if std::time::Instant::now() > deadline {
                return Err(VirtioError::Device(format!(
                    "queue {index} did not reset within a second"
                )));
            }
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        Ok(())
    }

    /// Routes configuration-change interrupts to `vector`.
    pub fn set_config_vector(&self, vector: u16) -> Result<(), VirtioError> {
        self.w16(common::CONFIG_MSIX_VECTOR, vector)?;
        if self.c16(common::CONFIG_MSIX_VECTOR)? != vector {
            return Err(VirtioError::Device(format!(
                "config vector {vector} refused"
            )));
        }
        Ok(())
    }

    /// Reads and clears the ISR (INTx only).
    pub fn read_isr(&self) -> Result<u8, VirtioError> {
        Ok(self.isr.region.read8(self.isr.offset)?)
    }

    /// Reads `buf.len()` bytes of device configuration at `offset`, retrying until the
    /// configuration generation is stable (§4.1.4.3.1).
    pub fn read_config(&self, offset: u64, buf: &mut [u8]) -> Result<(), VirtioError> {
        self.consistently(|| self.read_config_field(offset, buf))
    }

    /// Runs `read` (reads of device configuration fields with
    /// [`Transport::read_config_field`]) until the configuration generation is the same before
    /// and after it (§4.1.4.3.1): several fields read as one consistent set, for two reads of
    /// the generation instead of two per field.
    pub fn consistently<R>(
        &self,
        mut read: impl FnMut() -> Result<R, VirtioError>,
    ) -> Result<R, VirtioError> {
        for _ in 0..16 {
            let before = self.c8(common::CONFIG_GENERATION)?;
            let got = read()?;
            if self.c8(common::CONFIG_GENERATION)? == before {
                return Ok(got);
            }
        }
        Err(VirtioError::Device("configuration keeps changing".into()))
    }

    /// Reads `buf.len()` bytes of device configuration at `offset` once, without looking at
    /// the generation: only inside [`Transport::consistently`].
    pub fn read_config_field(&self, offset: u64, buf: &mut [u8]) -> Result<(), VirtioError> {
        let dev = self
            .device
            .as_ref()
            .ok_or_else(|| VirtioError::Device("device has no configuration structure".into()))?;
        if offset + buf.len() as u64 > dev.length as u64 {
            return Err(VirtioError::Device(format!(
                "configuration field at {offset:#x} beyond the {}-byte structure",
                dev.length
            )));
        }
        // Natural widths (§4.1.3.1): a 16-bit field with one 16-bit access, 32- and 64-bit
        // fields with 32-bit accesses, bytes alone only where nothing wider fits.
        let mut i = 0;
        while i < buf.len() {
            let at = dev.offset + offset + i as u64;
            let left = buf.len() - i;
            let n = if left >= 4 && (offset + i as u64).is_multiple_of(4) {
                buf[i..i + 4].copy_from_slice(&dev.region.read32(at)?.to_le_bytes());
                4
            } else if left >= 2 && (offset + i as u64).is_multiple_of(2) {
                buf[i..i + 2].copy_from_slice(&dev.region.read16(at)?.to_le_bytes());
                2
            } else {
                buf[i] = dev.region.read8(at)?;
                1
            };
            i += n;
        }
        Ok(())
    }

    /// Length of the device configuration structure.
    pub fn config_len(&self) -> u32 {
        self.device.as_ref().map_or(0, |d| d.length)
    }
}

/// Where to write to notify one queue.
#[derive(Debug, Clone)]
pub struct Doorbell {
    region: Region,
    offset: u64,
    queue: u16,
}

impl Doorbell {
    /// Notifies the device (§4.1.5.2): writes the queue index to its notify address. With
    /// vfio-user this is an ioeventfd write; with VFIO, an MMIO store.
    pub fn ring(&self) -> Result<(), VirtioError> {
        Ok(self.region.write16(self.offset, self.queue)?)
    }
}
