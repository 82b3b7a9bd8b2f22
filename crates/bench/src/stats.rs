//! Repeated runs and their summary: median, min, max, with the warm-up run discarded.

use serde::{Deserialize, Serialize};

/// Summary of one measurement over its kept runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Median of the kept runs.
    pub median: f64,
    /// Smallest kept run.
    pub min: f64,
    /// Largest kept run.
    pub max: f64,
    /// Every kept run, in order.
    pub samples: Vec<f64>,
}

impl Summary {
    /// Summarises `runs`, discarding the first `discard` (warm-up). Needs at least one kept.
    pub fn of(runs: &[f64], discard: usize) -> Self {
        let kept: Vec<f64> = runs
            .iter()
            .skip(discard.min(runs.len().saturating_sub(1)))
            .copied()
            .collect();
        let mut sorted = kept.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n == 0 {
            f64::NAN
        } else if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Self {
            median,
            min: sorted.first().copied().unwrap_or(f64::NAN),
            max: sorted.last().copied().unwrap_or(f64::NAN),
            samples: kept,
        }
    }
}

/// The median of a sample (for per-run latency distributions).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discards_warm_up_and_summarises() {
        let s = Summary::of(&[100.0, 3.0, 1.0, 2.0], 1);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(s.samples, vec![3.0, 1.0, 2.0]);
        let s = Summary::of(&[5.0], 1);
        assert_eq!(s.median, 5.0, "a single run is kept rather than discarded");
        assert_eq!(Summary::of(&[1.0, 4.0, 2.0], 1).median, 3.0);
    }
}
