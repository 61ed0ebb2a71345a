//! The block rules' rows for one scheme and kernel shape, by kind, for callers that name a rule's
//! block (tests that check each block's kernel, tools that list them). The rules themselves and
//! their evaluation live in [`kvq_codegen::rules`] ([`table::BLOCK_RULES`](kvq_codegen::rules::table::BLOCK_RULES)).

use kvq_codegen::rules::{self, table::CONSTANTS, LaunchRules, When};
use kvq_codegen::{KernelShape, TuneParams};
use kvq_spec::SchemeSpec;

pub use kvq_codegen::rules::BlockSplits;

/// A block a rule gives a scheme's kernels, and when it applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleBlock {
    /// The block (the launch variants, short staging and stored scores, as the rule says).
    pub params: TuneParams,
    /// When it applies.
    pub when: When,
}

/// The scheme's rule blocks of one kind, in the order they are tried.
fn blocks_where(spec: &SchemeSpec, shape: &KernelShape, kind: fn(&When) -> bool) -> Vec<RuleBlock> {
    LaunchRules::for_kernel(spec, shape)
        .rules
        .into_iter()
        .filter(|r| kind(&r.when))
        .map(|r| RuleBlock {
            params: r.block.params,
            when: r.when,
        })
        .collect()
}

/// The scheme's blocks for launches whose (sequence, KV head) pairs fill whole waves of SMs
/// over short contexts: one split a pair, no pieces.
pub fn whole_pairs_blocks(spec: &SchemeSpec, shape: &KernelShape) -> Vec<RuleBlock> {
    blocks_where(spec, shape, |w| matches!(w, When::WholePairs { .. }))
}

/// The scheme's blocks whose split warps each take one tile of the context bucket.
pub fn one_tile_blocks(spec: &SchemeSpec, shape: &KernelShape) -> Vec<RuleBlock> {
    blocks_where(spec, shape, |w| matches!(w, When::OneTile { .. }))
}

/// The scheme's blocks for launches with few (sequence, KV head) pairs.
pub fn few_pairs_blocks(spec: &SchemeSpec, shape: &KernelShape) -> Vec<RuleBlock> {
    blocks_where(spec, shape, |w| matches!(w, When::FewPairs { .. }))
}

/// The waves of `sm_count` SMs `pairs` (sequence, KV head) pairs take at one an SM, where they
/// fill enough of their last wave for a whole-pairs block; `None` where they do not.
pub fn whole_pair_waves(pairs: usize, sm_count: usize) -> Option<usize> {
    rules::whole_pair_waves(&CONSTANTS, pairs, sm_count)
}
