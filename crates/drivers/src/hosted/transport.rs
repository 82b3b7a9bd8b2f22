//! The crate's `Transport` over Outboard's virtio PCI transport (`crate::virtio::transport`):
//! the function's common, notify, ISR and device structures through its regions, whatever the
//! backend (VFIO, vfio-user, in-process).
//!
//! The crate's transport calls cannot fail; a failed register access (the device is gone) is
//! remembered here ([`HostedTransport::failed`]) and the adapter turns it into a device
//! failure after the call.

use std::sync::{Arc, Mutex};

use outboard_spec::virtio::{feature as vfeature, DeviceStatus as OurStatus, NO_VECTOR};
use virtio_drivers::transport::{DeviceStatus, DeviceType, InterruptStatus, Transport};
use virtio_drivers::{Error, PhysAddr};
use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::virtio::{Doorbell, Transport as Pci, VirtioError};

/// The MSI-X vector every queue interrupts on.
pub const QUEUE_VECTOR: u16 = 0;

/// A virtio PCI function as the crate's `Transport`.
pub struct HostedTransport {
    pci: Pci,
    device_type: DeviceType,
    doorbells: Vec<Option<Doorbell>>,
    failed: Arc<Mutex<Option<String>>>,
}

impl HostedTransport {
    /// Over `pci`, a device of `device_type`.
    pub fn new(pci: Pci, device_type: DeviceType) -> Self {
        Self {
            pci,
            device_type,
            doorbells: Vec::new(),
            failed: Arc::default(),
        }
    }

    /// Where a failed register access is recorded.
    pub fn failed(&self) -> Arc<Mutex<Option<String>>> {
        self.failed.clone()
    }

    fn note<T: Default>(&self, r: Result<T, VirtioError>) -> T {
        r.unwrap_or_else(|e| {
            let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
            f.get_or_insert_with(|| e.to_string());
            T::default()
        })
    }
}

impl Drop for HostedTransport {
    fn drop(&mut self) {
        // The device forgets its queues before their memory is unmapped and its addresses
        // reused (the crate's own PCI transport resets on drop too).
        if let Err(e) = self.pci.reset() {
            tracing::warn!("virtio-drivers-blk: resetting the device: {e}");
        }
    }
}

impl Transport for HostedTransport {
    fn device_type(&self) -> DeviceType {
        self.device_type
    }

    fn read_device_features(&mut self) -> u64 {
        let r = self.pci.device_features();
        self.note(r)
    }

    fn write_driver_features(&mut self, driver_features: u64) {
        // ACCESS_PLATFORM describes the platform, not the device class: the device's DMA goes
        // through Outboard's DMA space (an IOMMU, or the model's own address space), which is
        // what the bit says. The crate does not know the bit; the transport accepts it.
        let offered = self.note(self.pci.device_features());
        let platform = offered & vfeature::ACCESS_PLATFORM;
        let r = self.pci.write_driver_features(driver_features | platform);
        self.note(r)
    }

    fn max_queue_size(&mut self, queue: u16) -> u32 {
        let r = self.pci.queue_max_size(queue);
        u32::from(self.note(r))
    }

    fn notify(&mut self, queue: u16) {
        if let Some(Some(d)) = self.doorbells.get(usize::from(queue)) {
            let r = d.ring();
            self.note(r)
        }
    }

    fn get_status(&self) -> DeviceStatus {
        DeviceStatus::from_bits_retain(u32::from(self.note(self.pci.status().map(|s| s.bits()))))
    }

    fn set_status(&mut self, status: DeviceStatus) {
        let r = self
            .pci
            .set_status(OurStatus::from_bits_retain(status.bits() as u8));
        self.note(r);
        // The crate does not read FEATURES_OK back (§3.1.1 step 6): the transport does, and a
        // device that refused the features fails the start.
        if status.contains(DeviceStatus::FEATURES_OK) && !status.contains(DeviceStatus::DRIVER_OK) {
            let kept = self.note(self.pci.status().map(|s| s.bits()));
            if kept & OurStatus::FEATURES_OK.bits() == 0 {
                let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
                f.get_or_insert_with(|| {
                    "the device refused the features the driver accepted".into()
                });
            }
        }
    }

    fn set_guest_page_size(&mut self, _guest_page_size: u32) {
        // Modern virtio has no guest page size.
    }

    fn requires_legacy_layout(&self) -> bool {
        false
    }

    fn queue_set(
        &mut self,
        queue: u16,
        size: u32,
        descriptors: PhysAddr,
        driver_area: PhysAddr,
        device_area: PhysAddr,
    ) {
        let r = self.pci.set_config_vector(NO_VECTOR).and_then(|()| {
            self.pci.setup_queue(
                queue,
                size as u16,
                descriptors,
                driver_area,
                device_area,
                QUEUE_VECTOR,
            )
        });
        let bell = self.note(r.map(Some));
        let i = usize::from(queue);
        if self.doorbells.len() <= i {
            self.doorbells.resize(i + 1, None);
        }
        self.doorbells[i] = bell;
    }

    fn queue_unset(&mut self, queue: u16) {
        // Without RING_RESET a queue is unset by the device's reset, which the crate makes when
        // it drops the device; the doorbell goes now.
        if let Some(d) = self.doorbells.get_mut(usize::from(queue)) {
            *d = None;
        }
    }

    fn queue_used(&mut self, queue: u16) -> bool {
        self.doorbells
            .get(usize::from(queue))
            .is_some_and(Option::is_some)
    }

    fn ack_interrupt(&mut self) -> InterruptStatus {
        // Queue interrupts come on MSI-X (no ISR read needed); said as a queue interrupt.
        InterruptStatus::QUEUE_INTERRUPT
    }

    fn read_config_generation(&self) -> u32 {
        u32::from(self.note(self.pci.config_generation()))
    }

    fn read_config_space<T: FromBytes + IntoBytes>(&self, offset: usize) -> Result<T, Error> {
        let mut v = T::new_zeroed();
        let buf = v.as_mut_bytes();
        if offset + buf.len() > self.pci.config_len() as usize {
            return Err(Error::ConfigSpaceTooSmall);
        }
        self.pci
            .read_config_field(offset as u64, buf)
            .map_err(|_| Error::IoError)?;
        Ok(v)
    }

    fn write_config_space<T: IntoBytes + Immutable>(
        &mut self,
        _offset: usize,
        _value: T,
    ) -> Result<(), Error> {
        // The block driver writes no configuration; nothing else is hosted.
        Err(Error::Unsupported)
    }
}
