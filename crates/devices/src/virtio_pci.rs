//! Virtio over PCI, device side (virtio v1.2 §4.1): a modern, non-transitional function.
//!
//! Layout (every device model uses the same one):
//!
//! | where | what | how the driver reaches it |
//! |---|---|---|
//! | BAR0 0x0000 | common configuration | trapped (set-up only) |
//! | BAR0 0x1000 | ISR status | trapped (INTx only) |
//! | BAR0 0x2000 | device configuration | mmapped read-only page (sparse area) |
//! | BAR0 0x3000 + 4·q | queue q notify | ioeventfd per queue (trapped fallback) |
//! | BAR1 0x0000 / 0x0800 | MSI-X table / PBA | trapped |
//!
//! Interrupts are delivered through whatever eventfds the client attached with SET_IRQS: a
//! queue's MSI-X vector if it has one, otherwise the ISR bit plus INTx.

use std::os::fd::{AsFd, OwnedFd};

use outboard_shm::SharedMem;
use outboard_spec::pci;
use outboard_spec::virtio::{self, cap, common, feature, DeviceStatus, NO_VECTOR};
use outboard_vfio_user::wire::{self, region};
use outboard_vfio_user::{DeviceBackend, DeviceContext, DmaMap, IoFdDesc, MmapDesc, RegionDesc};
use rustix::event::EventfdFlags;
use rustix::io::Errno;

use crate::faults::Faults;
use crate::msix::{irq_infos, MsixTable};
use crate::pci_config::{Bar, ConfigBuilder, ConfigSpace, Ids};
use crate::virtqueue::{DeviceQueue, QueueError};

/// BAR0 size.
pub const BAR0_SIZE: u64 = 0x4000;
/// Offset of the common configuration in BAR0.
pub const COMMON_OFFSET: u64 = 0x0000;
/// Offset of the ISR status in BAR0.
pub const ISR_OFFSET: u64 = 0x1000;
/// Offset of the device configuration in BAR0.
pub const DEVICE_OFFSET: u64 = 0x2000;
/// Offset of the notification area in BAR0.
pub const NOTIFY_OFFSET: u64 = 0x3000;
/// Bytes between two queues' notify addresses.
pub const NOTIFY_MULTIPLIER: u32 = 4;
/// BAR1 (MSI-X) size.
pub const BAR1_SIZE: u64 = 0x1000;
/// Offset of the PBA in BAR1.
pub const PBA_OFFSET: u64 = 0x800;

/// What a specific virtio device adds to the transport.
pub trait VirtioDevice: Send {
    /// Virtio device ID (§5).
    fn device_id(&self) -> u16;
    /// The device's fault-injection handle, shared with its transport.
    fn faults(&self) -> crate::faults::FaultHandle;
    /// PCI class code for the function.
    fn class(&self) -> u32;
    /// Feature bits offered (the transport adds VERSION_1).
    fn features(&self) -> u64;
    /// Number of virtqueues.
    fn num_queues(&self) -> u16;
    /// Largest queue size offered.
    fn max_queue_size(&self) -> u16 {
        256
    }
    /// Device configuration bytes.
    fn config(&self) -> Vec<u8>;
    /// Negotiation finished and DRIVER_OK was set.
    fn activate(&mut self, features: u64);
    /// Back to power-on state.
    fn reset(&mut self);
    /// Serves every chain available on queue `index`. Errors mean the queue is broken.
    fn process(
        &mut self,
        index: u16,
        queue: &mut DeviceQueue,
        dma: &DmaMap,
    ) -> Result<(), QueueError>;
    /// Descriptors the device reads input from itself (a NIC's wire): polled for it.
    fn input_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        Vec::new()
    }
    /// Input descriptor `id` is readable: the device takes what came (into a backlog of its
    /// own) and says which queues to serve now and whether its configuration changed.
    fn input(&mut self, _id: usize) -> Arrived {
        Arrived::default()
    }
    /// Work the device found while serving a queue that the transport must act on (a NIC
    /// that read frames from its wire while waiting to send): queues to serve, a
    /// configuration change. Asked after every notification and input.
    fn deferred(&mut self) -> Arrived {
        Arrived::default()
    }
    /// How the driver asked the device to coalesce queue `q`'s used-buffer notifications
    /// (a NIC's `VIRTIO_NET_CTRL_NOTF_COAL`); the transport holds them accordingly.
    fn coalescing(&self, _q: u16) -> Coalescing {
        Coalescing::default()
    }
    /// Whether one queue may be reset alone (`VIRTIO_F_RING_RESET`, §2.6.1): true only for a
    /// device that holds no chain of a queue between calls to [`VirtioDevice::process`], so
    /// that forgetting the queue's rings forgets everything of it.
    fn ring_reset(&self) -> bool {
        false
    }
}

/// Notification coalescing for one queue: a used-buffer notification waits until `max_packets`
/// buffers were used or `usecs` passed since the first one held, whichever comes first. All
/// zero (the default): every notification at once.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Coalescing {
    /// Buffers used before a notification goes anyway (0: no count).
    pub max_packets: u32,
    /// Microseconds a notification may wait (0: none).
    pub usecs: u32,
}

/// Notifications the transport holds back, per queue (see [`Coalescing`]).
#[derive(Debug, Default)]
struct Held {
    /// Used buffers not yet notified, per queue.
    used: Vec<u32>,
    /// When each queue's held notification goes at the latest.
    due: Vec<Option<std::time::Instant>>,
    /// Fires at the earliest `due` (made when first needed).
    timer: Option<outboard_sys::timer::Timer>,
}

/// What input from outside asks of the transport (see [`VirtioDevice::input`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Arrived {
    /// Queues to serve now (a NIC's receive queue, with frames waiting for buffers).
    pub queues: Vec<u16>,
    /// The device configuration changed (a link went up or down): the driver is told with a
    /// configuration interrupt.
    pub config_changed: bool,
}

#[derive(Debug, Clone)]
struct QueueRegs {
    size: u16,
    msix_vector: u16,
    enabled: bool,
    desc: u64,
    driver: u64,
    device: u64,
    live: Option<DeviceQueue>,
    /// Reset alone (`queue_reset` reads 1) and not enabled again since.
    reset: bool,
}

/// Counters a test or `outboard hw probe` may look at.
#[derive(Debug, Default, Clone, Copy)]
pub struct TransportStats {
    /// Queue notifications received (ioeventfd or trapped).
    pub notifications: u64,
    /// Interrupts raised.
    pub interrupts: u64,
    /// Interrupts suppressed by the driver (EVENT_IDX / NO_INTERRUPT).
    pub suppressed: u64,
    /// Injected faults that fired.
    pub faults_fired: u64,
}

/// A virtio device behind the PCI transport; implements [`DeviceBackend`].
pub struct VirtioPci<D: VirtioDevice> {
    dev: D,
    cfg: ConfigSpace,
    pci_cfg_cap: u8,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    status: u8,
    config_msix_vector: u16,
    queue_select: u16,
    queues: Vec<QueueRegs>,
    isr: u8,
    notify: Vec<OwnedFd>,
    devcfg: SharedMem,
    msix: MsixTable,
    stats: TransportStats,
    faults: crate::faults::FaultHandle,
    /// Changes whenever the device configuration does (§4.1.4.3), so a driver reading it in
    /// pieces knows it read one version.
    config_generation: u8,
    /// Notifications held back by coalescing.
    held: Held,
}

impl<D: VirtioDevice> VirtioPci<D> {
    /// Wraps `dev` in the transport.
    pub fn new(dev: D) -> std::io::Result<Self> {
        let dev_faults = dev.faults();
        let nq = dev.num_queues();
        let vectors = nq + 1;
        let ids = Ids {
            vendor: virtio::PCI_VENDOR_ID,
            device: virtio::PCI_DEVICE_ID_BASE + dev.device_id(),
            subsystem_vendor: virtio::PCI_VENDOR_ID,
            subsystem: 0x1100,
            class: dev.class(),
            revision: 1,
        };
        let msix_body = MsixTable::capability_body(vectors, PBA_OFFSET);
        let vcap = |cfg_type: u8, bar: u8, offset: u64, length: u32, extra: &[u8]| {
            let len = cap::SIZE + extra.len() as u8;
            let mut b = vec![len, cfg_type, bar, 0, 0, 0];
            b.extend_from_slice(&(offset as u32).to_le_bytes());
            b.extend_from_slice(&length.to_le_bytes());
            b.extend_from_slice(extra);
            b
        };
        let b = ConfigBuilder::new(ids)
            .bar(Bar {
                index: 0,
                size: BAR0_SIZE,
            })
            .bar(Bar {
                index: 1,
                size: BAR1_SIZE,
            });
        let (b, _) = b.capability(pci::CAP_ID_MSIX, &msix_body, &[(1, 0xc0)]);
        let (b, _) = b.capability(
            pci::CAP_ID_VENDOR,
            &vcap(
                cap::COMMON_CFG,
                0,
                COMMON_OFFSET,
                common::SIZE_V1_2 as u32,
                &[],
            ),
            &[],
        );
        let (b, _) = b.capability(
            pci::CAP_ID_VENDOR,
            &vcap(
                cap::NOTIFY_CFG,
                0,
                NOTIFY_OFFSET,
                NOTIFY_MULTIPLIER * nq as u32,
                &NOTIFY_MULTIPLIER.to_le_bytes(),
            ),
            &[],
        );
        let (b, _) = b.capability(
            pci::CAP_ID_VENDOR,
            &vcap(cap::ISR_CFG, 0, ISR_OFFSET, 1, &[]),
            &[],
        );
        let devcfg_len = dev.config().len() as u32;
        let (b, _) = b.capability(
            pci::CAP_ID_VENDOR,
            &vcap(cap::DEVICE_CFG, 0, DEVICE_OFFSET, devcfg_len, &[]),
            &[],
        );
        // VIRTIO_PCI_CAP_PCI_CFG: bar, offset, length and data are writable (§4.1.4.9).
        let (b, pci_cfg_cap) = b.capability(
            pci::CAP_ID_VENDOR,
            &vcap(cap::PCI_CFG, 0, 0, 0, &[0; 4]),
            &[
                (2, 0xff),
                (6, 0xff),
                (7, 0xff),
                (8, 0xff),
                (9, 0xff),
                (10, 0xff),
                (11, 0xff),
                (12, 0xff),
                (13, 0xff),
            ],
        );
        let notify = (0..nq)
            .map(|_| {
                rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
                    .map_err(std::io::Error::from)
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        let devcfg = SharedMem::create("virtio-devcfg", (DEVICE_OFFSET + 0x1000) as usize)
            .map_err(std::io::Error::other)?;
        let mut t = Self {
            cfg: b.build(),
            pci_cfg_cap,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            config_msix_vector: NO_VECTOR,
            queue_select: 0,
            queues: Vec::new(),
            isr: 0,
            notify,
            devcfg,
            msix: MsixTable::new(vectors, PBA_OFFSET),
            stats: TransportStats::default(),
            faults: dev_faults,
            config_generation: 0,
            held: Held::default(),
            dev,
        };
        t.reset_transport();
        Ok(t)
    }

    /// The device model.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The device model, mutably (fault injection).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    /// Counters.
    pub fn stats(&self) -> TransportStats {
        self.stats
    }

    fn offered(&self) -> u64 {
        let ring_reset = match self.dev.ring_reset() {
            true => feature::RING_RESET,
            false => 0,
        };
        self.dev.features() | feature::VERSION_1 | ring_reset
    }

    /// Queue `sel` as it is after a reset: its defaults, no rings, nothing held.
    fn queue_defaults(&self) -> QueueRegs {
        QueueRegs {
            size: self.dev.max_queue_size(),
            msix_vector: NO_VECTOR,
            enabled: false,
            desc: 0,
            driver: 0,
            device: 0,
            live: None,
            reset: false,
        }
    }

    fn reset_transport(&mut self) {
        self.held.used.clear();
        self.held.due.clear();
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.driver_features = 0;
        self.status = 0;
        self.config_msix_vector = NO_VECTOR;
        self.queue_select = 0;
        self.isr = 0;
        self.queues = vec![self.queue_defaults(); self.dev.num_queues() as usize];
        self.dev.reset();
        self.publish_config();
    }

    /// Refreshes the mmapped device-configuration page from the model.
    fn publish_config(&self) {
        let c = self.dev.config();
        let _ = self.devcfg.write(DEVICE_OFFSET, &c);
    }

    fn raise(&mut self, ctx: &mut DeviceContext, vector: u16, isr_bit: u8) {
        let times = {
            let mut f = crate::faults::lock(&self.faults);
            if Faults::spend(&mut f.drop_irqs) {
                0
            } else if Faults::spend(&mut f.duplicate_irqs) {
                2
            } else {
                1
            }
        };
        if times != 1 {
            self.stats.faults_fired += 1;
        }
        for _ in 0..times {
            self.stats.interrupts += 1;
            if vector != NO_VECTOR && ctx.irqs.trigger(wire::irq::MSIX, vector as u32) {
                continue;
            }
            self.isr |= isr_bit;
            ctx.irqs.trigger(wire::irq::INTX, 0);
        }
    }

    /// Fires the faults armed for a notification of queue `q`; false if the device must not
    /// process it (it now needs a reset).
    fn notification_faults(&mut self, ctx: &mut DeviceContext, q: u16) -> bool {
        let (crash, stall, reset, spurious, corrupt) = {
            let mut f = crate::faults::lock(&self.faults);
            (
                f.crash,
                f.stall.take(),
                std::mem::take(&mut f.needs_reset),
                std::mem::take(&mut f.spurious_irqs),
                f.corrupt_used.take(),
            )
        };
        if crash {
            tracing::error!("fault injection: the device model crashes");
            std::process::abort();
        }
        if let Some(d) = stall {
            self.stats.faults_fired += 1;
            tracing::warn!("fault injection: the device stalls for {d:?}");
            std::thread::sleep(d);
        }
        let vector = self
            .queues
            .get(q as usize)
            .map_or(NO_VECTOR, |r| r.msix_vector);
        for _ in 0..spurious {
            self.stats.faults_fired += 1;
            self.raise(ctx, vector, virtio::isr::QUEUE);
        }
        if let Some(c) = corrupt {
            match self
                .queues
                .get_mut(q as usize)
                .and_then(|r| r.live.as_mut())
            {
                Some(queue) => {
                    self.stats.faults_fired += 1;
                    queue.corrupt_next_used(c);
                }
                // Not armed yet: keep it for a live queue.
                None => crate::faults::lock(&self.faults).corrupt_used = Some(c),
            }
        }
        if reset {
            self.stats.faults_fired += 1;
            self.needs_reset(ctx, &QueueError::Layout("fault injection".into()));
            return false;
        }
        true
    }

    fn needs_reset(&mut self, ctx: &mut DeviceContext, why: &QueueError) {
        tracing::warn!("virtio device needs reset: {why}");
        self.status |= DeviceStatus::DEVICE_NEEDS_RESET.bits();
        let v = self.config_msix_vector;
        self.raise(ctx, v, virtio::isr::CONFIG);
    }

    /// The driver notified queue `q`: runs it until the driver has nothing more for it.
    fn kick(&mut self, ctx: &mut DeviceContext, q: u16) {
        self.stats.notifications += 1;
        if !self.notification_faults(ctx, q) {
            return;
        }
        self.serve(ctx, q);
        self.catch_up(ctx);
    }

    /// Acts on the work the device deferred while it served (a few rounds at most: serving
    /// may find more, and the rest waits for the next event).
    fn catch_up(&mut self, ctx: &mut DeviceContext) {
        for _ in 0..4 {
            let a = self.dev.deferred();
            if a == Arrived::default() {
                return;
            }
            self.arrived(ctx, a);
        }
    }

    /// Input came from outside: the device's configuration may have changed, and queues may
    /// have work (frames waiting for receive buffers).
    fn arrived(&mut self, ctx: &mut DeviceContext, a: Arrived) {
        if a.config_changed {
            self.config_generation = self.config_generation.wrapping_add(1);
            self.publish_config();
            if self.status & DeviceStatus::DRIVER_OK.bits() != 0 {
                let v = self.config_msix_vector;
                self.raise(ctx, v, virtio::isr::CONFIG);
            }
        }
        for q in a.queues {
            self.serve(ctx, q);
        }
    }

    /// Runs queue `q` until it has nothing more to do, raising its interrupt as the driver
    /// asked.
    fn serve(&mut self, ctx: &mut DeviceContext, q: u16) {
        if self.status & DeviceStatus::DRIVER_OK.bits() == 0
            || self.status & DeviceStatus::DEVICE_NEEDS_RESET.bits() != 0
        {
            return;
        }
        let Some(mut queue) = self.queues.get_mut(q as usize).and_then(|r| r.live.take()) else {
            return;
        };
        let vector = self.queues[q as usize].msix_vector;
        // Passes in a row that used nothing: a queue may keep chains available that the
        // device leaves for later (a NIC's receive buffers wait for frames), so "more are
        // available" means more work only while passes use something. One idle pass more is
        // run after notifications are back on, for chains that came meanwhile unannounced.
        let mut idle = 0;
        let result = loop {
            let old = queue.used_idx();
            if let Err(e) = self.dev.process(q, &mut queue, &ctx.dma) {
                break Err(e);
            }
            if queue.used_idx() != old {
                idle = 0;
                match queue.should_notify(&ctx.dma, old) {
                    Ok(true) => {
                        let used = queue.used_idx().wrapping_sub(old);
                        self.notify_used(ctx, q, vector, u32::from(used));
                    }
                    Ok(false) => self.stats.suppressed += 1,
                    Err(e) => break Err(e),
                }
            } else {
                idle += 1;
            }
            match queue.enable_notifications(&ctx.dma) {
                Ok(true) if idle < 2 => continue,
                Ok(_) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        match result {
            Ok(()) => self.queues[q as usize].live = Some(queue),
            Err(e) => self.needs_reset(ctx, &e),
        }
    }

    /// Queue `q` used `used` buffers and the driver wants to hear of it: now, or once its
    /// coalescing says (enough buffers, or the hold-off over: the transport's timer).
    fn notify_used(&mut self, ctx: &mut DeviceContext, q: u16, vector: u16, used: u32) {
        let c = self.dev.coalescing(q);
        let qi = q as usize;
        if c == Coalescing::default() {
            return self.raise(ctx, vector, virtio::isr::QUEUE);
        }
        let h = &mut self.held;
        if h.used.len() <= qi {
            h.used.resize(qi + 1, 0);
            h.due.resize(qi + 1, None);
        }
        h.used[qi] = h.used[qi].saturating_add(used);
        let enough = c.max_packets > 0 && h.used[qi] >= c.max_packets;
        if enough || c.usecs == 0 && c.max_packets <= 1 {
            h.used[qi] = 0;
            h.due[qi] = None;
            return self.raise(ctx, vector, virtio::isr::QUEUE);
        }
        if c.usecs == 0 {
            // A count alone: the notification waits for it (as the device was asked).
            return;
        }
        if h.due[qi].is_none() {
            let due = std::time::Instant::now() + std::time::Duration::from_micros(c.usecs.into());
            h.due[qi] = Some(due);
            self.arm_hold_timer();
        }
    }

    /// Arms the hold-off timer for the earliest held notification.
    fn arm_hold_timer(&mut self) {
        let Some(first) = self.held.due.iter().flatten().min().copied() else {
            if let Some(t) = self.held.timer.as_mut() {
                let _ = t.disarm();
            }
            return;
        };
        if self.held.timer.is_none() {
            match outboard_sys::timer::Timer::new() {
                Ok(t) => self.held.timer = Some(t),
                Err(e) => {
                    // No timer: nothing may wait, so nothing is held.
                    tracing::warn!("virtio: coalescing without a timer: {e}");
                    self.held.due.iter_mut().for_each(|d| *d = Some(first));
                    return;
                }
            }
        }
        if let Some(t) = self.held.timer.as_mut() {
            let _ = t.arm_at(first);
        }
    }

    /// The hold-off timer fired: every held notification that is due goes now.
    fn hold_off_over(&mut self, ctx: &mut DeviceContext) {
        if let Some(t) = self.held.timer.as_mut() {
            t.ack();
        }
        let now = std::time::Instant::now();
        for qi in 0..self.held.due.len() {
            if self.held.due[qi].is_some_and(|d| d <= now) {
                self.held.due[qi] = None;
                self.held.used[qi] = 0;
                let vector = self.queues.get(qi).map_or(NO_VECTOR, |r| r.msix_vector);
                self.raise(ctx, vector, virtio::isr::QUEUE);
            }
        }
        self.arm_hold_timer();
    }

    fn common_read(&self, offset: u64, buf: &mut [u8]) {
        let q = self.queues.get(self.queue_select as usize);
        let nq = self.queues.len() as u16;
        let features = self.offered();
        let sel = self.device_feature_select;
        let val: u64 = match offset {
            common::DEVICE_FEATURE_SELECT => sel as u64,
            common::DEVICE_FEATURE => match sel {
                0 => features & 0xffff_ffff,
                1 => features >> 32,
                _ => 0,
            },
            common::DRIVER_FEATURE_SELECT => self.driver_feature_select as u64,
            common::DRIVER_FEATURE => match self.driver_feature_select {
                0 => self.driver_features & 0xffff_ffff,
                1 => self.driver_features >> 32,
                _ => 0,
            },
            common::CONFIG_MSIX_VECTOR => self.config_msix_vector as u64,
            common::NUM_QUEUES => nq as u64,
            common::DEVICE_STATUS => self.status as u64,
            common::CONFIG_GENERATION => self.config_generation as u64,
            common::QUEUE_SELECT => self.queue_select as u64,
            common::QUEUE_SIZE => q.map_or(0, |q| q.size as u64),
            common::QUEUE_MSIX_VECTOR => q.map_or(NO_VECTOR as u64, |q| q.msix_vector as u64),
            common::QUEUE_ENABLE => q.map_or(0, |q| q.enabled as u64),
            common::QUEUE_NOTIFY_OFF => self.queue_select as u64,
            common::QUEUE_DESC => q.map_or(0, |q| q.desc),
            common::QUEUE_DRIVER => q.map_or(0, |q| q.driver),
            common::QUEUE_DEVICE => q.map_or(0, |q| q.device),
            common::QUEUE_NOTIFY_DATA => 0,
            common::QUEUE_RESET => q.map_or(0, |q| q.reset as u64),
            // The upper halves of the 64-bit fields, for drivers that access them as two dwords.
            o if o == common::QUEUE_DESC + 4 => q.map_or(0, |q| q.desc >> 32),
            o if o == common::QUEUE_DRIVER + 4 => q.map_or(0, |q| q.driver >> 32),
            o if o == common::QUEUE_DEVICE + 4 => q.map_or(0, |q| q.device >> 32),
            _ => 0,
        };
        let bytes = val.to_le_bytes();
        let n = buf.len().min(8);
        buf[..n].copy_from_slice(&bytes[..n]);
    }

    fn common_write(
        &mut self,
        ctx: &mut DeviceContext,
        offset: u64,
        data: &[u8],
    ) -> Result<(), Errno> {
        let mut b = [0u8; 8];
        let n = data.len().min(8);
        b[..n].copy_from_slice(&data[..n]);
        let v = u64::from_le_bytes(b);
        let sel = self.queue_select as usize;
        let live = self.queues.get(sel).is_some_and(|q| q.enabled);
        let set_half = |field: &mut u64, high: bool| {
            if n == 8 {
                *field = v;
            } else if high {
                *field = (*field & 0xffff_ffff) | (v << 32);
            } else {
                *field = (*field & !0xffff_ffff) | (v & 0xffff_ffff);
            }
        };
        match offset {
            common::DEVICE_FEATURE_SELECT => self.device_feature_select = v as u32,
            common::DRIVER_FEATURE_SELECT => self.driver_feature_select = v as u32,
            common::DRIVER_FEATURE => {
                if self.status & DeviceStatus::FEATURES_OK.bits() != 0 {
                    return Err(Errno::PERM);
                }
                match self.driver_feature_select {
                    0 => {
                        self.driver_features =
                            (self.driver_features & !0xffff_ffff) | (v & 0xffff_ffff)
                    }
                    1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (v << 32),
                    _ => {}
                }
            }
            common::CONFIG_MSIX_VECTOR => self.config_msix_vector = v as u16,
            common::DEVICE_STATUS => self.write_status(ctx, v as u8),
            common::QUEUE_SELECT => self.queue_select = v as u16,
            common::QUEUE_SIZE
            | common::QUEUE_MSIX_VECTOR
            | common::QUEUE_DESC
            | common::QUEUE_DRIVER
            | common::QUEUE_DEVICE
                if live =>
            {
                // §4.1.4.3.2: queue registers may not change while the queue is enabled.
                return Err(Errno::BUSY);
            }
            o if sel >= self.queues.len()
                && (common::QUEUE_SIZE..common::SIZE_V1_2).contains(&o) =>
            {
                return Err(Errno::INVAL)
            }
            common::QUEUE_SIZE => {
                let max = self.dev.max_queue_size();
                self.queues[sel].size = (v as u16).min(max);
            }
            common::QUEUE_MSIX_VECTOR => self.queues[sel].msix_vector = v as u16,
            common::QUEUE_ENABLE => {
                if v == 1 && !live {
                    self.enable_queue(ctx, sel);
                }
            }
            common::QUEUE_RESET => {
                // §4.1.4.3: only with RING_RESET, and only 1 means anything. The queue
                // forgets its rings and every chain in them (the device held none between
                // calls: `VirtioDevice::ring_reset`), takes its defaults, and reads 1 until it
                // is enabled again.
                if self.driver_features & feature::RING_RESET == 0 || v != 1 {
                    return Err(Errno::INVAL);
                }
                self.queues[sel] = QueueRegs {
                    reset: true,
                    ..self.queue_defaults()
                };
                if let Some(u) = self.held.used.get_mut(sel) {
                    *u = 0;
                }
                if let Some(d) = self.held.due.get_mut(sel) {
                    *d = None;
                }
            }
            common::QUEUE_DESC => set_half(&mut self.queues[sel].desc, false),
            common::QUEUE_DRIVER => set_half(&mut self.queues[sel].driver, false),
            common::QUEUE_DEVICE => set_half(&mut self.queues[sel].device, false),
            o if o == common::QUEUE_DESC + 4 => set_half(&mut self.queues[sel].desc, true),
            o if o == common::QUEUE_DRIVER + 4 => set_half(&mut self.queues[sel].driver, true),
            o if o == common::QUEUE_DEVICE + 4 => set_half(&mut self.queues[sel].device, true),
            _ => return Err(Errno::INVAL),
        }
        Ok(())
    }

    fn enable_queue(&mut self, ctx: &mut DeviceContext, sel: usize) {
        let q = &self.queues[sel];
        let built = DeviceQueue::new(q.size, q.desc, q.driver, q.device, self.driver_features)
            .and_then(|dq| dq.check_rings(&ctx.dma).map(|()| dq));
        match built {
            Ok(dq) => {
                self.queues[sel].live = Some(dq);
                self.queues[sel].enabled = true;
                self.queues[sel].reset = false;
            }
            Err(e) => self.needs_reset(ctx, &e),
        }
    }

    fn write_status(&mut self, ctx: &mut DeviceContext, v: u8) {
        if v == 0 {
            self.reset_transport();
            return;
        }
        let mut v = v;
        let newly = v & !self.status;
        if newly & DeviceStatus::FEATURES_OK.bits() != 0 {
            let ok = self.driver_features & !self.offered() == 0
                && self.driver_features & feature::VERSION_1 != 0;
            if !ok {
                tracing::warn!(
                    "driver features {:#x} rejected (offered {:#x})",
                    self.driver_features,
                    self.offered()
                );
                v &= !DeviceStatus::FEATURES_OK.bits();
            }
        }
        if newly & DeviceStatus::DRIVER_OK.bits() != 0 {
            self.dev.activate(self.driver_features);
        }
        // NEEDS_RESET is the device's to set; the driver cannot clear it except by reset.
        self.status = v | (self.status & DeviceStatus::DEVICE_NEEDS_RESET.bits());
        let _ = ctx;
    }

    fn bar0_read(&mut self, offset: u64, buf: &mut [u8]) {
        buf.fill(0);
        match offset {
            o if o < COMMON_OFFSET + common::SIZE_V1_2 => self.common_read(o - COMMON_OFFSET, buf),
            ISR_OFFSET => {
                // Reading the ISR clears it (§4.1.4.5).
                if let Some(b) = buf.first_mut() {
                    *b = std::mem::take(&mut self.isr);
                }
            }
            o if (DEVICE_OFFSET..NOTIFY_OFFSET).contains(&o) => {
                let _ = self.devcfg.read(o, buf);
            }
            _ => {}
        }
    }

    fn bar0_write(
        &mut self,
        ctx: &mut DeviceContext,
        offset: u64,
        data: &[u8],
    ) -> Result<(), Errno> {
        match offset {
            o if o < COMMON_OFFSET + common::SIZE_V1_2 => {
                self.common_write(ctx, o - COMMON_OFFSET, data)
            }
            o if o >= NOTIFY_OFFSET
                && (o - NOTIFY_OFFSET).is_multiple_of(NOTIFY_MULTIPLIER as u64) =>
            {
                let q = ((o - NOTIFY_OFFSET) / NOTIFY_MULTIPLIER as u64) as u16;
                if (q as usize) < self.queues.len() {
                    self.kick(ctx, q);
                }
                Ok(())
            }
            // Device configuration of a block device is read-only; other writes are ignored.
            _ => Ok(()),
        }
    }

    /// Access through the VIRTIO_PCI_CAP_PCI_CFG window (§4.1.4.9).
    fn pci_cfg_window(&mut self, ctx: &mut DeviceContext, write: Option<&[u8]>) -> Vec<u8> {
        let c = self.pci_cfg_cap as u64;
        let bar = {
            let mut b = [0u8; 1];
            self.cfg.read(c + cap::BAR, &mut b);
            b[0]
        };
        let off = self.cfg.read32(c + cap::OFFSET) as u64;
        let len = (self.cfg.read32(c + cap::LENGTH) as usize).min(4);
        if bar != 0 || len == 0 || off + len as u64 > BAR0_SIZE {
            return vec![0; 4];
        }
        match write {
            Some(d) => {
                let _ = self.bar0_write(ctx, off, &d[..len.min(d.len())]);
                vec![]
            }
            None => {
                let mut b = vec![0u8; len];
                self.bar0_read(off, &mut b);
                b.resize(4, 0);
                b
            }
        }
    }
}

impl<D: VirtioDevice> DeviceBackend for VirtioPci<D> {
    fn regions(&self) -> Vec<RegionDesc<'_>> {
        let rw = region::FLAG_READ | region::FLAG_WRITE;
        vec![
            RegionDesc {
                index: region::BAR0,
                size: BAR0_SIZE,
                flags: rw,
                mmap: Some(MmapDesc {
                    fd: self.devcfg.fd().expect("devcfg memfd"),
                    offset: 0,
                    areas: vec![wire::SparseArea {
                        offset: DEVICE_OFFSET,
                        size: 0x1000,
                    }],
                }),
            },
            RegionDesc {
                index: region::BAR0 + 1,
                size: BAR1_SIZE,
                flags: rw,
                mmap: None,
            },
            RegionDesc {
                index: region::CONFIG,
                size: pci::CONFIG_SPACE_SIZE as u64,
                flags: rw,
                mmap: None,
            },
        ]
    }

    fn irqs(&self) -> Vec<wire::IrqInfo> {
        irq_infos(self.queues.len() as u32 + 1)
    }

    fn region_read(
        &mut self,
        _ctx: &mut DeviceContext,
        index: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), Errno> {
        match index {
            region::BAR0 => self.bar0_read(offset, buf),
            i if i == region::BAR0 + 1 => self.msix.read(offset, buf),
            region::CONFIG => {
                let c = self.pci_cfg_cap as u64 + cap::PCI_CFG_DATA;
                if offset >= c && offset < c + 4 {
                    let window = self.pci_cfg_window(_ctx, None);
                    for (i, b) in buf.iter_mut().enumerate() {
                        *b = window.get((offset - c) as usize + i).copied().unwrap_or(0);
                    }
                } else {
                    self.cfg.read(offset, buf);
                }
            }
            _ => return Err(Errno::INVAL),
        }
        Ok(())
    }

    fn region_write(
        &mut self,
        ctx: &mut DeviceContext,
        index: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), Errno> {
        match index {
            region::BAR0 => self.bar0_write(ctx, offset, data),
            i if i == region::BAR0 + 1 => {
                self.msix.write(offset, data);
                Ok(())
            }
            region::CONFIG => {
                let c = self.pci_cfg_cap as u64 + cap::PCI_CFG_DATA;
                if offset >= c && offset < c + 4 {
                    self.pci_cfg_window(ctx, Some(data));
                } else {
                    self.cfg.write(offset, data);
                }
                Ok(())
            }
            _ => Err(Errno::INVAL),
        }
    }

    fn io_fds(&self, index: u32) -> Vec<IoFdDesc<'_>> {
        if index != region::BAR0 {
            return Vec::new();
        }
        self.notify
            .iter()
            .enumerate()
            .map(|(q, fd)| IoFdDesc {
                offset: NOTIFY_OFFSET + q as u64 * NOTIFY_MULTIPLIER as u64,
                size: 0,
                fd: fd.as_fd(),
                datamatch: None,
            })
            .collect()
    }

    fn event_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        self.notify.iter().map(|f| f.as_fd()).collect()
    }

    fn event(&mut self, ctx: &mut DeviceContext, id: usize) {
        self.kick(ctx, id as u16);
    }

    fn input_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        // The transport's hold-off timer first (once made it stays), then the device's own:
        // an input's id then says whose it is without asking the device for its list.
        let mut v: Vec<_> = self
            .held
            .timer
            .as_ref()
            .map(|t| t.fd())
            .into_iter()
            .collect();
        v.extend(self.dev.input_fds());
        v
    }

    fn input(&mut self, ctx: &mut DeviceContext, id: usize) {
        // A timer made during this round shifts the ids gathered before it by one: that
        // round's device input is then taken as the timer (which raises only what is due)
        // and the device's descriptor, still readable, is served in the next round.
        let id = match (self.held.timer.is_some(), id) {
            (true, 0) => return self.hold_off_over(ctx),
            (true, i) => i - 1,
            (false, i) => i,
        };
        let a = self.dev.input(id);
        self.arrived(ctx, a);
        self.catch_up(ctx);
    }

    fn before_unmap(&mut self, ctx: &mut DeviceContext, iova: u64, size: u64) {
        // A queue whose rings disappear cannot continue; the driver is expected to reset first.
        let end = iova + size;
        let in_use = self.queues.iter().any(|q| {
            q.live.is_some()
                && [q.desc, q.driver, q.device]
                    .iter()
                    .any(|&a| a >= iova && a < end)
        });
        if in_use {
            self.needs_reset(ctx, &QueueError::Layout("ring memory was unmapped".into()));
            for q in &mut self.queues {
                q.live = None;
            }
        }
    }

    fn reset(&mut self, _ctx: &mut DeviceContext) {
        self.cfg.reset();
        self.msix.reset();
        self.reset_transport();
    }
}
