//! `bench-results/REPORT.md`: every test's numbers, charts and targets, top to bottom.

use std::fmt::Write;
use std::path::Path;

use crate::model::TestResult;

/// A number with as many decimals as its size needs.
pub(crate) fn fmt(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        return format!("{v:.0}");
    }
    match v.abs() {
        a if a >= 1000.0 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "**missed**",
        None => "not judged",
    }
}

/// Writes REPORT.md from the results present in `dir`, in suite order.
pub fn write(dir: &Path, charts: &[(String, Result<(), String>)]) -> Result<(), String> {
    let mut results = Vec::new();
    for test in crate::TESTS {
        let p = dir.join(format!("{test}.json"));
        if let Ok(text) = std::fs::read_to_string(&p) {
            results.push(
                serde_json::from_str::<TestResult>(&text)
                    .map_err(|e| format!("{}: {e}", p.display()))?,
            );
        }
    }
    let mut md = String::new();
    let _ = writeln!(md, "# Outboard evaluation report\n");
    if let Some(r) = results.first() {
        let m = &r.machine;
        let _ = writeln!(md, "Machine: {} CPUs ({}), Linux {}. Produced by `outboard bench`; every number is the median of the kept runs ({} kept, {} warm-up discarded), with min–max beside it. Absolute numbers drift on a shared machine: the targets are ratios measured in the same run.\n", m.cpus, m.cpu_model, m.kernel, r.runs - r.discarded, r.discarded);
    }
    let _ = writeln!(
        md,
        "## Targets\n\n| test | target | measured | verdict |\n|---|---|---|---|"
    );
    for r in &results {
        for t in &r.targets {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} |",
                r.test,
                t.target,
                t.measured,
                verdict(t.met)
            );
        }
    }
    for r in &results {
        let _ = writeln!(
            md,
            "\n## {} ({})\n\nReproduces: {}. Parameters: `{}`.\n",
            r.title, r.test, r.reference, r.params
        );
        for u in &r.unavailable {
            let _ = writeln!(
                md,
                "- Configuration `{}` did not run here: {}",
                u.config, u.reason
            );
        }
        for f in &r.figures {
            let _ = writeln!(md, "\n### {}\n", f.title);
            let file = format!("{}-{}.png", r.test, f.id);
            match charts.iter().find(|(n, _)| n == &file) {
                Some((_, Ok(()))) => {
                    let _ = writeln!(md, "![{}]({file})\n", f.title);
                }
                Some((_, Err(e))) => {
                    let _ = writeln!(md, "(chart not drawn: {e})\n");
                }
                None => {}
            }
            if f.kind == "bar" {
                let _ = writeln!(
                    md,
                    "| | median {} | min | max |\n|---|---|---|---|",
                    f.y_label
                );
                for s in &f.series {
                    if let Some(p) = s.points.first() {
                        let _ = writeln!(
                            md,
                            "| {} | {} | {} | {} |",
                            s.label,
                            fmt(p.y.median),
                            fmt(p.y.min),
                            fmt(p.y.max)
                        );
                    }
                }
            } else {
                let mut xs: Vec<f64> = f
                    .series
                    .iter()
                    .flat_map(|s| s.points.iter().map(|p| p.x))
                    .collect();
                xs.sort_by(f64::total_cmp);
                xs.dedup();
                let _ = write!(md, "| {} |", f.x_label);
                for s in &f.series {
                    let _ = write!(md, " {} |", s.label);
                }
                let _ = write!(md, "\n|---|");
                for _ in &f.series {
                    let _ = write!(md, "---|");
                }
                md.push('\n');
                for x in xs {
                    let _ = write!(md, "| {} |", fmt(x));
                    for s in &f.series {
                        match s.points.iter().find(|p| p.x == x) {
                            Some(p) => {
                                let _ = write!(
                                    md,
                                    " {} ({}–{}) |",
                                    fmt(p.y.median),
                                    fmt(p.y.min),
                                    fmt(p.y.max)
                                );
                            }
                            None => md.push_str(" – |"),
                        }
                    }
                    md.push('\n');
                }
                let _ = writeln!(md, "\n({})", f.y_label);
            }
        }
    }
    std::fs::write(dir.join("REPORT.md"), md).map_err(|e| e.to_string())
}
