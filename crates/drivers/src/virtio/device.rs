//! What every modern virtio-pci driver does the same way, whatever its device type: the
//! initialization sequence of virtio 1.2 §3.1.1, feature negotiation, interrupt routing
//! (MSI-X vector 0 for configuration changes and `1 + q` for queue `q`, or one INTx line),
//! queue set-up, DEVICE_NEEDS_RESET, the environment's event sources, and the reset that must
//! come before the driver's memory is freed (§3.3.1). A device driver (virtio-blk,
//! virtio-rng) adds only its device part: its feature bits, its configuration fields, what it
//! puts in its queues.
//!
//! Bring-up is two steps so the device part can read its configuration between them:
//! [`Negotiation::begin`] (steps 1–6: reset, ACKNOWLEDGE, DRIVER, features), then
//! [`Negotiation::finish`] (step 7's queues and vectors, then 8: DRIVER_OK).

use std::os::fd::BorrowedFd;

use outboard_env::{DeviceEvent, Failure, Fence};
use outboard_hw::{Irq, IrqKind, PciFunction};
use outboard_spec::virtio::{feature as vfeature, DeviceStatus, NO_VECTOR};

use crate::virtio::{Transport, VirtQueue, VirtioError};

/// The active probe's check every modern virtio-pci driver makes, from configuration space
/// and BAR sizes only: each structure in `needed` (`cap::COMMON_CFG`, …) is there, inside a
/// BAR the function has. The error says which is missing.
pub fn modern_structures(
    caps: &[crate::virtio::VirtioCap],
    bar_sizes: &[u64; 6],
    needed: &[u8],
) -> Result<(), String> {
    for &t in needed {
        let usable = caps.iter().any(|c| {
            c.cfg_type == t
                && bar_sizes.get(c.bar as usize).is_some_and(|&size| {
                    (c.offset as u64)
                        .checked_add(c.length as u64)
                        .is_some_and(|end| c.length > 0 && end <= size)
                })
        });
        if !usable {
            return Err(format!(
                "no usable virtio {} structure: the device lacks the modern virtio-pci \
                 interface (virtio 1.x §4.1.4), or places it outside its BARs",
                outboard_spec::virtio::cap::name(t)
            ));
        }
    }
    Ok(())
}

/// The active probe of a modern virtio-pci driver (`kind`: "virtio-net"): a PCI function whose
/// structures in `needed` are inside its BARs, bidding `initial`, or 100 less if it is the
/// transitional device `transitional` (0x1000 + the device id) rather than the modern one.
pub fn probe_modern(
    dev: &crate::personality::Probe<'_>,
    initial: u32,
    kind: &str,
    needed: &[u8],
    transitional: u16,
) -> Result<u32, String> {
    let crate::personality::Probe::Pci(f) = dev else {
        return Err(format!("{kind} drives PCI functions"));
    };
    let caps = crate::virtio::transport::virtio_caps(f).map_err(|e| e.to_string())?;
    let bars = f.bar_sizes().map_err(|e| e.to_string())?;
    modern_structures(&caps, &bars, needed)?;
    Ok(if f.identity().device == transitional {
        initial.saturating_sub(100)
    } else {
        initial
    })
}

/// A device between feature negotiation and DRIVER_OK.
pub struct Negotiation {
    func: PciFunction,
    transport: Transport,
    features: u64,
}

impl Negotiation {
    /// Steps 1–6 of §3.1.1 on `func`: enables memory and bus mastering, resets the device,
    /// sets ACKNOWLEDGE and DRIVER, and accepts the features both sides have of `supported`.
    /// `kind` names the device in errors ("virtio-blk").
    pub fn begin(func: PciFunction, kind: &str, supported: u64) -> Result<Self, VirtioError> {
        func.enable_command(
            outboard_spec::pci::COMMAND_MEMORY | outboard_spec::pci::COMMAND_BUS_MASTER,
        )?;
        let t = Transport::new(&func)?;
        t.reset()?;
        t.add_status(DeviceStatus::ACKNOWLEDGE)?;
        t.add_status(DeviceStatus::DRIVER)?;
        let offered = t.device_features()?;
        let refuse = |why: &str| -> VirtioError {
            let _ = t.add_status(DeviceStatus::FAILED);
            VirtioError::Device(why.into())
        };
        if offered & vfeature::VERSION_1 == 0 {
            return Err(refuse("legacy (pre-1.0) virtio devices are not supported"));
        }
        // Behind an IOMMU the driver hands out IOVAs. A device without ACCESS_PLATFORM (§6.1)
        // takes them for physical addresses and DMAs around the IOMMU: refuse it here, not one
        // timed-out request at a time later.
        if func.behind_iommu() && offered & vfeature::ACCESS_PLATFORM == 0 {
            return Err(refuse(
                "the device does not offer VIRTIO_F_ACCESS_PLATFORM: it would DMA to physical \
                 addresses, bypassing the IOMMU (for QEMU: iommu_platform=on)",
            ));
        }
        let features = match t.negotiate(supported) {
            Ok(f) => f,
            Err(e) => {
                let _ = t.add_status(DeviceStatus::FAILED);
                return Err(e);
            }
        };
        tracing::debug!("{kind}: offered {offered:#x}, accepted {features:#x}");
        Ok(Self {
            func,
            transport: t,
            features,
        })
    }

    /// The features both sides accepted.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// The transport, for the device part to read its configuration.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// The function (its DMA space, its queue count).
    pub fn function(&self) -> &PciFunction {
        &self.func
    }

    /// Marks the device FAILED (the device part found its configuration unusable).
    pub fn fail(&self) {
        let _ = self.transport.add_status(DeviceStatus::FAILED);
    }

    /// Sets up `queues` queues of at most `max_size` entries (each a power of two no larger
    /// than the device allows) with their interrupt vectors, then sets DRIVER_OK.
    pub fn finish(
        self,
        queues: u16,
        max_size: u16,
    ) -> Result<(VirtioDevice, Vec<VirtQueue>), VirtioError> {
        let Self {
            func,
            transport: t,
            features,
        } = self;
        // Interrupts: MSI-X vector 0 for configuration, 1+q for queue q; otherwise INTx.
        let msix = func.irq_count(IrqKind::MsiX)? > queues as u32;
        let irqs = if msix {
            func.enable_irqs(IrqKind::MsiX, queues as u32 + 1)?
        } else {
            func.enable_irqs(IrqKind::Intx, 1)?
        };
        if msix {
            t.set_config_vector(0)?;
        }
        let mut vqs = Vec::new();
        for q in 0..queues {
            let max = t.queue_max_size(q)?;
            if max == 0 {
                return Err(VirtioError::Device(format!("queue {q} is not available")));
            }
            let size = max.min(max_size);
            let size = if size.is_power_of_two() {
                size
            } else {
                size.next_power_of_two() / 2
            };
            let mut vq = VirtQueue::new(func.dma(), q, size, features)?;
            let (d, a, u) = vq.addresses();
            let vector = if msix { q + 1 } else { NO_VECTOR };
            vq.set_doorbell(t.setup_queue(q, size, d, a, u, vector)?);
            vqs.push(vq);
        }
        t.add_status(DeviceStatus::DRIVER_OK)?;
        Ok((
            VirtioDevice {
                func,
                transport: t,
                irqs,
                msix,
                features,
                stopped: false,
            },
            vqs,
        ))
    }
}

/// A running virtio-pci device: its transport, its vectors, and the device-independent part
/// of the environment's contract.
pub struct VirtioDevice {
    func: PciFunction,
    transport: Transport,
    irqs: Vec<Irq>,
    msix: bool,
    features: u64,
    stopped: bool,
}

impl VirtioDevice {
    /// The features both sides accepted.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Whether MSI-X is in use (else one INTx line carries everything).
    pub fn msix(&self) -> bool {
        self.msix
    }

    /// The PCI function.
    pub fn function(&self) -> &PciFunction {
        &self.func
    }

    /// The transport.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// Resets queue `vq` alone and sets it up again empty, on the same rings and vector
    /// (§2.6.1): every buffer it held is forgotten by the device and by `vq`. Needs
    /// `RING_RESET`.
    pub fn reset_queue(&self, vq: &mut VirtQueue) -> Result<(), VirtioError> {
        if self.features & vfeature::RING_RESET == 0 {
            return Err(VirtioError::Device(
                "this device cannot reset a queue alone (no RING_RESET)".into(),
            ));
        }
        let index = vq.index();
        self.transport.reset_queue(index)?;
        vq.clear()?;
        let (d, a, u) = vq.addresses();
        let vector = if self.msix { index + 1 } else { NO_VECTOR };
        vq.set_doorbell(
            self.transport
                .setup_queue(index, vq.size(), d, a, u, vector)?,
        );
        Ok(())
    }

    /// Whether the device set DEVICE_NEEDS_RESET (virtio 1.2 §2.1.2): it has stopped, and
    /// what it holds will not complete. A trapped register read: call it on the configuration
    /// interrupt, never per request.
    pub fn needs_reset(&self) -> Result<bool, VirtioError> {
        Ok(self
            .transport
            .status()?
            .contains(DeviceStatus::DEVICE_NEEDS_RESET))
    }

    /// Which event each of the function's fds stands for: with MSI-X, vector 0 is
    /// configuration changes and vector `q + 1` is queue `q`; with INTx one vector carries
    /// everything; and the device's loss.
    pub fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        let mut v: Vec<(DeviceEvent, BorrowedFd<'_>)> = self
            .irqs
            .iter()
            .enumerate()
            .map(|(i, irq)| {
                let ev = if self.msix && i == 0 {
                    DeviceEvent::ConfigChange
                } else {
                    DeviceEvent::Interrupt(i as u16)
                };
                (ev, irq.fd())
            })
            .collect();
        if let Some(fd) = self.func.loss_fd() {
            v.push((DeviceEvent::Lost, fd));
        }
        v
    }

    /// The contract's `handle`: acknowledges an interrupt, and reports a device that needs a
    /// reset or is gone.
    pub fn handle(&self, ev: DeviceEvent) -> Result<(), Failure> {
        let check_reset = || match self.needs_reset() {
            Ok(false) => Ok(()),
            Ok(true) => Err(Failure::NeedsReset),
            Err(e) => Err(Failure::Driver(format!("its status cannot be read: {e}"))),
        };
        match ev {
            DeviceEvent::Lost => Err(Failure::Lost),
            DeviceEvent::ConfigChange => {
                if let Some(irq) = self.irqs.first() {
                    irq.ack();
                }
                check_reset()
            }
            DeviceEvent::Interrupt(v) => {
                if let Some(irq) = self.irqs.get(v as usize) {
                    irq.ack();
                }
                if !self.msix {
                    // INTx: reading the ISR acknowledges the interrupt (§4.1.4.5); bit 1 says
                    // the configuration changed.
                    let isr = self
                        .transport
                        .read_isr()
                        .map_err(|e| Failure::Driver(e.to_string()))?;
                    if isr & 2 != 0 {
                        return check_reset();
                    }
                }
                Ok(())
            }
            // A driver's own timers are its own business; the device has none.
            DeviceEvent::Timer(_) => Ok(()),
        }
    }

    /// Resets the device, once: it stops using the driver's memory (§3.3.1: reset, then
    /// free). The driver calls it before its queues and buffers are dropped.
    pub fn stop(&mut self) -> Result<(), VirtioError> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        self.transport.reset()
    }

    /// Gives the device up after a failure ([`outboard_env::Driver::abandon`]) by a reset:
    /// fenced once the device read back reset (it reaches nothing it was given any more),
    /// not before. `who` names the driver in the log.
    pub fn abandon(&mut self, who: &str) -> Fence {
        match self.stop() {
            Ok(()) => Fence::Now,
            Err(e) => {
                tracing::warn!("{who}: reset on abandon failed: {e}");
                Fence::AtReopen
            }
        }
    }
}

impl Drop for VirtioDevice {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!("virtio: reset on teardown failed: {e}");
        }
    }
}
