//! What every emulated PCI function here has of MSI-X: the capability's body, the table (in
//! BAR 1 from offset 0, its pending-bit array at a fixed offset, which reads as zero), and the
//! interrupt types a vfio-user client is told about. Interrupts are raised through the
//! client's eventfds ([`outboard_vfio_user::DeviceContext`]); the table's contents are kept
//! for the driver to read back, as a device keeps them.

use outboard_spec::pci;
use outboard_vfio_user::wire;

/// A function's MSI-X table, in BAR 1.
#[derive(Debug, Clone)]
pub struct MsixTable {
    table: Vec<u8>,
    pba_offset: u64,
}

impl MsixTable {
    /// A table of `vectors` entries, its PBA at `pba_offset` in the same BAR.
    pub fn new(vectors: u16, pba_offset: u64) -> Self {
        Self {
            table: vec![0; usize::from(vectors) * pci::msix::ENTRY_SIZE as usize],
            pba_offset,
        }
    }

    /// The capability's body (after its id and next pointer): table size, table in BAR 1 at
    /// 0, PBA in BAR 1.
    pub fn capability_body(vectors: u16, pba_offset: u64) -> Vec<u8> {
        let mut b = vec![0u8; 10];
        b[0..2].copy_from_slice(&(vectors - 1).to_le_bytes());
        b[2..6].copy_from_slice(&1u32.to_le_bytes());
        b[6..10].copy_from_slice(&(pba_offset as u32 | 1).to_le_bytes());
        b
    }

    /// Reads BAR 1: the table's bytes; the PBA and the rest read as zero.
    pub fn read(&self, offset: u64, buf: &mut [u8]) {
        buf.fill(0);
        if offset >= self.pba_offset {
            return;
        }
        for (i, b) in buf.iter_mut().enumerate() {
            *b = self.table.get(offset as usize + i).copied().unwrap_or(0);
        }
    }

    /// Writes BAR 1: into the table; elsewhere dropped.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= self.pba_offset {
            return;
        }
        for (i, &b) in data.iter().enumerate() {
            if let Some(slot) = self.table.get_mut(offset as usize + i) {
                *slot = b;
            }
        }
    }

    /// Back to power-on: every entry zero.
    pub fn reset(&mut self) {
        self.table.fill(0);
    }
}

/// The interrupt types a function with `msix` MSI-X vectors offers a vfio-user client: INTx,
/// no MSI, its MSI-X vectors, no error or request interrupt.
pub fn irq_infos(msix: u32) -> Vec<wire::IrqInfo> {
    let info = |index, count| wire::IrqInfo {
        argsz: 16,
        flags: wire::irq::INFO_EVENTFD,
        index,
        count,
    };
    vec![
        info(wire::irq::INTX, 1),
        info(wire::irq::MSI, 0),
        info(wire::irq::MSIX, msix),
        info(wire::irq::ERR, 0),
        info(wire::irq::REQ, 0),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_keeps_what_is_written_and_the_pba_reads_zero() {
        let mut t = MsixTable::new(2, 0x800);
        t.write(16, &[1, 2, 3, 4]);
        t.write(0x800, &[9; 8]);
        let mut b = [0xffu8; 4];
        t.read(16, &mut b);
        assert_eq!(b, [1, 2, 3, 4]);
        t.read(0x800, &mut b);
        assert_eq!(b, [0; 4]);
        // Past the table (2 entries of 16 bytes) but before the PBA: zero, and a write there
        // is dropped.
        t.write(40, &[7]);
        t.read(40, &mut b[..1]);
        assert_eq!(b[0], 0);
        t.reset();
        t.read(16, &mut b);
        assert_eq!(b, [0; 4]);
        assert_eq!(
            MsixTable::capability_body(2, 0x800),
            [1, 0, 1, 0, 0, 0, 1, 8, 0, 0]
        );
    }
}
