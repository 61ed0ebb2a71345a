//! Low-rank latents of a layer's K/V projections (XQuant for GQA): `W = down · up` from the SVD
//! `W = U Σ Bᵀ`, with `down = U` (orthonormal, `d_model × r`) and `up = Σ Bᵀ` (`r × kv_heads·head_dim`).
//! The cache holds `X·down`; `X·W = (X·down)·up` rematerialises K (before RoPE) or V exactly.
//!
//! `r = min(d_model, kv_heads·head_dim)`, padded with zero channels to a multiple of 32; padding
//! channels are always zero. The integer store takes any multiple of 16, but at 32 a latent row of
//! any code width fills whole 32-bit words (no padded word), it is a width the GPU kernels serve,
//! and real layers (`d_model`, `kv_heads·head_dim` multiples of 128) never pad at all.

use super::svd::svd;
use crate::RefError;

/// One projection `W = down · up`.
#[derive(Debug, Clone, PartialEq)]
pub struct LatentProjection {
    pub d_model: usize,
    /// Output width `kv_heads · head_dim`.
    pub out: usize,
    /// Latent width (padded to a multiple of 32).
    pub rank: usize,
    /// `[d_model][rank]`, orthonormal columns (zero for padding).
    pub down: Vec<f32>,
    /// `[rank][out]`.
    pub up: Vec<f32>,
    /// Singular values of `W`, descending (`min(d_model, out)` of them).
    pub singular: Vec<f64>,
}

impl LatentProjection {
    /// Factors a row-major `[d_model][out]` weight.
    pub fn from_weight(w: &[f32], d_model: usize, out: usize) -> Result<Self, RefError> {
        if w.len() != d_model * out || d_model == 0 || out == 0 {
            return Err(RefError::Mismatch(format!(
                "a [{d_model}][{out}] projection weight from {} values",
                w.len()
            )));
        }
        let r = d_model.min(out);
        let rank = r.div_ceil(32) * 32;
        let (mut down, mut up) = (vec![0.0f32; d_model * rank], vec![0.0f32; rank * out]);
        let a: Vec<f64> = w.iter().map(|x| *x as f64).collect();
        let singular;
        if d_model >= out {
            // W = U Σ Vᵀ: down = U, up = Σ Vᵀ.
            let s = svd(&a, d_model, out)?;
            for i in 0..d_model {
                for k in 0..r {
                    down[i * rank + k] = s.u[i * r + k] as f32;
                }
            }
            for k in 0..r {
                for j in 0..out {
                    up[k * out + j] = (s.sigma[k] * s.v[j * r + k]) as f32;
                }
            }
            singular = s.sigma;
        } else {
            // Wᵀ = U' Σ V'ᵀ, so W = V' Σ U'ᵀ: down = V', up = Σ U'ᵀ.
            let t: Vec<f64> = (0..out)
                .flat_map(|j| (0..d_model).map(move |i| (i, j)))
                .map(|(i, j)| a[i * out + j])
                .collect();
            let s = svd(&t, out, d_model)?;
            for i in 0..d_model {
                for k in 0..r {
                    down[i * rank + k] = s.v[i * r + k] as f32;
                }
            }
            for k in 0..r {
                for j in 0..out {
                    up[k * out + j] = (s.sigma[k] * s.u[j * r + k]) as f32;
                }
            }
            singular = s.sigma;
        }
        Ok(Self {
            d_model,
            out,
            rank,
            down,
            up,
            singular,
        })
    }

    /// `x · down` for `[tokens][d_model]` rows: `[tokens][rank]`.
    pub fn project(&self, x: &[f32]) -> Vec<f32> {
        matmul64(x, &self.down, self.d_model, self.rank)
    }

    /// `latent · up` for `[tokens][rank]` rows: `[tokens][out]`.
    pub fn expand(&self, latent: &[f32]) -> Vec<f32> {
        matmul64(latent, &self.up, self.rank, self.out)
    }
}

/// `[rows][inner] × [inner][cols]` with f64 accumulation.
pub(crate) fn matmul64(a: &[f32], b: &[f32], inner: usize, cols: usize) -> Vec<f32> {
    let rows = a.len() / inner.max(1);
    let mut out = vec![0.0f32; rows * cols];
    let mut acc = vec![0.0f64; cols];
    for r in 0..rows {
        acc.iter_mut().for_each(|x| *x = 0.0);
        for (i, &x) in a[r * inner..(r + 1) * inner].iter().enumerate() {
            if x != 0.0 {
                for (o, w) in acc.iter_mut().zip(&b[i * cols..(i + 1) * cols]) {
                    *o += x as f64 * *w as f64;
                }
            }
        }
        for (o, x) in out[r * cols..(r + 1) * cols].iter_mut().zip(&acc) {
            *o = *x as f32;
        }
    }
    out
}

/// The K and V projections of one attention layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Projections {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub k: LatentProjection,
    pub v: LatentProjection,
}

impl Projections {
    /// From row-major `[d_model][kv_heads·head_dim]` weights (columns head-major: head `h`'s channel `c`
    /// is column `h·head_dim + c`, as in [`crate::synth::SynthLayer`]).
    pub fn from_weights(
        w_k: &[f32],
        w_v: &[f32],
        d_model: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self, RefError> {
        let out = kv_heads * head_dim;
        Ok(Self {
            kv_heads,
            head_dim,
            k: LatentProjection::from_weight(w_k, d_model, out)?,
            v: LatentProjection::from_weight(w_v, d_model, out)?,
        })
    }

    pub fn d_model(&self) -> usize {
        self.k.d_model
    }
}
