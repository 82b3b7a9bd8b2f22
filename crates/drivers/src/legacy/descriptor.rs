//! A C driver's descriptor (`include/outboard/driver.h`) and its class's operations
//! (`include/outboard/clock.h`), read and checked once into Rust values; the only module of
//! the legacy drivers that touches C pointers.
//!
//! The rule that makes a descriptor of any version readable: its first two fields, the ABI
//! version and the structure's size, never move. They are read first; anything else only
//! once both say this Outboard knows the layout.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};

/// The descriptor version this build reads (`OUTBOARD_DRIVER_ABI`).
pub const ABI_VERSION: u32 = 1;
/// Most PCI identities one descriptor may list.
const MAX_IDS: usize = 64;
/// Longest driver or class name.
const MAX_NAME: usize = 64;

/// `struct outboard_pci_id`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawPciId {
    vendor: u16,
    device: u16,
}

/// `struct outboard_driver`.
#[repr(C)]
#[derive(Debug)]
pub struct RawDriver {
    abi_version: u32,
    size: u32,
    name: *const c_char,
    class_name: *const c_char,
    ids: *const RawPciId,
    score: u32,
    class_ops: *const c_void,
}

/// Why a descriptor is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    /// Of another ABI version.
    #[error("the driver was built for driver ABI version {found}; this Outboard reads version {ABI_VERSION}")]
    Version {
        /// The version it says.
        found: u32,
    },
    /// Smaller than the structure of its version.
    #[error("the descriptor says it is {found} bytes; version {ABI_VERSION}'s is {expected}")]
    Size {
        /// What it says.
        found: u32,
        /// What version 1's is.
        expected: usize,
    },
    /// A field is missing or malformed.
    #[error("{0}")]
    Field(String),
}

/// A checked C driver descriptor.
#[derive(Debug)]
pub struct CDriver {
    /// The driver's name.
    pub name: String,
    /// The class it serves.
    pub class: String,
    /// The PCI functions it takes: (vendor, device).
    pub ids: Vec<(u16, u16)>,
    /// Its bid.
    pub score: u32,
    ops: *const c_void,
}

// SAFETY: a descriptor and the operations table it points to are immutable data of the C
// driver, alive for the rest of the process (a built-in's are statics; a library is never
// unloaded); the functions in them are called only inside the driver's legacy environment,
// which admits one thread at a time.
unsafe impl Send for CDriver {}
// SAFETY: as above; nothing in a CDriver is changed after it is read.
unsafe impl Sync for CDriver {}

fn name_field(what: &str, p: *const c_char) -> Result<String, DescriptorError> {
    if p.is_null() {
        return Err(DescriptorError::Field(format!(
            "the descriptor has no {what}"
        )));
    }
    // SAFETY: the driver promises (driver.h) a NUL-terminated string that lives as long as
    // the descriptor; strnlen reads no further than one byte past the longest name allowed.
    let len = unsafe { libc::strnlen(p, MAX_NAME + 1) };
    if len > MAX_NAME {
        return Err(DescriptorError::Field(format!(
            "its {what} is longer than {MAX_NAME} bytes"
        )));
    }
    // SAFETY: len bytes before a NUL, all readable (strnlen found the NUL within them).
    let s = unsafe {
        CStr::from_bytes_with_nul_unchecked(std::slice::from_raw_parts(p.cast(), len + 1))
    };
    let s = s
        .to_str()
        .map_err(|_| DescriptorError::Field(format!("its {what} is not UTF-8")))?;
    let fine = !s.is_empty()
        && s.len() <= MAX_NAME
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !fine {
        return Err(DescriptorError::Field(format!(
            "its {what} {s:?} is not 1 to {MAX_NAME} lower-case letters, digits and '-'"
        )));
    }
    Ok(s.to_string())
}

impl CDriver {
    /// Reads and checks the descriptor at `raw`.
    ///
    /// # Safety
    /// `raw` points to a `struct outboard_driver` (of any version: only its first two fields
    /// are read before they say it is version [`ABI_VERSION`]) that, with everything it
    /// points to, lives for the rest of the process.
    pub unsafe fn read(raw: *const RawDriver) -> Result<Self, DescriptorError> {
        if raw.is_null() {
            return Err(DescriptorError::Field("no descriptor".into()));
        }
        // SAFETY: the caller's promise; the first two u32 fields are in every version. Read
        // unaligned: a library's symbol is not checked for alignment.
        let (version, size) = unsafe {
            (
                std::ptr::addr_of!((*raw).abi_version).read_unaligned(),
                std::ptr::addr_of!((*raw).size).read_unaligned(),
            )
        };
        if version != ABI_VERSION {
            return Err(DescriptorError::Version { found: version });
        }
        let expected = std::mem::size_of::<RawDriver>();
        if (size as usize) < expected {
            return Err(DescriptorError::Size {
                found: size,
                expected,
            });
        }
        // SAFETY: version 1 and at least version 1's size: the whole structure is there.
        let d = unsafe { &*raw };
        let name = name_field("name", d.name)?;
        let class = name_field("class name", d.class_name)?;
        if d.ids.is_null() {
            return Err(DescriptorError::Field(format!("{name}: no PCI identities")));
        }
        let mut ids = Vec::new();
        for i in 0..=MAX_IDS {
            // SAFETY: the list ends with a vendor of 0 (driver.h); reading stops there, and
            // at MAX_IDS + 1 entries at the latest.
            let id = unsafe { *d.ids.add(i) };
            if id.vendor == 0 {
                break;
            }
            if i == MAX_IDS {
                return Err(DescriptorError::Field(format!(
                    "{name}: more than {MAX_IDS} PCI identities (is the list ended by a vendor of 0?)"
                )));
            }
            ids.push((id.vendor, id.device));
        }
        if ids.is_empty() {
            return Err(DescriptorError::Field(format!("{name}: no PCI identities")));
        }
        if d.class_ops.is_null() {
            return Err(DescriptorError::Field(format!(
                "{name}: no class operations"
            )));
        }
        Ok(Self {
            name,
            class,
            ids,
            score: d.score,
            ops: d.class_ops,
        })
    }

    /// Which copy of C code this is (its operations table's address): two descriptors of
    /// the same code share its statics.
    pub fn code(&self) -> usize {
        self.ops as usize
    }

    /// Checks that this Outboard serves the descriptor's class and that its operations are
    /// all there (what `outboard driver-lib` and a library's load refuse early).
    pub fn check_class(&self) -> Result<(), DescriptorError> {
        match self.class.as_str() {
            outboard_clock::CLASS => self.clock_ops().map(drop),
            other => Err(DescriptorError::Field(format!(
                "{}: this Outboard serves no C driver of the {other} class (it serves: clock)",
                self.name
            ))),
        }
    }

    /// The clock operations, for a driver of the clock class.
    pub fn clock_ops(&self) -> Result<ClockOps, DescriptorError> {
        if self.class != outboard_clock::CLASS {
            return Err(DescriptorError::Field(format!(
                "{}: serves the {} class, not clock",
                self.name, self.class
            )));
        }
        // SAFETY: a clock driver's class_ops is a `struct outboard_clock_ops` (driver.h),
        // immutable and alive as long as the descriptor.
        let ops = unsafe { &*(self.ops as *const RawClockOps) };
        match (ops.start, ops.now) {
            (Some(start), Some(now)) => Ok(ClockOps { start, now }),
            _ => Err(DescriptorError::Field(format!(
                "{}: a clock driver needs both start and now",
                self.name
            ))),
        }
    }
}

type StartFn = unsafe extern "C" fn(*const RawClockSink, *mut u32) -> c_int;
type NowFn = unsafe extern "C" fn(*mut u64) -> c_int;

/// `struct outboard_clock_ops`.
#[repr(C)]
struct RawClockOps {
    start: Option<StartFn>,
    now: Option<NowFn>,
}

/// `struct outboard_clock_sink`.
#[repr(C)]
pub struct RawClockSink {
    ctx: *const AtomicTicks,
    ticked: extern "C" fn(*const AtomicTicks, u64),
}

/// Where a C clock driver's ticks land: the running total, and what to do when it moves.
pub struct AtomicTicks {
    /// The highest total reported.
    pub total: AtomicU64,
    /// Called after the total moved (rings the driver server's loop).
    pub moved: Box<dyn Fn() + Send + Sync>,
}

extern "C" fn ticked(ctx: *const AtomicTicks, total: u64) {
    // SAFETY: ctx is the AtomicTicks this sink was made for (ClockSink::new), which the sink
    // keeps alive, and the sink outlives the driver's environment (LegacyClock drops the
    // environment, and with it the interrupt thread, first).
    let t = unsafe { &*ctx };
    if t.total.fetch_max(total, Ordering::AcqRel) < total {
        (t.moved)();
    }
}

/// A sink the C driver reports ticks to, holding what it points at.
pub struct ClockSink {
    raw: Box<RawClockSink>,
    _ticks: std::sync::Arc<AtomicTicks>,
}

// SAFETY: the raw sink only points at the AtomicTicks this value keeps alive, whose fields are
// atomics and a Send + Sync closure.
unsafe impl Send for ClockSink {}

impl ClockSink {
    /// A sink over `ticks`.
    pub fn new(ticks: std::sync::Arc<AtomicTicks>) -> Self {
        Self {
            raw: Box::new(RawClockSink {
                ctx: std::sync::Arc::as_ptr(&ticks),
                ticked,
            }),
            _ticks: ticks,
        }
    }
}

/// A clock driver's operations.
#[derive(Clone, Copy)]
pub struct ClockOps {
    start: StartFn,
    now: NowFn,
}

impl ClockOps {
    /// Calls the driver's `start`: its rate in hertz, or its error code. Call inside the
    /// driver's environment (`Osenv::enter`).
    pub fn start(&self, sink: &ClockSink) -> Result<u32, c_int> {
        let mut hz = 0u32;
        // SAFETY: a C function of the checked descriptor, called as clock.h says: the sink
        // lives as long as the driver (its owner keeps it), hz is a valid out-pointer.
        let rc = unsafe { (self.start)(&*sink.raw, &mut hz) };
        if rc != 0 {
            Err(rc)
        } else {
            Ok(hz)
        }
    }

    /// Calls the driver's `now`: the device's nanoseconds, or its error code. Call inside
    /// the driver's environment.
    pub fn now(&self) -> Result<u64, c_int> {
        let mut ns = 0u64;
        // SAFETY: as for start: a checked descriptor's function and a valid out-pointer.
        let rc = unsafe { (self.now)(&mut ns) };
        if rc != 0 {
            Err(rc)
        } else {
            Ok(ns)
        }
    }
}

extern "C" {
    /// The timer driver's descriptor, compiled in (`c/timer.c`).
    static outboard_builtin_timer: RawDriver;
}

/// The built-in timer driver's descriptor.
pub fn builtin_timer() -> Result<CDriver, DescriptorError> {
    // SAFETY: a static of the C driver compiled into this binary, a `struct outboard_driver`.
    unsafe { CDriver::read(std::ptr::addr_of!(outboard_builtin_timer)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_timer_reads_as_its_c_source_says() {
        let d = builtin_timer().unwrap();
        assert_eq!(d.name, "legacy-timer");
        assert_eq!(d.class, "clock");
        assert_eq!(
            d.ids,
            vec![(outboard_spec::timer::VENDOR, outboard_spec::timer::DEVICE)]
        );
        assert!(d.clock_ops().is_ok());
    }

    fn raw(version: u32, size: u32) -> RawDriver {
        static IDS: [RawPciId; 1] = [RawPciId {
            vendor: 0,
            device: 0,
        }];
        RawDriver {
            abi_version: version,
            size,
            name: c"x".as_ptr(),
            class_name: c"clock".as_ptr(),
            ids: IDS.as_ptr(),
            score: 1,
            class_ops: std::ptr::null(),
        }
    }

    #[test]
    fn another_version_a_short_structure_or_a_bad_field_is_refused_with_why() {
        let full = std::mem::size_of::<RawDriver>() as u32;
        // SAFETY: each points to a live RawDriver whose strings and list are statics.
        let read = |d: &RawDriver| unsafe { CDriver::read(d) };
        let e = read(&raw(2, full)).unwrap_err();
        assert_eq!(e, DescriptorError::Version { found: 2 });
        assert!(e.to_string().contains("version 2") && e.to_string().contains("version 1"));
        assert!(matches!(
            read(&raw(1, 8)),
            Err(DescriptorError::Size { found: 8, .. })
        ));
        // Version 1, whole, but no identities.
        assert!(
            matches!(read(&raw(1, full)), Err(DescriptorError::Field(w)) if w.contains("identities"))
        );
        let mut bad = raw(1, full);
        bad.name = c"Bad Name".as_ptr();
        assert!(matches!(read(&bad), Err(DescriptorError::Field(w)) if w.contains("lower-case")));
    }
}
