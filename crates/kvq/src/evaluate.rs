//! Evaluate any scheme on a synthetic layer with the CPU reference: one entry point for every family,
//! so tables and tests compare integer, CommVQ and XQuant schemes on the same data and with the same
//! memory accounting.
//!
//! - [`evaluate`] builds the scheme's cache with the reference (integer/FP16: [`IntCache`]; CommVQ:
//!   codebooks trained on held-out calibration tokens of the same layer, then [`CommVqCache`];
//!   XQuant: [`XQuantCache`] from the layer input and the SVD of its projections), decodes it, and
//!   compares attention against exact FP32 attention ([`attention::exact`], f64 accumulation).
//! - [`memory`] counts one sequence's cache for any `(spec, head_dim, kv_heads, len)`, by component
//!   (payload, metadata, FP16 windows at capacity), with the per-layer codebooks counted apart.
//!
//! ```
//! use kvq::evaluate::{self, Workload};
//! use kvq::reference::synth::SynthConfig;
//! use kvq::{schemes, Scheme};
//!
//! let cfg = SynthConfig { tokens: 320, head_dim: 64, d_model: 96, ..Default::default() };
//! let w = Workload::generate(&cfg, 0)?;
//! let fp16 = evaluate::evaluate(&schemes::Fp16::SPEC, &w)?;
//! let kivi2 = evaluate::evaluate(&schemes::Kivi2::SPEC, &w)?;
//! assert!(fp16.output_error < 1e-3 && fp16.output_error < kivi2.output_error);
//!
//! // Bits per element of a long sequence on a LLaMA-3.1-8B-shaped layer (8 KV heads × 128).
//! let bits = evaluate::bits_per_element(&schemes::Kivi2::SPEC, 128, 8, 32768)?;
//! assert!((bits - 2.366).abs() < 1e-3);
//! # Ok::<(), kvq::evaluate::EvalError>(())
//! ```

use crate::reference::attention::{self, Queries};
use crate::reference::commvq::{
    self, CalibrationData, CommVqCache, EmSchedule, TensorLayout, TrainOptions,
};
use crate::reference::footprint;
use crate::reference::int::IntCache;
use crate::reference::regions::TokenRegions;
use crate::reference::resources;
use crate::reference::synth::{self, SynthConfig, SynthKv};
use crate::reference::xquant::{Projections, XQuantCache};
use crate::reference::{Dequantized, KvTensor, RefError};
use crate::{CacheSource, Codebook, CodebookSpan, SchemeSpec, TensorQuant, XSource};
use std::fmt;
use std::sync::OnceLock;

/// Why an evaluation or an accounting was refused.
#[derive(Debug, Clone, PartialEq)]
pub enum EvalError {
    /// The reference refused the scheme or the data (shape, entry point, non-finite values).
    Reference(RefError),
    /// A codebook scheme on a workload without calibration tokens: codebooks must be trained on
    /// tokens the evaluation does not see.
    NoCalibration,
    /// A scheme no reference cache can hold (e.g. integer keys with codebook values).
    Unsupported(String),
    /// Inputs that do not fit together (lengths, shapes, an impossible latent rank).
    Workload(String),
}

impl fmt::Display for EvalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvalError::Reference(e) => write!(f, "{e}"),
            EvalError::NoCalibration => write!(
                f,
                "codebook schemes need calibration tokens: build the workload with \
                 `Workload::generate(cfg, n)`, n > 0, or `Workload::with_calibration`"
            ),
            EvalError::Unsupported(m) | EvalError::Workload(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for EvalError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            EvalError::Reference(e) => Some(e),
            _ => None,
        }
    }
}

impl From<RefError> for EvalError {
    fn from(e: RefError) -> Self {
        EvalError::Reference(e)
    }
}

/// Which reference cache holds a scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// `fp16` and `int(...)` tensors over K/V: [`IntCache`].
    Int,
    /// Codebook tensors (with, possibly, an `fp16` one) over K/V: [`CommVqCache`].
    CommVq,
    /// `source = x(latent)`: [`XQuantCache::build`].
    XQuant,
    /// `source = x(cross_layer)`: [`XQuantCache::build_cross_layer`].
    XQuantCrossLayer,
}

impl Family {
    /// The family of `spec`; mixing integer and codebook tensors has no reference cache.
    pub fn of(spec: &SchemeSpec) -> Result<Family, EvalError> {
        match spec.source {
            CacheSource::X(XSource::Latent) => return Ok(Family::XQuant),
            CacheSource::X(XSource::CrossLayer) => return Ok(Family::XQuantCrossLayer),
            CacheSource::Kv => {}
        }
        let is = |f: fn(&TensorQuant) -> bool| [&spec.k, &spec.v].into_iter().any(f);
        let codebook = is(|t| matches!(t, TensorQuant::Codebook(_)));
        let int = is(|t| matches!(t, TensorQuant::Int(_)));
        match (codebook, int) {
            (false, _) => Ok(Family::Int),
            (true, false) => Ok(Family::CommVq),
            (true, true) => Err(EvalError::Unsupported(format!(
                "`{spec}` mixes integer and codebook tensors; no reference cache holds both"
            ))),
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::Int => "int",
            Family::CommVq => "commvq",
            Family::XQuant => "xquant",
            Family::XQuantCrossLayer => "xquant-cl",
        })
    }
}

/// One sequence's cache of one layer, by component, in bytes. FP16 windows are counted as allocated
/// (sink at `sink` tokens, tail ring at `local + page`), as [`footprint`] does: the memory a runtime
/// reserves per sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Memory {
    /// Codes: dense integer planes and boost high planes, or packed codebook codes.
    pub payload: u64,
    /// Per-group or per-vector f16 scales and zeros, boost maps, alignment padding inside pages.
    pub metadata: u64,
    /// FP16 sink buffer, tail ring (Q-buffer + local window), whole FP16 pages.
    pub fp16: u64,
    /// f16 codebook tensors of the layer: shared by every sequence, so **not** in [`Memory::bytes`].
    pub codebooks: u64,
    /// XQuant-CL: the accumulator's latents kept per token (f16, both latents).
    pub accumulator: u64,
    /// K and V elements the cache stands for: `2 · len · kv_heads · head_dim`.
    pub elements: u64,
}

impl Memory {
    /// Per-sequence bytes: payload + metadata + FP16 (codebooks excluded).
    pub fn bytes(&self) -> u64 {
        self.payload + self.metadata + self.fp16 + self.accumulator
    }

    /// Per-sequence bits per K/V element (0 for an empty cache).
    pub fn bits_per_element(&self) -> f64 {
        if self.elements == 0 {
            return 0.0;
        }
        8.0 * self.bytes() as f64 / self.elements as f64
    }

    /// Fraction of an FP16 cache's memory saved (`1 − bits/16`).
    pub fn saved_vs_fp16(&self) -> f64 {
        1.0 - self.bits_per_element() / 16.0
    }
}

fn from_footprint(t: &footprint::TensorFootprint) -> Memory {
    Memory {
        payload: t.codes + t.high_bits + t.other,
        metadata: t.scales + t.zeros + t.index_maps + t.padding,
        fp16: t.fp16_bytes(),
        codebooks: 0,
        accumulator: 0,
        elements: 0,
    }
}

/// K's and V's memory together, or `None` when a sum (or the per-sequence total that
/// [`Memory::bytes`] adds unchecked) does not fit 64 bits.
fn plus(a: Memory, b: Memory) -> Option<Memory> {
    let m = Memory {
        payload: a.payload.checked_add(b.payload)?,
        metadata: a.metadata.checked_add(b.metadata)?,
        fp16: a.fp16.checked_add(b.fp16)?,
        codebooks: a.codebooks.checked_add(b.codebooks)?,
        accumulator: a.accumulator.checked_add(b.accumulator)?,
        elements: a.elements.checked_add(b.elements)?,
    };
    m.payload
        .checked_add(m.metadata)?
        .checked_add(m.fp16)?
        .checked_add(m.accumulator)?;
    Some(m)
}

/// Memory of a `len`-token sequence of a layer with `kv_heads` KV heads of `head_dim` channels.
///
/// XQuant assumes the GQA form: latents `kv_heads · head_dim` wide (a layer input at least that wide,
/// as in LLaMA-3.1-8B's 4096 against 8 × 128), padded to a multiple of 32 as the projections pad
/// them (one KV head of 80 channels has 96-wide latents); [`memory_with_rank`] takes the latent width.
pub fn memory(
    spec: &SchemeSpec,
    head_dim: u32,
    kv_heads: u32,
    len: u64,
) -> Result<Memory, EvalError> {
    // Two u32 factors leave room below u64::MAX for the rounding.
    let rank = (u64::from(head_dim) * u64::from(kv_heads)).next_multiple_of(32);
    let rank = usize::try_from(rank)
        .map_err(|_| EvalError::from(footprint::overflow(head_dim, kv_heads, len)))?;
    memory_with_rank(spec, head_dim, kv_heads, rank, len)
}

/// [`memory`] with XQuant's latent width `rank` (a multiple of 32; ignored by other families).
pub fn memory_with_rank(
    spec: &SchemeSpec,
    head_dim: u32,
    kv_heads: u32,
    rank: usize,
    len: u64,
) -> Result<Memory, EvalError> {
    spec.check_shape(head_dim, kv_heads)
        .map_err(RefError::from)?;
    let overflow = || EvalError::from(footprint::overflow(head_dim, kv_heads, len));
    let elements = footprint::checked_product(
        &[2, kv_heads.into(), head_dim.into(), len],
        head_dim,
        kv_heads,
        len,
    )?;
    let mem = match Family::of(spec)? {
        Family::Int => {
            let f = footprint::scheme(spec, head_dim, kv_heads, len)?;
            plus(from_footprint(&f.k), from_footprint(&f.v))
        }
        Family::CommVq => plus(
            commvq_tensor(spec, &spec.k, head_dim, kv_heads, len)?,
            commvq_tensor(spec, &spec.v, head_dim, kv_heads, len)?,
        ),
        Family::XQuant | Family::XQuantCrossLayer => {
            if rank == 0 || rank % 32 != 0 {
                return Err(EvalError::Workload(format!(
                    "an XQuant latent of {rank} channels: it must be a positive multiple of 32"
                )));
            }
            // The latents are stored as one "head" of `rank` channels with the scheme's quantizers.
            let latent = SchemeSpec {
                source: CacheSource::Kv,
                ..*spec
            };
            let accumulator = match spec.source {
                CacheSource::X(XSource::CrossLayer) => {
                    footprint::checked_product(&[4, rank as u64, len], head_dim, kv_heads, len)?
                }
                _ => 0,
            };
            let rank = u32::try_from(rank).map_err(|_| overflow())?;
            let t = |q| footprint::tensor(&latent, q, rank, 1, len);
            plus(from_footprint(&t(&spec.k)?), from_footprint(&t(&spec.v)?)).and_then(|m| {
                plus(
                    m,
                    Memory {
                        accumulator,
                        ..Memory::default()
                    },
                )
            })
        }
    }
    .ok_or_else(overflow)?;
    Ok(Memory { elements, ..mem })
}

/// Per-sequence bits per K/V element of `spec` at `len` tokens ([`memory`]).
pub fn bits_per_element(
    spec: &SchemeSpec,
    head_dim: u32,
    kv_heads: u32,
    len: u64,
) -> Result<f64, EvalError> {
    Ok(memory(spec, head_dim, kv_heads, len)?.bits_per_element())
}

/// One CommVQ-side tensor: the exact page layout of `commvq::layout`, FP16 windows at capacity.
fn commvq_tensor(
    spec: &SchemeSpec,
    t: &TensorQuant,
    head_dim: u32,
    kv_heads: u32,
    len: u64,
) -> Result<Memory, EvalError> {
    let c = match t {
        TensorQuant::Codebook(c) => c,
        // An FP16 tensor of a codebook scheme is stored in FP16 pages, as in every other scheme.
        _ => {
            return Ok(from_footprint(&footprint::tensor(
                spec, t, head_dim, kv_heads, len,
            )?))
        }
    };
    let (h, d, page) = (kv_heads as usize, head_dim as usize, spec.page as usize);
    let r = TokenRegions::new(
        len as usize,
        spec.sink as usize,
        spec.local_of(t) as usize,
        page,
    );
    let books = match c.span {
        CodebookSpan::Head => h,
        CodebookSpan::Token => 1,
    };
    let dim = SchemeSpec::codebook_dim(c.span, head_dim, kv_heads);
    let mul = |xs: &[u64]| footprint::checked_product(xs, head_dim, kv_heads, len);
    let (layout, codebook_values) = match c.codebook {
        Codebook::RopeCommutative {
            levels,
            residuals,
            pairs_per_code,
        } => {
            let (levels, rounds, g) =
                (levels as usize, residuals as usize, pairs_per_code as usize);
            let groups = d / 2 / g.max(1);
            let code_bits = 2 * levels.trailing_zeros();
            (
                TensorLayout::rope(page, h, groups, rounds, code_bits, books),
                mul(&[h, groups, rounds, levels, g, 2].map(|x| x as u64))?,
            )
        }
        // Table, per-channel scale σ and mean μ per book.
        Codebook::Additive { rows } => (
            TensorLayout::additive(page, books, rows as usize),
            mul(&[books as u64, rows as u64 + 2, dim])?,
        ),
    };
    let layout =
        layout.ok_or_else(|| EvalError::from(footprint::overflow(head_dim, kv_heads, len)))?;
    let window = spec.sink as u64 + spec.local_of(t) as u64 + page as u64;
    Ok(Memory {
        payload: mul(&[r.pages as u64, layout.code_words as u64, 4])?,
        metadata: mul(&[r.pages as u64, layout.scales as u64, 2])?,
        fp16: mul(&[h as u64, window, d as u64, 2])?,
        codebooks: mul(&[codebook_values, 2])?,
        accumulator: 0,
        elements: 0,
    })
}

/// Held-out calibration activations of the evaluated layer.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldOut {
    /// Keys before RoPE `[kv_heads][tokens][head_dim]`.
    pub k_pre_rope: KvTensor,
    pub v: KvTensor,
}

/// A synthetic layer prepared for evaluation: the sequence every scheme caches with its decode
/// queries, held-out calibration tokens of the same layer (CommVQ's codebooks are trained there),
/// exact attention (computed once, shared by every scheme), and the SVD of the layer's projections
/// (XQuant; computed on first use).
#[derive(Debug)]
pub struct Workload {
    data: SynthKv,
    held_out: Option<HeldOut>,
    train: TrainOptions,
    exact_probs: Vec<f64>,
    exact_out: Vec<f32>,
    projections: OnceLock<Result<Projections, RefError>>,
}

impl Workload {
    /// Every scheme caches `data` (and reads its layer for XQuant); no calibration tokens, so codebook
    /// schemes return [`EvalError::NoCalibration`].
    pub fn new(data: SynthKv) -> Result<Self, EvalError> {
        let exact_probs =
            attention::probabilities(&data.q, &data.k, &vec![false; data.k.tokens], None)?;
        let exact_out = attention::exact(&data.q, &data.k, &data.v)?;
        let train = default_training(data.config.seed);
        Ok(Self {
            data,
            held_out: None,
            train,
            exact_probs,
            exact_out,
            projections: OnceLock::new(),
        })
    }

    /// As [`Workload::new`], with calibration activations of the same layer that `data` does not hold.
    pub fn with_calibration(data: SynthKv, held_out: HeldOut) -> Result<Self, EvalError> {
        let shape = |t: &KvTensor| (t.kv_heads, t.head_dim);
        let (k, v) = (&held_out.k_pre_rope, &held_out.v);
        if shape(k) != shape(&data.k) || shape(v) != shape(&data.k) || k.tokens != v.tokens {
            return Err(EvalError::Workload(format!(
                "calibration K [{}][{}][{}] and V [{}][{}][{}] against a layer of {} KV heads × {}",
                k.kv_heads,
                k.tokens,
                k.head_dim,
                v.kv_heads,
                v.tokens,
                v.head_dim,
                data.k.kv_heads,
                data.k.head_dim
            )));
        }
        Ok(Self {
            held_out: Some(held_out),
            ..Self::new(data)?
        })
    }

    /// Generates one layer of `cfg.tokens + calibration` tokens and splits it: every scheme caches the
    /// first `cfg.tokens` (sink tokens and RoPE positions as generated, with the generated queries of
    /// the next token, which sit `calibration` positions further on); the last `calibration` tokens
    /// are the held-out calibration set. With `calibration = 0` the data is exactly
    /// `synth::generate(cfg)`. (A layer's seed also draws its weights, so held-out data of the same
    /// layer has to come from the same generated sequence.)
    pub fn generate(cfg: &SynthConfig, calibration: usize) -> Result<Self, EvalError> {
        if cfg.tokens == 0 {
            return Err(EvalError::Workload("a workload of 0 cached tokens".into()));
        }
        let tokens = cfg
            .tokens
            .checked_add(calibration)
            .ok_or_else(|| EvalError::Workload(format!("{} + {calibration} tokens", cfg.tokens)))?;
        check_workload_memory(cfg, tokens, calibration)?;
        if calibration == 0 {
            return Self::new(synth::generate(cfg));
        }
        let mut full = synth::generate(&SynthConfig { tokens, ..*cfg });
        let n = cfg.tokens;
        let held_out = HeldOut {
            k_pre_rope: suffix(&full.k_pre_rope, n),
            v: suffix(&full.v, n),
        };
        full.truncate(n);
        Self::with_calibration(full, held_out)
    }

    /// The same workload with other CommVQ training options.
    pub fn with_training(self, train: TrainOptions) -> Self {
        Self { train, ..self }
    }

    /// A codebook scheme's codebooks for this layer, trained on the held-out tokens as
    /// [`evaluate`] trains them (deterministic: the same codebooks every call), for a GPU cache of
    /// the same layer to be coded with.
    pub fn codebooks(&self, spec: &SchemeSpec) -> Result<commvq::Codebooks, EvalError> {
        let held = self.held_out.as_ref().ok_or(EvalError::NoCalibration)?;
        let data = CalibrationData {
            k_pre_rope: &held.k_pre_rope,
            v: &held.v,
            rope: self.data.rope,
        };
        Ok(commvq::train_with(spec, &data, &self.train)?)
    }

    /// The cached sequence, its queries and its layer.
    pub fn data(&self) -> &SynthKv {
        &self.data
    }

    /// The held-out calibration tokens, if any.
    pub fn held_out(&self) -> Option<&HeldOut> {
        self.held_out.as_ref()
    }

    /// CommVQ training options (default: the data's seed, 4 EM steps per round, as the tests use).
    pub fn training(&self) -> &TrainOptions {
        &self.train
    }

    /// Exact attention output `[q_heads][head_dim]` over the unquantized K/V.
    pub fn exact_output(&self) -> &[f32] {
        &self.exact_out
    }

    /// The SVD latents of the layer's K and V projections (computed on first use).
    pub fn projections(&self) -> Result<&Projections, EvalError> {
        let p = self.projections.get_or_init(|| {
            let (l, c) = (&self.data.layer, &self.data.config);
            Projections::from_weights(&l.w_k, &l.w_v, l.d_model, c.kv_heads, c.head_dim)
        });
        p.as_ref().map_err(|e| EvalError::Reference(e.clone()))
    }
}

/// Four EM steps per round: the held-out error moves little beyond that on synthetic calibration sets
/// (docs/CODEBOOKS.md §4), and training stays a fraction of a second per scheme.
fn default_training(seed: u64) -> TrainOptions {
    TrainOptions {
        em: EmSchedule {
            steps: 4,
            ..Default::default()
        },
        ..TrainOptions::seeded(seed)
    }
}

/// Tokens `from..` of every head (none when `from` is past the end).
fn suffix(x: &KvTensor, from: usize) -> KvTensor {
    let from = from.min(x.tokens);
    let n = x.tokens - from;
    let mut out = KvTensor::zeros(x.kv_heads, n, x.head_dim);
    for h in 0..x.kv_heads {
        out.head_mut(h)
            .copy_from_slice(&x.head(h)[from * x.head_dim..]);
    }
    out
}

/// How close one scheme's decode attention comes to exact attention on a [`Workload`].
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    pub family: Family,
    /// `‖o − o*‖ / ‖o*‖` of the decode output over all query heads, against exact attention.
    pub output_error: f64,
    /// Mean squared difference of the softmax probabilities (calibrated where the scheme asks) from
    /// the exact ones, over all query heads and tokens.
    pub softmax_mse: f64,
    /// Mean squared error of K̂ (after RoPE) over all cached tokens, relative to K's mean square.
    pub k_rel_mse: f64,
    /// Mean squared error of V̂, relative to V's mean square.
    pub v_rel_mse: f64,
    /// Cached tokens.
    pub tokens: usize,
    /// Tokens whose keys came from quantized pages (the rest are FP16).
    pub quantized_tokens: usize,
    /// This sequence's memory at the workload's shape ([`memory_with_rank`]).
    pub memory: Memory,
}

/// Refuses a workload larger than the machine's memory before any of it is allocated: the
/// generated layer at its peak, the copies the split into cached and held-out tokens makes, the
/// exact attention's probabilities, and one scheme's cache with its dequantized K/V.
fn check_workload_memory(
    cfg: &SynthConfig,
    tokens: usize,
    calibration: usize,
) -> Result<(), EvalError> {
    let kv = (tokens as u64)
        .checked_mul(cfg.kv_heads as u64)
        .and_then(|x| x.checked_mul(cfg.head_dim as u64))
        .and_then(|x| x.checked_mul(4));
    let probs = (tokens as u64)
        .checked_mul(cfg.kv_heads as u64)
        .and_then(|x| x.checked_mul(cfg.gqa as u64))
        .and_then(|x| x.checked_mul(8));
    let peak = synth::generate_bytes(&SynthConfig { tokens, ..*cfg })
        // The split's copies of K and V, then a scheme's cache and its dequantized K and V (the
        // generator's temporaries are gone by then): about four more K/V-sized buffers.
        .and_then(|b| b.checked_add(kv?.checked_mul(4)?))
        .and_then(|b| b.checked_add(probs?));
    resources::check(
        peak,
        &format!(
            "a synthetic workload of {} + {calibration} held-out tokens × {} KV heads × head_dim \
             {} (d_model {})",
            cfg.tokens, cfg.kv_heads, cfg.head_dim, cfg.d_model
        ),
    )
    .map_err(RefError::from)?;
    Ok(())
}

/// An XQuant scheme's cache of the workload's layer (the latents of its input through the SVD of
/// its projections). XQuant-CL runs a chain of two layers sharing this layer's weights: the
/// previous layer's input (`x_prev`) with a zero accumulator, then this layer's delta against its
/// reconstruction.
pub fn xquant_cache(spec: &SchemeSpec, w: &Workload) -> Result<XQuantCache, EvalError> {
    let s = &w.data;
    let p = w.projections()?;
    match Family::of(spec)? {
        Family::XQuant => Ok(XQuantCache::build(spec, &s.layer.x, p, s.rope)?),
        Family::XQuantCrossLayer => {
            let zeros = vec![0.0f32; s.layer.x_prev.len()];
            let (_, x_hat_prev) =
                XQuantCache::build_cross_layer(spec, &s.layer.x_prev, &zeros, p, s.rope)?;
            Ok(XQuantCache::build_cross_layer(spec, &s.layer.x, &x_hat_prev, p, s.rope)?.0)
        }
        other => Err(EvalError::Reference(RefError::WrongEntryPoint(format!(
            "`{spec}` is a {other} scheme, not XQuant"
        )))),
    }
}

/// Builds `spec`'s cache of the workload with the CPU reference and measures its attention error.
///
/// CommVQ trains its codebooks on the workload's held-out tokens first (the slow part: one to two
/// seconds per scheme for 1024 calibration tokens in a release build on 2 cores). XQuant-CL runs a
/// chain of two layers sharing this layer's weights: the previous layer's input (`x_prev`) with a
/// zero accumulator, then this layer's delta against its reconstruction.
pub fn evaluate(spec: &SchemeSpec, w: &Workload) -> Result<Evaluation, EvalError> {
    let s = &w.data;
    let family = Family::of(spec)?;
    let (h, d) = (s.k.kv_heads, s.k.head_dim);
    let mut rank = h * d;
    let deq = match family {
        Family::Int => IntCache::build(spec, &s.k, &s.v)?.dequantize(),
        Family::CommVq => {
            let books = w.codebooks(spec)?;
            CommVqCache::build(spec, &s.k_pre_rope, &s.v, s.rope, &books)?.dequantize()
        }
        Family::XQuant | Family::XQuantCrossLayer => {
            rank = w.projections()?.k.rank;
            xquant_cache(spec, w)?.dequantize()
        }
    };
    let memory = memory_with_rank(spec, d as u32, h as u32, rank, s.k.tokens as u64)?;
    compare(family, spec, w, &s.q, &deq, memory)
}

fn compare(
    family: Family,
    spec: &SchemeSpec,
    w: &Workload,
    q: &Queries,
    deq: &Dequantized,
    memory: Memory,
) -> Result<Evaluation, EvalError> {
    let s = &w.data;
    if (deq.k.kv_heads, deq.k.tokens, deq.k.head_dim) != (s.k.kv_heads, s.k.tokens, s.k.head_dim) {
        return Err(EvalError::Workload(
            "the dequantized cache does not have the sequence's shape".into(),
        ));
    }
    let probs = attention::probabilities(q, &deq.k, &deq.k_quantized, spec.calibrate.as_ref())?;
    let out = attention::weighted_values(&probs, q.q_heads, &deq.v);
    Ok(Evaluation {
        family,
        output_error: attention::relative_error(&out, &w.exact_out),
        softmax_mse: attention::mse(&probs, &w.exact_probs),
        k_rel_mse: relative_mse(&deq.k.data, &s.k.data),
        v_rel_mse: relative_mse(&deq.v.data, &s.v.data),
        tokens: s.k.tokens,
        quantized_tokens: deq.k_quantized.iter().filter(|q| **q).count(),
        memory,
    })
}

/// `mse(a, b) / mean(b²)`.
fn relative_mse(a: &[f32], b: &[f32]) -> f64 {
    let power = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / b.len().max(1) as f64;
    attention::mse(a, b) / power.max(f64::MIN_POSITIVE)
}
