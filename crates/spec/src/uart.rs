//! The 16550A UART (National Semiconductor PC16550D data sheet) as QEMU's `pci-serial` presents
//! it: one UART behind an 8-byte I/O BAR 0 of a PCI function, vendor [`VENDOR`] device
//! [`DEVICE`], class "serial controller, 16550-compatible" ([`CLASS`]), its interrupt on INTx.
//!
//! Registers are one byte each, at BAR offsets 0 to 7 ([`reg`]). Offsets 0 and 1 are the
//! divisor latch while `LCR.DLAB` is set. The baud rate is [`CLOCK_HZ`] / 16 / divisor.

/// Vendor: Red Hat, as QEMU's own PCI devices.
pub const VENDOR: u16 = 0x1b36;
/// Device: QEMU's PCI 16550A (`pci-serial`).
pub const DEVICE: u16 = 0x0002;
/// Class code: base 0x07 (communication), sub 0x00 (serial), prog-if 0x02 (16550).
pub const CLASS: u32 = 0x07_00_02;
/// Revision QEMU gives it.
pub const REVISION: u8 = 1;
/// Bytes of the I/O BAR.
pub const BAR0_SIZE: u64 = 8;

/// The input clock: 1.8432 MHz, so divisor 1 is 115,200 baud.
pub const CLOCK_HZ: u32 = 1_843_200;
/// The fastest rate: divisor 1.
pub const MAX_BAUD: u32 = CLOCK_HZ / 16;
/// Bytes in each FIFO.
pub const FIFO_SIZE: usize = 16;

/// Register offsets in the I/O BAR.
pub mod reg {
    /// Receive buffer (read), transmit holding (write); divisor low byte with `LCR.DLAB`.
    pub const DATA: u64 = 0;
    /// Interrupt enable ([`super::ier`]); divisor high byte with `LCR.DLAB`.
    pub const IER: u64 = 1;
    /// Interrupt identification (read, [`super::iir`]), FIFO control (write, [`super::fcr`]).
    pub const IIR_FCR: u64 = 2;
    /// Line control ([`super::lcr`]).
    pub const LCR: u64 = 3;
    /// Modem control ([`super::mcr`]).
    pub const MCR: u64 = 4;
    /// Line status ([`super::lsr`]).
    pub const LSR: u64 = 5;
    /// Modem status ([`super::msr`]).
    pub const MSR: u64 = 6;
    /// Scratch.
    pub const SCR: u64 = 7;
}

/// Interrupt enable bits.
pub mod ier {
    /// Received data available (and the character timeout).
    pub const RDA: u8 = 1 << 0;
    /// Transmit holding register empty.
    pub const THRE: u8 = 1 << 1;
    /// Receiver line status (overrun, parity, framing, break).
    pub const RLS: u8 = 1 << 2;
    /// Modem status change.
    pub const MSI: u8 = 1 << 3;
    /// The bits a 16550A implements.
    pub const ALL: u8 = 0x0f;
}

/// Interrupt identification: bit 0 clear means one is pending, bits 1–3 say which (highest
/// priority first: line status, data, timeout, transmitter, modem), bits 6–7 set while the
/// FIFOs are on.
pub mod iir {
    /// No interrupt pending.
    pub const NONE: u8 = 0x01;
    /// Receiver line status: cleared by reading LSR.
    pub const RLS: u8 = 0x06;
    /// Received data at the trigger level: cleared when it drops below.
    pub const RDA: u8 = 0x04;
    /// Character timeout: data below the trigger level waited four character times; cleared
    /// by reading DATA.
    pub const TIMEOUT: u8 = 0x0c;
    /// Transmitter holding register empty: cleared by reading IIR (when it is the source) or
    /// writing DATA.
    pub const THRE: u8 = 0x02;
    /// Modem status: cleared by reading MSR.
    pub const MODEM: u8 = 0x00;
    /// The interrupt-identity bits.
    pub const ID_MASK: u8 = 0x0f;
    /// Set while the FIFOs are enabled.
    pub const FIFOS_ON: u8 = 0xc0;
}

/// FIFO control bits (write-only).
pub mod fcr {
    /// Enables both FIFOs (clearing it empties them).
    pub const ENABLE: u8 = 1 << 0;
    /// Empties the receive FIFO (self-clearing).
    pub const CLEAR_RX: u8 = 1 << 1;
    /// Empties the transmit FIFO (self-clearing).
    pub const CLEAR_TX: u8 = 1 << 2;
    /// The receive trigger level: bits 6–7 select 1, 4, 8 or 14 bytes.
    pub const TRIGGER_SHIFT: u8 = 6;
    /// Receive trigger levels by the value of bits 6–7.
    pub const TRIGGER_LEVELS: [usize; 4] = [1, 4, 8, 14];
}

/// Line control bits.
pub mod lcr {
    /// Bits 0–1: data bits minus five.
    pub const WORD_MASK: u8 = 0x03;
    /// Two stop bits (1.5 with five data bits).
    pub const STOP2: u8 = 1 << 2;
    /// Parity on.
    pub const PARITY: u8 = 1 << 3;
    /// Even parity (with [`PARITY`]).
    pub const EVEN: u8 = 1 << 4;
    /// Stick parity: mark (odd) or space (even) (with [`PARITY`]).
    pub const STICK: u8 = 1 << 5;
    /// Sends a break.
    pub const BREAK: u8 = 1 << 6;
    /// Divisor latch access.
    pub const DLAB: u8 = 1 << 7;
}

/// Modem control bits.
pub mod mcr {
    /// Data terminal ready.
    pub const DTR: u8 = 1 << 0;
    /// Request to send (the receiver may take data: hardware flow control's input half).
    pub const RTS: u8 = 1 << 1;
    /// Output 1.
    pub const OUT1: u8 = 1 << 2;
    /// Output 2 (gates the interrupt on a PC's board).
    pub const OUT2: u8 = 1 << 3;
    /// Loopback: the transmitter feeds the receiver, modem outputs feed modem inputs.
    pub const LOOP: u8 = 1 << 4;
    /// The bits a 16550A implements.
    pub const ALL: u8 = 0x1f;
}

/// Line status bits.
pub mod lsr {
    /// Data ready.
    pub const DR: u8 = 1 << 0;
    /// Overrun: a byte arrived with the receive FIFO full and was lost.
    pub const OE: u8 = 1 << 1;
    /// Parity error.
    pub const PE: u8 = 1 << 2;
    /// Framing error.
    pub const FE: u8 = 1 << 3;
    /// Break received.
    pub const BI: u8 = 1 << 4;
    /// Transmit holding register (the FIFO, when on) empty.
    pub const THRE: u8 = 1 << 5;
    /// Transmitter empty: nothing left to send.
    pub const TEMT: u8 = 1 << 6;
    /// An error among the bytes in the receive FIFO.
    pub const FIFO_ERROR: u8 = 1 << 7;
    /// The error bits a read of LSR clears.
    pub const ERRORS: u8 = OE | PE | FE | BI;
}

/// Modem status bits.
pub mod msr {
    /// CTS changed since MSR was last read.
    pub const DCTS: u8 = 1 << 0;
    /// DSR changed.
    pub const DDSR: u8 = 1 << 1;
    /// RI went from on to off.
    pub const TERI: u8 = 1 << 2;
    /// DCD changed.
    pub const DDCD: u8 = 1 << 3;
    /// Clear to send (the other end may take data: hardware flow control's output half).
    pub const CTS: u8 = 1 << 4;
    /// Data set ready.
    pub const DSR: u8 = 1 << 5;
    /// Ring indicator.
    pub const RI: u8 = 1 << 6;
    /// Data carrier detect.
    pub const DCD: u8 = 1 << 7;
    /// The change bits a read clears.
    pub const DELTAS: u8 = 0x0f;
}

/// The divisor for `baud`, if the UART's clock makes it within 2%.
pub fn divisor(baud: u32) -> Option<u16> {
    if baud == 0 || baud > MAX_BAUD {
        return None;
    }
    let d = (MAX_BAUD + baud / 2) / baud;
    let d = u16::try_from(d).ok().filter(|d| *d > 0)?;
    let made = MAX_BAUD / u32::from(d);
    (made.abs_diff(baud) * 50 <= baud).then_some(d)
}

/// Bits on the line for one character with line control `lcr`: start, data, parity, stop.
pub fn frame_bits(lcr: u8) -> u32 {
    let data = 5 + u32::from(lcr & lcr::WORD_MASK);
    let parity = u32::from(lcr & lcr::PARITY != 0);
    let stop = if lcr & lcr::STOP2 != 0 { 2 } else { 1 };
    1 + data + parity + stop
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_rates_have_divisors_and_odd_ones_do_not() {
        assert_eq!(divisor(115_200), Some(1));
        assert_eq!(divisor(9600), Some(12));
        assert_eq!(divisor(50), Some(2304));
        assert_eq!(divisor(0), None);
        assert_eq!(divisor(230_400), None);
        assert_eq!(divisor(100_000), None, "115200 is 15% off");
        assert_eq!(frame_bits(0x03), 10, "8N1");
        assert_eq!(frame_bits(0x03 | lcr::PARITY | lcr::STOP2), 12);
    }
}
