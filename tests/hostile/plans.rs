//! Hostile inputs: plans (see main.rs).

#[allow(unused_imports)]
use crate::common::*;
