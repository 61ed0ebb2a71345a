//! Synthetic decode inputs for timing and the correctness check: the reference's fast generator
//! ([`kvq_reference::synth::random_kv`], uniform values with outlier key channels), and queries
//! rounded to the kernel's dtype. The generator lives in the reference crate, the one home of
//! synthetic data; this module adds only what needs a kernel [`Dtype`].

use half::{bf16, f16};
use kvq_codegen::Dtype;
use kvq_reference::resources::{self, AllocError};
use kvq_reference::synth::{self, Tails};
use kvq_reference::KvTensor;

pub use kvq_reference::synth::SynthRng;

/// Random K and V of one sequence, `[kv_heads][tokens][head_dim]`: [`synth::random_kv`] with
/// [`Tails::Uniform`] (uniform values with a per-token offset; one K channel in 16 amplified
/// eightfold), memory checked first.
pub fn random_kv(
    kv_heads: usize,
    tokens: usize,
    head_dim: usize,
    seed: u64,
) -> Result<(KvTensor, KvTensor), AllocError> {
    synth::random_kv(kv_heads, tokens, head_dim, seed, Tails::Uniform)
}

/// `n` random query values ([`synth::random_query_values`]) rounded to `dtype`: the device words
/// and the values the reference sees, with the memory checked first.
pub fn random_queries(
    n: usize,
    dtype: Dtype,
    seed: u64,
) -> Result<(Vec<u16>, Vec<f32>), AllocError> {
    let what = format!("the synthetic queries ({n} values)");
    let per_value = (std::mem::size_of::<u16>() + 2 * std::mem::size_of::<f32>()) as u64;
    resources::check((n as u64).checked_mul(per_value), &what)?;
    let raw = synth::random_query_values(n, seed)?;
    let mut bits = resources::try_with_capacity::<u16>(n, &what)?;
    let mut values = resources::try_with_capacity::<f32>(n, &what)?;
    for x in raw {
        let (b, v) = round_to_word(x, dtype);
        bits.push(b);
        values.push(v);
    }
    Ok((bits, values))
}

/// `x` rounded to `dtype` (nearest even): the device word and the value it holds, which is what
/// a reference computing on the same inputs must see.
pub fn round_to_word(x: f32, dtype: Dtype) -> (u16, f32) {
    match dtype {
        Dtype::F16 => {
            let h = f16::from_f32(x);
            (h.to_bits(), h.to_f32())
        }
        Dtype::Bf16 => {
            let h = bf16::from_f32(x);
            (h.to_bits(), h.to_f32())
        }
    }
}

/// A device word of `dtype` as f32.
pub fn word_to_f32(bits: u16, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F16 => f16::from_bits(bits).to_f32(),
        Dtype::Bf16 => bf16::from_bits(bits).to_f32(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_nonzero_and_bounded() {
        let (k, v) = random_kv(2, 50, 64, 7).unwrap();
        let (k2, _) = random_kv(2, 50, 64, 7).unwrap();
        assert_eq!(k, k2);
        assert_eq!(k.data.len(), 2 * 50 * 64);
        assert!(k
            .data
            .iter()
            .chain(&v.data)
            .all(|x| x.is_finite() && x.abs() <= 10.1));
        assert!(k.data.iter().filter(|x| **x == 0.0).count() < 5);
        assert!(
            k.data.iter().any(|x| x.abs() > 2.0),
            "outlier channels present"
        );
        assert!(v.data.iter().all(|x| x.abs() <= 1.26));
        let (bits, vals) = random_queries(100, Dtype::Bf16, 3).unwrap();
        for (b, v) in bits.iter().zip(&vals) {
            assert_eq!(word_to_f32(*b, Dtype::Bf16), *v);
        }
        let (b16, _) = random_queries(100, Dtype::F16, 3).unwrap();
        assert_ne!(b16, bits);
    }

    #[test]
    fn sizes_past_the_machine_are_errors_naming_the_bytes_not_aborts() {
        // 100M tokens × 8 heads × 128 channels × 4 bytes × 2 tensors: 819.2 GB.
        let e = random_kv(8, 100_000_000, 128, 1).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("synthetic K and V") && s.contains("819200000000 bytes"),
            "{s}"
        );
        // Past 64 bits.
        let e = random_kv(usize::MAX, 2, 2, 1).unwrap_err();
        assert_eq!(e.bytes, None, "{e}");
        let e = random_queries(usize::MAX / 2, Dtype::F16, 1).unwrap_err();
        assert!(e.to_string().contains("synthetic queries"), "{e}");
    }
}
