//! Figures of a plan for its HTML page (SVG, no script): the memory held over the step, the time
//! per op family, and the mesh with the layout of the largest parameters; estimates beside what a
//! run measured when a profile is given (`autopar run --profile-ops`).
//!
//! Invariants: the estimates drawn are the plan's own: the memory is the liveness walk behind
//! its peak ([`crate::memory::trace_steps`]), the times are its instructions' seconds, and an op
//! family is what [`family`] names (the text comparison of `autopar explain --measured` groups by
//! the same function). Every figure is one `<svg>` element with escaped text.

use std::collections::BTreeMap;
use std::fmt::Write;

use ir::{NodeIndex, Op};

use crate::svg::{BarChart, LineChart, Series};
use ::plan::{Instr, ParamShard, Plan};

/// What a run of the plan measured, per rank and per instruction.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    /// Each rank and the bytes it held after each instruction it ran, in the order run.
    pub memory: Vec<(usize, Vec<u64>)>,
    /// Per program instruction: the mean, over the ranks that ran it, of their seconds per step
    /// (summed over microbatches); `None` when no rank ran it.
    pub seconds: Vec<Option<f64>>,
}

/// An instruction's family: its op, or its collective's kind, `transfer` or `free`.
pub fn family(i: &Instr) -> String {
    match i {
        Instr::Op { op, .. } => op.name().to_string(),
        Instr::Collective { collective, .. } => format!("collective {}", collective.kind()),
        Instr::Transfer { .. } => "transfer".to_string(),
        Instr::Free { .. } => "free".to_string(),
    }
}

/// An instruction's estimated seconds per step: its seconds times the microbatches that run it
/// (the update phase runs once).
pub fn step_seconds(p: &Plan, i: &Instr) -> f64 {
    let once = match i {
        Instr::Op { seconds, .. } | Instr::Collective { seconds, .. } | Instr::Transfer { seconds, .. } => *seconds,
        Instr::Free { .. } => 0.0,
    };
    if i.once_per_step() { once } else { once * p.microbatches.max(1) as f64 }
}

/// One op family's instructions and their seconds per step.
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyTime {
    /// The family ([`family`]).
    pub family: String,
    /// Its instructions in the program (with a measurement: those measured).
    pub instructions: usize,
    /// Their estimated seconds per step ([`step_seconds`]).
    pub estimated: f64,
    /// Their measured seconds per step, when measured.
    pub measured: Option<f64>,
}

/// The program's time per op family, the costliest first (by the measurement when given, else
/// by the estimate). With measurements, instructions no rank ran are left out of both sides.
pub fn families(p: &Plan, measured: Option<&[Option<f64>]>) -> Vec<FamilyTime> {
    let mut by: BTreeMap<String, FamilyTime> = BTreeMap::new();
    for (k, i) in p.program.iter().enumerate() {
        let m = match measured {
            Some(m) => match m.get(k).copied().flatten() {
                Some(x) => Some(x),
                None => continue,
            },
            None => None,
        };
        let f = family(i);
        let e =
            by.entry(f.clone()).or_insert(FamilyTime { family: f, instructions: 0, estimated: 0.0, measured: None });
        e.instructions += 1;
        e.estimated += step_seconds(p, i);
        if let Some(m) = m {
            e.measured = Some(e.measured.unwrap_or(0.0) + m);
        }
    }
    let mut v: Vec<FamilyTime> = by.into_values().collect();
    v.sort_by(|a, b| b.measured.unwrap_or(b.estimated).total_cmp(&a.measured.unwrap_or(a.estimated)));
    v
}

/// Time per op family as grouped bars (milliseconds per step): estimated, and measured when
/// given. The costliest `rows` families are drawn; the rest are summed into one row.
pub fn families_chart(p: &Plan, measured: Option<&Measured>, rows: usize) -> BarChart {
    let fams: Vec<FamilyTime> = families(p, measured.map(|m| m.seconds.as_slice()))
        .into_iter()
        .filter(|f| f.estimated > 0.0 || f.measured.is_some_and(|m| m > 0.0))
        .collect();
    let mut categories = vec![];
    let (mut est, mut meas) = (vec![], vec![]);
    for (i, f) in fams.iter().enumerate() {
        if i < rows || fams.len() == rows + 1 {
            categories.push(format!("{} (x{})", f.family, f.instructions));
            est.push(Some(f.estimated * 1e3));
            meas.push(f.measured.map(|m| m * 1e3));
        } else {
            let rest = &fams[rows..];
            categories.push(format!("{} other families", rest.len()));
            est.push(Some(rest.iter().map(|f| f.estimated).sum::<f64>() * 1e3));
            meas.push(measured.map(|_| rest.iter().filter_map(|f| f.measured).sum::<f64>() * 1e3));
            break;
        }
    }
    let mut series = vec![("estimated".to_string(), est)];
    if measured.is_some() {
        series.push(("measured".to_string(), meas));
    }
    BarChart {
        title: if measured.is_some() {
            "Time per op family: estimated and measured".into()
        } else {
            "Time per op family (estimated)".into()
        },
        x_label: "ms per step (summed over the family's instructions and the microbatches)".into(),
        categories,
        series,
    }
}

/// A unit for byte counts up to `max`: its name and its size.
fn byte_unit(max: u64) -> (&'static str, f64) {
    if max >= 1 << 30 {
        ("GiB", (1u64 << 30) as f64)
    } else if max >= 1 << 20 {
        ("MiB", (1u64 << 20) as f64)
    } else {
        ("KiB", 1024.0)
    }
}

/// `ranks 0-3`, `ranks 0, 2` or `rank 1`.
fn ranks_text(r: &[usize]) -> String {
    match r {
        [one] => format!("rank {one}"),
        [a, .., b] if r.windows(2).all(|w| w[1] == w[0] + 1) => format!("ranks {a}-{b}"),
        _ => format!("ranks {}", r.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

/// Memory over the step: the bytes one rank holds after each instruction it runs, by the plan's
/// liveness walk (one line per pipeline stage; without stages every rank holds the same) and, when
/// given, as measured (one line per group of ranks that measured the same), with the estimated
/// peak as a reference line. A stage whose walk fails is left out (the plan's verifier says why).
pub fn memory_chart(p: &Plan, measured: Option<&Measured>) -> LineChart {
    let stages = p.stages();
    let estimated: Vec<(String, Vec<u64>)> = match p.device_mesh() {
        Ok(mesh) => (0..stages)
            .filter_map(|s| {
                let t = crate::memory::trace_steps(p, &mesh, s).ok()?;
                let name = if stages > 1 { format!("estimated, stage {s}") } else { "estimated (every rank)".into() };
                Some((name, t.into_iter().map(|x| x.1).collect()))
            })
            .collect(),
        Err(_) => vec![],
    };
    // Ranks that measured the same bytes share a line (grouped through a hash map: linear in the
    // ranks, however many).
    let mut groups: Vec<(Vec<usize>, &Vec<u64>)> = vec![];
    let mut group_of: std::collections::HashMap<&Vec<u64>, usize> = std::collections::HashMap::new();
    for (rank, bytes) in measured.map_or(&[][..], |m| &m.memory[..]) {
        match group_of.get(bytes) {
            Some(&g) => groups[g].0.push(*rank),
            None => {
                group_of.insert(bytes, groups.len());
                groups.push((vec![*rank], bytes));
            }
        }
    }
    // Past a few lines a chart is unreadable and a page huge: the largest groups are drawn, the
    // rest summed up in the title.
    groups.sort_by_key(|g| std::cmp::Reverse(g.0.len()));
    let hidden: usize = groups.iter().skip(MAX_MEASURED_LINES).map(|g| g.0.len()).sum();
    groups.truncate(MAX_MEASURED_LINES);
    // Measurements dashed, over the estimates they may coincide with.
    let lines: Vec<(String, &Vec<u64>, bool)> = estimated
        .iter()
        .map(|(n, b)| (n.clone(), b, false))
        .chain(groups.iter().map(|(r, b)| (format!("measured, {}", ranks_text(r)), *b, true)))
        .collect();
    let max = lines.iter().flat_map(|l| l.1.iter().copied()).chain([p.estimate.peak_bytes_per_rank]).max();
    let (unit, size) = byte_unit(max.unwrap_or(0));
    LineChart {
        title: if measured.is_some() && hidden > 0 {
            format!("Memory over the step per rank: estimated and measured ({hidden} more ranks not drawn)")
        } else if measured.is_some() {
            "Memory over the step per rank: estimated and measured".into()
        } else {
            "Memory over the step per rank (estimated)".into()
        },
        x_label: "instructions run, in order".into(),
        y_label: format!("{unit} held"),
        series: lines
            .into_iter()
            .map(|(name, b, dashed)| Series {
                name,
                points: envelope(b).into_iter().map(|(i, x)| (i as f64, x as f64 / size)).collect(),
                dots: false,
                dashed,
            })
            .collect(),
        references: vec![(p.estimate.peak_bytes_per_rank as f64 / size, "estimated peak".into())],
    }
}

/// Most measured lines a memory chart draws (groups of ranks that measured the same bytes).
const MAX_MEASURED_LINES: usize = 16;

/// Most points a memory line keeps: a long program (many stages and microbatches) is drawn by
/// each bucket's lowest and highest value, in order, so the page stays small and every peak shows.
const MAX_POINTS: usize = 4000;

/// `bytes` by instruction index, reduced to [`MAX_POINTS`] (see there).
fn envelope(bytes: &[u64]) -> Vec<(usize, u64)> {
    if bytes.len() <= MAX_POINTS {
        return bytes.iter().copied().enumerate().collect();
    }
    let bucket = bytes.len().div_ceil(MAX_POINTS / 2);
    let mut out = Vec::with_capacity(MAX_POINTS);
    for (k, chunk) in bytes.chunks(bucket).enumerate() {
        let at = |j: usize| (k * bucket + j, chunk[j]);
        let lo = (0..chunk.len()).min_by_key(|&j| chunk[j]).unwrap_or(0);
        let hi = (0..chunk.len()).max_by_key(|&j| chunk[j]).unwrap_or(0);
        out.push(at(lo.min(hi)));
        if lo != hi {
            out.push(at(lo.max(hi)));
        }
    }
    out
}

/// Fills of blocks (by block index); a replicated tensor is grey, as in the page's tables.
const BLOCK: [&str; 8] = ["#9dc3e6", "#f4b183", "#a9d18e", "#ffd966", "#c5a3d9", "#8fd3cf", "#f7a1a1", "#b4c7e7"];
const REPLICATED: &str = "#dddddd";

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The plan's parameters (not optimizer state), the largest first.
fn largest_params(p: &Plan, n: usize) -> Vec<&ParamShard> {
    let is_param = |x: &&ParamShard| {
        p.graph.g.node_weight(NodeIndex::new(x.node)).is_none_or(|n| matches!(n.op, Op::Param { .. }))
    };
    let mut v: Vec<&ParamShard> = p.params.iter().filter(is_param).collect();
    v.sort_by(|a, b| {
        let size = |x: &ParamShard| x.shape.iter().product::<usize>();
        size(b).cmp(&size(a)).then_with(|| a.name.cmp(&b.name))
    });
    v.truncate(n);
    v
}

/// Where the mesh's devices are drawn: the last axis across, the one before down, and the
/// outer axes (if any) as grids side by side.
struct Grid {
    shape: Vec<usize>,
    rows: usize,
    cols: usize,
    outer: usize,
}

const CW: f64 = 46.0;
const CH: f64 = 30.0;
const GAP: f64 = 18.0;

impl Grid {
    fn new(shape: &[usize]) -> Grid {
        let n = shape.len();
        Grid {
            shape: shape.to_vec(),
            rows: if n >= 2 { shape[n - 2] } else { 1 },
            cols: shape.last().copied().unwrap_or(1),
            outer: shape[..n.saturating_sub(2)].iter().product(),
        }
    }
    fn width(&self) -> f64 {
        self.outer as f64 * (self.cols as f64 * CW) + (self.outer - 1) as f64 * GAP
    }
    fn height(&self) -> f64 {
        self.rows as f64 * CH
    }
    /// The outer grid's coordinates (outer axes, outermost first).
    fn outer_coords(&self, o: usize) -> Vec<usize> {
        let outer_axes = &self.shape[..self.shape.len().saturating_sub(2)];
        let mut c = vec![0; outer_axes.len()];
        let mut r = o;
        for a in (0..outer_axes.len()).rev() {
            c[a] = r % outer_axes[a];
            r /= outer_axes[a];
        }
        c
    }
    /// Every device: its rank and the top-left corner of its cell (relative to the grids' own).
    fn cells(&self) -> Vec<(usize, f64, f64)> {
        let mut v = vec![];
        for o in 0..self.outer {
            let x0 = o as f64 * (self.cols as f64 * CW + GAP);
            for r in 0..self.rows {
                for c in 0..self.cols {
                    let rank = (o * self.rows + r) * self.cols + c;
                    v.push((rank, x0 + c as f64 * CW, r as f64 * CH));
                }
            }
        }
        v
    }
}

/// How many blocks a parameter's drawing stacks down (dim 0's) and across (the other dims'; a
/// vector's across).
fn block_grid(x: &ParamShard) -> (usize, usize) {
    let counts: Vec<usize> = x.shape.iter().zip(&x.local_shape).map(|(&s, &l)| s.checked_div(l).unwrap_or(1)).collect();
    match counts.len() {
        0 => (1, 1),
        1 => (1, counts[0]),
        _ => (counts[0], counts[1..].iter().product()),
    }
}

/// Which block of `x` each rank holds: per dim, the block index along it, or `None` where the
/// rank's pipeline stage does not hold the parameter.
fn blocks_of(p: &Plan, x: &ParamShard, ranks: usize) -> Vec<Option<Vec<usize>>> {
    let mesh = p.device_mesh().ok();
    (0..ranks)
        .map(|r| {
            if p.stages() > 1 && p.stage_of(r) != x.stage {
                return None;
            }
            let offsets = match x.offsets.get(r) {
                Some(o) if x.offsets.len() == ranks => o.clone(),
                _ => x.spec.offsets(&x.shape, mesh.as_ref()?, r),
            };
            Some(offsets.iter().zip(&x.local_shape).map(|(&o, &l)| o.checked_div(l).unwrap_or(0)).collect())
        })
        .collect()
}

/// The mesh with the layout of the `n` largest parameters: a first panel of the devices (rank
/// and pipeline stage, axes named with their sizes), then one row per parameter: the devices
/// again, each showing the block of the tensor it holds (`R`: the whole tensor; `–`: another
/// stage holds it), and the tensor split into its blocks in the same colours, each naming the
/// ranks that hold it.
pub fn mesh_svg(p: &Plan, n: usize) -> String {
    let f = MeshFigure::new(p);
    let params = largest_params(p, n);
    let (left, g) = (f.left, &f.g);
    let width = (left + g.width() + 40.0 + f.tensor_w + 20.0).max(640.0);
    let outer_label = f.outer_label;
    // The panels' heights, as they are drawn below: a title line, the outer grids' labels, the
    // grids (or the tensor and its label, if taller) and a gap.
    let height = 38.0
        + (16.0 + outer_label + g.height() + 26.0)
        + params.iter().map(|x| 16.0 + outer_label + f.body_h(x) + 26.0).sum::<f64>();
    let mut o = String::new();
    let _ = writeln!(
        o,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {width} {height}\" width=\"{width}\" height=\"{height}\" \
         font-family=\"sans-serif\" font-size=\"11\" role=\"img\" aria-label=\"the mesh and the layout of the largest parameters\">"
    );
    let _ = writeln!(o, "<rect width=\"{width}\" height=\"{height}\" fill=\"white\"/>");
    let sizes: Vec<String> = f.shape.iter().map(|s| s.to_string()).collect();
    let names: Vec<String> = (0..f.nd).map(|a| f.name(a)).collect();
    let _ = writeln!(
        o,
        "<text x=\"{:.1}\" y=\"18\" text-anchor=\"middle\" font-size=\"13\">Mesh {} ({}) and the layout of the {} largest parameters</text>",
        width / 2.0,
        sizes.join("x"),
        esc(&names.join(" x ")),
        params.len()
    );
    let mut y = f.devices(&mut o, 34.0);
    // One row per parameter.
    for x in &params {
        y = f.param_row(&mut o, y, x);
    }
    o.push_str("</svg>\n");
    o
}

/// What [`mesh_svg`] draws with: the plan's mesh laid out as grids, and the panels' geometry.
struct MeshFigure<'a> {
    p: &'a Plan,
    shape: Vec<usize>,
    ranks: usize,
    g: Grid,
    nd: usize,
    staged: bool,
    left: f64,
    tensor_w: f64,
    /// The height of the outer grids' labels (none with one grid).
    outer_label: f64,
}

impl<'a> MeshFigure<'a> {
    fn new(p: &'a Plan) -> MeshFigure<'a> {
        let shape = if p.mesh.shape.is_empty() { vec![1] } else { p.mesh.shape.clone() };
        let ranks: usize = shape.iter().product();
        let g = Grid::new(&shape);
        let nd = shape.len();
        let staged = p.stages() > 1;
        let outer_label = if g.outer > 1 { 16.0 } else { 0.0 };
        MeshFigure { p, shape, ranks, g, nd, staged, left: 30.0, tensor_w: 180.0, outer_label }
    }

    fn name(&self, a: usize) -> String {
        self.p.mesh.names.get(a).cloned().unwrap_or_else(|| format!("m{a}"))
    }

    /// The tensor is at least 46 px high, and 16 px per row of blocks (legible labels).
    fn tensor_h(&self, x: &ParamShard) -> f64 {
        (self.g.height().max(60.0) - 14.0).max(16.0 * block_grid(x).0 as f64)
    }

    /// A parameter row's height below its title: the grids or the tensor and its label.
    fn body_h(&self, x: &ParamShard) -> f64 {
        self.g.height().max(self.tensor_h(x) + 14.0)
    }

    /// Draws the grids at `y` (below the outer grids' labels), each cell through `cell`.
    fn grids(&self, o: &mut String, y: f64, cell: &dyn Fn(usize) -> (String, &'static str, bool)) {
        let (g, left) = (&self.g, self.left);
        let name = |a: usize| self.name(a);
        for ob in 0..g.outer {
            if g.outer > 1 {
                let c = g.outer_coords(ob);
                let label: Vec<String> = c.iter().enumerate().map(|(a, v)| format!("{}={v}", name(a))).collect();
                let _ = writeln!(
                    o,
                    "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" fill=\"#555\">{}</text>",
                    left + ob as f64 * (g.cols as f64 * CW + GAP),
                    y - 4.0,
                    esc(&label.join(" "))
                );
            }
        }
        for (rank, cx, cy) in g.cells() {
            let (text, fill, held) = cell(rank);
            let dash = if held { "" } else { " stroke-dasharray=\"3 2\"" };
            let _ = writeln!(
                o,
                "<g class=\"device\" data-rank=\"{rank}\"><title>rank {rank}</title><rect x=\"{:.1}\" y=\"{:.1}\" width=\"{}\" height=\"{}\" \
                 fill=\"{fill}\" stroke=\"#555\"{dash}/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text></g>",
                left + cx,
                y + cy,
                CW - 2.0,
                CH - 2.0,
                left + cx + CW / 2.0 - 1.0,
                y + cy + CH / 2.0 + 3.0,
                text
            );
        }
    }

    /// The first panel: the devices (rank and pipeline stage, axes named with their sizes),
    /// from `y`; returns the next panel's `y`.
    fn devices(&self, o: &mut String, mut y: f64) -> f64 {
        let (p, g, left, nd, staged, outer_label) =
            (self.p, &self.g, self.left, self.nd, self.staged, self.outer_label);
        let (shape, name) = (&self.shape, |a: usize| self.name(a));
        // The devices.
        let _ = writeln!(
            o,
            "<text x=\"{left}\" y=\"{:.1}\" font-weight=\"bold\">devices{}</text>",
            y + 4.0,
            if staged { format!(" ({} pipeline stages along {})", p.stages(), esc(&name(0))) } else { String::new() }
        );
        y += 16.0 + outer_label;
        let _ = writeln!(
            o,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" fill=\"#555\">{} ({}) →</text>",
            left + g.width() + 8.0,
            y + 10.0,
            esc(&name(nd - 1)),
            shape[nd - 1]
        );
        if nd >= 2 {
            let _ = writeln!(
                o,
                "<text transform=\"translate({:.1} {:.1}) rotate(-90)\" text-anchor=\"middle\" font-size=\"10\" fill=\"#555\">{} ({}) ↓</text>",
                left - 8.0,
                y + g.height() / 2.0,
                esc(&name(nd - 2)),
                shape[nd - 2]
            );
        }
        let device = |r: usize| {
            let t = if staged { format!("{r} · s{}", p.stage_of(r)) } else { r.to_string() };
            (t, "#f2f2f2", true)
        };
        self.grids(o, y, &device);
        y += g.height() + 26.0;
        y
    }

    /// One parameter's row from `y`: its title, the devices each showing the block they hold,
    /// and the tensor split into its blocks; returns the next row's `y`.
    fn param_row(&self, o: &mut String, mut y: f64, x: &ParamShard) -> f64 {
        let (p, left, staged, outer_label, ranks) = (self.p, self.left, self.staged, self.outer_label, self.ranks);
        let name = |a: usize| self.name(a);
        let blocks = blocks_of(p, x, ranks);
        let counts: Vec<usize> =
            x.shape.iter().zip(&x.local_shape).map(|(&s, &l)| s.checked_div(l).unwrap_or(1)).collect();
        let split: Vec<usize> = (0..counts.len()).filter(|&d| counts[d] > 1).collect();
        // Block index in mixed radix over the dims, dim 0 outermost.
        let linear = |b: &[usize]| b.iter().zip(&counts).fold(0, |acc, (&i, &c)| acc * c + i);
        let fill = |b: &[usize]| if split.is_empty() { REPLICATED } else { BLOCK[linear(b) % BLOCK.len()] };
        let how: Vec<String> = x
            .spec
            .dims()
            .iter()
            .enumerate()
            .filter(|(_, a)| !a.is_empty())
            .map(|(d, axes)| {
                let over: Vec<String> = axes.iter().map(|&a| name(a)).collect();
                format!("dim {d} over {}", over.join("×"))
            })
            .collect();
        let _ = writeln!(
            o,
            "<text x=\"{left}\" y=\"{:.1}\"><tspan font-weight=\"bold\">{}</tspan> \
             <tspan font-size=\"10\" fill=\"#333\">{:?} {}: {}; blocks of {:?}{}</tspan></text>",
            y + 4.0,
            esc(&x.name),
            x.shape,
            esc(&x.spec.to_string()),
            if how.is_empty() { "replicated".to_string() } else { esc(&how.join(", ")) },
            x.local_shape,
            if staged { format!(" (stage {})", x.stage) } else { String::new() }
        );
        y += 16.0 + outer_label;
        let cell = |r: usize| match &blocks[r] {
            None => ("–".to_string(), "#ffffff", false),
            Some(_) if split.is_empty() => ("R".to_string(), REPLICATED, true),
            Some(b) => {
                let idx: Vec<String> = split.iter().map(|&d| b[d].to_string()).collect();
                (idx.join(","), fill(b), true)
            }
        };
        self.grids(o, y, &cell);
        self.tensor(o, y, x, &blocks, &counts, &split);
        y + self.body_h(x) + 26.0
    }

    /// The tensor `x` at `y` right of the grids, split into its blocks (`counts` per dim, of
    /// which `split` are split) in the grids' colours, each naming the ranks holding it
    /// (`blocks`: which block each rank holds).
    fn tensor(
        &self,
        o: &mut String,
        y: f64,
        x: &ParamShard,
        blocks: &[Option<Vec<usize>>],
        counts: &[usize],
        split: &[usize],
    ) {
        let (g, left, tensor_w) = (&self.g, self.left, self.tensor_w);
        let tensor_h = |x: &ParamShard| self.tensor_h(x);
        let linear = |b: &[usize]| b.iter().zip(counts).fold(0, |acc, (&i, &c)| acc * c + i);
        let fill = |b: &[usize]| if split.is_empty() { REPLICATED } else { BLOCK[linear(b) % BLOCK.len()] };
        // The tensor, split into its blocks: dim 0 down, the other dims across (a vector across).
        let (brows, bcols) = block_grid(x);
        let (tx, th) = (left + g.width() + 40.0, tensor_h(x));
        let (bw, bh) = (tensor_w / bcols as f64, th / brows as f64);
        let mut holders: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (r, b) in blocks.iter().enumerate() {
            if let Some(b) = b {
                holders.entry(linear(b)).or_default().push(r);
            }
        }
        for k in 0..brows * bcols {
            let (br, bc) = (k / bcols, k % bcols);
            // The block's index per dim from its linear index.
            let mut b = vec![0; counts.len()];
            let mut rest = k;
            for d in (0..counts.len()).rev() {
                b[d] = rest % counts[d];
                rest /= counts[d];
            }
            let who = holders.get(&k).map_or(String::new(), |r| ranks_text(r));
            let _ = writeln!(
                o,
                "<g class=\"block\"><title>block {:?}: {}</title><rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\" stroke=\"#555\"/>",
                b,
                if who.is_empty() { "held by no rank".to_string() } else { format!("held by {who}") },
                tx + bc as f64 * bw,
                y + br as f64 * bh,
                bw,
                bh,
                fill(&b)
            );
            let short = holders.get(&k).map_or(String::new(), |r| {
                if split.is_empty() {
                    "every rank".into()
                } else {
                    r.iter().map(|x| format!("r{x}")).collect::<Vec<_>>().join(" ")
                }
            });
            if 6.5 * short.len() as f64 <= bw - 4.0 && bh >= 12.0 {
                let _ = write!(
                    o,
                    "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"10\">{short}</text>",
                    tx + bc as f64 * bw + bw / 2.0,
                    y + br as f64 * bh + bh / 2.0 + 3.0
                );
            }
            o.push_str("</g>\n");
        }
        let axes_text = match x.shape.len() {
            0 => "a scalar".to_string(),
            1 => "dim 0 →".to_string(),
            2 => "dim 0 ↓, dim 1 →".to_string(),
            k => format!("dim 0 ↓, dims 1-{} →", k - 1),
        };
        let _ = writeln!(
            o,
            "<text x=\"{tx:.1}\" y=\"{:.1}\" font-size=\"10\" fill=\"#555\">the tensor: {axes_text}; each block names the ranks holding it</text>",
            y + th + 12.0
        );
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{Baseline, PlanOptions};
    use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
    use ir::{DType, Graph, TensorMeta};
    use sharding::{DeviceMesh, DeviceProfile};

    /// A long memory line keeps at most MAX_POINTS points, in order, with its lowest and highest.
    #[test]
    fn long_memory_lines_keep_their_extremes() {
        let bytes: Vec<u64> =
            (0..100_000u64).map(|i| (i * 7919) % 1000 + if i == 54_321 { 10_000 } else { 0 }).collect();
        let e = envelope(&bytes);
        assert!(e.len() <= MAX_POINTS && e.len() > MAX_POINTS / 2, "{}", e.len());
        assert!(e.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(e.contains(&(54_321, bytes[54_321])));
        assert_eq!(e.iter().map(|x| x.1).min(), bytes.iter().copied().min());
        assert_eq!(envelope(&bytes[..10]).len(), 10);
    }

    /// A two-layer MLP's training step planned on `shape`, in `stages` pipeline stages.
    pub(crate) fn planned(shape: &[usize], baseline: Baseline, stages: usize) -> Plan {
        let f32s = |s: &[usize]| TensorMeta::new(DType::F32, s.to_vec());
        let mut g = Graph::new("mlp");
        let x = g.input("x", f32s(&[8, 16]));
        let w1 = g.param("w1", f32s(&[16, 64]), None);
        let w2 = g.param("w2", f32s(&[64, 32]), None);
        let h = g.add1("mm1", Op::MatMul, &[x, w1]).unwrap();
        let h = g.add1("relu", Op::Unary(ir::UnaryOp::Relu), &[h]).unwrap();
        let y = g.add1("mm2", Op::MatMul, &[h, w2]).unwrap();
        g.set_output("y", y);
        let loss: LossSpec = "mse:y:t".parse().unwrap();
        let tg = training_graph(&g, &TrainOptions::new(loss, Some(Optimizer::adamw(1e-3)))).unwrap();
        let cpu = DeviceProfile::builtin("cpu").unwrap();
        let names = (0..shape.len()).map(|a| format!("m{a}")).collect();
        let mesh = DeviceMesh::with_profile(shape.to_vec(), names, &cpu).unwrap();
        let opts = PlanOptions {
            budget: 1 << 30,
            baseline,
            threads: 1,
            time_limit: std::time::Duration::from_secs(2),
            stages,
            microbatches: stages,
            ..PlanOptions::default()
        };
        crate::plan(&tg.graph, &mesh, &cpu, &opts).unwrap()
    }

    fn well_formed(svg: &str) {
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
        assert_eq!(svg.matches("<svg").count(), 1);
        assert_eq!(svg.matches("<g").count(), svg.matches("</g>").count(), "unbalanced groups");
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
    }

    #[test]
    fn memory_is_the_liveness_walk_one_line_per_stage_and_measured_ranks_grouped() {
        let p = planned(&[2, 4], Baseline::Megatron, 1);
        let c = memory_chart(&p, None);
        assert_eq!(c.series.len(), 1, "SPMD: one estimated line for every rank");
        assert!(c.series[0].name.contains("every rank"));
        let mesh = p.device_mesh().unwrap();
        let peak = crate::memory::simulate_steps(&p, &mesh, 0).unwrap().peak;
        let (_, size) = byte_unit(peak);
        let top = c.series[0].points.iter().map(|q| q.1).fold(0.0, f64::max);
        assert_eq!((top * size).round() as u64, peak, "the line's top is the walk's peak");
        assert_eq!(c.references.len(), 1);
        // Four ranks measured the same bytes, one other: two dashed lines.
        let bytes: Vec<u64> = crate::memory::trace_steps(&p, &mesh, 0).unwrap().iter().map(|t| t.1).collect();
        let mut memory: Vec<(usize, Vec<u64>)> = (0..4).map(|r| (r, bytes.clone())).collect();
        memory.push((4, bytes.iter().map(|b| b + 1024).collect()));
        let m = Measured { memory, seconds: vec![None; p.program.len()] };
        let c = memory_chart(&p, Some(&m));
        let names: Vec<&str> = c.series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["estimated (every rank)", "measured, ranks 0-3", "measured, rank 4"]);
        assert_eq!(c.series.iter().filter(|s| s.dashed).count(), 2);
        well_formed(&c.svg());
        let staged = planned(&[2, 2], Baseline::Auto, 2);
        let c = memory_chart(&staged, None);
        let names: Vec<&str> = c.series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["estimated, stage 0", "estimated, stage 1"]);
        // 200,000 ranks that each measured other bytes: grouped in linear time (they were compared
        // pairwise), and a bounded number of lines drawn.
        let memory: Vec<(usize, Vec<u64>)> = (0..200_000).map(|r| (r, vec![r as u64, 7])).collect();
        let m = Measured { memory, seconds: vec![None; p.program.len()] };
        let t0 = std::time::Instant::now();
        let c = memory_chart(&p, Some(&m));
        assert!(t0.elapsed().as_secs_f64() < 5.0, "grouping took {:?}", t0.elapsed());
        assert_eq!(c.series.iter().filter(|s| s.dashed).count(), MAX_MEASURED_LINES);
        assert!(c.title.contains("199984 more ranks not drawn"), "{}", c.title);
    }

    #[test]
    fn families_sum_the_program_and_put_measurements_beside() {
        let p = planned(&[2, 4], Baseline::Dp, 1);
        let fams = families(&p, None);
        let total: f64 = p.program.iter().map(|i| step_seconds(&p, i)).sum();
        assert!((fams.iter().map(|f| f.estimated).sum::<f64>() - total).abs() <= 1e-12 * total.max(1.0));
        assert_eq!(fams.iter().map(|f| f.instructions).sum::<usize>(), p.program.len());
        assert!(fams.iter().any(|f| f.family == "matmul") && fams.iter().any(|f| f.family == "collective all-reduce"));
        assert!(fams.windows(2).all(|w| w[0].estimated >= w[1].estimated), "costliest first");
        let c = families_chart(&p, None, 3);
        assert_eq!(c.series.len(), 1);
        assert_eq!(c.categories.len(), 4, "three families and the rest");
        let svg = c.svg();
        well_formed(&svg);
        assert_eq!(svg.matches("class=\"bar\"").count(), 4);
        // Measured: every instruction 1 ms, but the first unmeasured (left out of both sides).
        let mut seconds = vec![Some(1e-3); p.program.len()];
        seconds[0] = None;
        let m = Measured { memory: vec![], seconds };
        let fams = families(&p, Some(&m.seconds));
        assert_eq!(fams.iter().map(|f| f.instructions).sum::<usize>(), p.program.len() - 1);
        let c = families_chart(&p, Some(&m), 100);
        assert_eq!(c.series.len(), 2);
        assert_eq!(c.svg().matches("class=\"bar\"").count(), 2 * c.categories.len());
    }

    #[test]
    fn the_mesh_shows_each_devices_block_of_the_largest_parameters() {
        // 2x4, Megatron: w1 split by columns, w2 by rows over the tensor axis.
        let p = planned(&[2, 4], Baseline::Megatron, 1);
        let svg = mesh_svg(&p, 4);
        well_formed(&svg);
        assert!(svg.contains("Mesh 2x4 (m0 x m1)") && svg.contains("m1 (4) →") && svg.contains("m0 (2) ↓"));
        // Two parameters (optimizer state left out): a devices panel and a row each.
        assert_eq!(svg.matches("class=\"device\"").count(), 3 * 8);
        assert!(svg.contains(">w1</tspan>") && svg.contains(">w2</tspan>") && !svg.contains("exp_avg"));
        let w1 = p.params.iter().find(|x| x.name == "w1").unwrap();
        let blocks = blocks_of(&p, w1, 8);
        let split = w1.shape.iter().zip(&w1.local_shape).filter(|(s, l)| s != l).count();
        assert_eq!(split, 1, "{}", w1.spec);
        // Each of the 4 blocks held by the 2 ranks of an m0 column.
        let distinct: std::collections::BTreeSet<_> = blocks.iter().flatten().collect();
        assert_eq!(distinct.len(), 4);
        assert_eq!(svg.matches("class=\"block\"").count(), 8);
        assert!(svg.contains(">r0 r4</text>"), "block 0 names ranks 0 and 4");
        // 2x2x2: the outer axis as two grids, each labelled.
        let p = planned(&[2, 2, 2], Baseline::Dp, 1);
        let svg = mesh_svg(&p, 4);
        well_formed(&svg);
        assert!(svg.contains(">m0=0</text>") && svg.contains(">m0=1</text>"));
        assert!(svg.contains(">R</text>") && svg.contains(">every rank</text>"), "dp replicates the parameters");
        // Pipeline stages: the other stage's devices hold nothing.
        let p = planned(&[2, 2], Baseline::Auto, 2);
        let svg = mesh_svg(&p, 4);
        well_formed(&svg);
        assert!(svg.contains("2 pipeline stages along m0") && svg.contains(">–</text>"));
    }
}
