//! XQuant caches: quantized latents of the layer input, rematerialised to K̂/V̂.

use super::lift::lift;
use super::projection::{matmul64, Projections};
use crate::int::IntCache;
use crate::rope::Rope;
use crate::synth::to_head_major;
use crate::{Dequantized, KvTensor, RefError};
use kvq_spec::{CacheSource, SchemeSpec, XSource};

/// One sequence's XQuant cache of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct XQuantCache {
    spec: SchemeSpec,
    tokens: usize,
    rope: Rope,
    projections: Projections,
    latents: IntCache,
    base: Option<(Vec<f32>, Vec<f32>)>,
}

fn check_x(
    spec: &SchemeSpec,
    want: XSource,
    x: &[f32],
    proj: &Projections,
    what: &'static str,
) -> Result<usize, RefError> {
    if spec.source != CacheSource::X(want) {
        let entry = match want {
            XSource::Latent => "`XQuantCache::build` serves `source = x(latent)`",
            XSource::CrossLayer => {
                "`XQuantCache::build_cross_layer` serves `source = x(cross_layer)`"
            }
        };
        return Err(RefError::WrongEntryPoint(format!(
            "{entry}; this scheme is `{spec}`"
        )));
    }
    let d = proj.d_model();
    if d == 0 || x.len() % d != 0 {
        return Err(RefError::Mismatch(format!(
            "{what}: {} values are not rows of d_model = {d}",
            x.len()
        )));
    }
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(RefError::NonFinite {
            tensor: what,
            head: 0,
            token: i / d,
            channel: i % d,
            value: x[i],
        });
    }
    Ok(x.len() / d)
}

/// The scheme applied to latents: same quantizers and regions, K/V as the cached tensors.
fn latent_spec(spec: &SchemeSpec) -> SchemeSpec {
    SchemeSpec {
        source: CacheSource::Kv,
        ..*spec
    }
}

/// Values rounded to nearest f16 (the accumulator's latents and the lifted deltas, as the GPU
/// keeps them).
fn f16_rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&a| half::f16::from_f32(a).to_f32()).collect()
}

/// Widest store head for latents (the page quantizers' and boost's limit on a head's channels).
const MAX_STORE_WIDTH: usize = 256;

/// Channels of one head of the latents' integer store (docs/LAYOUT.md §10): the widest multiple of
/// 32 up to 256 that divides `rank` and under which both latents' quantizers accept the head.
/// A latent row of `rank` channels is stored as `rank / width` heads, so a token-axis quantizer
/// without a `group` takes one scale per head's part of the row, and every store width is one the
/// GPU's page quantizers and the XQuant decode serve.
pub fn latent_store_width(spec: &SchemeSpec, rank: usize) -> Result<usize, RefError> {
    let fits = |w: usize| {
        rank % w == 0
            && [("k", &spec.k), ("v", &spec.v)].iter().all(|(name, t)| {
                SchemeSpec::check_tensor_shape(name, t, w as u32, (rank / w) as u32).is_ok()
            })
    };
    (1..=MAX_STORE_WIDTH / 32)
        .rev()
        .map(|i| 32 * i)
        .find(|&w| fits(w))
        .ok_or_else(|| {
            RefError::Mismatch(format!(
                "latents of {rank} channels: no store head width (a multiple of 32 up to \
                 {MAX_STORE_WIDTH} dividing {rank}) that `{spec}` accepts"
            ))
        })
}

/// `[tokens][rank]` latents as the store's head-major `[rank / width][tokens][width]`.
fn latent_tensor(
    spec: &SchemeSpec,
    data: &[f32],
    tokens: usize,
    rank: usize,
) -> Result<KvTensor, RefError> {
    let width = latent_store_width(spec, rank)?;
    crate::synth::try_to_head_major(data, tokens, rank / width, width, "latents")
}

/// The store's head-major latents back to `[tokens][rank]` rows.
fn latent_rows(t: &KvTensor) -> Vec<f32> {
    let (heads, tokens, width) = (t.kv_heads, t.tokens, t.head_dim);
    let mut rows = Vec::with_capacity(heads * tokens * width);
    for tok in 0..tokens {
        for h in 0..heads {
            rows.extend_from_slice(t.row(h, tok));
        }
    }
    rows
}

impl XQuantCache {
    /// `source = x(latent)`: caches `X·down_k` and `X·down_v` of the `[tokens][d_model]` layer input.
    pub fn build(
        spec: &SchemeSpec,
        x: &[f32],
        projections: &Projections,
        rope: Rope,
    ) -> Result<Self, RefError> {
        check_x(spec, XSource::Latent, x, projections, "x")?;
        let (pk, pv) = (&projections.k, &projections.v);
        Self::from_latents(spec, &pk.project(x), &pv.project(x), projections, rope)
    }

    /// `source = x(latent)` from latents computed elsewhere (`[tokens][rank]` each, e.g. `X·down`
    /// on a GPU): quantized and stored as [`build`](Self::build) stores its own.
    pub fn from_latents(
        spec: &SchemeSpec,
        latent_k: &[f32],
        latent_v: &[f32],
        projections: &Projections,
        rope: Rope,
    ) -> Result<Self, RefError> {
        if spec.source != CacheSource::X(XSource::Latent) {
            return Err(RefError::WrongEntryPoint(format!(
                "`XQuantCache::from_latents` serves `source = x(latent)`; this scheme is `{spec}`"
            )));
        }
        Self::store_latents(spec, latent_k, latent_v, projections, rope)
    }

    /// `source = x(cross_layer)` from latents computed elsewhere: the deltas' latents (stored) and
    /// the accumulator's (`X̂_{i−1}·down`, added back when decoding), `[tokens][rank]` each.
    pub fn from_cross_layer_latents(
        spec: &SchemeSpec,
        (delta_k, delta_v): (&[f32], &[f32]),
        (base_k, base_v): (&[f32], &[f32]),
        projections: &Projections,
        rope: Rope,
    ) -> Result<Self, RefError> {
        if spec.source != CacheSource::X(XSource::CrossLayer) {
            return Err(RefError::WrongEntryPoint(format!(
                "`XQuantCache::from_cross_layer_latents` serves `source = x(cross_layer)`; this \
                 scheme is `{spec}`"
            )));
        }
        if base_k.len() != delta_k.len() || base_v.len() != delta_v.len() {
            return Err(RefError::Mismatch(format!(
                "the accumulator's latents ({} and {} values) and the deltas' ({} and {}) differ",
                base_k.len(),
                base_v.len(),
                delta_k.len(),
                delta_v.len()
            )));
        }
        let mut cache = Self::store_latents(spec, delta_k, delta_v, projections, rope)?;
        cache.base = Some((f16_rounded(base_k), f16_rounded(base_v)));
        Ok(cache)
    }

    fn store_latents(
        spec: &SchemeSpec,
        latent_k: &[f32],
        latent_v: &[f32],
        projections: &Projections,
        rope: Rope,
    ) -> Result<Self, RefError> {
        let (pk, pv) = (&projections.k, &projections.v);
        let rank = pk.rank.max(1);
        let tokens = latent_k.len() / rank;
        if latent_k.len() != tokens * pk.rank || latent_v.len() != tokens * pv.rank {
            return Err(RefError::Mismatch(format!(
                "latents of {} and {} values are not the same tokens of rank {} and {}",
                latent_k.len(),
                latent_v.len(),
                pk.rank,
                pv.rank
            )));
        }
        let lk = latent_tensor(spec, latent_k, tokens, pk.rank)?;
        let lv = latent_tensor(spec, latent_v, tokens, pv.rank)?;
        Ok(Self {
            spec: *spec,
            tokens,
            rope,
            projections: projections.clone(),
            latents: IntCache::build(&latent_spec(spec), &lk, &lv)?,
            base: None,
        })
    }

    /// `source = x(cross_layer)`: caches the latents of `X_i − X̂_{i−1}` (`x_hat_prev` is the accumulator
    /// after the previous layer; zeros for the first layer) and returns this layer's accumulator
    /// `X̂_i` for the next one ([`next_accumulator`](Self::next_accumulator), `docs/CODEBOOKS.md` §3).
    /// A token's stored delta, its accumulator's latents and `X̂_i` depend on that token's rows alone,
    /// so a cache built whole equals one built token by token (the GPU's writes).
    pub fn build_cross_layer(
        spec: &SchemeSpec,
        x: &[f32],
        x_hat_prev: &[f32],
        projections: &Projections,
        rope: Rope,
    ) -> Result<(Self, Vec<f32>), RefError> {
        let tokens = check_x(spec, XSource::CrossLayer, x, projections, "x")?;
        if check_x(
            spec,
            XSource::CrossLayer,
            x_hat_prev,
            projections,
            "x_hat_prev",
        )? != tokens
        {
            return Err(RefError::Mismatch(
                "x and x_hat_prev hold different token counts".into(),
            ));
        }
        let delta: Vec<f32> = x.iter().zip(x_hat_prev).map(|(a, b)| a - b).collect();
        let (pk, pv) = (&projections.k, &projections.v);
        let (delta_k, delta_v) = (pk.project(&delta), pv.project(&delta));
        let next = Self::next_accumulator(projections, x_hat_prev, &delta_k, &delta_v)?;
        let mut cache = Self::store_latents(spec, &delta_k, &delta_v, projections, rope)?;
        cache.base = Some((
            f16_rounded(&pk.project(x_hat_prev)),
            f16_rounded(&pv.project(x_hat_prev)),
        ));
        Ok((cache, next))
    }

    /// XQuant-CL's accumulator after a layer: `X̂_i = X̂_{i−1} + δ̂`, `δ̂` the least-squares X-space
    /// delta whose latents are the layer's delta latents `delta_k`, `delta_v` (`[tokens][rank]`)
    /// rounded to f16 as the FP16 regions hold them, before any page quantizes them. So the
    /// accumulator never depends on whether a token's page has closed: a streaming cache (where a
    /// page closes long after its tokens were written) and a whole-sequence build store the same
    /// deltas. Quantization errors do not reach later layers either: each layer's reconstruction
    /// is its own stored accumulator latents plus its own dequantized delta.
    pub fn next_accumulator(
        projections: &Projections,
        x_hat_prev: &[f32],
        delta_k: &[f32],
        delta_v: &[f32],
    ) -> Result<Vec<f32>, RefError> {
        let (d, rank) = (projections.d_model(), projections.k.rank);
        let tokens = x_hat_prev.len() / d.max(1);
        if d == 0
            || x_hat_prev.len() != tokens * d
            || delta_k.len() != tokens * rank
            || delta_v.len() != tokens * projections.v.rank
        {
            return Err(RefError::Mismatch(format!(
                "an accumulator of {} values (rows of d_model {d}) and delta latents of {} and {}                  (rows of {rank}) are not the same tokens",
                x_hat_prev.len(),
                delta_k.len(),
                delta_v.len()
            )));
        }
        let step = lift(
            projections,
            &f16_rounded(delta_k),
            &f16_rounded(delta_v),
            tokens,
        )?;
        Ok(x_hat_prev.iter().zip(&step).map(|(a, b)| a + b).collect())
    }

    pub fn spec(&self) -> &SchemeSpec {
        &self.spec
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn projections(&self) -> &Projections {
        &self.projections
    }

    /// The RoPE the keys are rebuilt with.
    pub fn rope(&self) -> Rope {
        self.rope
    }

    /// What is stored: the K latent as tensor `k` (per-channel in the scheme's spec) and the V latent as
    /// tensor `v` (per-token), each `[rank / width][tokens][width]` ([`latent_store_width`]), in the
    /// integer layout of `docs/LAYOUT.md`.
    /// For `x(cross_layer)` these are the latents of the delta `X_i − X̂_{i−1}`.
    pub fn stored(&self) -> &IntCache {
        &self.latents
    }

    /// `x(cross_layer)` only: the latents `X̂_{i−1}·down_k`, `X̂_{i−1}·down_v` of the accumulator,
    /// `[tokens][rank]` each, rounded to f16 and kept with the layer's cache (the decode adds them
    /// to the deltas).
    pub fn accumulator_latents(&self) -> Option<(&[f32], &[f32])> {
        self.base
            .as_ref()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
    }

    /// The latents as the kernel sees them (`[tokens][rank]` each): dequantized, plus the accumulator's
    /// latents for `x(cross_layer)`.
    pub fn latents(&self) -> (Vec<f32>, Vec<f32>, Vec<bool>) {
        let d = self.latents.dequantize();
        let (mut k, mut v) = (latent_rows(&d.k), latent_rows(&d.v));
        if let Some((bk, bv)) = &self.base {
            k.iter_mut().zip(bk).for_each(|(a, b)| *a += b);
            v.iter_mut().zip(bv).for_each(|(a, b)| *a += b);
        }
        (k, v, d.k_quantized)
    }

    /// Rematerialised `K̂ = RoPE(L̂_k · up_k)` and `V̂ = L̂_v · up_v`.
    pub fn dequantize(&self) -> Dequantized {
        let (lk, lv, k_quantized) = self.latents();
        let k = self.rebuild_k(&self.projections.k.expand(&lk));
        let (h, d) = (self.projections.kv_heads, self.projections.head_dim);
        let v = to_head_major(&self.projections.v.expand(&lv), self.tokens, h, d);
        Dequantized { k, v, k_quantized }
    }

    /// As [`dequantize`](Self::dequantize), with K rebuilt from the f16 roundings (to nearest) of
    /// the latents and of `up_k`, products summed in f64: what a one-pass f16 tensor-core rebuild
    /// computes up to its f32 sums (kvq-codegen's `RebuildPrecision::F16`).
    pub fn dequantize_f16_rebuild(&self) -> Dequantized {
        let (lk, lv, k_quantized) = self.latents();
        let round = |x: &[f32]| -> Vec<f32> {
            x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
        };
        let p = &self.projections;
        let k = self.rebuild_k(&matmul64(&round(&lk), &round(&p.k.up), p.k.rank, p.k.out));
        let v = to_head_major(&p.v.expand(&lv), self.tokens, p.kv_heads, p.head_dim);
        Dequantized { k, v, k_quantized }
    }

    /// K̂ and V̂ of KV head `head` alone (`[1][tokens][head_dim]` each, `k_quantized` as the whole
    /// cache's): bit for bit that head of [`dequantize_f16_rebuild`](Self::dequantize_f16_rebuild)
    /// when `f16_rebuild`, else of [`dequantize`](Self::dequantize), at `1 / kv_heads` of the
    /// cost. A long cache at real widths (latents of 1,024, 32K tokens) takes minutes to rebuild
    /// whole; checking a decode on one KV head takes seconds.
    pub fn dequantize_kv_head(
        &self,
        head: usize,
        f16_rebuild: bool,
    ) -> Result<Dequantized, RefError> {
        let p = &self.projections;
        let (h, d) = (p.kv_heads, p.head_dim);
        if head >= h {
            return Err(RefError::Mismatch(format!(
                "KV head {head} of a cache of {h} KV heads"
            )));
        }
        let (lk, lv, k_quantized) = self.latents();
        let columns = |lp: &super::LatentProjection| -> Vec<f32> {
            (0..lp.rank)
                .flat_map(|k| lp.up[k * lp.out + head * d..k * lp.out + (head + 1) * d].to_vec())
                .collect()
        };
        let round = |x: &[f32]| -> Vec<f32> {
            x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
        };
        let k_rows = if f16_rebuild {
            matmul64(&round(&lk), &round(&columns(&p.k)), p.k.rank, d)
        } else {
            matmul64(&lk, &columns(&p.k), p.k.rank, d)
        };
        let mut k = KvTensor::new(k_rows, 1, self.tokens, d)?;
        for t in 0..self.tokens {
            self.rope.apply(k.row_mut(0, t), t);
        }
        let v = KvTensor::new(
            matmul64(&lv, &columns(&p.v), p.v.rank, d),
            1,
            self.tokens,
            d,
        )?;
        Ok(Dequantized { k, v, k_quantized })
    }

    /// `[tokens][kv_heads·head_dim]` products to head-major K with RoPE at each position.
    fn rebuild_k(&self, rows: &[f32]) -> KvTensor {
        let (h, d) = (self.projections.kv_heads, self.projections.head_dim);
        let mut k = to_head_major(rows, self.tokens, h, d);
        for head in 0..h {
            for t in 0..self.tokens {
                self.rope.apply(k.row_mut(head, t), t);
            }
        }
        k
    }

    /// `Σ_t p_t v̂_t` `[q_heads][head_dim]` without rematerialising V: `(Σ_t p_t l̂_t) · up_v`.
    pub fn weighted_values(&self, probs: &[f64], q_heads: usize) -> Result<Vec<f32>, RefError> {
        let (h, d, len) = (
            self.projections.kv_heads,
            self.projections.head_dim,
            self.tokens,
        );
        if h == 0 || q_heads % h != 0 || probs.len() != q_heads * len {
            return Err(RefError::Mismatch(format!(
                "{} probabilities for {q_heads} query heads over {len} tokens and {h} KV heads",
                probs.len()
            )));
        }
        let (_, lv, _) = self.latents();
        let pv = &self.projections.v;
        let mut out = vec![0.0f32; q_heads * d];
        for qh in 0..q_heads {
            let head = qh / (q_heads / h);
            let mut mix = vec![0.0f64; pv.rank];
            for (t, p) in probs[qh * len..(qh + 1) * len].iter().enumerate() {
                for (m, l) in mix.iter_mut().zip(&lv[t * pv.rank..(t + 1) * pv.rank]) {
                    *m += p * *l as f64;
                }
            }
            let mix: Vec<f32> = mix.iter().map(|x| *x as f32).collect();
            let head_up: Vec<f32> = (0..pv.rank)
                .flat_map(|k| {
                    pv.up[k * pv.out + head * d..k * pv.out + (head + 1) * d]
                        .iter()
                        .copied()
                })
                .collect();
            out[qh * d..(qh + 1) * d].copy_from_slice(&matmul64(&mix, &head_up, pv.rank, d));
        }
        Ok(out)
    }

    /// Bytes this sequence stores (both latents: pools and FP16 buffers; for `x(cross_layer)` also
    /// the accumulator's latents, f16, 4·R bytes a token).
    pub fn allocated_bytes(&self) -> usize {
        let base = self
            .base
            .as_ref()
            .map_or(0, |(k, v)| 2 * (k.len() + v.len()));
        self.latents.allocated_bytes() + base
    }

    /// Allocated bits (FP16 buffers at full capacity included) per element of the K and V it stands
    /// for (`2 · tokens · kv_heads · head_dim`).
    pub fn bits_per_kv_element(&self) -> f64 {
        let elements = 2 * self.tokens * self.projections.kv_heads * self.projections.head_dim;
        8.0 * self.allocated_bytes() as f64 / elements.max(1) as f64
    }

    /// Bits of the quantized pages (codes and their scales/zeros) per K/V element those pages stand for;
    /// 0 when no page is full yet.
    pub fn page_bits_per_kv_element(&self) -> f64 {
        let (k, v) = (self.latents.k(), self.latents.v());
        let tokens = k.pages() * k.page();
        let elements = 2 * tokens * self.projections.kv_heads * self.projections.head_dim;
        if elements == 0 {
            return 0.0;
        }
        8.0 * (k.pool().len() + v.pool().len()) as f64 / elements as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_kv_head_is_that_head_of_the_whole_rebuild() {
        let spec: SchemeSpec =
            "k = int(2, channel), v = int(2, token), sink = 4, source = x(latent)"
                .parse()
                .unwrap();
        let (kv, d, dm, tokens) = (3usize, 32usize, 64usize, 150usize);
        let p = Projections::synthetic(kv, d, dm, 5).unwrap();
        let mut rng = crate::synth::SynthRng::new(9);
        let mut lat = || -> Vec<f32> { (0..tokens * p.k.rank).map(|_| rng.symmetric()).collect() };
        let (lk, lv) = (lat(), lat());
        let cache = XQuantCache::from_latents(&spec, &lk, &lv, &p, Rope::default()).unwrap();
        for f16 in [false, true] {
            let whole = if f16 {
                cache.dequantize_f16_rebuild()
            } else {
                cache.dequantize()
            };
            for head in 0..kv {
                let one = cache.dequantize_kv_head(head, f16).unwrap();
                assert_eq!(one.k_quantized, whole.k_quantized);
                for t in [0, 3, 77, tokens - 1] {
                    assert_eq!(one.k.row(0, t), whole.k.row(head, t), "{f16} {head} {t}");
                    assert_eq!(one.v.row(0, t), whole.v.row(head, t), "{f16} {head} {t}");
                }
            }
        }
        assert!(cache.dequantize_kv_head(kv, true).is_err());
    }

    #[test]
    fn store_width_is_the_widest_head_the_quantizers_take() {
        let plain: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(latent)"
            .parse()
            .unwrap();
        for (rank, width) in [(1024, 256), (192, 192), (96, 96), (320, 160), (32, 32)] {
            assert_eq!(latent_store_width(&plain, rank).unwrap(), width, "{rank}");
        }
        // Token groups of 64 must divide the head: 320 = 5 × 64 takes heads of 64.
        let grouped: SchemeSpec =
            "k = int(2, channel), v = int(2, token, group = 64), source = x(latent)"
                .parse()
                .unwrap();
        assert_eq!(latent_store_width(&grouped, 320).unwrap(), 64);
        assert!(latent_store_width(&grouped, 96).is_err());
        // Rows round-trip through the head-major store.
        let rows: Vec<f32> = (0..3 * 512).map(|i| i as f32).collect();
        let t = latent_tensor(&plain, &rows, 3, 512).unwrap();
        assert_eq!((t.kv_heads, t.head_dim), (2, 256));
        assert_eq!(t.row(1, 2)[0], (2 * 512 + 256) as f32);
        assert_eq!(latent_rows(&t), rows);
    }
}
