//! A segment tree over time steps with range add and range max (no lazy propagation: each
//! node stores the max of its subtree including the adds applied to it).

pub(crate) struct SegTree {
    size: usize,
    mx: Vec<i64>,
    add: Vec<i64>,
}

const NEG: i64 = i64::MIN / 4;

impl SegTree {
    pub fn new(values: &[i64]) -> SegTree {
        let size = values.len().next_power_of_two().max(1);
        let mut mx = vec![NEG; 2 * size];
        mx[size..size + values.len()].copy_from_slice(values);
        for i in (1..size).rev() {
            mx[i] = mx[2 * i].max(mx[2 * i + 1]);
        }
        SegTree { size, mx, add: vec![0; 2 * size] }
    }

    /// Adds `v` to every step in `[l, r)`.
    pub fn add(&mut self, l: usize, r: usize, v: i64) {
        if l < r && v != 0 {
            self.add_rec(1, 0, self.size, l, r, v);
        }
    }

    fn add_rec(&mut self, node: usize, nl: usize, nr: usize, l: usize, r: usize, v: i64) {
        if r <= nl || nr <= l {
            return;
        }
        if l <= nl && nr <= r {
            self.mx[node] += v;
            self.add[node] += v;
            return;
        }
        let mid = (nl + nr) / 2;
        self.add_rec(2 * node, nl, mid, l, r, v);
        self.add_rec(2 * node + 1, mid, nr, l, r, v);
        self.mx[node] = self.mx[2 * node].max(self.mx[2 * node + 1]) + self.add[node];
    }

    /// Max over `[l, r)` (a very negative number when empty).
    pub fn max(&self, l: usize, r: usize) -> i64 {
        if l >= r {
            return NEG;
        }
        self.max_rec(1, 0, self.size, l, r)
    }

    fn max_rec(&self, node: usize, nl: usize, nr: usize, l: usize, r: usize) -> i64 {
        if r <= nl || nr <= l {
            return NEG;
        }
        if l <= nl && nr <= r {
            return self.mx[node];
        }
        let mid = (nl + nr) / 2;
        self.max_rec(2 * node, nl, mid, l, r).max(self.max_rec(2 * node + 1, mid, nr, l, r)) + self.add[node]
    }

    /// Max over all steps.
    pub fn global_max(&self) -> i64 {
        self.mx[1]
    }

    /// A step where the global max is reached.
    pub fn argmax(&self) -> usize {
        let mut node = 1;
        while node < self.size {
            node = if self.mx[2 * node] >= self.mx[2 * node + 1] { 2 * node } else { 2 * node + 1 };
        }
        node - self.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive() {
        let mut naive = vec![3i64, 1, 4, 1, 5, 9, 2];
        let mut t = SegTree::new(&naive);
        let ops = [(0, 3, 2), (2, 7, -1), (5, 6, 10), (1, 2, 7), (0, 7, -3)];
        for &(l, r, v) in &ops {
            t.add(l, r, v);
            for x in &mut naive[l..r] {
                *x += v;
            }
            for a in 0..7 {
                for b in a + 1..=7 {
                    assert_eq!(t.max(a, b), *naive[a..b].iter().max().unwrap());
                }
            }
            let g = t.argmax();
            assert_eq!(naive[g], t.global_max());
        }
    }
}
