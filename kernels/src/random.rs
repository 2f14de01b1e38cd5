//! The counter-based generator behind training-mode dropout (`ir::ops::random` states the
//! mask's definition and why it does not depend on the sharding), shared by the CPU kernel and,
//! as the same arithmetic in NVRTC source, the CUDA one.
//!
//! [`philox4x32_10`] is Random123's Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel
//! random numbers: as easy as 1, 2, 3", SC'11), checked against the library's known-answer
//! vectors. A [`Draw`] says which stream a block draws from (seed, step, microbatch) and where
//! the block lies in its tensor; [`Draw::fill_row`] computes the keep bits of one row of it.

use ir::DropoutAttrs;

/// Philox4x32's multipliers.
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
/// Philox4x32's key schedule (Weyl) constants.
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32-10: four 32-bit words from a 128-bit counter and a 64-bit key.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 as u64 * c[0] as u64;
        let p1 = M1 as u64 * c[2] as u64;
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// SplitMix64's finaliser (Steele, Lea and Flood): a bijection of u64 that mixes every bit.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The Philox key of dropout `id` under run seed `seed`: `splitmix64(splitmix64(seed) ^ id)`,
/// low word first.
pub fn key(seed: u64, id: u32) -> [u32; 2] {
    let k = splitmix64(splitmix64(seed) ^ id as u64);
    [k as u32, (k >> 32) as u32]
}

/// Which training step of which run: what a step's random ops draw from, before the
/// microbatch is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepKey {
    /// The run's seed (`--seed`).
    pub seed: u64,
    /// The training step, 0 at the first step of the run (a resumed run counts on).
    pub step: u64,
}

impl StepKey {
    /// The stream of microbatch `microbatch` of this step.
    pub fn stream(self, microbatch: u64) -> Stream {
        Stream { seed: self.seed, step: self.step, microbatch }
    }
}

/// What a training step's random ops draw from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stream {
    /// The run's seed (`--seed`).
    pub seed: u64,
    /// The training step, 0 at the first step of the run (a resumed run counts on).
    pub step: u64,
    /// The microbatch of the step (0 without microbatches).
    pub microbatch: u64,
}

/// Where one block of a dropout's tensor lies, and the stream it draws from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Draw {
    /// The step's stream.
    pub stream: Stream,
    /// The global shape of the tensor (one microbatch's: the graph's).
    pub shape: Vec<usize>,
    /// Offset of the block in it, per dim.
    pub offsets: Vec<usize>,
}

/// A block of a dropout made ready to draw: its key, counters and index arithmetic.
#[derive(Clone, Debug)]
pub struct Layout {
    key: [u32; 2],
    step: [u32; 2],
    threshold: u32,
    /// Global index of the block's first element.
    start: u64,
    /// Global strides of the dims before the last (elements along the last are consecutive).
    strides: Vec<u64>,
    /// The block's shape before its last dim.
    rows: Vec<usize>,
    /// The block's last dim (1 for a scalar).
    row_len: usize,
}

impl Draw {
    /// The stream a block of `local` shape at this draw's offsets draws from for dropout `a`,
    /// or why the block does not fit the tensor.
    pub fn layout(&self, a: &DropoutAttrs, local: &[usize]) -> Result<Layout, String> {
        let (g, o) = (&self.shape, &self.offsets);
        if g.len() != local.len() || o.len() != local.len() {
            return Err(format!("a block of {local:?} at offsets {o:?} does not fit a tensor of {g:?} (ranks differ)"));
        }
        if local.iter().zip(o).zip(g).any(|((&l, &o), &g)| o.checked_add(l).is_none_or(|e| e > g)) {
            return Err(format!("a block of {local:?} at offsets {o:?} does not fit a tensor of {g:?}"));
        }
        let too_large =
            || format!("a tensor of {g:?} in microbatch {} has more than 2^64 elements", self.stream.microbatch);
        // Row-major strides of the global shape, and the first element's index.
        let mut strides = vec![1u64; g.len()];
        let mut numel = 1u64;
        for d in (0..g.len()).rev() {
            strides[d] = numel;
            numel = numel.checked_mul(g[d] as u64).ok_or_else(too_large)?;
        }
        let mut start = self.stream.microbatch.checked_mul(numel).ok_or_else(too_large)?;
        for (&s, &o) in strides.iter().zip(o) {
            start = start.checked_add(s * o as u64).ok_or_else(too_large)?;
        }
        let n = local.len();
        let step = self.stream.step;
        Ok(Layout {
            key: key(self.stream.seed, a.id),
            step: [step as u32, (step >> 32) as u32],
            threshold: a.threshold(),
            start,
            strides: strides[..n.saturating_sub(1)].to_vec(),
            rows: local[..n.saturating_sub(1)].to_vec(),
            row_len: local.last().copied().unwrap_or(1),
        })
    }
}

impl Layout {
    /// Elements per row (the block's last dim).
    pub fn row_len(&self) -> usize {
        self.row_len
    }

    /// Global index of the first element of row `r` of the block (rows in row-major order).
    pub fn row_start(&self, mut r: usize) -> u64 {
        let mut e = self.start;
        for (&n, &s) in self.rows.iter().zip(&self.strides).rev() {
            e += (r % n) as u64 * s;
            r /= n;
        }
        e
    }

    /// The keep bit of the element with global index `e`.
    pub fn keeps(&self, e: u64) -> bool {
        let q = e >> 2;
        let w = philox4x32_10([q as u32, (q >> 32) as u32, self.step[0], self.step[1]], self.key);
        w[(e & 3) as usize] >= self.threshold
    }

    /// The keep bits of row `r` into `out` (one row long): one Philox block per four elements.
    pub fn fill_row(&self, r: usize, out: &mut [bool]) {
        let e0 = self.row_start(r);
        let mut block = u64::MAX;
        let mut words = [0u32; 4];
        for (j, keep) in out.iter_mut().enumerate() {
            let e = e0 + j as u64;
            if e >> 2 != block {
                block = e >> 2;
                words = philox4x32_10([block as u32, (block >> 32) as u32, self.step[0], self.step[1]], self.key);
            }
            *keep = words[(e & 3) as usize] >= self.threshold;
        }
    }

    /// The parameters the CUDA kernel reads: key, step words and threshold.
    pub fn words(&self) -> ([u32; 2], [u32; 2], u32) {
        (self.key, self.step, self.threshold)
    }

    /// The first element's global index and the global strides of the dims before the last.
    pub fn index_map(&self) -> (u64, &[u64], &[usize]) {
        (self.start, &self.strides, &self.rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for Philox4x32-10: `examples/kat_vectors` of the
    /// Random123 distribution (D. E. Shaw Research, BSD-3-Clause), the three `philox4x32 10`
    /// lines, and the extended set of its `philox4x32 10` lines with a single set counter bit
    /// generated by the same library (github.com/girving/random123-manual,
    /// `examples/kat_vectors`). Columns: counter (4 words), key (2 words), expected (4 words).
    const KAT: [([u32; 4], [u32; 2], [u32; 4]); 9] = [
        ([0, 0, 0, 0], [0, 0], [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]),
        ([u32::MAX; 4], [u32::MAX; 2], [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]),
        (
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0],
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
        ),
        ([1, 0, 0, 0], [1, 0], [0xac08141b, 0xdfc5ccbe, 0x79c07a47, 0xa7f66093]),
        ([0, 1, 0, 0], [1, 0], [0x833ff8dc, 0x225c963c, 0x232b88b3, 0x0b334b07]),
        ([0, 0, 1, 0], [1, 0], [0x07071c12, 0x428264b6, 0x3909104b, 0x6da2bda2]),
        ([0, 0, 0, 1], [1, 0], [0x127bee41, 0x1e047488, 0x48842b20, 0x0a393496]),
        ([0, 0, 0, 0x8000_0000], [0, 1], [0x0436a39b, 0x31be9efa, 0x6abd0c76, 0xe7a68f83]),
        (
            [0x452821e6, 0x38d01377, 0xbe5466cf, 0x34e90c6c],
            [0, 0x8000_0000],
            [0x94ca5566, 0x14924b2f, 0x28214292, 0x59faeaee],
        ),
    ];

    #[test]
    fn philox_matches_random123_known_answers() {
        for (ctr, key, want) in KAT {
            assert_eq!(philox4x32_10(ctr, key), want, "counter {ctr:08x?} key {key:08x?}");
        }
    }

    #[test]
    fn rows_draw_what_single_elements_draw() {
        let a = DropoutAttrs { ratio: 0.3, id: 5, mask: false };
        let draw =
            Draw { stream: Stream { seed: 9, step: 3, microbatch: 1 }, shape: vec![4, 6, 10], offsets: vec![2, 3, 5] };
        let l = draw.layout(&a, &[2, 3, 5]).unwrap();
        let mut row = vec![false; 5];
        for r in 0..6 {
            l.fill_row(r, &mut row);
            let (i, j) = (r / 3, r % 3);
            for (k, &keep) in row.iter().enumerate() {
                let e = 240 + ((2 + i) * 60 + (3 + j) * 10 + 5 + k) as u64;
                assert_eq!(l.row_start(r) + k as u64, e);
                assert_eq!(keep, l.keeps(e));
            }
        }
        assert!(draw.layout(&a, &[3, 3, 5]).unwrap_err().contains("does not fit"));
        assert!(draw.layout(&a, &[2, 3]).is_err());
    }

    #[test]
    fn keys_differ_by_seed_and_op() {
        assert_ne!(key(0, 0), key(0, 1));
        assert_ne!(key(0, 0), key(1, 0));
        assert_ne!(key(1, 0), key(0, 1));
    }
}
