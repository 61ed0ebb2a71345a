//! XQuant-CL's accumulator update for latent caches.
//!
//! A layer stores the latents `Δ_k = δ·down_k`, `Δ_v = δ·down_v` of the X-space delta
//! `δ = X_i − X̂_{i−1}`; the accumulator must stay in X space (the next layer has other down-projections,
//! so latents of different layers do not add). The decoder lifts the dequantized latents back to the
//! least-squares X-space delta `δ̂ = argmin ‖δ·down_k − Δ̂_k‖² + ‖δ·down_v − Δ̂_v‖²`, i.e.
//! `δ̂·M = Δ̂_k·down_kᵀ + Δ̂_v·down_vᵀ` with `M = down_k·down_kᵀ + down_v·down_vᵀ`, and adds it.
//! Directions outside both latent spaces do not reach this layer's K/V; they stay in the next delta.

use super::projection::Projections;
use crate::commvq::linalg::solve_spd;
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
