//! Storage behind an emulated disk: a file, anonymous memory, or nothing at all (`null:SIZE`),
//! each reached through an fd so the device moves data with `pread`/`pwrite` straight into
//! client DMA memory.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use rustix::fs::{FallocateFlags, MemfdFlags};

/// Where a disk's bytes live.
#[derive(Debug)]
pub struct Backing {
    fd: OwnedFd,
    len: u64,
    kind: Kind,
}

#[derive(Debug, Clone)]
enum Kind {
    File(PathBuf),
    Memory,
    /// `/dev/zero`: reads return zeros, writes are accepted and dropped.
    Null,
}

/// Why a backing could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// The spec could not be parsed.
    #[error("invalid backing {spec:?}: {why}")]
    Spec {
        /// What was given.
        spec: String,
        /// Why it is wrong.
        why: String,
    },
    /// The file could not be opened or sized.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

pub use outboard_sys::units::parse_size;

impl Backing {
    /// Opens `mem:SIZE` (zero-filled memory) or a file path. A file that does not exist is
    /// created sparse with `create_size` bytes if given. The size must be a multiple of 512.
    pub fn open(spec: &str, create_size: Option<u64>) -> Result<Self, BackingError> {
        Self::open_with(spec, create_size, false)
    }

    /// [`Backing::open`], read-only if `read_only`: a file is then opened `O_RDONLY`, so a
    /// read-only disk works on a file that is immutable, read-only or on a read-only mount,
    /// and nothing can write it through this descriptor. A read-only disk is never created.
    pub fn open_with(
        spec: &str,
        create_size: Option<u64>,
        read_only: bool,
    ) -> Result<Self, BackingError> {
        let bad = |why: &str| BackingError::Spec {
            spec: spec.to_string(),
            why: why.to_string(),
        };
        let b = if let Some(size) = spec.strip_prefix("null:") {
            let len = parse_size(size)
                .ok_or_else(|| bad("size must be a number with an optional K/M/G/T suffix"))?;
            let fd = rustix::fs::open(
                "/dev/zero",
                rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .map_err(|e| bad(&format!("/dev/zero: {e}")))?;
            Self {
                fd,
                len,
                kind: Kind::Null,
            }
        } else if let Some(n) = spec.strip_prefix("fd:") {
            // Memory the supervisor holds and passes to each incarnation of the model, so
            // that a restarted model finds the bytes its predecessor acknowledged.
            let n: i32 = n
                .parse()
                .map_err(|_| bad("fd:N takes a descriptor number"))?;
            let fd = outboard_sys::process::inherited_file(n).map_err(|e| bad(&e))?;
            let len = rustix::fs::fstat(&fd)
                .map_err(|e| bad(&e.to_string()))?
                .st_size as u64;
            // A memfd takes seals; a file on a file system does not, and needs its flushes.
            let kind = match rustix::fs::fcntl_get_seals(&fd) {
                Ok(_) => Kind::Memory,
                Err(_) => Kind::File(PathBuf::from(spec)),
            };
            Self { fd, len, kind }
        } else if let Some(size) = spec.strip_prefix("mem:") {
            let len = parse_size(size)
                .ok_or_else(|| bad("size must be a number with an optional K/M/G/T suffix"))?;
            let fd = rustix::fs::memfd_create("outboard-disk", MemfdFlags::CLOEXEC)
                .map_err(|e| bad(&e.to_string()))?;
            rustix::fs::ftruncate(&fd, len).map_err(|e| bad(&e.to_string()))?;
            Self {
                fd,
                len,
                kind: Kind::Memory,
            }
        } else {
            let path = PathBuf::from(spec);
            let io = |source| BackingError::Io {
                path: spec.to_string(),
                source,
            };
            // Refuse a bad size before creating anything, so a refusal leaves nothing behind.
            if let Some(n) = create_size.filter(|n| *n == 0 || n % 512 != 0) {
                return Err(bad(&format!("size {n} is not a positive multiple of 512")));
            }
            let file: File = match OpenOptions::new().read(true).write(!read_only).open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && create_size.is_some() => {
                    if read_only {
                        return Err(bad("a read-only disk is not created: make the file first"));
                    }
                    // A disk's bytes are its owner's alone, whatever the umask.
                    let f = OpenOptions::new()
                        .read(true)
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(&path)
                        .map_err(io)?;
                    f.set_len(create_size.unwrap_or(0)).map_err(io)?;
                    f
                }
                Err(e) => return Err(io(e)),
            };
            let len = file.metadata().map_err(io)?.len();
            Self {
                fd: file.into(),
                len,
                kind: Kind::File(path),
            }
        };
        if b.len == 0 || b.len % 512 != 0 {
            return Err(bad(&format!(
                "size {} is not a positive multiple of 512",
                b.len
            )));
        }
        Ok(b)
    }

    /// The descriptor, to pass to a model that opens nothing itself (`fd:N`).
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// The fd to read and write.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: empty backings are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Human-readable description.
    pub fn describe(&self) -> String {
        match &self.kind {
            Kind::File(p) => format!("file {}", p.display()),
            Kind::Memory => "memory".into(),
            Kind::Null => "nothing (reads zeros, drops writes)".into(),
        }
    }

    /// Makes written data durable (FLUSH): `fdatasync` for a file, nothing for memory.
    pub fn flush(&self) -> std::io::Result<()> {
        match self.kind {
            Kind::File(_) => rustix::fs::fdatasync(&self.fd).map_err(Into::into),
            Kind::Memory | Kind::Null => Ok(()),
        }
    }

    /// Deallocates a range (DISCARD); reads return zeros afterwards.
    pub fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.zero(offset, len)
    }

    /// Zeroes a range (WRITE_ZEROES): ZERO_RANGE, else PUNCH_HOLE, else writing zeros.
    pub fn zero(&self, offset: u64, len: u64) -> std::io::Result<()> {
        if matches!(self.kind, Kind::Null) {
            return Ok(());
        }
        if rustix::fs::fallocate(
            &self.fd,
            FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        )
        .is_ok()
        {
            return Ok(());
        }
        if rustix::fs::fallocate(
            &self.fd,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        )
        .is_ok()
        {
            return Ok(());
        }
        let zeros = vec![0u8; 64 << 10];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeros.len() as u64) as usize;
            rustix::io::pwrite(&self.fd, &zeros[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("1g"), Some(1 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("99999999999T"), None);
    }

    #[test]
    fn a_created_disk_is_readable_by_its_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("new.img");
        Backing::open(path.to_str().unwrap(), Some(1 << 20)).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_null_backing_reads_zeros_and_drops_writes() {
        let b = Backing::open("null:1G", None).unwrap();
        assert_eq!(b.len(), 1 << 30);
        rustix::io::pwrite(b.fd(), &[7u8; 512], 4096).unwrap();
        let mut back = [1u8; 512];
        assert_eq!(rustix::io::pread(b.fd(), &mut back, 4096).unwrap(), 512);
        assert_eq!(back, [0u8; 512]);
        b.flush().unwrap();
        b.zero(0, 1 << 20).unwrap();
        assert!(Backing::open("null:100", None).is_err());
    }

    #[test]
    fn rejects_bad_sizes_and_missing_files() {
        assert!(Backing::open("mem:100", None).is_err());
        assert!(Backing::open("mem:", None).is_err());
        assert!(Backing::open("/nonexistent/dir/disk.img", None).is_err());
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.img");
        let b = Backing::open(p.to_str().unwrap(), Some(1 << 20)).unwrap();
        assert_eq!(b.len(), 1 << 20);
    }
}
