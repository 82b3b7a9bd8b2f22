//! Quarantine: each crash of a driver server weighed for the request that caused it.
//!
//! A crash starts the next incarnation isolated (one request at a time in each device, named
//! in the heartbeat page: `outboard_server::blame`), so the crash after it names what was in
//! the device. A request named at [`QUARANTINE_AFTER`] crashes in a row is failed by the next
//! incarnation instead of sent again. What counts:
//!
//! - a crash that names requests: each is at one crash more if the last crash named it too,
//!   at one otherwise;
//! - a crash that names nobody ends every series: isolated devices with nothing in them (no
//!   request did it), or a device that was not isolated (the first crash of a series, with
//!   everything in flight).
//!
//! Only named crashes count, although a request that kills the driver was in flight at the
//! unnamed crash before them too: whatever is in an isolated device when a fault from
//! elsewhere strikes (a kill, a stall) is named for nothing, and counting the unnamed crash
//! let one such coincidence after the first naming quarantine an innocent request — a
//! campaign of 3,000 faults, ten a second, quarantined five. Two coincidences in a row are
//! needed now. A request that kills the driver every time is failed after three crashes in a
//! server that is still isolated, four otherwise.
//!
//! Each request named is *held back* by the next incarnation (it goes into the device after
//! another request went through it), so that being first after a restart — the oldest request
//! of a replay, whatever a device or a fault does to the first request it sees — is not what
//! names it again.

use outboard_server::blame::{Suspect, Verdict};
use outboard_session::control::QUARANTINE_AFTER;

/// The series of crashes the next one continues.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Series {
    /// None: no crash yet, a crash that named nobody, or a death that was no fault.
    #[default]
    None,
    /// The last crash named these requests, each with the crashes in a row it was at.
    Named(Vec<(Suspect, u32)>),
}

/// What a crash decides.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Weighed {
    /// The series the next crash continues.
    pub series: Series,
    /// Requests to fail instead of sending again, with their crashes.
    pub quarantined: Vec<(Suspect, u32)>,
}

impl Series {
    /// Weighs a crash whose heartbeat page said `verdict`.
    pub fn crash(&self, verdict: Verdict) -> Weighed {
        let Verdict::Named(named) = verdict else {
            return Weighed::default();
        };
        let mut w = Weighed::default();
        let mut series = Vec::new();
        for b in named {
            let strikes = match self {
                Series::Named(last) => last.iter().find(|(s, _)| *s == b).map_or(1, |(_, n)| n + 1),
                Series::None => 1,
            };
            if strikes >= QUARANTINE_AFTER {
                w.quarantined.push((b, strikes));
            } else {
                series.push((b, strikes));
            }
        }
        if !series.is_empty() {
            w.series = Series::Named(series);
        }
        w
    }

    /// The requests the next incarnation holds back: those the last crash named.
    pub fn held_back(&self) -> Vec<Suspect> {
        match self {
            Series::Named(n) => n.iter().map(|(s, _)| *s).collect(),
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(n: u64) -> Suspect {
        Suspect {
            key: 7,
            request: [1 << 32 | 8, n],
        }
    }

    /// Weighs `verdicts` in turn; returns every request quarantined.
    fn run(verdicts: &[Verdict]) -> Vec<Suspect> {
        let mut series = Series::None;
        let mut out = Vec::new();
        for v in verdicts {
            let w = series.crash(v.clone());
            out.extend(w.quarantined.iter().map(|(s, _)| *s));
            series = w.series;
        }
        out
    }

    fn named(n: u64) -> Verdict {
        Verdict::Named(vec![req(n)])
    }

    #[test]
    fn a_request_in_the_device_at_three_crashes_in_a_row_is_quarantined() {
        assert_eq!(run(&[named(1), named(1), named(1)]), vec![req(1)]);
        // The first crash, among everything in flight, named nobody: it does not count.
        assert_eq!(run(&[Verdict::Unknown, named(1), named(1)]), vec![]);
        assert_eq!(
            run(&[Verdict::Unknown, named(1), named(1), named(1)]),
            vec![req(1)]
        );
    }

    #[test]
    fn a_request_named_after_a_crash_that_named_another_starts_at_one() {
        // The crash before had another request alone in the device: this one was not in it.
        assert_eq!(run(&[named(1), named(2), named(2)]), vec![]);
        assert_eq!(run(&[named(1), named(2), named(2), named(2)]), vec![req(2)]);
    }

    #[test]
    fn a_crash_that_names_nobody_ends_the_series() {
        assert_eq!(
            run(&[named(1), named(1), Verdict::Nobody, named(1)]),
            vec![]
        );
        assert_eq!(
            run(&[named(1), named(1), Verdict::Unknown, named(1)]),
            vec![]
        );
    }

    #[test]
    fn requests_alternating_at_the_head_of_every_restart_are_never_quarantined() {
        // A device that fails the first request after each restart: the replay's oldest goes
        // first once, then is held back and another goes first.
        let mut v = vec![Verdict::Unknown];
        for i in 0..20 {
            v.push(named(i % 2));
        }
        assert_eq!(run(&v), vec![]);
    }

    #[test]
    fn each_of_several_devices_named_at_once_keeps_its_own_series() {
        let both = Verdict::Named(vec![req(1), req(2)]);
        let series = Series::None.crash(both.clone()).series;
        assert_eq!(series.held_back(), vec![req(1), req(2)]);
        let w = series.crash(named(2)).series.crash(named(2));
        assert_eq!(w.quarantined, vec![(req(2), 3)]);
    }
}
