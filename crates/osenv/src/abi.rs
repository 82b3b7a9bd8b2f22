//! The `osenv` C functions. Each finds the driver the calling thread is in
//! (`outboard_env::legacy::with_current`); called from outside any driver it does nothing,
//! logs why, and returns an error where it can. The semantics are in `osenv.h`.
//!
//! This module has `unsafe`: it takes pointers from C (sleep records, memory blocks, text)
//! and calls C function pointers (handlers, timer callbacks).

use std::alloc::Layout;
use std::ffi::{c_char, c_int, c_long, c_uint, c_void, CStr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_env::legacy::{with_current, Cpu, SleepRec};

use crate::state::{Block, CHandler, State, TimerReg, FIRST_TIMER_VECTOR, MAX_TIMERS};

/// Error codes of `osenv.h`.
/// `OSENV_EINVAL`: a bad argument (also what a C driver answers for settings it cannot make).
pub const EINVAL: c_int = -22;
const EBUSY: c_int = -16;
const ENOTIN: c_int = -1;
const EPERM: c_int = -1;
const EIO: c_int = -5;

const OSENV_IRQ_SHAREABLE: c_int = 0x1;
const OSENV_AUTO_SIZE: c_uint = 0x01;
const OSENV_PHYS_WIRED: c_uint = 0x02;
const KNOWN_MEMFLAGS: c_uint = 0x3f;

/// Highest timer frequency: 100 kHz (a 10 µs period).
const MAX_HZ: c_int = 100_000;

/// Runs `f` on the calling thread's driver and its `osenv` state, or logs that `call` came
/// from outside any driver.
fn in_driver<R>(call: &str, f: impl FnOnce(&Cpu, &State) -> R) -> Option<R> {
    let r = with_current(|cpu| cpu.context::<State>().map(|s| f(cpu, s))).flatten();
    if r.is_none() {
        tracing::error!("{call} called from outside a legacy driver: ignored");
    }
    r
}

/// As [`in_driver`], with interrupts held off while `f` runs: for every call that allocates,
/// logs or takes a lock, which a handler interrupting it could re-enter.
fn in_driver_quiet<R>(call: &str, f: impl FnOnce(&Cpu, &State) -> R) -> Option<R> {
    in_driver(call, |cpu, st| cpu.without_interrupts(|| f(cpu, st)))
}

/// `osenv_intr_disable`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_intr_disable() {
    in_driver("osenv_intr_disable", |cpu, _| cpu.intr_disable());
}

/// `osenv_intr_enable`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_intr_enable() {
    in_driver("osenv_intr_enable", |cpu, _| cpu.intr_enable());
}

/// `osenv_intr_enabled`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_intr_enabled() -> c_int {
    in_driver("osenv_intr_enabled", |cpu, _| cpu.intr_enabled() as c_int).unwrap_or(0)
}

/// A C handler and its argument, as a closure the model calls.
fn c_handler(func: extern "C" fn(*mut c_void), data: usize) -> outboard_env::legacy::Handler {
    Arc::new(move || func(data as *mut c_void))
}

/// `osenv_irq_alloc`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_irq_alloc(
    irq: c_int,
    handler: Option<extern "C" fn(*mut c_void)>,
    data: *mut c_void,
    flags: c_int,
) -> c_int {
    let Some(func) = handler else {
        return EINVAL;
    };
    if !(0..FIRST_TIMER_VECTOR as c_int).contains(&irq) {
        return EINVAL;
    }
    in_driver_quiet("osenv_irq_alloc", |cpu, st| {
        let vector = irq as u32;
        // A driver with a device has the device's vectors; one without (a test) any of 0-47.
        if st.device.is_some() && vector as usize >= st.irqs.len() {
            return EINVAL;
        }
        let shareable = flags & OSENV_IRQ_SHAREABLE != 0;
        match cpu.irq_alloc(vector, c_handler(func, data as usize), shareable) {
            Ok(id) => {
                st.handlers
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(CHandler {
                        vector,
                        func: func as usize,
                        data: data as usize,
                        id,
                    });
                0
            }
            Err(outboard_env::legacy::IrqError::Busy(_)) => EBUSY,
            Err(outboard_env::legacy::IrqError::InHandler) => EPERM,
            Err(_) => EINVAL,
        }
    })
    .unwrap_or(ENOTIN)
}

/// `osenv_irq_free`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_irq_free(
    irq: c_int,
    handler: Option<extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) {
    let Some(func) = handler else { return };
    in_driver("osenv_irq_free", |cpu, st| {
        if cpu.in_handler() {
            return;
        }
        let found = cpu.without_interrupts(|| {
            let mut list = st.handlers.lock().unwrap_or_else(|p| p.into_inner());
            let at = list.iter().position(|h| {
                h.vector as c_int == irq && h.func == func as usize && h.data == data as usize
            })?;
            Some(list.remove(at))
        });
        match found {
            Some(h) => cpu.irq_free(h.vector, h.id),
            None => tracing::warn!(
                "{}: osenv_irq_free of a handler not registered on vector {irq}",
                st.name
            ),
        }
    });
}

/// `osenv_irq_disable`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_irq_disable(irq: c_int) {
    if (0..FIRST_TIMER_VECTOR as c_int).contains(&irq) {
        in_driver("osenv_irq_disable", |cpu, _| cpu.irq_disable(irq as u32));
    }
}

/// `osenv_irq_enable`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_irq_enable(irq: c_int) {
    if (0..FIRST_TIMER_VECTOR as c_int).contains(&irq) {
        in_driver("osenv_irq_enable", |cpu, _| cpu.irq_enable(irq as u32));
    }
}

/// `osenv_irq_pending`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_irq_pending(irq: c_int) -> c_int {
    if !(0..FIRST_TIMER_VECTOR as c_int).contains(&irq) {
        return 0;
    }
    in_driver("osenv_irq_pending", |cpu, _| {
        cpu.irq_pending(irq as u32) as c_int
    })
    .unwrap_or(0)
}

/// The sleep record behind a C pointer.
///
/// # Safety
/// `sr` is null or points at an `osenv_sleeprec_t` (two `unsigned int`s, the layout of
/// [`SleepRec`]) that stays valid for the returned lifetime.
unsafe fn record<'a>(sr: *mut c_void) -> Option<&'a SleepRec> {
    // SAFETY: the caller's contract; `SleepRec` is `repr(C)` of two `AtomicU32`s, which have
    // the size and alignment of `unsigned int`, and atomics tolerate the concurrent accesses
    // (a handler's wakeup) the record sees.
    unsafe { sr.cast::<SleepRec>().as_ref() }
}

/// # Safety
/// `sr` points at a valid `osenv_sleeprec_t`.
#[no_mangle]
pub unsafe extern "C" fn osenv_sleep_init(sr: *mut c_void) {
    // SAFETY: the caller's contract.
    if let Some(r) = unsafe { record(sr) } {
        r.init();
    }
}

/// # Safety
/// `sr` points at a valid `osenv_sleeprec_t` that outlives the sleep.
#[no_mangle]
pub unsafe extern "C" fn osenv_sleep(sr: *mut c_void) {
    // SAFETY: the caller's contract.
    let Some(r) = (unsafe { record(sr) }) else {
        return;
    };
    in_driver("osenv_sleep", |cpu, st| {
        if st.probing {
            // Nothing of a probe's environment would ever wake it: returning at once is what
            // a spurious wakeup does, which a sleeper must expect anyway.
            tracing::warn!("{}: its probe called osenv_sleep: refused", st.name);
            return;
        }
        cpu.sleep(r)
    });
}

/// # Safety
/// `sr` points at a valid `osenv_sleeprec_t`.
#[no_mangle]
pub unsafe extern "C" fn osenv_wakeup(sr: *mut c_void) {
    if sr.is_null() {
        return;
    }
    // A wakeup needs no driver: one store and a futex wake. The sleeper may return and free
    // the record as soon as the store lands, so no reference to it outlives the store: the
    // wake goes to the address (a wake on freed memory wakes nobody, or a waiter that
    // tolerates spurious wake-ups).
    let word = sr.cast::<u32>();
    // SAFETY: the caller's contract: `sr` points at a valid record whose first word is the
    // futex word, accessed atomically by every party; the reference lives for the store only.
    unsafe { std::sync::atomic::AtomicU32::from_ptr(word) }
        .store(1, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: FUTEX_WAKE compares addresses only; it reads no memory through the pointer.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word,
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        )
    };
}

/// `osenv_mem_alloc`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_mem_alloc(size: usize, flags: c_uint, align: c_uint) -> *mut c_void {
    let align = if align == 0 { 1 } else { align as usize };
    if size == 0 || !align.is_power_of_two() || flags & !KNOWN_MEMFLAGS != 0 {
        return std::ptr::null_mut();
    }
    // A handler interrupting the allocator would corrupt it: interrupts are held off.
    in_driver_quiet("osenv_mem_alloc", |_, st| alloc(st, size, flags, align))
        .flatten()
        .unwrap_or(std::ptr::null_mut())
}

thread_local! {
    /// Whether this thread is inside the allocator of `osenv_mem_alloc`/`osenv_mem_free`.
    static IN_ALLOCATOR: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is inside the allocator of `osenv_mem_alloc` or
/// `osenv_mem_free`: a handler that finds it so has interrupted an allocation, which the rule
/// "allocations run with interrupts held off" forbids (the test of that rule asks it from a
/// handler; a constant-initialised thread-local is safe to read in a signal handler).
#[doc(hidden)]
pub fn in_allocator() -> bool {
    IN_ALLOCATOR.with(|f| f.get())
}

/// Marks the calling thread inside the allocator until dropped.
struct Allocating;

impl Allocating {
    fn new() -> Self {
        IN_ALLOCATOR.with(|f| f.set(true));
        Allocating
    }
}

impl Drop for Allocating {
    fn drop(&mut self) {
        IN_ALLOCATOR.with(|f| f.set(false));
    }
}

fn alloc(st: &State, size: usize, flags: c_uint, align: usize) -> Option<*mut c_void> {
    let _allocating = Allocating::new();
    let (ptr, block) = if flags & OSENV_PHYS_WIRED != 0 {
        let Some(dma) = &st.dma else {
            tracing::warn!(
                "{}: wired memory asked for, but the driver has no device",
                st.name
            );
            return None;
        };
        if align > 4096 {
            return None;
        }
        let buf = dma
            .alloc(size)
            .inspect_err(|e| tracing::warn!("{}: wired memory: {e}", st.name))
            .ok()?;
        let ptr = buf.io_ptr(0, size).ok()?;
        (ptr, Block::Wired(buf))
    } else {
        let layout = Layout::from_size_align(size, align).ok()?;
        // SAFETY: the layout has a non-zero size (checked by the caller).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return None;
        }
        (ptr, Block::Heap(layout))
    };
    st.blocks
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(ptr as usize, block);
    Some(ptr.cast())
}

/// `osenv_mem_free`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_mem_free(block: *mut c_void, flags: c_uint, size: usize) {
    if block.is_null() {
        return;
    }
    in_driver("osenv_mem_free", |cpu, st| {
        cpu.without_interrupts(|| {
            let _allocating = Allocating::new();
            let removed = st
                .blocks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(block as usize));
            match removed {
                Some(Block::Heap(layout)) => {
                    if flags & OSENV_AUTO_SIZE == 0 && size != layout.size() {
                        tracing::warn!(
                            "{}: osenv_mem_free of {} bytes for a block of {}",
                            st.name,
                            size,
                            layout.size()
                        );
                    }
                    // SAFETY: the block was allocated by `alloc` with this layout and was in
                    // the table until now, so it is freed once.
                    unsafe { std::alloc::dealloc(block.cast(), layout) }
                }
                // Dropping the buffer unmaps it from the device and frees it.
                Some(Block::Wired(buf)) => drop(buf),
                None => tracing::warn!(
                    "{}: osenv_mem_free of {block:p}, which osenv_mem_alloc did not return",
                    st.name
                ),
            }
        })
    });
}

/// `osenv_mem_get_phys`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_mem_get_phys(va: usize) -> usize {
    in_driver_quiet("osenv_mem_get_phys", |_, st| st.phys(va))
        .flatten()
        .unwrap_or(0) as usize
}

/// The text of a C string, lossily.
///
/// # Safety
/// `text` is null or a NUL-terminated string.
unsafe fn text(text: *const c_char) -> String {
    if text.is_null() {
        return String::new();
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// Called by `osenv_vlog` (C) with the formatted message.
///
/// # Safety
/// `message` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn outboard_osenv_log_text(priority: c_int, message: *const c_char) {
    // Formatting allocates and the subscriber takes locks: a handler must not interrupt them.
    let log = |name: &str| {
        // SAFETY: the caller's contract.
        let message = unsafe { text(message) };
        let message = message.trim_end();
        match priority {
            0..=3 => tracing::error!(driver = %name, "{message}"),
            4 => tracing::warn!(driver = %name, "{message}"),
            5 | 6 => tracing::info!(driver = %name, "{message}"),
            _ => tracing::debug!(driver = %name, "{message}"),
        }
    };
    let in_a_driver = with_current(|cpu| {
        cpu.without_interrupts(|| log(cpu.context::<State>().map_or("", |s| s.name.as_str())))
    });
    if in_a_driver.is_none() {
        log("");
    }
}

/// Called by `osenv_vpanic` (C): logs and ends the process.
///
/// # Safety
/// `message` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn outboard_osenv_panic_text(message: *const c_char) -> ! {
    // SAFETY: the caller's contract.
    let message = unsafe { text(message) };
    with_current(|cpu| cpu.intr_disable());
    tracing::error!("legacy driver panicked: {}", message.trim_end());
    eprintln!("legacy driver panicked: {}", message.trim_end());
    std::process::abort()
}

/// `osenv_timer_init`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_timer_init() {}

/// `osenv_timer_register`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_timer_register(func: Option<extern "C" fn()>, freq: c_int) -> c_int {
    let Some(func) = func else { return EINVAL };
    if !(1..=MAX_HZ).contains(&freq) {
        return EINVAL;
    }
    in_driver("osenv_timer_register", |cpu, st| {
        if cpu.in_handler() {
            return EPERM;
        }
        if st.probing {
            tracing::warn!("{}: its probe asked for a timer: refused", st.name);
            return EPERM;
        }
        cpu.without_interrupts(|| register(cpu, st, func, freq))
    })
    .unwrap_or(ENOTIN)
}

fn register(cpu: &Cpu, st: &State, func: extern "C" fn(), freq: c_int) -> c_int {
    {
        let mut timers = st.timers.lock().unwrap_or_else(|p| p.into_inner());
        if timers.len() >= MAX_TIMERS {
            return EBUSY;
        }
        let vector = (FIRST_TIMER_VECTOR..FIRST_TIMER_VECTOR + MAX_TIMERS as u32)
            .find(|v| timers.iter().all(|t| t.vector != *v))
            .expect("fewer than MAX_TIMERS timers leave a vector free");
        let fd = match outboard_sys::timer::periodic(Some(outboard_sys::timer::period_of(
            freq as u32,
        ))) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!("{}: timer: {e}", st.name);
                return EBUSY;
            }
        };
        let handler: outboard_env::legacy::Handler = Arc::new(move || func());
        let Ok(id) = cpu.irq_alloc(vector, handler, false) else {
            return EBUSY;
        };
        // Registered first, attached second: a tick finds its handler.
        match st.sources.attach(fd, vector) {
            Ok(source) => {
                timers.push(TimerReg {
                    func: func as usize,
                    freq,
                    vector,
                    handler: id,
                    source,
                });
                0
            }
            Err(e) => {
                tracing::warn!("{}: timer: {e}", st.name);
                cpu.irq_free(vector, id);
                EBUSY
            }
        }
    }
}

/// `osenv_timer_unregister`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_timer_unregister(func: Option<extern "C" fn()>, freq: c_int) {
    let Some(func) = func else { return };
    in_driver("osenv_timer_unregister", |cpu, st| {
        if !cpu.in_handler() {
            cpu.without_interrupts(|| unregister(cpu, st, func, freq))
        }
    });
}

fn unregister(cpu: &Cpu, st: &State, func: extern "C" fn(), freq: c_int) {
    {
        let mut timers = st.timers.lock().unwrap_or_else(|p| p.into_inner());
        let Some(at) = timers
            .iter()
            .position(|t| t.func == func as usize && t.freq == freq)
        else {
            tracing::warn!("{}: no timer at {freq} Hz to unregister", st.name);
            return;
        };
        let t = timers.remove(at);
        st.sources.detach(t.source);
        cpu.irq_free(t.vector, t.handler);
    }
}

/// `osenv_timer_spin`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_timer_spin(nanosec: c_long) {
    let until = Instant::now() + Duration::from_nanos(nanosec.max(0) as u64);
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// Runs `f` on the driver's device with interrupts held off (an access may be a message to a
/// vfio-user device model, which a handler's own access must not interleave with), or logs
/// that `call` came from a driver without a device.
fn on_device<R>(call: &str, f: impl FnOnce(&crate::device::Device) -> R) -> Option<R> {
    in_driver(call, |cpu, st| match &st.device {
        Some(d) => Some(cpu.without_interrupts(|| f(d))),
        None => {
            tracing::warn!("{}: {call}, but the driver has no device", st.name);
            None
        }
    })
    .flatten()
}

/// Whether a configuration address is the driver's own function (presented as 00:00.0).
fn own_function(bus: c_char, device: c_char, function: c_char) -> bool {
    bus == 0 && device == 0 && function == 0
}

/// Whether `port` is a dword of configuration space.
fn config_dword(port: c_uint) -> bool {
    port.is_multiple_of(4) && port < 4096
}

/// `osenv_pci_config_read`: see `include/outboard/osenv.h`.
///
/// # Safety
/// `data` is null or points at an `unsigned int` the call may write.
#[no_mangle]
pub unsafe extern "C" fn osenv_pci_config_read(
    bus: c_char,
    device: c_char,
    function: c_char,
    port: c_uint,
    data: *mut c_uint,
) -> c_int {
    if data.is_null() || !config_dword(port) {
        return EINVAL;
    }
    let value = if own_function(bus, device, function) {
        on_device("osenv_pci_config_read", |d| d.config_read(port)).flatten()
    } else if in_driver("osenv_pci_config_read", |_, _| ()).is_some() {
        // No other function is on the driver's bus: reads of an empty slot.
        Some(u32::MAX)
    } else {
        // SAFETY: the caller's contract; checked non-null above.
        unsafe { data.write(u32::MAX) };
        return ENOTIN;
    };
    let (value, rc) = match value {
        Some(v) => (v, 0),
        None => (u32::MAX, EIO),
    };
    // SAFETY: the caller's contract; checked non-null above.
    unsafe { data.write(value) };
    rc
}

/// `osenv_pci_config_write`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_pci_config_write(
    bus: c_char,
    device: c_char,
    function: c_char,
    port: c_uint,
    data: c_uint,
) -> c_int {
    if !config_dword(port) {
        return EINVAL;
    }
    if !own_function(bus, device, function) {
        return EPERM;
    }
    match on_device("osenv_pci_config_write", |d| d.config_write(port, data)) {
        Some(true) => 0,
        Some(false) => EPERM,
        None => EIO,
    }
}

/// `osenv_io_avail`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_io_avail(port: usize, size: usize) -> c_int {
    let (Ok(p), Ok(n)) = (u32::try_from(port), u32::try_from(size)) else {
        return 0;
    };
    on_device("osenv_io_avail", |d| d.io_avail(p, n) as c_int).unwrap_or(0)
}

/// `osenv_io_alloc`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_io_alloc(port: usize, size: usize) -> c_int {
    let (Ok(p), Ok(n)) = (u32::try_from(port), u32::try_from(size)) else {
        return EINVAL;
    };
    match on_device("osenv_io_alloc", |d| d.io_alloc(p, n)) {
        Some(true) => 0,
        Some(false) => EBUSY,
        None => EIO,
    }
}

/// `osenv_io_free`: see `include/outboard/osenv.h`.
#[no_mangle]
pub extern "C" fn osenv_io_free(port: usize, size: usize) {
    let (Ok(p), Ok(n)) = (u32::try_from(port), u32::try_from(size)) else {
        return;
    };
    if on_device("osenv_io_free", |d| d.io_free(p, n)) == Some(false) {
        tracing::warn!("osenv_io_free of ports {port:#x}+{size} the driver did not allocate");
    }
}

macro_rules! port_accessors {
    ($($read:ident $write:ident $r:ident $w:ident $t:ty;)*) => {$(
        /// Reads a port the driver allocated; all ones if it did not or the device failed.
        #[no_mangle]
        pub extern "C" fn $read(port: c_uint) -> $t {
            const N: u32 = std::mem::size_of::<$t>() as u32;
            on_device(stringify!($read), |d| {
                d.port(port, N).and_then(|(r, off)| r.$r(off).ok())
            })
            .flatten()
            .unwrap_or(<$t>::MAX)
        }

        /// Writes a port the driver allocated; dropped (and logged) otherwise.
        #[no_mangle]
        pub extern "C" fn $write(port: c_uint, value: $t) {
            const N: u32 = std::mem::size_of::<$t>() as u32;
            let done = on_device(stringify!($write), |d| {
                d.port(port, N).map(|(r, off)| r.$w(off, value).is_ok())
            })
            .flatten();
            if done != Some(true) {
                tracing::warn!("{}({port:#x}): not an allocated port, or the device failed", stringify!($write));
            }
        }
    )*};
}

port_accessors! {
    osenv_io_read8 osenv_io_write8 read8 write8 u8;
    osenv_io_read16 osenv_io_write16 read16 write16 u16;
    osenv_io_read32 osenv_io_write32 read32 write32 u32;
}

macro_rules! bar_accessors {
    ($($read:ident $write:ident $r:ident $w:ident $t:ty;)*) => {$(
        /// Reads a register of BAR `bar`; all ones if there is no such register or the device
        /// failed.
        #[no_mangle]
        pub extern "C" fn $read(bar: c_uint, offset: usize) -> $t {
            on_device(stringify!($read), |d| {
                d.bar(bar).and_then(|r| r.$r(offset as u64).ok())
            })
            .flatten()
            .unwrap_or(<$t>::MAX)
        }

        /// Writes a register of BAR `bar`; returns 0, or OSENV_EIO if there is no such register
        /// or the device failed.
        #[no_mangle]
        pub extern "C" fn $write(bar: c_uint, offset: usize, value: $t) -> c_int {
            let done = on_device(stringify!($write), |d| {
                d.bar(bar).map(|r| r.$w(offset as u64, value).is_ok())
            })
            .flatten();
            if done == Some(true) { 0 } else { EIO }
        }
    )*};
}

bar_accessors! {
    osenv_bar_read8 osenv_bar_write8 read8 write8 u8;
    osenv_bar_read16 osenv_bar_write16 read16 write16 u16;
    osenv_bar_read32 osenv_bar_write32 read32 write32 u32;
    osenv_bar_read64 osenv_bar_write64 read64 write64 u64;
}
