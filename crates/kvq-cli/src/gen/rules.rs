//! The launch rules of the runtime's untuned launches as data for the manifest: the resolved
//! [`LaunchRules`] of the scheme and kernel shape (the same values the runtime evaluates), and
//! the evaluation an engine follows to reproduce the runtime's block, split count, pieces,
//! staging path, stored scores and fast-memory occupancy.

use kvq::codegen::rules::LaunchRules;
use kvq::codegen::KernelShape;
use kvq::SchemeSpec;

/// The rules of `spec`'s kernels at `shape`, as the runtime evaluates them.
pub(super) fn launch_rules(spec: &SchemeSpec, shape: &KernelShape) -> LaunchRules {
    LaunchRules::for_kernel(spec, shape)
}

/// How an engine evaluates `tune.rules` (kvq's `LaunchRules::choose`), step by step; every
/// number comes from the rules document, none is written here.
pub(super) fn evaluation() -> Vec<String> {
    [
        "inputs: batch, kv_heads, max_len (longest sequence), sm_count, resident_ctas (sm_count × \
         cuOccupancyMaxActiveBlocksPerMultiprocessor of the decode kernel of the occupancy \
         block: the chosen rule's block, or default where the rule is few_pairs with \
         splits_from_default or no rule applies), fast_memory (2·memory_clock·bus_width / 8 / \
         sm_count ≥ constants.fast_memory_gbps_per_sm GB/s)",
        "pairs = batch·kv_heads·grid_rows; bucket = next power of two ≥ max(max_len, 1); \
         rule_bucket = next power of two ≥ max(max_len, constants.min_rule_bucket)",
        "rule = the first of rules whose `when` holds: whole_pairs: waves = ceil(pairs / \
         sm_count), 1000·pairs ≥ whole_pairs_fill_permille·waves·sm_count, waves and \
         rule_bucket in range; one_tile: pairs in range, s = rule_bucket / (tile_tokens·threads/32) \
         in 1..=max_splits, pairs·s ≤ max(1, floor(min_warps_per_sm / (threads/32)))·sm_count; \
         few_pairs: pairs and rule_bucket in range. block = rule.block, else default",
        "warp_tokens = short_warp_tokens if short_warps and bucket ≤ short_context_bucket, else \
         warp_tokens; splits(slots) = with most = clamp(bucket / (warp_tokens·warps), 1, \
         most_splits) and lo = clamp(ceil(fill_permille·slots / (1000·pairs)), 1, most), the s \
         in lo..=min(2·lo, most) maximising 1000·pairs·s / (ceil(pairs·s / slots)·slots), ties to \
         the smaller",
        "num_splits = 1 (whole_pairs), s (one_tile), else splits(resident_ctas)",
        "short_staging = block.short_staging_choice and (block.short_staging or bucket / \
         (num_splits·warps) ≥ short_staging_min_warp_tokens); store_scores = block.store_scores \
         and (whole_pairs or (bucket > short_context_bucket and (cta_gqa ≤ \
         stored_scores_max_gqa or stored_scores_any_gqa)))",
        "fast memory, outside whole_pairs and one_tile: where block.fast_memory has an entry \
         with this short_staging and store_scores: s12 = max(1, splits(sm_count·(\
         fast_memory_warps_per_sm / warps))); share = bucket / (s12·warps); if share ≥ \
         fast_memory_min_warp_tokens: min_warps_per_sm = fast_memory_warps_per_sm, \
         short_staging = true, tile_tokens = 64 where the entry's tile64 and share ≥ \
         fast_memory_tile64_min_warp_tokens, num_splits = s12",
        "pieces (none for whole_pairs): share = bucket / (num_splits·warps); long_shares: \
         num_pieces = long_shares_per_split·num_splits and piece_permille = \
         long_shares_permille where share ≥ long_shares_min_warp_tokens; few_splits: \
         num_pieces = few_splits_count and piece_permille = few_splits_permille where \
         num_splits·warps ≤ few_splits_max_warps and share ≥ few_splits_min_warp_tokens; else 0",
        "the block's parameters name the sources: generate them with kvq gen --threads \
         --tile-tokens --min-warps-per-sm --pack-heads --short-staging --store-scores",
    ]
    .into_iter()
    .map(String::from)
    .collect()
}
