//! Latency against context length, one line per scheme and one panel per batch size, as SVG
//! (plotters' SVG backend: no system libraries, text left to the viewer's fonts).

use std::path::Path;

use plotters::prelude::*;

use crate::error::{BenchError, Result};
use crate::grid::format_tokens;
use crate::report::BenchResults;

/// Line colours, cycled.
const COLOURS: [RGBColor; 8] = [
    RGBColor(0, 0, 0),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];

fn plot_err<E: std::fmt::Display>(e: E) -> BenchError {
    BenchError::Plot(e.to_string())
}

/// Draws `results` into an SVG document and returns its text.
pub fn svg(results: &BenchResults) -> Result<String> {
    let mut batches: Vec<usize> = results.rows.iter().map(|r| r.batch).collect();
    batches.sort_unstable();
    batches.dedup();
    let mut schemes: Vec<&str> = Vec::new();
    for r in &results.rows {
        if !schemes.contains(&r.scheme.as_str()) {
            schemes.push(&r.scheme);
        }
    }
    let panels = batches.len().max(1);
    let mut text = String::new();
    {
        let root =
            SVGBackend::with_string(&mut text, (560 * panels as u32, 460)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let title = format!(
            "kvq decode latency — {} — {} ({})",
            results.gpu.name, results.shape, results.date
        );
        let root = root.titled(&title, ("sans-serif", 16)).map_err(plot_err)?;
        let areas = root.split_evenly((1, panels));
        for (area, &batch) in areas.iter().zip(&batches) {
            draw_panel(area, results, batch, &schemes)?;
        }
        root.present().map_err(plot_err)?;
    }
    Ok(text)
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    results: &BenchResults,
    batch: usize,
    schemes: &[&str],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let rows: Vec<_> = results.rows.iter().filter(|r| r.batch == batch).collect();
    // x is log2(tokens) on a linear axis, so ticks fall on powers of two (4K, 8K, …).
    let (mut x_lo, mut x_hi, mut y_lo, mut y_hi) = (f64::MAX, f64::MIN, f64::MAX, 0f64);
    for r in &rows {
        x_lo = x_lo.min((r.context as f64).log2());
        x_hi = x_hi.max((r.context as f64).log2());
        y_lo = y_lo.min(r.median_us);
        y_hi = y_hi.max(r.median_us);
    }
    if rows.is_empty() {
        return Ok(());
    }
    let (x_lo, x_hi) = (x_lo.floor() - 0.5, x_hi.ceil() + 0.5);
    let x_ticks = (x_hi - x_lo).round() as usize + 1;
    let (y_lo, y_hi) = (y_lo.max(1e-3) / 1.5, y_hi * 1.5);
    let mut chart = ChartBuilder::on(area)
        .caption(format!("B = {batch}"), ("sans-serif", 14))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x_lo..x_hi, (y_lo..y_hi).log_scale())
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("context length (tokens)")
        .y_desc("median latency (µs)")
        .x_labels(x_ticks)
        .y_labels(10)
        .light_line_style(WHITE)
        .x_label_formatter(&|x| {
            let pow = x.round();
            if (x - pow).abs() < 1e-6 && (0.0..63.0).contains(&pow) {
                format_tokens(1usize << pow as u32)
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(plot_err)?;
    for (i, scheme) in schemes.iter().enumerate() {
        let mut points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.scheme == *scheme)
            .map(|r| ((r.context as f64).log2(), r.median_us))
            .collect();
        if points.is_empty() {
            continue;
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let colour = COLOURS[i % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
            .map_err(plot_err)?
            .label(scheme.to_string())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
            });
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, colour.filled())),
            )
            .map_err(plot_err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

/// Writes [`svg`] to `path`.
pub fn write_svg(results: &BenchResults, path: &Path) -> Result<()> {
    let text = svg(results)?;
    std::fs::write(path, text).map_err(|source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample;

    #[test]
    fn draws_one_line_per_scheme_and_a_panel_per_batch() {
        let text = svg(&sample()).unwrap();
        assert!(text.starts_with("<svg"), "{}", &text[..100.min(text.len())]);
        assert!(text.contains("B = 1") && text.contains("B = 16"));
        assert!(text.contains("kivi2") && text.contains("fp16"));
        assert!(text.contains("<polyline") || text.contains("<path"));
    }
}
