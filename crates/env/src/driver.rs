//! The driver contract (sDDF's `init`/`notified`/`handle_irq`, I/O Kit's work loop).
//!
//! A driver is built by its personality from a device and a [`DeviceEnv`]; from then on the
//! environment owns the loop. It asks the driver which event sources its device has
//! ([`Driver::sources`]), waits on them together with everything else it serves, and calls
//! [`Driver::handle`] with a typed [`DeviceEvent`] when one fires. A driver answers an event
//! either by doing its work (acknowledging an interrupt, noticing completions) or with the
//! [`Failure`] that the event revealed; the environment then fails or retries the requests the
//! device held. Class-specific operations (a block driver's `submit`, `poll`) are one small
//! trait per class, defined by the class layer on top of this one.

use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

use outboard_hw::{DmaBuf, DmaSpace, PciFunction};
use outboard_shm::SharedMem;

use crate::workloop::{LoopError, WorkLoop};

/// What happened to a driver's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceEvent {
    /// Interrupt vector `n` fired (for INTx, vector 0).
    Interrupt(u16),
    /// The configuration-change interrupt fired: the configuration changed, or the device
    /// reports that it needs a reset.
    ConfigChange,
    /// The device is gone: its model exited or stopped answering.
    Lost,
    /// The driver's own timer `n` expired (a timerfd it listed among its sources: a clock
    /// driver's tick, a watchdog, a retry). The environment waits on it like any source.
    Timer(u16),
}

/// Why a device can no longer serve. Requests it held fail with this, and the environment
/// gives the device up (and may open it again).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// The device set virtio's DEVICE_NEEDS_RESET (or the equivalent): it has stopped.
    #[error("the device needs a reset (it set DEVICE_NEEDS_RESET)")]
    NeedsReset,
    /// The device was lost.
    #[error("the device was lost: its model exited or stopped answering")]
    Lost,
    /// A request stayed in the device past the deadline.
    #[error("the device stalled: a request waited more than {0:?}")]
    Stalled(Duration),
    /// The driver could not talk to the device.
    #[error("{0}")]
    Driver(String),
}

/// What every driver implements, whatever its class.
pub trait Driver: Send {
    /// The driver's name (its personality's).
    fn driver_name(&self) -> &'static str;

    /// The event sources of the device, each with the event it stands for. The environment
    /// registers them when the driver starts and removes them before dropping the driver.
    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)>;

    /// Handles one event. An error means the device failed.
    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure>;

    /// Gives the device up after a failure, without waiting on it: from now on it must not
    /// reach memory it was given (a function reset, a vfio-user connection closed). Says
    /// whether that is certain now: the requests the device held are answered only once it
    /// is, since their clients take their buffers back with the answer.
    fn abandon(&mut self) -> Fence {
        Fence::Now
    }
}

/// Whether a device given up ([`Driver::abandon`]) can still carry out requests it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// It cannot: it was reset, or it never reached memory of its own (a device the driver
    /// server answers for).
    Now,
    /// It may, until it is opened again: a vfio-user model that stalled sees its client leave
    /// only when it wakes, and carries out first what its queues held. Its requests are
    /// answered once it is back (it reset) or given up.
    AtReopen,
}

/// Why the environment could not provide something.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// The work loop or a timer failed.
    #[error(transparent)]
    Loop(#[from] LoopError),
    /// Mapping memory into the device's DMA space failed.
    #[error("cannot map memory for the device: {0}")]
    Dma(#[from] outboard_hw::HwError),
}

/// What the environment holds for one device besides its driver: the device's DMA space, so
/// memory that others own (a session's buffers) is mapped without reaching through the driver.
#[derive(Clone)]
pub struct DeviceEnv {
    dma: Option<DmaSpace>,
}

impl std::fmt::Debug for DeviceEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceEnv")
            .field("dma", &self.dma.is_some())
            .finish()
    }
}

impl DeviceEnv {
    /// The environment of a PCI function: DMA goes through its address space.
    pub fn for_function(f: &PciFunction) -> Self {
        Self {
            dma: Some(f.dma().clone()),
        }
    }

    /// The environment of a virtual device with no DMA (the null device): memory is "mapped"
    /// at address 0 and never reached.
    pub fn virtual_device() -> Self {
        Self { dma: None }
    }

    /// Maps `mem` into the device's DMA space for as long as the returned mapping lives.
    pub fn map(&self, mem: Arc<SharedMem>) -> Result<Mapping, EnvError> {
        match &self.dma {
            Some(dma) => {
                let buf = dma.map_shared(mem)?;
                Ok(Mapping {
                    iova: buf.iova(),
                    _buf: Some(buf),
                })
            }
            None => Ok(Mapping {
                iova: 0,
                _buf: None,
            }),
        }
    }
}

/// Memory mapped into a device's DMA space; dropping it unmaps it.
#[derive(Debug)]
pub struct Mapping {
    iova: u64,
    _buf: Option<DmaBuf>,
}

impl Mapping {
    /// The device address of the memory's first byte.
    pub fn iova(&self) -> u64 {
        self.iova
    }
}

/// Why [`Waiter::wait_and_handle`] stopped early.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The loop itself failed.
    #[error(transparent)]
    Loop(#[from] LoopError),
    /// An event revealed that the device failed.
    #[error(transparent)]
    Failed(#[from] Failure),
}

/// The environment's loop for one driver running on its own (a colocated client, a tool): it
/// waits on the driver's sources and hands each event to the driver.
#[derive(Debug)]
pub struct Waiter {
    work: WorkLoop<DeviceEvent>,
    /// What fired, reused from wait to wait.
    ready: Vec<DeviceEvent>,
}

impl Waiter {
    /// A waiter on `sources` (from [`Driver::sources`]).
    pub fn new(sources: Vec<(DeviceEvent, BorrowedFd<'_>)>) -> Result<Self, LoopError> {
        let mut work = WorkLoop::new()?;
        for (event, fd) in sources {
            work.add_device(fd, event, event)?;
        }
        Ok(Self {
            work,
            ready: Vec::new(),
        })
    }

    /// One descriptor for all the sources: readable when any is (for a thread that waits on
    /// the driver and something else at once).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.work.fd()
    }

    /// Waits up to `timeout` for events and calls `handle` for each (the driver's
    /// [`Driver::handle`]); the first failure ends the wait.
    pub fn wait_and_handle(
        &mut self,
        timeout: Duration,
        mut handle: impl FnMut(DeviceEvent) -> Result<(), Failure>,
    ) -> Result<(), WaitError> {
        self.ready.clear();
        self.work.wait(Some(timeout), &mut self.ready)?;
        for &event in &self.ready {
            handle(event)?;
        }
        Ok(())
    }
}
