//! PCI configuration space (PCI Local Bus Specification 3.0, §6; PCI Express Base 4.0 §7.5).

/// Size of conventional configuration space.
pub const CONFIG_SPACE_SIZE: usize = 256;

/// Vendor ID (16 bits).
pub const VENDOR_ID: u64 = 0x00;
/// Device ID (16 bits).
pub const DEVICE_ID: u64 = 0x02;
/// Command register (16 bits).
pub const COMMAND: u64 = 0x04;
/// Status register (16 bits).
pub const STATUS: u64 = 0x06;
/// Revision ID (8 bits).
pub const REVISION_ID: u64 = 0x08;
/// Programming interface (8 bits); class code is bytes 0x09..0x0c.
pub const CLASS_PROG_IF: u64 = 0x09;
/// Subclass (8 bits).
pub const CLASS_SUB: u64 = 0x0a;
/// Base class (8 bits).
pub const CLASS_BASE: u64 = 0x0b;
/// Header type (8 bits).
pub const HEADER_TYPE: u64 = 0x0e;
/// First base address register; BAR n is at `BAR0 + 4 * n`.
pub const BAR0: u64 = 0x10;
/// Subsystem vendor ID (16 bits).
pub const SUBSYSTEM_VENDOR_ID: u64 = 0x2c;
/// Subsystem ID (16 bits).
pub const SUBSYSTEM_ID: u64 = 0x2e;
/// Expansion ROM base address (32 bits).
pub const ROM_ADDRESS: u64 = 0x30;
/// Capabilities pointer (8 bits).
pub const CAPABILITIES_POINTER: u64 = 0x34;
/// Interrupt line (8 bits).
pub const INTERRUPT_LINE: u64 = 0x3c;
/// Interrupt pin (8 bits).
pub const INTERRUPT_PIN: u64 = 0x3d;

/// Offset of base address register `n` (0..6).
pub const fn bar(n: u8) -> u64 {
    BAR0 + 4 * n as u64
}

/// Command register: respond to I/O space accesses.
pub const COMMAND_IO: u16 = 1 << 0;
/// Command register: respond to memory space accesses.
pub const COMMAND_MEMORY: u16 = 1 << 1;
/// Command register: the device may master the bus (DMA).
pub const COMMAND_BUS_MASTER: u16 = 1 << 2;
/// Command register: INTx emulation disabled.
pub const COMMAND_INTX_DISABLE: u16 = 1 << 10;
/// Status register: a capabilities list is present.
pub const STATUS_CAPABILITIES: u16 = 1 << 4;

/// BAR bit 0: the BAR decodes I/O space.
pub const BAR_IO: u32 = 1;
/// BAR bits 2:1 = 0b10: a 64-bit memory BAR.
pub const BAR_MEM_64: u32 = 0b100;
/// BAR bit 3: prefetchable memory.
pub const BAR_PREFETCH: u32 = 0b1000;

/// Capability ID: MSI.
pub const CAP_ID_MSI: u8 = 0x05;
/// Capability ID: vendor specific (virtio uses it).
pub const CAP_ID_VENDOR: u8 = 0x09;
/// Capability ID: PCI Express.
pub const CAP_ID_PCIE: u8 = 0x10;
/// Capability ID: MSI-X.
pub const CAP_ID_MSIX: u8 = 0x11;

/// Human-readable capability name, for probe output.
pub fn cap_name(id: u8) -> &'static str {
    match id {
        0x01 => "Power Management",
        CAP_ID_MSI => "MSI",
        CAP_ID_VENDOR => "Vendor Specific",
        CAP_ID_PCIE => "PCI Express",
        CAP_ID_MSIX => "MSI-X",
        0x12 => "SATA",
        0x13 => "Advanced Features",
        _ => "unknown",
    }
}

/// MSI-X capability layout (PCI 3.0 §6.8.2).
pub mod msix {
    /// Message control (16 bits) relative to the capability.
    pub const MESSAGE_CONTROL: u64 = 2;
    /// Table offset and BIR (32 bits).
    pub const TABLE: u64 = 4;
    /// PBA offset and BIR (32 bits).
    pub const PBA: u64 = 8;
    /// Capability length.
    pub const CAP_LEN: u8 = 12;
    /// Message control: table size minus one, bits 10:0.
    pub const CONTROL_TABLE_SIZE_MASK: u16 = 0x07ff;
    /// Message control: function mask.
    pub const CONTROL_FUNCTION_MASK: u16 = 1 << 14;
    /// Message control: MSI-X enable.
    pub const CONTROL_ENABLE: u16 = 1 << 15;
    /// Bytes per table entry (address lo, address hi, data, vector control).
    pub const ENTRY_SIZE: u64 = 16;
    /// Low three bits of the table/PBA dword select the BAR.
    pub const BIR_MASK: u32 = 0x7;
}

/// Human-readable class name for a (base class, subclass) pair, for probe output.
pub fn class_name(base: u8, sub: u8) -> &'static str {
    match (base, sub) {
        (0x01, 0x00) => "SCSI storage controller",
        (0x01, 0x06) => "SATA controller",
        (0x01, 0x08) => "Non-Volatile memory controller",
        (0x01, 0x80) => "Mass storage controller",
        (0x01, _) => "Mass storage controller",
        (0x02, 0x00) => "Ethernet controller",
        (0x02, _) => "Network controller",
        (0x03, _) => "Display controller",
        (0x06, 0x00) => "Host bridge",
        (0x06, 0x01) => "ISA bridge",
        (0x06, 0x04) => "PCI bridge",
        (0x06, _) => "Bridge",
        (0x07, 0x00) => "Serial controller",
        (0x08, 0x80) => "System peripheral",
        (0x08, _) => "Base system peripheral",
        (0x0c, 0x03) => "USB controller",
        (0x00, 0xff) | (0xff, _) => "Unassigned class",
        _ => "Unclassified device",
    }
}
