//! A third-party driver hosted unmodified: the block driver of the `virtio-drivers` crate (from
//! crates.io, as published), run in Outboard's environment and served as an ordinary block
//! device. Outboard supplies what the crate asks of a platform: its `Hal` ([`hal`]: DMA memory
//! from the device's DMA space, buffers shared with the device) and its `Transport`
//! ([`transport`]: virtio over PCI through the function's regions); [`blk`] drives the crate's
//! non-blocking requests from the block class's contract.
//!
//! What the crate does not have is supplied around it, never inside it: discard and
//! write-zeroes are written as zeros, and the request data moves through the adapter's own DMA
//! pool (one copy to or from the session's buffer area; the native driver moves none).

pub mod blk;
pub mod hal;
pub mod transport;
