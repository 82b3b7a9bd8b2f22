//! The results of a test, as written to `bench-results/<test>.json` and read back for the report.

use serde::{Deserialize, Serialize};

use crate::stats::Summary;

/// One test's results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TestResult {
    /// Test id (`disk-read`, `iops`, `null-rtt`).
    pub test: String,
    /// Human title.
    pub title: String,
    /// What in the Fluke thesis (or elsewhere) it reproduces.
    pub reference: String,
    /// Runs per measurement, including the discarded warm-up.
    pub runs: usize,
    /// Warm-up runs discarded.
    pub discarded: usize,
    /// Parameters (sizes, durations).
    pub params: serde_json::Value,
    /// The figures.
    pub figures: Vec<Figure>,
    /// Configurations that could not run here, and why.
    pub unavailable: Vec<Unavailable>,
    /// Targets from EVALUATION.md and whether this run met them.
    pub targets: Vec<Target>,
    /// When and where.
    pub machine: Machine,
}

/// A figure: several series over one x axis.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Figure {
    /// Id, used in the chart file name.
    pub id: String,
    /// Title.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// X values double from point to point: draw the axis in log₂.
    pub log_x: bool,
    /// Y values span orders of magnitude: draw the axis in log₁₀.
    #[serde(default)]
    pub log_y: bool,
    /// `line` or `bar`.
    pub kind: String,
    /// The series.
    pub series: Vec<Series>,
    /// Labels of the series that run none of Outboard's code (the kernel, a bare ping-pong):
    /// the machine's floor, and in a comparison of two builds the measure of its noise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub references: Vec<String>,
}

/// One configuration's curve (or bar).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Series {
    /// Configuration label.
    pub label: String,
    /// Points, in x order.
    pub points: Vec<Point>,
}

/// One measured point.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Point {
    /// X value.
    pub x: f64,
    /// Summary over the kept runs.
    pub y: Summary,
}

/// A configuration that did not run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Unavailable {
    /// Configuration.
    pub config: String,
    /// Why.
    pub reason: String,
}

/// A target and this run's verdict.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Target {
    /// The target, as EVALUATION.md states it.
    pub target: String,
    /// What this run measured.
    pub measured: String,
    /// Met (`None`: could not be judged, e.g. a configuration was unavailable).
    pub met: Option<bool>,
}

/// The machine the results came from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// Online CPUs.
    pub cpus: usize,
    /// Kernel release.
    pub kernel: String,
    /// CPU model.
    pub cpu_model: String,
    /// Seconds since the epoch when the test finished.
    pub finished_at: u64,
}

impl Machine {
    /// This machine, now.
    pub fn here() -> Self {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_default();
        Self {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            kernel: rustix::system::uname()
                .release()
                .to_string_lossy()
                .into_owned(),
            cpu_model,
            finished_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        }
    }
}

impl Figure {
    /// Marks the series whose labels `is_reference` accepts as references (code not Outboard's).
    pub fn references_where(mut self, is_reference: impl Fn(&str) -> bool) -> Self {
        self.references = (self.series.iter())
            .map(|s| s.label.clone())
            .filter(|l| is_reference(l))
            .collect();
        self
    }

    /// The series with this label.
    pub fn series(&self, label: &str) -> Option<&Series> {
        self.series.iter().find(|s| s.label == label)
    }
}

impl Series {
    /// The median at `x`.
    pub fn at(&self, x: f64) -> Option<f64> {
        self.points.iter().find(|p| p.x == x).map(|p| p.y.median)
    }
}

impl Series {
    /// An empty series.
    pub fn named(label: &str) -> Self {
        Self {
            label: label.into(),
            points: Vec::new(),
        }
    }
}

/// Two series of one configuration measured together (a figure and its CPU beside it).
pub struct Twin {
    /// The measurement (latency, throughput).
    pub first: Series,
    /// The CPU busy time beside it.
    pub second: Series,
}

impl Twin {
    /// Both empty, under `label`.
    pub fn new(label: &str) -> Self {
        Self {
            first: Series::named(label),
            second: Series::named(label),
        }
    }

    /// One point of each at `x`, from their runs (the warm-up discarded).
    pub fn push(&mut self, x: f64, first: &[f64], second: &[f64]) {
        let warm = crate::tests::WARM_UP;
        self.first.points.push(Point {
            x,
            y: Summary::of(first, warm),
        });
        self.second.points.push(Point {
            x,
            y: Summary::of(second, warm),
        });
    }
}
