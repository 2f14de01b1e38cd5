//! The `mpi` launcher: one process per rank under mpirun.

use super::{Event, Finished, Job, LaunchError, OnEvent, announce, check_fault, check_start, init, run_reporting};
use crate::comm::Communicator;
use crate::mpi_comm::{MpiComm, MpiWorld};

/// Runs this process's rank of a job under mpirun: MPI starts first, then `setup` makes the
/// job (so a failure there, as any later one, stops the whole job); the events are heard on
/// rank 0. A failure on any rank prints `error: rank R: cause` on its stderr and aborts every
/// process of the job (MPI has no other way to stop ranks waiting in a collective), so this
/// returns only on success.
pub fn mpi(setup: &mut dyn FnMut() -> Result<Job, String>, on: &mut OnEvent<'_>) -> Result<Finished, LaunchError> {
    let mut world = MpiWorld::init().map_err(|e| LaunchError::Setup(e.to_string()))?;
    let mut comm = world.comm();
    let rank = comm.rank();
    match run(&mut world, &mut comm, setup, on) {
        Ok(f) => Ok(f),
        Err(e) => {
            let msg = e.to_string().replace('\n', " ");
            eprintln!("error: rank {rank}: {msg}");
            comm.abort(&msg);
            std::process::exit(1)
        }
    }
}

fn run(
    world: &mut MpiWorld,
    comm: &mut MpiComm,
    setup: &mut dyn FnMut() -> Result<Job, String>,
    on: &mut OnEvent<'_>,
) -> Result<Finished, LaunchError> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut job = setup().map_err(LaunchError::Setup)?;
    let program = &job.program;
    if program.ranks() != size {
        return Err(LaunchError::Setup(format!(
            "the plan is for {} ranks but mpirun started {size}; run with mpirun -np {}",
            program.ranks(),
            program.ranks()
        )));
    }
    // Room for two steps of sends: a rank may start the next step before its peers took the last one's.
    world.reserve_sends(2 * program.send_bytes(rank)).map_err(|e| LaunchError::Setup(e.to_string()))?;
    // The run id (names temporary checkpoint directories) is rank 0's.
    let id = ir::Tensor::i64(vec![1], vec![std::process::id() as i64]);
    let everyone: Vec<usize> = (0..size).collect();
    let ids = comm.exchange(&everyone, std::sync::Arc::new(id)).map_err(|e| LaunchError::Run(e.into()))?;
    job.opts.run_id = format!("mpi-{}", ids[0].to_i64_vec()[0]);
    let program = &job.program;
    let reports = rank == 0;
    let mut warnings = vec![];
    let (mut states, source) =
        init::states(&job.init, program, &job.feeds, job.opts.data.as_deref(), &[rank], &mut |w| warnings.push(w))?;
    let mut st = states.remove(0);
    let start = st.steps_done;
    check_start(start, &job.opts)?;
    check_fault(&job.opts, size, start)?;
    let started = Event::Started { start, how: "as MPI processes".into(), source };
    announce(on, reports, warnings, started)?;
    let cpu = crate::cpu::Cpu::new(job.opts.threads_per_rank)
        .map_err(|e| LaunchError::Setup(e.to_string()))?
        .with_accumulation(job.opts.accumulation);
    let prof = run_reporting(program, &mut super::CpuRank { st: &mut st, cpu: &cpu, comm }, &job.opts, reports, on)?;
    let profiles = super::gather_profiles(comm, size, prof)?;
    let params = if job.gather {
        let p = super::gather_params(program, &st, comm)?;
        reports.then_some(p)
    } else {
        None
    };
    Ok(Finished { params, states: vec![st], profiles })
}
