//! Atomics, swapped for loom's under `--cfg loom` so the ring protocol can be model-checked.

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU32, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicU32, Ordering};
