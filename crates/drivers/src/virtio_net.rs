//! Native virtio-net driver (virtio v1.2 §5.1): its device part, on the generic virtio code
//! ([`crate::virtio::device`]) for bring-up, interrupts and needs-reset.
//!
//! One receive and one transmit queue. Receive buffers are fixed slots of one DMA area, kept
//! posted: the driver reposts each as soon as its frame is taken, one doorbell per batch.
//! With `MRG_RXBUF` a slot is 2 KiB and a frame may span several (`num_buffers` says how
//! many); without it each slot holds a whole frame of the device's MTU. Transmit copies each frame behind a zeroed
//! header into a slot of its own and publishes a batch with one doorbell; a slot is free again
//! once the device returns its chain.
//!
//! Everything the device writes is checked before it is believed: a used id that is not a
//! posted slot, a length shorter than the header or longer than the buffers, a `num_buffers`
//! of zero or more buffers than came — each is a device error (the frame is dropped and
//! counted), never an out-of-bounds read.
//!
//! Bound to the net class ([`outboard_net::NetDriver`]): a session's frame is transmitted
//! from where the client wrote it (a chain of the zeroed header in the driver's slot and the
//! frame at the client buffer's device address: no copy), and each received frame is shown
//! to the dispatcher from one reused buffer. The chip API (`send`, `recv`) copies, for direct
//! users and tests.

use std::os::fd::BorrowedFd;

use outboard_env::{AnyDriver, DeviceEvent, Driver, Failure, Fence};
use outboard_hw::{DmaBuf, PciFunction, PciIdentity};
use outboard_net::{NetDriver, NetError};
use outboard_spec::virtio::{self, feature as vfeature, net};

use crate::personality::{Identity, Personality, Probe, Provider, StartError, StartOptions};
use crate::virtio::{Buf, Negotiation, VirtQueue, VirtioDevice, VirtioError};

/// Largest queues the driver sets up.
pub const MAX_QUEUE_SIZE: u16 = 256;
/// Bytes of the control queue's buffer: a command, then its ack at [`CTRL_ACK`].
const CTRL_AREA: usize = 64;
/// Where the device writes a command's ack.
const CTRL_ACK: u64 = 32;
/// How long a control command may take.
const CTRL_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A receive slot with mergeable buffers.
const MERGEABLE_SLOT: usize = 2048;
/// Features the driver accepts.
pub const SUPPORTED_FEATURES: u64 = vfeature::VERSION_1
    | vfeature::ACCESS_PLATFORM
    | vfeature::RING_EVENT_IDX
    | net::feature::MAC
    | net::feature::STATUS
    | net::feature::MTU
    | net::feature::MRG_RXBUF
    | net::feature::CTRL_VQ
    | net::feature::NOTF_COAL
    | vfeature::RING_RESET;

/// Whether `id` is a virtio network device (modern or transitional).
pub fn matches(id: &PciIdentity) -> bool {
    id.vendor == virtio::PCI_VENDOR_ID
        && (id.device == virtio::PCI_DEVICE_ID_BASE + virtio::DEVICE_ID_NET
            || (id.device == 0x1000 && id.subsystem == virtio::DEVICE_ID_NET))
}

/// What the device says of itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its MAC address (all zero if it has none: `MAC` not offered).
    pub mac: [u8; 6],
    /// Largest payload it takes (1500 if it does not say).
    pub mtu: u16,
    /// Receive buffers merge.
    pub mergeable: bool,
}

/// Counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetDriverStats {
    /// Frames handed to the device.
    pub tx_frames: u64,
    /// Frames received whole.
    pub rx_frames: u64,
    /// Received frames dropped: the device wrote something that cannot be right.
    pub rx_errors: u64,
    /// Notifications sent to the device on the transmit queue: one per batch at most (none
    /// while the device said it is still working through the queue).
    pub tx_doorbells: u64,
}

/// The driver for one virtio-net function.
pub struct VirtioNet {
    device: VirtioDevice,
    rx: VirtQueue,
    tx: VirtQueue,
    rx_area: DmaBuf,
    tx_area: DmaBuf,
    /// The receive slot each posted chain (by head) is.
    rx_slot: Vec<Option<usize>>,
    /// A client's buffer lent to the device (by head): its tag and length.
    rx_lent: Vec<Option<(u64, u32)>>,
    /// The receive queue holds lent buffers only (see [`NetDriver::set_lending`]).
    lending: bool,
    /// Lent buffers the device wrote into, not yet taken.
    lent_done: Vec<(u64, Result<u32, NetError>)>,
    /// The transmit slot each chain in flight (by head) holds.
    tx_slot: Vec<Option<usize>>,
    /// A session's frame in flight (by head): its driver tag and length.
    tx_tag: Vec<Option<(u64, u32)>>,
    /// How many of `tx_tag` are set.
    tx_tagged: usize,
    /// Transmit completions reaped while taking slots back, not yet handed on.
    tx_done: Vec<(u64, Result<u32, NetError>)>,
    /// The frame being shown to the dispatcher (reused: no allocation per frame).
    frame: Vec<u8>,
    tx_free: Vec<usize>,
    rx_slot_size: usize,
    tx_slot_size: usize,
    /// Slots of a frame spread over several buffers, gathered until all have come.
    partial: Vec<(usize, u32)>,
    partial_want: u16,
    info: DeviceInfo,
    /// The control queue and a buffer for one command and its ack (with `CTRL_VQ`).
    ctrl: Option<(VirtQueue, DmaBuf)>,
    class: outboard_net::NetInfo,
    stats: NetDriverStats,
}

impl std::fmt::Debug for VirtioNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioNet")
            .field("info", &self.info)
            .finish()
    }
}

fn config_u16(n: &Negotiation, offset: usize) -> Result<u16, VirtioError> {
    let mut b = [0u8; 2];
    n.transport().read_config(offset as u64, &mut b)?;
    Ok(u16::from_le_bytes(b))
}

impl VirtioNet {
    /// Brings the device up and posts every receive buffer; `name` is its class device name.
    pub fn new(name: &str, func: PciFunction) -> Result<Self, VirtioError> {
        if !matches(&func.identity()) {
            return Err(VirtioError::Device(format!(
                "{:04x}:{:04x} is not a virtio-net device",
                func.identity().vendor,
                func.identity().device
            )));
        }
        let n = Negotiation::begin(func, "virtio-net", SUPPORTED_FEATURES)?;
        let f = n.features();
        let mut mac = [0u8; 6];
        if f & net::feature::MAC != 0 {
            n.transport()
                .read_config(net::config::MAC as u64, &mut mac)?;
        }
        let mtu = if f & net::feature::MTU != 0 {
            config_u16(&n, net::config::MTU)?
        } else {
            1500
        };
        let mergeable = f & net::feature::MRG_RXBUF != 0;
        // A whole frame of the MTU behind its header, rounded to a cache line.
        let whole = (net::HDR_SIZE + usize::from(mtu) + net::ETH_HEADER + 4).next_multiple_of(64);
        let rx_slot_size = if mergeable { MERGEABLE_SLOT } else { whole };
        let has_ctrl = f & net::feature::CTRL_VQ != 0;
        let (device, mut queues) = n.finish(if has_ctrl { 3 } else { 2 }, MAX_QUEUE_SIZE)?;
        let dma = device.function().dma();
        let ctrl = match has_ctrl {
            true => {
                let mut q = queues.pop().expect("three queues");
                // Commands are waited for, not interrupted for.
                q.disable_interrupts()?;
                let area = dma
                    .alloc(CTRL_AREA)
                    .map_err(|e| VirtioError::Device(e.to_string()))?;
                Some((q, area))
            }
            false => None,
        };
        let tx = queues.pop().expect("two queues");
        let rx = queues.pop().expect("two queues");
        let rx_area = dma
            .alloc(rx.size() as usize * rx_slot_size)
            .map_err(|e| VirtioError::Device(e.to_string()))?;
        let tx_area = dma
            .alloc(tx.size() as usize * whole)
            .map_err(|e| VirtioError::Device(e.to_string()))?;
        let mut d = Self {
            rx_slot: vec![None; rx.size() as usize],
            rx_lent: vec![None; rx.size() as usize],
            lending: false,
            lent_done: Vec::new(),
            tx_slot: vec![None; tx.size() as usize],
            tx_tag: vec![None; tx.size() as usize],
            tx_tagged: 0,
            tx_done: Vec::new(),
            frame: Vec::with_capacity(whole),
            tx_free: (0..tx.size() as usize).rev().collect(),
            rx_slot_size,
            tx_slot_size: whole,
            partial: Vec::new(),
            partial_want: 0,
            ctrl,
            info: DeviceInfo {
                mac,
                mtu,
                mergeable,
            },
            class: outboard_net::NetInfo {
                name: name.into(),
                mac,
                mtu,
                link_up: true,
                queue_depth: u32::from(tx.size()),
                counters: outboard_net::NetCounters::default(),
            },
            stats: NetDriverStats::default(),
            device,
            rx,
            tx,
            rx_area,
            tx_area,
        };
        for slot in 0..d.rx.size() as usize {
            d.post_rx(slot)?;
        }
        d.rx.publish()?;
        d.class.link_up = d.link_up()?;
        Ok(d)
    }

    /// What the device says of itself.
    pub fn device_info(&self) -> DeviceInfo {
        self.info
    }

    /// Counters.
    pub fn stats(&self) -> NetDriverStats {
        self.stats
    }

    /// The PCI function (its interrupts, its DMA space).
    pub fn function(&self) -> &PciFunction {
        self.device.function()
    }

    /// Whether the link is up (a device without `STATUS` is always up).
    pub fn link_up(&self) -> Result<bool, VirtioError> {
        if self.device.features() & net::feature::STATUS == 0 {
            return Ok(true);
        }
        let mut b = [0u8; 2];
        self.device
            .transport()
            .read_config(net::config::STATUS as u64, &mut b)?;
        Ok(u16::from_le_bytes(b) & net::S_LINK_UP != 0)
    }

    fn post_rx(&mut self, slot: usize) -> Result<(), VirtioError> {
        let iova = self.rx_area.iova() + (slot * self.rx_slot_size) as u64;
        let head = self
            .rx
            .add(&[Buf {
                iova,
                len: self.rx_slot_size as u32,
                write: true,
            }])?
            .ok_or_else(|| VirtioError::Device("receive queue full".into()))?;
        self.rx_slot[head as usize] = Some(slot);
        Ok(())
    }

    /// Frees the transmit slots of chains the device is done with.
    fn reclaim_tx(&mut self) -> Result<(), VirtioError> {
        while let Some((head, _)) = self.tx.pop_used()? {
            let slot = self
                .tx_slot
                .get_mut(head as usize)
                .and_then(Option::take)
                .ok_or_else(|| {
                    VirtioError::Device(format!("transmit completion for idle chain {head}"))
                })?;
            self.tx_free.push(slot);
            if let Some((tag, len)) = self.tx_tag[head as usize].take() {
                self.tx_tagged -= 1;
                self.tx_done.push((tag, Ok(len)));
            }
        }
        Ok(())
    }

    /// Queues `frames` for transmission with one doorbell; how many were taken (fewer when
    /// the queue is full: the rest may be sent again later). A frame shorter than an Ethernet
    /// header or longer than the MTU allows is refused.
    pub fn send(&mut self, frames: &[&[u8]]) -> Result<usize, VirtioError> {
        self.reclaim_tx()?;
        let max = usize::from(self.info.mtu) + net::ETH_HEADER + 4;
        let mut sent = 0;
        for f in frames {
            if f.len() < net::ETH_HEADER || f.len() > max {
                return Err(VirtioError::Device(format!(
                    "a frame of {} bytes (from {} to {max})",
                    f.len(),
                    net::ETH_HEADER
                )));
            }
            let Some(slot) = self.tx_free.last().copied() else {
                break;
            };
            let at = (slot * self.tx_slot_size) as u64;
            self.tx_area.fill(at, net::HDR_SIZE, 0)?;
            self.tx_area.write(at + net::HDR_SIZE as u64, f)?;
            let head = match self.tx.add(&[Buf {
                iova: self.tx_area.iova() + at,
                len: (net::HDR_SIZE + f.len()) as u32,
                write: false,
            }])? {
                Some(h) => h,
                None => break,
            };
            self.tx_free.pop();
            self.tx_slot[head as usize] = Some(slot);
            sent += 1;
        }
        if self.tx.publish()? {
            self.stats.tx_doorbells += 1;
        }
        self.stats.tx_frames += sent as u64;
        Ok(sent)
    }

    /// Asks the device to hold receive interrupts back: until `max_packets` frames came or
    /// `usecs` passed since the first (both 0: at once, the default). Refused by a device
    /// without `NOTF_COAL`, or one that answers the command `ERR`.
    pub fn set_rx_coalescing(&mut self, max_packets: u32, usecs: u32) -> Result<(), VirtioError> {
        if self.device.features() & net::feature::NOTF_COAL == 0 {
            return Err(VirtioError::Device(
                "this NIC does not coalesce interrupts (no NOTF_COAL)".into(),
            ));
        }
        let mut data = [0u8; net::ctrl::COAL_SIZE];
        data[..4].copy_from_slice(&max_packets.to_le_bytes());
        data[4..].copy_from_slice(&usecs.to_le_bytes());
        self.command(
            net::ctrl::CLASS_NOTF_COAL,
            net::ctrl::NOTF_COAL_RX_SET,
            &data,
        )
    }

    /// Sends one control-queue command and waits (bounded) for the device's ack.
    fn command(&mut self, class: u8, command: u8, data: &[u8]) -> Result<(), VirtioError> {
        let Some((q, area)) = self.ctrl.as_mut() else {
            return Err(VirtioError::Device("this NIC has no control queue".into()));
        };
        let len = 2 + data.len();
        if len > CTRL_ACK as usize {
            return Err(VirtioError::Device(format!("a command of {len} bytes")));
        }
        area.write(0, &[class, command])?;
        area.write(2, data)?;
        area.write(CTRL_ACK, &[net::ctrl::ERR])?;
        let head = q
            .add(&[
                Buf {
                    iova: area.iova(),
                    len: len as u32,
                    write: false,
                },
                Buf {
                    iova: area.iova() + CTRL_ACK,
                    len: 1,
                    write: true,
                },
            ])?
            .ok_or_else(|| VirtioError::Device("the control queue is full".into()))?;
        q.publish()?;
        let deadline = std::time::Instant::now() + CTRL_WAIT;
        loop {
            match q.pop_used()? {
                Some((h, _)) if h == head => break,
                Some((h, _)) => {
                    return Err(VirtioError::Device(format!(
                        "control queue: completion for idle chain {h}"
                    )))
                }
                None if std::time::Instant::now() > deadline => {
                    return Err(VirtioError::Device(format!(
                        "control command {class}.{command} not answered in {CTRL_WAIT:?}"
                    )))
                }
                None => std::thread::sleep(std::time::Duration::from_micros(50)),
            }
        }
        let mut ack = [0u8; 1];
        area.read(CTRL_ACK, &mut ack)?;
        match ack[0] {
            net::ctrl::OK => Ok(()),
            a => Err(VirtioError::Device(format!(
                "control command {class}.{command} refused (ack {a})"
            ))),
        }
    }

    /// Takes every frame the device has received, appended to `out`, and posts their buffers
    /// again (one doorbell); how many frames came.
    pub fn recv(&mut self, out: &mut Vec<Vec<u8>>) -> Result<usize, VirtioError> {
        self.receive_each(&mut |f| out.push(f.to_vec()))
    }

    /// Counts a received frame dropped because the device wrote something that cannot be
    /// right (also in the class status, where operators see it).
    fn rx_error(&mut self) {
        self.stats.rx_errors += 1;
        self.class.counters.rx_device_errors += 1;
    }

    /// Shows every frame the device has received to `each` (from one reused buffer), and
    /// posts their buffers again (one doorbell); how many frames came.
    fn receive_each(&mut self, each: &mut dyn FnMut(&[u8])) -> Result<usize, VirtioError> {
        let mut n = 0;
        while let Some((head, len)) = self.rx.pop_used()? {
            if let Some((tag, room)) = self.rx_lent.get_mut(head as usize).and_then(Option::take) {
                // A client's buffer: the frame is already where the client reads it. Only
                // the length is checked (the driver cannot read the client's memory).
                let whole = net::HDR_SIZE + net::ETH_HEADER;
                let result = if (len as usize) < whole || len > room {
                    self.rx_error();
                    Err(NetError::Io(format!(
                        "the device wrote {len} bytes into a {room}-byte buffer"
                    )))
                } else {
                    self.stats.rx_frames += 1;
                    Ok(len - net::HDR_SIZE as u32)
                };
                self.lent_done.push((tag, result));
                n += 1;
                continue;
            }
            let slot = self
                .rx_slot
                .get_mut(head as usize)
                .and_then(Option::take)
                .ok_or_else(|| {
                    VirtioError::Device(format!("receive completion for idle chain {head}"))
                })?;
            if len as usize > self.rx_slot_size {
                self.rx_error();
                self.drop_partial()?;
                self.post_rx(slot)?;
                continue;
            }
            if self.partial.is_empty() {
                let want = if self.info.mergeable && len as usize >= net::HDR_SIZE {
                    let mut b = [0u8; 2];
                    self.rx_area.read(
                        (slot * self.rx_slot_size + net::HDR_NUM_BUFFERS) as u64,
                        &mut b,
                    )?;
                    u16::from_le_bytes(b)
                } else {
                    1
                };
                // More pieces than there are buffers would hold every buffer for ever.
                if (len as usize) < net::HDR_SIZE + net::ETH_HEADER
                    || want == 0
                    || want > self.rx.size()
                {
                    self.rx_error();
                    self.post_rx(slot)?;
                    continue;
                }
                self.partial_want = want;
            }
            self.partial.push((slot, len));
            if self.partial.len() < usize::from(self.partial_want) {
                continue;
            }
            let total: usize = self.partial.iter().map(|&(_, l)| l as usize).sum();
            let mut frame = std::mem::take(&mut self.frame);
            frame.clear();
            frame.resize(total - net::HDR_SIZE, 0);
            let mut at = 0usize;
            for (i, &(s, l)) in self.partial.iter().enumerate() {
                let skip = if i == 0 { net::HDR_SIZE } else { 0 };
                let take = l as usize - skip;
                self.rx_area.read(
                    (s * self.rx_slot_size + skip) as u64,
                    &mut frame[at..at + take],
                )?;
                at += take;
            }
            for (s, _) in std::mem::take(&mut self.partial) {
                self.post_rx(s)?;
            }
            each(&frame);
            self.frame = frame;
            n += 1;
            self.stats.rx_frames += 1;
        }
        self.rx.publish()?;
        Ok(n)
    }

    /// A frame in pieces that cannot be completed: its buffers go back, it is counted.
    fn drop_partial(&mut self) -> Result<(), VirtioError> {
        for (s, _) in std::mem::take(&mut self.partial) {
            self.post_rx(s)?;
        }
        Ok(())
    }
}

/// A chip error that stops the whole device.
fn failure(e: VirtioError) -> Failure {
    Failure::Driver(e.to_string())
}

impl Driver for VirtioNet {
    fn driver_name(&self) -> &'static str {
        "virtio-net"
    }

    fn sources(&self) -> Vec<(DeviceEvent, BorrowedFd<'_>)> {
        self.device.sources()
    }

    fn handle(&mut self, event: DeviceEvent) -> Result<(), Failure> {
        self.device.handle(event)?;
        // A configuration change that is not a reset request: the link may have moved.
        if event == DeviceEvent::ConfigChange {
            self.refresh()?;
        }
        Ok(())
    }

    fn abandon(&mut self) -> Fence {
        self.device.abandon("virtio-net")
    }
}

impl NetDriver for VirtioNet {
    fn info(&self) -> &outboard_net::NetInfo {
        &self.class
    }

    fn refresh(&mut self) -> Result<(), Failure> {
        self.class.link_up = self.link_up().map_err(failure)?;
        Ok(())
    }

    fn has_room(&self) -> bool {
        !self.tx_free.is_empty() && self.tx.can_add(2)
    }

    fn in_flight(&self) -> usize {
        self.tx_tagged
    }

    fn transmit(&mut self, iova: u64, len: u32, tag: u64) -> Result<(), NetError> {
        let max = self.class.max_frame();
        if len < outboard_net::ETH_HEADER || len > max {
            return Err(NetError::Invalid(format!(
                "a frame of {len} bytes: this NIC sends {} to {max}",
                outboard_net::ETH_HEADER
            )));
        }
        let Some(slot) = self.tx_free.last().copied() else {
            return Err(NetError::QueueFull);
        };
        let dead = |e: VirtioError| NetError::DeviceFailed(e.to_string());
        let at = (slot * self.tx_slot_size) as u64;
        self.tx_area
            .fill(at, net::HDR_SIZE, 0)
            .map_err(|e| dead(e.into()))?;
        let head = self
            .tx
            .add(&[
                Buf {
                    iova: self.tx_area.iova() + at,
                    len: net::HDR_SIZE as u32,
                    write: false,
                },
                Buf {
                    iova,
                    len,
                    write: false,
                },
            ])
            .map_err(dead)?
            .ok_or(NetError::QueueFull)?;
        self.tx_free.pop();
        self.tx_slot[head as usize] = Some(slot);
        self.tx_tag[head as usize] = Some((tag, len));
        self.tx_tagged += 1;
        self.stats.tx_frames += 1;
        Ok(())
    }

    fn kick(&mut self) -> Result<(), Failure> {
        if self.lending {
            self.rx.publish().map_err(failure)?;
        }
        if self.tx.publish().map_err(failure)? {
            self.stats.tx_doorbells += 1;
        }
        Ok(())
    }

    fn poll(
        &mut self,
        sent: &mut Vec<(u64, Result<u32, NetError>)>,
        received: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, Failure> {
        self.reclaim_tx().map_err(failure)?;
        let n = self.tx_done.len();
        sent.append(&mut self.tx_done);
        Ok(n + self.receive_each(received).map_err(failure)?)
    }

    fn set_hold_off(&mut self, usecs: u32) -> Result<(), NetError> {
        // A frame count as well: a burst that fills a quarter of the ring goes at once.
        let packets = if usecs == 0 {
            0
        } else {
            u32::from(self.rx.size() / 4)
        };
        self.set_rx_coalescing(packets, usecs)
            .map_err(|e| NetError::Invalid(e.to_string()))
    }

    fn arm(&mut self) -> Result<bool, Failure> {
        let rx = self.rx.enable_interrupts().map_err(failure)?;
        let tx = self.tx.enable_interrupts().map_err(failure)?;
        Ok(rx || tx)
    }

    fn lend_headroom(&self) -> Option<u32> {
        // Taking the receive queue back from lent buffers needs resetting it alone.
        (self.device.features() & vfeature::RING_RESET != 0).then_some(net::HDR_SIZE as u32)
    }

    fn set_lending(&mut self, on: bool, returned: &mut Vec<u64>) -> Result<(), NetError> {
        if self.lend_headroom().is_none() {
            return Err(NetError::Invalid(
                "this NIC cannot reset its receive queue alone (no RING_RESET): it receives into the driver's buffers only".into(),
            ));
        }
        let dead = |e: VirtioError| NetError::DeviceFailed(e.to_string());
        self.device.reset_queue(&mut self.rx).map_err(dead)?;
        returned.extend(
            self.rx_lent
                .iter_mut()
                .filter_map(Option::take)
                .map(|(t, _)| t),
        );
        self.rx_slot.fill(None);
        self.partial.clear();
        self.lending = on;
        if !on {
            for slot in 0..self.rx.size() as usize {
                self.post_rx(slot).map_err(dead)?;
            }
            self.rx.publish().map_err(dead)?;
        }
        Ok(())
    }

    fn can_lend(&self) -> bool {
        self.lending && self.rx.can_add(1)
    }

    fn lend(&mut self, iova: u64, len: u32, tag: u64) -> Result<(), NetError> {
        if !self.lending {
            return Err(NetError::Invalid("not lending".into()));
        }
        // The header and the longest frame the device may write (an 802.1Q tag included):
        // one buffer always holds a whole frame, so a frame never spans two.
        let need = (net::HDR_SIZE + usize::from(self.info.mtu) + net::ETH_HEADER + 4) as u32;
        if len < need {
            return Err(NetError::Invalid(format!(
                "a lent buffer of {len} bytes: it must hold the header and a whole frame ({need})"
            )));
        }
        let head = self
            .rx
            .add(&[Buf {
                iova,
                len,
                write: true,
            }])
            .map_err(|e| NetError::DeviceFailed(e.to_string()))?
            .ok_or(NetError::QueueFull)?;
        self.rx_lent[head as usize] = Some((tag, len));
        Ok(())
    }

    fn take_lent(&mut self, out: &mut Vec<(u64, Result<u32, NetError>)>) {
        out.append(&mut self.lent_done);
    }

    fn lent_pieces(&self, headroom: &[u8]) -> u16 {
        // With mergeable buffers the header says how many buffers the frame took (a device
        // may spread a frame longer than the MTU over several); without, always one.
        match (
            self.info.mergeable,
            headroom.get(net::HDR_NUM_BUFFERS..net::HDR_NUM_BUFFERS + 2),
        ) {
            (true, Some(b)) => u16::from_le_bytes([b[0], b[1]]),
            _ => 1,
        }
    }
}

/// The catalog's entry for virtio-net.
pub const PERSONALITY: Personality = Personality {
    driver: "virtio-net",
    class: outboard_net::CLASS,
    score: 1000,
    matches: |id| matches!(id, Identity::Pci(id) if matches(id)),
    probe,
    start,
    faults: &[],
    library: None,
};

/// Looks at the function: the modern virtio-pci structures must be inside its BARs; a
/// transitional device bids 100 less.
fn probe(dev: &Probe<'_>, initial: u32) -> Result<u32, String> {
    use outboard_spec::virtio::cap;
    crate::virtio::device::probe_modern(
        dev,
        initial,
        "virtio-net",
        &[
            cap::COMMON_CFG,
            cap::NOTIFY_CFG,
            cap::ISR_CFG,
            cap::DEVICE_CFG,
        ],
        0x1000,
    )
}

fn start(p: Provider, o: &StartOptions) -> Result<Box<dyn AnyDriver>, StartError> {
    let Provider::Pci(f) = p else {
        return Err(StartError::NoMatch(
            "virtio-net drives PCI functions".into(),
        ));
    };
    let d = VirtioNet::new(&o.name, f).map_err(|e| StartError::Refused(e.to_string()))?;
    Ok(outboard_net::bind(d))
}
