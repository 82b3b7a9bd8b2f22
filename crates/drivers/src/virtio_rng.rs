//! Native virtio-rng driver (virtio v1.2 §5.4), work-loop model: the entropy class's driver.
//!
//! One queue (`requestq`): each request is one device-writable buffer — a piece of the
//! client's buffer area, by device address, so the bytes land where the client reads them (no
//! copy) — and its completion is the number of bytes the device wrote. The device part is
//! all there is here; bring-up, interrupts and needs-reset are the generic virtio code's
//! ([`crate::virtio::device`]).

use std::os::fd::BorrowedFd;

use outboard_env::{AnyDriver, DeviceEvent, Driver, Failure, Fence};
use outboard_hw::{PciFunction, PciIdentity};
use outboard_rng::{EntropyDriver, EntropyError, EntropyInfo};
use outboard_spec::virtio::{self, feature as vfeature};

use crate::personality::{Identity, Personality, Probe, Provider, StartError, StartOptions};
use crate::virtio::{Buf, Negotiation, VirtQueue, VirtioDevice, VirtioError};

/// Largest queue the driver sets up.
pub const MAX_QUEUE_SIZE: u16 = 64;
/// Most bytes one request asks for.
pub const MAX_READ: u32 = 64 << 10;
/// Features the driver accepts.
pub const SUPPORTED_FEATURES: u64 =
    vfeature::VERSION_1 | vfeature::ACCESS_PLATFORM | vfeature::RING_EVENT_IDX;

/// Whether `id` is a virtio entropy device (modern or transitional).
pub fn matches(id: &PciIdentity) -> bool {
    id.vendor == virtio::PCI_VENDOR_ID
        && (id.device == virtio::PCI_DEVICE_ID_BASE + virtio::DEVICE_ID_ENTROPY
            || (id.device == 0x1005 && id.subsystem == virtio::DEVICE_ID_ENTROPY))
}

/// A request in the device: the tag and how much it asked for.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    tag: u64,
    length: u32,
}

/// The driver for one virtio-rng function.
pub struct VirtioRng {
    device: VirtioDevice,
    queue: VirtQueue,
    in_flight: Vec<Option<InFlight>>,
    info: EntropyInfo,
}

impl std::fmt::Debug for VirtioRng {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioRng")
            .field("info", &self.info)
            .finish()
    }
}

fn device_error(e: VirtioError) -> EntropyError {
    EntropyError::DeviceFailed(e.to_string())
}

impl VirtioRng {
    /// Brings the device up (§3.1.1 through the generic code; no device configuration).
    pub fn new(name: &str, func: PciFunction) -> Result<Self, VirtioError> {
        if !matches(&func.identity()) {
            return Err(VirtioError::Device(format!(
                "{:04x}:{:04x} is not a virtio-rng device",
                func.identity().vendor,
                func.identity().device
            )));
        }
        let n = Negotiation::begin(func, "virtio-rng", SUPPORTED_FEATURES)?;
        let (device, mut queues) = n.finish(1, MAX_QUEUE_SIZE)?;
        let queue = queues.pop().expect("one queue");
        let size = queue.size();
        Ok(Self {
            device,
            in_flight: vec![None; size as usize],
            info: EntropyInfo {
                name: name.into(),
                max_read: MAX_READ,
                queue_depth: u32::from(size),
            },
            queue,
        })
    }
}

impl VirtioRng {
    /// The PCI function (for its DMA space).
    pub fn function(&self) -> &PciFunction {
        self.device.function()
    }
}

impl Driver for VirtioRng {
    fn driver_name(&self) -> &'static str {
        "virtio-rng"
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        self.device.sources()
    }

    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure> {
        self.device.handle(event)
    }

    fn abandon(&mut self) -> Fence {
        self.device.abandon("virtio-rng")
    }
}

impl EntropyDriver for VirtioRng {
    fn info(&self) -> &EntropyInfo {
        &self.info
    }

    fn has_room(&self) -> bool {
        self.queue.can_add(1)
    }

    fn in_flight(&self) -> usize {
        self.queue.in_flight()
    }

    fn submit(&mut self, iova: u64, length: u32, tag: u64) -> Result<(), EntropyError> {
        if length == 0 || length > MAX_READ {
            return Err(EntropyError::Invalid(format!("{length} bytes")));
        }
        let head = self
            .queue
            .add(&[Buf {
                iova,
                len: length,
                write: true,
            }])
            .map_err(device_error)?
            .ok_or(EntropyError::QueueFull)?;
        self.in_flight[head as usize] = Some(InFlight { tag, length });
        Ok(())
    }

    fn kick(&mut self) -> Result<(), Failure> {
        self.queue
            .publish()
            .map(|_| ())
            .map_err(|e| Failure::Driver(e.to_string()))
    }

    fn poll(&mut self, out: &mut Vec<(u64, Result<u32, EntropyError>)>) -> Result<usize, Failure> {
        let mut n = 0;
        while let Some((head, len)) = self
            .queue
            .pop_used()
            .map_err(|e| Failure::Driver(e.to_string()))?
        {
            let f = self
                .in_flight
                .get_mut(head as usize)
                .and_then(Option::take)
                .ok_or_else(|| Failure::Driver(format!("completion for idle slot {head}")))?;
            // §5.4.6.1: at least one byte. More than the buffer holds is the device lying
            // about what it wrote: the request fails rather than hand back what is not its.
            let result = match len {
                0 => Err(EntropyError::Io(
                    "the device wrote 0 bytes (virtio 1.2 §5.4.6.1 asks for at least one)".into(),
                )),
                n if n > f.length => Err(EntropyError::Protocol(format!(
                    "the device reports {n} bytes written into a buffer of {}",
                    f.length
                ))),
                n => Ok(n),
            };
            out.push((f.tag, result));
            n += 1;
        }
        Ok(n)
    }

    fn arm(&mut self) -> Result<bool, Failure> {
        self.queue
            .enable_interrupts()
            .map_err(|e| Failure::Driver(e.to_string()))
    }
}

/// The virtio-rng driver's personality: it claims virtio entropy functions that have the
/// modern virtio-pci interface (a transitional one with 100 less).
pub const PERSONALITY: Personality = Personality {
    driver: "virtio-rng",
    class: outboard_rng::CLASS,
    score: 1000,
    matches: |id| matches!(id, Identity::Pci(id) if matches(id)),
    probe,
    start,
    faults: &[],
    library: None,
};

fn probe(dev: &Probe<'_>, initial: u32) -> Result<u32, String> {
    use outboard_spec::virtio::cap;
    crate::virtio::device::probe_modern(
        dev,
        initial,
        "virtio-rng",
        &[cap::COMMON_CFG, cap::NOTIFY_CFG, cap::ISR_CFG],
        0x1005,
    )
}

fn start(p: Provider, o: &StartOptions) -> Result<Box<dyn AnyDriver>, StartError> {
    let Provider::Pci(f) = p else {
        return Err(StartError::NoMatch(
            "virtio-rng drives PCI functions".into(),
        ));
    };
    let d = VirtioRng::new(&o.name, f).map_err(|e| StartError::Refused(e.to_string()))?;
    Ok(outboard_rng::bind(d))
}
