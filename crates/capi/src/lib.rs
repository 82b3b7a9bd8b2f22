//! The C interface to Outboard's class devices: `include/outboard/block.h`.
//!
//! Thin wrappers over [`outboard_block::BlockDevice`]. Every pointer from C is checked for
//! null; lengths are taken as given (C's contract) and turned into slices only inside an
//! `unsafe` block that says why that is sound. Errors are the block class's wire codes.
//! A panic cannot unwind into C: `extern "C"` functions abort on panic.
#![deny(missing_docs)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use outboard_block::{BlockDevice, BlockError, BlockOp, BlockRequest};
use outboard_block_client::{BlockClient, SessionOptions};

/// An open block device (opaque to C).
pub struct ObBlock {
    dev: Box<dyn BlockDevice>,
    /// Completions reaped but not yet handed to C (more than its `max`).
    pending: std::collections::VecDeque<outboard_block::BlockCompletion>,
}

/// `ob_block_info`.
#[repr(C)]
pub struct ObBlockInfo {
    /// Capacity in blocks.
    pub capacity: u64,
    /// Block size.
    pub block_size: u32,
    /// 1 if read-only.
    pub read_only: u32,
    /// Queue depth.
    pub queue_depth: u32,
    /// Largest transfer of one request (bytes; 0: no limit). It fills what was padding, so the
    /// struct keeps its size.
    pub max_transfer: u32,
}

// The header's `ob_block_info` is 24 bytes (the C test checks its side).
const _: () = assert!(std::mem::size_of::<ObBlockInfo>() == 24);

/// `ob_block_request`.
#[repr(C)]
pub struct ObBlockRequest {
    /// `OB_OP_*`.
    pub op: u32,
    /// Blocks.
    pub blocks: u32,
    /// First block.
    pub lba: u64,
    /// Offset in the buffer area.
    pub buf_offset: u64,
    /// Tag.
    pub tag: u64,
}

/// `ob_block_completion`.
#[repr(C)]
pub struct ObBlockCompletion {
    /// Tag.
    pub tag: u64,
    /// Status.
    pub status: i32,
    /// Bytes.
    pub bytes: u32,
}

fn code(r: Result<(), BlockError>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => e.code(),
    }
}

/// Reads a C string argument.
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string valid for the call.
unsafe fn text<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

/// # Safety
/// `out` must be a valid pointer to write an `ob_block *` to.
unsafe fn give(out: *mut *mut ObBlock, r: Result<Box<dyn BlockDevice>, BlockError>) -> c_int {
    if out.is_null() {
        return BlockError::Invalid(String::new()).code();
    }
    match r {
        Ok(dev) => {
            // SAFETY: `out` is non-null and valid for writes per the contract.
            unsafe {
                *out = Box::into_raw(Box::new(ObBlock {
                    dev,
                    pending: Default::default(),
                }))
            };
            0
        }
        Err(e) => e.code(),
    }
}

/// `ob_block_open`.
///
/// # Safety
/// `control` null or a C string; `name` a C string; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ob_block_open(
    control: *const c_char,
    name: *const c_char,
    out: *mut *mut ObBlock,
) -> c_int {
    // SAFETY: the caller passes C strings or null (the header's contract).
    let (control, name) = unsafe { (text(control), text(name)) };
    let Some(name) = name else { return -1 };
    let control = control
        .map(PathBuf::from)
        .unwrap_or_else(outboard_client::manager::default_control);
    // SAFETY: `out` is writable per the contract.
    unsafe { give(out, outboard_block_client::open_block(&control, name)) }
}

/// `ob_block_open_server`.
///
/// # Safety
/// `server` and `name` C strings; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ob_block_open_server(
    server: *const c_char,
    name: *const c_char,
    out: *mut *mut ObBlock,
) -> c_int {
    // SAFETY: the caller passes C strings (the header's contract).
    let (Some(server), Some(name)) = (unsafe { text(server) }, unsafe { text(name) }) else {
        return -1;
    };
    let r = BlockClient::open(Path::new(server), name, SessionOptions::default())
        .map(|c| Box::new(c) as Box<dyn BlockDevice>);
    // SAFETY: `out` is writable per the contract.
    unsafe { give(out, r) }
}

/// `ob_block_close`.
///
/// # Safety
/// `b` null or a handle from `ob_block_open*`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn ob_block_close(b: *mut ObBlock) {
    if !b.is_null() {
        // SAFETY: created by Box::into_raw in `give`, and the caller gives it up.
        drop(unsafe { Box::from_raw(b) });
    }
}

/// Borrows the handle.
///
/// # Safety
/// `b` null or a live handle used by one thread at a time.
unsafe fn dev<'a>(b: *mut ObBlock) -> Option<&'a mut ObBlock> {
    // SAFETY: per the contract, a non-null `b` is a live, exclusively used handle.
    unsafe { b.as_mut() }
}

/// `ob_block_get_info`.
///
/// # Safety
/// `b` a live handle; `info` writable.
#[no_mangle]
pub unsafe extern "C" fn ob_block_get_info(b: *const ObBlock, info: *mut ObBlockInfo) -> c_int {
    // SAFETY: a live handle per the contract; only read here.
    let (Some(b), false) = (unsafe { b.as_ref() }, info.is_null()) else {
        return -1;
    };
    let i = b.dev.info();
    let v = ObBlockInfo {
        capacity: i.capacity,
        block_size: i.block_size,
        read_only: i.read_only as u32,
        queue_depth: i.queue_depth,
        max_transfer: i.max_transfer,
    };
    // SAFETY: non-null and writable per the contract.
    unsafe { info.write(v) };
    0
}

/// `ob_block_read`.
///
/// # Safety
/// `b` a live handle; `buf` valid for `len` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn ob_block_read(
    b: *mut ObBlock,
    lba: u64,
    buf: *mut c_void,
    len: usize,
) -> c_int {
    // SAFETY: per the contract.
    let (Some(b), false) = (unsafe { dev(b) }, buf.is_null()) else {
        return -1;
    };
    // SAFETY: `buf` is valid for `len` bytes of writes and not aliased during the call.
    let data = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) };
    code(b.dev.read_blocks(lba, data))
}

/// `ob_block_write`.
///
/// # Safety
/// `b` a live handle; `buf` valid for `len` bytes of reads.
#[no_mangle]
pub unsafe extern "C" fn ob_block_write(
    b: *mut ObBlock,
    lba: u64,
    buf: *const c_void,
    len: usize,
) -> c_int {
    // SAFETY: per the contract.
    let (Some(b), false) = (unsafe { dev(b) }, buf.is_null()) else {
        return -1;
    };
    // SAFETY: `buf` is valid for `len` bytes of reads during the call.
    let data = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) };
    code(b.dev.write_blocks(lba, data))
}

/// `ob_block_flush`.
///
/// # Safety
/// `b` a live handle.
#[no_mangle]
pub unsafe extern "C" fn ob_block_flush(b: *mut ObBlock) -> c_int {
    // SAFETY: per the contract.
    let Some(b) = (unsafe { dev(b) }) else {
        return -1;
    };
    code(b.dev.flush())
}

/// `ob_block_discard`.
///
/// # Safety
/// `b` a live handle.
#[no_mangle]
pub unsafe extern "C" fn ob_block_discard(b: *mut ObBlock, lba: u64, blocks: u32) -> c_int {
    // SAFETY: per the contract.
    let Some(b) = (unsafe { dev(b) }) else {
        return -1;
    };
    let r = BlockRequest {
        op: BlockOp::Discard,
        lba,
        blocks,
        buf_offset: 0,
        tag: 0,
    };
    code(b.dev.execute(&r).map(|_| ()))
}

/// `ob_block_buffer`: the buffer area, shared with the device (zero copy).
///
/// # Safety
/// `b` a live handle; `size` null or writable. The pointer is valid until `ob_block_close`.
#[no_mangle]
pub unsafe extern "C" fn ob_block_buffer(b: *mut ObBlock, size: *mut usize) -> *mut c_void {
    // SAFETY: per the contract.
    let Some(b) = (unsafe { dev(b) }) else {
        return std::ptr::null_mut();
    };
    if !size.is_null() {
        // SAFETY: non-null and writable per the contract.
        unsafe { size.write(b.dev.buffers().len()) };
    }
    b.dev.buffers().as_ptr().cast()
}

/// `ob_block_submit`.
///
/// # Safety
/// `b` a live handle; `req` readable.
#[no_mangle]
pub unsafe extern "C" fn ob_block_submit(b: *mut ObBlock, req: *const ObBlockRequest) -> c_int {
    // SAFETY: per the contract.
    let (Some(b), Some(r)) = (unsafe { dev(b) }, unsafe { req.as_ref() }) else {
        return -1;
    };
    let Some(op) = u8::try_from(r.op).ok().and_then(BlockOp::from_code) else {
        return -1;
    };
    let req = BlockRequest {
        op,
        lba: r.lba,
        blocks: r.blocks,
        buf_offset: r.buf_offset,
        tag: r.tag,
    };
    code(b.dev.submit(&req))
}

/// `ob_block_kick`.
///
/// # Safety
/// `b` a live handle.
#[no_mangle]
pub unsafe extern "C" fn ob_block_kick(b: *mut ObBlock) -> c_int {
    // SAFETY: per the contract.
    let Some(b) = (unsafe { dev(b) }) else {
        return -1;
    };
    code(b.dev.kick())
}

/// `ob_block_wait`.
///
/// # Safety
/// `b` a live handle; `out` writable for `max` completions.
#[no_mangle]
pub unsafe extern "C" fn ob_block_wait(
    b: *mut ObBlock,
    out: *mut ObBlockCompletion,
    max: usize,
    timeout_ms: c_int,
) -> c_int {
    // SAFETY: per the contract.
    let (Some(b), false) = (unsafe { dev(b) }, out.is_null() || max == 0) else {
        return -1;
    };
    if b.pending.is_empty() {
        let mut got = Vec::new();
        if let Err(e) = b
            .dev
            .wait(&mut got, Duration::from_millis(timeout_ms.max(0) as u64))
        {
            return e.code();
        }
        b.pending.extend(got);
    }
    let n = b.pending.len().min(max);
    for (i, c) in b.pending.drain(..n).enumerate() {
        let (status, bytes) = match c.result {
            Ok(n) => (0, n),
            Err(e) => (e.code(), 0),
        };
        // SAFETY: `i < n <= max` and `out` is writable for `max` entries.
        unsafe {
            out.add(i).write(ObBlockCompletion {
                tag: c.tag,
                status,
                bytes,
            })
        };
    }
    n as c_int
}

/// `ob_strerror`.
#[no_mangle]
pub extern "C" fn ob_strerror(code: c_int) -> *const c_char {
    let s: &'static CStr = match code {
        0 => c"success",
        -1 => c"invalid request",
        -2 => c"blocks beyond the end of the disk",
        -3 => c"the disk is read-only",
        -4 => c"the device reported an I/O error",
        -5 => c"the device does not support this operation",
        -6 => c"the device is gone",
        -7 => c"the driver is restarting",
        -8 => c"a request with this tag is already in flight",
        -9 => c"the buffer lies outside the buffer area",
        -10 => c"the submission ring is full",
        -11 => c"timed out",
        -12 => c"protocol error",
        -13 => c"no such device",
        -14 => c"the device or its driver failed and was given up",
        -15 => c"the device is in use by another client",
        -16 => c"the manager or server is not running",
        -17 => c"this request crashed the driver repeatedly: it is not sent again",
        -18 => c"refused (a device of another class, or not allowed)",
        _ => c"unknown error",
    };
    s.as_ptr()
}
