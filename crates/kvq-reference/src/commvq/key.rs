//! The RoPE-commutative key codebook: its tensor, the decoder and the greedy residual encoder.
//!
//! A head's `D` channels form `D/2` RoPE pairs (channel `p` with `p + D/2`, the half-split convention of
//! [`crate::rope`]). Read a pair as the complex number `k_p + i·k_{p+D/2}`: RoPE multiplies it by
//! `e^{iθ}`, and so does every matrix `[[x, y], [−y, x]]` (as a row-vector map) multiply by `x + iy`.
//! Complex numbers commute, hence the codebook commutes with RoPE.
//!
//! Pairs are grouped `g = pairs_per_code` at a time. For each (KV head, group, round) the codebook holds
//! `N' = levels` complex numbers per pair, `c_k = (c_{k,0} … c_{k,g−1})`. A code is two indices
//! `(a, b)`: the reconstruction is `c_a + i·c_b` on every pair of the group (the paper's binary code
//! selecting one matrix for each of the pair's two basis directions). Rounds add up (residual VQ).

use crate::RefError;

/// Trained codebook of one key tensor (`Codebook::RopeCommutative`).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyCodebook {
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `N'`: complex entries per pair and round.
    pub levels: usize,
    pub residuals: usize,
    pub pairs_per_code: usize,
    /// `[kv_head][group][round][entry][pair_in_group][re, im]`, values exactly representable in f16.
    pub entries: Vec<f32>,
}

impl KeyCodebook {
    /// An all-zero codebook of the given shape (filled by the trainer).
    pub fn zeros(
        kv_heads: usize,
        head_dim: usize,
        levels: usize,
        residuals: usize,
        pairs_per_code: usize,
    ) -> Self {
        let mut cb = Self {
            kv_heads,
            head_dim,
            levels,
            residuals,
            pairs_per_code,
            entries: Vec::new(),
        };
        cb.entries = vec![0.0; cb.expected_len()];
        cb
    }

    /// Groups of `pairs_per_code` pairs in one head.
    pub fn groups(&self) -> usize {
        self.head_dim / 2 / self.pairs_per_code.max(1)
    }

    /// Bits of one code (`a` and `b`): `2·log2(levels)`.
    pub fn code_bits(&self) -> u32 {
        2 * self.levels.trailing_zeros()
    }

    pub(crate) fn expected_len(&self) -> usize {
        self.kv_heads * self.groups() * self.residuals * self.levels * self.pairs_per_code * 2
    }

    /// One round's table `[entry][pair][re, im]` of one (head, group).
    pub(crate) fn table(&self, head: usize, group: usize, round: usize) -> &[f32] {
        let n = self.levels * self.pairs_per_code * 2;
        let start = ((head * self.groups() + group) * self.residuals + round) * n;
        &self.entries[start..start + n]
    }

    pub(crate) fn table_mut(&mut self, head: usize, group: usize, round: usize) -> &mut [f32] {
        let n = self.levels * self.pairs_per_code * 2;
        let start = ((head * self.groups() + group) * self.residuals + round) * n;
        &mut self.entries[start..start + n]
    }

    /// Adds the reconstruction of code `(a, b)` of one round to `out` (`2g` values, pair-interleaved).
    pub fn add_code(
        &self,
        head: usize,
        group: usize,
        round: usize,
        (a, b): (u32, u32),
        out: &mut [f64],
    ) {
        let g = self.pairs_per_code;
        let t = self.table(head, group, round);
        let (ca, cb) = (
            &t[a as usize * 2 * g..][..2 * g],
            &t[b as usize * 2 * g..][..2 * g],
        );
        for j in 0..g {
            let (xa, ya) = (ca[2 * j] as f64, ca[2 * j + 1] as f64);
            let (xb, yb) = (cb[2 * j] as f64, cb[2 * j + 1] as f64);
            out[2 * j] += xa - yb;
            out[2 * j + 1] += ya + xb;
        }
    }

    pub(crate) fn check(&self, kv_heads: usize, head_dim: usize) -> Result<(), RefError> {
        if self.kv_heads != kv_heads || self.head_dim != head_dim {
            return Err(RefError::Mismatch(format!(
                "key codebook trained for {} KV heads of {} channels, cache has {kv_heads} of {head_dim}",
                self.kv_heads, self.head_dim
            )));
        }
        if self.entries.len() != self.expected_len() {
            return Err(RefError::Mismatch(format!(
                "key codebook holds {} values, its shape needs {}",
                self.entries.len(),
                self.expected_len()
            )));
        }
        if let Some(x) = self.entries.iter().find(|x| !x.is_finite()) {
            return Err(RefError::Mismatch(format!(
                "key codebook holds a non-finite entry ({x})"
            )));
        }
        Ok(())
    }
}

/// Per-round tables for the greedy encoder: `‖z − c_a − i·c_b‖² = ‖z‖² + n_a + n_b − 2α_a − 2β_b + 2χ_ab`
/// with `α_a = z·c_a`, `β_b = z·(i·c_b)`, `n_k = ‖c_k‖²`, `χ_ab = c_a·(i·c_b)`; only α and β depend on z.
pub(crate) struct RoundTables {
    /// `[entry][2g]`: `c_k` and `i·c_k` as real vectors.
    pub c: Vec<f64>,
    pub ic: Vec<f64>,
    pub norm: Vec<f64>,
    /// `[a][b]`.
    pub cross: Vec<f64>,
    pub levels: usize,
    pub dim: usize,
}

impl RoundTables {
    /// Tables of a table `[entry][pair][re, im]` (as stored, or as being trained).
    pub fn new(table: &[f64], levels: usize, dim: usize) -> Self {
        let mut ic = vec![0.0; levels * dim];
        for k in 0..levels {
            for j in 0..dim / 2 {
                let (x, y) = (table[k * dim + 2 * j], table[k * dim + 2 * j + 1]);
                ic[k * dim + 2 * j] = -y;
                ic[k * dim + 2 * j + 1] = x;
            }
        }
        let norm: Vec<f64> = (0..levels)
            .map(|k| dot(&table[k * dim..][..dim], &table[k * dim..][..dim]))
            .collect();
        let mut cross = vec![0.0; levels * levels];
        for a in 0..levels {
            for b in 0..levels {
                cross[a * levels + b] = dot(&table[a * dim..][..dim], &ic[b * dim..][..dim]);
            }
        }
        Self {
            c: table.to_vec(),
            ic,
            norm,
            cross,
            levels,
            dim,
        }
    }

    /// `α` and `β` of one vector.
    pub fn projections(&self, z: &[f64], alpha: &mut [f64], beta: &mut [f64]) {
        for k in 0..self.levels {
            alpha[k] = dot(z, &self.c[k * self.dim..][..self.dim]);
            beta[k] = dot(z, &self.ic[k * self.dim..][..self.dim]);
        }
    }

    /// `‖z − c_a − i·c_b‖² − ‖z‖²` for every `(a, b)`, row-major into `out`.
    pub fn distances(&self, alpha: &[f64], beta: &[f64], out: &mut [f64]) {
        let l = self.levels;
        for a in 0..l {
            let base = self.norm[a] - 2.0 * alpha[a];
            let row = &mut out[a * l..(a + 1) * l];
            let cross = &self.cross[a * l..(a + 1) * l];
            for b in 0..l {
                row[b] = base + self.norm[b] - 2.0 * beta[b] + 2.0 * cross[b];
            }
        }
    }

    /// Nearest code of `z` (ties: the smallest `a·levels + b`) and its squared error minus `‖z‖²`.
    pub fn nearest(&self, z: &[f64], scratch: &mut Scratch) -> ((u32, u32), f64) {
        self.projections(z, &mut scratch.alpha, &mut scratch.beta);
        self.distances(&scratch.alpha, &scratch.beta, &mut scratch.dist);
        let (mut best, mut at) = (f64::INFINITY, 0);
        for (i, d) in scratch.dist.iter().enumerate() {
            if *d < best {
                best = *d;
                at = i;
            }
        }
        (((at / self.levels) as u32, (at % self.levels) as u32), best)
    }

    /// Subtracts the reconstruction of `(a, b)` from `z`.
    pub fn subtract(&self, (a, b): (u32, u32), z: &mut [f64]) {
        let (ca, icb) = (
            &self.c[a as usize * self.dim..][..self.dim],
            &self.ic[b as usize * self.dim..][..self.dim],
        );
        for ((zi, x), y) in z.iter_mut().zip(ca).zip(icb) {
            *zi -= x + y;
        }
    }
}

/// Reusable buffers of the encoder.
pub(crate) struct Scratch {
    pub alpha: Vec<f64>,
    pub beta: Vec<f64>,
    pub dist: Vec<f64>,
}

impl Scratch {
    pub fn new(levels: usize) -> Self {
        Self {
            alpha: vec![0.0; levels],
            beta: vec![0.0; levels],
            dist: vec![0.0; levels * levels],
        }
    }
}

/// Dot product with four interleaved partial sums (fixed order, so deterministic; lets the compiler
/// vectorise).
pub(crate) fn dot(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..4 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f64 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// The greedy residual encoder of one (head, group): round by round, the nearest code of what is left.
pub(crate) struct GroupEncoder {
    rounds: Vec<RoundTables>,
    scratch: Scratch,
}

impl GroupEncoder {
    pub fn new(cb: &KeyCodebook, head: usize, group: usize) -> Self {
        let dim = 2 * cb.pairs_per_code;
        let rounds = (0..cb.residuals)
            .map(|r| {
                let t: Vec<f64> = cb.table(head, group, r).iter().map(|x| *x as f64).collect();
                RoundTables::new(&t, cb.levels, dim)
            })
            .collect();
        Self {
            rounds,
            scratch: Scratch::new(cb.levels),
        }
    }

    /// Codes of one group vector (`2g` values, already divided by the vector's scale).
    pub fn encode(&mut self, group: &[f64], out: &mut [(u32, u32)]) {
        let mut z = group.to_vec();
        for (r, tables) in self.rounds.iter().enumerate() {
            let (code, _) = tables.nearest(&z, &mut self.scratch);
            tables.subtract(code, &mut z);
            out[r] = code;
        }
    }
}
