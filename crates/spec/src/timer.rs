//! Outboard's PCI timer: a programmable periodic interrupt and a free-running counter, the
//! device the legacy timer driver and the clock benchmark use. Outboard defines it (there is no
//! public standard for so small a device; `docs/timer.md` is its data sheet, and QEMU's `edu`
//! device uses the same placeholder vendor for the same purpose).
//!
//! One function, vendor [`VENDOR`] device [`DEVICE`], class "system peripheral, other"
//! ([`CLASS`]). BAR 0: [`BAR0_SIZE`] bytes of 32-bit and 64-bit little-endian registers.
//! BAR 1: the MSI-X table (one vector, [`MSIX_VECTORS`]) and its pending-bit array at
//! [`PBA_OFFSET`]. Without MSI-X the tick is raised on INTx.

/// Vendor: the placeholder id QEMU's own teaching devices use.
pub const VENDOR: u16 = 0x1234;
/// Device.
pub const DEVICE: u16 = 0x0b71;
/// Class code: base 0x08 (system peripheral), sub 0x80 (other).
pub const CLASS: u32 = 0x08_80_00;
/// Revision this layout describes.
pub const REVISION: u8 = 1;

/// Bytes of BAR 0.
pub const BAR0_SIZE: u64 = 0x1000;
/// Bytes of BAR 1 (MSI-X table, then the PBA).
pub const BAR1_SIZE: u64 = 0x1000;
/// The PBA's offset in BAR 1.
pub const PBA_OFFSET: u64 = 0x800;
/// MSI-X vectors: one, the tick.
pub const MSIX_VECTORS: u16 = 1;

/// Register offsets in BAR 0.
pub mod reg {
    /// Identity (read-only, 32 bits): [`super::ID_VALUE`].
    pub const ID: u64 = 0x00;
    /// Control (32 bits): [`super::ctrl`] bits.
    pub const CTRL: u64 = 0x04;
    /// Period in nanoseconds (32 bits), [`super::MIN_PERIOD_NS`] to [`super::MAX_PERIOD_NS`];
    /// a value outside is clamped to the nearer bound.
    pub const PERIOD_NS: u64 = 0x08;
    /// Free-running counter (read-only, 64 bits): nanoseconds since the device model started.
    /// A reset does not change it, so time read through it never goes backwards.
    pub const COUNTER_NS: u64 = 0x10;
    /// Ticks (read-only, 64 bits): whole periods since `RUN` was last set (0 while stopped).
    pub const TICKS: u64 = 0x18;
    /// Status (32 bits, write 1 to clear): [`super::status`] bits.
    pub const STATUS: u64 = 0x20;
}

/// The identity register's value: device id in the high half, revision in the low.
pub const ID_VALUE: u32 = (DEVICE as u32) << 16 | REVISION as u32;

/// Control register bits.
pub mod ctrl {
    /// The timer runs: `TICKS` counts periods from the moment this is set.
    pub const RUN: u32 = 1 << 0;
    /// A tick raises the interrupt (on `STATUS.TICK`'s rise).
    pub const IRQ_ENABLE: u32 = 1 << 1;
    /// Bits that exist; others read as zero.
    pub const ALL: u32 = RUN | IRQ_ENABLE;
}

/// Status register bits.
pub mod status {
    /// A tick happened since the driver last cleared this bit. Set on every tick; the
    /// interrupt is raised when it rises (ticks while it is set raise nothing: the driver
    /// reads `TICKS` for how many passed).
    pub const TICK: u32 = 1 << 0;
}

/// Shortest period: 10 µs (100 kHz).
pub const MIN_PERIOD_NS: u32 = 10_000;
/// Longest period: 1 s.
pub const MAX_PERIOD_NS: u32 = 1_000_000_000;
/// The period at power-on unless the model is told otherwise: 1 ms (1 kHz).
pub const DEFAULT_PERIOD_NS: u32 = 1_000_000;

/// A period clamped into the device's range.
pub fn clamp_period(ns: u32) -> u32 {
    ns.clamp(MIN_PERIOD_NS, MAX_PERIOD_NS)
}
