//! Properties of the launch rules over a grid of schemes, shapes, batches, lengths and GPUs:
//! every choice is a kernel the tuner also times, renders, fits an SM's shared memory and
//! registers at its occupancy floor, and launches a grid within the driver's limits; its split
//! count divides the bucket as its rule says and depends only on the bucket; its pieces come from
//! the kernel's piece rule. (Whether a choice is fast is a GPU question: kvq-runtime's
//! `tests/tune.rs` times it against the tuner's.)

use std::collections::HashMap;

use super::*;
use crate::{decode_kernels, Dtype};

const SCHEMES: &[&str] = &[
    "k = fp16, v = fp16",
    "k = int(8, channel, symmetric), v = int(8, channel, symmetric)",
    "k = int(4, channel), v = int(4, token), local = 128",
    "k = int(2, channel), v = int(2, token), local = 128",
    "k = int(2, channel, boost = boost(4, ratio = 0.125, by = magnitude)), \
     v = int(2, token, local = 128), sink = 32, page = 128",
    "k = int(1, channel), v = int(1, channel), sink = 32, local = 128, \
     calibrate = calibrate(tau1 = -1.5, tau2 = 3.25)",
    "k = int(2, channel), v = int(2, channel), sink = 32, local = 128, \
     calibrate = calibrate(tau1 = -1.25, tau2 = 0.75)",
    "k = int(3, channel), v = int(3, token)",
];

/// Shared memory an SM of the GPUs kvq targets offers its CTAs (H100, H200: 228 KiB, of which
/// 1 KiB a CTA is the driver's).
const SM_SHARED_BYTES: u64 = 228 * 1024;
/// Most dynamic shared memory one CTA may opt in to.
const CTA_SHARED_BYTES: u64 = 227 * 1024;
/// Registers and threads an SM has.
const SM_REGISTERS: u64 = 65_536;
const SM_THREADS: u64 = 2048;

#[test]
fn every_choice_is_a_valid_kernel_and_grid() {
    let mut rendered: HashMap<(String, KernelShape, TuneParams), u32> = HashMap::new();
    let mut choices = 0usize;
    for text in SCHEMES {
        let spec: SchemeSpec = text.parse().unwrap();
        for (head_dim, gqa) in [(128, 4), (128, 1), (128, 16), (64, 8), (256, 4)] {
            let shape = KernelShape::new(head_dim, gqa, Dtype::F16);
            let rules = LaunchRules::for_kernel(&spec, &shape);
            let candidates = TuneParams::candidates_for(&spec, &shape);
            let c = rules.constants;
            for batch in [1, 3, 16, 24, 64] {
                for max_len in [1, 300, 1024, 4096, 5000, 32_768, 131_072] {
                    for (sm_count, per_sm, fast_memory) in [
                        (132, 3, false),
                        (132, 2, true),
                        (114, 6, false),
                        (8, 1, false),
                    ] {
                        let launch = Launch {
                            batch,
                            kv_heads: 8,
                            max_len,
                        };
                        let gpu = Gpu {
                            sm_count,
                            resident_ctas: per_sm * sm_count,
                            fast_memory,
                        };
                        let choice = rules.choose(&launch, &gpu);
                        let p = choice.params;
                        let at = format!("{text} {shape:?} B={batch} L={max_len} {gpu:?}: {p:?}");
                        choices += 1;
                        // A block the templates declare, and one the tuner times (the same kernel:
                        // packing is moot where the kernel would not pack).
                        p.validate().unwrap();
                        let packed = TuneParams {
                            pack_heads: true,
                            ..p
                        };
                        assert!(
                            candidates.contains(&p)
                                || (candidates.contains(&packed)
                                    && !crate::decode::packs_heads(&spec, &shape, &packed)),
                            "{at}: not among the tuner's candidates"
                        );
                        // The grid: splits within the limit, pieces that check, rows and batch
                        // within the driver's grid.
                        assert!((1..=c.max_splits).contains(&choice.splits), "{at}");
                        choice.pieces.check(choice.splits).unwrap();
                        assert!(rules.pairs(&launch) / batch <= 65_535 && batch <= 65_535);
                        // Split warps never get fewer bucket tokens than the floor (unless one
                        // split is all there is); a one-tile rule's splits divide the bucket.
                        let bucket = context_bucket(max_len);
                        let warps = p.warps();
                        let share = bucket / (choice.splits * warps);
                        match rules.rule(&launch, sm_count).map(|(_, s)| s) {
                            Some(BlockSplits::OnePerPair) => {
                                assert_eq!(
                                    (choice.splits, choice.pieces),
                                    (1, Pieces::NONE),
                                    "{at}"
                                )
                            }
                            Some(BlockSplits::OneTilePerWarp(s)) => {
                                let rule_bucket =
                                    max_len.max(c.min_rule_bucket).next_power_of_two();
                                assert_eq!(s, choice.splits, "{at}");
                                assert_eq!(s * p.tile_tokens as usize * warps, rule_bucket, "{at}");
                            }
                            _ => assert!(
                                choice.splits == 1 || share >= rules.min_warp_tokens(max_len),
                                "{at}: {share} tokens a split warp"
                            ),
                        }
                        // Pieces only where the kernel runs them.
                        if rules.pieces == PieceKind::None {
                            assert_eq!(choice.pieces, Pieces::NONE, "{at}");
                        }
                        // The choice depends on the bucket only (a captured graph stays valid).
                        let at_bucket = Launch {
                            max_len: max_len.max(1).next_power_of_two(),
                            ..launch
                        };
                        assert_eq!(rules.choose(&at_bucket, &gpu), choice, "{at}");
                        // The kernel renders and fits: its dynamic shared memory within a CTA's
                        // and, at its occupancy floor, an SM's; its threads and the registers
                        // the floor leaves them within an SM's.
                        let key = (text.to_string(), shape, p);
                        let shared = *rendered.entry(key).or_insert_with(|| {
                            let k = decode_kernels(&spec, &shape, &p)
                                .unwrap_or_else(|e| panic!("{at}: {e}"));
                            k.decode.dynamic_shared_bytes
                        });
                        let ctas = u64::from(p.min_ctas_per_sm());
                        assert!(u64::from(shared) <= CTA_SHARED_BYTES, "{at}: {shared} B");
                        assert!(
                            ctas * u64::from(shared) <= SM_SHARED_BYTES,
                            "{at}: {shared} B"
                        );
                        assert!(ctas * u64::from(p.threads) <= SM_THREADS, "{at}");
                        let registers = SM_REGISTERS / (ctas * u64::from(p.threads));
                        assert!(registers >= 128, "{at}: {registers} registers a thread");
                    }
                }
            }
        }
    }
    assert!(choices > 5_000, "{choices}");
}

#[test]
fn the_rules_survive_json_and_the_table_is_ordered_by_kind() {
    for text in SCHEMES {
        let spec: SchemeSpec = text.parse().unwrap();
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let rules = LaunchRules::for_kernel(&spec, &shape);
        let json = serde_json::to_string(&rules).unwrap();
        let back: LaunchRules = serde_json::from_str(&json).unwrap();
        assert_eq!(back, rules, "{text}");
        assert_eq!(back.version, RULES_VERSION);
    }
    // Whole-pairs rows first, then one-tile rows, then few-pairs rows: the first row that applies
    // wins, and the kinds are tried in that order.
    let rank = |w: &When| match w {
        When::WholePairs { .. } => 0,
        When::OneTile { .. } => 1,
        When::FewPairs { .. } => 2,
    };
    let ranks: Vec<_> = table::BLOCK_RULES.iter().map(|r| rank(&r.when)).collect();
    assert!(ranks.windows(2).all(|w| w[0] <= w[1]), "{ranks:?}");
    // Every row names a block the templates declare.
    for r in table::BLOCK_RULES {
        let p = r.block.apply(TuneParams {
            threads: 64,
            tile_tokens: 64,
            min_warps_per_sm: 0,
            pack_heads: true,
            short_staging: false,
            store_scores: false,
        });
        p.validate().unwrap();
        assert!(!r.families.is_empty());
    }
}

#[test]
fn splits_fill_waves_and_stay_within_their_bounds() {
    let c = table::CONSTANTS;
    for pairs in [1, 8, 64, 128, 512, 2048] {
        for slots in [1, 132, 396, 792] {
            for max_len in [1, 256, 4096, 32_768, 131_072] {
                for warps in [2, 4, 8] {
                    for warp_tokens in [32, 64] {
                        let s = split_count(&c, pairs, max_len, slots, warps, warp_tokens);
                        let most = (context_bucket(max_len) / (warp_tokens * warps))
                            .clamp(1, c.most_splits);
                        assert!((1..=most).contains(&s), "{pairs} {slots} {max_len}");
                        // No fewer than fill a wave's nine tenths, where the bound allows.
                        let fewest = (c.fill_permille * slots).div_ceil(1000 * pairs);
                        assert!(s >= fewest.min(most), "{pairs} {slots} {max_len}: {s}");
                    }
                }
            }
        }
    }
}
