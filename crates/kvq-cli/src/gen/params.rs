//! Which block parameters the generated sources take: the flags, else the tuned results, else the
//! codegen default.

use kvq::codegen::{KernelShape, TuneParams};
use kvq::runtime::tune::{candidates_checksum, TuneEntry, TuneStore};
use kvq::SchemeSpec;

use super::GenRequest;
use crate::error::{CliError, Result};

/// Entries of the tune store for this scheme and kernel shape (any GPU, any bucket) chosen from
/// this kvq's candidate set (the key's checksum).
pub(super) fn tuned_entries(
    store: &TuneStore,
    spec: &SchemeSpec,
    shape: &KernelShape,
) -> Vec<TuneEntry> {
    let hash = format!("{:016x}", spec.stable_hash());
    let candidates = candidates_checksum(spec, shape);
    store
        .entries()
        .iter()
        .filter(|e| {
            e.problem.scheme_hash == hash
                && e.problem.head_dim == shape.head_dim
                && e.problem.gqa == shape.gqa
                && e.problem.dtype == shape.dtype
                && e.problem.candidates == candidates
                && e.choice.check().is_ok()
        })
        .cloned()
        .collect()
}

/// Block parameters for the sources: flags, else the most common tuned choice (ties: the most
/// recent), else the default.
pub(super) fn choose_params(
    req: &GenRequest,
    shape: &KernelShape,
    tuned: &[TuneEntry],
) -> Result<(TuneParams, &'static str)> {
    let default = TuneParams::default_for(&req.scheme.spec, shape);
    if req.threads.is_some()
        || req.tile_tokens.is_some()
        || req.min_warps_per_sm.is_some()
        || req.pack_heads.is_some()
        || req.short_staging.is_some()
        || req.store_scores.is_some()
    {
        let p = TuneParams {
            threads: req.threads.unwrap_or(default.threads),
            tile_tokens: req.tile_tokens.unwrap_or(default.tile_tokens),
            min_warps_per_sm: req.min_warps_per_sm.unwrap_or(default.min_warps_per_sm),
            pack_heads: req.pack_heads.unwrap_or(default.pack_heads),
            short_staging: req.short_staging.unwrap_or(default.short_staging),
            store_scores: req.store_scores.unwrap_or(default.store_scores),
        };
        p.validate().map_err(|e| {
            CliError::Usage(format!(
                "--threads/--tile-tokens/--min-warps-per-sm/--pack-heads/--short-staging/\
                 --store-scores: {e}"
            ))
        })?;
        return Ok((p, "flags"));
    }
    let mut best: Option<(TuneParams, usize, u64)> = None;
    for e in tuned {
        let p = e.choice.params;
        let count = tuned.iter().filter(|x| x.choice.params == p).count();
        let newest = tuned
            .iter()
            .filter(|x| x.choice.params == p)
            .map(|x| x.tuned_at_unix)
            .max()
            .unwrap_or(0);
        let better = match best {
            None => true,
            Some((_, c, t)) => (count, newest) > (c, t),
        };
        if better {
            best = Some((p, count, newest));
        }
    }
    Ok(match best {
        Some((p, _, _)) => (p, "tuned"),
        None => (default, "default"),
    })
}
