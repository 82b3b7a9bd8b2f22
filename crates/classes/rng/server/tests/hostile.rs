//! The entropy dispatcher against a client that breaks the rules: each bad entry gets its own
//! error completion (a length of 0 or past what the device gives, a buffer outside the
//! session's area, a tag already in flight), and the server goes on serving the good ones —
//! whose bytes are the seeded model's stream, DMAed by the unchanged driver into the buffers.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_client::{Channel, WaitMode};
use outboard_devices::virtio_pci::VirtioPci;
use outboard_devices::virtio_rng::{Entropy, Seeded, VirtioRng};
use outboard_drivers::virtio_rng::VirtioRng as RngDriver;
use outboard_hw::backend::in_process::InProcess;
use outboard_hw::PciFunction;
use outboard_rng::{EntropyError, EntropyRequest, Sqe, CLASS, RINGS};
use outboard_rng_server::EntropyDispatcher;
use outboard_server::DriverHost;
use outboard_session::Geometry;

const BUFFER: u64 = 64 << 10;

#[test]
fn bad_entries_fail_alone_and_good_ones_get_the_devices_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let model = VirtioPci::new(VirtioRng::new(Entropy::Seeded(Seeded::new(9)))).unwrap();
    let backend = Arc::new(InProcess::new(Box::new(model)));
    let f = PciFunction::with_backend("in-process".into(), backend).unwrap();
    let driver = RngDriver::new("rng0", f).unwrap();
    let env = outboard_env::DeviceEnv::for_function(driver.function());
    let sock = dir.path().join("rng.sock");
    let (stop, thread) = DriverHost::bind(&sock, vec![EntropyDispatcher::served(driver, env)])
        .unwrap()
        .spawn();

    let geometry = Geometry::of_class(&RINGS, 16, BUFFER);
    let (mut ch, _) = Channel::open(
        &sock,
        "rng0",
        CLASS,
        geometry,
        WaitMode::Blocking,
        Duration::from_secs(5),
    )
    .unwrap();
    let send = |ch: &mut Channel, tag: u64, buf_offset: u32, length: u32| {
        let r = EntropyRequest {
            tag,
            buf_offset,
            length,
        };
        assert!(ch.stage(0, &Sqe::encode(&r).0).unwrap());
    };
    send(&mut ch, 1, 0, 0); // nothing asked for
    send(&mut ch, 2, 0, 1 << 20); // more than the device gives at once
    send(&mut ch, 3, (BUFFER - 8) as u32, 16); // past the buffer area
    send(&mut ch, 4, 0, 32); // good
    send(&mut ch, 4, 64, 32); // the same tag again while 4 may be in flight
    send(&mut ch, 5, 128, 32); // good
    ch.kick();
    let mut answers = std::collections::HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while answers.len() < 5 && Instant::now() < deadline {
        while let Some((tag, result)) = ch.completion::<EntropyError>(0).unwrap() {
            answers.entry(tag).or_insert_with(Vec::new).push(result);
        }
        let _ = ch.wait(Instant::now() + Duration::from_millis(100));
    }
    // The server's words came with the code, on the reasons ring.
    assert_eq!(
        answers[&1],
        vec![Err(EntropyError::Invalid("a request for 0 bytes".into()))]
    );
    assert!(
        matches!(answers[&2][..], [Err(EntropyError::Invalid(_))]),
        "{answers:?}"
    );
    assert_eq!(answers[&3], vec![Err(EntropyError::BadBuffer)]);
    // Tag 4: one answer is the bytes, and the duplicate (if the first was still in flight)
    // is refused under the tag it gave.
    assert!(answers[&4].contains(&Ok(32)), "{answers:?}");
    assert!(
        answers[&4]
            .iter()
            .all(|r| matches!(r, Ok(32) | Err(EntropyError::DuplicateTag))),
        "{answers:?}"
    );
    assert_eq!(answers[&5], vec![Ok(32)]);
    // The seeded stream, in the order the device served the good requests: its first 32
    // bytes at offset 0 (tag 4), the next 32 at offset 128 (tag 5).
    let mut expected = [0u8; 96];
    Seeded::new(9).fill(&mut expected);
    let mut at0 = [0u8; 32];
    ch.buffers().read(0, &mut at0).unwrap();
    assert_eq!(at0, expected[..32]);
    let mut at128 = [0u8; 32];
    ch.buffers().read(128, &mut at128).unwrap();
    assert_eq!(at128, expected[32..64]);
    drop(ch);
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap().unwrap();
}
