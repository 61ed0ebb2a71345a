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
pub mod encoder;
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
pub use encoder::{AdditiveTables, EncoderTables, RopeTables, SideTables};
pub use file::{CodebookFileError, CODEBOOK_FILE_FORMAT, CODEBOOK_FILE_LIMIT};
pub use footprint::{Footprint, TensorFootprint};
pub use key::KeyCodebook;
pub use key_em::EmSchedule;
pub use layout::TensorLayout;
pub use train::{train, train_with, CalibrationData, Codebooks, TensorCodebook, TrainOptions};

use crate::rope::Rope;
use crate::{KvTensor, RefError};
use kvq_spec::{CacheSource, SchemeSpec, TensorQuant};

/// An f64 rounded to f16 the way every host and the GPU encoders round it: to the nearest f32, then
/// to the nearest f16 (both ties to even). `half`'s own `f16::from_f64` goes through f32 on CPUs with
/// F16C and directly elsewhere, so the codes and codebooks would depend on the host.
pub(crate) fn f16_of_f64(x: f64) -> half::f16 {
    half::f16::from_f32(x as f32)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Just above a tie of f16 but a tie once in f32: through f32 it rounds to even, as the GPU
    /// encoders do, whatever the host's `half` would do in one step.
    #[test]
    fn f64_to_f16_rounds_through_f32_on_every_host() {
        let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(f16_of_f64(x), half::f16::ONE);
        assert_eq!(
            f16_of_f64(1.0 + 2f64.powi(-11) + 2f64.powi(-20)).to_f64(),
            1.0 + 2f64.powi(-10)
        );
        assert!(f16_of_f64(65520.0).is_infinite() && f16_of_f64(65519.0).to_f64() == 65504.0);
    }
}
