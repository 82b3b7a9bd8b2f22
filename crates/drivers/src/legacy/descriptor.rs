//! A C driver's descriptor (`include/outboard/driver.h`) and its class's operations
//! (`include/outboard/clock.h`, `include/outboard/char.h`), read and checked once into Rust
//! values; the only module of the legacy drivers that touches C pointers.
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

/// A driver's active probe (`probe` in `struct outboard_driver`).
type RawProbe = unsafe extern "C" fn(*mut u32, *mut c_char, u32) -> c_int;

/// `struct outboard_driver` with the fields appended within version 1: read only as far as
/// its `size` says the driver's structure goes.
#[repr(C)]
struct RawDriverAppended {
    first: RawDriver,
    probe: Option<RawProbe>,
    model: u32,
}

/// The execution model a C driver is written for (`model` in `struct outboard_driver`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Model {
    /// `osenv.h`: a uniprocessor kernel's rules (`OUTBOARD_MODEL_LEGACY`, and a descriptor
    /// without the field).
    Legacy,
    /// `native.h`: called by the work loop, one call at a time (`OUTBOARD_MODEL_NATIVE`).
    Native,
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
    #[error(
        "the descriptor says it is {found} bytes; version {ABI_VERSION}'s is at least {expected}"
    )]
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
    probe: Option<RawProbe>,
    /// The execution model it is written for.
    pub model: Model,
}

// SAFETY: a descriptor and the operations table it points to are immutable data of the C
// driver, alive for the rest of the process (a built-in's are statics; a library is never
// unloaded). The functions in them are called only under their model's rule, by the class
// bridges of this crate (the calls are crate-private): a legacy driver's inside its
// environment, which admits one thread at a time; a native driver's by its work loop, one
// call at a time; a probe in an environment of its own, touching nothing but its arguments
// and that environment (driver.h).
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
        // A C compiler aligns the structure for its pointers; one that is not is no
        // descriptor (and could not be read in place).
        if !raw.is_aligned() {
            return Err(DescriptorError::Field(
                "the descriptor is not aligned for its pointers".into(),
            ));
        }
        // SAFETY: the caller's promise; the first two u32 fields are in every version.
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
        // Each appended field is read only if `size` covers it: a driver built when the
        // structure ended before it reads as it was.
        let covers = |end: usize| size as usize >= end;
        let probe_end = std::mem::offset_of!(RawDriverAppended, probe)
            + std::mem::size_of::<Option<RawProbe>>();
        let probe = if covers(probe_end) {
            // SAFETY: `size` says the driver's structure reaches past the field; read through
            // a raw pointer (no reference to more than is checked).
            unsafe { std::ptr::addr_of!((*raw.cast::<RawDriverAppended>()).probe).read_unaligned() }
        } else {
            None
        };
        let model_end = std::mem::offset_of!(RawDriverAppended, model) + 4;
        let model = if covers(model_end) {
            // SAFETY: as for `probe`: `size` covers the field.
            let m = unsafe {
                std::ptr::addr_of!((*raw.cast::<RawDriverAppended>()).model).read_unaligned()
            };
            match m {
                0 => Model::Legacy,
                1 => Model::Native,
                other => {
                    return Err(DescriptorError::Field(format!(
                        "its execution model {other} is neither legacy (0) nor native (1)"
                    )))
                }
            }
        } else {
            Model::Legacy
        };
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
            probe,
            model,
        })
    }

    /// Whether the driver has an active probe.
    pub fn has_probe(&self) -> bool {
        self.probe.is_some()
    }

    /// Calls the driver's active probe with `score` (its descriptor's on entry): `Ok` with
    /// its bid, `Err` with its error code and the reason it wrote (lossy UTF-8, possibly
    /// empty). A driver without a probe bids `score` unchanged. Call it only inside the
    /// probe's environment (`Osenv::for_probe`) on the calling thread.
    pub fn call_probe(&self, mut score: u32) -> Result<u32, (c_int, String)> {
        let Some(probe) = self.probe else {
            return Ok(score);
        };
        let mut why = [0u8; 256];
        // SAFETY: the probe's contract (driver.h): it writes the score and at most
        // `why.len()` bytes of reason; both point to live locals of those sizes.
        let rc = unsafe { probe(&mut score, why.as_mut_ptr().cast(), why.len() as u32) };
        if rc == 0 {
            return Ok(score);
        }
        // A reason not ended within the buffer is cut at its end.
        let end = why.iter().position(|&b| b == 0).unwrap_or(why.len());
        Err((rc, String::from_utf8_lossy(&why[..end]).trim().to_string()))
    }

    /// Which copy of C code this is (its operations table's address): two descriptors of
    /// the same code share its statics.
    pub fn code(&self) -> usize {
        self.ops as usize
    }

    /// Checks that this Outboard serves the descriptor's class and that its operations are
    /// all there (what `outboard driver-lib` and a library's load refuse early).
    pub fn check_class(&self) -> Result<(), DescriptorError> {
        match (self.class.as_str(), self.model) {
            (outboard_clock::CLASS, Model::Legacy) => self.clock_ops().map(drop),
            (outboard_clock::CLASS, Model::Native) => self.native_clock_ops().map(drop),
            (outboard_char::CLASS, Model::Legacy) => self.char_ops().map(drop),
            (outboard_char::CLASS, Model::Native) => self.native_char_ops().map(drop),
            (other, _) => Err(DescriptorError::Field(format!(
                "{}: this Outboard serves no C driver of the {other} class (it serves: clock, \
                 char)",
                self.name
            ))),
        }
    }

    /// The native clock operations, for a native driver of the clock class.
    pub fn native_clock_ops(&self) -> Result<NativeClockOps, DescriptorError> {
        if self.class != outboard_clock::CLASS || self.model != Model::Native {
            return Err(DescriptorError::Field(format!(
                "{}: not a native clock driver",
                self.name
            )));
        }
        // SAFETY: a native clock driver's class_ops is a `struct outboard_native_clock_ops`
        // (driver.h, clock.h), immutable and alive as long as the descriptor.
        let ops = unsafe { &*(self.ops as *const RawNativeClockOps) };
        match (ops.start, ops.event, ops.now, ops.stop) {
            (Some(start), Some(event), Some(now), Some(stop)) => Ok(NativeClockOps {
                start,
                event,
                now,
                stop,
            }),
            _ => Err(DescriptorError::Field(format!(
                "{}: a native clock driver needs all of start, event, now and stop",
                self.name
            ))),
        }
    }

    /// The native char operations, for a native driver of the char class.
    pub fn native_char_ops(&self) -> Result<NativeCharOps, DescriptorError> {
        if self.class != outboard_char::CLASS || self.model != Model::Native {
            return Err(DescriptorError::Field(format!(
                "{}: not a native char driver",
                self.name
            )));
        }
        // SAFETY: a native char driver's class_ops is a `struct outboard_native_char_ops`
        // (driver.h, char.h), immutable and alive as long as the descriptor.
        let o = unsafe { &*(self.ops as *const RawNativeCharOps) };
        match (
            o.start, o.event, o.read, o.write, o.get_line, o.set_line, o.counters, o.stop,
        ) {
            (
                Some(start),
                Some(event),
                Some(read),
                Some(write),
                Some(get_line),
                Some(set_line),
                Some(counters),
                Some(stop),
            ) => Ok(NativeCharOps {
                start,
                event,
                read,
                write,
                get_line,
                set_line,
                counters,
                stop,
            }),
            _ => Err(DescriptorError::Field(format!(
                "{}: a native char driver needs all of start, event, read, write, get_line, \
                 set_line, counters and stop",
                self.name
            ))),
        }
    }

    /// The char operations, for a driver of the char class.
    pub fn char_ops(&self) -> Result<CharOps, DescriptorError> {
        if self.class != outboard_char::CLASS || self.model != Model::Legacy {
            return Err(DescriptorError::Field(format!(
                "{}: serves the {} class, not char",
                self.name, self.class
            )));
        }
        // SAFETY: a char driver's class_ops is a `struct outboard_char_ops` (driver.h),
        // immutable and alive as long as the descriptor (for the rest of the process).
        let ops: &'static RawCharOpsChecked = unsafe { &*(self.ops as *const RawCharOpsChecked) };
        let o = &ops.0;
        let all = o.start.is_some()
            && o.read.is_some()
            && o.write.is_some()
            && o.get_line.is_some()
            && o.set_line.is_some()
            && o.counters.is_some()
            && o.stop.is_some();
        if !all {
            return Err(DescriptorError::Field(format!(
                "{}: a char driver needs all of start, read, write, get_line, set_line, \
                 counters and stop",
                self.name
            )));
        }
        Ok(CharOps { ops })
    }

    /// The clock operations, for a driver of the clock class.
    pub fn clock_ops(&self) -> Result<ClockOps, DescriptorError> {
        if self.model != Model::Legacy {
            return Err(DescriptorError::Field(format!(
                "{}: a native driver; its operations are outboard_native_clock_ops",
                self.name
            )));
        }
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

/// `struct outboard_char_ops`.
#[repr(C)]
struct RawCharOps {
    start: Option<unsafe extern "C" fn(*const RawCharSink, *mut RawCharInfo) -> c_int>,
    read: Option<unsafe extern "C" fn(*mut c_void, std::ffi::c_ulong, c_int) -> std::ffi::c_long>,
    write: Option<WriteFn>,
    get_line: Option<GetLineFn>,
    set_line: Option<SetLineFn>,
    counters: Option<CountersFn>,
    stop: Option<unsafe extern "C" fn()>,
}

/// `struct outboard_char_sink`.
#[repr(C)]
pub struct RawCharSink {
    ctx: *const CharBell,
    moved: extern "C" fn(*const CharBell),
}

/// `struct outboard_char_info`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct RawCharInfo {
    /// The fastest rate.
    pub max_baud: u32,
    /// FIFO bytes.
    pub fifo: u32,
}

/// `struct outboard_line`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RawLine {
    /// Bits per second.
    pub baud: u32,
    /// Data bits.
    pub data_bits: u8,
    /// `OUTBOARD_PARITY_*`: the class's parity codes.
    pub parity: u8,
    /// Stop bits.
    pub stop_bits: u8,
    /// `OUTBOARD_FLOW_*`: the class's flow codes.
    pub flow: u8,
}

/// `struct outboard_char_counters`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct RawCharCounters {
    /// Bytes sent.
    pub sent: u64,
    /// Bytes received.
    pub received: u64,
    /// Bytes dropped.
    pub dropped: u32,
    /// Overruns.
    pub overruns: u32,
    /// Errors.
    pub errors: u32,
    /// `OUTBOARD_MODEM_*`.
    pub modem: u8,
    /// Sending held by flow control.
    pub held: u8,
    reserved: [u8; 2],
}

/// What a C char driver's sink rings when something moved.
pub struct CharBell {
    /// Called at interrupt level (rings the driver server's loop).
    pub moved: Box<dyn Fn() + Send + Sync>,
}

extern "C" fn char_moved(ctx: *const CharBell) {
    // SAFETY: ctx is the CharBell this sink was made for (CharSink::new), kept alive by the
    // sink, which outlives the driver's environment (LegacyChar drops that first).
    (unsafe { &*ctx }.moved)();
}

/// A sink a C char driver reports to, holding what it points at.
pub struct CharSink {
    raw: Box<RawCharSink>,
    _bell: std::sync::Arc<CharBell>,
}

// SAFETY: the raw sink only points at the CharBell this value keeps alive, a Send + Sync
// closure.
unsafe impl Send for CharSink {}

impl CharSink {
    /// A sink over `bell`.
    pub fn new(bell: std::sync::Arc<CharBell>) -> Self {
        Self {
            raw: Box::new(RawCharSink {
                ctx: std::sync::Arc::as_ptr(&bell),
                moved: char_moved,
            }),
            _bell: bell,
        }
    }
}

/// A char driver's operations. Each is called inside the driver's environment.
#[derive(Clone, Copy)]
pub struct CharOps {
    ops: &'static RawCharOpsChecked,
}

/// A char operations table with every entry present.
struct RawCharOpsChecked(RawCharOps);

// SAFETY: function pointers of immutable C code; see CDriver's Send and Sync.
unsafe impl Sync for RawCharOpsChecked {}

fn rc(rc: c_int) -> Result<(), c_int> {
    if rc == 0 {
        Ok(())
    } else {
        Err(rc)
    }
}

impl CharOps {
    /// `start`: what the device is, or the driver's error code.
    pub fn start(&self, sink: &CharSink) -> Result<RawCharInfo, c_int> {
        let mut info = RawCharInfo::default();
        // SAFETY: a checked table's function, called as char.h says: the sink lives as long as
        // the driver (its owner keeps it), info is a valid out-pointer.
        rc(unsafe { (self.ops.0.start.expect("checked"))(&*sink.raw, &mut info) })?;
        Ok(info)
    }

    /// `read` into `buf`: the count, or the driver's (negative) code.
    pub fn read(&self, buf: &mut [u8], wait: bool) -> Result<usize, c_int> {
        // SAFETY: buf is valid for buf.len() bytes of writes; the driver writes at most that.
        let n = unsafe {
            (self.ops.0.read.expect("checked"))(
                buf.as_mut_ptr().cast(),
                buf.len() as std::ffi::c_ulong,
                c_int::from(wait),
            )
        };
        count(n, buf.len())
    }

    /// `write` of `bytes`: how many the driver took, or its (negative) code.
    pub fn write(&self, bytes: &[u8]) -> Result<usize, c_int> {
        // SAFETY: bytes is valid for bytes.len() bytes of reads; the driver reads at most that.
        let n = unsafe {
            (self.ops.0.write.expect("checked"))(
                bytes.as_ptr().cast(),
                bytes.len() as std::ffi::c_ulong,
            )
        };
        count(n, bytes.len())
    }

    /// `get_line`.
    pub fn get_line(&self) -> Result<RawLine, c_int> {
        let mut l = RawLine::default();
        // SAFETY: a valid out-pointer.
        rc(unsafe { (self.ops.0.get_line.expect("checked"))(&mut l) })?;
        Ok(l)
    }

    /// `set_line`.
    pub fn set_line(&self, l: &RawLine) -> Result<(), c_int> {
        // SAFETY: a valid pointer to settings the call only reads.
        rc(unsafe { (self.ops.0.set_line.expect("checked"))(l) })
    }

    /// `counters`.
    pub fn counters(&self) -> RawCharCounters {
        let mut c = RawCharCounters::default();
        // SAFETY: a valid out-pointer.
        unsafe { (self.ops.0.counters.expect("checked"))(&mut c) };
        c
    }

    /// `stop`.
    pub fn stop(&self) {
        // SAFETY: a checked table's function without arguments.
        unsafe { (self.ops.0.stop.expect("checked"))() }
    }
}

type WriteFn = unsafe extern "C" fn(*const c_void, std::ffi::c_ulong) -> std::ffi::c_long;
type GetLineFn = unsafe extern "C" fn(*mut RawLine) -> c_int;
type SetLineFn = unsafe extern "C" fn(*const RawLine) -> c_int;
type CountersFn = unsafe extern "C" fn(*mut RawCharCounters);
type NativeCharStartFn =
    unsafe extern "C" fn(*mut c_void, *const RawCharSink, *mut RawCharInfo) -> c_int;
type NativeReadFn = unsafe extern "C" fn(*mut c_void, std::ffi::c_ulong) -> std::ffi::c_long;

/// `struct outboard_native_char_ops`.
#[repr(C)]
struct RawNativeCharOps {
    start: Option<NativeCharStartFn>,
    event: Option<unsafe extern "C" fn(u32) -> c_int>,
    read: Option<NativeReadFn>,
    write: Option<WriteFn>,
    get_line: Option<GetLineFn>,
    set_line: Option<SetLineFn>,
    counters: Option<CountersFn>,
    stop: Option<unsafe extern "C" fn()>,
}

/// A count a C call returned (at most `len`), or its negative code.
fn count(n: std::ffi::c_long, len: usize) -> Result<usize, c_int> {
    if n < 0 {
        Err(c_int::try_from(n).unwrap_or(c_int::MIN))
    } else {
        Ok((n as usize).min(len))
    }
}

/// A native char driver's operations, called by the work loop's thread, one at a time, only
/// between a successful `start` and `stop` (or the device's give-up).
#[derive(Clone, Copy)]
pub struct NativeCharOps {
    start: NativeCharStartFn,
    event: unsafe extern "C" fn(u32) -> c_int,
    read: NativeReadFn,
    write: WriteFn,
    get_line: GetLineFn,
    set_line: SetLineFn,
    counters: CountersFn,
    stop: unsafe extern "C" fn(),
}

impl NativeCharOps {
    /// Calls `start` on device handle `dev`: what the device is, or the driver's code.
    ///
    /// # Safety
    /// `dev` is a live `outboard_dev` handle that stays valid, like `sink`, until
    /// [`NativeCharOps::stop`] returns or the driver is given up.
    pub(crate) unsafe fn start(
        &self,
        dev: *mut c_void,
        sink: &CharSink,
    ) -> Result<RawCharInfo, c_int> {
        let mut info = RawCharInfo::default();
        // SAFETY: a function of the checked descriptor, called as char.h says; the caller
        // keeps dev and sink alive; info is a valid out-pointer.
        rc(unsafe { (self.start)(dev, &*sink.raw, &mut info) })?;
        Ok(info)
    }

    /// Calls `event` for vector `vector`.
    pub(crate) fn event(&self, vector: u32) -> Result<(), c_int> {
        // SAFETY: a function of the checked descriptor taking a plain integer; called between
        // `start` and `stop` (the bridge's rule).
        rc(unsafe { (self.event)(vector) })
    }

    /// Calls `read` into `buf`: the count, or the driver's code.
    pub(crate) fn read(&self, buf: &mut [u8]) -> Result<usize, c_int> {
        // SAFETY: buf is valid for buf.len() bytes of writes; the driver writes at most that.
        let n = unsafe { (self.read)(buf.as_mut_ptr().cast(), buf.len() as std::ffi::c_ulong) };
        count(n, buf.len())
    }

    /// Calls `write` of `bytes`: how many the driver took, or its code.
    pub(crate) fn write(&self, bytes: &[u8]) -> Result<usize, c_int> {
        // SAFETY: bytes is valid for bytes.len() bytes of reads; the driver reads at most that.
        let n = unsafe { (self.write)(bytes.as_ptr().cast(), bytes.len() as std::ffi::c_ulong) };
        count(n, bytes.len())
    }

    /// Calls `get_line`.
    pub(crate) fn get_line(&self) -> Result<RawLine, c_int> {
        let mut l = RawLine::default();
        // SAFETY: a valid out-pointer.
        rc(unsafe { (self.get_line)(&mut l) })?;
        Ok(l)
    }

    /// Calls `set_line`.
    pub(crate) fn set_line(&self, l: &RawLine) -> Result<(), c_int> {
        // SAFETY: a valid pointer to settings the call only reads.
        rc(unsafe { (self.set_line)(l) })
    }

    /// Calls `counters`.
    pub(crate) fn counters(&self) -> RawCharCounters {
        let mut c = RawCharCounters::default();
        // SAFETY: a valid out-pointer.
        unsafe { (self.counters)(&mut c) };
        c
    }

    /// Calls `stop`.
    pub(crate) fn stop(&self) {
        // SAFETY: a function of the checked descriptor taking nothing; called once, last.
        unsafe { (self.stop)() }
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

/// `struct outboard_native_clock_ops`.
#[repr(C)]
struct RawNativeClockOps {
    start: Option<NativeStartFn>,
    event: Option<unsafe extern "C" fn(u32) -> c_int>,
    now: Option<NowFn>,
    stop: Option<unsafe extern "C" fn()>,
}

type NativeStartFn = unsafe extern "C" fn(*mut c_void, *const RawClockSink, *mut u32) -> c_int;

/// A native clock driver's operations, called by the work loop's thread, one at a time.
#[derive(Clone, Copy)]
pub struct NativeClockOps {
    start: NativeStartFn,
    event: unsafe extern "C" fn(u32) -> c_int,
    now: NowFn,
    stop: unsafe extern "C" fn(),
}

impl NativeClockOps {
    /// Calls `start` on device handle `dev`: its rate in hertz, or its error code.
    ///
    /// # Safety
    /// `dev` is a live `outboard_dev` handle (`crate::native_c::DevHandle`) that stays valid,
    /// like `sink`, until [`NativeClockOps::stop`] returns or the driver is given up.
    pub(crate) unsafe fn start(&self, dev: *mut c_void, sink: &ClockSink) -> Result<u32, c_int> {
        let mut hz = 0u32;
        // SAFETY: a function of the checked descriptor, called as clock.h says; the caller
        // keeps dev and sink alive; hz is a valid out-pointer.
        rc(unsafe { (self.start)(dev, &*sink.raw, &mut hz) })?;
        Ok(hz)
    }

    /// Calls `event` for vector `vector`.
    pub(crate) fn event(&self, vector: u32) -> Result<(), c_int> {
        // SAFETY: a function of the checked descriptor taking a plain integer; called only
        // after `start` succeeded and before `stop` (the bridge's rule).
        rc(unsafe { (self.event)(vector) })
    }

    /// Calls `now`: the device's time in nanoseconds.
    pub(crate) fn now(&self) -> Result<u64, c_int> {
        let mut ns = 0u64;
        // SAFETY: a valid out-pointer; called between `start` and `stop`.
        rc(unsafe { (self.now)(&mut ns) })?;
        Ok(ns)
    }

    /// Calls `stop`.
    pub(crate) fn stop(&self) {
        // SAFETY: a function of the checked descriptor taking nothing; called once, last.
        unsafe { (self.stop)() }
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
    static outboard_builtin_timer: RawDriverAppended;
    /// The native timer driver's descriptor, compiled in (`c/native_timer.c`).
    static outboard_builtin_native_timer: RawDriverAppended;
    /// The 16550 driver's descriptor, compiled in (`c/uart16550.c`).
    static outboard_builtin_uart16550: RawDriverAppended;
    /// The native 16550 driver's descriptor, compiled in (`c/native_uart16550.c`).
    static outboard_builtin_native_uart16550: RawDriverAppended;
}

/// The built-in native 16550 driver's descriptor.
pub fn builtin_native_uart16550() -> Result<CDriver, DescriptorError> {
    // SAFETY: a static of the C driver compiled into this binary, a `struct outboard_driver`.
    unsafe { CDriver::read(std::ptr::addr_of!(outboard_builtin_native_uart16550).cast()) }
}

/// The built-in 16550 driver's descriptor.
pub fn builtin_uart16550() -> Result<CDriver, DescriptorError> {
    // SAFETY: a static of the C driver compiled into this binary, a `struct outboard_driver`.
    unsafe { CDriver::read(std::ptr::addr_of!(outboard_builtin_uart16550).cast()) }
}

/// The built-in timer driver's descriptor.
pub fn builtin_timer() -> Result<CDriver, DescriptorError> {
    // SAFETY: a static of the C driver compiled into this binary, a `struct outboard_driver`.
    unsafe { CDriver::read(std::ptr::addr_of!(outboard_builtin_timer).cast()) }
}

/// The built-in native timer driver's descriptor.
pub fn builtin_native_timer() -> Result<CDriver, DescriptorError> {
    // SAFETY: a static of the C driver compiled into this binary, a `struct outboard_driver`.
    unsafe { CDriver::read(std::ptr::addr_of!(outboard_builtin_native_timer).cast()) }
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
        let u = builtin_uart16550().unwrap();
        assert_eq!(u.name, "uart16550");
        assert_eq!(u.class, "char");
        assert_eq!(
            u.ids,
            vec![(outboard_spec::uart::VENDOR, outboard_spec::uart::DEVICE)]
        );
        assert!(u.char_ops().is_ok() && u.clock_ops().is_err());
        let n = builtin_native_uart16550().unwrap();
        assert_eq!((n.class.as_str(), n.model), ("char", Model::Native));
        assert_eq!(n.ids, u.ids);
        assert!(n.native_char_ops().is_ok() && n.char_ops().is_err());
        let t = builtin_native_timer().unwrap();
        assert_eq!((t.class.as_str(), t.model), ("clock", Model::Native));
        assert!(t.native_clock_ops().is_ok() && t.clock_ops().is_err());
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

    unsafe extern "C" fn bids_twice(score: *mut u32, _: *mut c_char, _: u32) -> c_int {
        // SAFETY: call_probe passes a live u32.
        unsafe { *score *= 2 };
        0
    }

    unsafe extern "C" fn declines(_: *mut u32, why: *mut c_char, size: u32) -> c_int {
        let text = b"not this one\0";
        assert!(size as usize >= text.len());
        // SAFETY: call_probe passes `size` writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), why.cast(), text.len()) };
        -22
    }

    /// A careless probe: it fills the whole reason buffer and ends it with no NUL.
    unsafe extern "C" fn declines_unended(_: *mut u32, why: *mut c_char, size: u32) -> c_int {
        // SAFETY: call_probe passes `size` writable bytes.
        unsafe { std::ptr::write_bytes(why, b'x', size as usize) };
        -5
    }

    #[test]
    fn a_probe_is_read_only_where_the_descriptors_size_covers_it() {
        static IDS: [RawPciId; 2] = [
            RawPciId {
                vendor: 0x1234,
                device: 1,
            },
            RawPciId {
                vendor: 0,
                device: 0,
            },
        ];
        static OPS: u8 = 0;
        let first = |size: usize| RawDriver {
            size: size as u32,
            ids: IDS.as_ptr(),
            class_ops: std::ptr::addr_of!(OPS).cast(),
            ..raw(1, 0)
        };
        let appended = |probe: RawProbe, size: usize| RawDriverAppended {
            first: first(size),
            probe: Some(probe),
            model: 0,
        };
        let whole = std::mem::size_of::<RawDriverAppended>();
        // SAFETY: each points to a live descriptor whose strings and lists are statics.
        let old = unsafe { CDriver::read(&first(std::mem::size_of::<RawDriver>())) }.unwrap();
        assert!(
            !old.has_probe(),
            "a driver built before the probe field has none"
        );
        assert_eq!(old.call_probe(7), Ok(7), "its score is its bid");
        // A probe present, but beyond what `size` says the driver's structure holds: unread.
        let short = appended(bids_twice, std::mem::size_of::<RawDriver>());
        // SAFETY: as above (reading goes no further than `size`).
        let d = unsafe { CDriver::read(std::ptr::addr_of!(short).cast()) }.unwrap();
        assert!(!d.has_probe());
        // Built when the structure ended with the probe (before `model` was appended): its
        // probe is read, and it is a legacy driver.
        let probe_end = std::mem::offset_of!(RawDriverAppended, model);
        let d = appended(bids_twice, probe_end);
        // SAFETY: as above.
        let d = unsafe { CDriver::read(std::ptr::addr_of!(d).cast()) }.unwrap();
        assert_eq!(d.call_probe(7), Ok(14), "a probe its size covers is read");
        assert_eq!(d.model, Model::Legacy);
        let d = appended(bids_twice, whole);
        // SAFETY: as above.
        let d = unsafe { CDriver::read(std::ptr::addr_of!(d).cast()) }.unwrap();
        assert_eq!(d.call_probe(7), Ok(14));
        assert_eq!(d.model, Model::Legacy, "model 0 is the legacy model");
        let mut native = appended(bids_twice, whole);
        native.model = 1;
        // SAFETY: as above.
        let d = unsafe { CDriver::read(std::ptr::addr_of!(native).cast()) }.unwrap();
        assert_eq!(d.model, Model::Native);
        native.model = 7;
        // SAFETY: as above.
        let e = unsafe { CDriver::read(std::ptr::addr_of!(native).cast()) }.unwrap_err();
        assert!(e.to_string().contains("execution model 7"), "{e}");
        let d = appended(declines, whole);
        // SAFETY: as above.
        let d = unsafe { CDriver::read(std::ptr::addr_of!(d).cast()) }.unwrap();
        assert_eq!(d.call_probe(7), Err((-22, "not this one".to_string())));
        let d = appended(declines_unended, whole);
        // SAFETY: as above.
        let d = unsafe { CDriver::read(std::ptr::addr_of!(d).cast()) }.unwrap();
        let (rc, why) = d.call_probe(7).unwrap_err();
        assert_eq!(rc, -5);
        assert!(
            why.len() == 256 && why.bytes().all(|b| b == b'x'),
            "cut at the buffer's end"
        );
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
