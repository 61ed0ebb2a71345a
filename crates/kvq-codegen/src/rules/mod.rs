//! The launch rules: which block, split count, pieces, staging path, stored scores and occupancy
//! floor an untuned decode launch takes.
//!
//! The rules are data ([`table`]: rows of (families, condition, block) and one set of constants)
//! and one small evaluator. [`LaunchRules::for_kernel`] resolves the rows that concern one scheme
//! and kernel shape into plain values (the blocks, with the few facts about their kernels the
//! evaluator needs), and [`LaunchRules::choose`] turns a launch (batch, KV heads, longest
//! sequence) on a GPU (SMs, resident CTAs, fast memory) into a [`LaunchChoice`]. The runtime's
//! heuristic, the tuner's default candidate and `kvq gen` all use it: `kvq gen` writes the
//! resolved [`LaunchRules`] into its manifest as JSON, which an engine evaluates the same way.
//!
//! Codegen does no I/O and needs no GPU; the caller supplies the GPU's numbers (the resident CTAs
//! of the kernel of [`LaunchRules::occupancy_block`] come from the driver's occupancy query).
//!
//! Beside the launch rules, `variants` holds the rules that choose a kernel's code paths at
//! render time (the `*_pays` predicates: integer or f16 keys, subnormal codes, packed score
//! fragments, pieces, head tiles).

pub mod table;
pub(crate) mod variants;

use serde::{Deserialize, Serialize};

use crate::{
    decode_groups, decode_piece_rule, short_staging_changes, store_scores_changes, KernelShape,
    PieceRule, TuneParams,
};
use kvq_spec::{SchemeSpec, TensorQuant};

/// Version of the [`LaunchRules`] document; a reader refuses other versions.
pub const RULES_VERSION: u32 = 1;

/// An inclusive range of counts; `max: None` is unbounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub min: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<usize>,
}

impl Span {
    /// `min..=max`.
    pub const fn new(min: usize, max: usize) -> Span {
        Span {
            min,
            max: Some(max),
        }
    }

    /// `min..`.
    pub const fn from(min: usize) -> Span {
        Span { min, max: None }
    }

    pub fn contains(&self, x: usize) -> bool {
        x >= self.min && self.max.map_or(true, |m| x <= m)
    }
}

/// The kernel families the head_dim-128 block rules tell apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// FP16 K and V, one head tile a warp.
    Fp16,
    /// FP16 K and V in kernels of several head tiles (more than 8 query heads a KV head).
    Fp16TwoTiles,
    /// 4-bit K and V whose ring has a general staging path (KIVI-4).
    ShortStaging,
    /// Uncalibrated 1- or 2-bit K and V on the four-warp ring, without boosted channels.
    LowBit,
    /// The same with Kitty's boosted key channels.
    BoostedLowBit,
    /// Calibrated 1- or 2-bit K and V (CalibQuant): a range pass before the decode kernel.
    CalibratedLowBit,
    /// 8-bit K and V.
    EightBit,
}

/// The families the codegen default's block tells apart away from head_dim 128
/// ([`table::DEFAULT_BLOCKS`]; uncalibrated schemes only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CodegenFamily {
    /// FP16 K and V.
    Fp16,
    /// Integer K and V of 8 bits.
    EightBit,
    /// Integer K and V of 4 bits or more, not both 8 (KIVI-4).
    FourBit,
    /// Keys with Kitty's boosted channels.
    BoostedKeys,
}

impl CodegenFamily {
    /// The family of `spec`'s kernels, if it has one.
    pub fn of(spec: &SchemeSpec) -> Option<CodegenFamily> {
        if spec.calibrate.is_some() {
            return None;
        }
        let fp16 = |t: &TensorQuant| matches!(t, TensorQuant::Fp16);
        match (spec.k.as_int(), spec.v.as_int()) {
            (Some(k), Some(_)) if k.boost.is_some() => Some(CodegenFamily::BoostedKeys),
            (Some(k), Some(v)) if k.bits >= 8 && v.bits >= 8 => Some(CodegenFamily::EightBit),
            (Some(k), Some(v)) if k.bits >= 4 && v.bits >= 4 => Some(CodegenFamily::FourBit),
            _ if fp16(&spec.k) && fp16(&spec.v) => Some(CodegenFamily::Fp16),
            _ => None,
        }
    }
}

/// A row of [`table::DEFAULT_BLOCKS`]: the codegen default's threads and tile for these kernel
/// families at these head_dims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DefaultBlock {
    pub head_dims: &'static [u32],
    pub families: &'static [CodegenFamily],
    pub threads: u32,
    pub tile_tokens: u32,
}

impl DefaultBlock {
    pub const fn new(
        head_dims: &'static [u32],
        families: &'static [CodegenFamily],
        threads: u32,
        tile_tokens: u32,
    ) -> DefaultBlock {
        DefaultBlock {
            head_dims,
            families,
            threads,
            tile_tokens,
        }
    }
}

/// Threads and tile of the codegen default at `head_dim` for `spec` where
/// [`table::DEFAULT_BLOCKS`] has a row, else `None` (head_dim 128's rules apply).
pub fn default_block_away_from_128(spec: &SchemeSpec, head_dim: u32) -> Option<(u32, u32)> {
    let family = CodegenFamily::of(spec)?;
    table::DEFAULT_BLOCKS
        .iter()
        .find(|row| row.head_dims.contains(&head_dim) && row.families.contains(&family))
        .map(|row| (row.threads, row.tile_tokens))
}

/// A rule's block: threads and tile always, the other parameters where it sets them (else the
/// codegen default's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BlockEdit {
    pub threads: u32,
    pub tile_tokens: u32,
    pub min_warps_per_sm: Option<u32>,
    pub pack_heads: Option<bool>,
    pub short_staging: Option<bool>,
    pub store_scores: Option<bool>,
}

impl BlockEdit {
    /// `base` with this row's parameters.
    pub fn apply(&self, base: TuneParams) -> TuneParams {
        TuneParams {
            threads: self.threads,
            tile_tokens: self.tile_tokens,
            min_warps_per_sm: self.min_warps_per_sm.unwrap_or(base.min_warps_per_sm),
            pack_heads: self.pack_heads.unwrap_or(base.pack_heads),
            short_staging: self.short_staging.unwrap_or(base.short_staging),
            store_scores: self.store_scores.unwrap_or(base.store_scores),
        }
    }
}

/// When a block rule applies. "Pairs" are (sequence, decode grid row) pairs: batch × KV heads ×
/// the kernel's head groups; the bucket is the longest sequence rounded up to a power of two, at
/// least [`Constants::min_rule_bucket`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum When {
    /// The pairs fill `waves` waves of SMs (one pair an SM, the last wave at least
    /// [`Constants::whole_pairs_fill_permille`] full) and the bucket is in `buckets`: one split
    /// a pair and no pieces.
    WholePairs { waves: Span, buckets: Span },
    /// The pairs are in `pairs`, and the grid of one tile a split warp (splits = bucket / (tile ·
    /// warps), 1..=[`Constants::max_splits`]) fits one wave of the CTAs the block's occupancy
    /// floor holds on an SM.
    OneTile { pairs: Span },
    /// The pairs are in `pairs` and the bucket in `buckets`; the split count fills waves of this
    /// block's occupancy, or of the codegen default block's where `splits_from_default`.
    FewPairs {
        pairs: Span,
        buckets: Span,
        splits_from_default: bool,
    },
}

/// One row of [`table::BLOCK_RULES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BlockRule {
    pub families: &'static [Family],
    pub when: When,
    pub block: BlockEdit,
}

/// The numbers of the split, piece, staging, stored-score and fast-memory rules
/// ([`table::CONSTANTS`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Constants {
    /// Thousandths of a wave of resident CTAs the fewest splits must fill.
    pub fill_permille: usize,
    /// Most splits the heuristic gives a pair.
    pub most_splits: usize,
    /// Most splits any launch may have (a one-tile block's count must be within it).
    pub max_splits: usize,
    /// Fewest bucket tokens a split warp gets, in general.
    pub warp_tokens: usize,
    /// The same for kernels with `short_warps` at buckets up to `short_context_bucket`.
    pub short_warp_tokens: usize,
    pub short_context_bucket: usize,
    /// Bucket tokens a split warp from which a kernel with a choice takes the short staging path.
    pub short_staging_min_warp_tokens: usize,
    /// Most query heads a CTA at which keys of 2 bits or more store their scores.
    pub stored_scores_max_gqa: u32,
    /// [`PieceKind::LongShares`]: `per_split` pieces a split over `permille` of the cost from
    /// this share of a split warp.
    pub long_shares_min_warp_tokens: usize,
    pub long_shares_per_split: usize,
    pub long_shares_permille: u32,
    /// [`PieceKind::FewSplits`]: `count` pieces over `permille` with at most `max_warps` split
    /// warps and at least `min_warp_tokens` a warp.
    pub few_splits_max_warps: usize,
    pub few_splits_min_warp_tokens: usize,
    pub few_splits_count: usize,
    pub few_splits_permille: u32,
    /// Peak DRAM GB/s an SM from which a GPU's memory counts as fast.
    pub fast_memory_gbps_per_sm: f64,
    /// Warps an SM the fast-memory block asks registers for.
    pub fast_memory_warps_per_sm: u32,
    /// Fewest bucket tokens a split warp of the fast-memory grid for the block to apply, and for
    /// its tiles to grow to 64 tokens.
    pub fast_memory_min_warp_tokens: usize,
    pub fast_memory_tile64_min_warp_tokens: usize,
    /// Thousandths of their last wave the pairs of a whole-pairs block must fill.
    pub whole_pairs_fill_permille: usize,
    /// The block rules' buckets (and a one-tile rule's split count) round the longest sequence
    /// up to a power of two at least this large, as the tuner's keys do.
    pub min_rule_bucket: usize,
}

/// The context bucket of a launch: its longest sequence rounded up to a power of two.
pub fn context_bucket(max_len: usize) -> usize {
    max_len.max(1).next_power_of_two()
}

/// Small pieces of each sequence's work, in CTAs launched after all the splits' CTAs. The
/// splits' warps take fixed shares of `1000 − permille` thousandths of each (sequence, KV head)'s
/// cost; the rest is cut into `count` piece CTAs per (sequence, KV head). The GPU starts CTAs in
/// launch order as earlier ones end, so the pieces go to the SMs that finish their splits first
/// (some SMs run 15–30% faster than others whatever they hold, and a division fixed at launch
/// waits for the slowest). Which SM runs a piece does not change the result: each piece has its
/// own partial, merged in a fixed order.
///
/// `count = 0` (the [`Default`]) cuts no pieces: every token is in a split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Pieces {
    /// Piece CTAs per (sequence, KV head).
    pub count: usize,
    /// Thousandths of each (sequence, KV head)'s cost they cover (1..=999 when `count > 0`).
    pub permille: u32,
}

/// The most CTAs of one (sequence, KV head): splits and pieces share the grid's x dimension.
const MAX_GRID_X: usize = i32::MAX as usize;

impl Pieces {
    /// No pieces.
    pub const NONE: Pieces = Pieces {
        count: 0,
        permille: 0,
    };

    /// Whether the launch has any pieces.
    pub fn is_some(&self) -> bool {
        self.count > 0
    }

    /// Checks `permille` (1..=999 when there are pieces) and that the grid stays within the
    /// driver's limit with `splits` splits.
    pub fn check(&self, splits: usize) -> Result<(), String> {
        if self.is_some() && !(1..1000).contains(&self.permille) {
            return Err(format!(
                "pieces covering {}‰ of the work (expected 1..=999)",
                self.permille
            ));
        }
        if splits.saturating_add(self.count) > MAX_GRID_X {
            return Err(format!(
                "{splits} splits + {} pieces (at most {MAX_GRID_X} CTAs per (sequence, KV head))",
                self.count
            ));
        }
        Ok(())
    }
}

impl std::fmt::Display for Pieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_some() {
            write!(f, "{} pieces of {}‰", self.count, self.permille)
        } else {
            write!(f, "no pieces")
        }
    }
}

/// Where a kernel's default launches take pieces (the data form of [`PieceRule`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PieceKind {
    None,
    LongShares,
    FewSplits,
}

impl From<PieceRule> for PieceKind {
    fn from(rule: PieceRule) -> PieceKind {
        match rule {
            PieceRule::None => PieceKind::None,
            PieceRule::LongShares => PieceKind::LongShares,
            PieceRule::FewSplits => PieceKind::FewSplits,
        }
    }
}

/// A block a rule (or the default) launches, with what the evaluator must know of its kernel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    #[serde(flatten)]
    pub params: TuneParams,
    /// Whether the kernel has a choice of staging path (`short_staging` changes it).
    pub short_staging_choice: bool,
    /// The (short staging, stored scores) states of this block from which a launch on a GPU of
    /// fast memory takes the twelve-warp block, and whether its 64-token twin is a kernel too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fast_memory: Vec<FastMemory>,
}

/// One state of a [`Block`] that the fast-memory rule changes: that block with
/// `min_warps_per_sm` = [`Constants::fast_memory_warps_per_sm`] and `short_staging` true, and
/// where `tile64`, with 64-token tiles once a split warp's share allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FastMemory {
    pub short_staging: bool,
    pub store_scores: bool,
    pub tile64: bool,
}

/// A resolved rule: when it applies and the block it gives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    pub when: When,
    pub block: Block,
}

/// How a launch's split count is found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockSplits {
    /// Fills waves of this block's own occupancy.
    OwnOccupancy,
    /// Fills waves of the codegen default block's occupancy.
    DefaultOccupancy,
    /// One split and no pieces: each CTA takes a whole (sequence, KV head).
    OnePerPair,
    /// This many splits, each warp one tile of the context bucket.
    OneTilePerWarp(usize),
}

/// A launch to choose for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Sequences.
    pub batch: usize,
    /// KV heads a sequence (not counting head groups).
    pub kv_heads: usize,
    /// Tokens of the longest sequence.
    pub max_len: usize,
}

/// What the rules need of the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// CTAs of the kernel of [`LaunchRules::occupancy_block`] resident on the whole GPU at once.
    pub resident_ctas: usize,
    /// Peak DRAM bandwidth an SM at or past [`Constants::fast_memory_gbps_per_sm`].
    pub fast_memory: bool,
}

/// What the rules choose: the kernel's block, the split count and the pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchChoice {
    pub params: TuneParams,
    pub splits: usize,
    pub pieces: Pieces,
}

/// The launch rules of one scheme and kernel shape as plain values: what `kvq gen` writes, and
/// what [`LaunchRules::choose`] reads (nothing else).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LaunchRules {
    /// [`RULES_VERSION`].
    pub version: u32,
    /// The codegen default block, for launches no rule applies to.
    pub default: Block,
    /// The rules in the order they are tried; the first that applies gives the block.
    pub rules: Vec<Rule>,
    /// Decode grid rows a KV head (the kernel's head groups).
    pub grid_rows: u32,
    /// Query heads one decode CTA scores.
    pub cta_gqa: u32,
    /// Whether split warps may get [`Constants::short_warp_tokens`] at short buckets (quantized
    /// K or V, or FP16 kernels of several head tiles).
    pub short_warps: bool,
    /// Whether untuned launches store key scores past [`Constants::stored_scores_max_gqa`] too
    /// (1-bit keys).
    pub stored_scores_any_gqa: bool,
    /// Where the kernel takes pieces.
    pub pieces: PieceKind,
    pub constants: Constants,
}

/// The rule family of `spec`'s kernels at `shape`, where the head_dim-128 rules apply.
pub fn family(spec: &SchemeSpec, shape: &KernelShape) -> Option<Family> {
    if crate::rule_head_dim(spec, shape) != 128 {
        return None;
    }
    let base = TuneParams::default_for(spec, shape);
    if !spec.k.is_quantized() && !spec.v.is_quantized() {
        return Some(if decode_groups(spec, shape).tiles() > 1 {
            Family::Fp16TwoTiles
        } else {
            Family::Fp16
        });
    }
    // A 4-bit ring with a general staging path: the short path changes a 32-token-tile kernel.
    let short = TuneParams {
        threads: 128,
        tile_tokens: 32,
        short_staging: true,
        ..base
    };
    if short_staging_changes(spec, shape, &short) {
        return Some(Family::ShortStaging);
    }
    let (k, v) = (spec.k.as_int()?, spec.v.as_int()?);
    let ring = base.threads == 128 && base.tile_tokens == 64 && base.min_warps_per_sm == 12;
    if k.bits <= 2 && v.bits <= 2 && ring {
        return Some(if store_scores_changes(spec, shape, &base) {
            Family::CalibratedLowBit
        } else if k.boost.is_some() {
            Family::BoostedLowBit
        } else {
            Family::LowBit
        });
    }
    (k.bits == 8 && v.bits == 8).then_some(Family::EightBit)
}

/// Whether `params` renders a 4-bit K and V kernel at head_dim 128 with a short staging path
/// whose occupancy floor changes it: the kernels the fast-memory rule gives twelve warps an SM.
fn twelve_warp_candidate(
    spec: &SchemeSpec,
    shape: &KernelShape,
    params: &TuneParams,
    candidates: &[TuneParams],
) -> bool {
    let four_bits = |t: &TensorQuant| t.as_int().is_some_and(|q| q.bits == 4);
    let twelve = TuneParams {
        min_warps_per_sm: table::CONSTANTS.fast_memory_warps_per_sm,
        short_staging: true,
        ..*params
    };
    crate::rule_head_dim(spec, shape) == 128
        && four_bits(&spec.k)
        && four_bits(&spec.v)
        && params.min_warps_per_sm == 0
        && short_staging_changes(spec, shape, &twelve)
        && candidates.contains(&twelve)
}

impl Block {
    /// The block of `params` for `spec` at `shape`, its facts found from the kernel it renders.
    /// `candidates`: [`TuneParams::candidates_for`] (computed once by the caller).
    fn resolve(
        spec: &SchemeSpec,
        shape: &KernelShape,
        params: TuneParams,
        candidates: &[TuneParams],
    ) -> Block {
        let short_staging_choice = short_staging_changes(spec, shape, &params);
        let mut fast_memory = Vec::new();
        // The states `choose` may reach: the short path only where the kernel has it; stored
        // scores as the block says, or off.
        for short_staging in [false, true] {
            if short_staging && !short_staging_choice {
                continue;
            }
            let mut states = vec![params.store_scores];
            if params.store_scores {
                states.push(false);
            }
            for store_scores in states {
                let state = TuneParams {
                    short_staging,
                    store_scores,
                    ..params
                };
                if !twelve_warp_candidate(spec, shape, &state, candidates) {
                    continue;
                }
                let wide = TuneParams {
                    min_warps_per_sm: table::CONSTANTS.fast_memory_warps_per_sm,
                    short_staging: true,
                    tile_tokens: 64,
                    ..state
                };
                fast_memory.push(FastMemory {
                    short_staging,
                    store_scores,
                    tile64: candidates.contains(&wide) && short_staging_changes(spec, shape, &wide),
                });
            }
        }
        Block {
            params,
            short_staging_choice,
            fast_memory,
        }
    }
}

impl LaunchRules {
    /// The rules for `spec`'s kernels at `shape`: the table's rows for its family, resolved.
    pub fn for_kernel(spec: &SchemeSpec, shape: &KernelShape) -> LaunchRules {
        let base = TuneParams::default_for(spec, shape);
        let candidates = TuneParams::candidates_for(spec, shape);
        let resolve = |p| Block::resolve(spec, shape, p, &candidates);
        let rules = match family(spec, shape) {
            Some(family) => table::BLOCK_RULES
                .iter()
                .filter(|r| r.families.contains(&family))
                .map(|r| Rule {
                    when: r.when,
                    block: resolve(r.block.apply(base)),
                })
                .collect(),
            None => Vec::new(),
        };
        let groups = decode_groups(spec, shape);
        LaunchRules {
            version: RULES_VERSION,
            default: resolve(base),
            rules,
            grid_rows: groups.groups,
            cta_gqa: groups.heads,
            short_warps: spec.k.is_quantized() || spec.v.is_quantized() || groups.tiles() > 1,
            stored_scores_any_gqa: spec.k.as_int().is_some_and(|k| k.bits < 2),
            pieces: decode_piece_rule(spec, shape, &base).into(),
            constants: table::CONSTANTS,
        }
    }

    /// The decode grid rows of a launch: sequences × KV heads × head groups.
    pub fn pairs(&self, launch: &Launch) -> usize {
        launch.batch * launch.kv_heads * self.grid_rows as usize
    }

    /// Fewest bucket tokens a split warp gets for sequences of at most `max_len` tokens.
    pub fn min_warp_tokens(&self, max_len: usize) -> usize {
        let c = &self.constants;
        if self.short_warps && context_bucket(max_len) <= c.short_context_bucket {
            c.short_warp_tokens
        } else {
            c.warp_tokens
        }
    }

    /// Splits per pair for a grid of `pairs` pairs that fills whole waves of `resident_ctas`
    /// slots: between the fewest that fill [`Constants::fill_permille`] of a wave and twice that,
    /// the count whose last wave is the fullest (ties: fewer splits), never fewer than
    /// `warp_tokens` bucket tokens a warp of `warps_per_cta`, nor more than
    /// [`Constants::most_splits`]. It depends only on the batch shape, the bucket and the block,
    /// so a captured CUDA graph stays valid while sequences grow within their bucket.
    pub fn splits(
        &self,
        pairs: usize,
        max_len: usize,
        resident_ctas: usize,
        warps_per_cta: usize,
        warp_tokens: usize,
    ) -> usize {
        split_count(
            &self.constants,
            pairs,
            max_len,
            resident_ctas,
            warps_per_cta,
            warp_tokens,
        )
    }

    /// The first rule that applies to `launch` on `sm_count` SMs, and how it counts its splits.
    pub fn rule(&self, launch: &Launch, sm_count: usize) -> Option<(&Rule, BlockSplits)> {
        let pairs = self.pairs(launch);
        let c = &self.constants;
        // The block rules count buckets as the tuner's keys do: short contexts share one.
        let bucket = launch.max_len.max(c.min_rule_bucket).next_power_of_two();
        self.rules.iter().find_map(|r| {
            let splits = match r.when {
                When::WholePairs { waves, buckets } => {
                    let w = whole_pair_waves(c, pairs, sm_count)?;
                    (waves.contains(w) && buckets.contains(bucket))
                        .then_some(BlockSplits::OnePerPair)?
                }
                When::OneTile { pairs: range } => {
                    let p = &r.block.params;
                    let splits = bucket / (p.tile_tokens as usize * p.warps()).max(1);
                    let floor = (p.min_warps_per_sm as usize / p.warps().max(1)).max(1);
                    (range.contains(pairs)
                        && (1..=c.max_splits).contains(&splits)
                        && pairs * splits <= floor * sm_count.max(1))
                    .then_some(BlockSplits::OneTilePerWarp(splits))?
                }
                When::FewPairs {
                    pairs: range,
                    buckets,
                    splits_from_default,
                } => (range.contains(pairs) && buckets.contains(bucket)).then_some(
                    if splits_from_default {
                        BlockSplits::DefaultOccupancy
                    } else {
                        BlockSplits::OwnOccupancy
                    },
                )?,
            };
            Some((r, splits))
        })
    }

    /// The block of [`LaunchRules::choose`] before its launch-dependent variants (short staging,
    /// stored scores, fast memory): the first rule's, else the codegen default.
    pub fn default_block(&self, launch: &Launch, sm_count: usize) -> TuneParams {
        self.rule(launch, sm_count)
            .map_or(self.default.params, |(r, _)| r.block.params)
    }

    /// The block whose kernel's occupancy (CTAs an SM) the split count fills: the rule's own,
    /// except where it counts splits by the codegen default's. The caller loads its kernel for
    /// [`Gpu::resident_ctas`].
    pub fn occupancy_block(&self, launch: &Launch, sm_count: usize) -> TuneParams {
        self.rule(launch, sm_count)
            .filter(|(_, s)| *s != BlockSplits::DefaultOccupancy)
            .map_or(self.default.params, |(r, _)| r.block.params)
    }

    /// Whether a launch of `splits` splits of `warps` warps over sequences of at most `max_len`
    /// tokens takes the short staging path, where the kernel has a choice.
    pub fn short_staging_by_default(&self, max_len: usize, splits: usize, warps: usize) -> bool {
        context_bucket(max_len) / (splits.max(1) * warps.max(1))
            >= self.constants.short_staging_min_warp_tokens
    }

    /// Whether a launch over sequences of at most `max_len` tokens stores a calibrated scheme's
    /// key scores, where the kernel has a choice.
    pub fn store_scores_by_default(&self, max_len: usize) -> bool {
        context_bucket(max_len) > self.constants.short_context_bucket
            && (self.cta_gqa <= self.constants.stored_scores_max_gqa || self.stored_scores_any_gqa)
    }

    /// The pieces of a launch of `splits` splits of `warps` warps.
    pub fn pieces(&self, max_len: usize, splits: usize, warps: usize) -> Pieces {
        pieces_of(&self.constants, self.pieces, max_len, splits, warps)
    }

    /// The untuned launch: the first rule's block (else the codegen default); one split and no
    /// pieces for a whole-pairs rule, the rule's count for a one-tile rule, else
    /// [`LaunchRules::splits`] over the resident CTAs; the short staging path where the kernel
    /// has a choice and the block or a split warp's share says so; stored scores as the block
    /// says unless [`LaunchRules::store_scores_by_default`] says not (a whole-pairs block's say
    /// is final); on fast memory the twelve-warp block where it applies; pieces by the kernel's
    /// [`PieceKind`].
    pub fn choose(&self, launch: &Launch, gpu: &Gpu) -> LaunchChoice {
        let c = &self.constants;
        let rule = self.rule(launch, gpu.sm_count);
        let block = rule.map_or(&self.default, |(r, _)| &r.block);
        let how = rule.map(|(_, s)| s);
        let pairs = self.pairs(launch);
        let warp_tokens = self.min_warp_tokens(launch.max_len);
        let mut params = block.params;
        let one_per_pair = how == Some(BlockSplits::OnePerPair);
        let splits = match how {
            Some(BlockSplits::OnePerPair) => 1,
            Some(BlockSplits::OneTilePerWarp(splits)) => splits,
            _ => self.splits(
                pairs,
                launch.max_len,
                gpu.resident_ctas,
                params.warps(),
                warp_tokens,
            ),
        };
        params.short_staging = block.short_staging_choice
            && (params.short_staging
                || self.short_staging_by_default(launch.max_len, splits, params.warps()));
        params.store_scores =
            params.store_scores && (one_per_pair || self.store_scores_by_default(launch.max_len));
        let fixed = matches!(
            how,
            Some(BlockSplits::OnePerPair | BlockSplits::OneTilePerWarp(_))
        );
        let (params, splits) = match block.fast_memory.iter().find(|f| {
            f.short_staging == params.short_staging && f.store_scores == params.store_scores
        }) {
            Some(fast) if gpu.fast_memory && !fixed => {
                let warps = params.warps().max(1);
                let resident = gpu.sm_count * (c.fast_memory_warps_per_sm as usize / warps);
                let twelve_splits = self
                    .splits(pairs, launch.max_len, resident, params.warps(), warp_tokens)
                    .max(1);
                let share = context_bucket(launch.max_len) / (twelve_splits * warps);
                if share < c.fast_memory_min_warp_tokens {
                    (params, splits)
                } else {
                    let twelve = TuneParams {
                        min_warps_per_sm: c.fast_memory_warps_per_sm,
                        short_staging: true,
                        ..params
                    };
                    let tile64 = fast.tile64 && share >= c.fast_memory_tile64_min_warp_tokens;
                    let tile_tokens = if tile64 { 64 } else { twelve.tile_tokens };
                    (
                        TuneParams {
                            tile_tokens,
                            ..twelve
                        },
                        twelve_splits,
                    )
                }
            }
            _ => (params, splits),
        };
        let pieces = if one_per_pair {
            Pieces::NONE
        } else {
            self.pieces(launch.max_len, splits, params.warps())
        };
        LaunchChoice {
            params,
            splits,
            pieces,
        }
    }
}

/// The waves of `sm_count` SMs `pairs` pairs take at one an SM, where they fill at least
/// [`Constants::whole_pairs_fill_permille`] of them; `None` where they do not.
pub fn whole_pair_waves(c: &Constants, pairs: usize, sm_count: usize) -> Option<usize> {
    let sms = sm_count.max(1);
    let waves = pairs.div_ceil(sms);
    (pairs > 0 && 1000 * pairs >= c.whole_pairs_fill_permille * waves * sms).then_some(waves)
}

/// [`LaunchRules::splits`] with the constants `c`.
pub fn split_count(
    c: &Constants,
    pairs: usize,
    max_len: usize,
    resident_ctas: usize,
    warps_per_cta: usize,
    warp_tokens: usize,
) -> usize {
    let bucket = context_bucket(max_len);
    let most = (bucket / (warp_tokens.max(1) * warps_per_cta.max(1))).clamp(1, c.most_splits);
    let ctas = pairs.max(1);
    let slots = resident_ctas.max(1);
    let fewest = (c.fill_permille * slots)
        .div_ceil(1000 * ctas)
        .clamp(1, most);
    (fewest..=(2 * fewest).min(most))
        .max_by_key(|&s| {
            let grid = ctas * s;
            let waves = grid.div_ceil(slots);
            (1000 * grid / (waves * slots), std::cmp::Reverse(s))
        })
        .unwrap_or(1)
}

/// The pieces of `kind` for a launch of `splits` splits of `warps` warps (see [`Constants`]).
pub fn pieces_of(
    c: &Constants,
    kind: PieceKind,
    max_len: usize,
    splits: usize,
    warps: usize,
) -> Pieces {
    let splits = splits.max(1);
    let split_warps = splits * warps.max(1);
    let warp_tokens = context_bucket(max_len) / split_warps;
    match kind {
        PieceKind::LongShares if warp_tokens >= c.long_shares_min_warp_tokens => Pieces {
            count: c.long_shares_per_split * splits,
            permille: c.long_shares_permille,
        },
        PieceKind::FewSplits
            if split_warps <= c.few_splits_max_warps
                && warp_tokens >= c.few_splits_min_warp_tokens =>
        {
            Pieces {
                count: c.few_splits_count,
                permille: c.few_splits_permille,
            }
        }
        _ => Pieces::NONE,
    }
}

/// Whether a GPU of `peak_gbps` peak DRAM bandwidth over `sm_count` SMs counts as fast memory.
/// A GPU that reports no memory clock (0 GB/s) does not.
pub fn is_fast_memory(peak_gbps: f64, sm_count: usize) -> bool {
    sm_count > 0 && peak_gbps / sm_count as f64 >= table::CONSTANTS.fast_memory_gbps_per_sm
}

#[cfg(test)]
mod tests;
