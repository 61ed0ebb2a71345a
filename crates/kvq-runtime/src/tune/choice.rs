//! A launch configuration ([`TuneChoice`]: kernel block parameters plus the split-K count), the
//! heuristic default (the launch rules of [`kvq_codegen::rules`]), and the candidates the tuner
//! searches.

use kvq_codegen::rules::{table::CONSTANTS, Gpu, Launch, LaunchRules};
use kvq_codegen::{decode_piece_rule, TuneParams};
use serde::{Deserialize, Serialize};
use std::fmt;

use super::key::TuneProblem;
#[cfg(doc)]
use crate::decode::is_fast_memory;
use crate::decode::{default_pieces, Pieces};
use crate::error::{Result, RuntimeError};

/// Most split-K partitions any configuration may use (the scratch grows with it).
pub const MAX_SPLITS: usize = CONSTANTS.max_splits;

/// Everything the tuner chooses for one launch: the kernel's compile-time block parameters, and
/// how many ways each sequence's tokens are split (a launch-time value, so it costs no compile).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TuneChoice {
    /// Threads per CTA and tokens per tile.
    #[serde(flatten)]
    pub params: TuneParams,
    /// Split-K partitions per (sequence, KV head).
    pub splits: usize,
    /// Pieces launched after the splits (none in results stored before kvq had pieces).
    #[serde(default)]
    pub pieces: Pieces,
}

/// What the heuristic needs of the GPU: its SM count (the block rules count waves of one CTA an
/// SM), how many CTAs of the kernel of
/// [`TuneChoice::occupancy_block`] it holds at once
/// ([`DecodeKernel::resident_ctas`](crate::DecodeKernel::resident_ctas)), and whether its memory
/// is fast for its SMs ([`is_fast_memory`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Residency {
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// CTAs of the occupancy block's kernel resident on the whole GPU at once.
    pub resident_ctas: usize,
    /// Peak DRAM bandwidth an SM at or past [`FAST_MEMORY_GBPS_PER_SM`](crate::decode::FAST_MEMORY_GBPS_PER_SM)
    /// (an H200, not an H100): KIVI-4's kernels then take twelve warps an SM.
    pub fast_memory: bool,
}

impl Residency {
    /// `resident_ctas` CTAs of the occupancy block's kernel on `sm_count` SMs, memory not fast.
    pub fn new(sm_count: usize, resident_ctas: usize) -> Residency {
        Residency {
            sm_count,
            resident_ctas,
            fast_memory: false,
        }
    }

    /// The same, with `fast_memory` as [`is_fast_memory`] says of the GPU.
    pub fn with_fast_memory(self, fast_memory: bool) -> Residency {
        Residency {
            fast_memory,
            ..self
        }
    }
}

impl TuneChoice {
    /// The untuned default: the launch rules of `problem`'s scheme and kernel shape
    /// ([`LaunchRules::choose`]) on this GPU: the first block rule that applies to the batch shape
    /// and context bucket, else the codegen default; its split count (one for a whole-pairs
    /// block, one tile a warp for a one-tile block, else whole waves of the resident CTAs); the
    /// short staging path and stored scores where the kernel has a choice and the rules say so;
    /// on fast memory twelve warps an SM for KIVI-4's kernels where the rule says so; and the
    /// kernel's pieces. It depends only on the batch shape and the bucket, so a captured CUDA
    /// graph stays valid while sequences grow within their bucket.
    pub fn heuristic(problem: &TuneProblem, gpu: Residency) -> TuneChoice {
        let c = rules_of(problem).choose(
            &launch_of(problem),
            &Gpu {
                sm_count: gpu.sm_count,
                resident_ctas: gpu.resident_ctas,
                fast_memory: gpu.fast_memory,
            },
        );
        TuneChoice {
            params: c.params,
            splits: c.splits,
            pieces: c.pieces,
        }
    }

    /// The block of [`TuneChoice::heuristic`] on a GPU of `sm_count` SMs, before its
    /// launch-dependent variants (short staging, stored scores, fast memory): the first block
    /// rule's that applies, else [`TuneParams::default_for`].
    pub fn default_block(problem: &TuneProblem, sm_count: usize) -> TuneParams {
        rules_of(problem).default_block(&launch_of(problem), sm_count)
    }

    /// The block whose kernel's occupancy (CTAs an SM) the heuristic's split count fills:
    /// [`TuneChoice::default_block`]'s own, except where its rule counts splits by the codegen
    /// default's. Load its kernel for the [`Residency::resident_ctas`] [`TuneChoice::heuristic`]
    /// takes.
    pub fn occupancy_block(problem: &TuneProblem, sm_count: usize) -> TuneParams {
        rules_of(problem).occupancy_block(&launch_of(problem), sm_count)
    }

    /// Checks the block parameters against the ranges the templates declare and the split count
    /// against [`MAX_SPLITS`] (stored results may come from another kvq version).
    pub fn check(&self) -> Result<()> {
        self.params.validate()?;
        if self.splits == 0 || self.splits > MAX_SPLITS {
            return Err(RuntimeError::InvalidInput(format!(
                "{} splits (expected 1..={MAX_SPLITS})",
                self.splits
            )));
        }
        self.pieces
            .check(self.splits)
            .map_err(RuntimeError::InvalidInput)
    }
}

impl fmt::Display for TuneChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "threads {} tile {}",
            self.params.threads, self.params.tile_tokens
        )?;
        if self.params.min_warps_per_sm > 0 {
            write!(f, " warps/SM {}", self.params.min_warps_per_sm)?;
        }
        if !self.params.pack_heads {
            write!(f, " unpacked")?;
        }
        if self.params.short_staging {
            write!(f, " short staging")?;
        }
        if self.params.store_scores {
            write!(f, " stored scores")?;
        }
        write!(f, " splits {}", self.splits)?;
        if self.pieces.is_some() {
            write!(f, " {}", self.pieces)?;
        }
        Ok(())
    }
}

/// The launch rules of `problem`'s scheme and kernel shape.
fn rules_of(problem: &TuneProblem) -> LaunchRules {
    LaunchRules::for_kernel(&problem.spec, &problem.shape)
}

/// `problem`'s launch as the rules see it.
fn launch_of(problem: &TuneProblem) -> Launch {
    Launch {
        batch: problem.batch,
        kv_heads: problem.kv_heads,
        max_len: problem.max_len,
    }
}

/// The pieces [`default_pieces`] gives a launch of `splits` splits of the kernel `params` renders.
fn rule_pieces(problem: &TuneProblem, params: &TuneParams, splits: usize) -> Pieces {
    default_pieces(
        decode_piece_rule(&problem.spec, &problem.shape, params),
        problem.max_len,
        splits,
        params.warps(),
    )
}

/// The multiples of the heuristic split count the tuner tries, as (numerator, denominator):
/// ½, ¾, 1, 1½, 2, 3 and 4. The range reaches 4× because on an H200 tuned winners sat at a 2×
/// edge. Part of the candidate set's checksum ([`candidates_checksum`](super::candidates_checksum)).
pub const SPLIT_FACTORS: [(usize, usize); 7] =
    [(1, 2), (3, 4), (1, 1), (3, 2), (2, 1), (3, 1), (4, 1)];

/// Split counts to try around the heuristic `default`: [`SPLIT_FACTORS`] times it (halves
/// rounded down, 1½ up), within `1..=max`, ascending, without repeats. The default is always
/// included (clamped), so the tuner can only match or beat it.
pub fn split_candidates(default: usize, max: usize) -> Vec<usize> {
    let max = max.clamp(1, MAX_SPLITS);
    let d = default.max(1);
    let mut out: Vec<usize> = SPLIT_FACTORS
        .iter()
        .map(|&(n, m)| {
            if (n, m) == (3, 2) {
                (n * d).div_ceil(m)
            } else {
                n * d / m
            }
        })
        .map(|s| s.clamp(1, max))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Every configuration the tuner times for `problem`: each block-parameter combination that
/// renders a distinct kernel ([`TuneParams::candidates_for`]) × [`split_candidates`] around the heuristic split count (never more splits
/// than the longest sequence has tiles), each with the pieces [`default_pieces`] gives it; and
/// where that gives one split pieces, the one split without them too, a launch whose decode
/// kernel writes the output itself and needs no combine (on an H100 Kitty's kernels ran ×1.03
/// that way at B=128 L=4K and kivi2 ×0.99). The heuristic default comes first.
pub fn candidates(problem: &TuneProblem, gpu: Residency) -> Vec<TuneChoice> {
    let default = TuneChoice::heuristic(problem, gpu);
    let mut out = vec![default];
    for params in TuneParams::candidates_for(&problem.spec, &problem.shape) {
        let tiles = problem.max_len.div_ceil(params.tile_tokens.max(1) as usize);
        for splits in split_candidates(default.splits, tiles.max(default.splits)) {
            let c = TuneChoice {
                params,
                splits,
                pieces: rule_pieces(problem, &params, splits),
            };
            let mut push = |c: TuneChoice| {
                if c != default {
                    out.push(c);
                }
            };
            push(c);
            if splits == 1 && c.pieces.is_some() {
                push(TuneChoice {
                    pieces: Pieces::NONE,
                    ..c
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq_codegen::{Dtype, KernelShape};

    /// An H100's SMs.
    const H100_SMS: usize = 132;

    /// `resident_ctas` CTAs of the occupancy block's kernel on an H100.
    fn h100(resident_ctas: usize) -> Residency {
        Residency::new(H100_SMS, resident_ctas)
    }

    /// `scheme` at head_dim 128, GQA 4, f16, 8 KV heads.
    fn problem_of(scheme: &str, batch: usize, max_len: usize) -> TuneProblem {
        TuneProblem::new(
            scheme.parse().unwrap(),
            KernelShape::new(128, 4, Dtype::F16),
            8,
            batch,
            max_len,
        )
    }

    /// kivi2's problem (`problem_of`).
    /// The tuner offers `flag` both ways for `problem`'s kernels, and kivi2's kernels, which it
    /// does not change, never get it: neither untuned nor among the candidates.
    fn assert_tuned_both_ways_and_never_for_kivi2(
        problem: &TuneProblem,
        resident_ctas: usize,
        flag: fn(&TuneParams) -> bool,
    ) {
        let all = candidates(problem, h100(resident_ctas));
        assert!(all.iter().any(|c| flag(&c.params)));
        assert!(all.iter().any(|c| !flag(&c.params)));
        let kivi2 = self::problem(16, 32_768);
        assert!(!flag(&TuneChoice::heuristic(&kivi2, h100(396)).params));
        assert!(candidates(&kivi2, h100(396))
            .iter()
            .all(|c| !flag(&c.params)));
    }

    fn problem(batch: usize, max_len: usize) -> TuneProblem {
        problem_of("k = int(2, channel), v = int(2, token)", batch, max_len)
    }

    #[test]
    fn choices_stored_before_pieces_read_as_none() {
        let old = r#"{ "threads": 64, "tile_tokens": 64, "splits": 6 }"#;
        let c: TuneChoice = serde_json::from_str(old).unwrap();
        assert_eq!(c.pieces, Pieces::NONE);
        assert!(c.check().is_ok());
        let with = TuneChoice {
            pieces: Pieces {
                count: 4,
                permille: 100,
            },
            ..c
        };
        let back: TuneChoice =
            serde_json::from_str(&serde_json::to_string(&with).unwrap()).unwrap();
        assert_eq!(back, with);
        assert_eq!(
            with.to_string(),
            "threads 64 tile 64 splits 6 4 pieces of 100‰"
        );
        let twelve = TuneChoice {
            params: TuneParams {
                min_warps_per_sm: 12,
                ..c.params
            },
            ..c
        };
        assert_eq!(
            twelve.to_string(),
            "threads 64 tile 64 warps/SM 12 splits 6"
        );
        let unpacked = TuneChoice {
            params: TuneParams {
                pack_heads: false,
                ..twelve.params
            },
            ..twelve
        };
        assert_eq!(
            unpacked.to_string(),
            "threads 64 tile 64 warps/SM 12 unpacked splits 6"
        );
        let bad = TuneChoice {
            pieces: Pieces {
                count: 4,
                permille: 0,
            },
            ..c
        };
        assert!(bad.check().is_err());
    }

    #[test]
    fn pieces_follow_the_rule_for_each_candidate() {
        // INT8 at B=16 L=32K: the default (128 threads, 2 splits) has 4096 tokens a warp.
        let int8 = TuneProblem::new(
            "k = int(8, channel, symmetric), v = int(8, channel, symmetric)"
                .parse()
                .unwrap(),
            KernelShape::new(128, 4, Dtype::F16),
            8,
            16,
            32768,
        );
        let all = candidates(&int8, h100(264));
        assert_eq!(all[0].splits, 2);
        assert_eq!(
            all[0].pieces,
            Pieces {
                count: 4,
                permille: 100
            }
        );
        for c in &all {
            let per_warp = 32768 / (c.splits * c.params.warps());
            let one_part = c.splits == 1 && !c.pieces.is_some();
            assert_eq!(c.pieces.is_some(), per_warp >= 4096 && !one_part, "{c}");
        }
        // 2-bit keys and values: two per (sequence, KV head) wherever the splits are few.
        for c in candidates(&problem(16, 32768), h100(396)) {
            let few = c.splits * c.params.warps() <= CONSTANTS.few_splits_max_warps;
            let one_part = c.splits == 1 && !c.pieces.is_some();
            assert_eq!(c.pieces.is_some(), few && !one_part, "{c}");
            if few && !one_part {
                assert_eq!(c.pieces.count, 2, "{c}");
            }
        }
        // One split with pieces comes with one split without them, a one-part launch.
        for c in all.iter().filter(|c| c.splits == 1 && c.pieces.is_some()) {
            let one_part = TuneChoice {
                pieces: Pieces::NONE,
                ..*c
            };
            assert!(all.contains(&one_part), "{c}");
        }
        // Schemes whose kernels run no pieces (4-bit keys and values) never get any.
        let kivi4 = TuneProblem::new(
            "k = int(4, channel), v = int(4, token)".parse().unwrap(),
            KernelShape::new(128, 4, Dtype::F16),
            8,
            16,
            32768,
        );
        assert!(candidates(&kivi4, h100(396))
            .iter()
            .all(|c| !c.pieces.is_some()));
    }

    #[test]
    fn split_candidates_surround_the_default() {
        assert_eq!(split_candidates(16, 1024), vec![8, 12, 16, 24, 32, 48, 64]);
        assert_eq!(split_candidates(3, 1024), vec![1, 2, 3, 5, 6, 9, 12]);
        assert_eq!(split_candidates(1, 1024), vec![1, 2, 3, 4]);
        assert_eq!(split_candidates(33, 40), vec![16, 24, 33, 40]);
        assert_eq!(split_candidates(0, 0), vec![1]);
        assert!(split_candidates(4000, 100_000)
            .iter()
            .all(|&s| s <= MAX_SPLITS));
    }

    #[test]
    fn the_heuristic_takes_kivi4s_short_staging_path_where_warps_have_long_shares() {
        let kivi4 =
            |batch, max_len| problem_of("k = int(4, channel), v = int(4, token)", batch, max_len);
        // 264 resident four-warp CTAs (two an SM of an H100). B=16 L=32K: 2 splits, 4096 bucket
        // tokens a warp; L=128K: 16384. B=16 L=16K: 2048, and B=64 L=4K: 1024. B ≤ 8 from 4K and
        // B=8 to 32 over 1K to 8K take the few-pairs blocks, which are on the short path whatever
        // the share (B=1 L=128K: 33 splits, 992 a warp; B=16 L=2K: 2 splits, 256 a warp).
        for (batch, len, short) in [
            (16, 32_768, true),
            (16, 131_072, true),
            (16, 16_384, false),
            (64, 4096, false),
            (1, 131_072, true),
            (1, 32_768, true),
            (8, 4096, true),
            (16, 2048, true),
        ] {
            let c = TuneChoice::heuristic(&kivi4(batch, len), h100(264));
            let per_warp = len.next_power_of_two() / (c.splits * c.params.warps());
            assert_eq!(
                c.params.short_staging, short,
                "B={batch} L={len}: {c}, {per_warp} a warp"
            );
            assert_eq!(c.to_string().contains("short staging"), short);
        }
        // The tuner tries both paths for KIVI-4's blocks; kivi2's kernels always take the short
        // one, so they get no such candidate and never the flag.
        assert_tuned_both_ways_and_never_for_kivi2(&kivi4(4, 4096), 264, |p| p.short_staging);
    }

    #[test]
    fn the_heuristic_stores_calibrated_scores_past_short_contexts() {
        let calibquant1 = |batch, max_len| {
            problem_of(
                "k = int(1, channel), v = int(1, channel), local = 128, \
                 calibrate = calibrate(tau1 = -1.5, tau2 = 3.25)",
                batch,
                max_len,
            )
        };
        for (batch, len, stored) in [
            (16, 32_768, true),
            (1, 131_072, true),
            (4, 4097, true),
            (4, 4096, false),
            (16, 512, false),
        ] {
            let c = TuneChoice::heuristic(&calibquant1(batch, len), h100(396));
            assert_eq!(c.params.store_scores, stored, "B={batch} L={len}: {c}");
            assert_eq!(c.to_string().contains("stored scores"), stored);
        }
        // The tuner tries both for calibrated kernels; other kernels never store scores.
        assert_tuned_both_ways_and_never_for_kivi2(&calibquant1(4, 4096), 396, |p| p.store_scores);
    }

    #[test]
    fn the_heuristic_stores_no_2_bit_key_scores_past_four_query_heads_a_kv_head() {
        let calibrated = |bits, gqa, batch, max_len| {
            TuneProblem::new(
                format!(
                    "k = int({bits}, channel), v = int({bits}, token), local = 128, \
                     calibrate = calibrate(tau1 = -1.5, tau2 = 3.25)"
                )
                .parse()
                .unwrap(),
                KernelShape::new(128, gqa, Dtype::F16),
                8,
                batch,
                max_len,
            )
        };
        for (bits, gqa, batch, len, stored) in [
            (2, 1, 4, 32_768, true),
            (2, 4, 4, 32_768, true),
            (2, 8, 4, 32_768, false),
            (2, 8, 1, 131_072, false),
            (2, 8, 16, 32_768, false),
            // A whole-pairs block keeps its say (B=16 L=8K stores scores at any GQA).
            (2, 8, 16, 8192, true),
            // 1-bit keys keep their scores at GQA 8.
            (1, 8, 4, 32_768, true),
            (1, 8, 16, 131_072, true),
        ] {
            let c = TuneChoice::heuristic(&calibrated(bits, gqa, batch, len), h100(396));
            assert_eq!(
                c.params.store_scores, stored,
                "{bits}-bit keys, GQA {gqa} B={batch} L={len}: {c}"
            );
        }
        let (one_bit, two_bit) = (&calibrated(1, 8, 1, 1).spec, &calibrated(2, 8, 1, 1).spec);
        let stores = |spec: &kvq_spec::SchemeSpec, len, gqa| {
            LaunchRules::for_kernel(spec, &KernelShape::new(128, gqa, Dtype::F16))
                .store_scores_by_default(len)
        };
        assert!(stores(two_bit, 32_768, 4));
        assert!(!stores(two_bit, 32_768, 8));
        assert!(stores(one_bit, 32_768, 8));
        assert!(!stores(one_bit, 4096, 1));
    }

    #[test]
    fn candidates_cover_every_block_shape_and_start_with_the_default() {
        let p = problem(16, 32_768);
        let all = candidates(&p, h100(396));
        assert_eq!(all[0], TuneChoice::heuristic(&p, h100(396)));
        assert_eq!(all[0].splits, 3);
        let mut seen = std::collections::HashSet::new();
        for c in &all {
            c.check().unwrap();
            assert!(seen.insert(*c), "duplicate {c}");
        }
        let blocks = TuneParams::candidates_for(&p.spec, &p.shape);
        for params in &blocks {
            assert!(
                all.iter().any(|c| c.params == *params),
                "{params:?} missing"
            );
        }
        // Seven split counts a block, and one split once more without the pieces it takes.
        let one_split_with_pieces = all
            .iter()
            .filter(|c| c.splits == 1 && c.pieces.is_some())
            .count();
        assert_eq!(one_split_with_pieces, blocks.len());
        assert_eq!(all.len(), blocks.len() * 8);
        // Nine threads × tile blocks without a floor, six (CTAs of two or four warps) with twelve
        // warps an SM; 8-warp CTAs get one CTA an SM either way, so they come once.
        assert_eq!(blocks.len(), 15);
        assert!(blocks
            .iter()
            .all(|b| b.min_warps_per_sm == 0 || b.threads <= 128));
    }

    #[test]
    fn the_occupancy_floor_is_offered_only_where_it_changes_the_kernel() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let int8: kvq_spec::SchemeSpec =
            "k = int(8, channel, symmetric), v = int(8, channel, symmetric)"
                .parse()
                .unwrap();
        let blocks = TuneParams::candidates_for(&int8, &shape);
        assert_eq!(
            blocks[0].min_warps_per_sm, 0,
            "INT8 runs uncapped by default"
        );
        assert_eq!(
            blocks.iter().filter(|b| b.min_warps_per_sm == 12).count(),
            6
        );
        // Head_dim 96 (two slabs on the tensor-core kernel) gets the floor to try as 128 does;
        // head_dim 256 gets none.
        let d96 = TuneParams::candidates_for(&int8, &KernelShape::new(96, 4, Dtype::F16));
        assert_eq!(d96.iter().filter(|b| b.min_warps_per_sm == 12).count(), 6);
        // Sixteen warps (128 registers) are tried below head_dim 128 only.
        assert_eq!(d96.iter().filter(|b| b.min_warps_per_sm == 16).count(), 9);
        assert!(blocks.iter().all(|b| b.min_warps_per_sm != 16));
        let d256 = TuneParams::candidates_for(&int8, &KernelShape::new(256, 4, Dtype::F16));
        assert!(d256.iter().all(|b| b.min_warps_per_sm == 0));
        assert_eq!(d256.len(), 9);
    }

    #[test]
    fn unpacked_kernels_are_offered_only_where_the_kernel_would_pack() {
        let shape = |gqa| KernelShape::new(128, gqa, Dtype::F16);
        let kitty = kvq_spec::SchemeSpec::parse(
            "k = int(bits = 2, axis = channel, boost = boost(bits = 4, ratio = 0.125, by = magnitude)), \
             v = int(bits = 2, axis = token, local = 128), page = 128, sink = 32",
        )
        .unwrap();
        let blocks = TuneParams::candidates_for(&kitty, &shape(4));
        assert!(blocks[0].pack_heads, "the default packs");
        let unpacked: Vec<_> = blocks.iter().filter(|b| !b.pack_heads).collect();
        assert!(!unpacked.is_empty());
        // Packing needs an even number of 16-token subtiles: tiles of 32 or 64 tokens.
        assert!(unpacked.iter().all(|b| b.tile_tokens >= 32), "{unpacked:?}");
        for b in &unpacked {
            let packed = TuneParams {
                pack_heads: true,
                ..**b
            };
            assert!(blocks.contains(&packed), "{b:?} without its packed twin");
        }
        // At GQA 8 every head column is live, and kivi2 keeps one subtile a fragment: nothing to
        // turn off.
        assert!(TuneParams::candidates_for(&kitty, &shape(8))
            .iter()
            .all(|b| b.pack_heads));
        let kivi2 = kvq_spec::SchemeSpec::parse("k = int(2, channel), v = int(2, token)").unwrap();
        assert!(TuneParams::candidates_for(&kivi2, &shape(4))
            .iter()
            .all(|b| b.pack_heads));
    }

    #[test]
    fn fp16_at_b1_over_long_contexts_starts_from_its_few_pairs_block() {
        // 396 resident CTAs: three four-warp CTAs an SM on 132 SMs, the FP16 block's occupancy.
        let p = problem_of("k = fp16, v = fp16", 1, 32_768);
        let block = TuneChoice::default_block(&p, H100_SMS);
        assert_eq!((block.threads, block.tile_tokens), (128, 32));
        let h = TuneChoice::heuristic(&p, h100(396));
        assert_eq!(h.params, block);
        assert_eq!(h.splits, 49); // 392 CTAs: one wave
        assert_eq!(candidates(&p, h100(396))[0], h);
        // At B=16 the codegen's two-warp block stays.
        let wide = problem_of("k = fp16, v = fp16", 16, 32_768);
        assert_eq!(
            TuneChoice::heuristic(&wide, h100(792)).params,
            TuneParams::default_for(&wide.spec, &wide.shape)
        );
    }

    #[test]
    fn kivi4_with_few_pairs_takes_tiles_of_32_with_the_default_blocks_splits() {
        let kivi4 = problem_of("k = int(4, channel), v = int(4, token)", 1, 32_768);
        let block = TuneChoice::default_block(&kivi4, H100_SMS);
        assert_eq!((block.threads, block.tile_tokens), (128, 32));
        assert!(block.short_staging);
        // The splits fill waves of the 64-token block's two CTAs an SM: 33 at B=1.
        let occupancy = TuneChoice::occupancy_block(&kivi4, H100_SMS);
        assert_eq!(
            occupancy,
            TuneParams::default_for(&kivi4.spec, &kivi4.shape)
        );
        let h = TuneChoice::heuristic(&kivi4, h100(264));
        assert_eq!((h.params, h.splits), (block, 33));
    }

    #[test]
    fn kivi4_takes_twelve_warps_on_fast_memory_where_split_warps_have_long_shares() {
        let kivi4 = |batch, len| problem_of("k = int(4, channel), v = int(4, token)", batch, len);
        // An H200's 132 SMs; the resident CTAs are those of the eight-warp occupancy block.
        let fast = h100(264).with_fast_memory(true);
        // (batch, context, twelve warps, splits, tile): 64-token tiles from 1024 tokens a split
        // warp (B=8 L=32K 1365, B=2 L=128K 1365, B=4 L=128K 2730, B=8 L=128K 5461; B=16 has them
        // already), the block's own at 682 (B=4 L=32K) and 668 (B=1 L=128K).
        for (batch, len, twelve, splits, tile) in [
            (16, 32_768, true, 3, 64),
            (16, 131_072, true, 3, 64),
            (8, 32_768, true, 6, 64),
            (8, 131_072, true, 6, 64),
            (4, 32_768, true, 12, 32),
            (4, 131_072, true, 12, 64),
            (2, 131_072, true, 24, 64),
            (1, 131_072, true, 49, 32),
            // Split warps of 167, 85 and 341 bucket tokens keep the eight-warp launch.
            (1, 32_768, false, 33, 32),
            (4, 4096, false, 8, 32),
            (16, 4096, false, 2, 32),
        ] {
            let p = kivi4(batch, len);
            let slow = TuneChoice::heuristic(&p, h100(264));
            let h = TuneChoice::heuristic(&p, fast);
            assert_eq!(slow.params.min_warps_per_sm, 0, "B={batch} L={len}: {slow}");
            assert_eq!(
                h.params.min_warps_per_sm == 12,
                twelve,
                "B={batch} L={len}: {h}"
            );
            assert_eq!(h.splits, splits, "B={batch} L={len}: {h}");
            assert_eq!(h.params.tile_tokens, tile, "B={batch} L={len}: {h}");
            if twelve {
                // The same block otherwise, on the short staging path whatever the split warps' shares.
                let same = TuneParams {
                    min_warps_per_sm: 0,
                    short_staging: slow.params.short_staging,
                    tile_tokens: slow.params.tile_tokens,
                    ..h.params
                };
                assert_eq!(same, slow.params, "B={batch} L={len}");
                assert!(h.params.short_staging, "B={batch} L={len}: {h}");
                assert_eq!(candidates(&p, fast)[0], h);
            } else {
                assert_eq!(h, slow, "B={batch} L={len}");
            }
        }
        // The H100's launches at the shapes the fast-memory rule was measured at (tile, splits),
        // which that rule leaves as they were.
        for (batch, len, tile, splits) in [
            (1, 4096, 32, 32),
            (4, 4096, 32, 8),
            (16, 4096, 32, 2),
            (1, 32_768, 32, 33),
            (4, 32_768, 32, 8),
            (16, 32_768, 64, 2),
            (1, 131_072, 32, 33),
            (4, 131_072, 32, 8),
            (16, 131_072, 64, 2),
        ] {
            let h = TuneChoice::heuristic(&kivi4(batch, len), h100(264));
            assert_eq!(
                (h.params.tile_tokens, h.params.min_warps_per_sm, h.splits),
                (tile, 0, splits),
                "H100, B={batch} L={len}: {h}"
            );
            assert!(h.params.short_staging, "H100, B={batch} L={len}: {h}");
        }
        // Other head_dims (not measured) keep theirs.
        let d64 = TuneProblem::new(
            "k = int(4, channel), v = int(4, token)".parse().unwrap(),
            KernelShape::new(64, 4, Dtype::F16),
            8,
            16,
            131_072,
        );
        assert_eq!(
            TuneChoice::heuristic(&d64, fast),
            TuneChoice::heuristic(&d64, h100(264))
        );
        // Kernels of other families keep their launch on fast memory.
        for scheme in [
            "k = int(2, channel), v = int(2, token)",
            "k = int(8, channel, symmetric), v = int(8, token, symmetric)",
            "k = fp16, v = fp16",
        ] {
            let p = problem_of(scheme, 16, 32_768);
            assert_eq!(
                TuneChoice::heuristic(&p, fast),
                TuneChoice::heuristic(&p, h100(264)),
                "{scheme}"
            );
        }
    }

    #[test]
    fn whole_pairs_launch_one_split_without_pieces_and_lead_the_candidates() {
        // kivi2 at B=16 L=4K on an H100: 128 pairs, one wave of 132 SMs. Before the rule the
        // heuristic ran three splits with two pieces (a combine after the decode grid).
        let p = problem(16, 4096);
        let h = TuneChoice::heuristic(&p, h100(132));
        assert_eq!((h.params.threads, h.params.tile_tokens), (256, 32));
        assert_eq!((h.splits, h.pieces), (1, Pieces::NONE));
        assert_eq!(h.params, TuneChoice::default_block(&p, H100_SMS));
        assert_eq!(candidates(&p, h100(132))[0], h);
        // CalibQuant's whole-pairs block says whether it stores scores, under 4K tokens too.
        for (len, stored) in [(1024, false), (4096, true)] {
            let cq = problem_of(
                "k = int(1, channel), v = int(1, channel), sink = 32, local = 128, \
                 calibrate = calibrate(tau1 = -1.5, tau2 = 3.25)",
                16,
                len,
            );
            let h = TuneChoice::heuristic(&cq, h100(132));
            assert_eq!((h.params.threads, h.splits), (256, 1), "L={len}");
            assert_eq!(h.params.store_scores, stored, "L={len}");
        }
        // The same launch on 114 SMs (two waves, 56% full) keeps the codegen block and its splits.
        let pcie = TuneChoice::heuristic(&p, Residency::new(114, 342));
        assert_eq!(pcie.params, TuneParams::default_for(&p.spec, &p.shape));
        assert!(pcie.splits > 1, "{pcie}");
    }

    #[test]
    fn short_contexts_never_get_more_splits_than_tiles() {
        let p = problem(1, 100);
        let all = candidates(&p, h100(396));
        assert_eq!(all[0].splits, 1);
        for c in &all {
            let tiles = 100usize.div_ceil(c.params.tile_tokens as usize);
            assert!(c.splits <= tiles.max(1), "{c}");
        }
    }

    #[test]
    fn head_groups_count_as_kv_heads_of_their_group_size() {
        // 16 query heads a KV head take two grid rows of 8: the untuned launch of 8 KV heads at
        // GQA 16 is that of 16 KV heads at GQA 8, for every family of rules. FP16's rows hold
        // 16 heads (two head tiles a warp): GQA 32 over 8 KV heads is GQA 16 over 16.
        for (scheme, row_heads) in [
            ("k = fp16, v = fp16", 16),
            ("k = int(2, channel), v = int(2, token), local = 128", 8),
            ("k = int(4, channel), v = int(4, token), local = 128", 8),
            ("k = int(1, channel), v = int(1, channel), local = 128, calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)", 8),
        ] {
            for (batch, len) in [(1, 32_768), (4, 4096), (16, 32_768), (64, 1024)] {
                let of = |gqa, kv_heads| {
                    let p = TuneProblem::new(
                        scheme.parse().unwrap(),
                        KernelShape::new(128, gqa, Dtype::F16),
                        kv_heads,
                        batch,
                        len,
                    );
                    (p.grid_heads(), p.cta_gqa(), TuneChoice::heuristic(&p, h100(396)))
                };
                let (rows, heads, grouped) = of(2 * row_heads, 8);
                assert_eq!((rows, heads), (16, row_heads), "{scheme}");
                assert_eq!(grouped, of(row_heads, 16).2, "{scheme} B={batch} L={len}");
            }
        }
    }

    #[test]
    fn invalid_choices_are_rejected() {
        let ok = TuneChoice::heuristic(&problem(1, 4096), h100(396));
        assert!(ok.check().is_ok());
        let mut bad = ok;
        bad.splits = 0;
        assert!(bad.check().is_err());
        bad.splits = MAX_SPLITS + 1;
        assert!(bad.check().is_err());
        let mut bad = ok;
        bad.params.threads = 96;
        assert!(bad.check().is_err());
    }
}
