//! The char dispatcher against a client that breaks the rules, with the C 16550 driver on the
//! pci-serial model behind it: each bad entry gets its own error completion (an unknown
//! operation, an empty transfer, bytes outside the buffer area, an unknown parity code, a rate
//! above the device's, a tag already in flight), and the good ones are served: a write's bytes
//! reach the far end, a read is filled from it, a line request's record comes ahead of its
//! completion.

mod common;

use std::time::{Duration, Instant};

use outboard_char::{
    decode_line, CharError, CharOp, CharRequest, LineSettings, Sqe, CLASS, COMPLETIONS, LINES,
    LINE_SIZE, REQUESTS, RINGS,
};
use outboard_client::{Channel, WaitMode};
use outboard_devices::serial_line::Line;
use outboard_session::Geometry;

#[test]
fn bad_entries_fail_alone_and_good_ones_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let (near, far) = common::socket_pair();
    let served = common::serve_with(
        dir.path(),
        Line::stream(near).unwrap(),
        common::Uart::Legacy,
    );
    let sock = served.sock.clone();

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
    served.stop();
}
