//! PNG charts with plotters: line charts (log₂ x axis where sizes double) and bar charts with
//! min–max whiskers. Text needs a TrueType font: DejaVu Sans (Debian's `fonts-dejavu-core`)
//! is registered at first use; without it charts are skipped and the report says so.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::model::Figure;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers a font once; false if none is installed.
pub fn font_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        for p in FONT_PATHS {
            if let Ok(bytes) = std::fs::read(p) {
                // The font lives for the whole process: plotters wants 'static bytes.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

fn size_label(v: f64) -> String {
    let v = v.round() as u64;
    match v {
        v if v >= 1 << 20 && v % (1 << 20) == 0 => format!("{}M", v >> 20),
        v if v >= 1 << 10 && v % (1 << 10) == 0 => format!("{}K", v >> 10),
        v => v.to_string(),
    }
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Draws `fig` to `path` (PNG, 1000×600).
pub fn draw(fig: &Figure, path: &Path) -> Result<(), String> {
    if !font_available() {
        return Err("no TrueType font (install fonts-dejavu-core)".into());
    }
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    match fig.kind.as_str() {
        "bar" => bars(fig, &root)?,
        _ => lines(fig, &root)?,
    }
    root.present().map_err(err)
}

fn lines(
    fig: &Figure,
    root: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
) -> Result<(), String> {
    let tx = |x: f64| if fig.log_x { x.log2() } else { x };
    // A log y axis is drawn as log10(y) on a linear axis, labelled with the real values.
    let ty = |y: f64| if fig.log_y { y.max(1e-9).log10() } else { y };
    let xs: Vec<f64> = fig
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| tx(p.x)))
        .collect();
    let (x0, x1) = (
        xs.iter().copied().fold(f64::INFINITY, f64::min),
        xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    let ys = || {
        fig.series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|p| p.y.min > 0.0 || !fig.log_y)
    };
    let (ymin, ymax) = if fig.log_y {
        let lo = ys().map(|p| p.y.min.log10()).fold(f64::INFINITY, f64::min);
        let hi = ys()
            .map(|p| p.y.max.log10())
            .fold(f64::NEG_INFINITY, f64::max);
        (lo.floor(), hi.ceil().max(lo.floor() + 1.0))
    } else {
        (
            0.0,
            ys().map(|p| p.y.max).fold(0.0, f64::max).max(1e-9) * 1.1,
        )
    };
    let (x0, x1) = if x0 < x1 {
        (x0, x1)
    } else {
        (x0 - 1.0, x1 + 1.0)
    };
    let mut chart = ChartBuilder::on(root)
        .caption(&fig.title, ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x0 - 0.2..x1 + 0.2, ymin..ymax)
        .map_err(err)?;
    let (log_x, log_y) = (fig.log_x, fig.log_y);
    let value = |v: f64| {
        if v >= 10_000.0 {
            format!("{:.0}k", v / 1000.0)
        } else if v >= 10.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.2}")
        }
    };
    chart
        .configure_mesh()
        .x_desc(&fig.x_label)
        .y_desc(&fig.y_label)
        .x_labels(if log_x { (x1 - x0) as usize + 1 } else { 10 })
        .x_label_formatter(&|v| {
            if log_x {
                size_label(2f64.powf(*v))
            } else {
                format!("{v}")
            }
        })
        .y_labels(if log_y {
            (ymax - ymin) as usize * 2 + 1
        } else {
            10
        })
        .y_label_formatter(&|v| {
            if log_y {
                value(10f64.powf(*v))
            } else {
                value(*v)
            }
        })
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(err)?;
    for (i, s) in fig.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = s.points.iter().map(|p| (tx(p.x), ty(p.y.median))).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(&s.label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        chart
            .draw_series(
                pts.iter()
                    .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
            )
            .map_err(err)?;
        // Whiskers: the spread of the kept runs.
        chart
            .draw_series(s.points.iter().map(|p| {
                PathElement::new(
                    vec![(tx(p.x), ty(p.y.min)), (tx(p.x), ty(p.y.max))],
                    color.stroke_width(1),
                )
            }))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)
}

fn bars(
    fig: &Figure,
    root: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
) -> Result<(), String> {
    let n = fig.series.len();
    let ymax = fig
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.y.max))
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.15;
    let labels: Vec<String> = fig.series.iter().map(|s| s.label.clone()).collect();
    let mut chart = ChartBuilder::on(root)
        .caption(&fig.title, ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(-0.5..n as f64 - 0.5, 0.0..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|v| labels.get(v.round() as usize).cloned().unwrap_or_default())
        .y_desc(&fig.y_label)
        .y_label_formatter(&|v| {
            if *v >= 10_000.0 {
                format!("{:.0}k", v / 1000.0)
            } else {
                format!("{v:.2}")
            }
        })
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(err)?;
    for (i, s) in fig.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        if let Some(p) = s.points.first() {
            let x = i as f64;
            chart
                .draw_series([Rectangle::new(
                    [(x - 0.3, 0.0), (x + 0.3, p.y.median)],
                    color.filled(),
                )])
                .map_err(err)?;
            chart
                .draw_series([PathElement::new(
                    vec![(x, p.y.min), (x, p.y.max)],
                    BLACK.stroke_width(2),
                )])
                .map_err(err)?;
            chart
                .draw_series([Text::new(
                    format!("{:.2}", p.y.median),
                    (x - 0.1, p.y.max + ymax * 0.02),
                    ("sans-serif", 15),
                )])
                .map_err(err)?;
        }
    }
    Ok(())
}
