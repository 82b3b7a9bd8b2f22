//! The `outboard_dev_*` C functions (`include/outboard/native.h`): each turns the driver's
//! handle back into its [`NativeDevice`] and calls it.
//!
//! This module has `unsafe`: it takes the handle and out-pointers from C.

use std::ffi::{c_char, c_int, c_void, CStr};

use super::device::{Answer, NativeDevice, EINVAL};

/// The device behind a handle, or `None` for a null one.
///
/// # Safety
/// `dev` is null or a handle Outboard gave the driver (a `NativeDevice` the bridge keeps
/// alive until the driver's `stop` returns).
unsafe fn device<'a>(dev: *mut c_void) -> Option<&'a NativeDevice> {
    // SAFETY: the caller's contract; only shared references are formed.
    unsafe { dev.cast::<NativeDevice>().as_ref() }
}

/// Stores an answer's value at `out` (when both are there) and returns its code.
///
/// # Safety
/// `out` is null or valid for one write of `T`.
unsafe fn answer<T>(a: Answer<T>, out: *mut T) -> c_int {
    match a {
        Ok(v) if !out.is_null() => {
            // SAFETY: the caller's contract; checked non-null.
            unsafe { out.write_unaligned(v) };
            0
        }
        Ok(_) => EINVAL,
        Err(code) => code,
    }
}

/// `outboard_dev_config_read32`: see `include/outboard/native.h`.
///
/// # Safety
/// `dev` is the driver's handle; `value` is null or a writable `uint32_t`.
#[no_mangle]
pub unsafe extern "C" fn outboard_dev_config_read32(
    dev: *mut c_void,
    offset: u32,
    value: *mut u32,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(d) = (unsafe { device(dev) }) else {
        return EINVAL;
    };
    // SAFETY: the caller's contract.
    unsafe { answer(d.config_read32(offset), value) }
}

/// `outboard_dev_config_write32`: see `include/outboard/native.h`.
///
/// # Safety
/// `dev` is the driver's handle.
#[no_mangle]
pub unsafe extern "C" fn outboard_dev_config_write32(
    dev: *mut c_void,
    offset: u32,
    value: u32,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(d) = (unsafe { device(dev) }) else {
        return EINVAL;
    };
    d.config_write32(offset, value).err().unwrap_or(0)
}

/// The C register accessors of `include/outboard/native.h`: each `outboard_dev_<access>` calls
/// [`NativeDevice`]'s method of that name.
macro_rules! c_accessors {
    ($($t:ty: $read:ident => $read_m:ident, $write:ident => $write_m:ident;)*) => {$(
        #[doc = concat!("`", stringify!($read), "`: see `include/outboard/native.h`.")]
        ///
        /// # Safety
        /// `dev` is the driver's handle; `value` is null or writable.
        #[no_mangle]
        pub unsafe extern "C" fn $read(
            dev: *mut c_void,
            bar: u32,
            offset: u64,
            value: *mut $t,
        ) -> c_int {
            // SAFETY: the caller's contract.
            let Some(d) = (unsafe { device(dev) }) else {
                return EINVAL;
            };
            // SAFETY: the caller's contract.
            unsafe { answer(d.$read_m(bar, offset), value) }
        }

        #[doc = concat!("`", stringify!($write), "`: see `include/outboard/native.h`.")]
        ///
        /// # Safety
        /// `dev` is the driver's handle.
        #[no_mangle]
        pub unsafe extern "C" fn $write(
            dev: *mut c_void,
            bar: u32,
            offset: u64,
            value: $t,
        ) -> c_int {
            // SAFETY: the caller's contract.
            let Some(d) = (unsafe { device(dev) }) else {
                return EINVAL;
            };
            d.$write_m(bar, offset, value).err().unwrap_or(0)
        }
    )*};
}

c_accessors! {
    u8: outboard_dev_read8 => read8, outboard_dev_write8 => write8;
    u16: outboard_dev_read16 => read16, outboard_dev_write16 => write16;
    u32: outboard_dev_read32 => read32, outboard_dev_write32 => write32;
    u64: outboard_dev_read64 => read64, outboard_dev_write64 => write64;
    u8: outboard_dev_io_read8 => io_read8, outboard_dev_io_write8 => io_write8;
    u16: outboard_dev_io_read16 => io_read16, outboard_dev_io_write16 => io_write16;
    u32: outboard_dev_io_read32 => io_read32, outboard_dev_io_write32 => io_write32;
}

/// `outboard_dev_enable_irqs`: see `include/outboard/native.h`.
///
/// # Safety
/// `dev` is the driver's handle; `enabled` is null or a writable `uint32_t`.
#[no_mangle]
pub unsafe extern "C" fn outboard_dev_enable_irqs(
    dev: *mut c_void,
    count: u32,
    enabled: *mut u32,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(d) = (unsafe { device(dev) }) else {
        return EINVAL;
    };
    if enabled.is_null() {
        return EINVAL;
    }
    // SAFETY: the caller's contract.
    unsafe { answer(d.enable_irqs(count), enabled) }
}

/// `outboard_dev_dma_alloc`: see `include/outboard/native.h`.
///
/// # Safety
/// `dev` is the driver's handle; `va` and `iova` are writable (null: `OUTBOARD_EINVAL`).
#[no_mangle]
pub unsafe extern "C" fn outboard_dev_dma_alloc(
    dev: *mut c_void,
    size: u64,
    va: *mut *mut c_void,
    iova: *mut u64,
) -> c_int {
    // SAFETY: the caller's contract.
    let Some(d) = (unsafe { device(dev) }) else {
        return EINVAL;
    };
    if va.is_null() || iova.is_null() {
        return EINVAL;
    }
    match d.dma_alloc(size) {
        Ok((p, at)) => {
            // SAFETY: the caller's contract; both checked non-null.
            unsafe {
                va.write_unaligned(p.cast());
                iova.write_unaligned(at);
            }
            0
        }
        Err(code) => code,
    }
}

/// `outboard_dev_dma_free`: see `include/outboard/native.h`.
///
/// # Safety
/// `dev` is the driver's handle; the driver no longer touches the block at `va`.
#[no_mangle]
pub unsafe extern "C" fn outboard_dev_dma_free(dev: *mut c_void, va: *mut c_void) -> c_int {
    // SAFETY: the caller's contract.
    let Some(d) = (unsafe { device(dev) }) else {
        return EINVAL;
    };
    d.dma_free(va as usize).err().unwrap_or(0)
}

/// `outboard_dev_log`: see `include/outboard/native.h`.
///
/// # Safety
/// `dev` is the driver's handle; `message` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn outboard_dev_log(dev: *mut c_void, level: c_int, message: *const c_char) {
    // SAFETY: the caller's contract.
    let Some(d) = (unsafe { device(dev) }) else {
        return;
    };
    if message.is_null() {
        return;
    }
    // SAFETY: the caller's contract: NUL-terminated.
    let text = unsafe { CStr::from_ptr(message) }.to_string_lossy();
    d.log(level, &text);
}
