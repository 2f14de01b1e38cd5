//! Runs a plan for a few steps with ranks as threads, from seeded parameters and an all-zero
//! batch: `cargo run -p runtime --example run_plan -- PLAN.json [STEPS]`.
use std::collections::BTreeMap;

use runtime::launch::{Event, Init, Job, RunOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: run_plan PLAN.json [STEPS]")?;
    let steps: u64 = args.next().map_or(Ok(3), |s| s.parse())?;
    let plan = plan::Valid::from_json(&std::fs::read_to_string(&path)?)?;
    let program = runtime::Program::from_valid(&plan, ir::DType::F32)?;
    let feeds: BTreeMap<String, ir::Tensor> = program
        .inputs
        .iter()
        .map(|i| Ok((i.name.clone(), ir::Tensor::zeros(&i.meta)?)))
        .collect::<Result<_, ir::AllocError>>()?;
    let opts = RunOptions { until_step: steps, ..Default::default() };
    let job = Job { program, feeds, init: Init::Seed { seed: 0 }, opts, gather: true };
    let done = runtime::launch::threads(&job, &mut |e| {
        match e {
            Event::Started { how, source, .. } => println!("{} ranks {how}; {source}", job.program.ranks()),
            Event::Step(r) => println!("step {} loss {:.6} ({:.1} ms)", r.step, r.loss, r.seconds * 1e3),
            Event::Warning(w) => eprintln!("warning: {w}"),
        }
        Ok(())
    })?;
    println!("trained {} parameters", done.params.map_or(0, |p| p.len()));
    Ok(())
}
