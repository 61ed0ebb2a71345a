//! Helpers shared by the GPU and NVRTC test files: the harness that reports a test without its
//! GPU or NVRTC as ignored (kvq-runtime's, re-exported), per-case seeds, and the error bound GPU
//! outputs are checked against.
#![allow(dead_code)]

use kvq::codegen::Dtype;
use kvq::reference::attention::{self, Queries};
use kvq::reference::step::StepQueries;
use kvq::reference::{Dequantized, KvTensor};
use kvq::schemes::BUILTIN;
use kvq::{Axis, CacheSource, SchemeSpec, TensorQuant};
use std::time::{SystemTime, UNIX_EPOCH};

// Not every file that includes this module uses all three.
#[allow(unused_imports)]
pub use kvq::runtime::testing::harness::{needs, plain, run as run_trials};

/// The built-ins with GPU kernels today: integer and FP16 schemes caching K/V.
pub fn integer_schemes() -> Vec<(&'static str, SchemeSpec)> {
    BUILTIN
        .iter()
        .filter(|b| b.spec.source == CacheSource::Kv)
        .filter(|b| {
            ![b.spec.k, b.spec.v]
                .iter()
                .any(|t| matches!(t, TensorQuant::Codebook(_)))
        })
        .map(|b| (b.name, b.spec))
        .collect()
}

/// Calibrated schemes the built-ins do not cover: keys of 4 and 8 bits, and boosted keys, which
/// CalibQuant's range pass scores on the f16 path (with stored scores, the decode kernel's; with
/// the keys scored twice, its own), and token-axis V with a sink and a local window.
pub fn other_calibrated_schemes() -> Vec<(&'static str, SchemeSpec)> {
    [
        (
            "calibrated-int4",
            "k = int(4, channel), v = int(4, token), sink = 32, local = 128, \
             calibrate = calibrate(tau1 = -1.25, tau2 = 0.75)",
        ),
        (
            "calibrated-int8",
            "k = int(8, channel, symmetric), v = int(8, channel, symmetric), \
             calibrate = calibrate(tau1 = -0.5, tau2 = 0.25)",
        ),
        (
            "calibrated-boost",
            "k = int(2, channel, boost = boost(4, ratio = 0.125, by = magnitude)), \
             v = int(2, token, local = 128), sink = 32, page = 128, \
             calibrate = calibrate(tau1 = -1.5, tau2 = 3.25)",
        ),
    ]
    .into_iter()
    .map(|(name, text)| {
        let spec = SchemeSpec::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        (name, spec)
    })
    .collect()
}

/// Uncalibrated layouts the built-ins do not cover: FP16 keys with 2-bit values, whose centring
/// cannot follow K pages and takes every chunk (an every-other-page centring keyed on K
/// pages would not fit them); 1-bit K and V, whose rows at head_dim 64 give a thread half a word (16 K
/// codes, 8 V codes; the keys take the f16 path there and the integer path at 128 and 256); and
/// CalibQuant-1 without its calibration (channel-axis 1-bit V, as subnormals, in one pass), which
/// the bench runner measures beside it.
pub fn other_uncalibrated_schemes() -> Vec<(&'static str, SchemeSpec)> {
    [
        ("fp16-k-kivi2-v", "k = fp16, v = int(2, token)"),
        (
            "one-bit-kv",
            "k = int(1, channel), v = int(1, token), sink = 16, local = 64",
        ),
        (
            "one-bit-channel-v",
            "k = int(1, channel), v = int(1, channel), sink = 32, local = 128",
        ),
    ]
    .into_iter()
    .map(|(name, text)| {
        let spec = SchemeSpec::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        (name, spec)
    })
    .collect()
}

/// The head_dims `KVQ_TEST_HEAD_DIMS` names (a comma list, each one of `known`), printed; `None`
/// where it is unset. An unknown or empty list panics: a typo must not pass by checking nothing.
pub fn selected_head_dims(known: &[u32]) -> Option<Vec<u32>> {
    let list = std::env::var("KVQ_TEST_HEAD_DIMS").ok()?;
    let dims: Vec<u32> = list
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| match d.parse() {
            Ok(d) if known.contains(&d) => d,
            _ => panic!("KVQ_TEST_HEAD_DIMS names `{d}`; known: {known:?}"),
        })
        .collect();
    assert!(!dims.is_empty(), "KVQ_TEST_HEAD_DIMS names no head_dim");
    println!("KVQ_TEST_HEAD_DIMS: checking only {dims:?}");
    Some(dims)
}

/// The seed of one case's inputs: a hash of the run's seed and the case's name, so a case's
/// inputs do not depend on which other cases a filter (`KVQ_TEST_SCHEMES`, a test name) keeps.
/// FNV-1a over the name, then SplitMix64's finaliser to spread it.
pub fn case_seed(seed: u64, case: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in case.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

/// A fresh seed per run (printed by the tests), or `KVQ_SEED` to repeat one.
pub fn seed() -> u64 {
    std::env::var("KVQ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

/// Unit roundoff (half an ulp at 1) of a kernel dtype: f16 keeps 11 significant bits, bf16 8.
pub fn unit_roundoff(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F16 => 2f64.powi(-11),
        Dtype::Bf16 => 2f64.powi(-8),
    }
}

/// The magnitude the kernel's rounding of stored value `(t, c)` of one head meets: the value
/// itself for FP16 rows, and for integer codes the largest value of its quantization group (the
/// scaled code `s·(q − offset)` and the zero are rounded separately, and either can be as large
/// as the group's largest value when the result cancels). `[tokens][head_dim]` of one head.
fn rounding_magnitudes(x: &KvTensor, head: usize, quant: &TensorQuant, page: usize) -> Vec<f64> {
    let (n, d) = (x.tokens, x.head_dim);
    let mut r: Vec<f64> = (0..n)
        .flat_map(|t| x.row(head, t).iter().map(|v| f64::from(v.abs())))
        .collect();
    let Some(q) = quant.as_int() else {
        return r;
    };
    match q.axis {
        Axis::Token => {
            let g = q.group.map_or(d, |g| g as usize).clamp(1, d);
            for row in r.chunks_mut(d) {
                for group in row.chunks_mut(g) {
                    let m = group.iter().copied().fold(0.0, f64::max);
                    group.fill(m);
                }
            }
        }
        Axis::Channel => {
            let page = page.max(1);
            for first in (0..n).step_by(page) {
                let last = (first + page).min(n);
                for c in 0..d {
                    let m = (first..last).map(|t| r[t * d + c]).fold(0.0, f64::max);
                    (first..last).for_each(|t| r[t * d + c] = m);
                }
            }
        }
    }
    r
}

/// The reference output of one sequence's decode and a bound on each element's error in a
/// kernel computing it in `dtype`.
pub struct Expected {
    pub want: Vec<f32>,
    pub bound: Vec<f64>,
    /// Each head's log-sum-exp of its scores (natural log), and its error bound: a score error
    /// `δs_t` moves the LSE by `Σ_t p_t·δs_t`, so at most `Σ_t p_t·|δs_t|` with `|δs_t|` as for
    /// the outputs (below), plus the kernel's f32 arithmetic, 2^-20 of the magnitudes involved.
    pub lse: Vec<f32>,
    pub lse_bound: Vec<f64>,
}

/// Hoeffding's λ for the probabilistic terms: a sum `Σ a_i·e_i` of independent rounding errors
/// `|e_i| ≤ u` exceeds `λ·u·‖a‖₂` with probability at most `2·exp(−λ²/2)` (about 1e-14 at 8),
/// which over the ~10⁸ output elements of a full run leaves a false failure a one-in-a-million
/// event (Higham and Mary's probabilistic rounding error analysis rests on the same inequality).
const LAMBDA: f64 = 8.0;

/// Reference output and per-element error bound for queries `q` (already rounded to `dtype`, as
/// the kernel sees them) over a dequantized cache.
///
/// Output element `o = Σ_t p_t·v_t` (one head, one channel). To first order in the unit roundoff
/// `u` of `dtype`, the kernel's error is the sum of
///
/// * **values**: each product `p_t·v_t` meets at most three roundings to `dtype` before its f32
///   accumulation: the value (or scaled code) itself, `p_t` as a tensor-core operand, and a scale
///   folded into `p_t` (token-axis codes). Each is relative to `R_t ≥ |v_t|`, what the rounding
///   meets ([`rounding_magnitudes`]): the magnitude of what was summed, not of `o`, which cancels.
///   At most `3u·Σ_t p_t·R_t`, and (independent round-to-nearest errors) at most
///   `λ·u·√3·‖p_t·R_t‖₂` but for a one-in-10¹⁴ chance; the smaller is taken.
/// * **scores**: a score error `δs_t` moves `p_t` by `p_t·(δs_t − Σ_j p_j·δs_j)`, so `o` by
///   `Σ_t p_t·δs_t·(v_t − o)`. With each key value (or `q_i` times its scale) rounded once,
///   `|δs_t| ≤ κ·u·Σ_i |q_i|·RK_t,i / √d`: at most `Σ_t p_t·|v_t − o|·|δs_t|`, and, the channels'
///   errors being independent (a scale's rounding is shared by a page's tokens, so only channels
///   are counted as independent), at most `λ·κ·u·W·‖q_i·max_t RK_t,i‖₂ / √d` with
///   `W = Σ_t p_t·|v_t − o|`; the smaller is taken. κ = 1, and 3 under CalibQuant's calibration,
///   whose map takes the scores' range from the same rounded scores (slope at most 1, plus the
///   range ends' own errors).
/// * **output**: `u·|o|`, its own rounding to `dtype`.
/// * **subnormal weights** (f16 only): `2^-25·p_max·Σ_t R_t` over tokens with
///   `p_t < 2^-14·p_max`, whose kernel weights `exp(s_t − m) ≥ p_t/p_max` may be f16 subnormals,
///   rounded absolutely (half of 2^-24) rather than relatively; `p_max` undoes the softmax's
///   normalisation.
///
/// Accumulations run in f32, 13 bits finer than f16, and are left out.
pub fn expected(
    q: &Queries,
    deq: &Dequantized,
    spec: &SchemeSpec,
    dtype: Dtype,
) -> Result<Expected, String> {
    let calibrate = spec.calibrate.as_ref();
    let p = attention::probabilities(q, &deq.k, &deq.k_quantized, calibrate)
        .map_err(|e| e.to_string())?;
    let want = attention::weighted_values(&p, q.q_heads, &deq.v);
    let u = unit_roundoff(dtype);
    let kappa = if calibrate.is_some() { 3.0 } else { 1.0 };
    let (n, d) = (deq.v.tokens, deq.v.head_dim);
    let root_d = (d as f64).sqrt();
    let group = q.q_heads / deq.v.kv_heads;
    let page = spec.page as usize;
    let mut bound = vec![0.0f64; q.q_heads * d];
    let lse = kvq::reference::step::attend(&StepQueries::single(q), deq, calibrate)
        .map_err(|e| e.to_string())?
        .lse;
    let mut lse_bound = vec![0.0f64; q.q_heads];
    for kv in 0..deq.v.kv_heads {
        let rv = rounding_magnitudes(&deq.v, kv, &spec.v, page);
        let rk = rounding_magnitudes(&deq.k, kv, &spec.k, page);
        let mut rk_max = vec![0.0f64; d];
        for row in rk.chunks(d) {
            for (m, &r) in rk_max.iter_mut().zip(row) {
                *m = m.max(r);
            }
        }
        for h in kv * group..(kv + 1) * group {
            let ph = &p[h * n..(h + 1) * n];
            let qh = q.head(h);
            let p_max = ph.iter().copied().fold(0.0, f64::max);
            // Per-token score error bound, and the channels' share for the probabilistic form.
            let ds: Vec<f64> = (0..n)
                .map(|t| {
                    let dot: f64 = qh
                        .iter()
                        .zip(&rk[t * d..(t + 1) * d])
                        .map(|(a, r)| f64::from(a.abs()) * r)
                        .sum();
                    kappa * u * dot / root_d
                })
                .collect();
            let q_rk = qh
                .iter()
                .zip(&rk_max)
                .map(|(a, r)| (f64::from(*a) * r).powi(2))
                .sum::<f64>()
                .sqrt();
            let shifted: f64 = ph.iter().zip(&ds).map(|(p, e)| p * e).sum();
            let largest_dot = ds.iter().copied().fold(0.0, f64::max) / (kappa * u);
            lse_bound[h] = shifted + 2f64.powi(-20) * (1.0 + f64::from(lse[h]).abs() + largest_dot);
            let tiny = |t: usize| dtype == Dtype::F16 && ph[t] < 2f64.powi(-14) * p_max;
            // Token-major sums (each row read once, contiguously): the per-channel loop over
            // tokens strided through the rows and made the check slower than the kernels' runs.
            let o: Vec<f64> = (0..d).map(|c| f64::from(want[h * d + c])).collect();
            let (mut v1, mut v2, mut s1, mut w, mut sub) = (
                vec![0.0f64; d],
                vec![0.0f64; d],
                vec![0.0f64; d],
                vec![0.0f64; d],
                vec![0.0f64; d],
            );
            for t in 0..n {
                let row = deq.v.row(kv, t);
                let rt = &rv[t * d..(t + 1) * d];
                let (pt, dst, tiny_t) = (ph[t], ds[t], tiny(t));
                for c in 0..d {
                    let r = rt[c];
                    let spread = pt * (f64::from(row[c]) - o[c]).abs();
                    v1[c] += pt * r;
                    v2[c] += (pt * r) * (pt * r);
                    s1[c] += spread * dst;
                    w[c] += spread;
                    if tiny_t {
                        sub[c] += r;
                    }
                }
            }
            for c in 0..d {
                let values = (3.0 * u * v1[c]).min(LAMBDA * u * (3.0 * v2[c]).sqrt());
                let scores = s1[c].min(LAMBDA * kappa * u * w[c] * q_rk / root_d);
                bound[h * d + c] =
                    u * o[c].abs() + values + scores + 2f64.powi(-25) * p_max * sub[c];
            }
        }
    }
    Ok(Expected {
        want,
        bound,
        lse,
        lse_bound,
    })
}

/// How a kernel's output compares with [`Expected`]: the largest error as a share of its bound
/// (≤ 1 passes), and the elements past their bound or not finite.
#[derive(Debug, Clone, Default)]
pub struct Judgement {
    pub worst_ratio: f64,
    pub over: usize,
    pub non_finite: usize,
    /// The element of the largest ratio: (index, have, want, bound).
    pub worst: Option<(usize, f32, f32, f64)>,
}

impl Judgement {
    pub fn passed(&self) -> bool {
        self.over == 0 && self.non_finite == 0
    }
}

impl std::fmt::Display for Judgement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} over their bound, {} not finite, worst at {:.2} of its bound",
            self.over, self.non_finite, self.worst_ratio
        )?;
        if let Some((i, have, want, bound)) = self.worst {
            write!(
                f,
                " (element {i}: {have:e} for {want:e}, bound {bound:.2e})"
            )?;
        }
        Ok(())
    }
}

/// Compares `have` with `e` element by element.
pub fn judge(have: &[f32], e: &Expected) -> Judgement {
    let mut j = Judgement::default();
    assert_eq!(have.len(), e.want.len(), "output length");
    for (i, ((&h, &w), &b)) in have.iter().zip(&e.want).zip(&e.bound).enumerate() {
        if !h.is_finite() {
            j.non_finite += 1;
            continue;
        }
        let err = (f64::from(h) - f64::from(w)).abs();
        // A zero bound (an exactly representable output of exact inputs) allows no error.
        let ratio = if err == 0.0 { 0.0 } else { err / b };
        if ratio > 1.0 {
            j.over += 1;
        }
        if ratio > j.worst_ratio || j.worst.is_none() {
            j.worst_ratio = ratio.max(j.worst_ratio);
            j.worst = Some((i, h, w, b));
        }
    }
    j
}
