//! In-band DMA: memory mapped without an fd is reached by the server with DMA_READ / DMA_WRITE
//! over the twin socket, served by the client's twin thread.

mod common;

use std::sync::{Arc, Mutex};

use outboard_shm::SharedMem;
use outboard_vfio_user::wire::{self, dma, region};
use outboard_vfio_user::{Client, ClientOptions, DeviceBackend, DeviceContext, RegionDesc};
use rustix::io::Errno;

/// A DMA engine: registers addr (0x0), len (0x8); writing 1 to 0x10 copies client memory into
/// the buffer at 0x100, writing 1 to 0x18 copies the buffer out. 0x20 holds the last error.
#[derive(Default)]
struct Engine {
    regs: [u64; 5],
    buffer: Vec<u8>,
    log: Arc<Mutex<Vec<String>>>,
}

impl DeviceBackend for Engine {
    fn regions(&self) -> Vec<RegionDesc<'_>> {
        common::bar0_and_config()
    }
    fn irqs(&self) -> Vec<wire::IrqInfo> {
        vec![]
    }
    fn region_read(
        &mut self,
        _: &mut DeviceContext,
        index: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), Errno> {
        buf.fill(0);
        if index == region::BAR0 && offset >= 0x100 {
            let o = (offset - 0x100) as usize;
            let n = buf.len().min(self.buffer.len().saturating_sub(o));
            buf[..n].copy_from_slice(&self.buffer[o..o + n]);
        } else if index == region::BAR0 && offset < 0x28 && buf.len() == 8 {
            buf.copy_from_slice(&self.regs[offset as usize / 8].to_le_bytes());
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
        if index != region::BAR0 || data.len() != 8 || offset >= 0x28 {
            return Err(Errno::INVAL);
        }
        self.regs[offset as usize / 8] = u64::from_le_bytes(data.try_into().unwrap());
        let (addr, len) = (self.regs[0], self.regs[1] as usize);
        let result = match offset {
            0x10 => {
                self.buffer = vec![0; len];
                ctx.dma.read(addr, &mut self.buffer)
            }
            0x18 => ctx
                .dma
                .write(addr, &self.buffer[..len.min(self.buffer.len())]),
            _ => Ok(()),
        };
        self.regs[4] = result.is_err() as u64;
        if let Err(e) = result {
            self.log.lock().unwrap().push(e.to_string());
        }
        Ok(())
    }
    fn reset(&mut self, _: &mut DeviceContext) {
        self.regs = [0; 5];
    }
}

/// Serves an engine at `path`; returns the server and the engine's error log.
fn serve_engine(path: &std::path::Path) -> (common::Served, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let engine = Engine {
        log: log.clone(),
        ..Default::default()
    };
    (common::serve(path, engine), log)
}

#[test]
fn server_reaches_fdless_memory_through_the_twin_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("engine.sock");
    let (srv, log) = serve_engine(&path);

    let mut c = common::client_with_twin_socket(&path);
    let mem = Arc::new(SharedMem::create("inband", 8192).unwrap());
    mem.write(100, b"hello from the client").unwrap();
    c.dma_map_in_band(0x4000_0000, mem.clone(), dma::FLAG_READ | dma::FLAG_WRITE)
        .unwrap();

    let reg = |c: &mut Client, off: u64, v: u64| {
        c.region_write(region::BAR0, off, &v.to_le_bytes()).unwrap()
    };
    // Device reads 21 bytes at IOVA base+100 (DMA_READ).
    reg(&mut c, 0x0, 0x4000_0000 + 100);
    reg(&mut c, 0x8, 21);
    reg(&mut c, 0x10, 1);
    let mut got = [0u8; 21];
    c.region_read(region::BAR0, 0x100, &mut got).unwrap();
    assert_eq!(&got, b"hello from the client");
    // Device writes it back elsewhere (DMA_WRITE).
    reg(&mut c, 0x0, 0x4000_0000 + 4096);
    reg(&mut c, 0x18, 1);
    let mut back = [0u8; 21];
    mem.read(4096, &mut back).unwrap();
    assert_eq!(&back, b"hello from the client");
    // Outside the map: the device sees an error, the client a working connection.
    reg(&mut c, 0x0, 0x5000_0000);
    reg(&mut c, 0x10, 1);
    let mut err = [0u8; 8];
    c.region_read(region::BAR0, 0x20, &mut err).unwrap();
    assert_eq!(u64::from_le_bytes(err), 1);
    assert!(
        log.lock().unwrap().last().unwrap().contains("unmapped"),
        "{:?}",
        log.lock().unwrap()
    );

    drop(c);
    srv.stop();
}

/// A client that announced max_data_xfer_size 1024 gets a 4 KiB device transfer as four
/// DMA messages of at most 1024 bytes each (one 4 KiB DMA_WRITE used to arrive anyway).
#[test]
fn server_dma_is_split_to_the_clients_max_data_xfer_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("engine.sock");
    let (srv, log) = serve_engine(&path);
    let opts = ClientOptions {
        max_data_xfer_size: 1024,
        ..Default::default()
    };
    let mut c = Client::connect(&path, opts).unwrap();
    let mem = Arc::new(SharedMem::create("inband", 16384).unwrap());
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    mem.write(0, &data).unwrap();
    c.dma_map_in_band(0x4000_0000, mem.clone(), dma::FLAG_READ | dma::FLAG_WRITE)
        .unwrap();
    let reg = |c: &mut Client, off: u64, v: u64| {
        c.region_write(region::BAR0, off, &v.to_le_bytes()).unwrap()
    };
    // 4 KiB in (DMA_READ), then out again 8 KiB further on (DMA_WRITE).
    reg(&mut c, 0x0, 0x4000_0000);
    reg(&mut c, 0x8, 4096);
    reg(&mut c, 0x10, 1);
    reg(&mut c, 0x0, 0x4000_0000 + 8192);
    reg(&mut c, 0x18, 1);
    let mut err = [0u8; 8];
    c.region_read(region::BAR0, 0x20, &mut err).unwrap();
    assert_eq!(u64::from_le_bytes(err), 0, "{:?}", log.lock().unwrap());
    let mut back = vec![0u8; 4096];
    mem.read(8192, &mut back).unwrap();
    assert_eq!(back, data);
    drop(c);
    srv.stop();
}
