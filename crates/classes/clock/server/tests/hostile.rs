//! The clock dispatcher against a client that breaks the rules, with the C timer driver on the
//! timer model behind it: each bad entry gets its own error completion (an unknown operation, a
//! time request with an argument, a wait for 0 ticks or for longer than the device takes, a tag
//! already waiting), and the good ones are served: a wait comes back after its ticks, a time
//! request's record comes ahead of its completion.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_client::{Channel, WaitMode};
use outboard_clock::{
    decode_time, ClockError, ClockOp, ClockRequest, Sqe, CLASS, COMPLETIONS, REQUESTS, RINGS,
    TIMES, TIME_SIZE,
};
use outboard_clock_server::ClockDispatcher;
use outboard_drivers::legacy::clock::LegacyClock;
use outboard_drivers::legacy::descriptor::builtin_timer;
use outboard_hw::PciFunction;
use outboard_server::DriverHost;
use outboard_session::Geometry;

#[test]
fn bad_entries_fail_alone_and_good_ones_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let model_sock = dir.path().join("timer.sock");
    let model = outboard_devices::timer::Timer::new(1_000_000).unwrap(); // 1 kHz
    let mut server = outboard_vfio_user::Server::bind(
        &model_sock,
        model,
        outboard_vfio_user::ServerOptions::default(),
    )
    .unwrap();
    let model_stop = Arc::new(AtomicBool::new(false));
    let s = model_stop.clone();
    let model_thread = std::thread::spawn(move || server.run(&s));

    let spec = format!("vfio-user:{}", model_sock.display())
        .parse()
        .unwrap();
    let f = PciFunction::open(&spec).unwrap();
    let env = outboard_env::DeviceEnv::for_function(&f);
    let c = builtin_timer().unwrap();
    let opts = outboard_drivers::StartOptions {
        name: "clock0".into(),
        ..Default::default()
    };
    let driver = LegacyClock::start("legacy-timer", &c, &opts, f).unwrap();
    let sock = dir.path().join("clock.sock");
    let (stop, thread) = DriverHost::bind(&sock, vec![ClockDispatcher::served(driver, env)])
        .unwrap()
        .spawn();

    let geometry = Geometry::of_class(&RINGS, 16, 4096);
    let (mut ch, _) = Channel::open(
        &sock,
        "clock0",
        CLASS,
        geometry,
        WaitMode::Blocking,
        Duration::from_secs(5),
    )
    .unwrap();
    let send = |ch: &mut Channel, tag: u64, op: ClockOp| {
        let e = Sqe::encode(&ClockRequest { tag, op });
        assert!(ch.stage(REQUESTS, &e.0).unwrap());
    };
    let mut raw = Sqe::encode(&ClockRequest {
        tag: 1,
        op: ClockOp::Now,
    });
    raw.0[8] = 7; // operation 7
    assert!(ch.stage(REQUESTS, &raw.0).unwrap());
    raw.0[8] = 2;
    raw.0[12] = 1; // NOW with an argument
    raw.0[0] = 2;
    assert!(ch.stage(REQUESTS, &raw.0).unwrap());
    send(&mut ch, 3, ClockOp::Wait(0));
    send(&mut ch, 4, ClockOp::Wait(u32::MAX));
    send(&mut ch, 5, ClockOp::Wait(20)); // good: 20 ms
    send(&mut ch, 5, ClockOp::Wait(1)); // tag 5 is waiting
    send(&mut ch, 6, ClockOp::Now); // good
    let sent = Instant::now();
    ch.kick();
    let mut answers = std::collections::HashMap::new();
    let mut wait_done = None;
    let mut record = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while answers.values().map(Vec::len).sum::<usize>() < 7 && Instant::now() < deadline {
        while let Some((tag, result)) = ch.completion::<ClockError>(COMPLETIONS).unwrap() {
            if tag == 5 && result.is_ok() {
                wait_done = Some(sent.elapsed());
            }
            // The time record is there when its completion is.
            if tag == 6 {
                let mut e = [0u8; TIME_SIZE as usize];
                assert!(
                    ch.pop(TIMES, &mut e).unwrap(),
                    "a completion before its record"
                );
                record = Some(decode_time(&e));
            }
            answers.entry(tag).or_insert_with(Vec::new).push(result);
        }
        let _ = ch.wait(Instant::now() + Duration::from_millis(50));
    }
    let invalid = |t: u64, words: &str| {
        assert!(
            matches!(&answers[&t][..], [Err(ClockError::Invalid(w))] if w.contains(words)),
            "{t}: {answers:?}"
        );
    };
    invalid(1, "unknown operation 7");
    invalid(2, "argument");
    invalid(3, "0 ticks");
    invalid(4, "longer than the device takes");
    assert!(
        answers[&5].contains(&Err(ClockError::DuplicateTag)),
        "{answers:?}"
    );
    let waited = answers[&5].iter().find_map(|r| r.clone().ok());
    assert!(waited >= Some(20), "{answers:?}");
    // 20 ticks at 1 kHz: not before 20 ms of the device's time.
    assert!(
        wait_done >= Some(Duration::from_millis(19)),
        "{wait_done:?}"
    );
    assert_eq!(answers[&6], vec![Ok(0)]);
    let (tag, t) = record.expect("no time record");
    assert_eq!((tag, t.hz), (6, 1000));
    let mut e = [0u8; TIME_SIZE as usize];
    assert!(t.device_ns > 0);
    assert!(!ch.pop(TIMES, &mut e).unwrap(), "a second time record");

    drop(ch);
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap().unwrap();
    model_stop.store(true, Ordering::Relaxed);
    model_thread.join().unwrap().unwrap();
}
