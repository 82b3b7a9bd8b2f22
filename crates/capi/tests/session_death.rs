//! Reliability defect 9: after the session died, the C API answered `OB_EINVAL` ("handle
//! busy") instead of repeating why it failed.

use std::ffi::CString;
use std::sync::atomic::Ordering;

use outboard_capi::{ob_block_close, ob_block_open_server, ob_block_read, ObBlock};
use outboard_drivers::null_blk::NullBlock;
use outboard_server::DriverHost;

const OB_EGONE: i32 = -6;

#[test]
fn every_call_after_the_server_died_says_the_device_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("host.sock");
    let (stop, t) = DriverHost::bind(
        &sock,
        vec![outboard_block_server::BlockDispatcher::served(
            NullBlock::new("null0", 1 << 20),
            outboard_env::DeviceEnv::virtual_device(),
        )],
    )
    .unwrap()
    .spawn();
    let server = CString::new(sock.to_str().unwrap()).unwrap();
    let name = CString::new("null0").unwrap();
    let mut b: *mut ObBlock = std::ptr::null_mut();
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid C strings, a writable handle slot, a buffer of the length given.
    unsafe {
        assert_eq!(
            ob_block_open_server(server.as_ptr(), name.as_ptr(), &mut b),
            0
        );
        assert_eq!(ob_block_read(b, 0, buf.as_mut_ptr().cast(), buf.len()), 0);
    }
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap().unwrap();
    for attempt in 0..3 {
        // SAFETY: as above; the handle is still open.
        let r = unsafe { ob_block_read(b, 0, buf.as_mut_ptr().cast(), buf.len()) };
        assert_eq!(r, OB_EGONE, "attempt {attempt}");
    }
    // SAFETY: the handle from ob_block_open_server, closed once.
    unsafe { ob_block_close(b) };
}
