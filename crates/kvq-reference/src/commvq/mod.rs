//! CommVQ (Li et al., ICML 2025): additive vector quantization of the KV cache with learned codebooks.
//!
//! - Keys: a RoPE-commutative codebook ([`key`]) encodes the keys *before* RoPE; each entry acts on a
//!   RoPE pair as the complex number `x + iy` (the 2×2 matrix `[[x, y], [−y, x]]`), which commutes with
//!   the rotation, so RoPE can be applied after decoding ([`CommVqCache::dequantize`]) or folded into a
//!   per-query table of `q·C` ([`CommVqCache::scores`]). Trained by EM with annealed soft assignments
//!   ([`key_em`]), encoded greedily round by round. One f16 scale (the vector's norm) per vector.
//! - Values: a binary additive codebook ([`additive`]), `v̂ = w·(s·C) ⊙ σ`; attention reorders to
//!   `((p·w·S)·C) ⊙ σ` ([`CommVqCache::weighted_values`]).
//! - Sink and local windows stay FP16 (f16-rounded; keys after RoPE), split by [`TokenRegions`]
//!   exactly as for the integer schemes; whole pages are coded.
//!
//! Bit layout: [`layout`] and `docs/CODEBOOKS.md`. Footprint: [`CommVqCache::footprint`].
//!
//! [`TokenRegions`]: crate::regions::TokenRegions

pub mod additive;
mod additive_train;
mod cache;
pub mod device;
mod fast;
pub mod file;
mod footprint;
pub mod key;
pub mod key_em;
pub mod layout;
pub(crate) mod linalg;
mod pairs;
mod train;
mod vectors;

pub use additive::AdditiveCodebook;
pub use additive_train::AdditiveSchedule;
pub use cache::{Coding, CommVqCache, Stored};
pub use device::{
    device_attend, DeviceCodebooks, DeviceLayout, DeviceSequence, DeviceTensor, SideKind,
    SideLayout, DEVICE_LAYOUT_VERSION,
};
pub use file::{CodebookFileError, CODEBOOK_FILE_FORMAT, CODEBOOK_FILE_LIMIT};
pub use footprint::{Footprint, TensorFootprint};
pub use key::KeyCodebook;
pub use key_em::EmSchedule;
pub use layout::TensorLayout;
pub use train::{train, train_with, CalibrationData, Codebooks, TensorCodebook, TrainOptions};

use crate::rope::Rope;
use crate::{KvTensor, RefError};
use kvq_spec::{CacheSource, SchemeSpec, TensorQuant};

/// Checks what every CommVQ entry point needs: a codebook/FP16 scheme over K/V, agreeing finite tensors.
pub(crate) fn check_inputs(spec: &SchemeSpec, k: &KvTensor, v: &KvTensor) -> Result<(), RefError> {
    if spec.source != CacheSource::Kv {
        return Err(RefError::WrongEntryPoint(
            "this scheme caches layer activations: use `xquant`, not `commvq`".into(),
        ));
    }
    for (t, which) in [(&spec.k, "k"), (&spec.v, "v")] {
        if matches!(t, TensorQuant::Int(_)) {
            return Err(RefError::WrongEntryPoint(format!(
                "`{which}` is integer-quantized: use `int::IntCache`, not `commvq`"
            )));
        }
    }
    if (k.kv_heads, k.tokens, k.head_dim) != (v.kv_heads, v.tokens, v.head_dim) {
        return Err(RefError::Mismatch(format!(
            "K is [{} × {} × {}] but V is [{} × {} × {}]",
            k.kv_heads, k.tokens, k.head_dim, v.kv_heads, v.tokens, v.head_dim
        )));
    }
    spec.check_shape_usize(k.head_dim, k.kv_heads)?;
    // NaN/Inf, or beyond the f16 range of the FP16 tokens: the integer schemes' rule.
    crate::int::check_cacheable(k, "k")?;
    crate::int::check_cacheable(v, "v")?;
    Ok(())
}

/// The query heads a KV head serves (GQA) for decode queries `q` over a sequence of `tokens` tokens
/// of `kv_heads` heads of `head_dim`; a mismatch or an empty sequence is refused.
pub(crate) fn check_queries(
    q: &crate::attention::Queries,
    kv_heads: usize,
    head_dim: usize,
    tokens: usize,
) -> Result<usize, RefError> {
    if q.head_dim != head_dim
        || q.data.len() != q.q_heads * q.head_dim
        || kv_heads == 0
        || q.q_heads % kv_heads != 0
    {
        return Err(RefError::Mismatch(format!(
            "{} query heads of {} channels against {kv_heads} KV heads of {head_dim}",
            q.q_heads, q.head_dim
        )));
    }
    if tokens == 0 {
        return Err(RefError::Mismatch(
            "attention over an empty sequence".into(),
        ));
    }
    Ok(q.q_heads / kv_heads)
}

/// `k` rotated to positions `0..tokens`.
pub(crate) fn post_rope(k: &KvTensor, rope: Rope) -> KvTensor {
    let mut out = k.clone();
    for h in 0..k.kv_heads {
        for t in 0..k.tokens {
            rope.apply(out.row_mut(h, t), t);
        }
    }
    out
}
