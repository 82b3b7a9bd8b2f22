//! Shared memory for Outboard.
//!
//! Every byte that crosses a process boundary in Outboard lives in a [`SharedMem`]: DMA buffers a
//! driver hands to a device, a client's memory mapped into a device model, BARs a device model
//! exports. The peer on the other side is not trusted and may write at any time, so this type
//! never hands out `&[u8]` or `&mut [u8]` to the mapping: callers copy in and out, or use the
//! atomics for fields that are shared by protocol (ring indices). Every access is bounds-checked
//! and returns [`ShmError`] instead of faulting.
//!
//! This is one of the few modules allowed `unsafe`: it owns the `mmap` and every raw-pointer
//! access to it.
#![deny(missing_docs)]

mod guard;
mod words;

pub use words::Words;

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64};

use rustix::fs::MemfdFlags;
use rustix::mm::{MapFlags, ProtFlags};

/// What went wrong with a shared-memory operation.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShmError {
    /// The access does not lie within the mapping.
    #[error("access of {len} bytes at offset {offset:#x} is outside the {size:#x}-byte mapping")]
    OutOfBounds {
        /// Start of the access.
        offset: u64,
        /// Length of the access.
        len: u64,
        /// Size of the mapping.
        size: u64,
    },
    /// An atomic access is not naturally aligned.
    #[error("atomic access at offset {offset:#x} is not {align}-byte aligned")]
    Misaligned {
        /// Start of the access.
        offset: u64,
        /// Required alignment.
        align: u64,
    },
    /// The mapping is read-only.
    #[error("the mapping is read-only")]
    ReadOnly,
    /// The peer shrank the file under the mapping; its contents are gone.
    #[error("the peer truncated the memory it shared")]
    PeerTruncated,
    /// A zero-length mapping was requested.
    #[error("a mapping cannot be empty")]
    Empty,
    /// The operating system refused.
    #[error("{op}: {errno}")]
    Os {
        /// The call that failed.
        op: &'static str,
        /// Why.
        errno: rustix::io::Errno,
    },
}

/// Integer widths a device register can have.
pub trait Mmio: Copy + sealed::Sealed {}
impl Mmio for u8 {}
impl Mmio for u16 {}
impl Mmio for u32 {}
impl Mmio for u64 {}
mod sealed {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for u16 {}
    impl Sealed for u32 {}
    impl Sealed for u64 {}
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, ShmError>;

/// Access rights of a mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read only.
    ReadOnly,
    /// Read and write.
    ReadWrite,
}

/// A shared mapping, optionally with the fd it came from (so it can be passed to a peer).
pub struct SharedMem {
    ptr: NonNull<u8>,
    len: usize,
    access: Access,
    fd: Option<OwnedFd>,
    /// Set when the file cannot be sealed against shrinking (see [`guard`]).
    guard: Option<guard::Guard>,
    /// Ordinary process memory ([`SharedMem::heap`]) rather than a mapping.
    heap: bool,
}

/// Alignment of heap-backed memory: a page, like a mapping.
const HEAP_ALIGN: usize = 4096;

// SAFETY: `SharedMem` owns its mapping; all access goes through raw pointers with explicit
// copies or atomics, so sharing it between threads is as safe as sharing it between processes,
// which is its purpose.
unsafe impl Send for SharedMem {}
// SAFETY: see `Send`: no method hands out a reference that could alias a mutable one.
unsafe impl Sync for SharedMem {}

impl std::fmt::Debug for SharedMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMem")
            .field("len", &self.len)
            .field("access", &self.access)
            .finish()
    }
}

fn os(op: &'static str) -> impl Fn(rustix::io::Errno) -> ShmError {
    move |errno| ShmError::Os { op, errno }
}

impl SharedMem {
    /// Creates a new zero-filled memfd of `len` bytes and maps it read-write.
    pub fn create(name: &str, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(ShmError::Empty);
        }
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(os("memfd_create"))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(os("ftruncate"))?;
        Self::map_owned(fd, 0, len, Access::ReadWrite)
    }

    /// Seals the size of a memfd this process created (`F_SEAL_GROW | F_SEAL_SHRINK |
    /// F_SEAL_SEAL`), so a peer it is passed to can neither resize it nor seal it otherwise.
    pub fn seal_size(&self) -> Result<()> {
        let fd = self.fd().ok_or(ShmError::Empty)?;
        rustix::fs::fcntl_add_seals(
            fd,
            rustix::fs::SealFlags::GROW
                | rustix::fs::SealFlags::SHRINK
                | rustix::fs::SealFlags::SEAL,
        )
        .map_err(os("fcntl(F_ADD_SEALS)"))
    }

    /// Maps `len` bytes of `fd` from `offset`, keeping the fd.
    pub fn map_owned(fd: OwnedFd, offset: u64, len: usize, access: Access) -> Result<Self> {
        let ptr = Self::mmap(fd.as_fd(), offset, len, access)?;
        Ok(Self {
            ptr,
            len,
            access,
            fd: Some(fd),
            guard: None,
            heap: false,
        })
    }

    /// Maps `len` bytes of `fd` from `offset` without keeping the fd (the mapping holds the file).
    pub fn map(fd: BorrowedFd<'_>, offset: u64, len: usize, access: Access) -> Result<Self> {
        let ptr = Self::mmap(fd, offset, len, access)?;
        Ok(Self {
            ptr,
            len,
            access,
            fd: None,
            guard: None,
            heap: false,
        })
    }

    /// Zero-filled ordinary process memory with the same accessors: it has no fd and cannot be
    /// shared with another process. For tests, and for Miri, which cannot create or map a
    /// memfd but checks every access made through these methods.
    pub fn heap(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(ShmError::Empty);
        }
        let layout =
            std::alloc::Layout::from_size_align(len, HEAP_ALIGN).map_err(|_| ShmError::Os {
                op: "allocate",
                errno: rustix::io::Errno::NOMEM,
            })?;
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(ShmError::Os {
            op: "allocate",
            errno: rustix::io::Errno::NOMEM,
        })?;
        Ok(Self {
            ptr,
            len,
            access: Access::ReadWrite,
            fd: None,
            guard: None,
            heap: true,
        })
    }

    /// Maps `len` bytes of a file a peer passed us, keeping the fd. The peer must not be able to
    /// make our accesses fault by shrinking the file: a memfd is sealed against shrinking
    /// (`F_SEAL_SHRINK`, which also binds the peer); a file that cannot be sealed is mapped under
    /// the SIGBUS guard, so a truncation turns into [`ShmError::PeerTruncated`] on this
    /// mapping's accesses instead of killing the process.
    pub fn map_peer_owned(fd: OwnedFd, offset: u64, len: usize, access: Access) -> Result<Self> {
        let needs_guard = Self::seal_against_shrinking(fd.as_fd())?;
        let mut m = Self::map_owned(fd, offset, len, access)?;
        if needs_guard {
            m.guard = Some(guard::Guard::register(m.ptr.as_ptr() as usize, m.len)?);
        }
        Ok(m)
    }

    /// [`SharedMem::map_peer_owned`] without keeping the fd.
    pub fn map_peer(fd: BorrowedFd<'_>, offset: u64, len: usize, access: Access) -> Result<Self> {
        let needs_guard = Self::seal_against_shrinking(fd)?;
        let mut m = Self::map(fd, offset, len, access)?;
        if needs_guard {
            m.guard = Some(guard::Guard::register(m.ptr.as_ptr() as usize, m.len)?);
        }
        Ok(m)
    }

    /// Seals a regular file against shrinking; true if that was impossible and the mapping
    /// needs the guard. Other files (device memory) cannot be truncated.
    fn seal_against_shrinking(fd: BorrowedFd<'_>) -> Result<bool> {
        let st = rustix::fs::fstat(fd).map_err(os("fstat"))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Ok(false);
        }
        let sealed = |s: rustix::fs::SealFlags| s.contains(rustix::fs::SealFlags::SHRINK);
        if rustix::fs::fcntl_get_seals(fd).is_ok_and(sealed) {
            return Ok(false);
        }
        Ok(rustix::fs::fcntl_add_seals(fd, rustix::fs::SealFlags::SHRINK).is_err())
    }

    /// Whether this mapping is guarded because its file could not be sealed.
    pub fn is_guarded(&self) -> bool {
        self.guard.is_some()
    }

    /// Fails if the peer truncated the file under a guarded mapping.
    #[inline]
    fn intact(&self) -> Result<()> {
        match &self.guard {
            Some(g) if g.poisoned() => Err(ShmError::PeerTruncated),
            _ => Ok(()),
        }
    }

    fn mmap(fd: BorrowedFd<'_>, offset: u64, len: usize, access: Access) -> Result<NonNull<u8>> {
        if len == 0 {
            return Err(ShmError::Empty);
        }
        let prot = match access {
            Access::ReadOnly => ProtFlags::READ,
            Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
        };
        // A peer-supplied fd may be shorter than claimed; touching pages past its end would raise
        // SIGBUS in this process. Check the size first when the fd can tell us.
        if let Ok(st) = rustix::fs::fstat(fd) {
            let is_regular = (st.st_mode & 0o170000) == 0o100000;
            let end = offset.checked_add(len as u64);
            if is_regular && end.is_none_or(|end| end > st.st_size as u64) {
                return Err(ShmError::OutOfBounds {
                    offset,
                    len: len as u64,
                    size: st.st_size as u64,
                });
            }
        }
        // SAFETY: a fresh shared mapping at an address the kernel chooses cannot overlap any Rust
        // object; the result is checked, and the pointer is only used through bounds-checked
        // methods below until `Drop` unmaps exactly this range.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                MapFlags::SHARED,
                fd,
                offset,
            )
        }
        .map_err(os("mmap"))?;
        NonNull::new(ptr.cast::<u8>()).ok_or(ShmError::Os {
            op: "mmap",
            errno: rustix::io::Errno::NOMEM,
        })
    }

    /// Size of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty mappings cannot be made.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The fd behind the mapping, if this side owns one (to pass it to a peer).
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|fd| fd.as_fd())
    }

    /// Access rights of the mapping.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Checks that `[offset, offset + len)` lies inside the mapping and returns it as `usize`.
    #[inline]
    pub fn check(&self, offset: u64, len: usize) -> Result<usize> {
        let end = offset.checked_add(len as u64);
        match end {
            Some(end) if end <= self.len as u64 => Ok(offset as usize),
            _ => Err(ShmError::OutOfBounds {
                offset,
                len: len as u64,
                size: self.len as u64,
            }),
        }
    }

    #[inline]
    fn check_write(&self, offset: u64, len: usize) -> Result<usize> {
        if self.access == Access::ReadOnly {
            return Err(ShmError::ReadOnly);
        }
        self.check(offset, len)
    }

    /// Copies bytes out of the mapping.
    #[inline]
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let start = self.check(offset, buf.len())?;
        // SAFETY: the range was bounds-checked against the live mapping. The peer may write the
        // same bytes concurrently; we copy them as plain bytes (every bit pattern is a valid u8)
        // and never form a reference into the mapping, which is the same contract vm-memory and
        // io_uring rings rely on.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(start), buf.as_mut_ptr(), buf.len())
        };
        self.intact()
    }

    /// Writes `len` bytes of the mapping from `offset` to the file `fd` (a pipe, a file,
    /// standard output) straight from the mapping: the kernel copies them, this process does
    /// not. Short writes are continued; a failed write is returned as [`ShmError::Os`].
    pub fn write_out(&self, offset: u64, len: usize, fd: BorrowedFd<'_>) -> Result<()> {
        let start = self.check(offset, len)?;
        let mut done = 0;
        while done < len {
            // SAFETY: `[start + done, start + len)` lies inside the live mapping (checked
            // above). The kernel reads it as plain bytes; no Rust reference into the mapping is
            // formed, so a peer writing the same bytes meanwhile changes only what is written.
            let n = unsafe {
                libc::write(
                    fd.as_raw_fd(),
                    self.ptr.as_ptr().add(start + done).cast(),
                    len - done,
                )
            };
            if n <= 0 {
                let errno = match std::io::Error::last_os_error().raw_os_error() {
                    Some(e) if n < 0 => rustix::io::Errno::from_raw_os_error(e),
                    _ => rustix::io::Errno::NOSPC,
                };
                if errno == rustix::io::Errno::INTR {
                    continue;
                }
                return Err(ShmError::Os { op: "write", errno });
            }
            done += n as usize;
        }
        self.intact()
    }

    /// Copies bytes into the mapping.
    #[inline]
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let start = self.check_write(offset, data.len())?;
        // SAFETY: bounds-checked, writable mapping; see `read` for why a concurrent peer access
        // does not make this unsound for plain bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(start), data.len())
        };
        self.intact()
    }

    /// Reads from `fd` straight into `[offset, offset + len)` of the mapping — one `read(2)`,
    /// no copy in user space (a socket's payload lands in a device-visible buffer). Returns the
    /// bytes read; 0 means end of file. `EINTR` is retried.
    pub fn fill_from_fd(&self, fd: BorrowedFd<'_>, offset: u64, len: usize) -> Result<usize> {
        let start = self.check_write(offset, len)?;
        // SAFETY: the range is bounds-checked against the live, writable mapping. The slice is
        // of `MaybeUninit<u8>`, valid for any content, and only the kernel writes through it
        // (read(2) copies into it); a peer writing the same bytes concurrently races only with
        // that copy, as with `write` above, and the caller hands over only buffers no request
        // in flight is using.
        let buf = unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr
                    .as_ptr()
                    .add(start)
                    .cast::<std::mem::MaybeUninit<u8>>(),
                len,
            )
        };
        let n = loop {
            match rustix::io::read(fd, &mut *buf) {
                Ok((init, _)) => break init.len(),
                Err(rustix::io::Errno::INTR) => continue,
                Err(errno) => return Err(ShmError::Os { op: "read", errno }),
            }
        };
        self.intact()?;
        Ok(n)
    }

    /// Writes `[offset, offset + len)` of the mapping to `fd` — one `write(2)`, no copy in user
    /// space. Returns the bytes written. `EINTR` is retried.
    pub fn drain_to_fd(&self, fd: BorrowedFd<'_>, offset: u64, len: usize) -> Result<usize> {
        let start = self.check(offset, len)?;
        // SAFETY: bounds-checked live mapping; only the kernel reads through the slice
        // (write(2) copies out of it). Bytes a peer changes meanwhile are sent as they are,
        // which is the same contract as `read` above for plain bytes.
        let buf = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), len) };
        let n = loop {
            match rustix::io::write(fd, buf) {
                Ok(n) => break n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(errno) => return Err(ShmError::Os { op: "write", errno }),
            }
        };
        self.intact()?;
        Ok(n)
    }

    /// The address of `[offset, offset + len)` in this process, bounds-checked, for handing to
    /// the kernel as an I/O buffer (io_uring). Using it is the caller's `unsafe`: the memory
    /// must stay mapped, and untouched by Rust references, until the kernel is done with it.
    pub fn io_ptr(&self, offset: u64, len: usize) -> Result<*mut u8> {
        let start = self.check_write(offset, len)?;
        // SAFETY: `start` is within the mapping (checked above); no reference is formed.
        Ok(unsafe { self.ptr.as_ptr().add(start) })
    }

    /// Fills `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: u64, len: usize, byte: u8) -> Result<()> {
        let start = self.check_write(offset, len)?;
        // SAFETY: bounds-checked, writable mapping (see `write`).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(start), byte, len) };
        self.intact()
    }

    /// Copies `len` bytes from `self` at `offset` to `other` at `other_offset`.
    pub fn copy_to(
        &self,
        offset: u64,
        other: &SharedMem,
        other_offset: u64,
        len: usize,
    ) -> Result<()> {
        let src = self.check(offset, len)?;
        let dst = other.check_write(other_offset, len)?;
        // SAFETY: both ranges are bounds-checked against live mappings; `copy` (memmove) is used
        // because the two mappings may be views of the same file.
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(src), other.ptr.as_ptr().add(dst), len) };
        self.intact()?;
        other.intact()
    }

    /// Reads a little-endian value of `N` bytes with a single volatile access when aligned.
    fn load<const N: usize>(&self, offset: u64) -> Result<[u8; N]> {
        let mut bytes = [0u8; N];
        self.read(offset, &mut bytes)?;
        Ok(bytes)
    }

    /// Reads a little-endian u16.
    pub fn read_u16(&self, offset: u64) -> Result<u16> {
        Ok(u16::from_le_bytes(self.load(offset)?))
    }
    /// Reads a little-endian u32.
    pub fn read_u32(&self, offset: u64) -> Result<u32> {
        Ok(u32::from_le_bytes(self.load(offset)?))
    }
    /// Reads a little-endian u64.
    pub fn read_u64(&self, offset: u64) -> Result<u64> {
        Ok(u64::from_le_bytes(self.load(offset)?))
    }
    /// Writes a little-endian u16.
    pub fn write_u16(&self, offset: u64, v: u16) -> Result<()> {
        self.write(offset, &v.to_le_bytes())
    }
    /// Writes a little-endian u32.
    pub fn write_u32(&self, offset: u64, v: u32) -> Result<()> {
        self.write(offset, &v.to_le_bytes())
    }
    /// Writes a little-endian u64.
    pub fn write_u64(&self, offset: u64, v: u64) -> Result<()> {
        self.write(offset, &v.to_le_bytes())
    }

    #[inline]
    fn atomic_ptr(&self, offset: u64, size: usize) -> Result<*mut u8> {
        let start = self.check(offset, size)?;
        // SAFETY: `start` is in bounds (checked above).
        let ptr = unsafe { self.ptr.as_ptr().add(start) };
        if !(ptr as usize).is_multiple_of(size) {
            return Err(ShmError::Misaligned {
                offset,
                align: size as u64,
            });
        }
        Ok(ptr)
    }

    /// A 16-bit atomic shared with the peer (ring indices and flags).
    ///
    /// Little-endian hosts only: the virtio and session layouts are little-endian, and Outboard
    /// targets x86-64 and aarch64 Linux.
    #[inline]
    pub fn atomic_u16(&self, offset: u64) -> Result<&AtomicU16> {
        let ptr = self.atomic_ptr(offset, 2)?;
        // SAFETY: in bounds, 2-byte aligned, and the mapping lives as long as `&self`. AtomicU16
        // has the same layout as u16 and tolerates concurrent access from the peer.
        Ok(unsafe { AtomicU16::from_ptr(ptr.cast()) })
    }

    /// A 32-bit atomic shared with the peer.
    #[inline]
    pub fn atomic_u32(&self, offset: u64) -> Result<&AtomicU32> {
        let ptr = self.atomic_ptr(offset, 4)?;
        // SAFETY: as for `atomic_u16`, with 4-byte alignment checked.
        Ok(unsafe { AtomicU32::from_ptr(ptr.cast()) })
    }

    /// `n` consecutive 64-bit atomics shared with the peer, from `offset` (counters one side
    /// writes and the other reads). On a read-only mapping, only load from them.
    #[inline]
    pub fn atomics_u64(&self, offset: u64, n: usize) -> Result<&[AtomicU64]> {
        let bytes = n.checked_mul(8).ok_or(ShmError::OutOfBounds {
            offset,
            len: u64::MAX,
            size: self.len as u64,
        })?;
        self.check(offset, bytes.max(8))?;
        let ptr = self.atomic_ptr(offset, 8)?;
        // SAFETY: `n` words from `ptr` are in bounds (checked above) and 8-byte aligned; the
        // mapping lives as long as `&self`. AtomicU64 has the layout of u64 and tolerates
        // concurrent access from the peer; no `&mut` to this memory is ever handed out.
        Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<AtomicU64>(), n) })
    }

    /// One exact-width volatile load, as device registers require (a BAR mapped from VFIO must
    /// see a single 4-byte read for a 4-byte register, never four byte reads). Width is
    /// `size_of::<T>()`; the offset must be naturally aligned.
    pub fn mmio_read<T: Mmio>(&self, offset: u64) -> Result<T> {
        let ptr = self.atomic_ptr(offset, std::mem::size_of::<T>())?;
        // SAFETY: in bounds and naturally aligned (checked by `atomic_ptr`); `T` is a plain
        // integer (sealed trait), valid for every bit pattern.
        Ok(unsafe { std::ptr::read_volatile(ptr.cast::<T>()) })
    }

    /// One exact-width volatile store (see [`SharedMem::mmio_read`]).
    pub fn mmio_write<T: Mmio>(&self, offset: u64, value: T) -> Result<()> {
        if self.access == Access::ReadOnly {
            return Err(ShmError::ReadOnly);
        }
        let ptr = self.atomic_ptr(offset, std::mem::size_of::<T>())?;
        // SAFETY: in bounds, aligned, writable mapping; see `mmio_read`.
        unsafe { std::ptr::write_volatile(ptr.cast::<T>(), value) };
        Ok(())
    }

    /// Reads up to `len` bytes of `file` at `file_offset` straight into the mapping at
    /// `offset` (`pread`, no bounce buffer). Returns the byte count read (short at end of file).
    pub fn pread_from(
        &self,
        file: BorrowedFd<'_>,
        file_offset: u64,
        offset: u64,
        len: usize,
    ) -> Result<usize> {
        let start = self.check_write(offset, len)?;
        // SAFETY: `[start, start+len)` is inside this live, writable mapping. The slice exists
        // only for the duration of the syscall, which writes plain bytes into it; a concurrent
        // peer write races the same way a device DMA would and cannot violate u8 validity.
        let buf = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(start), len) };
        let mut done = 0;
        while done < len {
            match rustix::io::pread(file, &mut buf[done..], file_offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    return Err(ShmError::Os {
                        op: "pread",
                        errno: e,
                    })
                }
            }
        }
        Ok(done)
    }

    /// Writes `len` bytes from the mapping at `offset` to `file` at `file_offset` (`pwrite`).
    pub fn pwrite_to(
        &self,
        file: BorrowedFd<'_>,
        file_offset: u64,
        offset: u64,
        len: usize,
    ) -> Result<()> {
        let start = self.check(offset, len)?;
        // SAFETY: in bounds of the live mapping; read-only use for the duration of the call
        // (see `pread_from` on concurrent peers).
        let buf = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), len) };
        let mut done = 0;
        while done < len {
            match rustix::io::pwrite(file, &buf[done..], file_offset + done as u64) {
                Ok(0) => {
                    return Err(ShmError::Os {
                        op: "pwrite",
                        errno: rustix::io::Errno::NOSPC,
                    })
                }
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    return Err(ShmError::Os {
                        op: "pwrite",
                        errno: e,
                    })
                }
            }
        }
        Ok(())
    }

    /// Raw pointer to the start of the mapping, for zero-copy handoff to the kernel (e.g.
    /// `pread` straight into a DMA buffer). The caller must stay within [`SharedMem::len`].
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        // Unregister first: once unmapped, the address range may be reused by another mapping
        // whose faults are not ours to absorb.
        self.guard = None;
        if self.heap {
            let layout = std::alloc::Layout::from_size_align(self.len, HEAP_ALIGN)
                .expect("the layout `heap` allocated with");
            // SAFETY: allocated in `heap` with exactly this layout; no reference into it can
            // outlive `self` because none is ever handed out.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
            return;
        }
        // SAFETY: unmaps exactly the range mapped in `mmap`; no reference into it can outlive
        // `self` because none is ever handed out.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(sealable: bool, len: u64) -> OwnedFd {
        let flags = if sealable {
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING
        } else {
            MemfdFlags::CLOEXEC
        };
        let fd = rustix::fs::memfd_create("peer", flags).unwrap();
        rustix::fs::ftruncate(&fd, len).unwrap();
        fd
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot create or map a memfd")]
    fn a_peers_memfd_is_sealed_against_shrinking() {
        let fd = memfd(true, 8192);
        let peer = fd.try_clone().unwrap();
        let m = SharedMem::map_peer_owned(fd, 0, 8192, Access::ReadWrite).unwrap();
        assert!(!m.is_guarded());
        assert_eq!(
            rustix::fs::ftruncate(&peer, 0),
            Err(rustix::io::Errno::PERM),
            "the peer can no longer shrink it"
        );
        m.write(8000, b"still here").unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot create or map a memfd")]
    fn a_file_truncated_under_a_guarded_mapping_is_an_error_not_sigbus() {
        // Without ALLOW_SEALING a memfd is born with F_SEAL_SEAL: it cannot be sealed.
        let fd = memfd(false, 3 * 4096);
        let peer = fd.try_clone().unwrap();
        let m = SharedMem::map_peer_owned(fd, 0, 3 * 4096, Access::ReadWrite).unwrap();
        assert!(m.is_guarded());
        m.write(5000, b"data").unwrap();
        rustix::fs::ftruncate(&peer, 0).unwrap();
        let mut buf = [0u8; 4];
        assert_eq!(m.read(5000, &mut buf), Err(ShmError::PeerTruncated));
        assert_eq!(m.write(100, b"x"), Err(ShmError::PeerTruncated));
        // Other mappings are unaffected.
        let other = SharedMem::create("other", 4096).unwrap();
        other.write(0, b"ok").unwrap();
        drop(m);
        // A guarded mapping that is never truncated works as any other.
        let fd = memfd(false, 4096);
        let m = SharedMem::map_peer_owned(fd, 0, 4096, Access::ReadWrite).unwrap();
        m.write(0, b"fine").unwrap();
        m.read(0, &mut buf).unwrap();
        assert_eq!(&buf, b"fine");
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot create or map a memfd")]
    fn round_trips_and_bounds() {
        let m = SharedMem::create("t", 4096).unwrap();
        m.write(10, b"hello").unwrap();
        let mut b = [0u8; 5];
        m.read(10, &mut b).unwrap();
        assert_eq!(&b, b"hello");
        assert!(matches!(
            m.read(4094, &mut b),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(matches!(
            m.write(u64::MAX, b"x"),
            Err(ShmError::OutOfBounds { .. })
        ));
        m.write_u32(100, 0xdead_beef).unwrap();
        assert_eq!(m.read_u32(100).unwrap(), 0xdead_beef);
        assert!(matches!(
            m.atomic_u16(101),
            Err(ShmError::Misaligned { .. })
        ));
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot create or map a memfd")]
    fn second_mapping_sees_writes() {
        let m = SharedMem::create("t", 8192).unwrap();
        let view = SharedMem::map(m.fd().unwrap(), 4096, 4096, Access::ReadOnly).unwrap();
        m.write(4096 + 7, &[42]).unwrap();
        let mut b = [0u8; 1];
        view.read(7, &mut b).unwrap();
        assert_eq!(b[0], 42);
        assert_eq!(view.write(0, &[1]), Err(ShmError::ReadOnly));
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot create or map a memfd")]
    fn refuses_mapping_past_end_of_file() {
        let m = SharedMem::create("t", 4096).unwrap();
        let r = SharedMem::map(m.fd().unwrap(), 0, 8192, Access::ReadWrite);
        assert!(matches!(r, Err(ShmError::OutOfBounds { .. })));
    }

    /// Every accessor over ordinary memory: the tests Miri runs (`cargo +nightly miri test -p
    /// outboard-shm`), so undefined behaviour in the unsafe code shows up there.
    mod heap {
        use super::*;
        use std::sync::atomic::Ordering;

        #[test]
        fn copies_fills_and_bounds() {
            let m = SharedMem::heap(8192).unwrap();
            m.write(4090, b"across a page").unwrap();
            let mut b = [0u8; 13];
            m.read(4090, &mut b).unwrap();
            assert_eq!(&b, b"across a page");
            m.fill(100, 50, 0xab).unwrap();
            assert_eq!(m.read_u64(100).unwrap(), 0xabab_abab_abab_abab);
            m.write_u16(0, 0x1234).unwrap();
            m.write_u32(2, 0xdead_beef).unwrap();
            m.write_u64(6, u64::MAX).unwrap();
            assert_eq!(m.read_u16(0).unwrap(), 0x1234);
            assert_eq!(m.read_u32(2).unwrap(), 0xdead_beef);
            assert_eq!(m.read_u64(6).unwrap(), u64::MAX);
            // Out of bounds, and overflowing offsets, are errors, never accesses.
            assert!(m.read(8190, &mut b).is_err());
            assert!(m.write(u64::MAX - 3, b"xxxxxxx").is_err());
            assert!(m.fill(8192, 1, 0).is_err());
            assert!(m.check(0, 8193).is_err());
            assert!(SharedMem::heap(0).is_err());
        }

        #[test]
        fn copy_between_and_within() {
            let a = SharedMem::heap(4096).unwrap();
            let b = SharedMem::heap(4096).unwrap();
            a.write(0, b"0123456789").unwrap();
            a.copy_to(0, &b, 100, 10).unwrap();
            let mut got = [0u8; 10];
            b.read(100, &mut got).unwrap();
            assert_eq!(&got, b"0123456789");
            // Overlapping, within one buffer (memmove).
            a.copy_to(0, &a, 3, 10).unwrap();
            a.read(3, &mut got).unwrap();
            assert_eq!(&got, b"0123456789");
            assert!(a.copy_to(4090, &b, 0, 10).is_err());
            assert!(a.copy_to(0, &b, 4090, 10).is_err());
        }

        #[test]
        fn atomics_and_mmio_are_aligned_and_in_bounds() {
            let m = SharedMem::heap(4096).unwrap();
            let x = m.atomic_u32(64).unwrap();
            x.store(7, Ordering::Release);
            assert_eq!(m.atomic_u32(64).unwrap().fetch_add(1, Ordering::AcqRel), 7);
            assert_eq!(m.read_u32(64).unwrap(), 8);
            m.atomic_u16(2).unwrap().store(0xffff, Ordering::Relaxed);
            assert_eq!(m.read_u16(2).unwrap(), 0xffff);
            assert!(matches!(m.atomic_u32(66), Err(ShmError::Misaligned { .. })));
            assert!(m.atomic_u32(4096).is_err());
            m.mmio_write::<u64>(8, 0x0102_0304_0506_0708).unwrap();
            assert_eq!(m.mmio_read::<u8>(8).unwrap(), 0x08);
            assert_eq!(m.mmio_read::<u16>(8).unwrap(), 0x0708);
            assert_eq!(m.mmio_read::<u32>(12).unwrap(), 0x0102_0304);
            assert!(m.mmio_read::<u64>(12).is_err());
        }

        #[test]
        fn shared_between_threads() {
            let m = std::sync::Arc::new(SharedMem::heap(4096).unwrap());
            let t = {
                let m = m.clone();
                std::thread::spawn(move || {
                    m.write(512, &[1u8; 64]).unwrap();
                    m.atomic_u32(0).unwrap().store(1, Ordering::Release);
                })
            };
            while m.atomic_u32(0).unwrap().load(Ordering::Acquire) == 0 {
                std::hint::spin_loop();
            }
            let mut b = [0u8; 64];
            m.read(512, &mut b).unwrap();
            assert_eq!(b, [1u8; 64]);
            t.join().unwrap();
        }
    }
}
