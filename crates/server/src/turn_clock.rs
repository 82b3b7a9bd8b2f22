//! The time of the server loop's turn, read once a phase, and when completions are timed.
//!
//! Reading the clock costs about 30 ns on a VM, a tenth of a request at millions a second.
//! So every request that enters a device in a turn of the loop shares one read (its deadline
//! stamp and its latency's start), and every completion found after them in the turn shares
//! another. Under load even that second read is rationed: a turn whose requests went in less
//! than [`SAMPLE_GAP`] after the last timed completion leaves its completions untimed, and so
//! does a turn with no request going in (whose time is not known without a read) less than
//! [`SAMPLE_TURNS`] turns after it. A busy server then times about one turn's completions
//! every 20 µs (a sample: the histogram's count is below the requests'), an idle one every
//! request (between two, it waits or spins through many turns).

use std::cell::Cell;
use std::time::Instant;

/// Least time between two timed turns of completions, while requests keep coming, in ns.
pub const SAMPLE_GAP: u64 = 20_000;
/// Least turns between two timed turns of completions when no request went in.
pub const SAMPLE_TURNS: u64 = 64;

/// One reading: the instant and nanoseconds since the server started.
type Reading = (Instant, u64);

/// The loop's clock (see the module).
#[derive(Debug)]
pub struct TurnClock {
    base: Instant,
    /// This phase's reading, once taken.
    now: Cell<Option<Reading>>,
    /// The reading of this turn's requests going in, once the completions' phase began.
    entered: Cell<Option<Reading>>,
    /// When completions were last timed, ns.
    last_timed: Cell<Option<u64>>,
    /// Turns so far, and the turn completions were last timed in.
    turns: Cell<u64>,
    last_timed_turn: Cell<Option<u64>>,
}

impl Default for TurnClock {
    fn default() -> Self {
        Self {
            base: Instant::now(),
            now: Cell::new(None),
            entered: Cell::new(None),
            last_timed: Cell::new(None),
            turns: Cell::new(0),
            last_timed_turn: Cell::new(None),
        }
    }
}

impl TurnClock {
    #[inline]
    fn read(&self) -> Reading {
        match self.now.get() {
            Some(t) => t,
            None => {
                let at = Instant::now();
                let d = at.saturating_duration_since(self.base);
                let t = (
                    at,
                    d.as_secs() * 1_000_000_000 + u64::from(d.subsec_nanos()),
                );
                self.now.set(Some(t));
                t
            }
        }
    }

    /// Now, as of this phase.
    #[inline]
    pub fn now(&self) -> Instant {
        self.read().0
    }

    /// Now, as of this phase, in nanoseconds since the server started.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.read().1
    }

    /// A new turn (or an event, which may come after a sleep): the next reading is new.
    #[inline]
    pub fn turn(&self) {
        self.now.set(None);
        self.entered.set(None);
        self.turns.set(self.turns.get().wrapping_add(1));
    }

    /// The loop slept: the next completions found are timed, however few turns ago the last
    /// were (a server at a human pace sleeps between requests, and times every one).
    #[inline]
    pub fn slept(&self) {
        self.last_timed.set(None);
        self.last_timed_turn.set(None);
    }

    /// The turn's requests went in; completions are found from here on, read anew (a
    /// vfio-user model may finish a request before its doorbell returns).
    #[inline]
    pub fn completions(&self) {
        self.entered.set(self.now.take());
    }

    /// When a completion found now was found, to time it; `None` when this turn is not
    /// timed (see the module).
    #[inline]
    pub fn completion_ns(&self) -> Option<u64> {
        if let Some(t) = self.now.get() {
            return Some(t.1);
        }
        if let (Some(last), Some(last_turn)) = (self.last_timed.get(), self.last_timed_turn.get()) {
            let soon = match self.entered.get() {
                Some(entered) => entered.1.saturating_sub(last) < SAMPLE_GAP,
                None => self.turns.get().wrapping_sub(last_turn) < SAMPLE_TURNS,
            };
            if soon {
                return None;
            }
        }
        let ns = self.read().1;
        self.last_timed.set(Some(ns));
        self.last_timed_turn.set(Some(self.turns.get()));
        Some(ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_reads_the_clock_once_and_completions_read_it_anew() {
        let c = TurnClock::default();
        c.turn();
        let went_in = c.now_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(c.now_ns(), went_in, "one reading a phase");
        c.completions();
        let found = c.completion_ns().expect("the first completions are timed");
        assert!(found >= went_in + 2_000_000, "{found} vs {went_in}");
        assert_eq!(c.completion_ns(), Some(found), "shared in the phase");
    }

    #[test]
    fn a_busy_loop_times_completions_at_most_once_a_gap_and_an_idle_one_always() {
        let c = TurnClock::default();
        c.turn();
        c.now_ns();
        c.completions();
        assert!(c.completion_ns().is_some());
        // Straight on: requests went in within the gap of the last timing.
        c.turn();
        c.now_ns();
        c.completions();
        assert_eq!(c.completion_ns(), None);
        // A turn with no request going in times what it finds only some turns later.
        c.turn();
        c.completions();
        assert_eq!(c.completion_ns(), None);
        for _ in 0..SAMPLE_TURNS {
            c.turn();
        }
        c.completions();
        assert!(c.completion_ns().is_some());
        // After a sleep, timed however soon.
        c.slept();
        c.turn();
        c.now_ns();
        c.completions();
        assert!(c.completion_ns().is_some());
        // After a pause longer than the gap, timed again.
        std::thread::sleep(std::time::Duration::from_micros(2 * SAMPLE_GAP / 1000));
        c.turn();
        c.now_ns();
        c.completions();
        assert!(c.completion_ns().is_some());
    }
}
