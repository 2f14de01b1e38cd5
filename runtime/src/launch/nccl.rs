//! The `nccl` launcher: one process per GPU, collectives through NCCL.

use super::{
    Event, Finished, Job, LaunchError, NcclOptions, OnEvent, announce, check_fault, check_start, init, run_reporting,
};
use crate::comm::Communicator;
use crate::gpu::{GpuRank, NcclGroups};

/// This process's rank and the world size (see [`NcclOptions::rank_world`]).
fn rank_and_world(o: &NcclOptions) -> Result<(usize, usize), LaunchError> {
    if let Some(rw) = o.rank_world {
        return Ok(rw);
    }
    for (rank, size) in [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")] {
        if let (Ok(r), Ok(w)) = (std::env::var(rank), std::env::var(size)) {
            let parse = |name: &str, v: &str| {
                v.trim().parse::<usize>().map_err(|e| LaunchError::Setup(format!("{name}={v}: {e}")))
            };
            return Ok((parse(rank, &r)?, parse(size, &w)?));
        }
    }
    Ok((0, 1))
}

/// Runs this process's rank of `job` on its GPU, collectives through NCCL; the events are
/// heard on rank 0. A failure returns this rank's error (NCCL has no abort: under mpirun the
/// process's exit ends the job). `model_hash` names the id directory (see
/// [`NcclOptions::dir`]).
pub fn nccl(job: &mut Job, model_hash: &str, o: &NcclOptions, on: &mut OnEvent<'_>) -> Result<Finished, LaunchError> {
    let (rank, world) = rank_and_world(o)?;
    if world == 0 || rank >= world {
        return Err(LaunchError::Setup(format!("--backend nccl: rank {rank} of a world of {world}")));
    }
    // Errors keep their kind (the CLI's hints depend on it); set-up messages gain the rank, the
    // others name it already.
    run(job, model_hash, o, rank, world, on).map_err(|e| match e {
        LaunchError::Setup(m) if world > 1 => LaunchError::Setup(format!("rank {rank}: {m}")),
        e => e,
    })
}

fn run(
    job: &mut Job,
    model_hash: &str,
    o: &NcclOptions,
    rank: usize,
    world: usize,
    on: &mut OnEvent<'_>,
) -> Result<Finished, LaunchError> {
    let setup = |e: kernels::Error| LaunchError::Setup(e.to_string());
    if job.program.ranks() != world {
        return Err(LaunchError::Setup(format!(
            "the plan is for {} ranks but this is rank {rank} of {world}; run with mpirun -np {}",
            job.program.ranks(),
            job.program.ranks()
        )));
    }
    if let Some(why) = job.program.needs_buffered_sends() {
        return Err(LaunchError::Setup(format!("cuda: {why}")));
    }
    let gpu = match o.gpu {
        Some(g) => g,
        None => rank % kernels::cuda::device_count().map_err(setup)?.max(1),
    };
    let ctx = kernels::cuda::CudaContext::new(gpu).map_err(setup)?;
    let hash: String = model_hash.chars().filter(char::is_ascii_alphanumeric).take(16).collect();
    // One id directory per job: the launcher's job id when there is one, so that the ranks of a
    // job meet and concurrent jobs of the same plan do not.
    let launcher_job = ["PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"]
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .map(|j| format!("-{}", j.replace(|c: char| !c.is_ascii_alphanumeric(), "_")))
        .unwrap_or_default();
    let dir = o
        .dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("autopar-nccl-{hash}-{world}{launcher_job}")));
    let reports = rank == 0;
    let mut warnings = vec![];
    let (mut states, source) =
        init::states(&job.init, &job.program, &job.feeds, job.opts.data.as_deref(), &[rank], &mut |w| {
            warnings.push(w)
        })?;
    let host = crate::cpu::Cpu::new(job.opts.threads_per_rank)
        .map_err(|e| LaunchError::Setup(e.to_string()))?
        .with_accumulation(job.opts.accumulation);
    let groups = NcclGroups::new(rank, world, dir, job.opts.timeout);
    let mut st = GpuRank::new(ctx, groups, host, states.remove(0))?;
    let start = st.steps_done;
    check_start(start, &job.opts)?;
    check_fault(&job.opts, world, start)?;
    // The run id (names temporary checkpoint directories) is rank 0's.
    let id = std::sync::Arc::new(ir::Tensor::i64(vec![1], vec![std::process::id() as i64]));
    let everyone: Vec<usize> = (0..world).collect();
    let ids = st.host_comm().exchange(&everyone, id).map_err(|e| LaunchError::Run(e.into()))?;
    job.opts.run_id = format!("nccl-{}", ids[0].to_i64_vec()[0]);
    let how = format!("as processes on GPUs with NCCL, rank 0 on {}", st.context().device_name());
    announce(on, reports, warnings, Event::Started { start, how, source })?;
    let prof = run_reporting(&job.program, &mut st, &job.opts, reports, on)?;
    let profiles = super::gather_profiles(&mut st.host_comm(), world, prof)?;
    let params = if job.gather {
        let host = st.host_state()?;
        let p = super::gather_params(&job.program, &host, &mut st.host_comm())?;
        reports.then_some(p)
    } else {
        None
    };
    // The blocks stay on the GPU (download them with `GpuRank::host_state` when needed).
    Ok(Finished { params, states: vec![], profiles })
}
