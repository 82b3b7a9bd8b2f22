//! Virtio block device (virtio v1.2, §5.2).

/// Feature bits of the block device (§5.2.3).
pub mod feature {
    /// Maximum size of any single segment is in `size_max`.
    pub const SIZE_MAX: u64 = 1 << 1;
    /// Maximum number of segments in a request is in `seg_max`.
    pub const SEG_MAX: u64 = 1 << 2;
    /// Disk-style geometry is in `geometry`.
    pub const GEOMETRY: u64 = 1 << 4;
    /// The device is read-only.
    pub const RO: u64 = 1 << 5;
    /// Block size of disk is in `blk_size`.
    pub const BLK_SIZE: u64 = 1 << 6;
    /// Cache flush command support.
    pub const FLUSH: u64 = 1 << 9;
    /// Topology information is available.
    pub const TOPOLOGY: u64 = 1 << 10;
    /// The device can toggle its cache between writeback and writethrough.
    pub const CONFIG_WCE: u64 = 1 << 11;
    /// The device supports multiqueue; `num_queues` is valid.
    pub const MQ: u64 = 1 << 12;
    /// The device can support discard.
    pub const DISCARD: u64 = 1 << 13;
    /// The device can support write zeroes.
    pub const WRITE_ZEROES: u64 = 1 << 14;

    /// Name of a block feature bit, for probe output.
    pub fn name(bit: u32) -> Option<&'static str> {
        Some(match bit {
            1 => "SIZE_MAX",
            2 => "SEG_MAX",
            4 => "GEOMETRY",
            5 => "RO",
            6 => "BLK_SIZE",
            9 => "FLUSH",
            10 => "TOPOLOGY",
            11 => "CONFIG_WCE",
            12 => "MQ",
            13 => "DISCARD",
            14 => "WRITE_ZEROES",
            15 => "LIFETIME",
            16 => "SECURE_ERASE",
            17 => "ZONED",
            _ => return None,
        })
    }
}

/// `struct virtio_blk_config` field offsets (§5.2.4).
pub mod config {
    /// le64 capacity, in 512-byte sectors.
    pub const CAPACITY: u64 = 0x00;
    /// le32 size_max.
    pub const SIZE_MAX: u64 = 0x08;
    /// le32 seg_max.
    pub const SEG_MAX: u64 = 0x0c;
    /// le32 blk_size.
    pub const BLK_SIZE: u64 = 0x14;
    /// u8 writeback.
    pub const WRITEBACK: u64 = 0x20;
    /// le16 num_queues.
    pub const NUM_QUEUES: u64 = 0x22;
    /// le32 max_discard_sectors.
    pub const MAX_DISCARD_SECTORS: u64 = 0x24;
    /// le32 max_discard_seg.
    pub const MAX_DISCARD_SEG: u64 = 0x28;
    /// le32 discard_sector_alignment.
    pub const DISCARD_SECTOR_ALIGNMENT: u64 = 0x2c;
    /// le32 max_write_zeroes_sectors.
    pub const MAX_WRITE_ZEROES_SECTORS: u64 = 0x30;
    /// le32 max_write_zeroes_seg.
    pub const MAX_WRITE_ZEROES_SEG: u64 = 0x34;
    /// u8 write_zeroes_may_unmap.
    pub const WRITE_ZEROES_MAY_UNMAP: u64 = 0x38;
    /// Size of the structure up to and including `write_zeroes_may_unmap` and padding.
    pub const SIZE: u64 = 0x3c;
}

/// Sector size used by `capacity` and request `sector` fields, whatever `blk_size` says.
pub const SECTOR_SIZE: u64 = 512;

/// Request types (§5.2.6).
pub mod req {
    /// Read.
    pub const IN: u32 = 0;
    /// Write.
    pub const OUT: u32 = 1;
    /// Flush.
    pub const FLUSH: u32 = 4;
    /// Get device ID string (20 bytes).
    pub const GET_ID: u32 = 8;
    /// Discard.
    pub const DISCARD: u32 = 11;
    /// Write zeroes.
    pub const WRITE_ZEROES: u32 = 13;

    /// Size of `struct virtio_blk_req` header: le32 type, le32 reserved, le64 sector.
    pub const HEADER_SIZE: u32 = 16;
    /// Size of one discard / write-zeroes segment: le64 sector, le32 num_sectors, le32 flags.
    pub const SEGMENT_SIZE: u32 = 16;
    /// Segment flag: the device may unmap (write zeroes).
    pub const SEGMENT_F_UNMAP: u32 = 1;
    /// Length of the GET_ID string.
    pub const ID_BYTES: u32 = 20;

    use zerocopy::little_endian::{U32, U64};
    use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

    /// `struct virtio_blk_req`'s header (§5.2.6), as it sits in driver memory.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
    #[repr(C)]
    pub struct Header {
        /// Request type (`IN`, `OUT`, …).
        pub kind: U32,
        /// Reserved, zero.
        pub reserved: U32,
        /// First 512-byte sector (zero for FLUSH and GET_ID).
        pub sector: U64,
    }

    /// One discard / write-zeroes segment (§5.2.6.2).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
    #[repr(C)]
    pub struct Segment {
        /// First sector.
        pub sector: U64,
        /// Number of sectors.
        pub num_sectors: U32,
        /// `SEGMENT_F_UNMAP` or zero.
        pub flags: U32,
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::mem::{offset_of, size_of};

        #[test]
        fn layouts_are_pinned() {
            assert_eq!(size_of::<Header>(), HEADER_SIZE as usize);
            assert_eq!(offset_of!(Header, reserved), 4);
            assert_eq!(offset_of!(Header, sector), 8);
            assert_eq!(size_of::<Segment>(), SEGMENT_SIZE as usize);
            assert_eq!(offset_of!(Segment, num_sectors), 8);
            assert_eq!(offset_of!(Segment, flags), 12);
            let h = Header {
                kind: OUT.into(),
                reserved: 0.into(),
                sector: 0x0102_0304_0506_0708.into(),
            };
            assert_eq!(
                h.as_bytes(),
                &[1, 0, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1],
                "little-endian on the wire"
            );
        }
    }
}

/// Request status byte (§5.2.6).
pub mod status {
    /// Success.
    pub const OK: u8 = 0;
    /// Device or driver error.
    pub const IOERR: u8 = 1;
    /// Request unsupported by the device.
    pub const UNSUPP: u8 = 2;
}
