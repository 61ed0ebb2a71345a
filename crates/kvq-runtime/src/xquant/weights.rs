//! [`XQuantWeights`]: one layer's projections on the device, as the decode and the cache writes
//! read them.

use crate::decode::upload;
use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaSlice, CudaStream};
use kvq_codegen::Dtype;
use kvq_reference::rope::Rope;
use kvq_reference::xquant::{latent_store_width, Projections};
use kvq_spec::{CacheSource, SchemeSpec};
use std::sync::Arc;

/// A layer's XQuant projections in device memory: `up_k` transposed and split in two f16 halves
/// (the decode's tensor-core rebuild), the high half again in K groups (the warpgroup rebuild's
/// copies), `up_v` in f32, the RoPE frequencies, and — for the cache
/// writes — `[down_k | down_v]` transposed and split in two halves of the layer input's format.
pub struct XQuantWeights {
    pub(super) spec: SchemeSpec,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) d_model: usize,
    pub(super) rank: usize,
    pub(super) store_width: usize,
    pub(super) up_k_hi: CudaSlice<u16>,
    pub(super) up_k_lo: CudaSlice<u16>,
    /// The high half as `[kv_heads][rank / 8][head_dim][8]`: any run of whole 8-latent groups
    /// of a KV head is one contiguous copy into the warpgroup rebuild's shared-memory layout.
    pub(super) up_k_groups: CudaSlice<u16>,
    pub(super) up_v: CudaSlice<f32>,
    pub(super) rope_freq: CudaSlice<f64>,
    /// `[2·rank][d_model]` halves in `down_dtype` (hi, lo).
    pub(super) down: Option<(CudaSlice<u16>, CudaSlice<u16>, Dtype)>,
}

pub(super) fn invalid(msg: String) -> RuntimeError {
    RuntimeError::InvalidInput(msg)
}

/// `m` (`[rows][cols]` f32) transposed to `[cols][rows]` and split into two 16-bit halves,
/// `x ≈ hi + lo` (each rounded to nearest in `dtype`; in f16 the low half's subnormals bound the
/// error by 2⁻²⁵ in absolute terms, far below a projection's weights of about 1/√d_model).
fn split_transposed(m: &[f32], rows: usize, cols: usize, dtype: Dtype) -> (Vec<u16>, Vec<u16>) {
    let round = |x: f32| -> (u16, f32) {
        match dtype {
            Dtype::F16 => {
                let h = half::f16::from_f32(x);
                (h.to_bits(), h.to_f32())
            }
            Dtype::Bf16 => {
                let h = half::bf16::from_f32(x);
                (h.to_bits(), h.to_f32())
            }
        }
    };
    let (mut hi, mut lo) = (vec![0u16; rows * cols], vec![0u16; rows * cols]);
    for r in 0..rows {
        for c in 0..cols {
            let x = m[r * cols + c];
            let (h, hv) = round(x);
            hi[c * rows + r] = h;
            lo[c * rows + r] = round(x - hv).0;
        }
    }
    (hi, lo)
}

/// `hi` (`[kv_heads·d][rank]`, up_kᵀ) as `[kv_heads][rank / 8][d][8]`.
fn k_groups(hi: &[u16], kv_heads: usize, d: usize, rank: usize) -> Vec<u16> {
    let mut out = vec![0u16; hi.len()];
    for h in 0..kv_heads {
        for col in 0..d {
            let row = &hi[(h * d + col) * rank..(h * d + col + 1) * rank];
            for (c, &x) in row.iter().enumerate() {
                out[((h * (rank / 8) + c / 8) * d + col) * 8 + c % 8] = x;
            }
        }
    }
    out
}

impl XQuantWeights {
    /// Uploads `projections` and `rope` for the decode of `spec` (an XQuant scheme); with
    /// `writes` (the layer input's dtype), also the down factors the cache writes project with.
    pub fn upload(
        stream: &Arc<CudaStream>,
        spec: &SchemeSpec,
        projections: &Projections,
        rope: Rope,
        writes: Option<Dtype>,
    ) -> Result<Self> {
        if !matches!(spec.source, CacheSource::X(_)) {
            return Err(invalid(format!(
                "`{spec}` caches K and V; XQuant weights serve `source = x(...)` schemes"
            )));
        }
        let p = projections;
        if p.k.rank != p.v.rank || p.k.d_model != p.v.d_model {
            return Err(invalid(format!(
                "K and V latents differ: ranks {} and {}, d_model {} and {}",
                p.k.rank, p.v.rank, p.k.d_model, p.v.d_model
            )));
        }
        let (h, d, rank) = (p.kv_heads, p.head_dim, p.k.rank);
        let store_width = latent_store_width(spec, rank)?;
        let freq: Vec<f64> = (0..d / 2)
            .map(|i| rope.theta.powf(-2.0 * i as f64 / d as f64))
            .collect();
        let (hi, lo) = split_transposed(&p.k.up, rank, p.k.out, Dtype::F16);
        // The rank is a multiple of 32 (kvq_reference::xquant::projection pads it).
        let groups = k_groups(&hi, h, d, rank);
        let down = match writes {
            None => None,
            Some(dtype) => {
                // [d_model][2·rank]: K's latent columns, then V's.
                let dm = p.k.d_model;
                let mut both = vec![0f32; dm * 2 * rank];
                for i in 0..dm {
                    both[i * 2 * rank..i * 2 * rank + rank]
                        .copy_from_slice(&p.k.down[i * rank..(i + 1) * rank]);
                    both[i * 2 * rank + rank..(i + 1) * 2 * rank]
                        .copy_from_slice(&p.v.down[i * rank..(i + 1) * rank]);
                }
                let (dhi, dlo) = split_transposed(&both, dm, 2 * rank, dtype);
                Some((
                    upload(stream, &dhi, 0, "down (high half)")?,
                    upload(stream, &dlo, 0, "down (low half)")?,
                    dtype,
                ))
            }
        };
        Ok(Self {
            spec: *spec,
            kv_heads: h,
            head_dim: d,
            d_model: p.k.d_model,
            rank,
            store_width,
            up_k_hi: upload(stream, &hi, 0, "up_k (high half)")?,
            up_k_lo: upload(stream, &lo, 0, "up_k (low half)")?,
            up_k_groups: upload(stream, &groups, 0, "up_k (in K groups)")?,
            up_v: upload(stream, &p.v.up, 0.0, "up_v")?,
            rope_freq: upload(stream, &freq, 0.0, "the RoPE frequencies")?,
            down,
        })
    }

    /// The latent width `R`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Channels of a store head (`rank / store_width` heads a latent row).
    pub fn store_width(&self) -> usize {
        self.store_width
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_groups_put_each_group_of_eight_latents_beside_the_columns() {
        let (kv, d, rank) = (2, 3, 16);
        let hi: Vec<u16> = (0..kv * d * rank).map(|i| i as u16).collect();
        let g = k_groups(&hi, kv, d, rank);
        for h in 0..kv {
            for col in 0..d {
                for c in 0..rank {
                    let at = ((h * (rank / 8) + c / 8) * d + col) * 8 + c % 8;
                    assert_eq!(g[at], hi[(h * d + col) * rank + c], "{h} {col} {c}");
                }
            }
        }
    }

    #[test]
    fn split_halves_transpose_and_sum_back() {
        let m = [1.0f32 + 1e-5, -3.25, 1e-3 / 3.0, 7.0, 0.1, -0.2];
        for dtype in [Dtype::F16, Dtype::Bf16] {
            let (hi, lo) = split_transposed(&m, 2, 3, dtype);
            let back = |bits: u16| match dtype {
                Dtype::F16 => half::f16::from_bits(bits).to_f32(),
                Dtype::Bf16 => half::bf16::from_bits(bits).to_f32(),
            };
            for r in 0..2 {
                for c in 0..3 {
                    let x = m[r * 3 + c];
                    let y = back(hi[c * 2 + r]) + back(lo[c * 2 + r]);
                    // f16's low half is subnormal below 2⁻¹⁴: an absolute floor of half its
                    // smallest step, 2⁻²⁵.
                    let (rel, abs) = match dtype {
                        Dtype::F16 => (1e-6, 2f32.powi(-25)),
                        Dtype::Bf16 => (2e-5, 0.0),
                    };
                    assert!((x - y).abs() <= rel * x.abs() + abs, "{dtype:?} {x} {y}");
                }
            }
        }
    }
}
