//! Hostile inputs: files (see main.rs).

#[allow(unused_imports)]
use crate::common::*;
