//! The vfio-user backend: a device model in another process.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use outboard_shm::{Access, SharedMem};
use outboard_vfio_user::wire::{dma, region};
use outboard_vfio_user::{Client, ClientError, ClientOptions};

use super::{irq_index, Backend};
use crate::region::{Doorbell, MappedArea, Trap};
use crate::{HwError, IrqKind, Region, Result};

/// A device model reached over a vfio-user socket.
pub struct VfioUserBackend {
    client: Arc<Mutex<Client>>,
    /// The connection's socket, duplicated so it can be watched without the client's lock.
    watch: OwnedFd,
}

struct VfioUserTrap {
    client: Arc<Mutex<Client>>,
}

fn err(e: ClientError) -> HwError {
    match e {
        // The model closed the connection, now or at an earlier call (which dropped it): this
        // device is gone for this server, as a restart must bring it back; not a resource
        // shortage (a session opening on a server whose model just died was refused as
        // "busy" and its client gave up, instead of waiting for the next server).
        ClientError::Channel {
            source: outboard_vfio_user::channel::ChannelError::Closed,
            ..
        }
        | ClientError::Broken { .. } => HwError::Gone(e.to_string()),
        e => HwError::Backend(e.to_string()),
    }
}

fn lock(c: &Mutex<Client>) -> MutexGuard<'_, Client> {
    // A panic while holding the lock leaves the client usable: it holds no invariants that a
    // half-done call breaks (the next call's id check catches a desynchronised stream).
    c.lock().unwrap_or_else(|p| p.into_inner())
}

impl Trap for VfioUserTrap {
    fn read(&self, bar: u8, offset: u64, buf: &mut [u8]) -> Result<()> {
        lock(&self.client)
            .region_read(region::BAR0 + bar as u32, offset, buf)
            .map_err(err)
    }
    fn write(&self, bar: u8, offset: u64, data: &[u8], posted: bool) -> Result<()> {
        let mut c = lock(&self.client);
        if posted {
            c.region_write_posted(region::BAR0 + bar as u32, offset, data)
        } else {
            c.region_write(region::BAR0 + bar as u32, offset, data)
        }
        .map_err(err)
    }
}

impl VfioUserBackend {
    /// Connects to the device model listening at `path`.
    pub fn connect(path: &Path) -> Result<Self> {
        let client = Client::connect(path, ClientOptions::default())
            .map_err(|e| refused(e, &path.display().to_string()))?;
        Self::with_client(client)
    }

    /// Uses a socket already connected to the device model.
    pub fn from_fd(fd: std::os::fd::OwnedFd) -> Result<Self> {
        let client = Client::from_fd(fd, ClientOptions::default())
            .map_err(|e| refused(e, "a connection to a device model"))?;
        Self::with_client(client)
    }

    fn with_client(client: Client) -> Result<Self> {
        let watch = client
            .socket()
            .try_clone_to_owned()
            .map_err(|e| HwError::Backend(format!("dup: {e}")))?;
        Ok(Self {
            client: Arc::new(Mutex::new(client)),
            watch,
        })
    }
}

impl Backend for VfioUserBackend {
    fn config_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        lock(&self.client)
            .region_read(region::CONFIG, offset, buf)
            .map_err(err)
    }

    fn config_write(&self, offset: u64, data: &[u8]) -> Result<()> {
        lock(&self.client)
            .region_write(region::CONFIG, offset, data)
            .map_err(err)
    }

    fn region_size(&self, bar: u8) -> Result<u64> {
        Ok(lock(&self.client)
            .region_info(region::BAR0 + bar as u32)
            .map_err(err)?
            .info
            .size)
    }

    fn region(&self, bar: u8) -> Result<Region> {
        let index = region::BAR0 + bar as u32;
        let mut c = lock(&self.client);
        let ri = c.region_info(index).map_err(err)?;
        let info = &ri.info;
        if info.size == 0 {
            return Err(HwError::NoSuchRegion(bar));
        }
        let access = if info.flags & region::FLAG_WRITE != 0 {
            Access::ReadWrite
        } else {
            Access::ReadOnly
        };
        let mut maps = Vec::new();
        if let Some(fd) = &ri.fd {
            let areas: Vec<(u64, u64)> = if info.sparse.is_empty() {
                vec![(0, info.size)]
            } else {
                info.sparse.iter().map(|a| (a.offset, a.size)).collect()
            };
            for (offset, size) in areas {
                // The server is not trusted: an area must lie inside the region.
                if offset.checked_add(size).is_none_or(|end| end > info.size) || size == 0 {
                    return Err(HwError::Backend(format!(
                        "BAR{bar}: server offered mmap area {offset:#x}+{size:#x} outside the region"
                    )));
                }
                let fd_offset = info
                    .offset
                    .checked_add(offset)
                    .ok_or_else(|| HwError::Backend("mmap offset overflows".into()))?;
                let mem = SharedMem::map_peer(
                    std::os::fd::AsFd::as_fd(fd),
                    fd_offset,
                    size as usize,
                    access,
                )?;
                maps.push(MappedArea { offset, mem });
            }
        }
        let mut doorbells = Vec::new();
        for io in c.region_io_fds(index).map_err(err)? {
            if io.offset >= info.size {
                return Err(HwError::Backend(format!(
                    "BAR{bar}: ioeventfd at {:#x} outside the region",
                    io.offset
                )));
            }
            doorbells.push(Doorbell {
                offset: io.offset,
                size: io.size,
                datamatch: io.datamatch,
                fd: io.fd,
            });
        }
        drop(c);
        Ok(Region::new(
            bar,
            info.size,
            maps,
            doorbells,
            Arc::new(VfioUserTrap {
                client: self.client.clone(),
            }),
        ))
    }

    fn irq_count(&self, kind: IrqKind) -> Result<u32> {
        let mut c = lock(&self.client);
        if irq_index(kind) >= c.device_info().num_irqs {
            return Ok(0);
        }
        Ok(c.irq_info(irq_index(kind)).map_err(err)?.count)
    }

    fn set_irqs(&self, kind: IrqKind, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let mut c = lock(&self.client);
        if fds.is_empty() {
            c.disable_irqs(irq_index(kind))
        } else {
            c.set_irq_eventfds(irq_index(kind), 0, fds)
        }
        .map_err(|e| HwError::Irq(e.to_string()))
    }

    fn unmask_intx(&self) -> Result<()> {
        lock(&self.client)
            .unmask_irq(irq_index(IrqKind::Intx), 0)
            .map_err(|e| HwError::Irq(e.to_string()))
    }

    fn dma_map(&self, iova: u64, size: u64, fd: BorrowedFd<'_>, offset: u64) -> Result<()> {
        lock(&self.client)
            .dma_map(iova, size, dma::FLAG_READ | dma::FLAG_WRITE, fd, offset)
            .map_err(err)
    }

    fn dma_unmap(&self, iova: u64, size: u64) -> Result<()> {
        lock(&self.client).dma_unmap(iova, size).map_err(err)
    }

    fn reset(&self) -> Result<()> {
        lock(&self.client).reset().map_err(err)
    }

    fn loss_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.watch.as_fd())
    }

    /// Closing the connection is the one thing that needs nothing from a stalled model: the
    /// model resets the device and drops every DMA mapping when it sees its client leave.
    /// Not certain now: a model that stalled sees it only when it wakes, and may first carry
    /// out what its queues held (with whatever the buffers hold by then).
    fn abandon(&self) -> bool {
        let _ = rustix::net::shutdown(&self.watch, rustix::net::Shutdown::Both);
        false
    }
}

/// Why a model did not take this client: busy (it serves another one) is its own error.
fn refused(e: outboard_vfio_user::ClientError, spec: &str) -> HwError {
    match e.errno() {
        Some(rustix::io::Errno::BUSY) => HwError::Busy { spec: spec.into() },
        _ => err(e),
    }
}
