//! The char dispatcher against a client that breaks the rules, with the C 16550 driver on the
//! pci-serial model behind it: each bad entry gets its own error completion (an unknown
//! operation, an empty transfer, bytes outside the buffer area, an unknown parity code, a rate
//! above the device's, a tag already in flight), and the good ones are served: a write's bytes
//! reach the far end, a read is filled from it, a line request's record comes ahead of its
//! completion.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_char::{
    decode_line, CharError, CharOp, CharRequest, LineSettings, Sqe, CLASS, COMPLETIONS, LINES,
    LINE_SIZE, REQUESTS, RINGS,
};
use outboard_char_server::CharDispatcher;
use outboard_client::{Channel, WaitMode};
use outboard_devices::serial::Serial;
use outboard_devices::serial_line::Line;
use outboard_drivers::legacy::descriptor::builtin_uart16550;
use outboard_drivers::legacy::serial::LegacyChar;
use outboard_hw::PciFunction;
use outboard_server::DriverHost;
use outboard_session::Geometry;

#[test]
fn bad_entries_fail_alone_and_good_ones_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let (near, far) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let model_sock = dir.path().join("uart.sock");
    let model = Serial::new(Line::stream(near).unwrap()).unwrap();
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
    let c = builtin_uart16550().unwrap();
    let driver = LegacyChar::start("uart16550", &c, "tty0", f).unwrap();
    let sock = dir.path().join("char.sock");
    let (stop, thread) = DriverHost::bind(&sock, vec![CharDispatcher::served(driver, env)])
        .unwrap()
        .spawn();

    let geometry = Geometry::of_class(&RINGS, 16, 4096);
    let (mut ch, _) = Channel::open(
        &sock,
        "tty0",
        CLASS,
        geometry,
        WaitMode::Blocking,
        Duration::from_secs(5),
    )
    .unwrap();
    let send = |ch: &mut Channel, tag: u64, op: CharOp| {
        let e = Sqe::encode(&CharRequest { tag, op });
        assert!(ch.stage(REQUESTS, &e.0).unwrap());
    };
    let mut raw = Sqe::encode(&CharRequest {
        tag: 1,
        op: CharOp::Line,
    });
    raw.0[8] = 9; // operation 9
    assert!(ch.stage(REQUESTS, &raw.0).unwrap());
    send(&mut ch, 2, CharOp::Read { offset: 0, len: 0 });
    send(
        &mut ch,
        3,
        CharOp::Write {
            offset: 4000,
            len: 200,
        },
    );
    let mut raw = Sqe::encode(&CharRequest {
        tag: 4,
        op: CharOp::SetLine(LineSettings::default()),
    });
    raw.0[29] = 7; // parity code 7
    assert!(ch.stage(REQUESTS, &raw.0).unwrap());
    send(
        &mut ch,
        5,
        CharOp::SetLine(LineSettings {
            baud: 1_000_000,
            ..LineSettings::default()
        }),
    );
    ch.buffers().write(2048, b"out").unwrap();
    send(
        &mut ch,
        6,
        CharOp::Write {
            offset: 2048,
            len: 3,
        },
    );
    send(&mut ch, 7, CharOp::Read { offset: 0, len: 64 });
    send(&mut ch, 7, CharOp::Line); // tag 7 is waiting
    send(&mut ch, 8, CharOp::Line);
    ch.kick();

    // The far end sees the good write, and answers it.
    let mut got = [0u8; 3];
    let mut n = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while n < 3 && Instant::now() < deadline {
        n += rustix::io::read(&far, &mut got[n..]).unwrap();
    }
    assert_eq!(&got, b"out");
    rustix::io::write(&far, b"in!").unwrap();

    let mut answers = std::collections::HashMap::new();
    let mut record = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while answers.values().map(Vec::len).sum::<usize>() < 9 && Instant::now() < deadline {
        while let Some((tag, result)) = ch.completion::<CharError>(COMPLETIONS).unwrap() {
            if tag == 8 {
                let mut e = [0u8; LINE_SIZE as usize];
                assert!(
                    ch.pop(LINES, &mut e).unwrap(),
                    "a completion before its record"
                );
                record = Some(decode_line(&e));
            }
            answers.entry(tag).or_insert_with(Vec::new).push(result);
        }
        let _ = ch.wait(Instant::now() + Duration::from_millis(50));
    }
    let invalid = |t: u64, words: &str| {
        assert!(
            matches!(&answers[&t][..], [Err(CharError::Invalid(w))] if w.contains(words)),
            "{t}: {answers:?}"
        );
    };
    invalid(1, "unknown operation 9");
    invalid(2, "0 bytes");
    invalid(3, "outside");
    invalid(4, "parity");
    invalid(5, "1 to 115200");
    assert_eq!(answers[&6], vec![Ok(3)]);
    assert!(
        answers[&7].contains(&Err(CharError::DuplicateTag)),
        "{answers:?}"
    );
    let read = answers[&7].iter().find_map(|r| r.clone().ok());
    assert!(read.is_some_and(|n| (1..=3).contains(&n)), "{answers:?}");
    let mut inb = [0u8; 3];
    ch.buffers().read(0, &mut inb).unwrap();
    assert_eq!(
        &inb[..read.unwrap() as usize],
        &b"in!"[..read.unwrap() as usize]
    );
    assert_eq!(answers[&8], vec![Ok(0)]);
    let (tag, status) = record.expect("no line record");
    assert_eq!(tag, 8);
    assert_eq!(status.unwrap().line, LineSettings::default());

    drop(ch);
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap().unwrap();
    model_stop.store(true, Ordering::Relaxed);
    model_thread.join().unwrap().unwrap();
}
