//! `Pad` beyond what [`ir::Op::Pad`] does (a constant fill on non-negative pads): negative pads
//! (crops) and the modes `edge`, `reflect` and `wrap`, rewritten per padded axis into `Slice`s
//! (edge: an `Expand` of the edge slice) joined by a `Concat`, so kernels, gradients and sharding
//! come from those ops.
//!
//! Negative pads crop first (one `Slice`); the remaining pads then fill in the mode. Limits, as
//! errors naming the node: `reflect` needs each pad smaller than its axis (after cropping), `wrap`
//! and `edge` each pad at most / an axis of at least one element. numpy, whose `pad` is ONNX's
//! reference, repeats a reflection or wrap that is longer than the axis; exports do not produce
//! that, and autopar does not rewrite it.

use super::{Importer, V};
use ir::{Op, SliceAxis};

impl Importer<'_> {
    /// `x` padded by `pads` (the begins then the ends, one per dim of `x`; negative crops) in
    /// ONNX `mode` (`constant` with fill `value`, `edge`, `reflect`, `wrap`), as ops named after
    /// `nm`.
    pub(super) fn pad_modes(&mut self, nm: &str, x: V, mode: &str, pads: &[i64], value: f32) -> Result<V, String> {
        if !matches!(mode, "constant" | "edge" | "reflect" | "wrap") {
            return Err(format!("mode={mode} is not supported (constant, edge, reflect, wrap are)"));
        }
        let shape = self.meta(&x).shape;
        let r = shape.len();
        if pads.len() != 2 * r {
            return Err(format!("{} pads for rank {r}", pads.len()));
        }
        // Crop first: one Slice over every axis with a negative pad.
        let mut crops = Vec::new();
        for (a, &n) in shape.iter().enumerate() {
            let (lo, hi) = (pads[a].min(0).unsigned_abs(), pads[a + r].min(0).unsigned_abs());
            if lo == 0 && hi == 0 {
                continue;
            }
            let cut = usize::try_from(lo.saturating_add(hi)).unwrap_or(usize::MAX);
            let len = n.checked_sub(cut).ok_or_else(|| {
                format!("pads {} and {} crop more than axis {a}'s {n} elements", pads[a], pads[a + r])
            })?;
            crops.push(SliceAxis { axis: a, start: lo as i64, len, step: 1 });
        }
        let mut cur =
            if crops.is_empty() { x } else { self.emit1(&format!("{nm}.crop"), Op::Slice { axes: crops }, &[x])? };
        let grow: Vec<usize> = pads.iter().map(|&p| p.max(0) as usize).collect();
        if grow.iter().all(|&p| p == 0) {
            return Ok(cur);
        }
        if mode == "constant" {
            return self.emit1(nm, Op::Pad { pads: grow, value }, &[cur]);
        }
        for a in 0..r {
            let (lo, hi) = (grow[a], grow[a + r]);
            if lo == 0 && hi == 0 {
                continue;
            }
            let shape = self.meta(&cur).shape;
            let n = shape[a];
            let fits = match mode {
                "reflect" => lo < n && hi < n,
                "wrap" => lo <= n && hi <= n,
                _ => n > 0,
            };
            if !fits {
                return Err(format!(
                    "mode={mode}: pads {lo} and {hi} do not fit axis {a} of {n} elements (a {mode} pad longer \
                     than its axis is not supported)"
                ));
            }
            // (first index, count, step) of the slices placed before and after the axis.
            let (before, after) = match mode {
                "edge" => ((0, 1, 1), (n as i64 - 1, 1, 1)),
                "reflect" => ((lo as i64, lo, -1), (n as i64 - 2, hi, -1)),
                _ => (((n - lo) as i64, lo, 1), (0, hi, 1)),
            };
            let mut parts = Vec::new();
            for (side, (start, len, step), want) in [("lo", before, lo), ("hi", after, hi)] {
                if want == 0 {
                    continue;
                }
                let name = format!("{nm}.{a}.{side}");
                let axes = vec![SliceAxis { axis: a, start, len, step }];
                let mut part = self.emit1(&name, Op::Slice { axes }, &[cur.clone()])?;
                if mode == "edge" && want > 1 {
                    let mut to = shape.clone();
                    to[a] = want;
                    part = self.emit1(&format!("{name}.expand"), Op::Expand { shape: to }, &[part])?;
                }
                parts.push((side, part));
            }
            let mut ins: Vec<V> = parts.iter().filter(|(s, _)| *s == "lo").map(|(_, p)| p.clone()).collect();
            ins.push(cur);
            ins.extend(parts.iter().filter(|(s, _)| *s == "hi").map(|(_, p)| p.clone()));
            let last = (a + 1..r).all(|b| grow[b] == 0 && grow[b + r] == 0);
            let name = if last { nm.to_string() } else { format!("{nm}.{a}") };
            cur = self.emit1(&name, Op::Concat { axis: a }, &ins)?;
        }
        Ok(cur)
    }
}
