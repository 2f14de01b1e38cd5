//! Layout conversion checked by execution and for optimality.
//!
//! - `conversions_execute_correctly`: on random meshes, shapes, specs (partial and multi-axis
//!   shards included) and integer-valued tensors, every step of the exact and the greedy path,
//!   executed with `sim::apply`, yields blocks that assemble to the original tensor under the step's
//!   spec, and the final blocks have the target's local shape.
//! - `colossal_auto_examples`: the worked examples of Colossal-Auto's layout table on 2-D meshes.
//! - `exact_is_never_beaten`: on 1,000 random (from, to) pairs on 2-D meshes, the exact path is never
//!   costlier than the greedy path nor than the cheapest path of at most 4 steps.

use std::cell::Cell;
use std::time::Instant;

use ir::Tensor;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sharding::collective::Collective;
use sharding::convert::{self, Conversion};
use sharding::mesh::Link;
use sharding::{DeviceMesh, LayoutConverter, Search, ShardingSpec, sim};

/// Bytes per element in every conversion here (f32).
const ELEM: usize = 4;

/// A spec from one choice per mesh axis (`0`: replicate, `1`: partial, `2 + d`: shard dim `d`) and
/// a key per axis ordering the axes that split one dim (smallest key outermost).
fn spec_from_choices(states: &[usize], keys: &[u32], rank: usize) -> ShardingSpec {
    let mut dims = vec![vec![]; rank];
    let mut order: Vec<usize> = (0..states.len()).collect();
    order.sort_by_key(|&a| (keys[a], a));
    for a in order {
        if states[a] >= 2 {
            dims[states[a] - 2].push(a);
        }
    }
    let partial = (0..states.len()).filter(|&a| states[a] == 1).collect();
    ShardingSpec::new(dims, partial)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

/// A random tensor of small integers (every sum the simulation forms is exact in f32).
fn int_tensor(shape: &[usize], lo: i32, hi: i32, rng: &mut StdRng) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(shape.to_vec(), (0..n).map(|_| rng.random_range(lo..=hi) as f32).collect())
}

fn add_assign(a: &mut Tensor, b: &Tensor, sign: f32) {
    let v: Vec<f32> = a.to_f32_vec().iter().zip(b.to_f32_vec()).map(|(x, y)| x + sign * y).collect();
    *a = Tensor::f32(a.shape().to_vec(), v);
}

/// One execution case: a mesh (axis sizes, and which axes have the slow link), a tensor shape, a
/// source and a target spec, and a data seed.
#[derive(Clone, Debug)]
struct Case {
    mesh: Vec<usize>,
    slow: Vec<bool>,
    shape: Vec<usize>,
    from: String,
    to: String,
    seed: u64,
}

/// A mesh whose axes have an inter-node link (slow) or an intra-node one, so that paths differ
/// from those on uniform meshes (e.g. staged gathers).
fn case_mesh(shape: &[usize], slow: &[bool]) -> DeviceMesh {
    let names = (0..shape.len()).map(|i| format!("m{i}")).collect();
    let links = slow.iter().map(|&s| if s { Link::new(20e-6, 25e9) } else { Link::new(10e-6, 450e9) }).collect();
    DeviceMesh::new(shape.to_vec(), names, links).unwrap()
}

/// Random cases. `mode`: 0 free, 1 source partial on some axis, 2 target partial on some axis,
/// 3 target equal to source. Every dim is the lcm of the source's and target's split sizes times 1
/// or 2, so both specs divide it.
fn cases() -> impl Strategy<Value = Case> {
    let mesh =
        prop::collection::vec(1usize..=4, 1..=3).prop_filter("at most 8 ranks", |m| m.iter().product::<usize>() <= 8);
    (mesh, 1usize..=4, 0u8..4)
        .prop_flat_map(|(mesh, rank, mode)| {
            let n = mesh.len();
            let states = || prop::collection::vec(0..rank + 2, n);
            let keys = || prop::collection::vec(any::<u32>(), n);
            (
                Just(mesh),
                Just(rank),
                Just(mode),
                (states(), keys(), states(), keys()),
                0..n,
                prop::collection::vec(1usize..=2, rank),
                prop::collection::vec(any::<bool>(), n),
                any::<u64>(),
            )
        })
        .prop_map(|(mesh_shape, rank, mode, (mut fs, fk, mut ts, tk), forced, factors, slow, seed)| {
            match mode {
                1 => fs[forced] = 1,
                2 => ts[forced] = 1,
                _ => {}
            }
            let from = spec_from_choices(&fs, &fk, rank);
            let to = if mode == 3 { from.clone() } else { spec_from_choices(&ts, &tk, rank) };
            let mesh = case_mesh(&mesh_shape, &slow);
            let shape = (0..rank)
                .map(|d| lcm(mesh.group_size(&from.dims()[d]), mesh.group_size(&to.dims()[d])) * factors[d])
                .collect();
            Case { mesh: mesh_shape, slow, shape, from: from.to_string(), to: to.to_string(), seed }
        })
}

/// Runs `path` on `blocks` step by step; after every step, each rank's block has the local shape of
/// the step's spec and the blocks assemble to `global` under it. Also checks the path's bookkeeping
/// (it starts at the source, ends at the target, step costs are the collectives' costs).
fn execute(path: &Conversion, mut blocks: Vec<Tensor>, global: &Tensor, mesh: &DeviceMesh) -> Result<(), String> {
    let shape = global.shape();
    let mut cur = path.from.clone();
    let mut total = 0.0;
    for (i, step) in path.steps.iter().enumerate() {
        let cost = step.collective.cost(cur.local_bytes(shape, mesh, ELEM), mesh);
        if cost != step.cost {
            return Err(format!("step {i} ({}) costs {} but its collective {cost}", step.collective, step.cost));
        }
        total += step.cost;
        blocks = sim::apply(&step.collective, &blocks, mesh).map_err(|e| format!("step {i}: {e}"))?;
        cur = step.after.clone();
        let local = cur.local_shape(shape, mesh);
        if let Some(r) = blocks.iter().position(|b| b.shape() != local.as_slice()) {
            return Err(format!(
                "after step {i} ({}) rank {r} holds {:?}, {cur} gives {local:?}",
                step.collective,
                blocks[r].shape()
            ));
        }
        let got = sim::assemble(&blocks, &cur, shape, mesh, 0.0)
            .map_err(|e| format!("after step {i} ({}): {e}", step.collective))?;
        if &got != global {
            return Err(format!("after step {i} ({}) the blocks under {cur} are not the tensor", step.collective));
        }
    }
    if cur != path.to {
        return Err(format!("the path ends at {cur}, not at {}", path.to));
    }
    if total != path.cost {
        return Err(format!("steps sum to {total}, the path says {}", path.cost));
    }
    let local = path.to.local_shape(shape, mesh);
    if blocks.iter().any(|b| b.shape() != local.as_slice()) {
        return Err(format!("final blocks are not of the target's local shape {local:?}"));
    }
    let got = sim::assemble(&blocks, &path.to, shape, mesh, 0.0).map_err(|e| e.to_string())?;
    if &got != global {
        return Err("the final blocks do not assemble to the tensor".into());
    }
    Ok(())
}

fn path_text(c: &Conversion) -> String {
    if c.steps.is_empty() {
        return "(no steps)".into();
    }
    c.steps.iter().map(|s| format!("{} -> {}", s.collective, s.after)).collect::<Vec<_>>().join("; ")
}

/// Checks acceptance item 1: for random meshes (1-3 axes of size 1-4, at most 8 ranks, fast or slow
/// links per axis), tensors of
/// rank 1-4 holding small integers, and valid source/target specs (multi-axis shards such as S01 or
/// S10 and partial axes included), distributing the tensor under the source (with the partial
/// groups' split perturbed), executing the exact path and the greedy converter's path step by step,
/// and assembling under the target gives back the tensor exactly, with every rank's block of the
/// target's local shape. Partial sources, partial targets and identical specs are each covered.
#[test]
fn conversions_execute_correctly() {
    let t0 = Instant::now();
    let config = Config { cases: 1024, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new(config);
    let (partial_from, partial_to, same, multi_axis, perturbed, steps) =
        (Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0), Cell::new(0));
    let result = runner.run(&cases(), |case| {
        let mesh = case_mesh(&case.mesh, &case.slow);
        let from: ShardingSpec = case.from.parse().unwrap();
        let to: ShardingSpec = case.to.parse().unwrap();
        from.check(&case.shape, &mesh).unwrap();
        to.check(&case.shape, &mesh).unwrap();
        let mut rng = StdRng::seed_from_u64(case.seed);
        let global = int_tensor(&case.shape, -8, 8, &mut rng);
        let mut blocks = sim::distribute(&global, &from, &mesh).unwrap();
        // Spread each partial group's value over two of its members.
        for group in mesh.groups(from.partial()) {
            if group.len() >= 2 {
                let i = rng.random_range(0..group.len());
                let j = (i + rng.random_range(1..group.len())) % group.len();
                let delta = int_tensor(blocks[group[i]].shape(), -4, 4, &mut rng);
                add_assign(&mut blocks[group[i]], &delta, 1.0);
                add_assign(&mut blocks[group[j]], &delta, -1.0);
                perturbed.set(perturbed.get() + 1);
            }
        }
        prop_assert_eq!(&sim::assemble(&blocks, &from, &case.shape, &mesh, 0.0).unwrap(), &global);

        let exact = convert::exact(&from, &to, &case.shape, ELEM, &mesh).unwrap();
        let greedy = LayoutConverter::new(mesh.clone(), Search::Greedy).convert(&case.shape, ELEM, &from, &to).unwrap();
        for (name, path) in [("exact", &exact), ("greedy", &*greedy)] {
            if let Err(why) = execute(path, blocks.clone(), &global, &mesh) {
                return Err(TestCaseError::fail(format!("{name} path [{}]: {why}", path_text(path))));
            }
        }
        prop_assert!(exact.cost <= greedy.cost * (1.0 + 1e-12), "exact {} > greedy {}", exact.cost, greedy.cost);
        if from == to {
            prop_assert!(exact.steps.is_empty() && greedy.steps.is_empty());
            same.set(same.get() + 1);
        }
        partial_from.set(partial_from.get() + usize::from(from.is_partial()));
        partial_to.set(partial_to.get() + usize::from(to.is_partial()));
        let multi = |s: &ShardingSpec| s.dims().iter().any(|d| d.len() >= 2);
        multi_axis.set(multi_axis.get() + usize::from(multi(&from) || multi(&to)));
        steps.set(steps.get() + exact.steps.len() + greedy.steps.len());
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    println!(
        "{} cases in {:.1?}: {} partial sources ({} partial groups perturbed), {} partial targets, {} identical, \
         {} with multi-axis shards, {} steps executed",
        runner.config().cases,
        t0.elapsed(),
        partial_from.get(),
        perturbed.get(),
        partial_to.get(),
        same.get(),
        multi_axis.get(),
        steps.get()
    );
    // Coverage (typical runs: about 530, 540, 350, 120 and 590).
    assert!(partial_from.get() >= 200 && partial_to.get() >= 200 && same.get() >= 150 && multi_axis.get() >= 50);
    assert!(perturbed.get() >= 200);
}

/// 2-D meshes of acceptance item 2: uniform 2x2, 2x4 and 4x2, and two meshes whose axes have
/// different links (a slow outer axis, and a slow inner axis).
fn meshes_2d() -> Vec<(&'static str, DeviceMesh)> {
    let slow = Link::new(20e-6, 25e9);
    let fast = Link::new(10e-6, 450e9);
    let names = || vec!["m0".to_string(), "m1".to_string()];
    vec![
        ("2x2", DeviceMesh::uniform(&[2, 2]).unwrap()),
        ("2x4", DeviceMesh::uniform(&[2, 4]).unwrap()),
        ("4x2", DeviceMesh::uniform(&[4, 2]).unwrap()),
        ("2x4 slow outer", DeviceMesh::new(vec![2, 4], names(), vec![slow.clone(), fast.clone()]).unwrap()),
        ("4x2 slow inner", DeviceMesh::new(vec![4, 2], names(), vec![fast, slow]).unwrap()),
    ]
}

/// Checks acceptance item 2(a): Colossal-Auto's worked examples on a 8x16x32 tensor take one step
/// each on every 2-D mesh (S01 R R -> R S01 R and S0 R R -> R S0 R one all-to-all, R S0 R -> R S01 R
/// a free slice), and the exact path is no costlier than the greedy one or any path of <= 4 steps.
#[test]
fn colossal_auto_examples() {
    let shape = [8, 16, 32];
    let examples =
        [("S01 R R", "R S01 R", "all-to-all"), ("S0 R R", "R S0 R", "all-to-all"), ("R S0 R", "R S01 R", "slice")];
    for (name, mesh) in meshes_2d() {
        for (a, b, kind) in examples {
            let (from, to): (ShardingSpec, ShardingSpec) = (a.parse().unwrap(), b.parse().unwrap());
            let e = convert::exact(&from, &to, &shape, ELEM, &mesh).unwrap();
            let g = convert::greedy(&from, &to, &shape, ELEM, &mesh).unwrap();
            let bf = convert::brute_force_cost(&from, &to, &shape, ELEM, &mesh, 4).unwrap();
            println!(
                "{name:>15}: {a} -> {b}: exact {:.3e} s [{}]; greedy {:.3e} s; brute force {bf:.3e} s",
                e.cost,
                path_text(&e),
                g.cost
            );
            assert_eq!(e.steps.len(), 1, "{a} -> {b} on {name}");
            assert_eq!(e.steps[0].collective.kind(), kind, "{a} -> {b} on {name}");
            assert!(e.cost <= g.cost * (1.0 + 1e-12) && e.cost <= bf * (1.0 + 1e-12));
        }
    }
    // The all-to-all of S01 R R -> R S01 R acts over both axes at once, in the shard order.
    let mesh = DeviceMesh::uniform(&[2, 4]).unwrap();
    let e = convert::exact(&"S01 R R".parse().unwrap(), &"R S01 R".parse().unwrap(), &shape, ELEM, &mesh).unwrap();
    assert_eq!(e.steps[0].collective, Collective::AllToAll { axes: vec![0, 1], split_dim: 1, concat_dim: 0 });
}

/// A random valid spec for a shape whose dims are multiples of 8 on a 2-D mesh of at most 8 ranks.
fn random_spec(rank: usize, ndim: usize, rng: &mut StdRng) -> ShardingSpec {
    let states: Vec<usize> = (0..ndim).map(|_| rng.random_range(0..rank + 2)).collect();
    let keys: Vec<u32> = (0..ndim).map(|_| rng.random_range(0..2)).collect();
    spec_from_choices(&states, &keys, rank)
}

/// Checks acceptance item 2(b): on 1,000 random (from, to) pairs (partial specs included) on the 2-D
/// meshes, tensors of rank 2-3 with dims from 8 to 4096 (costs from latency- to bandwidth-bound),
/// the exact path's cost is never above the greedy search's nor above the cheapest path of at most
/// 4 steps; when the exact path has at most 4 steps the two are equal. Prints how often greedy is
/// strictly worse.
#[test]
fn exact_is_never_beaten() {
    let t0 = Instant::now();
    let meshes = meshes_2d();
    let mut rng = StdRng::seed_from_u64(0x5eed_1a70);
    let sizes = [8, 16, 32, 64, 256, 1024, 4096];
    let (mut checked, mut greedy_worse, mut worst_ratio, mut partial_pairs, mut beyond_4) = (0, 0, 1.0f64, 0, 0);
    for i in 0..1000 {
        let (name, mesh) = &meshes[i % meshes.len()];
        let rank = rng.random_range(2..=3);
        let shape: Vec<usize> = (0..rank).map(|_| sizes[rng.random_range(0..sizes.len())]).collect();
        let from = random_spec(rank, 2, &mut rng);
        let to = if i % 50 == 0 { from.clone() } else { random_spec(rank, 2, &mut rng) };
        from.check(&shape, mesh).unwrap();
        to.check(&shape, mesh).unwrap();
        let e = convert::exact(&from, &to, &shape, ELEM, mesh).unwrap();
        let g = convert::greedy(&from, &to, &shape, ELEM, mesh).unwrap();
        let bf = convert::brute_force_cost(&from, &to, &shape, ELEM, mesh, 4);
        let ctx = || format!("{from} -> {to} on {name}, shape {shape:?}: exact {} [{}]", e.cost, path_text(&e));
        assert!(e.cost <= g.cost * (1.0 + 1e-12), "{}; greedy {} [{}]", ctx(), g.cost, path_text(&g));
        match bf {
            Some(bf) => {
                assert!(e.cost <= bf * (1.0 + 1e-12), "{}; brute force {bf}", ctx());
                if e.steps.len() <= 4 {
                    assert!(bf <= e.cost * (1.0 + 1e-12), "{}; brute force {bf}", ctx());
                }
            }
            None => {
                assert!(e.steps.len() > 4, "{}; brute force found no path of <= 4 steps", ctx());
                beyond_4 += 1;
            }
        }
        if g.cost > e.cost * (1.0 + 1e-12) {
            greedy_worse += 1;
            if e.cost > 0.0 {
                worst_ratio = worst_ratio.max(g.cost / e.cost);
            }
        }
        partial_pairs += usize::from(from.is_partial() || to.is_partial());
        checked += 1;
    }
    println!(
        "{checked} pairs checked in {:.1?} ({partial_pairs} with a partial spec, {beyond_4} needing more than 4 steps): \
         greedy strictly worse on {greedy_worse} (worst greedy/exact cost ratio {worst_ratio:.2})",
        t0.elapsed()
    );
    assert_eq!(checked, 1000);
}
