//! Shape inference of op families kept out of `op.rs`'s large matches: one file per family,
//! reached from `Op::infer` by one short arm per op.

pub(crate) mod norm;
