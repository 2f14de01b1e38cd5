//! FxHash (rustc's hasher): fast for the small integer keys of layout pricing and the planner's
//! caches, where SipHash's DoS resistance buys nothing (keys are ours, not a user's).

use std::collections::HashMap;

/// The hasher state.
#[derive(Clone, Copy, Default)]
pub struct Fx(u64);

impl std::hash::Hasher for Fx {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u32(&mut self, x: u32) {
        self.write_u64(x as u64);
    }
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
    fn write_u128(&mut self, x: u128) {
        self.write_u64(x as u64);
        self.write_u64((x >> 64) as u64);
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

/// Builds [`Fx`] hashers.
pub type BuildFx = std::hash::BuildHasherDefault<Fx>;

/// A `HashMap` hashed with [`Fx`].
pub type FxMap<K, V> = HashMap<K, V, BuildFx>;
/// A `HashSet` with [`Fx`].
pub type FxSet<K> = std::collections::HashSet<K, BuildFx>;
