//! Line and bar charts as standalone SVG (no script, no external resources), for the pages
//! `autopar explain` writes: training curves of a run log, and measurements against estimates.
//!
//! Invariants: the output is one `<svg>` element with a `viewBox`, every line chart series one
//! `<polyline>` and every bar one `<rect class="bar">` (each series with its legend entry), text
//! escaped; non-finite points (and beyond ±1e300, where ranges overflow) are left out, and a
//! chart with no such point says so instead of drawing axes over nothing; every coordinate
//! written is finite (a range too narrow for its magnitude, all x at step 1e17, is widened); a
//! series of more than [`MAX_SERIES_POINTS`] points is drawn by each bucket's lowest and highest
//! point ([`downsample`]), so a chart's size is bounded whatever the log's length.

use std::fmt::Write;

/// One line of a chart: `(x, y)` points in x order.
#[derive(Clone, Debug, Default)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// The points.
    pub points: Vec<(f64, f64)>,
    /// Draw a dot at every point (sparse series, such as evaluations).
    pub dots: bool,
    /// Draw the line dashed (e.g. a measurement over the estimate it may coincide with).
    pub dashed: bool,
}

/// A chart: its title, axis labels and series.
#[derive(Clone, Debug, Default)]
pub struct LineChart {
    /// Title above the plot.
    pub title: String,
    /// The x axis' label.
    pub x_label: String,
    /// The y axis' label.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
    /// Horizontal reference lines: value and label (e.g. an entropy to beat).
    pub references: Vec<(f64, String)>,
}

const COLOURS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
const W: f64 = 640.0;
const H: f64 = 320.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 32.0;
const BOTTOM: f64 = 44.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// An `<svg>` element's opening of height `h` (width [`W`]): white ground and the title.
fn open(h: f64, title: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {W} {h}\" width=\"{W}\" height=\"{h}\" \
         font-family=\"sans-serif\" font-size=\"11\" role=\"img\" aria-label=\"{}\">",
        esc(title)
    );
    let _ = writeln!(o, "<rect width=\"{W}\" height=\"{h}\" fill=\"white\"/>");
    let _ = writeln!(
        o,
        "<text x=\"{:.1}\" y=\"18\" text-anchor=\"middle\" font-size=\"13\">{}</text>",
        W / 2.0,
        esc(title)
    );
    o
}

/// About five round tick values covering `lo..=hi`.
pub fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite()) || hi <= lo {
        return vec![lo];
    }
    let raw = (hi - lo) / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let mut v = vec![];
    let mut t = (lo / step).ceil() * step;
    while t <= hi + step * 1e-9 && v.len() < 12 {
        v.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    v
}

/// A tick label: short, without trailing zeros.
fn label(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e6).contains(&a) {
        return format!("{v:.1e}");
    }
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

/// Most points a line chart draws of one series.
pub const MAX_SERIES_POINTS: usize = 2000;

/// `points` (in x order) reduced to at most `max` (>= 2): in consecutive buckets of equal
/// count, the lowest and the highest point of each, in x order, so every extreme stays.
pub fn downsample(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max {
        return points.to_vec();
    }
    let bucket = points.len().div_ceil((max / 2).max(1));
    let mut out = Vec::with_capacity(max);
    for chunk in points.chunks(bucket) {
        let lo = (0..chunk.len()).min_by(|&a, &b| chunk[a].1.total_cmp(&chunk[b].1)).unwrap_or(0);
        let hi = (0..chunk.len()).max_by(|&a, &b| chunk[a].1.total_cmp(&chunk[b].1)).unwrap_or(0);
        out.push(chunk[lo.min(hi)]);
        if lo != hi {
            out.push(chunk[lo.max(hi)]);
        }
    }
    out
}

/// `lo..hi` widened when it is empty or narrower than its values' precision (values near 1e17
/// are 16 apart in f64: a range of 1 around them would not be a range).
fn widened(lo: f64, hi: f64, pad: f64) -> (f64, f64) {
    let min_width = (lo.abs().max(hi.abs()) * 1e-9).max(1e-300);
    if hi - lo < min_width {
        let w = min_width.max(lo.abs() * 1e-6).max(1.0);
        (lo - w, hi + w)
    } else {
        let p = (hi - lo) * pad;
        (lo - p, hi + p)
    }
}

impl LineChart {
    /// The chart as an `<svg>` element.
    pub fn svg(&self) -> String {
        // Beyond ±1e300 a range overflows: such points are left out as non-finite ones are.
        let finite = |p: &&(f64, f64)| p.0.abs() < 1e300 && p.1.abs() < 1e300;
        let pts: Vec<(f64, f64)> = self.series.iter().flat_map(|s| s.points.iter().filter(finite).copied()).collect();
        let mut o = open(H, &self.title);
        if pts.is_empty() {
            let _ = writeln!(
                o,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">no data</text>\n</svg>",
                W / 2.0,
                H / 2.0
            );
            return o;
        }
        let fold = |f: fn(f64, f64) -> f64, init: f64, get: fn(&(f64, f64)) -> f64| pts.iter().map(get).fold(init, f);
        let (mut x0, mut x1) = (fold(f64::min, f64::INFINITY, |p| p.0), fold(f64::max, f64::NEG_INFINITY, |p| p.0));
        let mut y0 = fold(f64::min, f64::INFINITY, |p| p.1);
        let mut y1 = fold(f64::max, f64::NEG_INFINITY, |p| p.1);
        for (r, _) in self.references.iter().filter(|r| r.0.abs() < 1e300) {
            y0 = y0.min(*r);
            y1 = y1.max(*r);
        }
        (x0, x1) = widened(x0, x1, 0.0);
        (y0, y1) = widened(y0, y1, 0.05);
        let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
        let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
        let sy = |y: f64| TOP + (1.0 - (y - y0) / (y1 - y0)) * ph;
        // Grid and ticks.
        let _ = writeln!(o, "<g stroke=\"#e0e0e0\">");
        for t in ticks(y0, y1) {
            let _ =
                writeln!(o, "<line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\"/>", LEFT + pw, sy(t), sy(t));
        }
        for t in ticks(x0, x1) {
            let _ = writeln!(o, "<line y1=\"{TOP}\" y2=\"{:.1}\" x1=\"{:.1}\" x2=\"{:.1}\"/>", TOP + ph, sx(t), sx(t));
        }
        let _ = writeln!(o, "</g>");
        let _ = writeln!(
            o,
            "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#444\"/>"
        );
        for t in ticks(y0, y1) {
            let _ = writeln!(
                o,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                LEFT - 4.0,
                sy(t) + 4.0,
                label(t)
            );
        }
        for t in ticks(x0, x1) {
            let _ = writeln!(
                o,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                sx(t),
                TOP + ph + 14.0,
                label(t)
            );
        }
        let _ = writeln!(
            o,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            LEFT + pw / 2.0,
            H - 8.0,
            esc(&self.x_label)
        );
        let _ = writeln!(
            o,
            "<text transform=\"translate(14 {:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
            TOP + ph / 2.0,
            esc(&self.y_label)
        );
        for (v, name) in self.references.iter().filter(|r| r.0.abs() < 1e300) {
            let y = sy(*v);
            let _ = writeln!(
                o,
                "<line class=\"reference\" x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#777\" stroke-dasharray=\"4 3\"/>\n\
                 <text x=\"{:.1}\" y=\"{:.1}\" fill=\"#555\">{}</text>",
                LEFT + pw,
                LEFT + 4.0,
                y - 4.0,
                esc(name)
            );
        }
        // Series, then their legend on a veil (legible over the lines).
        let mut legend = String::new();
        let lx = LEFT + pw - 150.0;
        for (k, s) in self.series.iter().enumerate() {
            let c = COLOURS[k % COLOURS.len()];
            let shown: Vec<(f64, f64)> = s.points.iter().filter(finite).copied().collect();
            let shown = downsample(&shown, MAX_SERIES_POINTS);
            let line: Vec<String> = shown
                .iter()
                .map(|&(x, y)| (sx(x), sy(y)))
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .map(|(x, y)| format!("{x:.1},{y:.1}"))
                .collect();
            let dash = if s.dashed { " stroke-dasharray=\"5 3\"" } else { "" };
            let _ = writeln!(
                o,
                "<polyline class=\"series\" data-name=\"{}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\"{dash} points=\"{}\"/>",
                esc(&s.name),
                line.join(" ")
            );
            if s.dots {
                for &(x, y) in shown.iter().filter(|&&(x, y)| sx(x).is_finite() && sy(y).is_finite()) {
                    let _ = writeln!(o, "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2.5\" fill=\"{c}\"/>", sx(x), sy(y));
                }
            }
            let ly = TOP + 14.0 + 14.0 * k as f64;
            let _ = writeln!(
                legend,
                "<line x1=\"{lx:.1}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"{c}\" stroke-width=\"2\"{dash}/>\
                 <text x=\"{:.1}\" y=\"{ly:.1}\">{}</text>",
                lx + 18.0,
                ly - 4.0,
                ly - 4.0,
                lx + 22.0,
                esc(&s.name)
            );
        }
        if !self.series.is_empty() {
            let _ = writeln!(
                o,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"148\" height=\"{:.1}\" fill=\"white\" fill-opacity=\"0.8\"/>",
                lx - 4.0,
                TOP + 2.0,
                14.0 * self.series.len() as f64 + 4.0
            );
        }
        o.push_str(&legend);
        o.push_str("</svg>\n");
        o
    }
}

/// Grouped horizontal bars: one row per category, one bar per series in each row (e.g. the
/// estimated and the measured seconds of each op family).
#[derive(Clone, Debug, Default)]
pub struct BarChart {
    /// Title above the plot.
    pub title: String,
    /// The value axis' label.
    pub x_label: String,
    /// Row labels, top to bottom.
    pub categories: Vec<String>,
    /// Each series' name and its value per category (`None`: no bar).
    pub series: Vec<(String, Vec<Option<f64>>)>,
}

impl BarChart {
    /// The chart as an `<svg>` element; its height grows with the rows.
    pub fn svg(&self) -> String {
        let (label_w, bar, gap) = (190.0, 9.0, 7.0);
        let shown = |v: &Option<f64>| v.filter(|x| x.is_finite() && x.abs() < 1e300 && *x >= 0.0);
        let max = self.series.iter().flat_map(|s| s.1.iter().filter_map(shown)).fold(0.0, f64::max);
        let n = self.series.len().max(1) as f64;
        let row = n * bar + gap;
        let ph = (row * self.categories.len() as f64).max(row);
        // The legend has a line of its own under the title.
        let top = TOP + 14.0;
        let h = top + ph + BOTTOM;
        let mut o = open(h, &self.title);
        if max <= 0.0 {
            let _ = writeln!(
                o,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">no data</text>\n</svg>",
                W / 2.0,
                top + ph / 2.0
            );
            return o;
        }
        let t = ticks(0.0, max);
        let hi = t.last().copied().filter(|&x| x >= max).unwrap_or(max);
        let pw = W - label_w - RIGHT;
        let sx = |v: f64| label_w + v / hi * pw;
        let _ = writeln!(o, "<g stroke=\"#e0e0e0\">");
        for &v in &t {
            let _ = writeln!(o, "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{top}\" y2=\"{:.1}\"/>", sx(v), sx(v), top + ph);
        }
        let _ = writeln!(o, "</g>");
        for &v in &t {
            let _ = writeln!(
                o,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                sx(v),
                top + ph + 14.0,
                label(v)
            );
        }
        let _ = writeln!(
            o,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            label_w + pw / 2.0,
            h - 8.0,
            esc(&self.x_label)
        );
        for (i, c) in self.categories.iter().enumerate() {
            let y = top + row * i as f64 + gap / 2.0;
            // Long names keep their end, which tells families apart.
            let text: String = if c.chars().count() > 30 {
                "…".chars().chain(c.chars().skip(c.chars().count() - 29)).collect()
            } else {
                c.clone()
            };
            let _ = writeln!(
                o,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\"><title>{}</title>{}</text>",
                label_w - 6.0,
                y + n * bar / 2.0 + 4.0,
                esc(c),
                esc(&text)
            );
            for (k, (name, values)) in self.series.iter().enumerate() {
                let Some(v) = values.get(i).and_then(shown) else { continue };
                let colour = COLOURS[k % COLOURS.len()];
                let _ = writeln!(
                    o,
                    "<rect class=\"bar\" x=\"{label_w}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bar}\" fill=\"{colour}\">\
                     <title>{}, {}: {}</title></rect>",
                    y + bar * k as f64,
                    (sx(v) - label_w).max(0.5),
                    esc(c),
                    esc(name),
                    label(v)
                );
            }
        }
        let _ = writeln!(
            o,
            "<line x1=\"{label_w}\" x2=\"{label_w}\" y1=\"{top}\" y2=\"{:.1}\" stroke=\"#444\"/>",
            top + ph
        );
        // The legend on its line under the title, to the right.
        for (k, (name, _)) in self.series.iter().enumerate() {
            let colour = COLOURS[k % COLOURS.len()];
            let (lx, ly) = (W - RIGHT - 80.0 * (self.series.len() - k) as f64, top - 8.0);
            let _ = writeln!(
                o,
                "<rect x=\"{lx:.1}\" y=\"{:.1}\" width=\"12\" height=\"9\" fill=\"{colour}\"/>\
                 <text x=\"{:.1}\" y=\"{ly:.1}\">{}</text>",
                ly - 8.0,
                lx + 16.0,
                esc(name)
            );
        }
        o.push_str("</svg>\n");
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(2.31, 3.42);
        assert!(t.first().is_some_and(|&a| a >= 2.31) && t.last().is_some_and(|&b| b <= 3.42), "{t:?}");
        assert_eq!(ticks(1.0, 1.0), vec![1.0]);
    }

    #[test]
    fn a_chart_draws_each_series_and_skips_non_finite_points() {
        let c = LineChart {
            title: "loss <train>".into(),
            x_label: "step".into(),
            y_label: "nats".into(),
            series: vec![
                Series {
                    name: "train".into(),
                    points: vec![(1.0, 3.0), (2.0, f64::NAN), (2.5, 1e308), (3.0, 2.0)],
                    dots: false,
                    dashed: true,
                },
                Series { name: "eval".into(), points: vec![(3.0, 2.5)], dots: true, dashed: false },
            ],
            references: vec![(3.3, "unigram".into())],
        };
        let s = c.svg();
        assert_eq!(s.matches("<polyline").count(), 2);
        assert_eq!(s.matches("<circle").count(), 1);
        assert_eq!(s.matches("stroke-dasharray=\"5 3\"").count(), 2, "the dashed line and its legend entry");
        assert!(s.contains("loss &lt;train&gt;") && s.contains("class=\"reference\""));
        assert!(!s.contains("NaN"));
        let empty = LineChart { title: "t".into(), ..Default::default() }.svg();
        assert!(empty.contains("no data"));
    }

    #[test]
    fn a_bar_chart_draws_a_bar_per_present_value() {
        let c = BarChart {
            title: "time <per family>".into(),
            x_label: "ms".into(),
            categories: vec!["matmul".into(), "collective all-reduce".into(), "add".into()],
            series: vec![
                ("estimated".into(), vec![Some(2.0), Some(1.0), Some(0.5)]),
                ("measured".into(), vec![Some(3.0), None, Some(f64::NAN)]),
            ],
        };
        let s = c.svg();
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert_eq!(s.matches("class=\"bar\"").count(), 4);
        assert!(s.contains("time &lt;per family&gt;") && s.contains(">estimated</text>"));
        assert!(!s.contains("NaN"));
        let empty = BarChart { title: "t".into(), ..Default::default() }.svg();
        assert!(empty.contains("no data"));
    }
}
