//! Line charts as standalone SVG (no script, no external resources), for the pages `autopar
//! explain` writes: training curves of a run log, and measurements against estimates.
//!
//! Invariants: the output is one `<svg>` element with a `viewBox`, every series one `<polyline>`
//! (with its legend entry), text escaped; non-finite points (and beyond ±1e300, where ranges
//! overflow) are left out, and a chart with no such point says so instead of drawing axes over
//! nothing.

use std::fmt::Write;

/// One line of a chart: `(x, y)` points in x order.
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// The points.
    pub points: Vec<(f64, f64)>,
    /// Draw a dot at every point (sparse series, such as evaluations).
    pub dots: bool,
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

impl LineChart {
    /// The chart as an `<svg>` element.
    pub fn svg(&self) -> String {
        // Beyond ±1e300 a range overflows: such points are left out as non-finite ones are.
        let finite = |p: &&(f64, f64)| p.0.abs() < 1e300 && p.1.abs() < 1e300;
        let pts: Vec<(f64, f64)> = self.series.iter().flat_map(|s| s.points.iter().filter(finite).copied()).collect();
        let mut o = String::new();
        let _ = writeln!(
            o,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {W} {H}\" width=\"{W}\" height=\"{H}\" \
             font-family=\"sans-serif\" font-size=\"11\" role=\"img\" aria-label=\"{}\">",
            esc(&self.title)
        );
        let _ = writeln!(o, "<rect width=\"{W}\" height=\"{H}\" fill=\"white\"/>");
        let _ = writeln!(
            o,
            "<text x=\"{:.1}\" y=\"18\" text-anchor=\"middle\" font-size=\"13\">{}</text>",
            W / 2.0,
            esc(&self.title)
        );
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
        if x1 <= x0 {
            (x0, x1) = (x0 - 1.0, x1 + 1.0);
        }
        if y1 <= y0 {
            (y0, y1) = (y0 - 1.0, y1 + 1.0);
        } else {
            let pad = (y1 - y0) * 0.05;
            (y0, y1) = (y0 - pad, y1 + pad);
        }
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
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#555\">{}</text>",
                LEFT + pw,
                LEFT + pw - 4.0,
                y - 4.0,
                esc(name)
            );
        }
        // Series and legend.
        for (k, s) in self.series.iter().enumerate() {
            let c = COLOURS[k % COLOURS.len()];
            let line: Vec<String> =
                s.points.iter().filter(finite).map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y))).collect();
            let _ = writeln!(
                o,
                "<polyline class=\"series\" data-name=\"{}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\" points=\"{}\"/>",
                esc(&s.name),
                line.join(" ")
            );
            if s.dots {
                for &(x, y) in s.points.iter().filter(finite) {
                    let _ = writeln!(o, "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2.5\" fill=\"{c}\"/>", sx(x), sy(y));
                }
            }
            let ly = TOP + 14.0 + 14.0 * k as f64;
            let lx = LEFT + pw - 150.0;
            let _ = writeln!(
                o,
                "<line x1=\"{lx:.1}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"{c}\" stroke-width=\"2\"/>\
                 <text x=\"{:.1}\" y=\"{ly:.1}\">{}</text>",
                lx + 18.0,
                ly - 4.0,
                ly - 4.0,
                lx + 22.0,
                esc(&s.name)
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
                },
                Series { name: "eval".into(), points: vec![(3.0, 2.5)], dots: true },
            ],
            references: vec![(3.3, "unigram".into())],
        };
        let s = c.svg();
        assert_eq!(s.matches("<polyline").count(), 2);
        assert_eq!(s.matches("<circle").count(), 1);
        assert!(s.contains("loss &lt;train&gt;") && s.contains("class=\"reference\""));
        assert!(!s.contains("NaN"));
        let empty = LineChart { title: "t".into(), ..Default::default() }.svg();
        assert!(empty.contains("no data"));
    }
}
