//! Measuring the cost model's inputs (`autopar profile`), above the runtime it measures:
//! [`profile`] sweeps every mesh axis's links with collectives and one device's throughput and
//! memory bandwidth; [`calibrate`] times the instructions of generated training steps and fits
//! each op family's cost. Both run programs through [`runtime`] and build models with [`tracer`]
//! (the runtime itself reads no model format).
//!
//! Invariants: a measurement is a function of the machine and the options passed (no global
//! state); the fits' coefficients are non-negative, so a fitted cost never decreases with size.

pub mod calibrate;
pub mod profile;
