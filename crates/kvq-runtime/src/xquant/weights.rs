//! [`XQuantWeights`]: one layer's projections on the device, as the decode and the cache writes
//! read them.

use crate::decode::upload;
use crate::error::{Result, RuntimeError};
use crate::launch::Input;
use cudarc::driver::{CudaSlice, CudaStream};
use kvq_codegen::{rebuild_k_order, Dtype};
use kvq_reference::rope::Rope;
use kvq_reference::xquant::{latent_store_width, Projections};
use kvq_spec::{CacheSource, SchemeSpec, XSource};
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

/// `hi` (`[kv_heads·d][rank]`, up_kᵀ) as `[kv_heads][rank / 8][d][8]`, each block of 16 latents
/// in the warpgroup rebuild's K order (`kvq_codegen::rebuild_k_order`: slot `k` of a block holds
/// its latent `order[k]`).
fn k_groups(hi: &[u16], kv_heads: usize, d: usize, rank: usize, order: &[usize; 16]) -> Vec<u16> {
    let mut out = vec![0u16; hi.len()];
    for h in 0..kv_heads {
        for col in 0..d {
            let row = &hi[(h * d + col) * rank..(h * d + col + 1) * rank];
            for slot in 0..rank {
                let c = slot / 16 * 16 + order[slot % 16];
                out[((h * (rank / 8) + slot / 8) * d + col) * 8 + slot % 8] = row[c];
            }
        }
    }
    out
}

/// A layer's projections on the host, in the formats and layouts the kernels read.
struct HostWeights {
    kv_heads: usize,
    head_dim: usize,
    d_model: usize,
    rank: usize,
    store_width: usize,
    up_k_hi: Vec<u16>,
    up_k_lo: Vec<u16>,
    up_k_groups: Vec<u16>,
    up_v: Vec<f32>,
    rope_freq: Vec<f64>,
    /// `[2·rank][d_model]` halves (hi, lo) in the layer input's dtype.
    down: Option<(Vec<u16>, Vec<u16>, Dtype)>,
}

impl HostWeights {
    /// Checks `projections` against `spec` and lays them out; `writes` (the layer input's dtype)
    /// adds the down factors the cache writes project with.
    fn new(
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
        let rope_freq: Vec<f64> = (0..d / 2)
            .map(|i| rope.theta.powf(-2.0 * i as f64 / d as f64))
            .collect();
        let (up_k_hi, up_k_lo) = split_transposed(&p.k.up, rank, p.k.out, Dtype::F16);
        // The rank is a multiple of 32 (kvq_reference::xquant::projection pads it).
        let up_k_groups = k_groups(&up_k_hi, h, d, rank, &rebuild_k_order(spec));
        let down = writes.map(|dtype| {
            // [d_model][2·rank]: K's latent columns, then V's.
            let dm = p.k.d_model;
            let mut both = vec![0f32; dm * 2 * rank];
            for i in 0..dm {
                both[i * 2 * rank..i * 2 * rank + rank]
                    .copy_from_slice(&p.k.down[i * rank..(i + 1) * rank]);
                both[i * 2 * rank + rank..(i + 1) * 2 * rank]
                    .copy_from_slice(&p.v.down[i * rank..(i + 1) * rank]);
            }
            let (hi, lo) = split_transposed(&both, dm, 2 * rank, dtype);
            (hi, lo, dtype)
        });
        Ok(Self {
            kv_heads: h,
            head_dim: d,
            d_model: p.k.d_model,
            rank,
            store_width,
            up_k_hi,
            up_k_lo,
            up_k_groups,
            up_v: p.v.up.clone(),
            rope_freq,
            down,
        })
    }
}

/// The buffers of a layer's projections as one launch reads them: kvq's allocations
/// ([`XQuantWeights::inputs`]) or sections of an engine's buffer ([`XQuantWeightsLayout::inputs`]).
#[derive(Clone, Copy)]
pub struct XQuantWeightInputs<'a> {
    pub(super) spec: SchemeSpec,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) d_model: usize,
    pub(super) rank: usize,
    pub(super) up_k_hi: Input<'a, u16>,
    pub(super) up_k_lo: Input<'a, u16>,
    pub(super) up_k_groups: Input<'a, u16>,
    pub(super) up_v: Input<'a, f32>,
    pub(super) rope_freq: Input<'a, f64>,
    /// The down factors (hi, lo) and the layer input's dtype, where the writes project.
    pub(super) down: Option<(Input<'a, u16>, Input<'a, u16>, Dtype)>,
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
        let w = HostWeights::new(spec, projections, rope, writes)?;
        let down = match &w.down {
            None => None,
            Some((hi, lo, dtype)) => Some((
                upload(stream, hi, 0, "down (high half)")?,
                upload(stream, lo, 0, "down (low half)")?,
                *dtype,
            )),
        };
        Ok(Self {
            spec: *spec,
            kv_heads: w.kv_heads,
            head_dim: w.head_dim,
            d_model: w.d_model,
            rank: w.rank,
            store_width: w.store_width,
            up_k_hi: upload(stream, &w.up_k_hi, 0, "up_k (high half)")?,
            up_k_lo: upload(stream, &w.up_k_lo, 0, "up_k (low half)")?,
            up_k_groups: upload(stream, &w.up_k_groups, 0, "up_k (in K groups)")?,
            up_v: upload(stream, &w.up_v, 0.0, "up_v")?,
            rope_freq: upload(stream, &w.rope_freq, 0.0, "the RoPE frequencies")?,
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

    /// These buffers as a launch takes them.
    pub fn inputs(&self) -> XQuantWeightInputs<'_> {
        XQuantWeightInputs {
            spec: self.spec,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            d_model: self.d_model,
            rank: self.rank,
            up_k_hi: Input::Slice(&self.up_k_hi),
            up_k_lo: Input::Slice(&self.up_k_lo),
            up_k_groups: Input::Slice(&self.up_k_groups),
            up_v: Input::Slice(&self.up_v),
            rope_freq: Input::Slice(&self.rope_freq),
            down: self
                .down
                .as_ref()
                .map(|(hi, lo, dtype)| (Input::Slice(hi), Input::Slice(lo), *dtype)),
        }
    }
}

/// Sections of [`XQuantWeightsLayout`], in buffer order.
const SECTIONS: usize = 8;
/// The lift matrix's section (XQuant-CL; 0 bytes for `x(latent)`).
const LIFT: usize = 7;

/// Where a layer's packed projections lie in one device buffer an engine owns (the engine
/// surface's `xquant_weights`): `up_k` as two f16 halves `[kv_heads·head_dim][rank]` and again in
/// K groups `[kv_heads][rank / 8][head_dim][8]`, `up_v` f32 `[rank][kv_heads·head_dim]`, the RoPE
/// frequencies f64 `[head_dim / 2]`, `[down_k | down_v]ᵀ` as two halves `[2·rank][d_model]`
/// in the layer input's dtype and, for XQuant-CL, the lift matrix f32 `[2·rank][d_model]`
/// (`Projections::lift_matrix`), each section starting on a 256-byte boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XQuantWeightsLayout {
    /// KV heads of the rebuilt K.
    pub kv_heads: usize,
    /// Channels a KV head.
    pub head_dim: usize,
    /// Width of the layer input.
    pub d_model: usize,
    /// Latent width `R`: `min(d_model, kv_heads·head_dim)` rounded up to 32, as the SVD pads it.
    pub rank: usize,
    /// Whether the buffer holds XQuant-CL's lift matrix.
    pub cross_layer: bool,
    /// `(offset, bytes)` of each section.
    sections: [(usize, usize); SECTIONS],
    /// Bytes of the whole buffer.
    pub bytes: usize,
}

impl XQuantWeightsLayout {
    /// The layout for `kv_heads × head_dim` keys and values from a `d_model`-wide layer input,
    /// with the lift matrix where `cross_layer`; `None` where a size passes the address space.
    pub fn new(
        kv_heads: usize,
        head_dim: usize,
        d_model: usize,
        cross_layer: bool,
    ) -> Option<Self> {
        let out = kv_heads.checked_mul(head_dim)?;
        let rank = d_model.min(out).checked_next_multiple_of(32)?;
        let halves = out.checked_mul(rank)?.checked_mul(2)?;
        let down = rank.checked_mul(2)?.checked_mul(d_model)?.checked_mul(2)?;
        let sizes = [
            halves,
            halves,
            halves,
            halves.checked_mul(2)?,
            8 * (head_dim / 2),
            down,
            down,
            if cross_layer { down.checked_mul(2)? } else { 0 },
        ];
        let mut sections = [(0, 0); SECTIONS];
        let mut at = 0usize;
        for (s, bytes) in sections.iter_mut().zip(sizes) {
            *s = (at, bytes);
            at = at.checked_add(bytes)?.checked_next_multiple_of(256)?;
        }
        Some(Self {
            kv_heads,
            head_dim,
            d_model,
            rank,
            cross_layer,
            sections,
            bytes: at,
        })
    }

    /// `projections` (of this shape) and the RoPE of `rope` packed for `spec`, the down factors
    /// in `input` (the layer input's dtype): the bytes the engine's buffer holds. XQuant-CL's
    /// lift matrix is solved here, on the host (seconds at d_model 4,096: docs/CODEBOOKS.md §3).
    pub fn pack(
        &self,
        spec: &SchemeSpec,
        projections: &Projections,
        rope: Rope,
        input: Dtype,
    ) -> Result<Vec<u8>> {
        let p = projections;
        let shape = (p.kv_heads, p.head_dim, p.k.d_model, p.k.rank);
        if shape != (self.kv_heads, self.head_dim, self.d_model, self.rank) {
            return Err(invalid(format!(
                "projections for {} KV heads of {}, d_model {}, latents of {}; the buffer is laid \
                 out for {} of {}, {}, {}",
                shape.0,
                shape.1,
                shape.2,
                shape.3,
                self.kv_heads,
                self.head_dim,
                self.d_model,
                self.rank
            )));
        }
        let cross_layer = matches!(spec.source, CacheSource::X(XSource::CrossLayer));
        if cross_layer != self.cross_layer {
            return Err(invalid(format!(
                "`{spec}` {} the lift matrix; the buffer is laid out {} it",
                if cross_layer {
                    "needs"
                } else {
                    "has no use for"
                },
                if self.cross_layer { "with" } else { "without" }
            )));
        }
        let w = HostWeights::new(spec, projections, rope, Some(input))?;
        let Some((down_hi, down_lo, _)) = &w.down else {
            return Err(invalid("no down factors".into()));
        };
        let mut bytes = vec![0u8; self.bytes];
        let mut put = |i: usize, data: Vec<u8>| {
            let (at, len) = self.sections[i];
            debug_assert_eq!(len, data.len());
            bytes[at..at + data.len()].copy_from_slice(&data);
        };
        let le16 = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        put(0, le16(&w.up_k_hi));
        put(1, le16(&w.up_k_lo));
        put(2, le16(&w.up_k_groups));
        put(3, w.up_v.iter().flat_map(|x| x.to_le_bytes()).collect());
        put(
            4,
            w.rope_freq.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
        put(5, le16(down_hi));
        put(6, le16(down_lo));
        if cross_layer {
            let lift = projections.lift_matrix()?;
            put(LIFT, lift.iter().flat_map(|x| x.to_le_bytes()).collect());
        }
        Ok(bytes)
    }

    /// The sections of a buffer at device address `base` as a launch takes them, for `spec`'s
    /// decode and for writes from a layer input of `input`.
    pub fn inputs(
        &self,
        spec: &SchemeSpec,
        base: u64,
        input: Dtype,
    ) -> XQuantWeightInputs<'static> {
        let at = |i: usize| base + self.sections[i].0 as u64;
        XQuantWeightInputs {
            spec: *spec,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            d_model: self.d_model,
            rank: self.rank,
            up_k_hi: Input::Raw(at(0)),
            up_k_lo: Input::Raw(at(1)),
            up_k_groups: Input::Raw(at(2)),
            up_v: Input::Raw(at(3)),
            rope_freq: Input::Raw(at(4)),
            down: Some((Input::Raw(at(5)), Input::Raw(at(6)), input)),
        }
    }

    /// The lift matrix's address in a buffer at `base` (XQuant-CL's layouts only).
    pub fn lift(&self, base: u64) -> Option<u64> {
        self.cross_layer
            .then(|| base + self.sections[LIFT].0 as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_groups_put_each_group_of_eight_latents_beside_the_columns_in_the_rebuild_order() {
        let (kv, d, rank) = (2, 3, 32);
        let hi: Vec<u16> = (0..kv * d * rank).map(|i| i as u16).collect();
        let spec: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(latent)"
            .parse()
            .unwrap();
        let order = rebuild_k_order(&spec);
        let g = k_groups(&hi, kv, d, rank, &order);
        let natural = k_groups(&hi, kv, d, rank, &std::array::from_fn(|k| k));
        for h in 0..kv {
            for col in 0..d {
                for slot in 0..rank {
                    let at = ((h * (rank / 8) + slot / 8) * d + col) * 8 + slot % 8;
                    assert_eq!(
                        natural[at],
                        hi[(h * d + col) * rank + slot],
                        "{h} {col} {slot}"
                    );
                    let c = slot / 16 * 16 + order[slot % 16];
                    assert_eq!(g[at], hi[(h * d + col) * rank + c], "{h} {col} {slot}");
                }
            }
        }
        // Slot 1 of a 2-bit block reads channel 8: the pair's second code, 16 bits on.
        assert_eq!(order[1], 8);
    }

    #[test]
    fn the_layout_packs_each_section_on_its_boundary() {
        use kvq_reference::synth::{generate, SynthConfig};
        let (kv, d, dm) = (2, 64, 96);
        let layer = generate(&SynthConfig {
            tokens: 4,
            kv_heads: kv,
            gqa: 1,
            head_dim: d,
            d_model: dm,
            ..Default::default()
        });
        let p = Projections::from_weights(&layer.layer.w_k, &layer.layer.w_v, dm, kv, d).unwrap();
        let spec: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(latent)"
            .parse()
            .unwrap();
        let layout = XQuantWeightsLayout::new(kv, d, dm, false).unwrap();
        // min(96, 128) = 96 latents, already a multiple of 32.
        assert_eq!(layout.rank, 96);
        let bytes = layout.pack(&spec, &p, layer.rope, Dtype::Bf16).unwrap();
        assert_eq!(bytes.len(), layout.bytes);
        let host = HostWeights::new(&spec, &p, layer.rope, Some(Dtype::Bf16)).unwrap();
        let u16s = |i: usize| -> Vec<u16> {
            let (at, len) = layout.sections[i];
            assert_eq!(at % 256, 0, "section {i}");
            bytes[at..at + len]
                .chunks(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        assert_eq!(u16s(0), host.up_k_hi);
        assert_eq!(u16s(1), host.up_k_lo);
        assert_eq!(u16s(2), host.up_k_groups);
        let (down_hi, down_lo, _) = host.down.as_ref().unwrap();
        assert_eq!(&u16s(5), down_hi);
        assert_eq!(&u16s(6), down_lo);
        let (at, len) = layout.sections[3];
        let up_v: Vec<f32> = bytes[at..at + len]
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(up_v, p.v.up);
        let (at, _) = layout.sections[4];
        let f1 = f64::from_le_bytes(bytes[at + 8..at + 16].try_into().unwrap());
        assert_eq!(f1, layer.rope.theta.powf(-2.0 / d as f64));
        // Projections of another shape are refused, naming both.
        let other = XQuantWeightsLayout::new(kv, d, 128, false).unwrap();
        let e = other.pack(&spec, &p, layer.rope, Dtype::Bf16).unwrap_err();
        assert!(e.to_string().contains("d_model 96"), "{e}");
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
