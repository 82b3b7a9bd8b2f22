//! Wire formats of the vfio-user protocol (QEMU `docs/interop/vfio-user.rst`).
//!
//! Every message is a 16-byte header followed by a command-specific payload. All fields are in
//! the host's byte order (the specification says so; client and server share a host). This
//! module only encodes and decodes: it performs no I/O, owns no fds, and every decoder takes
//! untrusted bytes and returns [`WireError`] rather than panicking, which the property tests at
//! the end of this file check.

use vfio_bindings::bindings::vfio as sys;

/// Command numbers (the table in "Commands").
pub mod cmd {
    /// Version and capability negotiation.
    pub const VERSION: u16 = 1;
    /// Add a DMA region.
    pub const DMA_MAP: u16 = 2;
    /// Remove a DMA region.
    pub const DMA_UNMAP: u16 = 3;
    /// Device flags and region/IRQ counts.
    pub const DEVICE_GET_INFO: u16 = 4;
    /// Region size, flags, mmap fd and capabilities.
    pub const DEVICE_GET_REGION_INFO: u16 = 5;
    /// ioeventfds / ioregionfds of a region.
    pub const DEVICE_GET_REGION_IO_FDS: u16 = 6;
    /// IRQ type information.
    pub const DEVICE_GET_IRQ_INFO: u16 = 7;
    /// Attach eventfds to IRQs, mask, unmask, trigger.
    pub const DEVICE_SET_IRQS: u16 = 8;
    /// Read a device region.
    pub const REGION_READ: u16 = 9;
    /// Write a device region.
    pub const REGION_WRITE: u16 = 10;
    /// Server reads client memory.
    pub const DMA_READ: u16 = 11;
    /// Server writes client memory.
    pub const DMA_WRITE: u16 = 12;
    /// Reset the device.
    pub const DEVICE_RESET: u16 = 13;
    /// Several small region writes in one message.
    pub const REGION_WRITE_MULTI: u16 = 15;

    /// Name of a command, for logs and errors.
    pub fn name(c: u16) -> &'static str {
        match c {
            VERSION => "VERSION",
            DMA_MAP => "DMA_MAP",
            DMA_UNMAP => "DMA_UNMAP",
            DEVICE_GET_INFO => "DEVICE_GET_INFO",
            DEVICE_GET_REGION_INFO => "DEVICE_GET_REGION_INFO",
            DEVICE_GET_REGION_IO_FDS => "DEVICE_GET_REGION_IO_FDS",
            DEVICE_GET_IRQ_INFO => "DEVICE_GET_IRQ_INFO",
            DEVICE_SET_IRQS => "DEVICE_SET_IRQS",
            REGION_READ => "REGION_READ",
            REGION_WRITE => "REGION_WRITE",
            DMA_READ => "DMA_READ",
            DMA_WRITE => "DMA_WRITE",
            DEVICE_RESET => "DEVICE_RESET",
            REGION_WRITE_MULTI => "REGION_WRITE_MULTI",
            _ => "UNKNOWN",
        }
    }
}

/// Size of the message header.
pub const HEADER_SIZE: usize = 16;
/// Largest data transfer this implementation proposes and accepts (the spec default).
pub const MAX_DATA_XFER: u32 = 1 << 20;
/// Largest whole message accepted: a full data transfer plus headers and slack for capability
/// lists. Anything larger is a protocol error, not an allocation.
pub const MAX_MESSAGE_SIZE: u32 = MAX_DATA_XFER + 4096;
/// Most fds accepted with one message.
pub const MAX_FDS: usize = 16;

/// Header flag bits.
pub mod flags {
    /// Mask of the message type bits.
    pub const TYPE_MASK: u32 = 0xf;
    /// A command.
    pub const TYPE_COMMAND: u32 = 0;
    /// A reply.
    pub const TYPE_REPLY: u32 = 1;
    /// The command wants no reply (posted).
    pub const NO_REPLY: u32 = 1 << 4;
    /// The reply reports an error.
    pub const ERROR: u32 = 1 << 5;
}

/// Region indices of a PCI device (`VFIO_PCI_*_REGION_INDEX`).
pub mod region {
    use super::sys;
    /// BAR0; BAR n is `BAR0 + n`.
    pub const BAR0: u32 = sys::VFIO_PCI_BAR0_REGION_INDEX;
    /// Expansion ROM.
    pub const ROM: u32 = sys::VFIO_PCI_ROM_REGION_INDEX;
    /// Configuration space.
    pub const CONFIG: u32 = sys::VFIO_PCI_CONFIG_REGION_INDEX;
    /// Number of standard PCI regions (BAR0–5, ROM, config, VGA).
    pub const NUM_PCI: u32 = sys::VFIO_PCI_NUM_REGIONS;
    /// Region may be read.
    pub const FLAG_READ: u32 = sys::VFIO_REGION_INFO_FLAG_READ;
    /// Region may be written.
    pub const FLAG_WRITE: u32 = sys::VFIO_REGION_INFO_FLAG_WRITE;
    /// Region (or part of it) may be mmapped.
    pub const FLAG_MMAP: u32 = sys::VFIO_REGION_INFO_FLAG_MMAP;
    /// Reply carries a capability list.
    pub const FLAG_CAPS: u32 = sys::VFIO_REGION_INFO_FLAG_CAPS;
    /// Sparse mmap capability id.
    pub const CAP_SPARSE_MMAP: u16 = sys::VFIO_REGION_INFO_CAP_SPARSE_MMAP as u16;
}

/// IRQ indices and flags of a PCI device.
pub mod irq {
    use super::sys;
    /// Legacy INTx.
    pub const INTX: u32 = sys::VFIO_PCI_INTX_IRQ_INDEX;
    /// MSI.
    pub const MSI: u32 = sys::VFIO_PCI_MSI_IRQ_INDEX;
    /// MSI-X.
    pub const MSIX: u32 = sys::VFIO_PCI_MSIX_IRQ_INDEX;
    /// Error reporting.
    pub const ERR: u32 = sys::VFIO_PCI_ERR_IRQ_INDEX;
    /// Device request.
    pub const REQ: u32 = sys::VFIO_PCI_REQ_IRQ_INDEX;
    /// Number of IRQ indices of a PCI device.
    pub const NUM_PCI: u32 = sys::VFIO_PCI_NUM_IRQS;
    /// IRQ info: eventfd signalling supported.
    pub const INFO_EVENTFD: u32 = sys::VFIO_IRQ_INFO_EVENTFD;
    /// IRQ info: interrupts are set up as a set.
    pub const INFO_NORESIZE: u32 = sys::VFIO_IRQ_INFO_NORESIZE;
    /// SET_IRQS data: none.
    pub const SET_DATA_NONE: u32 = sys::VFIO_IRQ_SET_DATA_NONE;
    /// SET_IRQS data: array of bools.
    pub const SET_DATA_BOOL: u32 = sys::VFIO_IRQ_SET_DATA_BOOL;
    /// SET_IRQS data: eventfds in the ancillary data.
    pub const SET_DATA_EVENTFD: u32 = sys::VFIO_IRQ_SET_DATA_EVENTFD;
    /// SET_IRQS action: mask.
    pub const SET_ACTION_MASK: u32 = sys::VFIO_IRQ_SET_ACTION_MASK;
    /// SET_IRQS action: unmask.
    pub const SET_ACTION_UNMASK: u32 = sys::VFIO_IRQ_SET_ACTION_UNMASK;
    /// SET_IRQS action: trigger.
    pub const SET_ACTION_TRIGGER: u32 = sys::VFIO_IRQ_SET_ACTION_TRIGGER;
    /// Mask of the data-type bits.
    pub const SET_DATA_MASK: u32 = SET_DATA_NONE | SET_DATA_BOOL | SET_DATA_EVENTFD;
    /// Mask of the action bits.
    pub const SET_ACTION_MASK_ALL: u32 = SET_ACTION_MASK | SET_ACTION_UNMASK | SET_ACTION_TRIGGER;

    /// Name of an IRQ index.
    pub fn name(index: u32) -> &'static str {
        match index {
            INTX => "INTx",
            MSI => "MSI",
            MSIX => "MSI-X",
            ERR => "ERR",
            REQ => "REQ",
            _ => "unknown",
        }
    }
}

/// Device info flags.
pub mod device {
    use super::sys;
    /// The device supports DEVICE_RESET.
    pub const FLAG_RESET: u32 = sys::VFIO_DEVICE_FLAGS_RESET;
    /// The device is a PCI device.
    pub const FLAG_PCI: u32 = sys::VFIO_DEVICE_FLAGS_PCI;
}

/// DMA map flags.
pub mod dma {
    /// The region is readable by the device.
    pub const FLAG_READ: u32 = 1;
    /// The region is writable by the device.
    pub const FLAG_WRITE: u32 = 2;
    /// DMA_UNMAP: also return a dirty-page bitmap (migration; not supported here).
    pub const UNMAP_FLAG_GET_DIRTY_BITMAP: u32 = 1;
    /// DMA_UNMAP: remove every mapping (`addr` and `size` must be 0).
    pub const UNMAP_FLAG_ALL: u32 = 2;
}

/// I/O fd sub-region type: ioeventfd.
pub const IO_FD_TYPE_IOEVENTFD: u32 = 0;
/// ioeventfd flag: only a write of `datamatch` triggers the fd.
pub const IOEVENTFD_FLAG_DATAMATCH: u32 = 1;

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The payload is shorter than its fixed part.
    #[error("{what}: payload of {got} bytes is shorter than the {need} bytes required")]
    Truncated {
        /// The structure being decoded.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        got: usize,
    },
    /// A field holds a value the protocol does not allow.
    #[error("{what}: {why}")]
    Invalid {
        /// The structure being decoded.
        what: &'static str,
        /// What is wrong.
        why: String,
    },
}

fn invalid(what: &'static str, why: impl Into<String>) -> WireError {
    WireError::Invalid {
        what,
        why: why.into(),
    }
}

/// A cursor over untrusted bytes.
struct Reader<'a> {
    what: &'static str,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(what: &'static str, buf: &'a [u8], need: usize) -> Result<Self, WireError> {
        if buf.len() < need {
            return Err(WireError::Truncated {
                what,
                need,
                got: buf.len(),
            });
        }
        Ok(Self { what, buf, pos: 0 })
    }
    fn take<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let end = self.pos + N;
        let bytes = self.buf.get(self.pos..end).ok_or(WireError::Truncated {
            what: self.what,
            need: end,
            got: self.buf.len(),
        })?;
        self.pos = end;
        Ok(bytes.try_into().expect("slice of length N"))
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_ne_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_ne_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_ne_bytes(self.take()?))
    }
    fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }
}

/// Appends host-endian fields to a payload.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
}

/// The header's layout on the wire (little-endian; pinned by a test).
#[derive(
    Debug,
    Clone,
    Copy,
    zerocopy::FromBytes,
    zerocopy::IntoBytes,
    zerocopy::KnownLayout,
    zerocopy::Immutable,
)]
#[repr(C)]
pub struct RawHeader {
    /// Message id.
    pub msg_id: zerocopy::little_endian::U16,
    /// Command.
    pub command: zerocopy::little_endian::U16,
    /// Whole message size.
    pub size: zerocopy::little_endian::U32,
    /// Flags.
    pub flags: zerocopy::little_endian::U32,
    /// errno.
    pub error: zerocopy::little_endian::U32,
}

/// The 16-byte message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Message id, echoed in the reply.
    pub msg_id: u16,
    /// Command number.
    pub command: u16,
    /// Size of the whole message including this header.
    pub size: u32,
    /// Type, no-reply and error bits.
    pub flags: u32,
    /// errno of a failed command (replies only).
    pub error: u32,
}

impl Header {
    /// A command header for a payload of `payload_len` bytes.
    pub fn command(msg_id: u16, command: u16, payload_len: usize) -> Self {
        Self {
            msg_id,
            command,
            size: (HEADER_SIZE + payload_len) as u32,
            flags: flags::TYPE_COMMAND,
            error: 0,
        }
    }
    /// A successful reply to `to` with a payload of `payload_len` bytes.
    pub fn reply(to: &Header, payload_len: usize) -> Self {
        Self {
            msg_id: to.msg_id,
            command: to.command,
            size: (HEADER_SIZE + payload_len) as u32,
            flags: flags::TYPE_REPLY,
            error: 0,
        }
    }
    /// An error reply to `to`: header only, per the specification.
    pub fn error_reply(to: &Header, errno: u32) -> Self {
        Self {
            msg_id: to.msg_id,
            command: to.command,
            size: HEADER_SIZE as u32,
            flags: flags::TYPE_REPLY | flags::ERROR,
            error: errno,
        }
    }
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let raw = RawHeader {
            msg_id: self.msg_id.into(),
            command: self.command.into(),
            size: self.size.into(),
            flags: self.flags.into(),
            error: self.error.into(),
        };
        zerocopy::transmute!(raw)
    }
    /// Decodes and validates a header: its type and size must make sense.
    pub fn decode(b: &[u8; HEADER_SIZE]) -> Result<Self, WireError> {
        let raw: RawHeader = zerocopy::transmute!(*b);
        let h = Self {
            msg_id: raw.msg_id.get(),
            command: raw.command.get(),
            size: raw.size.get(),
            flags: raw.flags.get(),
            error: raw.error.get(),
        };
        if (h.size as usize) < HEADER_SIZE {
            return Err(invalid(
                "header",
                format!("message size {} is below 16", h.size),
            ));
        }
        if h.size > MAX_MESSAGE_SIZE {
            return Err(invalid(
                "header",
                format!(
                    "message size {} exceeds the limit {MAX_MESSAGE_SIZE}",
                    h.size
                ),
            ));
        }
        let ty = h.flags & flags::TYPE_MASK;
        if ty != flags::TYPE_COMMAND && ty != flags::TYPE_REPLY {
            return Err(invalid("header", format!("unknown message type {ty}")));
        }
        Ok(h)
    }
    /// Whether this is a reply.
    pub fn is_reply(&self) -> bool {
        self.flags & flags::TYPE_MASK == flags::TYPE_REPLY
    }
    /// Whether a command asks for no reply.
    pub fn no_reply(&self) -> bool {
        self.flags & flags::NO_REPLY != 0
    }
    /// Whether a reply reports an error.
    pub fn is_error(&self) -> bool {
        self.flags & flags::ERROR != 0
    }
    /// Payload length.
    pub fn payload_len(&self) -> usize {
        self.size as usize - HEADER_SIZE
    }
}

/// VERSION payload: version and JSON capabilities.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    /// Major version.
    pub major: u16,
    /// Minor version.
    pub minor: u16,
    /// JSON capabilities (without the terminating NUL).
    pub json: String,
}

impl Version {
    /// Encodes, adding the terminating NUL.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u16(self.major)
            .u16(self.minor)
            .bytes(self.json.as_bytes())
            .bytes(&[0]);
        w.0
    }
    /// Decodes; the JSON must be UTF-8 and NUL-terminated if present.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new("version", b, 4)?;
        let major = r.u16()?;
        let minor = r.u16()?;
        let rest = r.rest();
        let json = match rest.split_last() {
            None => String::new(),
            Some((0, body)) => std::str::from_utf8(body)
                .map_err(|_| invalid("version", "capabilities are not UTF-8"))?
                .to_owned(),
            Some(_) => return Err(invalid("version", "capabilities are not NUL-terminated")),
        };
        if json.contains('\0') {
            return Err(invalid("version", "capabilities contain a NUL byte"));
        }
        Ok(Self { major, minor, json })
    }
}

/// Declares a payload of four u32 fields with its codec: several VFIO structures
/// (`vfio_device_info`, `vfio_irq_info`, the IO-fds request) have exactly this shape.
macro_rules! u32x4_payload {
    ($(#[$doc:meta])* $name:ident, $what:literal, $($(#[$fdoc:meta])* $field:ident),+) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        pub struct $name {
            $($(#[$fdoc])* pub $field: u32,)+
        }

        impl $name {
            /// Encoded size.
            pub const SIZE: usize = 16;
            /// Encodes.
            pub fn encode(&self) -> Vec<u8> {
                let mut w = Writer::default();
                $(w.u32(self.$field);)+
                w.0
            }
            /// Decodes.
            pub fn decode(b: &[u8]) -> Result<Self, WireError> {
                let mut r = Reader::new($what, b, Self::SIZE)?;
                Ok(Self { $($field: r.u32()?,)+ })
            }
        }
    };
}

u32x4_payload!(
    /// DEVICE_GET_INFO payload (request and reply).
    DeviceInfo, "device info",
    /// Maximum reply size (request) / size needed (reply).
    argsz,
    /// `device::FLAG_*`.
    flags,
    /// Number of regions.
    num_regions,
    /// Number of IRQ indices.
    num_irqs
);

u32x4_payload!(
    /// DEVICE_GET_REGION_IO_FDS request.
    IoFdsRequest, "region io fds",
    /// Maximum reply size.
    argsz,
    /// Must be zero.
    flags,
    /// Region index.
    index,
    /// Must be zero.
    count
);

u32x4_payload!(
    /// DEVICE_GET_IRQ_INFO payload (request and reply).
    IrqInfo, "irq info",
    /// Maximum reply size / size needed.
    argsz,
    /// `irq::INFO_*`.
    flags,
    /// IRQ index.
    index,
    /// Number of vectors.
    count
);

/// One mmappable area of a region (`struct vfio_region_sparse_mmap_area`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseArea {
    /// Offset of the area within the region (and, added to the region's mmap offset, in the fd).
    pub offset: u64,
    /// Size of the area.
    pub size: u64,
}

/// DEVICE_GET_REGION_INFO payload (`struct vfio_region_info` and its capability list).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RegionInfo {
    /// Maximum reply size (request) / size needed (reply).
    pub argsz: u32,
    /// `region::FLAG_*`.
    pub flags: u32,
    /// Region index.
    pub index: u32,
    /// Offset of the first capability from the start of this structure, or 0.
    pub cap_offset: u32,
    /// Region size.
    pub size: u64,
    /// mmap offset in the region's fd.
    pub offset: u64,
    /// Sparse mmap areas decoded from the capability list.
    pub sparse: Vec<SparseArea>,
}

impl RegionInfo {
    /// Size of the fixed part.
    pub const SIZE: usize = 32;

    /// Encodes the fixed part and, when `sparse` is not empty, a sparse-mmap capability;
    /// `argsz` and `cap_offset` are filled in. If `max` (the request's argsz) is smaller than the
    /// full reply, only the fixed part is sent and `argsz` tells the client what to ask for.
    pub fn encode_reply(&self, max: u32) -> Vec<u8> {
        let caps_len = if self.sparse.is_empty() {
            0
        } else {
            16 + 16 * self.sparse.len()
        };
        let full = (Self::SIZE + caps_len) as u32;
        let fits = max >= full;
        let mut flags = self.flags;
        // As in libvfio-user: the flag announces a capability list only where one is sent.
        if caps_len > 0 && fits {
            flags |= region::FLAG_CAPS;
        }
        let mut w = Writer::default();
        w.u32(full)
            .u32(flags)
            .u32(self.index)
            .u32(if caps_len > 0 && fits {
                Self::SIZE as u32
            } else {
                0
            })
            .u64(self.size)
            .u64(self.offset);
        if caps_len > 0 && fits {
            // struct vfio_info_cap_header + struct vfio_region_info_cap_sparse_mmap
            w.u16(region::CAP_SPARSE_MMAP).u16(1).u32(0);
            w.u32(self.sparse.len() as u32).u32(0);
            for a in &self.sparse {
                w.u64(a.offset).u64(a.size);
            }
        }
        w.0
    }

    /// Whether an encoded reply is whole: its `argsz` (the full size) is what was sent.
    pub fn is_whole_reply(reply: &[u8]) -> bool {
        reply.len() >= 4
            && u32::from_le_bytes(reply[..4].try_into().expect("4 bytes")) as usize == reply.len()
    }

    /// Encodes a request for region `index` allowing a reply of `argsz` bytes.
    pub fn encode_request(index: u32, argsz: u32) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(argsz).u32(0).u32(index).u32(0).u64(0).u64(0);
        w.0
    }

    /// Decodes a request or reply, walking the capability list defensively: every capability
    /// must lie inside the payload and each `next` must move forward.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "region info";
        let mut r = Reader::new(WHAT, b, Self::SIZE)?;
        let mut info = Self {
            argsz: r.u32()?,
            flags: r.u32()?,
            index: r.u32()?,
            cap_offset: r.u32()?,
            size: r.u64()?,
            offset: r.u64()?,
            sparse: Vec::new(),
        };
        let mut next = info.cap_offset as usize;
        let mut hops = 0;
        while next != 0 && info.flags & region::FLAG_CAPS != 0 {
            if next < Self::SIZE || next + 8 > b.len() {
                // The client asked with a small argsz: capabilities are not present.
                if next >= b.len() {
                    break;
                }
                return Err(invalid(
                    WHAT,
                    format!("capability at {next} is outside the reply"),
                ));
            }
            hops += 1;
            if hops > 64 {
                return Err(invalid(WHAT, "capability list is too long or loops"));
            }
            let mut c = Reader::new(WHAT, &b[next..], 8)?;
            let id = c.u16()?;
            let _version = c.u16()?;
            let following = c.u32()? as usize;
            if id == region::CAP_SPARSE_MMAP {
                let nr = c.u32()? as usize;
                let _reserved = c.u32()?;
                if nr > 1024 || c.rest().len() < nr * 16 {
                    return Err(invalid(
                        WHAT,
                        format!("sparse capability claims {nr} areas"),
                    ));
                }
                for _ in 0..nr {
                    let offset = c.u64()?;
                    let size = c.u64()?;
                    info.sparse.push(SparseArea { offset, size });
                }
            }
            if following != 0 && following <= next {
                return Err(invalid(WHAT, "capability list does not move forward"));
            }
            next = following;
        }
        Ok(info)
    }
}

/// One sub-region of a DEVICE_GET_REGION_IO_FDS reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoFdSubRegion {
    /// Offset within the region.
    pub offset: u64,
    /// Size of the access that triggers it (0: any).
    pub size: u64,
    /// Index of the fd in the ancillary data.
    pub fd_index: u32,
    /// `IO_FD_TYPE_*`.
    pub kind: u32,
    /// `IOEVENTFD_FLAG_*`.
    pub flags: u32,
    /// Value to match when `IOEVENTFD_FLAG_DATAMATCH` is set.
    pub datamatch: u64,
}

/// DEVICE_GET_REGION_IO_FDS reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoFdsReply {
    /// Size of the full reply.
    pub argsz: u32,
    /// Region index.
    pub index: u32,
    /// Sub-regions (empty when the client's argsz was too small to hold them).
    pub subs: Vec<IoFdSubRegion>,
    /// Number of sub-regions the device has.
    pub count: u32,
}

impl IoFdsReply {
    /// Encoded size of one sub-region.
    pub const SUB_SIZE: usize = 40;
    /// Encodes, leaving out the array if `max` is too small for it.
    pub fn encode(index: u32, subs: &[IoFdSubRegion], max: u32) -> Vec<u8> {
        let full = (IoFdsRequest::SIZE + Self::SUB_SIZE * subs.len()) as u32;
        let mut w = Writer::default();
        w.u32(full).u32(0).u32(index).u32(subs.len() as u32);
        if max >= full {
            for s in subs {
                w.u64(s.offset)
                    .u64(s.size)
                    .u32(s.fd_index)
                    .u32(s.kind)
                    .u32(s.flags)
                    .u32(0);
                w.u64(s.datamatch);
            }
        }
        w.0
    }
    /// Decodes.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "region io fds reply";
        let mut r = Reader::new(WHAT, b, IoFdsRequest::SIZE)?;
        let argsz = r.u32()?;
        let _flags = r.u32()?;
        let index = r.u32()?;
        let count = r.u32()?;
        let mut subs = Vec::new();
        let avail = r.rest().len();
        if count > 0 && avail > 0 {
            // Entry i is at i * ((argsz - 16) / count), per the spec's forward-compatible rule.
            let stride = (argsz as usize).saturating_sub(IoFdsRequest::SIZE) / count as usize;
            if stride < Self::SUB_SIZE || stride * count as usize > avail {
                return Err(invalid(
                    WHAT,
                    format!("{count} sub-regions do not fit in {avail} bytes"),
                ));
            }
            for i in 0..count as usize {
                let mut s = Reader::new(WHAT, &r.rest()[i * stride..], Self::SUB_SIZE)?;
                let offset = s.u64()?;
                let size = s.u64()?;
                let fd_index = s.u32()?;
                let kind = s.u32()?;
                let flags = s.u32()?;
                let _pad = s.u32()?;
                let datamatch = s.u64()?;
                subs.push(IoFdSubRegion {
                    offset,
                    size,
                    fd_index,
                    kind,
                    flags,
                    datamatch,
                });
            }
        }
        Ok(Self {
            argsz,
            index,
            subs,
            count,
        })
    }
}

/// DEVICE_SET_IRQS payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IrqSet {
    /// Size of the request payload.
    pub argsz: u32,
    /// One `SET_DATA_*` and one `SET_ACTION_*` bit.
    pub flags: u32,
    /// IRQ index.
    pub index: u32,
    /// First vector.
    pub start: u32,
    /// Number of vectors.
    pub count: u32,
    /// Bool array for `SET_DATA_BOOL`.
    pub data: Vec<u8>,
}

impl IrqSet {
    /// Size of the fixed part.
    pub const SIZE: usize = 20;
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32((Self::SIZE + self.data.len()) as u32)
            .u32(self.flags)
            .u32(self.index)
            .u32(self.start)
            .u32(self.count)
            .bytes(&self.data);
        w.0
    }
    /// Decodes and checks that exactly one data type and one action are given, and that a bool
    /// array covers `count` vectors.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "set irqs";
        let mut r = Reader::new(WHAT, b, Self::SIZE)?;
        let s = Self {
            argsz: r.u32()?,
            flags: r.u32()?,
            index: r.u32()?,
            start: r.u32()?,
            count: r.u32()?,
            data: r.rest().to_vec(),
        };
        let data = s.flags & irq::SET_DATA_MASK;
        let action = s.flags & irq::SET_ACTION_MASK_ALL;
        if data.count_ones() != 1 || action.count_ones() != 1 {
            return Err(invalid(
                WHAT,
                format!("flags {:#x} need one data type and one action", s.flags),
            ));
        }
        if s.flags & !(irq::SET_DATA_MASK | irq::SET_ACTION_MASK_ALL) != 0 {
            return Err(invalid(WHAT, format!("unknown flags {:#x}", s.flags)));
        }
        if data == irq::SET_DATA_BOOL && s.data.len() < s.count as usize {
            return Err(invalid(WHAT, "bool array shorter than count"));
        }
        if s.start.checked_add(s.count).is_none() {
            return Err(invalid(WHAT, "start + count overflows"));
        }
        Ok(s)
    }
}

/// REGION_READ / REGION_WRITE payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionAccess {
    /// Offset within the region.
    pub offset: u64,
    /// Region index.
    pub region: u32,
    /// Bytes to transfer.
    pub count: u32,
    /// Data (write requests and read replies).
    pub data: Vec<u8>,
}

impl RegionAccess {
    /// Size of the fixed part.
    pub const SIZE: usize = 16;
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.offset)
            .u32(self.region)
            .u32(self.count)
            .bytes(&self.data);
        w.0
    }
    /// Decodes; `with_data` says whether `count` bytes of data must follow.
    pub fn decode(b: &[u8], with_data: bool) -> Result<Self, WireError> {
        const WHAT: &str = "region access";
        let mut r = Reader::new(WHAT, b, Self::SIZE)?;
        let offset = r.u64()?;
        let region = r.u32()?;
        let count = r.u32()?;
        if count > MAX_DATA_XFER {
            return Err(invalid(
                WHAT,
                format!("count {count} exceeds max_data_xfer_size"),
            ));
        }
        let rest = r.rest();
        let data = if with_data {
            if rest.len() != count as usize {
                return Err(invalid(
                    WHAT,
                    format!("count {count} but {} data bytes", rest.len()),
                ));
            }
            rest.to_vec()
        } else {
            Vec::new()
        };
        Ok(Self {
            offset,
            region,
            count,
            data,
        })
    }
}

/// DMA_MAP payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaMap {
    /// Size of this structure (32).
    pub argsz: u32,
    /// `dma::FLAG_*`.
    pub flags: u32,
    /// Offset in the fd, if one is passed.
    pub offset: u64,
    /// Base DMA address (IOVA).
    pub addr: u64,
    /// Size.
    pub size: u64,
}

impl DmaMap {
    /// Encoded size.
    pub const SIZE: usize = 32;
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(self.argsz)
            .u32(self.flags)
            .u64(self.offset)
            .u64(self.addr)
            .u64(self.size);
        w.0
    }
    /// Decodes and rejects empty or wrapping ranges.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new("dma map", b, Self::SIZE)?;
        let m = Self {
            argsz: r.u32()?,
            flags: r.u32()?,
            offset: r.u64()?,
            addr: r.u64()?,
            size: r.u64()?,
        };
        if m.size == 0 || m.addr.checked_add(m.size).is_none() {
            return Err(invalid(
                "dma map",
                format!("bad range {:#x}+{:#x}", m.addr, m.size),
            ));
        }
        if m.flags & !(dma::FLAG_READ | dma::FLAG_WRITE) != 0 {
            return Err(invalid("dma map", format!("unknown flags {:#x}", m.flags)));
        }
        Ok(m)
    }
}

/// DMA_UNMAP payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaUnmap {
    /// Maximum reply size.
    pub argsz: u32,
    /// 0, or [`dma::UNMAP_FLAG_ALL`] (dirty bitmaps are not supported).
    pub flags: u32,
    /// Base DMA address.
    pub addr: u64,
    /// Size.
    pub size: u64,
}

impl DmaUnmap {
    /// Encoded size.
    pub const SIZE: usize = 24;
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(self.argsz)
            .u32(self.flags)
            .u64(self.addr)
            .u64(self.size);
        w.0
    }
    /// Decodes.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new("dma unmap", b, Self::SIZE)?;
        Ok(Self {
            argsz: r.u32()?,
            flags: r.u32()?,
            addr: r.u64()?,
            size: r.u64()?,
        })
    }
}

/// DMA_READ / DMA_WRITE payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DmaAccess {
    /// Client DMA address.
    pub addr: u64,
    /// Bytes to transfer.
    pub count: u64,
    /// Data (write requests and read replies).
    pub data: Vec<u8>,
}

impl DmaAccess {
    /// Size of the fixed part.
    pub const SIZE: usize = 16;
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.addr).u64(self.count).bytes(&self.data);
        w.0
    }
    /// Decodes; `with_data` says whether `count` bytes of data must follow.
    pub fn decode(b: &[u8], with_data: bool) -> Result<Self, WireError> {
        const WHAT: &str = "dma access";
        let mut r = Reader::new(WHAT, b, Self::SIZE)?;
        let addr = r.u64()?;
        let count = r.u64()?;
        if count > MAX_DATA_XFER as u64 {
            return Err(invalid(
                WHAT,
                format!("count {count} exceeds max_data_xfer_size"),
            ));
        }
        let rest = r.rest();
        let data = if with_data {
            if rest.len() as u64 != count {
                return Err(invalid(
                    WHAT,
                    format!("count {count} but {} data bytes", rest.len()),
                ));
            }
            rest.to_vec()
        } else {
            Vec::new()
        };
        Ok(Self { addr, count, data })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn header_layout_is_pinned() {
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<RawHeader>(), HEADER_SIZE);
        assert_eq!(offset_of!(RawHeader, command), 2);
        assert_eq!(offset_of!(RawHeader, size), 4);
        assert_eq!(offset_of!(RawHeader, flags), 8);
        assert_eq!(offset_of!(RawHeader, error), 12);
        let h = Header::command(0x0102, 0x0304, 4);
        assert_eq!(
            h.encode(),
            [2, 1, 4, 3, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            "little-endian, command type"
        );
    }

    #[test]
    fn header_round_trip_and_limits() {
        let h = Header::command(7, cmd::REGION_READ, 16);
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut big = h;
        big.size = MAX_MESSAGE_SIZE + 1;
        assert!(Header::decode(&big.encode()).is_err());
        let mut small = h;
        small.size = 3;
        assert!(Header::decode(&small.encode()).is_err());
        let mut ty = h;
        ty.flags = 7;
        assert!(Header::decode(&ty.encode()).is_err());
    }

    #[test]
    fn region_info_with_sparse_areas_round_trips() {
        let info = RegionInfo {
            flags: region::FLAG_READ | region::FLAG_MMAP,
            index: 0,
            size: 0x4000,
            offset: 0,
            sparse: vec![SparseArea {
                offset: 0x2000,
                size: 0x1000,
            }],
            ..Default::default()
        };
        let full = info.encode_reply(u32::MAX);
        let back = RegionInfo::decode(&full).unwrap();
        assert_eq!(back.sparse, info.sparse);
        assert_eq!(back.argsz as usize, full.len());
        // A client that asked for only the fixed part gets argsz telling it to ask again.
        let short = info.encode_reply(32);
        assert_eq!(short.len(), 32);
        let back = RegionInfo::decode(&short).unwrap();
        assert!(back.sparse.is_empty());
        assert_eq!(back.argsz as usize, full.len());
    }

    #[test]
    fn set_irqs_requires_one_data_and_one_action() {
        let mut s = IrqSet {
            argsz: 20,
            flags: irq::SET_DATA_EVENTFD | irq::SET_ACTION_TRIGGER,
            index: irq::MSIX,
            start: 0,
            count: 2,
            data: vec![],
        };
        assert!(IrqSet::decode(&s.encode()).is_ok());
        s.flags = irq::SET_DATA_EVENTFD | irq::SET_DATA_BOOL | irq::SET_ACTION_TRIGGER;
        assert!(IrqSet::decode(&s.encode()).is_err());
        s.flags = irq::SET_DATA_BOOL | irq::SET_ACTION_TRIGGER;
        assert!(IrqSet::decode(&s.encode()).is_err(), "bool array missing");
    }

    #[test]
    fn region_access_count_must_match_data() {
        let a = RegionAccess {
            offset: 0,
            region: 0,
            count: 4,
            data: vec![1, 2, 3],
        };
        assert!(RegionAccess::decode(&a.encode(), true).is_err());
    }

    #[test]
    fn version_json_must_be_nul_terminated() {
        let v = Version {
            major: 0,
            minor: 1,
            json: "{}".into(),
        };
        assert_eq!(Version::decode(&v.encode()).unwrap(), v);
        assert!(Version::decode(&[0, 0, 1, 0, b'{', b'}']).is_err());
    }

    proptest! {
        // Decoders see arbitrary bytes from an untrusted peer: they must return, never panic.
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Version::decode(&bytes);
            let _ = DeviceInfo::decode(&bytes);
            let _ = RegionInfo::decode(&bytes);
            let _ = IoFdsRequest::decode(&bytes);
            let _ = IoFdsReply::decode(&bytes);
            let _ = IrqInfo::decode(&bytes);
            let _ = IrqSet::decode(&bytes);
            let _ = RegionAccess::decode(&bytes, true);
            let _ = RegionAccess::decode(&bytes, false);
            let _ = DmaMap::decode(&bytes);
            let _ = DmaUnmap::decode(&bytes);
            let _ = DmaAccess::decode(&bytes, true);
            if bytes.len() >= HEADER_SIZE {
                let _ = Header::decode(bytes[..HEADER_SIZE].try_into().unwrap());
            }
        }

        #[test]
        fn region_info_caps_never_panic(
            cap_offset in 0u32..200,
            mut tail in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut b = RegionInfo { flags: region::FLAG_CAPS, cap_offset, ..Default::default() }
                .encode_reply(0);
            // encode_reply drops cap_offset when nothing fits; put it back to fuzz the walk.
            b[12..16].copy_from_slice(&cap_offset.to_ne_bytes());
            b.append(&mut tail);
            let _ = RegionInfo::decode(&b);
        }

        #[test]
        fn dma_map_round_trips(addr in 0u64..1 << 48, size in 1u64..1 << 40, flags in 0u32..4) {
            let m = DmaMap { argsz: 32, flags, offset: 0, addr, size };
            prop_assert_eq!(DmaMap::decode(&m.encode()).unwrap(), m);
        }
    }
}
