//! Two builds side by side (`outboard bench --baseline OLD TESTS`). Both builds run the same
//! tests in alternating rounds — baseline then this build, then this build then baseline, and so
//! on (ABBA) — so that the machine's drift during the run falls on both alike. Round k of this
//! build is paired with round k of the baseline, and every measured point gets the ratio of the
//! two medians, turned so that above 1 is better: a rate is divided, a time or a CPU cost is
//! inverted. A point whose median paired ratio is below `1 − tolerance` is worse.
//!
//! Series that run none of Outboard's code (a figure's references: the kernel, a bare
//! ping-pong) can move only with the machine, so their ratios are the run's noise floor, which
//! the report gives beside the verdict: a point worse by less than the references moved is
//! within the noise.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::model::TestResult;
use crate::report::fmt;

/// How often a failed round is run again before the comparison gives up.
const RETRIES: usize = 2;

/// What a comparison needs.
pub struct Options {
    /// The other build's `outboard` executable.
    pub baseline: PathBuf,
    /// This build's `outboard` executable.
    pub this: PathBuf,
    /// Tests both builds run.
    pub tests: Vec<String>,
    /// Arguments both builds' `bench` get (`--quick`, `--runs N`, `--size S`).
    pub args: Vec<String>,
    /// Rounds per build.
    pub rounds: usize,
    /// How much worse a point may be before it counts as worse (0.05: 5%).
    pub tolerance: f64,
    /// Where each round's results and the comparison go.
    pub out: PathBuf,
    /// Longest one build's round may take before it is stopped.
    pub round_limit: Duration,
}

/// Which way a figure's unit improves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    /// A rate or a share: more is better.
    Higher,
    /// A time or a CPU cost: less is better.
    Lower,
}

impl Better {
    /// From a figure's y label; `None` for a unit this does not know (no verdict then).
    pub fn of_unit(y_label: &str) -> Option<Better> {
        let unit = y_label.trim_end_matches(" (log scale)").trim();
        let lower = unit.to_lowercase();
        if lower.starts_with("cpu") || matches!(unit, "ns" | "µs" | "us" | "ms" | "s" | "seconds")
        {
            Some(Better::Lower)
        } else if lower.contains("/s")
            || lower.contains("per second")
            || lower == "iops"
            || unit == "%"
        {
            Some(Better::Higher)
        } else {
            None
        }
    }
}

/// One measured point of both builds.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Test id.
    pub test: String,
    /// Figure id.
    pub figure: String,
    /// The figure's unit.
    pub unit: String,
    /// Series label.
    pub series: String,
    /// X value (0 for a bar).
    pub x: f64,
    /// A series that runs none of Outboard's code.
    pub reference: bool,
    /// Which way the unit improves, if known.
    pub better: Option<Better>,
    /// The baseline's medians, one per round it measured this point in.
    pub baseline: Vec<f64>,
    /// This build's medians, one per round.
    pub this: Vec<f64>,
    /// Per round with both: this build relative to the baseline, above 1 better.
    pub paired: Vec<f64>,
}

impl Row {
    /// The median paired ratio (above 1: this build is better), if any round has both.
    pub fn change(&self) -> Option<f64> {
        median(&self.paired)
    }

    /// A 95% confidence interval of [`Row::change`], free of any assumption about the
    /// ratios' distribution (the order statistics a sign test gives); `None` below six
    /// rounds, too few for one.
    pub fn interval(&self) -> Option<(f64, f64)> {
        median_interval(&self.paired)
    }

    /// Whether a change is shown at all: the interval lies wholly above or below no change.
    /// A point worse by more than the tolerance whose interval includes no change is worse in
    /// this run's median, and as likely no change at all in the noise.
    pub fn shown(&self) -> bool {
        self.interval().is_some_and(|(lo, hi)| hi < 1.0 || lo > 1.0)
    }

    /// How this point came out: `worse`, `better`, `same`, or why it has no verdict.
    pub fn verdict(&self, tolerance: f64) -> &'static str {
        match (self.better, self.change()) {
            (None, _) => "unit unknown",
            (_, None) => "not measured by both",
            _ if self.reference => "reference",
            (_, Some(c)) if c < 1.0 - tolerance => "worse",
            (_, Some(c)) if c > 1.0 + tolerance => "better",
            _ => "same",
        }
    }
}

/// The comparison of one run.
#[derive(Debug, Serialize)]
pub struct Comparison {
    /// The baseline executable.
    pub baseline: String,
    /// This build's executable.
    pub this: String,
    /// Rounds per build.
    pub rounds: usize,
    /// The tolerance the verdicts use.
    pub tolerance: f64,
    /// Every point measured by either build.
    pub rows: Vec<Row>,
    /// Rounds that failed and were run again, and why.
    pub retried: Vec<String>,
}

impl Comparison {
    /// Points of Outboard's code worse than the tolerance allows.
    pub fn worse(&self) -> impl Iterator<Item = &Row> {
        (self.rows.iter()).filter(|r| r.verdict(self.tolerance) == "worse")
    }

    /// The largest move of a reference point's median paired ratio away from 1: the noise.
    pub fn noise(&self) -> Option<f64> {
        (self.rows.iter().filter(|r| r.reference))
            .filter_map(|r| r.change())
            .map(|c| (c - 1.0).abs())
            .max_by(f64::total_cmp)
    }
}

fn median(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| crate::stats::Summary::of(v, 0).median)
}

/// The 95% interval of the median of `v`: the k-th smallest and k-th largest value, for the
/// largest k at which fewer than k values fall below the median with probability at most
/// 2.5% (each value is below it with probability one half, whatever the distribution).
fn median_interval(v: &[f64]) -> Option<(f64, f64)> {
    let n = v.len();
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    // P(X <= j) for X ~ Binomial(n, 1/2), j = 0, 1, …: the first j where it passes 2.5%
    // is the number of values outside the interval on each side.
    let mut term = 0.5f64.powi(n as i32);
    let mut below = 0.0;
    let mut outside = 0;
    for j in 0..n {
        below += term;
        if below > 0.025 {
            break;
        }
        outside = j + 1;
        term *= (n - j) as f64 / (j + 1) as f64;
    }
    (outside > 0).then(|| (sorted[outside - 1], sorted[n - outside]))
}

/// The two builds, in the order of round `k` (ABBA: even rounds start with the baseline).
fn order(k: usize) -> [Build; 2] {
    if k.is_multiple_of(2) {
        [Build::Baseline, Build::This]
    } else {
        [Build::This, Build::Baseline]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Build {
    Baseline,
    This,
}

impl Build {
    fn dir(self, out: &Path, round: usize) -> PathBuf {
        let name = match self {
            Build::Baseline => "baseline",
            Build::This => "this",
        };
        out.join(name).join(format!("round-{round}"))
    }
}

/// Runs both builds' rounds, then compares them; writes `COMPARE.md` and `compare.json`.
pub fn compare(opts: &Options) -> Result<Comparison, String> {
    for exe in [&opts.baseline, &opts.this] {
        if !exe.is_file() {
            return Err(format!("{}: no such executable", exe.display()));
        }
    }
    let progress = ProgressBar::new((2 * opts.rounds) as u64);
    progress.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} rounds  {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut retried = Vec::new();
    for k in 0..opts.rounds {
        for build in order(k) {
            let exe = match build {
                Build::Baseline => &opts.baseline,
                Build::This => &opts.this,
            };
            progress.set_message(format!(
                "round {}/{}: {}",
                k + 1,
                opts.rounds,
                exe.display()
            ));
            let dir = build.dir(&opts.out, k);
            // A build that fails a round now and then (a race since fixed, in an old one) is
            // given it again, up to twice; the report lists every retry.
            let mut attempt = 0;
            while let Err(e) = run_round(exe, opts, &dir) {
                attempt += 1;
                if attempt > RETRIES {
                    return Err(e);
                }
                let kept = dir.with_file_name(format!("round-{k}-failed-{attempt}"));
                let _ = std::fs::rename(&dir, &kept);
                retried.push(format!("{e} (kept in {}; run again)", kept.display()));
            }
            progress.inc(1);
        }
    }
    progress.finish_and_clear();
    let comparison = Comparison {
        retried,
        baseline: opts.baseline.display().to_string(),
        this: opts.this.display().to_string(),
        rounds: opts.rounds,
        tolerance: opts.tolerance,
        rows: rows(&opts.out, &opts.tests, opts.rounds)?,
    };
    let json = serde_json::to_string_pretty(&comparison).map_err(|e| e.to_string())?;
    write(&opts.out.join("compare.json"), &json)?;
    write(&opts.out.join("COMPARE.md"), &markdown(&comparison))?;
    Ok(comparison)
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// One build's `bench` into `dir`, its output to `dir/bench.log`; stopped (its whole process
/// group, which it leads and which cannot be reused while it is unreaped) past the limit.
fn run_round(exe: &Path, opts: &Options, dir: &Path) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let log_path = dir.join("bench.log");
    let log =
        std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let err = log.try_clone().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .arg("bench")
        .args(&opts.tests)
        .args(&opts.args)
        .arg("--out")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .process_group(0)
        .spawn()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    let deadline = Instant::now() + opts.round_limit;
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if Instant::now() > deadline {
            // The child is unreaped, so its process group id is still ours to signal.
            let group = rustix::process::Pid::from_child(&child);
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
            let _ = child.wait();
            return Err(format!(
                "{} bench took longer than {:?} and was stopped; see {}",
                exe.display(),
                opts.round_limit,
                log_path.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} bench failed ({status}); see {}",
            exe.display(),
            log_path.display()
        ))
    }
}

/// Every point of every round of both builds, in report order. Figure metadata (unit,
/// references) comes from this build's results, which know them; the baseline's only add
/// numbers. Round k of one build is paired with round k of the other only where both measured
/// the point.
fn rows(out: &Path, tests: &[String], rounds: usize) -> Result<Vec<Row>, String> {
    // (test's place, figure, series, x) -> the row and each build's median by round.
    type Key = (usize, String, String, u64);
    let mut seen: BTreeMap<Key, (Row, [BTreeMap<usize, f64>; 2])> = BTreeMap::new();
    for (t, test) in tests.iter().enumerate() {
        for k in 0..rounds {
            for (b, build) in [Build::This, Build::Baseline].into_iter().enumerate() {
                let path = build.dir(out, k).join(format!("{test}.json"));
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                let result: TestResult =
                    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
                for f in &result.figures {
                    for s in &f.series {
                        for p in &s.points {
                            let key = (t, f.id.clone(), s.label.clone(), p.x.to_bits());
                            let (_, by_round) = seen.entry(key).or_insert_with(|| {
                                let row = Row {
                                    test: test.clone(),
                                    figure: f.id.clone(),
                                    unit: f.y_label.clone(),
                                    series: s.label.clone(),
                                    x: p.x,
                                    reference: f.references.contains(&s.label),
                                    better: Better::of_unit(&f.y_label),
                                    baseline: Vec::new(),
                                    this: Vec::new(),
                                    paired: Vec::new(),
                                };
                                (row, [BTreeMap::new(), BTreeMap::new()])
                            });
                            by_round[b].insert(k, p.y.median);
                        }
                    }
                }
            }
        }
    }
    // The map's order is the report's: tests as asked, then figure, series and x (the bits of a
    // non-negative float sort as its value).
    let rows: Vec<Row> = (seen.into_values())
        .map(|(mut row, [this, baseline])| {
            for (k, &b) in &this {
                let Some(&a) = baseline.get(k) else { continue };
                let ratio = match row.better {
                    Some(Better::Lower) => a / b,
                    _ => b / a,
                };
                if ratio.is_finite() && ratio > 0.0 {
                    row.paired.push(ratio);
                }
            }
            row.this = this.into_values().collect();
            row.baseline = baseline.into_values().collect();
            row
        })
        .collect();
    Ok(rows)
}

fn percent(change: f64) -> String {
    format!("{:+.1}%", (change - 1.0) * 100.0)
}

/// The whole comparison as Markdown: a summary, then every point.
pub fn markdown(c: &Comparison) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Two builds compared\n");
    let _ = writeln!(
        md,
        "Baseline `{}`, this build `{}`: {} rounds each, alternating (ABBA). A change is this build's median relative to the baseline's in the same round, the median over rounds, signed so that + is better (a time or CPU cost inverted); the range is over rounds. Worse means worse by more than {:.0}%.\n",
        c.baseline,
        c.this,
        c.rounds,
        c.tolerance * 100.0
    );
    let _ = writeln!(md, "{}\n", summary(c));
    let _ = writeln!(
        md,
        "| test | figure | series | x | baseline | this | change | 95% interval | range | verdict |\n|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in &c.rows {
        let range = match (
            r.paired.iter().copied().min_by(f64::total_cmp),
            r.paired.iter().copied().max_by(f64::total_cmp),
        ) {
            (Some(lo), Some(hi)) => format!("{} … {}", percent(lo), percent(hi)),
            _ => "-".into(),
        };
        let cell = |v: &[f64]| median(v).map(fmt).unwrap_or_else(|| "-".into());
        let interval = r.interval().map_or_else(
            || "-".into(),
            |(lo, hi)| format!("{} … {}", percent(lo), percent(hi)),
        );
        let _ = writeln!(
            md,
            "| {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.test,
            r.figure,
            r.unit,
            r.series,
            fmt(r.x),
            cell(&r.baseline),
            cell(&r.this),
            r.change().map(percent).unwrap_or_else(|| "-".into()),
            interval,
            range,
            r.verdict(c.tolerance)
        );
    }
    md
}

/// The verdict in a few lines: points compared, points worse, the references' noise.
pub fn summary(c: &Comparison) -> String {
    let judged = (c.rows.iter())
        .filter(|r| matches!(r.verdict(c.tolerance), "worse" | "better" | "same"))
        .count();
    let worse: Vec<&Row> = c.worse().collect();
    let mut s = format!(
        "{judged} points of Outboard's code compared; {} worse by more than {:.0}%.",
        worse.len(),
        c.tolerance * 100.0
    );
    if !worse.is_empty() && worse.iter().all(|r| r.interval().is_some()) {
        let shown = worse.iter().filter(|r| r.shown()).count();
        let _ = write!(
            s,
            " Of those, {shown} {} a change at all (a 95% interval of the change wholly below no change); in the others the interval includes no change.",
            if shown == 1 { "shows" } else { "show" }
        );
    }
    match c.noise() {
        Some(n) => {
            let _ = write!(
                s,
                " The references (code that is the same in both builds) moved by up to {:.1}%: the noise of this run.",
                n * 100.0
            );
        }
        None => s.push_str(" No reference series was measured, so the run's noise is unknown."),
    }
    if !c.retried.is_empty() {
        let _ = write!(s, " {} rounds failed and were run again:", c.retried.len());
        for r in &c.retried {
            let _ = write!(s, "\n- {r}");
        }
    }
    for r in worse {
        let interval = r.interval().map_or_else(String::new, |(lo, hi)| {
            format!(", 95% interval {} … {}", percent(lo), percent(hi))
        });
        let _ = write!(
            s,
            "\n- {} {} `{}` at {}: {} (baseline {}, this {}{interval})",
            r.test,
            r.figure,
            r.series,
            fmt(r.x),
            r.change().map(percent).unwrap_or_default(),
            median(&r.baseline).map(fmt).unwrap_or_default(),
            median(&r.this).map(fmt).unwrap_or_default()
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_say_which_way_is_better() {
        for unit in [
            "MB/s (log scale)",
            "IOPS",
            "requests/s",
            "Mbit/s",
            "achieved (Mbit/s)",
            "frames per second",
            "%",
        ] {
            assert_eq!(Better::of_unit(unit), Some(Better::Higher), "{unit}");
        }
        for unit in ["µs", "ms", "seconds", "CPU seconds", "CPU cores busy"] {
            assert_eq!(Better::of_unit(unit), Some(Better::Lower), "{unit}");
        }
        assert_eq!(Better::of_unit("widgets"), None);
    }

    fn row(better: Better, baseline: &[f64], this: &[f64], reference: bool) -> Row {
        Row {
            test: "t".into(),
            figure: "f".into(),
            unit: String::new(),
            series: "s".into(),
            x: 0.0,
            reference,
            better: Some(better),
            baseline: baseline.to_vec(),
            this: this.to_vec(),
            paired: (baseline.iter().zip(this))
                .map(|(a, b)| match better {
                    Better::Higher => b / a,
                    Better::Lower => a / b,
                })
                .collect(),
        }
    }

    #[test]
    fn verdicts_follow_the_unit_and_the_tolerance() {
        // Slower latency is worse; a faster rate better; within 5% the same.
        assert_eq!(
            row(Better::Lower, &[1.0, 1.0], &[1.2, 1.1], false).verdict(0.05),
            "worse"
        );
        assert_eq!(
            row(Better::Higher, &[100.0], &[90.0], false).verdict(0.05),
            "worse"
        );
        assert_eq!(
            row(Better::Higher, &[100.0], &[120.0], false).verdict(0.05),
            "better"
        );
        assert_eq!(
            row(Better::Lower, &[1.0], &[1.04], false).verdict(0.05),
            "same"
        );
        assert_eq!(
            row(Better::Lower, &[1.0], &[2.0], true).verdict(0.05),
            "reference"
        );
        assert_eq!(
            row(Better::Lower, &[], &[2.0], false).verdict(0.05),
            "not measured by both"
        );
    }

    #[test]
    fn the_noise_is_the_references_largest_move() {
        let c = Comparison {
            baseline: "a".into(),
            this: "b".into(),
            rounds: 2,
            tolerance: 0.05,
            rows: vec![
                row(Better::Higher, &[100.0, 100.0], &[93.0, 97.0], true),
                row(Better::Higher, &[100.0, 100.0], &[80.0, 80.0], false),
            ],
            retried: vec!["round 1 failed".into()],
        };
        assert!((c.noise().unwrap() - 0.05).abs() < 1e-9);
        assert_eq!(c.worse().count(), 1);
        let md = markdown(&c);
        assert!(
            md.contains("1 points of Outboard's code compared; 1 worse"),
            "{md}"
        );
        assert!(md.contains("moved by up to 5.0%"), "{md}");
        assert!(
            md.contains("1 rounds failed and were run again:\n- round 1 failed"),
            "{md}"
        );
    }

    #[test]
    fn the_interval_of_the_median_is_the_sign_test_s() {
        // Fewer than six values: no 95% interval exists.
        assert_eq!(median_interval(&[1.0, 2.0, 3.0, 4.0, 5.0]), None);
        // Six: the extremes (2 × 1/64 = 3.1% outside).
        assert_eq!(
            median_interval(&[6.0, 1.0, 5.0, 2.0, 4.0, 3.0]),
            Some((1.0, 6.0))
        );
        // 24: the 7th smallest and the 7th largest (P(X ≤ 6) = 1.1%, P(X ≤ 7) = 3.2%).
        let v: Vec<f64> = (1..=24).map(f64::from).collect();
        assert_eq!(median_interval(&v), Some((7.0, 18.0)));
    }

    #[test]
    fn a_change_is_shown_only_when_the_interval_excludes_none() {
        let base = [100.0; 8];
        // Every round 10% slower: worse, and shown.
        let slow = row(Better::Higher, &base, &[90.0; 8], false);
        assert_eq!(slow.verdict(0.05), "worse");
        assert!(slow.shown());
        // Worse by median, but rounds on both sides of no change: not shown.
        let noisy = row(
            Better::Higher,
            &base,
            &[80.0, 85.0, 90.0, 92.0, 93.0, 104.0, 110.0, 120.0],
            false,
        );
        assert_eq!(noisy.verdict(0.05), "worse");
        assert!(!noisy.shown());
        let c = Comparison {
            baseline: "a".into(),
            this: "b".into(),
            rounds: 8,
            tolerance: 0.05,
            rows: vec![slow, noisy],
            retried: vec![],
        };
        let md = summary(&c);
        assert!(md.contains("2 worse by more than 5%"), "{md}");
        assert!(md.contains("Of those, 1 shows a change at all"), "{md}");
        assert!(md.contains("95% interval -20.0% … +20.0%"), "{md}");
    }

    #[test]
    fn rounds_alternate() {
        assert_eq!(order(0), [Build::Baseline, Build::This]);
        assert_eq!(order(1), [Build::This, Build::Baseline]);
    }
}
