//! Integer quantization (KIVI, Kitty, CalibQuant, INT8) and FP16 caches: the paged store whose bytes
//! the GPU kernels read (`docs/LAYOUT.md`), and decode attention over it.
//!
//! [`IntCache`] stores a sequence's K and V; [`TensorStore`] stores any one `[heads][tokens][dim]`
//! tensor the same way (XQuant stores its latents with it). Both expose the exact bytes for GPU tests.
//!
//! ```
//! use kvq_reference::{int, synth, attention};
//! let spec = kvq_spec::SchemeSpec::parse("k = int(2, channel), v = int(2, token), local = 128").unwrap();
//! let s = synth::generate(&synth::SynthConfig { tokens: 400, head_dim: 64, d_model: 96, ..Default::default() });
//! let out = int::attend(&spec, &s.k, &s.v, &s.q).unwrap();
//! let exact = attention::exact(&s.q, &s.k, &s.v).unwrap();
//! assert!(attention::relative_error(&out, &exact) < 0.5);
//! ```

mod boost;
mod layout;
mod page;
mod quantize;
mod store;

/// The f16 type of the FP16 buffers and of scales/zeros.
pub use half::f16;

pub use boost::{scores as boost_scores, select as select_boosted};
pub use layout::{
    align, boosted_channels, fp16_block_bytes, BoostLayout, IntLayout, Section, ALIGN,
    LAYOUT_VERSION, NOT_BOOSTED,
};
pub use page::{decode_fp16, decode_page, encode_fp16, encode_page};
pub use quantize::{f16_down, f16_next_down, f16_next_up, f16_up, GroupParams, Quantizer, F16_MAX};
pub use store::{check_cacheable, check_tensor_shape, TensorStore};

use crate::attention::{self, Queries};
use crate::{Dequantized, KvTensor, RefError};
use kvq_spec::{CacheSource, SchemeSpec, TensorQuant};

/// A sequence's K and V in the cache layout of an integer or FP16 scheme.
#[derive(Debug, Clone, PartialEq)]
pub struct IntCache {
    spec: SchemeSpec,
    k: TensorStore,
    v: TensorStore,
}

fn check_entry(spec: &SchemeSpec) -> Result<(), RefError> {
    if let CacheSource::X(_) = spec.source {
        return Err(RefError::WrongEntryPoint(
            "this scheme caches the layer input: use kvq_reference::xquant".into(),
        ));
    }
    for (name, t) in [("k", &spec.k), ("v", &spec.v)] {
        if let TensorQuant::Codebook(_) = t {
            return Err(RefError::WrongEntryPoint(format!(
                "{name} uses a codebook: use kvq_reference::commvq"
            )));
        }
    }
    Ok(())
}

impl IntCache {
    /// Quantizes and packs a sequence's K and V (`[kv_heads][tokens][head_dim]`). Checks the entry
    /// point, shapes and values (no NaN/Inf, |x| ≤ 65504) before storing anything.
    pub fn build(spec: &SchemeSpec, k: &KvTensor, v: &KvTensor) -> Result<Self, RefError> {
        check_entry(spec)?;
        if (k.kv_heads, k.tokens, k.head_dim) != (v.kv_heads, v.tokens, v.head_dim) {
            return Err(RefError::Mismatch(format!(
                "K is [{}][{}][{}] but V is [{}][{}][{}]",
                k.kv_heads, k.tokens, k.head_dim, v.kv_heads, v.tokens, v.head_dim
            )));
        }
        spec.check_shape_usize(k.head_dim, k.kv_heads)?;
        check_cacheable(k, "k")?;
        check_cacheable(v, "v")?;
        Ok(Self {
            spec: *spec,
            k: TensorStore::build(spec, &spec.k, k, "k")?,
            v: TensorStore::build(spec, &spec.v, v, "v")?,
        })
    }

    pub fn spec(&self) -> &SchemeSpec {
        &self.spec
    }

    pub fn k(&self) -> &TensorStore {
        &self.k
    }

    pub fn v(&self) -> &TensorStore {
        &self.v
    }

    pub fn tokens(&self) -> usize {
        self.k.tokens()
    }

    /// Bytes allocated for this sequence (pools and FP16 buffers of both tensors).
    pub fn allocated_bytes(&self) -> usize {
        self.k.allocated_bytes() + self.v.allocated_bytes()
    }

    /// K̂ and V̂ decoded from the stored bytes, and which keys came from quantized pages.
    pub fn dequantize(&self) -> Dequantized {
        Dequantized {
            k: self.k.dequantize(),
            v: self.v.dequantize(),
            k_quantized: (0..self.k.tokens())
                .map(|t| self.k.is_quantized(t))
                .collect(),
        }
    }
}

/// Decode attention of `q` over the sequence as the scheme caches it (calibrated if it asks).
pub fn attend(
    spec: &SchemeSpec,
    k: &KvTensor,
    v: &KvTensor,
    q: &Queries,
) -> Result<Vec<f32>, RefError> {
    let cache = IntCache::build(spec, k, v)?;
    attention::decode(q, &cache.dequantize(), spec.calibrate.as_ref())
}

/// A step of `q.q_len` query tokens, the sequence's last tokens, over the sequence as the scheme
/// caches it: each row causal, with its LSE ([`step`](crate::step)).
///
/// ```
/// use kvq_reference::{int, step::StepQueries, synth};
/// let spec = kvq_spec::SchemeSpec::parse("k = int(2, channel), v = int(2, token), local = 64").unwrap();
/// let s = synth::generate(&synth::SynthConfig { tokens: 200, head_dim: 64, d_model: 96, ..Default::default() });
/// let state = int::attend_step(&spec, &s.k, &s.v, &StepQueries::repeat(&s.q, 4)).unwrap();
/// assert_eq!(state.lse.len(), 4 * s.q.q_heads);
/// ```
pub fn attend_step(
    spec: &SchemeSpec,
    k: &KvTensor,
    v: &KvTensor,
    q: &crate::step::StepQueries,
) -> Result<crate::step::AttentionState, RefError> {
    let cache = IntCache::build(spec, k, v)?;
    crate::step::attend(q, &cache.dequantize(), spec.calibrate.as_ref())
}
