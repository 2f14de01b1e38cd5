//! Layout-conversion and strategy-generation speed: `cargo bench -p sharding --bench layout`.
//!
//! Prints, for a 3-D tensor on 2x4 and 2x2x2 meshes, how many valid specs exist, the time to find
//! the exact (Dijkstra) and greedy paths between every pair, how often greedy is costlier and by
//! how much on average, and the time to generate the strategies of a matmul.

use std::time::Instant;

use ir::{DType, Op, TensorMeta};
use sharding::convert::{exact, greedy};
use sharding::{DeviceMesh, DeviceProfile, OpContext, ShardingSpec, expand};

/// Every valid spec of `shape` on `mesh` (each axis: replicate, partial, or appended to a dim).
fn all_specs(shape: &[usize], mesh: &DeviceMesh) -> Vec<ShardingSpec> {
    let mut out = vec![ShardingSpec::replicated(shape.len())];
    for a in 0..mesh.ndim() {
        let mut next = vec![];
        for s in &out {
            next.push(s.clone());
            let mut p = s.partial().to_vec();
            p.push(a);
            next.push(s.clone().with_partial(p));
            for d in 0..shape.len() {
                for pos in 0..=s.dims()[d].len() {
                    let mut axes = s.dims()[d].clone();
                    axes.insert(pos, a);
                    next.push(s.clone().with_dim(d, axes));
                }
            }
        }
        out = next;
    }
    out.retain(|s| s.check(shape, mesh).is_ok());
    out.sort();
    out.dedup();
    out
}

fn main() {
    let profile = DeviceProfile::builtin("h100-sxm").expect("built-in profile");
    let shape = [8, 16, 32];
    for dims in [vec![2, 4], vec![2, 2, 2]] {
        let names = (0..dims.len()).map(|i| format!("m{i}")).collect();
        let mesh = DeviceMesh::with_profile(dims.clone(), names, &profile).expect("mesh");
        let specs = all_specs(&shape, &mesh);
        let (mut te, mut tg, mut worse, mut ratio, mut pairs) = (0.0, 0.0, 0, 0.0, 0);
        for a in &specs {
            for b in &specs {
                let t = Instant::now();
                let e = exact(a, b, &shape, 4, &mesh).expect("exact");
                te += t.elapsed().as_secs_f64();
                let t = Instant::now();
                let g = greedy(a, b, &shape, 4, &mesh).expect("greedy");
                tg += t.elapsed().as_secs_f64();
                pairs += 1;
                if g.cost > e.cost * (1.0 + 1e-9) {
                    worse += 1;
                    ratio += g.cost / e.cost.max(1e-30);
                }
            }
        }
        println!(
            "mesh {mesh}, f32{shape:?}: {} specs, {pairs} pairs; exact {:.1} us/pair, greedy {:.1} us/pair; greedy costlier on {worse} pairs ({:.1}%), by {:.2}x on average there",
            specs.len(),
            te / pairs as f64 * 1e6,
            tg / pairs as f64 * 1e6,
            100.0 * worse as f64 / pairs as f64,
            if worse > 0 { ratio / worse as f64 } else { 1.0 }
        );
        let f = |s: &[usize]| TensorMeta::new(DType::F32, s.to_vec());
        let t = Instant::now();
        let n = expand(
            &Op::MatMul,
            &[f(&[8, 128, 768]), f(&[768, 3072])],
            &[f(&[8, 128, 3072])],
            &OpContext::default(),
            &mesh,
            &profile,
        )
        .expect("matmul rule")
        .len();
        println!("mesh {mesh}: {n} matmul strategies generated in {:.1} us", t.elapsed().as_secs_f64() * 1e6);
    }
}
