//! The typed form of a quantization scheme.
//!
//! Every type here is `Copy` and built only from numbers and enums, so the `#[scheme]` attribute can
//! emit a `SchemeSpec` as a `const` and the runtime can hash, compare and print it freely.

use serde::{Deserialize, Serialize};

/// Which axis owns a scale/zero pair.
///
/// `Channel`: every channel has its own scale over a group of tokens (KIVI's keys).
/// `Token`: every token has its own scale over a group of channels (KIVI's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Axis {
    Channel,
    Token,
}

/// How Kitty ranks channels for the precision boost within a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BoostCriterion {
    /// Mean |x| over the page's tokens (Kitty's choice).
    Magnitude,
    /// Variance over the page's tokens.
    Variance,
}

/// Kitty's dynamic channel-wise precision boost: per page, the top `ratio · D` channels are stored with
/// `bits` bits instead of the tensor's base bits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Boost {
    pub bits: u8,
    pub ratio: f32,
    pub by: BoostCriterion,
}

/// Integer (scalar) quantization of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct IntQuant {
    /// 1, 2, 3, 4 or 8.
    pub bits: u8,
    pub axis: Axis,
    /// Elements sharing one scale: tokens for `Axis::Channel` (always one page), channels for
    /// `Axis::Token` (`None` = the whole head).
    pub group: Option<u32>,
    /// Symmetric (scale only, codes centred on zero) instead of asymmetric (scale + zero).
    pub symmetric: bool,
    pub boost: Option<Boost>,
    /// Overrides the cache-wide FP16 local window for this tensor.
    pub local: Option<u32>,
}

/// Which vectors one codebook code covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CodebookSpan {
    /// One KV head's vector (head_dim scalars).
    Head,
    /// All KV heads of a token concatenated (kv_heads · head_dim scalars).
    Token,
}

/// Vector-quantization codebooks (CommVQ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Codebook {
    /// Additive VQ whose entries are 2×2 matrices `[[x, y], [-y, x]]` acting on RoPE pairs, so they
    /// commute with the rotation. `levels` (CommVQ's N') matrices per pair and round; each of the
    /// `residuals` rounds picks two of them for a group of `pairs_per_code` pairs (one per basis
    /// direction of a pair), so a code is `2 · log2(levels)` bits per `2 · pairs_per_code` scalars:
    /// `residuals · log2(levels) / pairs_per_code` bits/scalar.
    RopeCommutative {
        levels: u32,
        residuals: u32,
        pairs_per_code: u32,
    },
    /// Additive VQ with a binary code `s ∈ {0,1}^rows` per vector: `v̂ = s · C`.
    Additive { rows: u32 },
}

/// A codebook quantizer and the span of its vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CodebookQuant {
    pub codebook: Codebook,
    pub span: CodebookSpan,
}

/// How one of K or V is stored.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum TensorQuant {
    Fp16,
    Int(IntQuant),
    Codebook(CodebookQuant),
}

/// CalibQuant's calibration of quantized tokens' pre-softmax scores:
/// `g(x) = (δ−γ+τ1−τ2)/(δ−γ)·(x−γ) + γ−τ1`, with `[γ, δ]` the range of the scores.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub tau1: f32,
    pub tau2: f32,
}

/// What the cache holds for XQuant-style rematerialisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum XSource {
    /// The layer input projected to low-rank latents `X·U_k`, `X·U_v` (GQA models).
    Latent,
    /// Cross-layer deltas `Q(X_i − X̂_{i−1})` with an accumulator (XQuant-CL).
    CrossLayer,
}

/// The source of the cached tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CacheSource {
    /// K and V themselves (every scheme but XQuant).
    Kv,
    /// The layer input X; K and V are rematerialised from it.
    X(XSource),
}

/// A complete KV-cache quantization scheme.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SchemeSpec {
    pub k: TensorQuant,
    pub v: TensorQuant,
    /// Tokens per cache page (one channel-axis quantization group).
    pub page: u32,
    /// First tokens kept in FP16 (attention sinks).
    pub sink: u32,
    /// Most recent tokens kept in FP16, unless a tensor overrides it.
    pub local: u32,
    pub calibrate: Option<Calibration>,
    pub source: CacheSource,
}

/// Default tokens per page (KIVI's and Kitty's group size).
pub const DEFAULT_PAGE: u32 = 128;

impl TensorQuant {
    /// True when the tensor is stored at lower precision than FP16.
    pub const fn is_quantized(&self) -> bool {
        !matches!(self, TensorQuant::Fp16)
    }

    /// The integer quantizer, if this tensor uses one.
    pub const fn as_int(&self) -> Option<&IntQuant> {
        match self {
            TensorQuant::Int(q) => Some(q),
            _ => None,
        }
    }
}

impl SchemeSpec {
    /// The FP16 local window of `tensor` (its override, else the cache-wide value).
    pub fn local_of(&self, tensor: &TensorQuant) -> u32 {
        match tensor {
            TensorQuant::Int(IntQuant { local: Some(l), .. }) => *l,
            _ => self.local,
        }
    }

    /// A stable 64-bit hash of the canonical text (FNV-1a); used in cache keys and kernel names.
    pub fn stable_hash(&self) -> u64 {
        let text = self.to_string();
        text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }
}

impl Codebook {
    /// Payload bits per cached scalar of a vector of `dim` scalars.
    pub fn bits_per_scalar(&self, dim: u32) -> f64 {
        match *self {
            Codebook::RopeCommutative {
                levels,
                residuals,
                pairs_per_code,
            } => residuals as f64 * (levels as f64).log2() / pairs_per_code as f64,
            Codebook::Additive { rows } => rows as f64 / dim as f64,
        }
    }
}
