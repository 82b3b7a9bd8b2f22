//! The server's view of client memory: the DMA map table (a software IOMMU).
//!
//! A device model may touch only what the client mapped, with the rights it mapped it with:
//! [`DmaMap::translate`] is the single check every access goes through. Regions mapped with an
//! fd are mmapped here and accessed directly; regions mapped without one are reached with
//! DMA_READ / DMA_WRITE messages over the twin socket.

use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use outboard_shm::{Access, SharedMem};
use rustix::io::Errno;

use crate::channel::Channel;
use crate::wire::{self, cmd, DmaAccess, Header};

/// Why a device's memory access failed. A device model turns this into a device error (e.g. a
/// virtio-blk IOERR status), never a crash.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DmaError {
    /// Some of the range is not mapped.
    #[error("DMA to unmapped address range {iova:#x}+{len:#x}")]
    NotMapped {
        /// Start of the access.
        iova: u64,
        /// Length of the access.
        len: u64,
    },
    /// The range is mapped without the needed right.
    #[error("DMA {what} of {iova:#x} is not permitted by the mapping")]
    Forbidden {
        /// "read" or "write".
        what: &'static str,
        /// Start of the access.
        iova: u64,
    },
    /// The region has no fd and no twin socket is available, or the client failed the request.
    #[error("in-band DMA to {iova:#x} failed: {why}")]
    InBand {
        /// Start of the access.
        iova: u64,
        /// What happened.
        why: String,
    },
}

struct Region {
    iova: u64,
    size: u64,
    flags: u32,
    mem: Option<SharedMem>,
}

impl Region {
    fn end(&self) -> u64 {
        self.iova + self.size
    }
}

/// The client's DMA regions as the server sees them.
#[derive(Default)]
pub struct DmaMap {
    regions: Vec<Region>,
    twin: Mutex<Option<(Channel, u16)>>,
    timeout: Duration,
    /// The most data one DMA_READ / DMA_WRITE may carry (the client's max_data_xfer_size).
    max_transfer: usize,
}

impl std::fmt::Debug for DmaMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaMap")
            .field("regions", &self.regions.len())
            .finish()
    }
}

impl DmaMap {
    /// An empty map whose in-band accesses time out after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self {
            regions: Vec::new(),
            twin: Mutex::new(None),
            timeout,
            max_transfer: wire::MAX_DATA_XFER as usize,
        }
    }

    /// Limits each in-band DMA message to `bytes` of data; larger accesses are split.
    pub fn set_max_transfer(&mut self, bytes: usize) {
        self.max_transfer = bytes.clamp(1, wire::MAX_DATA_XFER as usize);
    }

    /// Installs the server end of the twin socket for in-band DMA.
    pub fn set_twin(&mut self, chan: Option<Channel>) {
        *self.twin.get_mut().expect("twin lock") = chan.map(|c| (c, 0));
    }

    /// Adds a region. Overlap with an existing one is `EEXIST` (spec: "A command to map over an
    /// existing region must be failed ... with EEXIST").
    pub fn map(&mut self, m: &wire::DmaMap, fd: Option<OwnedFd>) -> Result<(), Errno> {
        let end = m.addr + m.size; // decode rejected overflow
        if self
            .regions
            .iter()
            .any(|r| m.addr < r.end() && r.iova < end)
        {
            return Err(Errno::EXIST);
        }
        if self.regions.len() >= 65535 {
            return Err(Errno::NOSPC);
        }
        let size = usize::try_from(m.size).map_err(|_| Errno::INVAL)?;
        let access = if m.flags & wire::dma::FLAG_WRITE != 0 {
            Access::ReadWrite
        } else {
            Access::ReadOnly
        };
        let mem = match fd {
            Some(fd) => Some(
                SharedMem::map_peer_owned(fd, m.offset, size, access).map_err(|e| {
                    tracing::warn!("DMA_MAP {:#x}+{:#x}: {e}", m.addr, m.size);
                    Errno::INVAL
                })?,
            ),
            None => None,
        };
        let at = self.regions.partition_point(|r| r.iova < m.addr);
        self.regions.insert(
            at,
            Region {
                iova: m.addr,
                size: m.size,
                flags: m.flags,
                mem,
            },
        );
        Ok(())
    }

    /// Removes a region; address and size must match a mapping exactly. An unknown range is
    /// `ENOENT`, as in libvfio-user.
    pub fn unmap(&mut self, addr: u64, size: u64) -> Result<(), Errno> {
        let at = self
            .regions
            .iter()
            .position(|r| r.iova == addr && r.size == size)
            .ok_or(Errno::NOENT)?;
        self.regions.remove(at);
        Ok(())
    }

    /// Removes every region (DMA_UNMAP with `FLAG_ALL`); the twin socket stays.
    pub fn unmap_all(&mut self) {
        self.regions.clear();
    }

    /// Drops every region (client disconnected).
    pub fn clear(&mut self) {
        self.regions.clear();
        self.set_twin(None);
    }

    /// Every mapping as `(iova, size, inode of the backing fd)`; the inode is `None` for
    /// in-band regions. Lets tests prove zero copy: a client's buffer memfd is mapped here.
    pub fn mappings(&self) -> Vec<(u64, u64, Option<u64>)> {
        self.regions
            .iter()
            .map(|r| {
                let ino = r
                    .mem
                    .as_ref()
                    .and_then(|m| m.fd())
                    .and_then(|fd| rustix::fs::fstat(fd).ok())
                    .map(|st| st.st_ino);
                (r.iova, r.size, ino)
            })
            .collect()
    }

    /// Number of mapped regions.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    fn find(&self, iova: u64, len: u64, write: bool) -> Result<&Region, DmaError> {
        let end = iova
            .checked_add(len)
            .ok_or(DmaError::NotMapped { iova, len })?;
        let r = self
            .regions
            .iter()
            .find(|r| r.iova <= iova && end <= r.end())
            .ok_or(DmaError::NotMapped { iova, len })?;
        let need = if write {
            wire::dma::FLAG_WRITE
        } else {
            wire::dma::FLAG_READ
        };
        if r.flags & need == 0 {
            return Err(DmaError::Forbidden {
                what: if write { "write" } else { "read" },
                iova,
            });
        }
        Ok(r)
    }

    /// Translates `[iova, iova+len)` to a directly mapped memory and offset, checking rights.
    /// Fails for in-band regions; use [`DmaMap::read`]/[`DmaMap::write`] to reach those.
    pub fn translate(
        &self,
        iova: u64,
        len: u64,
        write: bool,
    ) -> Result<(&SharedMem, u64), DmaError> {
        let r = self.find(iova, len, write)?;
        match &r.mem {
            Some(mem) => Ok((mem, iova - r.iova)),
            None => Err(DmaError::InBand {
                iova,
                why: "region has no fd".into(),
            }),
        }
    }

    /// Reads client memory.
    pub fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        let r = self.find(iova, buf.len() as u64, false)?;
        match &r.mem {
            Some(mem) => mem
                .read(iova - r.iova, buf)
                .map_err(|_| DmaError::NotMapped {
                    iova,
                    len: buf.len() as u64,
                }),
            None => {
                let mut at = iova;
                for piece in buf.chunks_mut(self.max_transfer) {
                    let reply = self.in_band(cmd::DMA_READ, at, piece.len() as u64, &[])?;
                    let a = DmaAccess::decode(&reply, true).map_err(|e| DmaError::InBand {
                        iova: at,
                        why: e.to_string(),
                    })?;
                    if a.data.len() != piece.len() {
                        return Err(DmaError::InBand {
                            iova: at,
                            why: "short DMA_READ reply".into(),
                        });
                    }
                    piece.copy_from_slice(&a.data);
                    at += piece.len() as u64;
                }
                Ok(())
            }
        }
    }

    /// Writes client memory.
    pub fn write(&self, iova: u64, data: &[u8]) -> Result<(), DmaError> {
        let r = self.find(iova, data.len() as u64, true)?;
        match &r.mem {
            Some(mem) => mem
                .write(iova - r.iova, data)
                .map_err(|_| DmaError::NotMapped {
                    iova,
                    len: data.len() as u64,
                }),
            None => {
                let mut at = iova;
                for piece in data.chunks(self.max_transfer) {
                    self.in_band(cmd::DMA_WRITE, at, piece.len() as u64, piece)?;
                    at += piece.len() as u64;
                }
                Ok(())
            }
        }
    }

    fn in_band(
        &self,
        command: u16,
        iova: u64,
        count: u64,
        data: &[u8],
    ) -> Result<Vec<u8>, DmaError> {
        let fail = |why: String| DmaError::InBand { iova, why };
        if count > wire::MAX_DATA_XFER as u64 {
            return Err(fail("transfer larger than max_data_xfer_size".into()));
        }
        let mut twin = self.twin.lock().expect("twin lock");
        let Some((chan, next_id)) = twin.as_mut() else {
            return Err(fail(
                "region has no fd and no twin socket was negotiated".into(),
            ));
        };
        *next_id = next_id.wrapping_add(1);
        let payload = DmaAccess {
            addr: iova,
            count,
            data: data.to_vec(),
        }
        .encode();
        let header = Header::command(*next_id, command, payload.len());
        chan.send(&header, &payload, &[])
            .map_err(|e| fail(e.to_string()))?;
        let msg = chan
            .recv(Instant::now() + self.timeout)
            .map_err(|e| fail(e.to_string()))?;
        if !msg.header.is_reply()
            || msg.header.msg_id != header.msg_id
            || msg.header.command != command
        {
            return Err(fail("unexpected message on the twin socket".into()));
        }
        if msg.header.is_error() {
            return Err(fail(format!("client replied errno {}", msg.header.error)));
        }
        Ok(msg.payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn map_req(addr: u64, size: u64, flags: u32) -> wire::DmaMap {
        wire::DmaMap {
            argsz: 32,
            flags,
            offset: 0,
            addr,
            size,
        }
    }

    #[test]
    fn enforces_bounds_rights_and_overlap() {
        let mem = SharedMem::create("c", 8192).unwrap();
        let fd = mem.fd().unwrap().try_clone_to_owned().unwrap();
        let mut map = DmaMap::new(Duration::from_secs(1));
        map.map(&map_req(0x10000, 8192, wire::dma::FLAG_READ), Some(fd))
            .unwrap();
        let fd2 = mem.fd().unwrap().try_clone_to_owned().unwrap();
        assert_eq!(
            map.map(&map_req(0x11000, 4096, 3), Some(fd2)),
            Err(Errno::EXIST)
        );

        mem.write(100, b"abc").unwrap();
        let mut b = [0u8; 3];
        map.read(0x10000 + 100, &mut b).unwrap();
        assert_eq!(&b, b"abc");
        assert!(matches!(
            map.read(0x10000 + 8190, &mut b),
            Err(DmaError::NotMapped { .. })
        ));
        assert!(matches!(
            map.read(0xfff, &mut b),
            Err(DmaError::NotMapped { .. })
        ));
        assert!(matches!(
            map.write(0x10000, b"x"),
            Err(DmaError::Forbidden { .. })
        ));
        assert_eq!(map.unmap(0x10000, 4096), Err(Errno::NOENT));
        map.unmap(0x10000, 8192).unwrap();
        assert!(map.read(0x10000, &mut b).is_err());
        let _ = mem.fd().unwrap().as_fd();
    }

    #[test]
    fn in_band_region_without_twin_is_an_error_not_a_hang() {
        let mut map = DmaMap::new(Duration::from_millis(10));
        map.map(&map_req(0, 4096, 3), None).unwrap();
        let mut b = [0u8; 4];
        assert!(matches!(map.read(0, &mut b), Err(DmaError::InBand { .. })));
    }
}
