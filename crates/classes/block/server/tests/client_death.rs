//! A client that vanishes with requests in flight leaves nothing behind. Its own test binary:
//! the fd and memory-map counts of `/proc/self` are process-wide, so no other test may run
//! beside it.

mod common;

use std::time::Duration;

use common::{entry, good_client_works, maps, open_fds, Raw};

const SIZE: &str = "1M";

#[test]
fn a_client_killed_with_requests_in_flight_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let srv = common::Served::start(dir.path(), SIZE);
    let (sock, backend) = (srv.sock.clone(), srv.backend.clone());
    let dma_before = backend.with_device(|_, ctx| ctx.dma.len());
    good_client_works(&sock); // warm up: the first session's one-time allocations
                              // Its session is released once its buffers are unmapped from the device.
    assert!(common::eventually(Duration::from_secs(10), || {
        backend.with_device(|_, ctx| ctx.dma.len()) == dma_before
    }));
    let (fds, mapped, dma) = (
        open_fds(),
        maps(),
        backend.with_device(|_, ctx| ctx.dma.len()),
    );
    for round in 0..5 {
        let mut raw = Raw::open(&sock);
        let reads: Vec<[u8; 32]> = (0..16)
            .map(|i| entry(1, i, i * 8, 8, (i as u32) * 4096))
            .collect();
        raw.send(&reads);
        drop(raw); // gone, with up to 16 requests in the device
        std::thread::sleep(Duration::from_millis(50 + round * 10));
    }
    let released = || {
        backend.with_device(|_, ctx| ctx.dma.len()) == dma && open_fds() <= fds && maps() <= mapped
    };
    assert!(
        common::eventually(Duration::from_secs(10), released),
        "left behind: DMA mappings {} (was {dma}), fds {} (was {fds}), maps {} (was {mapped})",
        backend.with_device(|_, ctx| ctx.dma.len()),
        open_fds(),
        maps()
    );
    good_client_works(&sock);
    let stats = srv.stop();
    assert_eq!(stats.sessions_opened, stats.sessions_released);
}
