//! Seeded synthetic attention layers with the structure that makes KV quantization hard in real
//! models: heavy-tailed activations, a few "massive" hidden dimensions, key outlier channels (in slowly
//! rotating RoPE pairs, as observed in LLaMA-family models), attention-sink tokens, RoPE applied, and
//! queries aligned with the keys so attention is peaky rather than uniform.
//!
//! K and V come from an explicit layer (`K = RoPE(X·W_k)`, `V = X·W_v`), so XQuant's rematerialisation
//! can be checked on the same data; `x_prev` is the previous layer's input for XQuant-CL.
//!
//! For sizes where that layer costs too much (a 128K-token cache is 268M values), [`random_kv`]
//! draws K/V directly from [`SynthRng`]: fast, seeded, never zero, with a few large-magnitude key
//! channels. It is the one fast generator the tuner, the bench, `kvq demo`, `kvq gen`'s sample
//! and the GPU tests share, so "the same seed" means the same data everywhere.

use crate::attention::Queries;
use crate::resources::{self, AllocError};
use crate::rope::Rope;
use crate::{KvTensor, RefError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal, StudentT};

/// SplitMix64: one multiply-xorshift chain per value. Speed matters more than statistical
/// quality for [`random_kv`], hence no cryptographic or crate-provided generator.
#[derive(Clone, Debug)]
pub struct SynthRng(u64);

impl SynthRng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> SynthRng {
        SynthRng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn symmetric(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// The distribution of [`random_kv`]'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tails {
    /// Uniform values in `[-1, 1)` plus a per-token offset in `[-0.25, 0.25)`: what the tuner
    /// and the bench time and check kernels on.
    Uniform,
    /// Laplace values (scale 0.4) plus a per-channel bias in `[-0.5, 0.5)` times the channel's
    /// gain: heavy tails, so quantization groups hold values several scales out (the demo's
    /// latency workload, the CLI's captures, the GPU tests).
    Laplace,
}

/// Random K and V of one sequence, `[kv_heads][tokens][head_dim]`, with values drawn as `tails`
/// says and one K channel in 16 amplified eightfold (the outlier channels KIVI and Kitty are
/// designed around). The same arguments always give the same data.
///
/// The sizes come from callers' flags and shapes, so the memory is checked and reserved before
/// any is taken: a size past the machine (or past 64 bits) is an [`AllocError`] naming the bytes,
/// never an allocation abort.
pub fn random_kv(
    kv_heads: usize,
    tokens: usize,
    head_dim: usize,
    seed: u64,
    tails: Tails,
) -> Result<(KvTensor, KvTensor), AllocError> {
    let count = resources::product(&[kv_heads, tokens, head_dim]);
    let what = format!(
        "the synthetic K and V ({kv_heads} KV heads × {tokens} tokens × {head_dim} channels)"
    );
    // K and V are both held at once, so both are checked before either is taken.
    let both = count
        .and_then(resources::bytes_of::<f32>)
        .and_then(|b| b.checked_mul(2));
    resources::check(both, &what)?;
    let count = count.unwrap_or(usize::MAX);
    let gains_len = kv_heads.saturating_mul(head_dim);
    let mut rng = SynthRng::new(seed);
    let mut fill = |outliers: bool| -> Result<KvTensor, AllocError> {
        let mut data = resources::try_with_capacity::<f32>(count, &what)?;
        let mut channels = resources::try_with_capacity::<(f32, f32)>(gains_len, &what)?;
        match tails {
            Tails::Uniform => {
                channels.extend((0..gains_len).map(|_| {
                    let gain = if outliers && rng.next_u64() % 16 == 0 {
                        8.0
                    } else {
                        1.0
                    };
                    (gain, 0.0)
                }));
                for h in 0..kv_heads {
                    let ch = &channels[h * head_dim..(h + 1) * head_dim];
                    for _ in 0..tokens {
                        let offset = 0.25 * rng.symmetric();
                        data.extend(ch.iter().map(|(g, _)| (rng.symmetric() + offset) * g));
                    }
                }
            }
            Tails::Laplace => {
                channels.extend((0..gains_len).map(|_| {
                    let outlier = outliers && rng.next_u64() % 16 == 0;
                    let gain = if outlier { 8.0 } else { 1.0 };
                    (gain, 0.5 * rng.symmetric() * gain)
                }));
                for h in 0..kv_heads {
                    let ch = &channels[h * head_dim..(h + 1) * head_dim];
                    for _ in 0..tokens {
                        data.extend(ch.iter().map(|(gain, bias)| {
                            let u = (rng.symmetric() + 1.0) * 0.5; // [0, 1)
                            let magnitude = -(1.0 - u).max(f32::MIN_POSITIVE).ln() * 0.4;
                            let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
                            (sign * magnitude * gain + bias).clamp(-60000.0, 60000.0)
                        }));
                    }
                }
            }
        }
        Ok(KvTensor {
            data,
            kv_heads,
            tokens,
            head_dim,
        })
    };
    let k = fill(true)?;
    let v = fill(false)?;
    Ok((k, v))
}

/// `n` random query values, uniform in `[-1.5, 1.5)`, from a stream distinct from
/// [`random_kv`]'s for the same seed (callers round them to their kernel's dtype).
pub fn random_query_values(n: usize, seed: u64) -> Result<Vec<f32>, AllocError> {
    let what = format!("the synthetic queries ({n} values)");
    let mut values = resources::try_with_capacity::<f32>(n, &what)?;
    let mut rng = SynthRng::new(seed ^ 0x5155_4552_5951);
    values.extend((0..n).map(|_| 1.5 * rng.symmetric()));
    Ok(values)
}

/// Shape and structure of a synthetic layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthConfig {
    pub tokens: usize,
    pub kv_heads: usize,
    /// Query heads per KV head (GQA group).
    pub gqa: usize,
    pub head_dim: usize,
    /// Hidden size of the layer input X.
    pub d_model: usize,
    /// RoPE pairs per head whose key channels carry outliers.
    pub outlier_pairs: usize,
    /// Leading tokens with massive activations (attention sinks).
    pub sink_tokens: usize,
    pub seed: u64,
}

impl Default for SynthConfig {
    fn default() -> Self {
        Self {
            tokens: 1024,
            kv_heads: 2,
            gqa: 4,
            head_dim: 128,
            d_model: 256,
            outlier_pairs: 4,
            sink_tokens: 4,
            seed: 0x006b_7671,
        }
    }
}

/// The layer that produced the K/V: inputs and projection weights (row-major `[in][out]`).
#[derive(Debug, Clone, PartialEq)]
pub struct SynthLayer {
    /// `[tokens][d_model]` layer input.
    pub x: Vec<f32>,
    /// `[tokens][d_model]` previous layer's input (X differs from it by a residual update).
    pub x_prev: Vec<f32>,
    /// `[d_model][kv_heads·head_dim]`.
    pub w_k: Vec<f32>,
    /// `[d_model][kv_heads·head_dim]`.
    pub w_v: Vec<f32>,
    pub d_model: usize,
}

/// A synthetic decode step: cached K/V of `tokens` tokens and the next token's queries.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthKv {
    pub config: SynthConfig,
    /// Keys before RoPE (what CommVQ encodes).
    pub k_pre_rope: KvTensor,
    /// Keys after RoPE at positions `0..tokens` (what scalar schemes quantize).
    pub k: KvTensor,
    pub v: KvTensor,
    /// Queries of the next token, RoPE at position `tokens`.
    pub q: Queries,
    pub rope: Rope,
    pub layer: SynthLayer,
}

impl SynthKv {
    /// The first `n` tokens of the layer (all of them when it holds fewer): K before and after
    /// RoPE, V and the layer inputs cut alike. The queries stay those of the full layer.
    pub fn truncate(&mut self, n: usize) {
        let n = n.min(self.k.tokens);
        let dm = self.layer.d_model;
        self.k_pre_rope = self.k_pre_rope.prefix(n);
        self.k = self.k.prefix(n);
        self.v = self.v.prefix(n);
        self.layer.x.truncate(n * dm);
        self.layer.x_prev.truncate(n * dm);
        self.config.tokens = n;
    }
}

/// `[rows][inner] × [inner][cols]` row-major.
pub fn matmul(a: &[f32], b: &[f32], rows: usize, inner: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * cols];
    for r in 0..rows {
        let o = &mut out[r * cols..(r + 1) * cols];
        for (i, &x) in a[r * inner..(r + 1) * inner].iter().enumerate() {
            if x == 0.0 {
                continue;
            }
            for (oc, w) in o.iter_mut().zip(&b[i * cols..(i + 1) * cols]) {
                *oc += x * w;
            }
        }
    }
    out
}

/// Splits `[tokens][kv_heads·head_dim]` into head-major `[kv_heads][tokens][head_dim]`.
pub fn to_head_major(flat: &[f32], tokens: usize, kv_heads: usize, head_dim: usize) -> KvTensor {
    let mut t = KvTensor::zeros(kv_heads, tokens, head_dim);
    for tok in 0..tokens {
        for h in 0..kv_heads {
            let src = &flat[(tok * kv_heads + h) * head_dim..(tok * kv_heads + h + 1) * head_dim];
            t.row_mut(h, tok).copy_from_slice(src);
        }
    }
    t
}

/// As [`to_head_major`], with the memory checked first ([`crate::resources`]) and `flat`'s length
/// checked against the shape: an error instead of an abort or a panic.
pub fn try_to_head_major(
    flat: &[f32],
    tokens: usize,
    kv_heads: usize,
    head_dim: usize,
    what: &str,
) -> Result<KvTensor, RefError> {
    if crate::resources::product(&[tokens, kv_heads, head_dim]) != Some(flat.len()) {
        return Err(RefError::Mismatch(format!(
            "{what}: {} values for [tokens {tokens}][kv_heads {kv_heads}][head_dim {head_dim}]",
            flat.len()
        )));
    }
    let mut t = KvTensor::try_zeros(kv_heads, tokens, head_dim, what)?;
    for tok in 0..tokens {
        for h in 0..kv_heads {
            let src = &flat[(tok * kv_heads + h) * head_dim..(tok * kv_heads + h + 1) * head_dim];
            t.row_mut(h, tok).copy_from_slice(src);
        }
    }
    Ok(t)
}

/// Bytes [`generate`] holds at its peak for `cfg` (inputs, weights, K before and after RoPE, V,
/// the projections' outputs, queries), or `None` when that overflows.
pub fn generate_bytes(cfg: &SynthConfig) -> Option<u64> {
    let (l, dm, h, d) = (
        cfg.tokens as u64,
        cfg.d_model as u64,
        cfg.kv_heads as u64,
        cfg.head_dim as u64,
    );
    let kvd = h.checked_mul(d)?;
    let floats = [
        l.checked_mul(dm)?.checked_mul(2)?,   // x, x_prev
        dm.checked_mul(kvd)?.checked_mul(2)?, // w_k, w_v
        l.checked_mul(kvd)?.checked_mul(5)?,  // k_pre, k, v and the two matmul outputs
        dm.checked_mul(d)?,                   // one query head's projection
        h.checked_mul(cfg.gqa as u64)?.checked_mul(d)?,
    ]
    .into_iter()
    .try_fold(0u64, |a, b| a.checked_add(b))?;
    floats.checked_mul(4)
}

/// [`generate`], after checking that the layer fits in the memory available: a size past it is
/// an error naming the bytes ([`crate::resources::AllocError`]), not an abort.
pub fn try_generate(cfg: &SynthConfig) -> Result<SynthKv, RefError> {
    crate::resources::check(
        generate_bytes(cfg),
        &format!(
            "a synthetic layer of {} tokens × {} KV heads × head_dim {} (d_model {})",
            cfg.tokens, cfg.kv_heads, cfg.head_dim, cfg.d_model
        ),
    )?;
    Ok(generate(cfg))
}

/// Generates a layer and its K/V/queries; the same config always gives the same data. A layer
/// larger than the machine's memory aborts the process: [`try_generate`] checks first.
pub fn generate(cfg: &SynthConfig) -> SynthKv {
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let (l, dm, h, d) = (cfg.tokens, cfg.d_model, cfg.kv_heads, cfg.head_dim);
    let kvd = h * d;
    let tails = StudentT::new(5.0).expect("valid degrees of freedom");
    let normal = Normal::new(0.0, 1.0).expect("valid normal");
    let massive: Vec<usize> = (0..2).map(|_| rng.random_range(0..dm)).collect();

    // X: heavy-tailed noise + a slowly drifting "topic" + massive dims, huge on sink tokens.
    let mut topic = vec![0.0f32; dm];
    let mut x_prev = vec![0.0f32; l * dm];
    for t in 0..l {
        for (j, tp) in topic.iter_mut().enumerate() {
            *tp = 0.97 * *tp + 0.25 * normal.sample(&mut rng) as f32;
            let mut val = tails.sample(&mut rng) as f32 * 0.6 + *tp;
            if massive.contains(&j) {
                val += if t < cfg.sink_tokens { 60.0 } else { 4.0 };
            }
            x_prev[t * dm + j] = val;
        }
    }
    // The layer's residual update: X = X_prev + a smaller, correlated change.
    let x: Vec<f32> = x_prev
        .iter()
        .map(|p| p + 0.2 * normal.sample(&mut rng) as f32 + 0.05 * p)
        .collect();

    let w_scale = 1.0 / (dm as f64).sqrt();
    let half = d / 2;
    // Key channels: graded magnitudes (log-normal gains, as measured key channels are), a few
    // low-frequency RoPE pairs with outlier gains, and the massive hidden dimensions projected
    // onto those slow pairs, so sink tokens get keys that stay aligned with queries at any distance.
    let gain_dist = rand_distr::LogNormal::new(0.0, 0.6).expect("valid log-normal");
    let mut gains = vec![1.0f32; kvd];
    for head in 0..h {
        let pair_gains: Vec<f32> = (0..half)
            .map(|_| gain_dist.sample(&mut rng) as f32)
            .collect();
        for (i, g) in pair_gains.iter().enumerate() {
            gains[head * d + i] = *g;
            gains[head * d + i + half] = *g;
        }
        for _ in 0..cfg.outlier_pairs {
            let pair = rng.random_range(half * 3 / 4..half);
            let g = rng.random_range(3.0..5.0f32);
            gains[head * d + pair] *= g;
            gains[head * d + pair + half] *= g;
        }
    }
    let mut w_k: Vec<f32> = (0..dm * kvd)
        .map(|i| (normal.sample(&mut rng) * w_scale) as f32 * gains[i % kvd])
        .collect();
    let w_v: Vec<f32> = (0..dm * kvd)
        .map(|_| (normal.sample(&mut rng) * w_scale) as f32)
        .collect();
    // The massive dimensions write a fixed-sign offset into the slow channels: a consistent key bias
    // for ordinary tokens (|x| ≈ 4) and a dominant key for the sink tokens (|x| ≈ 60).
    for &m in &massive {
        for col in 0..kvd {
            let slow = col % d % half >= half * 3 / 4;
            let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
            w_k[m * kvd + col] = if slow {
                sign * 0.15 * gains[col]
            } else {
                w_k[m * kvd + col] * 0.05
            };
        }
    }

    let rope = Rope::default();
    let k_pre = to_head_major(&matmul(&x, &w_k, l, dm, kvd), l, h, d);
    let v = to_head_major(&matmul(&x, &w_v, l, dm, kvd), l, h, d);
    let mut k = k_pre.clone();
    for head in 0..h {
        for t in 0..l {
            rope.apply(k.row_mut(head, t), t);
        }
    }

    // Queries: the next token's input through W_k-like projections plus per-head noise, tempered to
    // a realistic logit spread (std ≈ 2 over the cached tokens), then turned towards the sink keys
    // until the sinks take a per-head share of the attention (20–70%), as in trained models.
    let x_next: Vec<f32> = (0..dm)
        .map(|j| x[(l.max(1) - 1) * dm + j] * 0.5 + tails.sample(&mut rng) as f32 * 0.5)
        .collect();
    let q_heads = h * cfg.gqa;
    let sinks = cfg.sink_tokens.min(l);
    let mut q = vec![0.0f32; q_heads * d];
    for qh in 0..q_heads {
        let kvh = qh / cfg.gqa;
        let mut w_q = vec![0.0f32; dm * d];
        for row in 0..dm {
            for c in 0..d {
                w_q[row * d + c] =
                    w_k[row * kvd + kvh * d + c] + (normal.sample(&mut rng) * w_scale) as f32;
            }
        }
        let mut qv = matmul(&x_next, &w_q, 1, dm, d);
        rope.apply(&mut qv, l);
        let logits = |qv: &[f32]| -> Vec<f64> {
            (0..l)
                .map(|t| {
                    let kt = k.row(kvh, t);
                    qv.iter()
                        .zip(kt)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect()
        };
        let z = logits(&qv);
        let mean = z.iter().sum::<f64>() / l.max(1) as f64;
        let std = (z.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / l.max(1) as f64).sqrt();
        let s = if std > 0.0 { (2.0 / std) as f32 } else { 1.0 };
        qv.iter_mut().for_each(|x| *x *= s);
        if sinks > 0 && l > sinks {
            let target = rng.random_range(0.2..0.7f64);
            // Unit direction of the mean sink key; bisection on how far the query moves along it.
            let mut dir = vec![0.0f32; d];
            for t in 0..sinks {
                for (a, b) in dir.iter_mut().zip(k.row(kvh, t)) {
                    *a += *b;
                }
            }
            let norm = dir
                .iter()
                .map(|x| (*x as f64).powi(2))
                .sum::<f64>()
                .sqrt()
                .max(1e-12);
            dir.iter_mut().for_each(|x| *x /= norm as f32);
            let mass = |beta: f64| -> f64 {
                let shifted: Vec<f32> = qv
                    .iter()
                    .zip(&dir)
                    .map(|(a, b)| a + (beta as f32) * b)
                    .collect();
                let z = logits(&shifted);
                let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
                e[..sinks].iter().sum::<f64>() / e.iter().sum::<f64>()
            };
            let (mut lo, mut hi) = (-8.0f64, 8.0f64);
            for _ in 0..40 {
                let mid = 0.5 * (lo + hi);
                if mass(mid) < target {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            let beta = 0.5 * (lo + hi) as f32;
            qv.iter_mut().zip(&dir).for_each(|(a, b)| *a += beta * b);
        }
        q[qh * d..(qh + 1) * d].copy_from_slice(&qv);
    }

    SynthKv {
        config: *cfg,
        k_pre_rope: k_pre,
        k,
        v,
        q: Queries {
            data: q,
            q_heads,
            head_dim: d,
        },
        rope,
        layer: SynthLayer {
            x,
            x_prev,
            w_k,
            w_v,
            d_model: dm,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention;

    fn small() -> SynthConfig {
        SynthConfig {
            tokens: 300,
            kv_heads: 2,
            gqa: 2,
            head_dim: 64,
            d_model: 96,
            ..Default::default()
        }
    }

    #[test]
    fn a_layer_past_the_machine_is_an_error_naming_its_bytes() {
        let huge = SynthConfig {
            tokens: 100_000_000_000,
            ..Default::default()
        };
        let e = try_generate(&huge).unwrap_err();
        let s = e.to_string();
        assert!(
            matches!(e, RefError::Alloc(_))
                && s.contains("100000000000 tokens")
                && s.contains("bytes"),
            "{s}"
        );
        let e = try_generate(&SynthConfig {
            tokens: usize::MAX,
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        let e = try_to_head_major(&[0.0; 3], 2, 1, 2, "K").unwrap_err();
        assert!(e.to_string().contains("3 values"), "{e}");
    }

    #[test]
    fn random_kv_is_seeded_finite_and_has_outlier_key_channels() {
        for tails in [Tails::Uniform, Tails::Laplace] {
            let (k, v) = random_kv(2, 300, 64, 5, tails).unwrap();
            let (k2, v2) = random_kv(2, 300, 64, 5, tails).unwrap();
            assert_eq!((&k, &v), (&k2, &v2), "{tails:?}");
            assert_ne!(k, random_kv(2, 300, 64, 6, tails).unwrap().0, "{tails:?}");
            assert!(k.data.iter().chain(&v.data).all(|x| x.is_finite()));
            assert!(
                k.data.iter().filter(|x| **x == 0.0).count() < 5,
                "{tails:?}"
            );
            let max = |t: &KvTensor| t.data.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            assert!(max(&k) > 2.0 * max(&v), "{tails:?}: K outlier channels");
        }
        // Heavy tails: some values several scales out; uniform values stay within their range.
        let (_, v) = random_kv(2, 300, 64, 5, Tails::Laplace).unwrap();
        assert!(v.data.iter().any(|x| x.abs() > 2.0));
        let (_, v) = random_kv(2, 300, 64, 5, Tails::Uniform).unwrap();
        assert!(v.data.iter().all(|x| x.abs() <= 1.25));
        let q = random_query_values(100, 3).unwrap();
        assert!(q.iter().all(|x| x.abs() <= 1.5) && q != random_query_values(100, 4).unwrap());
        let e = random_kv(8, 100_000_000, 128, 1, Tails::Laplace).unwrap_err();
        assert!(e.to_string().contains("819200000000 bytes"), "{e}");
    }

    #[test]
    fn same_seed_same_data_other_seed_other_data() {
        let a = generate(&small());
        assert_eq!(a, generate(&small()));
        let b = generate(&SynthConfig { seed: 7, ..small() });
        assert_ne!(a.k, b.k);
    }

    #[test]
    fn keys_have_outlier_channels_and_sinks_draw_attention() {
        let s = generate(&small());
        let d = s.config.head_dim;
        // Mean |k| per channel: the largest is far above the median.
        let mut mags: Vec<f64> = (0..d)
            .map(|c| {
                (0..s.k.tokens)
                    .map(|t| s.k.row(0, t)[c].abs() as f64)
                    .sum::<f64>()
            })
            .collect();
        mags.sort_by(f64::total_cmp);
        assert!(
            mags[d - 1] > 4.0 * mags[d / 2],
            "no outlier channel: {mags:?}"
        );
        // Sink tokens take far more than their share of attention.
        let p = attention::probabilities(&s.q, &s.k, &vec![false; s.k.tokens], None).unwrap();
        let l = s.k.tokens;
        let sink_mass: f64 = (0..s.q.q_heads)
            .map(|h| p[h * l..h * l + s.config.sink_tokens].iter().sum::<f64>())
            .sum::<f64>()
            / s.q.q_heads as f64;
        assert!(
            sink_mass > 10.0 * s.config.sink_tokens as f64 / l as f64,
            "sink mass {sink_mass}"
        );
        assert!(s.k.data.iter().all(|x| x.is_finite()));
    }
}
