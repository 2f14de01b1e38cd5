//! Op families, one file each (see issue 16): inference and docs of the ops a family adds. The
//! family's other stages live in files of the same name in `autodiff/`, `tracer`, `sharding` and
//! `kernels`.

pub mod index;
