//! The manifest's statements of the rules the runtime's untuned launches follow (block, split
//! count, pieces, staging path, stored scores, fast memory), so an engine can reproduce them.

use kvq::codegen::{
    decode_groups, decode_head_groups, short_staging_changes, store_scores_changes, KernelShape,
    PieceRule, TuneParams,
};
use kvq::SchemeSpec;

/// The decode grid's rows a sequence as the rules count them: `kv_heads`, times the head groups
/// where the kernel splits a KV head's query heads (`DecodeKernels::head_groups`).
fn grid_rows_text(spec: &SchemeSpec, shape: &KernelShape) -> String {
    match decode_head_groups(spec, shape) {
        1 => "kv_heads".into(),
        groups => format!("kv_heads·{groups}"),
    }
}

/// The manifest's rule for the short staging path of the runtime's untuned launches
/// (`kvq_runtime::short_staging_by_default`), for kernels where it is a choice.
pub(super) fn default_short_staging_text(
    spec: &SchemeSpec,
    shape: &KernelShape,
    params: &TuneParams,
) -> String {
    if short_staging_changes(spec, shape, params) {
        format!(
            "warps = block / 32; short_staging = true (sources generated with --short-staging \
             true) where bucket / (num_splits·warps) ≥ {}, else false",
            kvq::runtime::decode::SHORT_STAGING_MIN_WARP_TOKENS
        )
    } else {
        "false (this decode kernel takes one staging path)".into()
    }
}

/// The manifest's rule for the stored scores of the runtime's untuned launches
/// (`kvq_runtime::store_scores_by_default`), for kernels where it is a choice.
pub(super) fn default_store_scores_text(
    spec: &SchemeSpec,
    shape: &KernelShape,
    params: &TuneParams,
) -> String {
    if store_scores_changes(spec, shape, params) {
        let groups = decode_groups(spec, shape);
        let gqa = if kvq::runtime::decode::scores_stored_at_any_gqa(spec) {
            String::new()
        } else if groups.groups == 1 {
            format!(" and gqa ≤ {}", kvq::runtime::decode::STORED_SCORES_MAX_GQA)
        } else {
            // The heads a grid row scores, a known number for this shape.
            format!(
                " and a head group's {} heads ≤ {}",
                groups.heads,
                kvq::runtime::decode::STORED_SCORES_MAX_GQA
            )
        };
        format!(
            "store_scores = true (sources generated with --store-scores true, the default) \
             where bucket > {}{gqa}, else false; launches on a whole-pairs block \
             (default_block) store them as that block says",
            kvq::runtime::decode::SHORT_CONTEXT_BUCKET
        )
    } else {
        "false (this scheme's kernels store no scores)".into()
    }
}

/// The manifest's rule for the runtime's untuned launches on GPUs of fast memory for their SMs
/// (`kvq_runtime::decode::fast_memory_block`), for schemes it applies to.
pub(super) fn default_fast_memory_text(spec: &SchemeSpec, shape: &KernelShape) -> String {
    use kvq::runtime::decode::{
        fast_memory_applies, FAST_MEMORY_GBPS_PER_SM, FAST_MEMORY_MIN_WARP_TOKENS,
        FAST_MEMORY_TILE64_MIN_WARP_TOKENS,
    };
    if !fast_memory_applies(spec, shape) {
        return "none (these launches do not depend on the GPU's memory)".into();
    }
    format!(
        "where 2·memory_clock·bus_width / 8 / sm_count ≥ {FAST_MEMORY_GBPS_PER_SM} GB/s (peak DRAM \
         bandwidth an SM), outside the whole-pairs and one-tile blocks: the default_block's block \
         with min_warps_per_sm 12 and short_staging true (sources generated with \
         --min-warps-per-sm 12 --short-staging true) and num_splits from default_splits with \
         slots = (12 / warps)·sm_count, where bucket / (num_splits·warps) ≥ \
         {FAST_MEMORY_MIN_WARP_TOKENS}, and tile_tokens 64 where that share is ≥ \
         {FAST_MEMORY_TILE64_MIN_WARP_TOKENS}; else as default_block, default_splits and \
         default_short_staging say"
    )
}

/// The manifest's rule for the block of the runtime's untuned launches
/// (`kvq_runtime::decode::rule_block`, which `TuneChoice::default_block` and `occupancy_block`
/// apply): the scheme's whole-pairs blocks, then its one-tile blocks, then its few-pairs blocks,
/// else the codegen default.
pub(super) fn default_block_text(spec: &SchemeSpec, shape: &KernelShape) -> String {
    use kvq::runtime::decode::{
        few_pairs_blocks, one_tile_blocks, whole_pairs_blocks, WholePairsBlock,
    };
    let base = TuneParams::default_for(spec, shape);
    let pairs_text = format!("batch·{}", grid_rows_text(spec, shape));
    let mut rules = Vec::new();
    let whole: Vec<String> = whole_pairs_blocks(spec, shape)
        .iter()
        .map(|w| {
            format!(
                "{} where {} and {}",
                block_change_text(&base, &w.params),
                range_text("waves", &w.waves),
                range_text("bucket", &w.buckets),
            )
        })
        .collect();
    if !whole.is_empty() {
        rules.push(format!(
            "waves = ceil({pairs_text} / sm_count); where {pairs_text} ≥ {}·waves·sm_count, \
             with num_splits = 1 and num_pieces = 0: {}",
            WholePairsBlock::MIN_FILL_PERMILLE as f64 / 1000.0,
            whole.join(", ")
        ));
    }
    for one in one_tile_blocks(spec, shape) {
        let tile_warps = one.params.tile_tokens as usize * one.params.warps();
        rules.push(format!(
            "{} with num_splits = bucket / {tile_warps} (one tile a warp) where {} and \
             {pairs_text}·num_splits ≤ {}·sm_count",
            block_change_text(&base, &one.params),
            range_text(&pairs_text, &one.pairs),
            one.floor_ctas_per_sm(),
        ));
    }
    for few in few_pairs_blocks(spec, shape) {
        let (pairs, buckets) = (
            range_text(&pairs_text, &few.pairs),
            range_text("bucket", &few.buckets),
        );
        let slots = if few.splits_from_default {
            format!(
                ", with default_splits' slots from the occupancy of the threads {} tile_tokens {} \
                 block",
                base.threads, base.tile_tokens
            )
        } else {
            String::new()
        };
        rules.push(format!(
            "{} where {pairs} and {buckets}{slots}",
            block_change_text(&base, &few.params)
        ));
    }
    let otherwise = format!(
        "threads {} and tile_tokens {}",
        base.threads, base.tile_tokens
    );
    if rules.is_empty() {
        return format!("{otherwise} at every batch and context");
    }
    format!("{}; else {otherwise}", rules.join("; "))
}

/// `what` within `range`: "any what" from 0 or 1 to `usize::MAX`, "what ≤ hi" from 0 or 1,
/// "what ≥ lo" to `usize::MAX`, "what = n" for one value, else "lo ≤ what ≤ hi".
fn range_text(what: &str, range: &std::ops::RangeInclusive<usize>) -> String {
    match (*range.start(), *range.end()) {
        (0 | 1, usize::MAX) => format!("any {what}"),
        (lo, hi) if lo == hi => format!("{what} = {lo}"),
        (0 | 1, hi) => format!("{what} ≤ {hi}"),
        (lo, usize::MAX) => format!("{what} ≥ {lo}"),
        (lo, hi) => format!("{lo} ≤ {what} ≤ {hi}"),
    }
}

/// A rule's block as the parameters it sets and the `kvq gen` flags that generate its sources:
/// threads and tile always, the occupancy floor, head packing, short staging and stored scores
/// where they differ from the codegen default `base`.
fn block_change_text(base: &TuneParams, block: &TuneParams) -> String {
    // (manifest name, value in the block, shown); each flag is the name with dashes. Threads
    // and tile always show; the rest where the block differs from the codegen default.
    fn differs<T: PartialEq + ToString>(name: &str, block: T, base: T) -> (&str, String, bool) {
        let shown = block != base;
        (name, block.to_string(), shown)
    }
    let params = [
        ("threads", block.threads.to_string(), true),
        ("tile_tokens", block.tile_tokens.to_string(), true),
        differs(
            "min_warps_per_sm",
            block.min_warps_per_sm,
            base.min_warps_per_sm,
        ),
        differs("pack_heads", block.pack_heads, base.pack_heads),
        differs("short_staging", block.short_staging, base.short_staging),
        differs("store_scores", block.store_scores, base.store_scores),
    ];
    let shown: Vec<_> = params.iter().filter(|(_, _, shown)| *shown).collect();
    let mut set: Vec<String> = shown.iter().map(|(n, v, _)| format!("{n} {v}")).collect();
    let flags: Vec<String> = shown
        .iter()
        .map(|(n, v, _)| format!("--{} {v}", n.replace('_', "-")))
        .collect();
    let last = set.pop().unwrap_or_default();
    format!(
        "{} and {last} (sources generated with {})",
        set.join(", "),
        flags.join(" ")
    )
}

/// The manifest's formula for the heuristic split count, with this scheme's fewest bucket tokens
/// per split warp (`kvq_runtime::min_warp_tokens`, which changes at most once, past
/// `SHORT_CONTEXT_BUCKET`).
pub(super) fn default_splits_text(spec: &kvq::SchemeSpec, shape: &KernelShape) -> String {
    use kvq::runtime::decode::{min_warp_tokens, SHORT_CONTEXT_BUCKET};
    let short = min_warp_tokens(spec, shape, SHORT_CONTEXT_BUCKET);
    let long = min_warp_tokens(spec, shape, SHORT_CONTEXT_BUCKET + 1);
    let warp_tokens = if short == long {
        long.to_string()
    } else {
        format!("{short} if bucket ≤ {SHORT_CONTEXT_BUCKET}, else {long}")
    };
    format!(
        "slots = sm_count × cuOccupancyMaxActiveBlocksPerMultiprocessor(decode, block, its \
         dynamic_shared_bytes); ctas = batch·{rows}; bucket = next power of two ≥ longest \
         sequence; warp_tokens = {warp_tokens}; most = clamp(bucket / (warp_tokens·block / 32), \
         1, 256); lo = clamp(ceil(0.9·slots / ctas), 1, most); the s in lo..=min(2·lo, most) \
         maximising ctas·s / (ceil(ctas·s / slots)·slots), ties to the smaller",
        rows = grid_rows_text(spec, shape)
    )
}

/// The manifest's rule for the pieces of the runtime's untuned launches
/// (`kvq_runtime::default_pieces`), by the decode kernel's piece rule.
pub(super) fn default_pieces_text(rule: PieceRule) -> String {
    match rule {
        PieceRule::LongShares => format!(
            "warps = block / 32; if bucket / (num_splits·warps) ≥ {} then num_pieces = \
             2·num_splits and piece_permille = 100, else num_pieces = 0",
            kvq::runtime::decode::PIECES_MIN_WARP_TOKENS
        ),
        PieceRule::FewSplits => format!(
            "warps = block / 32; if num_splits·warps ≤ {} and bucket / (num_splits·warps) ≥ {} \
             then num_pieces = 2 and piece_permille = 50, else num_pieces = 0",
            kvq::runtime::decode::PIECES_MAX_FEW_SPLIT_WARPS,
            kvq::runtime::decode::PIECES_FEW_SPLITS_MIN_WARP_TOKENS
        ),
        PieceRule::None => "num_pieces = 0 (this decode kernel runs no pieces)".into(),
    }
}
