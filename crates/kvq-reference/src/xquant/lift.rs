//! XQuant-CL's accumulator update for latent caches.
//!
//! A layer stores the latents `Δ_k = δ·down_k`, `Δ_v = δ·down_v` of the X-space delta
//! `δ = X_i − X̂_{i−1}`; the accumulator must stay in X space (the next layer has other down-projections,
//! so latents of different layers do not add). The writer lifts the latents (unquantized, rounded to
//! f16: `XQuantCache::next_accumulator`) back to the least-squares X-space delta
//! `δ̂ = argmin ‖δ̂·down_k − Δ_k‖² + ‖δ̂·down_v − Δ_v‖²`, i.e.
//! `δ̂·M = Δ_k·down_kᵀ + Δ_v·down_vᵀ` with `M = down_k·down_kᵀ + down_v·down_vᵀ`, and adds it.
//! Directions outside both latent spaces do not reach this layer's K/V; they stay in the next delta.

use super::projection::Projections;
use crate::commvq::linalg::{cholesky, solve_spd, substitute};
use crate::RefError;

/// `δ̂` (`[tokens][d_model]`) of dequantized latent deltas `[tokens][rank]`.
pub(crate) fn lift(
    p: &Projections,
    dk: &[f32],
    dv: &[f32],
    tokens: usize,
) -> Result<Vec<f32>, RefError> {
    let d = p.d_model();
    let mut m = vec![0.0f64; d * d];
    // Right-hand sides as columns: b[i][t] = Σ_k down[i][k] · Δ[t][k].
    let mut b = vec![0.0f64; d * tokens];
    for (proj, delta) in [(&p.k, dk), (&p.v, dv)] {
        let r = proj.rank;
        for i in 0..d {
            let di = &proj.down[i * r..(i + 1) * r];
            for j in 0..d {
                let dj = &proj.down[j * r..(j + 1) * r];
                m[i * d + j] += di
                    .iter()
                    .zip(dj)
                    .map(|(a, c)| *a as f64 * *c as f64)
                    .sum::<f64>();
            }
            for t in 0..tokens {
                let row = &delta[t * r..(t + 1) * r];
                b[i * tokens + t] += di
                    .iter()
                    .zip(row)
                    .map(|(a, c)| *a as f64 * *c as f64)
                    .sum::<f64>();
            }
        }
    }
    let trace = (0..d).map(|i| m[i * d + i]).sum::<f64>() / d as f64;
    solve_spd(&mut m, d, &mut b, tokens, 1e-9 * trace.max(1e-30))?;
    let mut out = vec![0.0f32; tokens * d];
    for i in 0..d {
        for t in 0..tokens {
            out[t * d + i] = b[i * tokens + t] as f32;
        }
    }
    Ok(out)
}

impl Projections {
    /// The lift as a matrix `[rank_k + rank_v][d_model]` (f32): row `j` is the X-space delta of a
    /// unit K latent `j`, row `rank_k + j` of a unit V latent `j`, so `δ̂ = [Δ_k | Δ_v] · L` — what
    /// a GPU multiplies new tokens' delta latents by. With `D = [down_k | down_v]`,
    /// `L = Dᵀ·(D·Dᵀ + εI)⁻¹ = (Dᵀ·D + εI)⁻¹·Dᵀ`: the second form solves a system of the latents'
    /// width instead of d_model's where that is smaller (LLaMA-3's 2,048 against 4,096), with the
    /// ridge [`XQuantCache::next_accumulator`](super::XQuantCache::next_accumulator) uses.
    pub fn lift_matrix(&self) -> Result<Vec<f32>, RefError> {
        let (d, rk, rv) = (self.d_model(), self.k.rank, self.v.rank);
        let rows = rk + rv;
        if rows >= d {
            let (mut dk, mut dv) = (vec![0.0f32; rows * rk], vec![0.0f32; rows * rv]);
            for j in 0..rk {
                dk[j * rk + j] = 1.0;
            }
            for j in 0..rv {
                dv[(rk + j) * rv + j] = 1.0;
            }
            return lift(self, &dk, &dv, rows);
        }
        // Column j of D, as f64.
        let column = |j: usize| -> Vec<f64> {
            let (down, r, c) = if j < rk {
                (&self.k.down, rk, j)
            } else {
                (&self.v.down, rv, j - rk)
            };
            (0..d).map(|i| down[i * r + c] as f64).collect()
        };
        let cols: Vec<Vec<f64>> = (0..rows).map(column).collect();
        let gram_rows = crate::par::map(rows, 0, |a| {
            (0..rows)
                .map(|b| {
                    cols[a]
                        .iter()
                        .zip(&cols[b])
                        .map(|(x, y)| x * y)
                        .sum::<f64>()
                })
                .collect::<Vec<f64>>()
        })?;
        let mut g: Vec<f64> = gram_rows.into_iter().flatten().collect();
        let trace = (0..rows).map(|i| g[i * rows + i]).sum::<f64>() / d as f64;
        for i in 0..rows {
            g[i * rows + i] += 1e-9 * trace.max(1e-30);
        }
        cholesky(&mut g, rows)?;
        // The right-hand side Dᵀ in blocks of d_model's columns, solved independently.
        const BLOCK: usize = 256;
        let blocks = crate::par::map(d.div_ceil(BLOCK), 0, |blk| {
            let (c0, c1) = (blk * BLOCK, ((blk + 1) * BLOCK).min(d));
            let mut b: Vec<f64> = cols
                .iter()
                .flat_map(|c| c[c0..c1].iter().copied())
                .collect();
            substitute(&g, rows, &mut b, c1 - c0);
            b
        })?;
        let mut out = vec![0.0f32; rows * d];
        for (blk, b) in blocks.iter().enumerate() {
            let (c0, w) = (blk * BLOCK, b.len() / rows);
            for j in 0..rows {
                for c in 0..w {
                    out[j * d + c0 + c] = b[j * w + c] as f32;
                }
            }
        }
        Ok(out)
    }
}
