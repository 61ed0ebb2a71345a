//! [`XQuantDeviceCache`]: a batch's XQuant caches built by the CPU reference, uploaded whole (tests,
//! `kvq demo`, benchmarks). Engines write theirs on the device: [`super::XQuantPagedCache`].

use super::weights::{invalid, XQuantWeights};
use crate::decode::{upload, GpuCache};
use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaStream};
use kvq_reference::xquant::XQuantCache;
use kvq_spec::{CacheSource, XSource};
use std::sync::Arc;

/// A batch's XQuant caches in device memory: the latents' integer store (docs/LAYOUT.md §10),
/// the layer's projections ([`XQuantWeights`]) and, for XQuant-CL, the accumulator's latents.
pub struct XQuantDeviceCache {
    pub(super) latents: GpuCache,
    pub(super) weights: XQuantWeights,
    /// XQuant-CL: the accumulator's latents (`X̂_{i−1}·down_k`, `·down_v`), f16
    /// `[batch][base_rows][rank]`, which the decode adds to the stored deltas.
    pub(super) base: Option<(CudaSlice<u16>, CudaSlice<u16>)>,
    pub(super) base_rows: usize,
}

impl XQuantDeviceCache {
    /// Uploads `caches` (one per sequence, all of one scheme, projections and RoPE).
    pub fn upload(stream: &Arc<CudaStream>, caches: &[XQuantCache]) -> Result<Self> {
        let first = caches
            .first()
            .ok_or_else(|| invalid("a batch of no sequences".into()))?;
        for (i, c) in caches.iter().enumerate() {
            if c.spec() != first.spec()
                || c.projections() != first.projections()
                || c.rope() != first.rope()
            {
                return Err(invalid(format!(
                    "sequence {i} differs from sequence 0 in scheme, projections or RoPE"
                )));
            }
        }
        let stored: Vec<&kvq_reference::int::IntCache> =
            caches.iter().map(|c| c.stored()).collect();
        let latents = GpuCache::upload(stream, &stored)?;
        let base_rows = latents.max_len().max(1);
        let base = match first.spec().source {
            CacheSource::X(XSource::CrossLayer) => {
                let rank = first.projections().k.rank;
                let (mut k, mut v) = (
                    vec![0u16; caches.len() * base_rows * rank],
                    vec![0u16; caches.len() * base_rows * rank],
                );
                // The reference keeps them rounded to f16 already: the bits are exact.
                let bits = |dst: &mut [u16], src: &[f32]| {
                    dst.iter_mut()
                        .zip(src)
                        .for_each(|(d, s)| *d = half::f16::from_f32(*s).to_bits())
                };
                for (i, c) in caches.iter().enumerate() {
                    let (bk, bv) = c.accumulator_latents().ok_or_else(|| {
                        invalid(format!(
                            "sequence {i}: a cross-layer cache without its accumulator"
                        ))
                    })?;
                    let at = i * base_rows * rank;
                    bits(&mut k[at..at + bk.len()], bk);
                    bits(&mut v[at..at + bv.len()], bv);
                }
                Some((
                    upload(stream, &k, 0, "the accumulator's K latents")?,
                    upload(stream, &v, 0, "the accumulator's V latents")?,
                ))
            }
            _ => None,
        };
        let weights = XQuantWeights::upload(
            stream,
            first.spec(),
            first.projections(),
            first.rope(),
            None,
        )?;
        Ok(Self {
            latents,
            weights,
            base,
            base_rows,
        })
    }

    /// Sequences of the batch.
    pub fn batch(&self) -> usize {
        self.latents.batch()
    }

    /// The longest sequence's tokens.
    pub fn max_len(&self) -> usize {
        self.latents.max_len()
    }

    /// Device bytes of the latents' store (pages, FP16 rows, page table, lengths); the
    /// projections' factors not included.
    pub fn latent_bytes(&self) -> usize {
        self.latents.device_bytes()
    }
}
