//! The char class's conformance suite: what every serial line must do for its clients,
//! whichever driver serves it and whatever the device is. The workspace's tests run it on the
//! C 16550 driver over Outboard's 16550 model (its far end a socket and a pseudo-terminal), and
//! `outboard char selftest` runs it on any line, QEMU's `pci-serial` through VFIO among them.
//!
//! The suite needs the line **looped back**: whatever the device sends comes back to its
//! receiver (an echo at the far end, or a plug joining TX to RX). It does not need the modem
//! lines looped: it expects CTS on while the far end keeps up. It changes the line's settings
//! and puts 115,200 baud 8N1 (or the fastest rate below it) back at the end of each check.
//!
//! A check compares bytes under the frame's data bits (`byte & mask`): a device that sends
//! 5 to 7 data bits may or may not hand the upper bits back, and either is right.
//!
//! What a looped line cannot tell: both ends are the same UART, so a rate or frame the device
//! did not really take still carries bytes. "Read back" is the settings the driver reports
//! after taking them; the 16550 driver reads its divisor latch and line control register back
//! and fails the call if the device kept others.

use std::time::{Duration, Instant};

use crate::{CharDevice, CharError, Flow, LineCounters, LineSettings, Parity};

/// One check: its name, and the check itself (what it saw, or what went wrong).
pub struct Check {
    /// What it checks, in a few words.
    pub name: &'static str,
    /// Runs it; the detail on success, the failure otherwise.
    pub run: fn(&mut dyn CharDevice) -> Result<String, String>,
}

/// Every check, in the order they run (the first says whether the rest can).
pub const CHECKS: &[Check] = &[
    Check {
        name: "class status and the base line",
        run: status,
    },
    Check {
        name: "every byte value loops back, counted",
        run: every_byte,
    },
    Check {
        name: "every frame is set, read back, carries data",
        run: every_frame,
    },
    Check {
        name: "standard rates",
        run: rates,
    },
    Check {
        name: "settings refused, the line unchanged",
        run: refusals,
    },
    Check {
        name: "8 KiB in 1 KiB bursts both ways at once",
        run: burst,
    },
    Check {
        name: "RTS/CTS: a flood nobody reads, all kept",
        run: flood_with_flow_control,
    },
    Check {
        name: "no flow control: kept in order or counted",
        run: flood_without_flow_control,
    },
];

/// Bytes the floods send: far more than a UART's FIFO, and more than a driver buffers (the C
/// 16550 driver's ring and its server's queue hold 4 KiB each).
pub const FLOOD: usize = 12 << 10;

/// Bytes the burst check sends in all, 1 KiB at a time.
pub const BURST: usize = 8 << 10;

/// How long a line may stay silent before the suite takes it that nothing more comes.
const IDLE: Duration = Duration::from_secs(2);

/// Runs every check; the first failure, named.
pub fn run(d: &mut dyn CharDevice) -> Result<(), String> {
    for c in CHECKS {
        (c.run)(d).map_err(|e| format!("{}: {e}", c.name))?;
    }
    Ok(())
}

/// `len` bytes numbered from `seed`, each one off from the last by a step prime to 256, so that
/// a byte lost, doubled or moved shows.
pub fn numbered(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i as u8).wrapping_mul(37)))
        .collect()
}

/// `len` pseudo-random bytes (xorshift) for `seed`: no run of 8 of them recurs in a flood, so
/// a byte lost, changed or moved shows wherever it falls.
pub fn scrambled(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Checks that `got` is `sent` with bytes left out only: runs of it in order, each byte once,
/// each run found where its first 8 bytes (or all, if fewer) are in `sent`.
fn in_order_with_gaps(sent: &[u8], got: &[u8]) -> Result<(), String> {
    let mut at = 0;
    let mut i = 0;
    while i < got.len() {
        if sent.get(at) == Some(&got[i]) {
            at += 1;
            i += 1;
            continue;
        }
        // A gap: the next run starts where its first bytes are, further on.
        let probe = &got[i..(i + 8).min(got.len())];
        match sent[at..].windows(probe.len()).position(|w| w == probe) {
            Some(k) => at += k,
            None => {
                return Err(format!(
                    "byte {i} that came ({:#04x}) starts no run of those sent after byte {at}: \
                     changed, doubled or out of order",
                    got[i]
                ))
            }
        }
    }
    Ok(())
}

/// The line the suite starts from and puts back: 115,200 baud (or the device's fastest rate
/// below it) 8N1, no flow control.
pub fn base_line(d: &dyn CharDevice) -> LineSettings {
    LineSettings {
        baud: 115_200.min(d.info().max_baud),
        ..LineSettings::default()
    }
}

fn err(e: CharError) -> String {
    e.to_string()
}

/// Sets `line` and checks that the line's status says it.
fn set(d: &mut dyn CharDevice, line: &LineSettings) -> Result<(), String> {
    d.set_line(line)
        .map_err(|e| format!("setting {line}: {e}"))?;
    let now = d.line().map_err(err)?.line;
    if now != *line {
        return Err(format!("set {line}, the line says {now}"));
    }
    Ok(())
}

/// Puts the base line back.
fn restore(d: &mut dyn CharDevice) -> Result<(), String> {
    let base = base_line(d);
    set(d, &base)
}

fn counters(d: &mut dyn CharDevice) -> Result<LineCounters, String> {
    Ok(d.line().map_err(err)?.counters)
}

/// How far a counter moved (the wire carries byte counts modulo 2^32).
fn moved(before: u64, after: u64) -> u64 {
    u64::from((after as u32).wrapping_sub(before as u32))
}

/// Reads until `n` bytes came or nothing came for `idle`.
fn receive(d: &mut dyn CharDevice, n: usize, idle: Duration) -> Result<Vec<u8>, String> {
    let mut got = Vec::with_capacity(n);
    let mut buf = vec![0u8; 4096];
    while got.len() < n {
        let want = (n - got.len()).min(buf.len());
        match d.read(&mut buf[..want], Some(idle)).map_err(err)? {
            0 => break,
            k => got.extend_from_slice(&buf[..k]),
        }
    }
    Ok(got)
}

/// Takes whatever the line still holds (left from an earlier check), up to 1 MiB.
fn drain(d: &mut dyn CharDevice) -> Result<usize, String> {
    let mut n = 0;
    let mut buf = vec![0u8; 4096];
    while n < 1 << 20 {
        match d
            .read(&mut buf, Some(Duration::from_millis(200)))
            .map_err(err)?
        {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Waits until the device has received nothing new for half a second (the far end has sent
/// what it will, or is held back), at most 60 s.
fn settle(d: &mut dyn CharDevice) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = (counters(d)?.received, Instant::now());
    while last.1.elapsed() < Duration::from_millis(500) {
        if Instant::now() > deadline {
            return Err("the line never went quiet in 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
        let r = counters(d)?.received;
        if r != last.0 {
            last = (r, Instant::now());
        }
    }
    Ok(())
}

/// Compares what came back with what was sent, under `data_bits`.
fn same(sent: &[u8], got: &[u8], data_bits: u8) -> Result<(), String> {
    let mask = (0xffu16 >> (8 - data_bits.min(8))) as u8;
    if got.len() != sent.len() {
        return Err(format!(
            "{} bytes sent, {} came back{}",
            sent.len(),
            got.len(),
            first_difference(sent, got, mask)
        ));
    }
    match sent.iter().zip(got).position(|(a, b)| a & mask != b & mask) {
        None => Ok(()),
        Some(i) => Err(format!(
            "byte {i} of {}: sent {:#04x}, came back {:#04x} ({data_bits} data bits)",
            sent.len(),
            sent[i],
            got[i]
        )),
    }
}

fn first_difference(sent: &[u8], got: &[u8], mask: u8) -> String {
    match sent.iter().zip(got).position(|(a, b)| a & mask != b & mask) {
        Some(i) => format!("; the first {i} the same"),
        None => String::new(),
    }
}

/// Writes `bytes` and reads as many back.
fn round_trip(d: &mut dyn CharDevice, bytes: &[u8], data_bits: u8) -> Result<(), String> {
    d.write(bytes).map_err(|e| format!("write: {e}"))?;
    let got = receive(d, bytes.len(), IDLE)?;
    same(bytes, &got, data_bits)
}

fn status(d: &mut dyn CharDevice) -> Result<String, String> {
    let i = d.info().clone();
    if i.fifo == 0 {
        return Err("the device says it has no FIFO (0 bytes)".into());
    }
    if i.max_baud < 300 {
        return Err(format!(
            "the fastest rate is {} baud: the suite needs 300 at least",
            i.max_baud
        ));
    }
    let base = base_line(d);
    set(d, &base)?;
    let left = drain(d)?;
    Ok(format!(
        "{}: FIFO {} B, up to {} baud; {base}; {left} bytes left over taken",
        i.name, i.fifo, i.max_baud
    ))
}

fn every_byte(d: &mut dyn CharDevice) -> Result<String, String> {
    // Each value twice, the second time in reverse: 512 bytes, far more than a FIFO.
    let mut bytes: Vec<u8> = (0..=255).collect();
    bytes.extend((0..=255u8).rev());
    let before = counters(d)?;
    round_trip(d, &bytes, 8)?;
    let after = counters(d)?;
    let (sent, received) = (
        moved(before.sent, after.sent),
        moved(before.received, after.received),
    );
    if sent != bytes.len() as u64 || received != bytes.len() as u64 {
        return Err(format!(
            "{} bytes went round, the counters say {sent} sent and {received} received",
            bytes.len()
        ));
    }
    Ok(format!("{} bytes, counted sent and received", bytes.len()))
}

fn every_frame(d: &mut dyn CharDevice) -> Result<String, String> {
    let baud = 38_400.min(d.info().max_baud);
    let mut n = 0;
    for data_bits in 5..=8u8 {
        for parity in [
            Parity::None,
            Parity::Odd,
            Parity::Even,
            Parity::Mark,
            Parity::Space,
        ] {
            for stop_bits in 1..=2u8 {
                let line = LineSettings {
                    baud,
                    data_bits,
                    parity,
                    stop_bits,
                    flow: Flow::None,
                };
                set(d, &line)?;
                round_trip(d, &[0x55, 0xaa, 0xff, 0x00, 0x3c], data_bits)
                    .map_err(|e| format!("{line}: {e}"))?;
                n += 1;
            }
        }
    }
    restore(d)?;
    Ok(format!("{n} frames at {baud} baud"))
}

fn rates(d: &mut dyn CharDevice) -> Result<String, String> {
    let max = d.info().max_baud;
    let mut done = Vec::new();
    for baud in [300, 1200, 2400, 9600, 19_200, 38_400, 57_600, 115_200, max] {
        if baud > max || done.contains(&baud) {
            continue;
        }
        let line = LineSettings {
            baud,
            ..LineSettings::default()
        };
        set(d, &line)?;
        round_trip(d, b"rate", 8).map_err(|e| format!("{line}: {e}"))?;
        done.push(baud);
    }
    restore(d)?;
    Ok(format!("{done:?} baud"))
}

fn refusals(d: &mut dyn CharDevice) -> Result<String, String> {
    let base = base_line(d);
    let max = d.info().max_baud;
    let bad = [
        LineSettings {
            baud: max + 1,
            ..base
        },
        LineSettings { baud: 0, ..base },
        LineSettings {
            data_bits: 4,
            ..base
        },
        LineSettings {
            data_bits: 9,
            ..base
        },
        LineSettings {
            stop_bits: 3,
            ..base
        },
    ];
    for line in bad {
        match d.set_line(&line) {
            Err(CharError::Invalid(_)) => {}
            Err(e) => return Err(format!("{line:?}: refused as {e:?}, not as invalid")),
            Ok(()) => return Err(format!("{line:?} was taken")),
        }
        let now = d.line().map_err(err)?.line;
        if now != base {
            return Err(format!("refusing {line:?} changed the line to {now}"));
        }
    }
    // Rates in range that a device may not make (a divided clock makes some rates only):
    // taken, or refused by the driver as invalid with the line unchanged.
    let mut refused_by_driver = 0;
    for baud in [7, 100_000.min(max), max - max / 7] {
        let line = LineSettings { baud, ..base };
        match d.set_line(&line) {
            Ok(()) => {
                let now = d.line().map_err(err)?.line;
                if now != line {
                    return Err(format!("{baud} baud taken, the line says {now}"));
                }
                restore(d)?;
            }
            Err(CharError::Invalid(_)) => {
                refused_by_driver += 1;
                let now = d.line().map_err(err)?.line;
                if now != base {
                    return Err(format!("refusing {baud} baud changed the line to {now}"));
                }
            }
            Err(e) => return Err(format!("{baud} baud: refused as {e:?}, not as invalid")),
        }
    }
    round_trip(d, b"still", 8)?;
    Ok(format!(
        "{} refused as invalid; of 3 odd rates, {refused_by_driver} refused by the driver",
        bad.len()
    ))
}

fn burst(d: &mut dyn CharDevice) -> Result<String, String> {
    // 1 KiB at a time, each read back before the next: the device sends and receives at once,
    // and no more is on its way than any driver has room for.
    let bytes = numbered(11, BURST);
    let before = counters(d)?;
    let t0 = Instant::now();
    for chunk in bytes.chunks(1024) {
        round_trip(d, chunk, 8)?;
    }
    let took = t0.elapsed();
    let after = counters(d)?;
    lost_nothing(&before, &after)?;
    Ok(format!(
        "{BURST} bytes each way in {:.0} ms",
        took.as_secs_f64() * 1e3
    ))
}

/// What the counters say happened between two readings.
fn moves(before: &LineCounters, after: &LineCounters) -> String {
    format!(
        "the device received {}, dropped {}, overran {}, modem lines {:#x}",
        moved(before.received, after.received),
        after.dropped.wrapping_sub(before.dropped),
        after.overruns.wrapping_sub(before.overruns),
        after.modem
    )
}

/// Fails if the line dropped or overran between two readings of its counters.
fn lost_nothing(before: &LineCounters, after: &LineCounters) -> Result<(), String> {
    let dropped = after.dropped.wrapping_sub(before.dropped);
    let overruns = after.overruns.wrapping_sub(before.overruns);
    if dropped != 0 || overruns != 0 {
        return Err(format!("{dropped} dropped, {overruns} overrun"));
    }
    Ok(())
}

/// Sets `flow`, writes [`FLOOD`] bytes with nobody reading, waits until the line is quiet,
/// then reads everything there is: what was sent, what came back, and the counters' moves.
fn flood(
    d: &mut dyn CharDevice,
    flow: Flow,
    seed: u8,
) -> Result<(Vec<u8>, Vec<u8>, LineCounters, LineCounters), String> {
    let line = LineSettings {
        flow,
        ..base_line(d)
    };
    set(d, &line)?;
    let bytes = scrambled(u64::from(seed), FLOOD);
    let before = counters(d)?;
    d.write(&bytes).map_err(|e| format!("write: {e}"))?;
    settle(d)?;
    // What was held back comes as the reader makes room: allow it a pause of a few seconds.
    let got = receive(d, bytes.len(), 2 * IDLE)?;
    let after = counters(d)?;
    restore(d)?;
    Ok((bytes, got, before, after))
}

fn flood_with_flow_control(d: &mut dyn CharDevice) -> Result<String, String> {
    let (sent, got, before, after) = flood(d, Flow::RtsCts, 23)?;
    same(&sent, &got, 8).map_err(|e| format!("{e}; {}", moves(&before, &after)))?;
    lost_nothing(&before, &after)?;
    Ok(format!("{} bytes kept while nobody read", sent.len()))
}

fn flood_without_flow_control(d: &mut dyn CharDevice) -> Result<String, String> {
    let (sent, got, before, after) = flood(d, Flow::None, 41)?;
    // What came is what was sent, with bytes left out only ...
    in_order_with_gaps(&sent, &got)?;
    // ... and every byte left out is counted: dropped by the driver, one by one, or lost to a
    // full FIFO, which a UART reports as overrun events (one may lose several bytes).
    let dropped = u64::from(after.dropped.wrapping_sub(before.dropped));
    let overruns = u64::from(after.overruns.wrapping_sub(before.overruns));
    let missing = (sent.len() - got.len()) as u64;
    if dropped > missing || (missing > dropped && overruns == 0) {
        return Err(format!(
            "{} sent, but {} came, {dropped} counted dropped and {overruns} overrun",
            sent.len(),
            got.len()
        ));
    }
    Ok(format!(
        "{} came in order, {dropped} dropped, {overruns} overrun",
        got.len()
    ))
}

#[cfg(test)]
mod tests {
    //! The suite judged on a line in memory that loops back: a right one passes, and each
    //! way of being wrong fails the check that should catch it.

    use std::collections::VecDeque;

    use super::*;
    use crate::{CharInfo, LineStatus};

    /// How the line in memory goes wrong.
    #[derive(Clone, Copy, PartialEq)]
    enum Fault {
        None,
        /// Says it took settings it did not apply.
        IgnoresSettings,
        /// Drops what its ring has no room for even under RTS/CTS.
        DropsUnderFlowControl,
        /// Drops without counting.
        DropsUncounted,
        /// Swaps two bytes once it has taken 2 KiB.
        Reorders,
        /// Does not count what it sends.
        Uncounted,
        /// Changes a byte it holds the first time it drops one.
        ChangesWhenFull,
    }

    /// A loopback line with a 4 KiB receive ring; under RTS/CTS the far end waits for room.
    struct Looped {
        info: CharInfo,
        line: LineSettings,
        ring: VecDeque<u8>,
        waiting: VecDeque<u8>,
        counters: LineCounters,
        fault: Fault,
    }

    const RING: usize = 4096;

    impl Looped {
        fn new(fault: Fault) -> Self {
            Self {
                info: CharInfo {
                    name: "mem0".into(),
                    max_baud: 115_200,
                    fifo: 16,
                },
                line: LineSettings::default(),
                ring: VecDeque::new(),
                waiting: VecDeque::new(),
                counters: LineCounters::default(),
                fault,
            }
        }

        /// The far end sends what waits while the ring has room (or drops it, without flow
        /// control).
        fn deliver(&mut self) {
            let flow = self.line.flow == Flow::RtsCts && self.fault != Fault::DropsUnderFlowControl;
            while let Some(&b) = self.waiting.front() {
                if self.ring.len() < RING {
                    self.ring.push_back(b);
                } else if flow {
                    break;
                } else if self.fault != Fault::DropsUncounted {
                    self.counters.dropped += 1;
                    if self.fault == Fault::ChangesWhenFull {
                        self.fault = Fault::None;
                        self.ring[RING / 2] ^= 0x55;
                    }
                }
                self.waiting.pop_front();
                self.counters.received += 1;
                let n = self.ring.len();
                if self.fault == Fault::Reorders && self.counters.received >= 2048 && n >= 2 {
                    self.fault = Fault::None;
                    self.ring.swap(n - 1, n - 2);
                }
            }
        }
    }

    impl CharDevice for Looped {
        fn info(&self) -> &CharInfo {
            &self.info
        }
        fn write(&mut self, bytes: &[u8]) -> Result<(), CharError> {
            let mask = (0xffu16 >> (8 - self.line.data_bits)) as u8;
            self.waiting.extend(bytes.iter().map(|b| b & mask));
            if self.fault != Fault::Uncounted {
                self.counters.sent += bytes.len() as u64;
            }
            self.deliver();
            Ok(())
        }
        fn read(&mut self, buf: &mut [u8], _: Option<Duration>) -> Result<usize, CharError> {
            let n = buf.len().min(self.ring.len());
            for (i, b) in self.ring.drain(..n).enumerate() {
                buf[i] = b;
            }
            self.deliver();
            Ok(n)
        }
        fn line(&mut self) -> Result<LineStatus, CharError> {
            Ok(LineStatus {
                line: self.line,
                counters: self.counters,
            })
        }
        fn set_line(&mut self, line: &LineSettings) -> Result<(), CharError> {
            crate::validate_line(line, &self.info)?;
            if self.fault != Fault::IgnoresSettings || line.baud == 115_200 {
                self.line = *line;
            }
            Ok(())
        }
    }

    fn verdict(fault: Fault) -> Result<(), String> {
        run(&mut Looped::new(fault))
    }

    #[test]
    fn a_line_that_does_what_the_class_says_passes() {
        verdict(Fault::None).unwrap();
    }

    #[test]
    fn each_way_of_being_wrong_fails_its_check() {
        for (fault, check) in [
            (Fault::IgnoresSettings, "every frame"),
            (Fault::Uncounted, "every byte value"),
            (Fault::DropsUnderFlowControl, "RTS/CTS"),
            (Fault::DropsUncounted, "no flow control"),
            (Fault::Reorders, "8 KiB in 1 KiB bursts"),
            (Fault::ChangesWhenFull, "no flow control"),
        ] {
            let why = verdict(fault).unwrap_err();
            assert!(why.starts_with(check), "{check}: {why}");
        }
    }

    #[test]
    fn bytes_left_out_pass_and_bytes_changed_or_moved_do_not() {
        let sent = scrambled(3, 4000);
        let mut gaps = sent[..1000].to_vec();
        gaps.extend_from_slice(&sent[2500..3000]);
        gaps.extend_from_slice(&sent[3990..]);
        in_order_with_gaps(&sent, &gaps).unwrap();
        let mut changed = gaps.clone();
        changed[1200] ^= 1;
        assert!(in_order_with_gaps(&sent, &changed).is_err());
        let mut moved = gaps.clone();
        moved.swap(300, 301);
        assert!(in_order_with_gaps(&sent, &moved).is_err());
        let mut doubled = sent[..1000].to_vec();
        doubled.extend_from_slice(&sent[900..1500]);
        assert!(in_order_with_gaps(&sent, &doubled).is_err());
    }

    #[test]
    fn numbered_bytes_repeat_only_every_256() {
        let b = numbered(5, 600);
        assert!(
            b[..256]
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len()
                == 256
        );
        assert_eq!(b[0], b[256]);
    }
}
