//! Hostile inputs: flags (see main.rs).

#[allow(unused_imports)]
use crate::common::*;
