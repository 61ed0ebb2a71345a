//! [`Projections::synthetic`]: a layer's K/V projections built directly as their SVD factors, for
//! timing and tuning the latent decode at real widths (d_model 4,096, latents of 1,024) without
//! factoring a weight: an SVD of a 4,096-wide projection takes seconds of CPU, and what the decode
//! costs does not depend on the values, only on the widths.

use super::projection::{LatentProjection, Projections};
use crate::resources;
use crate::synth::SynthRng;
use crate::RefError;

/// The `[rows][n]` leading rows of the Householder reflection `I − 2·u·uᵀ / uᵀu` of a random `u`:
/// orthonormal rows, every entry non-zero (a dense factor, as a real layer's), built in
/// `rows · n` steps where an orthogonalisation would take `n³`.
fn householder_rows(rows: usize, n: usize, rng: &mut SynthRng) -> Vec<f64> {
    let u: Vec<f64> = (0..n).map(|_| f64::from(rng.symmetric()) + 1.5).collect();
    let norm2: f64 = u.iter().map(|x| x * x).sum();
    let mut out = vec![0.0f64; rows * n];
    for r in 0..rows {
        for c in 0..n {
            let identity = if r == c { 1.0 } else { 0.0 };
            out[r * n + c] = identity - 2.0 * u[r] * u[c] / norm2;
        }
    }
    out
}

/// One projection `W = down · up` of `d_model` inputs and `out` outputs with singular values
/// falling from 2 to 0.5: `down`'s columns and `up`'s rows (over σ) are the leading rows of two
/// Householder reflections, so the factors are an exact thin SVD of their product.
fn synthetic_projection(d_model: usize, out: usize, rng: &mut SynthRng) -> LatentProjection {
    let r = d_model.min(out);
    let rank = r.div_ceil(32) * 32;
    let singular: Vec<f64> = (0..r)
        .map(|k| 2.0 * 0.25f64.powf(k as f64 / r.max(1) as f64))
        .collect();
    // U's columns: the reflection's first r rows, read transposed.
    let u_rows = householder_rows(r, d_model, rng);
    let mut down = vec![0.0f32; d_model * rank];
    for k in 0..r {
        for i in 0..d_model {
            down[i * rank + k] = u_rows[k * d_model + i] as f32;
        }
    }
    let b_rows = householder_rows(r, out, rng);
    let mut up = vec![0.0f32; rank * out];
    for k in 0..r {
        for j in 0..out {
            up[k * out + j] = (singular[k] * b_rows[k * out + j]) as f32;
        }
    }
    LatentProjection {
        d_model,
        out,
        rank,
        down,
        up,
        singular,
    }
}

impl Projections {
    /// K and V projections of a layer whose input is `d_model` wide, for `kv_heads` heads of
    /// `head_dim`, made from `seed` as exact SVD factors (orthonormal `down`, `up = Σ·Bᵀ`, the
    /// rank `min(d_model, kv_heads·head_dim)` padded to a multiple of 32 as
    /// [`LatentProjection::from_weight`] pads it). For benchmarks and the tuner: real widths at
    /// no factoring cost; [`Projections::from_weights`] factors a real layer.
    pub fn synthetic(
        kv_heads: usize,
        head_dim: usize,
        d_model: usize,
        seed: u64,
    ) -> Result<Projections, RefError> {
        let out = kv_heads.checked_mul(head_dim).unwrap_or(0);
        if out == 0 || d_model == 0 {
            return Err(RefError::Mismatch(format!(
                "synthetic projections of {kv_heads} KV heads × {head_dim} channels from d_model \
                 {d_model}: every size must be positive"
            )));
        }
        // Two projections of `down` [d_model][rank] and `up` [rank][out] each.
        let rank = d_model.min(out).div_ceil(32) * 32;
        let elements = d_model
            .checked_add(out)
            .and_then(|w| w.checked_mul(rank))
            .and_then(|n| n.checked_mul(2));
        resources::check(
            elements.and_then(resources::bytes_of::<f32>),
            "the synthetic projections",
        )?;
        let mut rng = SynthRng::new(seed);
        Ok(Projections {
            kv_heads,
            head_dim,
            k: synthetic_projection(d_model, out, &mut rng),
            v: synthetic_projection(d_model, out, &mut rng),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dot(a: impl Iterator<Item = f64>, b: impl Iterator<Item = f64>) -> f64 {
        a.zip(b).map(|(x, y)| x * y).sum()
    }

    #[test]
    fn factors_are_an_exact_thin_svd_at_either_aspect() {
        for (kv, d, dm) in [(2usize, 32usize, 160usize), (4, 32, 96)] {
            let p = Projections::synthetic(kv, d, dm, 7).unwrap();
            let out = kv * d;
            let r = dm.min(out);
            for lp in [&p.k, &p.v] {
                assert_eq!(
                    (lp.d_model, lp.out, lp.rank),
                    (dm, out, r.div_ceil(32) * 32)
                );
                assert_eq!(lp.singular.len(), r);
                assert!(lp.singular.windows(2).all(|w| w[0] > w[1]));
                // down: orthonormal columns.
                for a in [0, r / 2, r - 1] {
                    for b in [0, r / 3, r - 1] {
                        let col = |k: usize| (0..dm).map(move |i| lp.down[i * lp.rank + k] as f64);
                        let want = if a == b { 1.0 } else { 0.0 };
                        assert!((dot(col(a), col(b)) - want).abs() < 1e-5, "{a} {b}");
                    }
                }
                // up: orthogonal rows of norm σ, dense.
                for a in [0, r - 1] {
                    for b in [0, r - 1] {
                        let row =
                            |k: usize| lp.up[k * out..(k + 1) * out].iter().map(|&x| x as f64);
                        let want = if a == b { lp.singular[a].powi(2) } else { 0.0 };
                        assert!((dot(row(a), row(b)) - want).abs() < 1e-4, "{a} {b}");
                    }
                }
                assert!(lp.up[..out].iter().all(|&x| x != 0.0));
            }
            assert_ne!(p.k.up, p.v.up);
            assert_eq!(p, Projections::synthetic(kv, d, dm, 7).unwrap());
        }
    }

    #[test]
    fn empty_or_impossible_sizes_are_errors() {
        assert!(Projections::synthetic(0, 128, 4096, 1).is_err());
        assert!(Projections::synthetic(8, 128, 0, 1).is_err());
        let e = Projections::synthetic(1 << 20, 1 << 20, 1 << 40, 1).unwrap_err();
        assert!(e.to_string().contains("synthetic projections"), "{e}");
    }
}
