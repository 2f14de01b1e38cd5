//! Hostile inputs: shapes (see main.rs).

#[allow(unused_imports)]
use crate::common::*;
