//! Synthetic decode inputs for timing and the correctness check: fast, seeded, never zero, with a
//! few large-magnitude key channels (the structure that makes quantization schemes differ, and
//! that makes Kitty boost real channels).
//!
//! Speed matters more than statistical quality here (a 128K-token cache is 268M values), so this
//! is SplitMix64, not a cryptographic or crate-provided generator.

use half::{bf16, f16};
use kvq_codegen::Dtype;
use kvq_reference::resources::{self, AllocError};
use kvq_reference::KvTensor;

/// SplitMix64: one multiply-xorshift chain per value.
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

/// Random K and V of one sequence, `[kv_heads][tokens][head_dim]`: uniform values with a per-token
/// offset; one K channel in 16 is amplified eightfold.
///
/// The sizes come from callers' flags and shapes, so the memory is checked and reserved before
/// any is taken: a size past the machine (or past 64 bits) is an [`AllocError`] naming the bytes,
/// never an allocation abort.
pub fn random_kv(
    kv_heads: usize,
    tokens: usize,
    head_dim: usize,
    seed: u64,
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
        let mut gains = resources::try_with_capacity::<f32>(gains_len, &what)?;
        gains.extend((0..gains_len).map(|_| {
            if outliers && rng.next_u64() % 16 == 0 {
                8.0
            } else {
                1.0
            }
        }));
        let mut data = resources::try_with_capacity::<f32>(count, &what)?;
        for h in 0..kv_heads {
            let gains = &gains[h * head_dim..(h + 1) * head_dim];
            for _ in 0..tokens {
                let offset = 0.25 * rng.symmetric();
                data.extend(gains.iter().map(|g| (rng.symmetric() + offset) * g));
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

/// `n` random query values rounded to `dtype`: the device words and the values the reference sees,
/// with the memory checked first as in [`random_kv`].
pub fn random_queries(
    n: usize,
    dtype: Dtype,
    seed: u64,
) -> Result<(Vec<u16>, Vec<f32>), AllocError> {
    let what = format!("the synthetic queries ({n} values)");
    let per_value = (std::mem::size_of::<u16>() + std::mem::size_of::<f32>()) as u64;
    resources::check((n as u64).checked_mul(per_value), &what)?;
    let mut bits = resources::try_with_capacity::<u16>(n, &what)?;
    let mut values = resources::try_with_capacity::<f32>(n, &what)?;
    let mut rng = SynthRng::new(seed ^ 0x5155_4552_5951); // distinct stream from K/V's
    for _ in 0..n {
        let (b, v) = round_to_word(1.5 * rng.symmetric(), dtype);
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
