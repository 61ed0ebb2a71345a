//! Synthetic XQuant caches for timing (the tuner, `kvq bench`, `kvq demo`'s latency): random
//! latents quantized by the CPU reference over synthetic projections. The decode's time depends on
//! the widths and the token count only, so neither a real layer nor its SVD is needed, and every
//! caller times the same kind of cache.

use kvq_reference::resources::{self, AllocError};
use kvq_reference::rope::Rope;
use kvq_reference::synth::SynthRng;
use kvq_reference::xquant::{Projections, XQuantCache};
use kvq_spec::{CacheSource, SchemeSpec, XSource};

use crate::error::{Result, RuntimeError};

fn reference(what: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::InvalidInput(format!("{what}: {e}"))
}

/// `n` values uniform in [-2, 2) (the latents' spread: a projection of unit-scale inputs onto
/// orthonormal directions), allocated only if the machine has the memory.
fn random_latents(n: usize, rng: &mut SynthRng, what: &str) -> Result<Vec<f32>> {
    let mut out: Vec<f32> = resources::try_with_capacity(n, what).map_err(RuntimeError::Memory)?;
    out.extend((0..n).map(|_| 2.0 * rng.symmetric()));
    Ok(out)
}

/// One sequence of `tokens` random latents of `spec` over `projections`, quantized and stored by
/// the CPU reference as a cache written from a real layer input is; for XQuant-CL
/// (`x(cross_layer)`) with random accumulator latents too, which its decode adds to the deltas.
pub fn random_latent_cache(
    spec: &SchemeSpec,
    projections: &Projections,
    tokens: usize,
    rope: Rope,
    seed: u64,
) -> Result<XQuantCache> {
    let (rk, rv) = (projections.k.rank, projections.v.rank);
    let count = |rank: usize| {
        tokens.checked_mul(rank).ok_or_else(|| {
            RuntimeError::Memory(AllocError::overflow(format!(
                "{tokens} tokens of {rank} latents"
            )))
        })
    };
    let (nk, nv) = (count(rk)?, count(rv)?);
    let mut rng = SynthRng::new(seed);
    let lk = random_latents(nk, &mut rng, "the K latents")?;
    let lv = random_latents(nv, &mut rng, "the V latents")?;
    match spec.source {
        CacheSource::X(XSource::CrossLayer) => {
            let bk = random_latents(nk, &mut rng, "the accumulator's K latents")?;
            let bv = random_latents(nv, &mut rng, "the accumulator's V latents")?;
            XQuantCache::from_cross_layer_latents(spec, (&lk, &lv), (&bk, &bv), projections, rope)
        }
        _ => XQuantCache::from_latents(spec, &lk, &lv, projections, rope),
    }
    .map_err(|e| reference(&format!("a random latent cache of `{spec}`"), e))
}

/// [`random_latent_cache`] over [`Projections::synthetic`] of a layer whose input is `d_model`
/// wide (latents of `min(d_model, kv_heads·head_dim)`), with the default RoPE.
pub fn synthetic_cache(
    spec: &SchemeSpec,
    (kv_heads, head_dim, d_model): (usize, usize, usize),
    tokens: usize,
    seed: u64,
) -> Result<XQuantCache> {
    let projections = Projections::synthetic(kv_heads, head_dim, d_model, seed)
        .map_err(|e| reference("synthetic projections", e))?;
    random_latent_cache(
        spec,
        &projections,
        tokens,
        Rope::default(),
        seed ^ 0x6c61_7465,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sources_build_at_the_projections_rank() {
        for text in [
            "k = int(2, channel), v = int(2, token), source = x(latent)",
            "k = int(2, channel), v = int(2, token), source = x(cross_layer)",
        ] {
            let spec: SchemeSpec = text.parse().unwrap();
            let c = synthetic_cache(&spec, (2, 32, 256), 130, 3).unwrap();
            assert_eq!(c.tokens(), 130);
            assert_eq!(c.projections().k.rank, 64);
            assert_eq!(
                c.accumulator_latents().is_some(),
                spec.source == CacheSource::X(XSource::CrossLayer)
            );
            assert_eq!(c, synthetic_cache(&spec, (2, 32, 256), 130, 3).unwrap());
        }
    }

    #[test]
    fn other_schemes_and_impossible_sizes_are_errors() {
        let kivi: SchemeSpec = "k = int(2, channel), v = int(2, token)".parse().unwrap();
        let e = synthetic_cache(&kivi, (2, 32, 64), 10, 1).unwrap_err();
        assert!(e.to_string().contains("random latent cache"), "{e}");
        let x2: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(latent)"
            .parse()
            .unwrap();
        assert!(synthetic_cache(&x2, (2, 32, 64), usize::MAX / 2, 1).is_err());
    }
}
