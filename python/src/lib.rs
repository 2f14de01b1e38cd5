//! The native module of the `autopar` Python package: `autopar._autopar`.
//!
//! A thin face over the CLI's library ([`autopar::cmd`]): the Python side builds the same
//! arguments the command line takes, this module parses them with the CLI's parser and calls the
//! CLI's functions, so a Python error carries the CLI's one-line message. Errors are raised as
//! `autopar._autopar.Error` subclasses by kind: `ArgumentError` (a value the parser refused),
//! `ModelError` (the ONNX file: unreadable, an unsupported op), `PlanError` (planning: e.g. a
//! memory budget no plan fits) and `RunError` (training on a plan: e.g. an input of the wrong
//! shape).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;

create_exception!(_autopar, Error, PyException, "Every autopar error; its message is the CLI's one line.");
create_exception!(_autopar, ArgumentError, Error, "An argument the command line would refuse (mesh, memory, ...).");
create_exception!(_autopar, ModelError, Error, "The ONNX model cannot be imported (unreadable, an unsupported op).");
create_exception!(_autopar, PlanError, Error, "Planning failed (e.g. no plan fits the memory budget).");
create_exception!(_autopar, RunError, Error, "Training on a plan failed (e.g. an input of the wrong shape).");

/// The Python exception of a failure: `ModelError` when the importer refused the file, else
/// `other`'s kind; the message is the CLI's line.
fn raise(e: &anyhow::Error, other: fn(String) -> PyErr) -> PyErr {
    let msg = autopar::error_line(e);
    if e.chain().any(|c| c.downcast_ref::<tracer::ImportError>().is_some()) {
        ModelError::new_err(msg)
    } else {
        other(msg)
    }
}

/// A plan made by `autopar autoparallelize`, held in memory.
#[pyclass(module = "autopar._autopar", frozen)]
struct NativePlan {
    plan: codegen::Plan,
}

#[pymethods]
impl NativePlan {
    /// The plan as `plan.json` holds it.
    fn to_json(&self) -> PyResult<String> {
        self.plan.to_json().map_err(|e| PlanError::new_err(format!("{e:#}")))
    }

    /// The summary `autopar autoparallelize` prints.
    fn summary(&self) -> String {
        codegen::explain::summary(&self.plan)
    }

    /// The standalone HTML page of `autopar explain PLAN --html`.
    fn html(&self) -> String {
        codegen::explain::html(&self.plan)
    }
}

/// Plans as `autopar autoparallelize ARGS...` does (ARGS without the program and subcommand).
#[pyfunction]
fn plan(py: Python<'_>, args: Vec<String>) -> PyResult<NativePlan> {
    let a = autopar::parse_plan_args(args).map_err(ArgumentError::new_err)?;
    let plan = py.detach(|| autopar::cmd::plan::plan(&a)).map_err(|e| raise(&e, PlanError::new_err))?;
    Ok(NativePlan { plan })
}

/// Runs `autopar run ARGS...`, calling `on_step(dict)` after each step with its `step`, `loss`,
/// `seconds` (and `lr`, `grad_norm` where the plan's graph has them).
#[pyfunction]
fn run(py: Python<'_>, args: Vec<String>, on_step: Py<PyAny>) -> PyResult<()> {
    let a = autopar::parse_run_args(args).map_err(ArgumentError::new_err)?;
    let mut failed: Option<PyErr> = None;
    let res = py.detach(|| {
        autopar::cmd::run::run_observed(&a, &mut |r| {
            if failed.is_some() {
                return;
            }
            let called = Python::attach(|py| -> PyResult<()> {
                let d = PyDict::new(py);
                d.set_item("step", r.step)?;
                d.set_item("loss", r.loss)?;
                d.set_item("seconds", r.seconds)?;
                d.set_item("lr", r.lr)?;
                d.set_item("grad_norm", r.grad_norm)?;
                on_step.call1(py, (d,))?;
                Ok(())
            });
            failed = called.err();
        })
    });
    if let Some(e) = failed {
        return Err(e);
    }
    res.map_err(|e| raise(&e, RunError::new_err))
}

#[pymodule]
fn _autopar(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("ArgumentError", py.get_type::<ArgumentError>())?;
    m.add("ModelError", py.get_type::<ModelError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("RunError", py.get_type::<RunError>())?;
    m.add_class::<NativePlan>()?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(run, m)?)?;
    Ok(())
}
