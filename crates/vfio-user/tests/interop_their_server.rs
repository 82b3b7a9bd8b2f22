//! Our client against a server written with the independent `vfio_user` crate (rust-vmm).

use std::fs::File;
use std::io::Write;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outboard_vfio_user::wire::{dma, irq, region};
use outboard_vfio_user::{Client, ClientOptions};
use vfio_bindings::bindings::vfio::vfio_region_info;

#[derive(Default)]
struct Seen {
    dma: Vec<(u64, u64, bool)>,
    irq_fds: Vec<File>,
    resets: u32,
}

/// A tiny device for their server: PCI config space, a 4 KiB register BAR whose offset 0x100
/// raises MSI-X vector 0 when written.
struct TheirDevice {
    config: [u8; 256],
    bar0: Vec<u8>,
    seen: Arc<Mutex<Seen>>,
}

impl vfio_user::ServerBackend for TheirDevice {
    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), std::io::Error> {
        let src: &[u8] = if region == 7 {
            &self.config
        } else {
            &self.bar0
        };
        let o = offset as usize;
        data.copy_from_slice(&src[o..o + data.len()]);
        Ok(())
    }
    fn region_write(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), std::io::Error> {
        let o = offset as usize;
        if region == 0 {
            self.bar0[o..o + data.len()].copy_from_slice(data);
            if offset == 0x100 {
                if let Some(f) = self.seen.lock().unwrap().irq_fds.first_mut() {
                    f.write_all(&1u64.to_ne_bytes())?;
                }
            }
        }
        Ok(())
    }
    fn dma_map(
        &mut self,
        _flags: vfio_user::DmaMapFlags,
        _offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> Result<(), std::io::Error> {
        self.seen
            .lock()
            .unwrap()
            .dma
            .push((address, size, fd.is_some()));
        Ok(())
    }
    fn dma_unmap(
        &mut self,
        _flags: vfio_user::DmaUnmapFlags,
        address: u64,
        size: u64,
    ) -> Result<(), std::io::Error> {
        self.seen
            .lock()
            .unwrap()
            .dma
            .retain(|d| (d.0, d.1) != (address, size));
        Ok(())
    }
    fn reset(&mut self) -> Result<(), std::io::Error> {
        self.seen.lock().unwrap().resets += 1;
        Ok(())
    }
    fn set_irqs(
        &mut self,
        _index: u32,
        _flags: u32,
        _start: u32,
        _count: u32,
        fds: Vec<File>,
    ) -> Result<(), std::io::Error> {
        self.seen.lock().unwrap().irq_fds = fds;
        Ok(())
    }
}

fn region(index: u32, size: u64) -> vfio_user::ServerRegion {
    vfio_user::ServerRegion {
        region_info: vfio_region_info {
            argsz: std::mem::size_of::<vfio_region_info>() as u32,
            flags: if size > 0 {
                region::FLAG_READ | region::FLAG_WRITE
            } else {
                0
            },
            index,
            cap_offset: 0,
            size,
            offset: 0,
        },
        sparse_areas: vec![],
        mmap_fd: None,
    }
}

#[test]
fn our_client_drives_their_server() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("their.sock");
    let mut config = [0u8; 256];
    config[0..4].copy_from_slice(&[0xf4, 0x1a, 0x42, 0x10]);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let dev = TheirDevice {
        config,
        bar0: vec![0; 4096],
        seen: seen.clone(),
    };
    let regions: Vec<_> = (0..9)
        .map(|i| region(i, [4096, 0, 0, 0, 0, 0, 0, 256, 0][i as usize]))
        .collect();
    let irqs = vec![
        vfio_user::IrqInfo {
            index: irq::INTX,
            flags: 1,
            count: 1,
        },
        vfio_user::IrqInfo {
            index: irq::MSI,
            flags: 1,
            count: 0,
        },
        vfio_user::IrqInfo {
            index: irq::MSIX,
            flags: 1,
            count: 4,
        },
    ];
    let server = vfio_user::Server::new(&path, true, irqs, regions).unwrap();
    let thread = std::thread::spawn(move || {
        let mut dev = dev;
        server.run(&mut dev).unwrap();
    });

    let mut c = Client::connect(
        &path,
        ClientOptions {
            timeout: Duration::from_secs(5),
            twin_socket: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(c.device_info().num_regions, 9);
    assert_eq!(c.device_info().num_irqs, 3);
    assert_eq!(c.minor_version(), 0, "their server answers 0.0 to our 0.1");
    assert!(
        c.peer_capabilities().twin_socket.is_none(),
        "they do not offer a twin socket"
    );

    let cfg = c.region_info(region::CONFIG).unwrap();
    assert_eq!(cfg.info.size, 256);
    assert!(cfg.fd.is_none());
    let mut id = [0u8; 4];
    c.region_read(region::CONFIG, 0, &mut id).unwrap();
    assert_eq!(id, [0xf4, 0x1a, 0x42, 0x10]);

    c.region_write(region::BAR0, 0x10, &0xfeed_f00du32.to_le_bytes())
        .unwrap();
    c.region_write_posted(region::BAR0, 0x14, &0x1234_5678u32.to_le_bytes())
        .unwrap();
    let mut b = [0u8; 8];
    c.region_read(region::BAR0, 0x10, &mut b).unwrap();
    assert_eq!(
        b,
        [0x0d, 0xf0, 0xed, 0xfe, 0x78, 0x56, 0x34, 0x12],
        "posted write ordered before the read"
    );

    assert_eq!(c.irq_info(irq::MSIX).unwrap().count, 4);
    let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).unwrap();
    c.set_irq_eventfds(irq::MSIX, 0, &[efd.as_fd()]).unwrap();
    c.region_write(region::BAR0, 0x100, &[1]).unwrap();
    let mut v = [0u8; 8];
    rustix::io::read(&efd, &mut v).expect("their device raised our eventfd");
    assert_eq!(u64::from_ne_bytes(v), 1);

    let mem = outboard_shm::SharedMem::create("dma", 8192).unwrap();
    c.dma_map(
        0x10_0000,
        8192,
        dma::FLAG_READ | dma::FLAG_WRITE,
        mem.fd().unwrap(),
        0,
    )
    .unwrap();
    assert_eq!(seen.lock().unwrap().dma, vec![(0x10_0000, 8192, true)]);
    c.dma_unmap(0x10_0000, 8192).unwrap();
    assert!(seen.lock().unwrap().dma.is_empty());
    c.reset().unwrap();
    assert_eq!(seen.lock().unwrap().resets, 1);

    // Their server rejects an unknown region with an error reply, which we surface as such.
    let err = c.region_info(42).unwrap_err();
    assert!(err.errno().is_some(), "{err}");

    drop(c);
    thread.join().unwrap();
}
