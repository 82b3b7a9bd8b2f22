//! Virtio 1.x over PCI and the split virtqueue (virtio v1.2, §2, §4.1).

use bitflags::bitflags;

/// PCI vendor ID of every virtio device (§4.1.2).
pub const PCI_VENDOR_ID: u16 = 0x1af4;
/// Modern (non-transitional) device IDs are 0x1040 + virtio device ID (§4.1.2.1).
pub const PCI_DEVICE_ID_BASE: u16 = 0x1040;
/// Virtio device ID of a block device (§5.2).
pub const DEVICE_ID_BLOCK: u16 = 2;
/// Virtio device ID of a network device (§5.1).
pub const DEVICE_ID_NET: u16 = 1;
/// Virtio device ID of an entropy source (§5.4).
pub const DEVICE_ID_ENTROPY: u16 = 4;

/// Virtio PCI capability `cfg_type` values (§4.1.4).
pub mod cap {
    /// Common configuration.
    pub const COMMON_CFG: u8 = 1;
    /// Notifications.
    pub const NOTIFY_CFG: u8 = 2;
    /// ISR status.
    pub const ISR_CFG: u8 = 3;
    /// Device-specific configuration.
    pub const DEVICE_CFG: u8 = 4;
    /// PCI configuration access.
    pub const PCI_CFG: u8 = 5;

    /// `struct virtio_pci_cap` field offsets relative to the capability start (§4.1.4).
    pub const CAP_LEN: u64 = 2;
    /// `cfg_type`.
    pub const CFG_TYPE: u64 = 3;
    /// `bar`.
    pub const BAR: u64 = 4;
    /// `id`.
    pub const ID: u64 = 5;
    /// `offset` (le32) within the BAR.
    pub const OFFSET: u64 = 8;
    /// `length` (le32).
    pub const LENGTH: u64 = 12;
    /// `notify_off_multiplier` (le32), notify capability only (§4.1.4.4).
    pub const NOTIFY_OFF_MULTIPLIER: u64 = 16;
    /// Size of `struct virtio_pci_cap`.
    pub const SIZE: u8 = 16;
    /// Size of `struct virtio_pci_notify_cap`.
    pub const NOTIFY_SIZE: u8 = 20;
    /// Size of `struct virtio_pci_cfg_cap` (cap + 4 bytes of `pci_cfg_data`).
    pub const PCI_CFG_SIZE: u8 = 20;
    /// `pci_cfg_data` within `struct virtio_pci_cfg_cap`.
    pub const PCI_CFG_DATA: u64 = 16;

    /// Human-readable `cfg_type`.
    pub fn name(cfg_type: u8) -> &'static str {
        match cfg_type {
            COMMON_CFG => "common",
            NOTIFY_CFG => "notify",
            ISR_CFG => "isr",
            DEVICE_CFG => "device",
            PCI_CFG => "pci-cfg",
            8 => "shared-memory",
            _ => "unknown",
        }
    }
}

/// `struct virtio_pci_common_cfg` field offsets (§4.1.4.3).
pub mod common {
    /// le32 device_feature_select (rw).
    pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
    /// le32 device_feature (ro).
    pub const DEVICE_FEATURE: u64 = 0x04;
    /// le32 driver_feature_select (rw).
    pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
    /// le32 driver_feature (rw).
    pub const DRIVER_FEATURE: u64 = 0x0c;
    /// le16 config_msix_vector (rw).
    pub const CONFIG_MSIX_VECTOR: u64 = 0x10;
    /// le16 num_queues (ro).
    pub const NUM_QUEUES: u64 = 0x12;
    /// u8 device_status (rw).
    pub const DEVICE_STATUS: u64 = 0x14;
    /// u8 config_generation (ro).
    pub const CONFIG_GENERATION: u64 = 0x15;
    /// le16 queue_select (rw).
    pub const QUEUE_SELECT: u64 = 0x16;
    /// le16 queue_size (rw).
    pub const QUEUE_SIZE: u64 = 0x18;
    /// le16 queue_msix_vector (rw).
    pub const QUEUE_MSIX_VECTOR: u64 = 0x1a;
    /// le16 queue_enable (rw).
    pub const QUEUE_ENABLE: u64 = 0x1c;
    /// le16 queue_notify_off (ro).
    pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
    /// le64 queue_desc (rw).
    pub const QUEUE_DESC: u64 = 0x20;
    /// le64 queue_driver (rw): the available ring.
    pub const QUEUE_DRIVER: u64 = 0x28;
    /// le64 queue_device (rw): the used ring.
    pub const QUEUE_DEVICE: u64 = 0x30;
    /// Size of the structure without the v1.2 `queue_notif_config_data`/`queue_reset` fields.
    pub const SIZE: u64 = 0x38;
    /// le16 queue_notify_data (ro; with `NOTIF_CONFIG_DATA`).
    pub const QUEUE_NOTIFY_DATA: u64 = 0x38;
    /// le16 queue_reset (rw; with `RING_RESET`): 1 written resets the selected queue, 1 read
    /// back says it is reset (§4.1.4.3).
    pub const QUEUE_RESET: u64 = 0x3a;
    /// Size of the structure with the v1.2 fields.
    pub const SIZE_V1_2: u64 = 0x3c;
}

/// "No vector" value for MSI-X vector registers (§4.1.5.1.2).
pub const NO_VECTOR: u16 = 0xffff;

bitflags! {
    /// Device status bits (§2.1).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct DeviceStatus: u8 {
        /// The guest OS has found the device.
        const ACKNOWLEDGE = 1;
        /// The guest OS knows how to drive the device.
        const DRIVER = 2;
        /// The driver is set up and ready to drive the device.
        const DRIVER_OK = 4;
        /// The driver has acknowledged the features it understands.
        const FEATURES_OK = 8;
        /// The device has experienced an error from which it cannot recover.
        const DEVICE_NEEDS_RESET = 64;
        /// Something went wrong in the guest; it has given up on the device.
        const FAILED = 128;
    }
}

/// Reserved (device-independent) feature bits (§6).
pub mod feature {
    /// The driver can use descriptors with the INDIRECT flag.
    pub const RING_INDIRECT_DESC: u64 = 1 << 28;
    /// `used_event` / `avail_event` notification suppression.
    pub const RING_EVENT_IDX: u64 = 1 << 29;
    /// Compliance with virtio 1.x.
    pub const VERSION_1: u64 = 1 << 32;
    /// The device is behind an IOMMU / uses platform DMA translation.
    pub const ACCESS_PLATFORM: u64 = 1 << 33;
    /// Packed virtqueue layout.
    pub const RING_PACKED: u64 = 1 << 34;
    /// Buffers are used in the order they were made available.
    pub const IN_ORDER: u64 = 1 << 35;
    /// Notifications carry extra data.
    pub const NOTIFICATION_DATA: u64 = 1 << 38;
    /// The driver may reset one queue alone (§2.6.1): the device forgets its buffers, and
    /// the queue may be set up and enabled again.
    pub const RING_RESET: u64 = 1 << 40;

    /// Name of a reserved feature bit, for probe output.
    pub fn name(bit: u32) -> Option<&'static str> {
        Some(match bit {
            28 => "RING_INDIRECT_DESC",
            29 => "RING_EVENT_IDX",
            32 => "VERSION_1",
            33 => "ACCESS_PLATFORM",
            34 => "RING_PACKED",
            35 => "IN_ORDER",
            36 => "ORDER_PLATFORM",
            37 => "SR_IOV",
            38 => "NOTIFICATION_DATA",
            39 => "NOTIF_CONFIG_DATA",
            40 => "RING_RESET",
            _ => return None,
        })
    }
}

/// ISR status bits (§4.1.4.5).
pub mod isr {
    /// A queue interrupt.
    pub const QUEUE: u8 = 1;
    /// A configuration change interrupt.
    pub const CONFIG: u8 = 2;
}

/// The network device (§5.1).
pub mod net {
    /// Feature bits of the network device (§5.1.3).
    pub mod feature {
        /// The device handles packets with a partial checksum (offload).
        pub const CSUM: u64 = 1 << 0;
        /// The device reports its maximum MTU in `mtu`.
        pub const MTU: u64 = 1 << 3;
        /// The device has a MAC address in `mac`.
        pub const MAC: u64 = 1 << 5;
        /// The driver can merge receive buffers: one frame may span several.
        pub const MRG_RXBUF: u64 = 1 << 15;
        /// `status` is valid (link up or down).
        pub const STATUS: u64 = 1 << 16;
        /// There is a control queue (§5.1.6.5).
        pub const CTRL_VQ: u64 = 1 << 17;
        /// The device coalesces used-buffer notifications on request (§5.1.6.5.9:
        /// `VIRTIO_NET_CTRL_NOTF_COAL`).
        pub const NOTF_COAL: u64 = 1 << 53;
    }

    /// The first receive queue (§5.1.2).
    pub const RECEIVEQ: u16 = 0;
    /// The first transmit queue.
    pub const TRANSMITQ: u16 = 1;
    /// The control queue with one queue pair (index `2 * max_virtqueue_pairs`).
    pub const CONTROLQ: u16 = 2;

    /// The control queue's commands (§5.1.6.5): a device-readable `u8 class`, `u8 command`
    /// and the command's data, then a device-writable `u8 ack`.
    pub mod ctrl {
        /// `ack`: done.
        pub const OK: u8 = 0;
        /// `ack`: refused.
        pub const ERR: u8 = 1;
        /// Class: notification coalescing.
        pub const CLASS_NOTF_COAL: u8 = 6;
        /// `VIRTIO_NET_CTRL_NOTF_COAL_TX_SET`: `le32 tx_max_packets; le32 tx_usecs`.
        pub const NOTF_COAL_TX_SET: u8 = 0;
        /// `VIRTIO_NET_CTRL_NOTF_COAL_RX_SET`: `le32 rx_max_packets; le32 rx_usecs`.
        pub const NOTF_COAL_RX_SET: u8 = 1;
        /// Bytes of a coalescing command's data.
        pub const COAL_SIZE: usize = 8;
    }

    /// Device configuration layout (§5.1.4): offsets and size.
    pub mod config {
        /// `u8 mac[6]`.
        pub const MAC: usize = 0;
        /// `le16 status`.
        pub const STATUS: usize = 6;
        /// `le16 max_virtqueue_pairs`.
        pub const MAX_VIRTQUEUE_PAIRS: usize = 8;
        /// `le16 mtu`.
        pub const MTU: usize = 10;
        /// The fields up to `mtu`.
        pub const SIZE: usize = 12;
    }

    /// `status`: the link is up.
    pub const S_LINK_UP: u16 = 1;

    /// `struct virtio_net_hdr` ahead of every frame (§5.1.6): flags, gso_type, hdr_len,
    /// gso_size, csum_start, csum_offset, num_buffers — 12 bytes once VERSION_1 is negotiated.
    pub const HDR_SIZE: usize = 12;
    /// Header: `u8 flags`.
    pub const HDR_FLAGS: usize = 0;
    /// Header: `u8 gso_type`.
    pub const HDR_GSO_TYPE: usize = 1;
    /// Header: `le16 num_buffers`.
    pub const HDR_NUM_BUFFERS: usize = 10;
    /// `flags`: the checksum is partial (only with CSUM).
    pub const HDR_F_NEEDS_CSUM: u8 = 1;
    /// `gso_type`: not a GSO frame.
    pub const GSO_NONE: u8 = 0;

    /// An Ethernet header: destination, source, type.
    pub const ETH_HEADER: usize = 14;
    /// The shortest frame a NIC sends (without the frame check sequence).
    pub const ETH_MIN_FRAME: usize = 60;
}

/// The split virtqueue layout (§2.7).
pub mod split {
    /// Largest queue size a split queue may have.
    pub const MAX_QUEUE_SIZE: u16 = 32768;

    /// Size of one descriptor: le64 addr, le32 len, le16 flags, le16 next.
    pub const DESC_SIZE: u64 = 16;
    /// Descriptor: `addr` field.
    pub const DESC_ADDR: u64 = 0;
    /// Descriptor: `len` field.
    pub const DESC_LEN: u64 = 8;
    /// Descriptor: `flags` field.
    pub const DESC_FLAGS: u64 = 12;
    /// Descriptor: `next` field.
    pub const DESC_NEXT: u64 = 14;

    /// Descriptor flag: the buffer continues via `next`.
    pub const DESC_F_NEXT: u16 = 1;
    /// Descriptor flag: the buffer is device-writable.
    pub const DESC_F_WRITE: u16 = 2;
    /// Descriptor flag: the buffer holds a table of indirect descriptors.
    pub const DESC_F_INDIRECT: u16 = 4;

    /// Available ring: le16 flags.
    pub const AVAIL_FLAGS: u64 = 0;
    /// Available ring: le16 idx.
    pub const AVAIL_IDX: u64 = 2;
    /// Available ring: first entry of `ring[]`.
    pub const AVAIL_RING: u64 = 4;
    /// Available ring flag: the driver does not want interrupts.
    pub const AVAIL_F_NO_INTERRUPT: u16 = 1;

    /// Used ring: le16 flags.
    pub const USED_FLAGS: u64 = 0;
    /// Used ring: le16 idx.
    pub const USED_IDX: u64 = 2;
    /// Used ring: first element `{le32 id, le32 len}` of `ring[]`.
    pub const USED_RING: u64 = 4;
    /// Size of one used element.
    pub const USED_ELEM_SIZE: u64 = 8;
    /// Used ring flag: the device does not want notifications.
    pub const USED_F_NO_NOTIFY: u16 = 1;

    /// Bytes needed for a descriptor table of `size` entries (16-byte aligned).
    pub const fn desc_table_size(size: u16) -> u64 {
        DESC_SIZE * size as u64
    }
    /// Bytes needed for an available ring with `used_event` (2-byte aligned).
    pub const fn avail_ring_size(size: u16) -> u64 {
        6 + 2 * size as u64
    }
    /// Bytes needed for a used ring with `avail_event` (4-byte aligned).
    pub const fn used_ring_size(size: u16) -> u64 {
        6 + USED_ELEM_SIZE * size as u64
    }
    /// Offset of available ring entry `i`.
    pub const fn avail_entry(size: u16, i: u16) -> u64 {
        AVAIL_RING + 2 * (i % size) as u64
    }
    /// Offset of `used_event` at the end of the available ring.
    pub const fn used_event(size: u16) -> u64 {
        AVAIL_RING + 2 * size as u64
    }
    /// Offset of used ring element `i`.
    pub const fn used_entry(size: u16, i: u16) -> u64 {
        USED_RING + USED_ELEM_SIZE * (i % size) as u64
    }
    /// Offset of `avail_event` at the end of the used ring.
    pub const fn avail_event(size: u16) -> u64 {
        USED_RING + USED_ELEM_SIZE * size as u64
    }

    /// `vring_need_event` (§2.7.10): whether moving the index from `old` to `new` crosses
    /// `event`, i.e. whether the other side asked to be notified within that window.
    pub const fn need_event(event: u16, new: u16, old: u16) -> bool {
        new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
    }
}

#[cfg(test)]
mod tests {
    use super::split::*;

    #[test]
    fn need_event_matches_the_spec_formula_across_wrap() {
        // The device moved used idx from 10 to 13 and the driver asked for an event at 11.
        assert!(need_event(11, 13, 10));
        // Event at 13 is after the new index: not yet.
        assert!(!need_event(13, 13, 10));
        // Across the 16-bit wrap.
        assert!(need_event(0xffff, 2, 0xfffe));
        assert!(!need_event(5, 2, 0xfffe));
    }

    #[test]
    fn ring_sizes() {
        assert_eq!(desc_table_size(256), 4096);
        assert_eq!(avail_ring_size(256), 518);
        assert_eq!(used_ring_size(256), 2054);
        assert_eq!(used_event(4), 12);
        assert_eq!(avail_event(4), 36);
    }
}
