//! The twin socket's thread starts with the first in-band mapping, not with the connection: a
//! client that maps all its memory with an fd (every Outboard driver) never has it, so its
//! process has one thread fewer to wake and end when it is killed. Alone in its own test
//! binary, so that no other test's client adds a thread of that name.

mod common;

use std::sync::Arc;

use outboard_shm::SharedMem;
use outboard_vfio_user::wire::dma;

use common::Idle;

/// Threads of this process named as the twin socket's.
fn twin_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim() == "vfio-user-twin")
        })
        .count()
}

#[test]
fn the_twin_thread_starts_with_the_first_in_band_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idle.sock");
    let srv = common::serve(&path, Idle);
    let mut c = common::client_with_twin_socket(&path);
    // Negotiated, used by nothing yet: no thread.
    let mem = Arc::new(SharedMem::create("with-fd", 4096).unwrap());
    c.dma_map(
        0x1000_0000,
        4096,
        dma::FLAG_READ | dma::FLAG_WRITE,
        mem.fd().expect("a memfd"),
        0,
    )
    .unwrap();
    assert_eq!(twin_threads(), 0, "a thread before any in-band mapping");
    let inband = Arc::new(SharedMem::create("in-band", 4096).unwrap());
    c.dma_map_in_band(0x2000_0000, inband, dma::FLAG_READ | dma::FLAG_WRITE)
        .unwrap();
    assert_eq!(twin_threads(), 1, "no thread serves the in-band mapping");
    drop(c);
    assert_eq!(twin_threads(), 0, "the thread outlived its client");
    srv.stop();
}
