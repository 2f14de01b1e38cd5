//! Routed experts and their gradient ([`ir::Op::Moe`], [`ir::Op::MoeGrad`]; the semantics are
//! in `ir::ops::moe`), dropless: token by token, the router's softmax, its top-k (ties to the
//! lower expert), then each chosen expert's MLP on that token's row.
//!
//! Everything runs on the calling thread in one fixed order (tokens ascending, then the chosen
//! experts in rank order, then the hidden and inner dims), so the results are the same bits on
//! every run, and weight gradients are summed over tokens in that order. The gradient
//! recomputes the routing and each expert's hidden row from the inputs.

use super::{F, Float, floats, tensor};
use crate::Error;
use ir::{MoeAct, MoeAttrs, MoeDims, Tensor};

/// The inputs of a MoE op as slices: x, the router, w1, w3 (SwiGLU only), w2.
struct Inputs<'a> {
    x: &'a [F],
    wr: &'a [F],
    w1: &'a [F],
    w3: Option<&'a [F]>,
    w2: &'a [F],
}

fn inputs<'a>(op: &'static str, a: &MoeAttrs, ins: &[&'a Tensor]) -> Result<(MoeDims, Inputs<'a>), Error> {
    let metas: Vec<_> = ins.iter().map(|t| t.meta()).collect();
    let d = a.check(op, &metas).map_err(|message| Error::BadInput { op, message })?;
    let k = a.num_inputs();
    let w3 = if a.act == MoeAct::Swiglu { Some(floats(op, ins[3])?) } else { None };
    let i = Inputs {
        x: floats(op, ins[0])?,
        wr: floats(op, ins[1])?,
        w1: floats(op, ins[2])?,
        w3,
        w2: floats(op, ins[k - 1])?,
    };
    Ok((d, i))
}

/// One token's routing: the router probabilities `[E]`, the chosen experts (in rank order)
/// and their weights.
struct Route {
    p: Vec<F>,
    chosen: Vec<usize>,
    g: Vec<F>,
}

fn route(a: &MoeAttrs, d: &MoeDims, x: &[F], wr: &[F]) -> Route {
    let e = d.experts;
    let mut z = vec![0.0 as F; e];
    for (h, &xh) in x.iter().enumerate() {
        for (zi, &w) in z.iter_mut().zip(&wr[h * e..(h + 1) * e]) {
            *zi += xh * w;
        }
    }
    let max = z.iter().fold(F::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0 as F;
    for v in z.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    z.iter_mut().for_each(|v| *v /= sum);
    let mut taken = vec![false; e];
    let mut chosen = Vec::with_capacity(a.top_k);
    for _ in 0..a.top_k {
        let mut best: Option<usize> = None;
        for i in 0..e {
            if !taken[i] && best.is_none_or(|b| z[i] > z[b]) {
                best = Some(i);
            }
        }
        let b = best.expect("top_k <= experts");
        taken[b] = true;
        chosen.push(b);
    }
    let mut g: Vec<F> = chosen.iter().map(|&i| z[i]).collect();
    if a.normalize {
        let s: F = g.iter().sum();
        g.iter_mut().for_each(|v| *v /= s);
    }
    Route { p: z, chosen, g }
}

/// Expert `e`'s hidden rows for token `x`: `x W1[e]` and (SwiGLU) `x W3[e]`.
fn hidden(d: &MoeDims, i: &Inputs, e: usize, x: &[F]) -> (Vec<F>, Vec<F>) {
    let (hd, f) = (d.hidden, d.ffn);
    let proj = |w: &[F]| {
        let w = &w[e * hd * f..(e + 1) * hd * f];
        let mut out = vec![0.0 as F; f];
        for (h, &xh) in x.iter().enumerate() {
            for (o, &wv) in out.iter_mut().zip(&w[h * f..(h + 1) * f]) {
                *o += xh * wv;
            }
        }
        out
    };
    let h1 = proj(i.w1);
    let h3 = i.w3.map(proj).unwrap_or_default();
    (h1, h3)
}

fn sigmoid(v: F) -> F {
    1.0 / (1.0 + (-v).exp())
}

/// The standard normal's CDF and density at `v` (exact GELU is `v Φ(v)`).
fn phi(v: F) -> (F, F) {
    let cdf = 0.5 * (1.0 + Float::erf(v * super::consts::FRAC_1_SQRT_2));
    let pdf = (-0.5 * v * v).exp() * (0.5 * super::consts::FRAC_2_SQRT_PI * super::consts::FRAC_1_SQRT_2);
    (cdf, pdf)
}

/// The activation row from the hidden rows.
fn activate(act: MoeAct, h1: &[F], h3: &[F]) -> Vec<F> {
    match act {
        MoeAct::Swiglu => h1.iter().zip(h3).map(|(&u, &v)| u * sigmoid(u) * v).collect(),
        MoeAct::Gelu => h1.iter().map(|&u| u * phi(u).0).collect(),
    }
}

/// `y += g · act W2[e]` (the expert's output row scaled by its weight); returns the unscaled
/// row `act W2[e]`.
fn down(d: &MoeDims, w2: &[F], e: usize, act: &[F]) -> Vec<F> {
    let (hd, f) = (d.hidden, d.ffn);
    let w = &w2[e * f * hd..(e + 1) * f * hd];
    let mut o = vec![0.0 as F; hd];
    for (fi, &av) in act.iter().enumerate() {
        for (ov, &wv) in o.iter_mut().zip(&w[fi * hd..(fi + 1) * hd]) {
            *ov += av * wv;
        }
    }
    o
}

/// The auxiliary loss's per-expert factor `E · count_e / T`, and the loss `Σ_e factor_e P_e`.
fn aux(d: &MoeDims, routes: &[Route]) -> (Vec<F>, F) {
    let (e, t) = (d.experts, d.tokens);
    if t == 0 {
        return (vec![0.0; e], 0.0);
    }
    let mut count = vec![0.0 as F; e];
    let mut mean = vec![0.0 as F; e];
    for r in routes {
        r.chosen.iter().for_each(|&c| count[c] += 1.0);
        mean.iter_mut().zip(&r.p).for_each(|(m, &p)| *m += p);
    }
    let factor: Vec<F> = count.iter().map(|&c| e as F * c / t as F).collect();
    let loss = factor.iter().zip(&mean).map(|(&f, &m)| f * m / t as F).sum();
    (factor, loss)
}

/// [`ir::Op::Moe`]: outputs y and the auxiliary loss.
pub(crate) fn moe(a: &MoeAttrs, ins: &[&Tensor]) -> Result<Vec<Tensor>, Error> {
    let op = "moe";
    let (d, i) = inputs(op, a, ins)?;
    let hd = d.hidden;
    let mut y = vec![0.0 as F; d.tokens * hd];
    let mut routes = Vec::with_capacity(d.tokens);
    for t in 0..d.tokens {
        let x = &i.x[t * hd..(t + 1) * hd];
        let r = route(a, &d, x, i.wr);
        let yt = &mut y[t * hd..(t + 1) * hd];
        for (&e, &g) in r.chosen.iter().zip(&r.g) {
            let (h1, h3) = hidden(&d, &i, e, x);
            let o = down(&d, i.w2, e, &activate(a.act, &h1, &h3));
            yt.iter_mut().zip(&o).for_each(|(yv, &ov)| *yv += g * ov);
        }
        routes.push(r);
    }
    let (_, loss) = aux(&d, &routes);
    Ok(vec![tensor(op, ins[0].shape(), F::data(y))?, tensor(op, &[], F::data(vec![loss]))?])
}

/// The gradients [`moe_grad`] accumulates, in the forward inputs' layouts.
struct Grads {
    dx: Vec<F>,
    dwr: Vec<F>,
    dw1: Vec<F>,
    dw3: Vec<F>,
    dw2: Vec<F>,
}

/// One chosen expert's backward for token `x` with output gradient `dy` and weight `g`:
/// accumulates into `gr` (dx into `dx`) and returns the gradient of the weight `g`.
#[allow(clippy::too_many_arguments)]
fn expert_grad(
    a: &MoeAttrs,
    d: &MoeDims,
    i: &Inputs,
    e: usize,
    x: &[F],
    dy: &[F],
    g: F,
    gr: &mut Grads,
    dx: &mut [F],
) -> F {
    let (hd, f) = (d.hidden, d.ffn);
    let (h1, h3) = hidden(d, i, e, x);
    let act = activate(a.act, &h1, &h3);
    let o = down(d, i.w2, e, &act);
    let dg: F = o.iter().zip(dy).map(|(&ov, &dv)| ov * dv).sum();
    // do = g dy; dW2[e] += act^T do; dact = W2[e] do.
    let w2 = &i.w2[e * f * hd..(e + 1) * f * hd];
    let dw2 = &mut gr.dw2[e * f * hd..(e + 1) * f * hd];
    let mut dact = vec![0.0 as F; f];
    for fi in 0..f {
        let (wrow, drow) = (&w2[fi * hd..(fi + 1) * hd], &mut dw2[fi * hd..(fi + 1) * hd]);
        let mut s = 0.0 as F;
        for hh in 0..hd {
            let dov = g * dy[hh];
            drow[hh] += act[fi] * dov;
            s += wrow[hh] * dov;
        }
        dact[fi] = s;
    }
    let (dh1, dh3): (Vec<F>, Vec<F>) = match a.act {
        MoeAct::Swiglu => (0..f)
            .map(|fi| {
                let (u, v) = (h1[fi], h3[fi]);
                let s = sigmoid(u);
                (dact[fi] * v * s * (1.0 + u * (1.0 - s)), dact[fi] * u * s)
            })
            .unzip(),
        MoeAct::Gelu => (
            h1.iter()
                .zip(&dact)
                .map(|(&u, &da)| {
                    let (cdf, pdf) = phi(u);
                    da * (cdf + u * pdf)
                })
                .collect(),
            Vec::new(),
        ),
    };
    // dW1[e] += x^T dh1, dx += W1[e] dh1 (and W3 likewise).
    let mut back = |w: &[F], dw: &mut [F], dh: &[F]| {
        let (w, dw) = (&w[e * hd * f..(e + 1) * hd * f], &mut dw[e * hd * f..(e + 1) * hd * f]);
        for h in 0..hd {
            let (wrow, drow) = (&w[h * f..(h + 1) * f], &mut dw[h * f..(h + 1) * f]);
            let mut s = 0.0 as F;
            for fi in 0..f {
                drow[fi] += x[h] * dh[fi];
                s += wrow[fi] * dh[fi];
            }
            dx[h] += s;
        }
    };
    back(i.w1, &mut gr.dw1, &dh1);
    if let Some(w3) = i.w3 {
        back(w3, &mut gr.dw3, &dh3);
    }
    dg
}

/// The router's backward for one token: from the chosen weights' gradients `dg` and the
/// auxiliary loss's per-expert factor scaled by `daux / T`, the logits' gradient, then
/// `dWr += x^T dz` and `dx += Wr dz`.
#[allow(clippy::too_many_arguments)]
fn router_grad(
    a: &MoeAttrs,
    d: &MoeDims,
    r: &Route,
    dg: &[F],
    aux: &[F],
    x: &[F],
    wr: &[F],
    dwr: &mut [F],
    dx: &mut [F],
) {
    let e = d.experts;
    let mut dp: Vec<F> = aux.to_vec();
    if a.normalize {
        // g_j = p_j / s: dp_j = (dg_j - Σ_k dg_k g_k) / s.
        let s: F = r.chosen.iter().map(|&c| r.p[c]).sum();
        let dot: F = dg.iter().zip(&r.g).map(|(&a, &b)| a * b).sum();
        for (&c, &dgj) in r.chosen.iter().zip(dg) {
            dp[c] += (dgj - dot) / s;
        }
    } else {
        r.chosen.iter().zip(dg).for_each(|(&c, &dgj)| dp[c] += dgj);
    }
    let dot: F = dp.iter().zip(&r.p).map(|(&a, &b)| a * b).sum();
    let dz: Vec<F> = r.p.iter().zip(&dp).map(|(&p, &g)| p * (g - dot)).collect();
    for h in 0..d.hidden {
        let (wrow, drow) = (&wr[h * e..(h + 1) * e], &mut dwr[h * e..(h + 1) * e]);
        let mut s = 0.0 as F;
        for k in 0..e {
            drow[k] += x[h] * dz[k];
            s += wrow[k] * dz[k];
        }
        dx[h] += s;
    }
}

/// [`ir::Op::MoeGrad`]: inputs the forward's, dy and daux; outputs dx, the router's gradient
/// and the experts' (w1, w3 for SwiGLU, w2).
pub(crate) fn moe_grad(a: &MoeAttrs, ins: &[&Tensor]) -> Result<Vec<Tensor>, Error> {
    let op = "moe_grad";
    let (d, i) = inputs(op, a, ins)?;
    let k = a.num_inputs();
    let (dy, daux) = (floats(op, ins[k])?, floats(op, ins[k + 1])?);
    let daux = daux.first().copied().unwrap_or(0.0);
    let (hd, e, f) = (d.hidden, d.experts, d.ffn);
    let routes: Vec<Route> = (0..d.tokens).map(|t| route(a, &d, &i.x[t * hd..(t + 1) * hd], i.wr)).collect();
    let (factor, _) = aux(&d, &routes);
    // d aux / d p_te = factor_e / T.
    let per = if d.tokens == 0 { 0.0 } else { daux / d.tokens as F };
    let aux_dp: Vec<F> = factor.iter().map(|&v| v * per).collect();
    let mut gr = Grads {
        dx: vec![0.0; d.tokens * hd],
        dwr: vec![0.0; hd * e],
        dw1: vec![0.0; e * hd * f],
        dw3: vec![0.0; if i.w3.is_some() { e * hd * f } else { 0 }],
        dw2: vec![0.0; e * f * hd],
    };
    let mut dxt = vec![0.0 as F; hd];
    for (t, r) in routes.iter().enumerate() {
        let x = &i.x[t * hd..(t + 1) * hd];
        let dyt = &dy[t * hd..(t + 1) * hd];
        dxt.iter_mut().for_each(|v| *v = 0.0);
        let dg: Vec<F> =
            r.chosen.iter().zip(&r.g).map(|(&c, &g)| expert_grad(a, &d, &i, c, x, dyt, g, &mut gr, &mut dxt)).collect();
        router_grad(a, &d, r, &dg, &aux_dp, x, i.wr, &mut gr.dwr, &mut dxt);
        gr.dx[t * hd..(t + 1) * hd].copy_from_slice(&dxt);
    }
    let mut out = vec![
        tensor(op, ins[0].shape(), F::data(gr.dx))?,
        tensor(op, ins[1].shape(), F::data(gr.dwr))?,
        tensor(op, ins[2].shape(), F::data(gr.dw1))?,
    ];
    if i.w3.is_some() {
        out.push(tensor(op, ins[3].shape(), F::data(gr.dw3))?);
    }
    out.push(tensor(op, ins[k - 1].shape(), F::data(gr.dw2))?);
    Ok(out)
}
