//! Helpers shared by the vfio-user tests.

#![allow(dead_code)]

use outboard_vfio_user::wire::region;
use outboard_vfio_user::RegionDesc;

/// A 4 KiB read-write BAR0 reached by trapped accesses, and a 256-byte configuration space:
/// the smallest device a test backend needs.
pub fn bar0_and_config() -> Vec<RegionDesc<'static>> {
    vec![
        RegionDesc {
            index: region::BAR0,
            size: 0x1000,
            flags: region::FLAG_READ | region::FLAG_WRITE,
            mmap: None,
        },
        RegionDesc {
            index: region::CONFIG,
            size: 256,
            flags: region::FLAG_READ,
            mmap: None,
        },
    ]
}
