//! Every decode-kernel variant renders; set KVQ_DUMP_DIR to write the sources out (for NVRTC checks).

use kvq_codegen::{
    decode_kernels, decode_slow_path, short_staging_changes, store_scores_changes, Dtype,
    KernelShape, SlowPath, TuneParams,
};
use kvq_spec::SchemeSpec;

mod common;
use common::SCHEMES;

#[test]
fn every_variant_renders() {
    let dump = std::env::var_os("KVQ_DUMP_DIR");
    for (i, text) in SCHEMES.iter().enumerate() {
        let spec = SchemeSpec::parse(text).unwrap();
        for head_dim in [64, 96, 128, 256] {
            for (gqa, dtype) in [(1, Dtype::F16), (4, Dtype::Bf16), (8, Dtype::F16)] {
                for tune in TuneParams::candidates().filter(|t| t.threads == 128 || head_dim == 128)
                {
                    let shape = KernelShape::new(head_dim, gqa, dtype);
                    let k = decode_kernels(&spec, &shape, &tune)
                        .unwrap_or_else(|e| panic!("{text}: {e}"));
                    assert!(k.source.contains(&k.decode.name));
                    assert_eq!(k.range.is_some(), spec.calibrate.is_some());
                    if let Some(dir) = &dump {
                        if tune == TuneParams::default_for(&spec, &shape) {
                            let path = std::path::Path::new(dir)
                                .join(format!("s{i}_d{head_dim}_g{gqa}_{dtype}.cu"));
                            std::fs::write(path, &k.source).unwrap();
                        }
                    }
                }
            }
        }
    }
}

/// The generic kernel is never a silent choice: the kernels say why it serves a shape, the same
/// reason `decode_slow_path` gives without rendering, and the tensor-core kernel's shapes have none.
#[test]
fn slow_path_is_typed_and_matches_the_kernels() {
    let kivi2 = SchemeSpec::parse("k = int(2, channel), v = int(2, token), local = 128").unwrap();
    let kivi2_token_k = SchemeSpec::parse("k = int(2, token), v = int(2, token)").unwrap();
    let cases = [
        (&kivi2, 128, None),
        // Several slabs (docs/LAYOUT.md §9) stay on the tensor-core kernel; past 256 channels the
        // generic kernel serves the head.
        (&kivi2, 96, None),
        (&kivi2, 80, None),
        (&kivi2, 288, Some(SlowPath::HeadDim(288))),
        (
            &kivi2_token_k,
            128,
            Some(SlowPath::TokenAxisKeys { tensor: 'k' }),
        ),
    ];
    for (spec, head_dim, want) in cases {
        let shape = KernelShape::new(head_dim, 4, Dtype::F16);
        let k = decode_kernels(spec, &shape, &TuneParams::default_for(spec, &shape)).unwrap();
        assert_eq!(k.slow_path, want, "{spec} d{head_dim}");
        assert_eq!(decode_slow_path(spec, &shape), want, "{spec} d{head_dim}");
    }
    assert_eq!(SlowPath::HeadDim(288).to_string(), "head_dim 288");
}

/// Dynamic shared memory of the tensor-core decode kernel's merge: each warp's accumulators
/// (`head_dim / 16` m-tiles × 4 per lane), rows of 32 lanes padded to 33 words.
fn merge_bytes(tune: &TuneParams, head_dim: u32) -> u32 {
    tune.threads / 32 * (head_dim / 16) * 4 * 33 * 4
}

#[test]
fn dynamic_shared_memory_holds_the_ring_and_then_the_merge() {
    let shape = KernelShape::new(128, 4, Dtype::F16);
    let render_with = |text: &str, tune: &TuneParams| {
        decode_kernels(&SchemeSpec::parse(text).unwrap(), &shape, tune).unwrap()
    };
    let tune_for = |text: &str, tile: u32| TuneParams {
        tile_tokens: tile,
        ..TuneParams::default_for(&SchemeSpec::parse(text).unwrap(), &shape)
    };
    for text in SCHEMES {
        for tune in TuneParams::candidates() {
            let k = render_with(text, &tune);
            let bytes = k.decode.dynamic_shared_bytes;
            assert!(bytes % 16 == 0, "{text}: {bytes}");
            // A ring in the dense layout fits 72 KiB; aligned, it fits the SM's 192 KiB shared by
            // the CTAs the occupancy floor asks for (two at least).
            let align = ring_alignment(&k.source);
            let ctas = tune.min_ctas_per_sm().max(2) as usize;
            match align {
                Some(16) | None => assert!(bytes <= 72 * 1024, "{text}: {bytes}"),
                Some(a) => {
                    assert!(
                        [32, 128].contains(&a) && bytes as usize * ctas <= 192 * 1024,
                        "{text} {tune:?}: {bytes} bytes at {a}-byte sections"
                    );
                    for name in [
                        "ST_K", "ST_KH", "ST_V", "ST_VS", "ST_VZ", "ST_KP", "ST_BYTES",
                    ] {
                        assert_eq!(
                            stage_offset(&k.source, name) % a,
                            0,
                            "{text} {tune:?}: {name}"
                        );
                    }
                }
            }
            if is_tensor_core_kernel(&k.source) {
                assert!(bytes >= merge_bytes(&tune, 128), "{text}: {bytes}");
            } else {
                assert_eq!(
                    bytes, 0,
                    "{text}: the generic kernel merges in static arrays"
                );
                assert!(!stages(&k.source), "{text}");
            }
        }
    }
    // Quantized K and V stage, and their rings are larger than the merge; FP16 never stages; INT8
    // at 64-token tiles would need 129 KiB, so it loads directly and keeps only the merge.
    let staged = |text: &str, tile: u32| {
        let tune = tune_for(text, tile);
        let k = render_with(text, &tune);
        assert_eq!(
            stages(&k.source),
            k.decode.dynamic_shared_bytes > merge_bytes(&tune, 128),
            "{text} at {tile}-token tiles"
        );
        stages(&k.source)
    };
    assert!(staged(SCHEMES[1], 64));
    // 2-bit K and V (capped, three four-warp CTAs an SM) and 4-bit K and V (uncapped, two) align
    // their sections to 128 bytes; 4-bit at the twelve-warp floor keeps the dense layout.
    let align_of = |text: &str, tune: &TuneParams| ring_alignment(&render_with(text, tune).source);
    assert_eq!(align_of(SCHEMES[1], &tune_for(SCHEMES[1], 64)), Some(128));
    assert_eq!(align_of(SCHEMES[2], &tune_for(SCHEMES[2], 64)), Some(128));
    let capped = TuneParams {
        min_warps_per_sm: 12,
        ..tune_for(SCHEMES[2], 64)
    };
    assert_eq!(align_of(SCHEMES[2], &capped), Some(16));
    assert!(!staged(SCHEMES[0], 64));
    assert!(!staged(SCHEMES[5], 64));
    assert!(staged(SCHEMES[5], 32));
}

/// The section alignment a rendered decode kernel's ring states (`None`: no ring).
/// Whether the unit's kernel stages chunks through the cp.async ring (`KVQ_STAGES > 0`).
fn stages(source: &str) -> bool {
    unit_constant(source, "KVQ_STAGES").unwrap_or(0) > 0
}

fn ring_alignment(source: &str) -> Option<usize> {
    unit_constant(source, "ST_ALIGN").filter(|_| unit_constant(source, "KVQ_STAGES") > Some(0))
}

/// The value of an integer constant the unit defines (`NAME = value` in a `static constexpr`
/// declaration).
fn unit_constant(source: &str, name: &str) -> Option<usize> {
    let decl = format!(" {name} = ");
    let at = source.find(&decl)?;
    let rest = &source[at + decl.len()..];
    let end = rest.find(|c: char| !c.is_ascii_digit())?;
    rest[..end].parse().ok()
}

/// Where a ring section starts in a stage (`ST_K`, …; `ST_BYTES` the stage's size), from the
/// section sizes the unit defines.
fn stage_offset(source: &str, name: &str) -> usize {
    let sizes = [
        ("ST_K", "ST_HEADER_BYTES"),
        ("ST_KH", "ST_K_ROWS_BYTES"),
        ("ST_V", "ST_K_HIGH_BYTES"),
        ("ST_VS", "ST_V_ROWS_BYTES"),
        ("ST_VZ", "ST_V_SCALES_BYTES"),
        ("ST_KP", "ST_V_ZEROS_BYTES"),
    ];
    if name == "ST_BYTES" {
        return unit_constant(source, "ST_BYTES").unwrap_or_else(|| panic!("{name} not rendered"));
    }
    let upto = sizes
        .iter()
        .position(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("{name}"));
    sizes[..=upto]
        .iter()
        .map(|(_, size)| {
            unit_constant(source, size).unwrap_or_else(|| panic!("{size} not rendered"))
        })
        .sum()
}

#[test]
fn the_score_range_pass_stages_keys_through_the_decode_ring() {
    let shape = KernelShape::new(128, 4, Dtype::F16);
    let calibrated = [
        SCHEMES[4],
        // V in FP16: no ring, so the range pass loads K from global memory too.
        "k = int(2, channel), v = fp16, sink = 8, calibrate = calibrate(tau1 = 0.5, tau2 = 0.2)",
    ];
    let mut staged = 0;
    for text in calibrated {
        let spec = SchemeSpec::parse(text).unwrap();
        for tune in TuneParams::candidates() {
            let k = decode_kernels(&spec, &shape, &tune).unwrap();
            let range = k
                .range
                .as_ref()
                .expect("a calibrated scheme has a range pass");
            assert_eq!(range.block, k.decode.block, "{text}");
            // The range pass has the ring alone; the decode kernel reuses it for its merge.
            assert_eq!(
                k.decode.dynamic_shared_bytes,
                range.dynamic_shared_bytes.max(merge_bytes(&tune, 128)),
                "{text}"
            );
            assert_eq!(
                range.dynamic_shared_bytes > 0,
                !k.source.contains("static constexpr int KVQ_STAGES = 0;"),
                "{text}"
            );
            staged += usize::from(range.dynamic_shared_bytes > 0);
        }
    }
    assert!(staged > 0, "no calibrated variant staged its keys");
}

/// A scheme and its decode source at head_dim 128, GQA 4, f16, default launch parameters.
fn default_source(text: &str) -> (SchemeSpec, String) {
    let spec = SchemeSpec::parse(text).unwrap();
    let source = source_at(&spec, 128, 4, None);
    (spec, source)
}

/// The decode source of `spec` in f16 at a head_dim and GQA, with the default launch parameters
/// but for `tile_tokens` where given.
fn source_at(spec: &SchemeSpec, head_dim: u32, gqa: u32, tile_tokens: Option<u32>) -> String {
    let shape = KernelShape::new(head_dim, gqa, Dtype::F16);
    let mut tune = TuneParams::default_for(spec, &shape);
    if let Some(tile) = tile_tokens {
        tune.tile_tokens = tile;
    }
    decode_kernels(spec, &shape, &tune).unwrap().source
}

fn is_tensor_core_kernel(source: &str) -> bool {
    source.contains("#include \"kvq/decode/constants.cuh\"")
}

/// Integer codes of 1 or 2 bits along `axis`.
fn is_low_bit(t: &kvq_spec::TensorQuant, axis: kvq_spec::Axis) -> bool {
    matches!(t, kvq_spec::TensorQuant::Int(q) if q.bits <= 2 && q.axis == axis)
}

/// Keys of at most 2 bits meet the query on the integer tensor cores: in the decode kernel where
/// the scheme is not calibrated, or with a third, fine query limb where it is and the keys have 2
/// bits (calibration magnifies score errors; 1-bit keys measured slower on that path). A
/// calibrated scheme's keys are scored by its range pass alone, which stores the scores for the
/// decode kernel, so there the fold (and its query table, staged once per CTA in shared memory)
/// is the range pass's; kernels without a fold keep no table.
#[test]
fn only_keys_of_at_most_two_bits_take_the_integer_tensor_cores_and_calibrated_ones_with_a_fine_limb(
) {
    const DECODE_INTEGER: &str = "K_INT = true,";
    const RANGE_INTEGER: &str = "KVQ_RANGE_INT = true,";
    // Kitty's boosted plane joins the integer sums where the keys take the integer path without
    // the fine limb.
    const HIGH_INT: &str = "K_HIGH_INT = true;";
    // The bias's sums in one mma chain in the decode kernel, two in the range pass (CalibQuant-2's
    // range pass is slower with one).
    const FINE: &str = "K_FINE = true,";
    const STORED: &str = "static constexpr bool KVQ_STORED = true;";
    let mut fine_limbs = 0;
    for text in SCHEMES {
        let (spec, source) = default_source(text);
        let integer =
            is_tensor_core_kernel(&source) && is_low_bit(&spec.k, kvq_spec::Axis::Channel);
        let calibrated = spec.calibrate.is_some();
        let two_bit = matches!(spec.k, kvq_spec::TensorQuant::Int(q) if q.bits == 2);
        let decode = integer && (!calibrated || two_bit);
        let fine = decode && calibrated;
        // With stored scores the range pass scores on the decode kernel's path, never the
        // range pass's own two-limb one.
        let range = integer && calibrated && !source.contains(STORED);
        let boost = matches!(spec.k, kvq_spec::TensorQuant::Int(q) if q.boost.is_some());
        for (marker, expected) in [
            (DECODE_INTEGER, decode),
            (RANGE_INTEGER, range),
            (FINE, fine),
            (HIGH_INT, decode && boost && !calibrated),
        ] {
            assert_eq!(source.contains(marker), expected, "{text}: {marker}");
        }
        fine_limbs += usize::from(fine);
    }
    assert!(
        fine_limbs >= 1,
        "a calibrated 2-bit scheme takes the fine limb"
    );
}

/// Calibrated 2-bit keys on the integer path mask their byte planes in pairs, one shift a word
/// (their decode kernels carry the fine limb, which absorbs the 2 bits a scaled plane's query
/// loses); every other kernel shifts each plane down, so uncalibrated keys keep 16 bits of query
/// in every plane (with pairs, kivi2's largest f16 error rose about 2.5×).
#[test]
fn only_calibrated_two_bit_keys_mask_their_byte_planes_in_place() {
    const PAIRS: &str = "static constexpr int K_PLANES_IN_PLACE = 2;";
    let mut paired = 0;
    for text in SCHEMES {
        let (spec, source) = default_source(text);
        if !is_tensor_core_kernel(&source) {
            continue;
        }
        let integer_keys =
            source.contains("K_INT = true,") || source.contains("KVQ_RANGE_INT = true,");
        let two_bit = matches!(spec.k, kvq_spec::TensorQuant::Int(q) if q.bits == 2);
        let pairs = two_bit && spec.calibrate.is_some();
        assert!(
            !pairs || integer_keys,
            "{text}: calibrated 2-bit keys take the integer path"
        );
        assert_eq!(source.contains(PAIRS), pairs, "{text}: {PAIRS}");
        paired += usize::from(pairs);
    }
    assert!(
        paired >= 1,
        "a calibrated 2-bit scheme masks its planes in pairs"
    );
}

/// In the split-K division an FP16 row (sink or tail window) of a tensor of 1- or 2-bit codes
/// costs up to 4.5 of its quantized rows in kernels of at most four warps a CTA, 3 otherwise
/// (eight-warp CTAs, wider codes, FP16 tensors): per-warp timestamps put kivi2's FP16 rows at
/// about 4.7 quantized rows at B=1, and 4.5 lost at B=16 L=4K in eight-warp CTAs (thirty-eighth
/// round).
#[test]
fn fp16_rows_of_low_bit_tensors_cost_more_quantized_rows_in_small_ctas() {
    let cap = |t: &kvq_spec::TensorQuant, threads: u32| {
        let low_bit = matches!(t, kvq_spec::TensorQuant::Int(q) if q.bits <= 2);
        if low_bit && threads <= 128 {
            "4.5f"
        } else {
            "3.f"
        }
    };
    let mut raised = 0;
    for text in SCHEMES {
        let spec = SchemeSpec::parse(text).unwrap();
        let shape = KernelShape::new(128, 4, Dtype::F16);
        for threads in [64, 128, 256] {
            let mut tune = TuneParams::default_for(&spec, &shape);
            tune.threads = threads;
            let source = decode_kernels(&spec, &shape, &tune).unwrap().source;
            if !is_tensor_core_kernel(&source) {
                continue;
            }
            let line = format!(
                "static constexpr float K_ROW_CAP = {}, V_ROW_CAP = {};",
                cap(&spec.k, threads),
                cap(&spec.v, threads)
            );
            assert!(
                source.contains(&line),
                "{text} at {threads} threads: {line}"
            );
            raised += usize::from(line.contains("4.5f"));
        }
    }
    assert!(
        raised >= 4,
        "1- and 2-bit tensors in small CTAs get the larger cap"
    );
}

/// Every calibrated scheme on the tensor-core kernel stores its keys' scores in the range pass
/// and reads them back in the decode kernel, which then stages scores where it staged keys and
/// folds no query; uncalibrated kernels and the generic kernel store none.
#[test]
fn calibrated_tensor_core_kernels_score_their_keys_once_and_read_the_scores_back() {
    const STORED: &str = "static constexpr bool KVQ_STORED = true;";
    let mut stored = 0;
    for text in SCHEMES {
        let spec = SchemeSpec::parse(text).unwrap();
        for head_dim in [64, 128, 256] {
            let source = source_at(&spec, head_dim, 4, None);
            let expected = spec.calibrate.is_some() && is_tensor_core_kernel(&source);
            assert_eq!(
                source.contains(STORED),
                expected,
                "{text} head_dim {head_dim}"
            );
            if expected {
                stored += 1;
            }
        }
    }
    assert!(stored >= 4, "both CalibQuant built-ins store scores");
}

/// With the keys scored twice (`TuneParams::store_scores` false), CalibQuant's kernels are those
/// before stored scores: the range pass meets 1- and 2-bit keys on its own two-limb integer path,
/// and the decode kernel scores the keys again, folding its query per page.
#[test]
fn calibrated_kernels_scoring_keys_twice_keep_the_range_pass_on_its_own_path() {
    for text in SCHEMES {
        let spec = SchemeSpec::parse(text).unwrap();
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let default = TuneParams::default_for(&spec, &shape);
        let twice = TuneParams {
            store_scores: false,
            ..default
        };
        assert_eq!(
            default.store_scores,
            store_scores_changes(&spec, &shape, &default),
            "{text}: the default stores scores wherever that changes the kernels"
        );
        let source = decode_kernels(&spec, &shape, &twice).unwrap().source;
        assert!(
            !source.contains("static constexpr bool KVQ_STORED = true;"),
            "{text}"
        );
        if default.store_scores {
            assert!(source.contains("KVQ_RANGE_INT = true,"), "{text}");
        }
    }
}

/// Kitty's boosted plane joins the integer sums up to head_dim 128; at 256 (Kitty-Pro spilled
/// there with it) it keeps the f16 `mma` in real units.
#[test]
fn the_boosted_plane_takes_the_integer_path_up_to_head_dim_128() {
    const HIGH_INT: &str = "K_HIGH_INT = true;";
    let spec = SchemeSpec::parse(
        "k = int(2, channel, boost = boost(4, ratio = 0.25, by = magnitude)), v = int(2, token)",
    )
    .unwrap();
    for (head_dim, expected) in [(64, true), (128, true), (256, false)] {
        let source = source_at(&spec, head_dim, 4, None);
        assert_eq!(source.contains(HIGH_INT), expected, "head_dim {head_dim}");
        assert_eq!(
            source.contains("K_BOOST = true;") && !source.contains(HIGH_INT),
            !expected,
            "head_dim {head_dim}: the f16 high plane where the integer one is off"
        );
    }
}

/// Two subtiles share a score fragment only where the boosted plane takes the integer path, at
/// GQA ≤ 4 and with an even number of 16-token subtiles a chunk (measured: the other kernels
/// gained nothing from it at B=16 L=32K, KIVI-4 lost).
#[test]
fn only_kitty_kernels_pack_two_subtiles_into_a_score_fragment_at_gqa_of_at_most_four() {
    const PACK: &str = "static constexpr bool KVQ_PACK = true;";
    let kitty = SchemeSpec::parse(
        "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 128), sink = 32",
    )
    .unwrap();
    let kivi2 = SchemeSpec::parse("k = int(2, channel), v = int(2, token), local = 128").unwrap();
    for (spec, head_dim, gqa, tile, expected) in [
        (&kitty, 128, 4, None, true),
        (&kitty, 128, 1, None, true),
        (&kitty, 64, 2, None, true),
        (&kitty, 128, 4, Some(32), true),
        (&kitty, 128, 4, Some(16), false),
        (&kitty, 128, 8, None, false),
        (&kitty, 256, 4, None, false),
        (&kivi2, 128, 4, None, false),
    ] {
        let source = source_at(spec, head_dim, gqa, tile);
        assert!(source.contains("static constexpr bool KVQ_PACK = "));
        assert_eq!(
            source.contains(PACK),
            expected,
            "head_dim {head_dim}, gqa {gqa}, tile {tile:?}"
        );
    }
    // `TuneParams::pack_heads` false turns it off, and only the tuning parameter moves it.
    let shape = KernelShape::new(128, 4, Dtype::F16);
    let packed = TuneParams::default_for(&kitty, &shape);
    let unpacked = TuneParams {
        pack_heads: false,
        ..packed
    };
    let source = decode_kernels(&kitty, &shape, &unpacked).unwrap().source;
    assert!(source.contains("static constexpr bool KVQ_PACK = false;"));
    let with = decode_kernels(&kitty, &shape, &packed).unwrap();
    let without = decode_kernels(&kitty, &shape, &unpacked).unwrap();
    assert_ne!(
        with.decode.name, without.decode.name,
        "one cache entry each"
    );
}

/// Asymmetric channel-axis V of 1 or 2 bits enters P·V as f16 subnormals, its page's scales on the
/// accumulators; symmetric or wider channel-axis V keeps the dequantising `fma` per pair.
#[test]
fn only_asymmetric_channel_axis_values_of_at_most_two_bits_enter_pv_as_subnormals_with_page_units()
{
    const CHANNEL_SUB: &str = "static constexpr bool V_CHANNEL_SUB = true;";
    let mut subnormal = 0;
    for text in SCHEMES {
        let (spec, source) = default_source(text);
        let tensor_core_kernel = is_tensor_core_kernel(&source);
        let expected = tensor_core_kernel
            && matches!(spec.v, kvq_spec::TensorQuant::Int(q)
                if q.bits <= 2 && q.axis == kvq_spec::Axis::Channel && !q.symmetric);
        assert_eq!(source.contains(CHANNEL_SUB), expected, "{text}");
        subnormal += usize::from(expected);
    }
    assert!(subnormal >= 2, "CalibQuant-1 and -2's shapes take the path");
}

/// 1-bit asymmetric keys on the f16 path (calibrated schemes' keys: uncalibrated 1- and 2-bit keys
/// take the integer path) enter the score `mma` as f16 subnormals, and their fold scales each pair's
/// query by a power of two; every other kernel keeps the magic-number conversion.
#[test]
fn only_one_bit_asymmetric_keys_on_the_f16_path_enter_the_scores_as_subnormals() {
    const KEY_SUB: &str = "static constexpr bool K_SUB = true;";
    let mut subnormal = 0;
    for text in SCHEMES {
        let (spec, source) = default_source(text);
        let tensor_core_kernel = is_tensor_core_kernel(&source);
        let one_bit_asymmetric = matches!(spec.k, kvq_spec::TensorQuant::Int(q)
            if q.bits == 1 && q.axis == kvq_spec::Axis::Channel && !q.symmetric && q.boost.is_none());
        let expected = tensor_core_kernel && one_bit_asymmetric && spec.calibrate.is_some();
        assert_eq!(source.contains(KEY_SUB), expected, "{text}");
        subnormal += usize::from(expected);
    }
    assert_eq!(subnormal, 1, "CalibQuant-1's shape takes the path");
}

/// With stored scores, a decode kernel with 1-bit asymmetric channel-axis V stages a new V page's
/// parameters into the K parameter section it no longer uses, and reads them there; 2-bit V
/// (CalibQuant-2's shape) and kernels that score keys keep the load from the page block. The range
/// pass on the f16 path (1-bit calibrated keys) loads its query's pairs once, not per page, and at
/// GQA ≤ 4 meets both halves of the query in one `mma`.
#[test]
fn stored_scores_kernels_stage_one_bit_v_parameters_and_keep_the_range_query() {
    const STAGE_VP: &str = "static constexpr bool KVQ_STAGE_VP = true;";
    const KEPT: &str = "KVQ_RANGE_QUERY_KEPT = true;";
    let (mut staged, mut kept) = (0, 0);
    for text in SCHEMES {
        let (spec, source) = default_source(text);
        let stored = source.contains("static constexpr bool KVQ_STORED = true;");
        let one_bit_channel_v = matches!(spec.v, kvq_spec::TensorQuant::Int(q)
            if q.bits == 1 && q.axis == kvq_spec::Axis::Channel && !q.symmetric);
        assert_eq!(
            source.contains(STAGE_VP),
            stored && one_bit_channel_v,
            "{text}"
        );
        // Calibrated 2-bit keys take the integer path with its query table; others the f16 path.
        let f16_keys = matches!(spec.k, kvq_spec::TensorQuant::Int(q) if q.bits != 2);
        assert_eq!(source.contains(KEPT), stored && f16_keys, "{text}");
        // At GQA 4 that range pass also meets both query halves in one mma (columns 4..7 the low ones).
        assert_eq!(
            source.contains("static constexpr bool KVQ_RANGE_PACKED = true,"),
            stored && f16_keys,
            "{text}"
        );
        assert!(
            !source_at(&spec, 128, 8, None)
                .contains("static constexpr bool KVQ_RANGE_PACKED = true,"),
            "{text}: eight heads fill the columns"
        );
        staged += usize::from(stored && one_bit_channel_v);
        kept += usize::from(source.contains(KEPT));
        // Without stored scores nothing changes: the keys-twice kernel folds K's parameters there.
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let tune = TuneParams {
            store_scores: false,
            ..TuneParams::default_for(&spec, &shape)
        };
        let twice = decode_kernels(&spec, &shape, &tune).unwrap().source;
        assert!(!twice.contains(STAGE_VP) && !twice.contains(KEPT), "{text}");
    }
    assert_eq!((staged, kept), (1, 1), "CalibQuant-1's shape, and no other");
}

/// Token-axis V of 1 or 2 bits enters P·V as f16 subnormals (one AND a pair); 4-bit V measured no
/// gain on that path and keeps the magic-number conversion.
#[test]
fn only_token_axis_values_of_at_most_two_bits_enter_pv_as_subnormals() {
    const SUBNORMAL: &str = "static constexpr bool V_SUBNORMAL = true;";
    let mut subnormal = 0;
    for text in SCHEMES {
        let (spec, source) = default_source(text);
        let tensor_core_kernel = is_tensor_core_kernel(&source);
        let expected = tensor_core_kernel && is_low_bit(&spec.v, kvq_spec::Axis::Token);
        assert_eq!(source.contains(SUBNORMAL), expected, "{text}");
        assert!(
            !tensor_core_kernel || source.contains("#include \"kvq/decode/values.cuh\""),
            "{text}: the tensor-core unit includes the values header, which holds both conversions"
        );
        subnormal += usize::from(expected);
    }
    assert!(subnormal >= 2, "kivi2 and Kitty's shapes take the path");
    let values = kvq_codegen::kernel_headers()
        .iter()
        .find(|(name, _)| *name == "kvq/decode/values.cuh")
        .map(|(_, text)| *text)
        .unwrap_or_default();
    assert!(values.contains("kvq_v_pairs<BITS, OFF, MODE == 2>("));
}

#[test]
fn eight_bit_and_uncalibrated_low_bit_tensor_core_kernels_run_pieces_and_every_kernel_takes_them() {
    use kvq_codegen::{decode_piece_rule, decode_runs_pieces, PieceRule};
    for d in [64, 128, 256] {
        let shape = KernelShape::new(d, 4, Dtype::F16);
        for text in SCHEMES {
            let spec = SchemeSpec::parse(text).unwrap();
            for tune in TuneParams::candidates() {
                let k = decode_kernels(&spec, &shape, &tune).unwrap();
                let tensor_core_kernel = is_tensor_core_kernel(&k.source);
                let all_bits = |f: fn(u32) -> bool| {
                    [spec.k, spec.v]
                        .iter()
                        .all(|t| matches!(t, kvq_spec::TensorQuant::Int(q) if f(q.bits as u32)))
                };
                let rule = if !tensor_core_kernel {
                    PieceRule::None
                } else if all_bits(|b| b == 8) {
                    PieceRule::LongShares
                } else if all_bits(|b| b <= 2) && spec.calibrate.is_none() {
                    PieceRule::FewSplits
                } else {
                    PieceRule::None
                };
                assert_eq!(k.piece_rule, rule, "{text} d{d} {tune:?}");
                assert_eq!(
                    k.runs_pieces(),
                    rule != PieceRule::None,
                    "{text} d{d} {tune:?}"
                );
                assert_eq!(decode_piece_rule(&spec, &shape, &tune), rule, "{text}");
                assert_eq!(
                    decode_runs_pieces(&spec, &shape, &tune),
                    k.runs_pieces(),
                    "{text}"
                );
                if tensor_core_kernel {
                    let rendered = format!("KVQ_RUNS_PIECES = {};", k.runs_pieces());
                    assert!(k.source.contains(&rendered), "{text}: {rendered}");
                }
                // The launch is the same for every kernel: pieces after the splits, the combine
                // merges both, and a decode launch of one part writes `out` itself.
                let params: Vec<&str> = k.decode.params.iter().map(|(_, n)| n.as_str()).collect();
                assert_eq!(
                    params[params.len() - 3..],
                    ["num_pieces", "piece_permille", "out"]
                );
                assert!(
                    k.source
                        .contains("#include \"kvq/decode/decode_kernel.cuh\"")
                        || k.source.contains("#include \"kvq/decode_generic.cuh\""),
                    "{text}: the one-part output"
                );
                assert_eq!(k.decode.grid[0], "num_splits + num_pieces");
                assert_eq!(k.combine.params.last().unwrap().1, "num_parts");
            }
        }
    }
}

/// Every quantizer form where the tensor's layout supports it (tiled where not).
fn forms_of(spec: &SchemeSpec, head_dim: u32) -> Vec<kvq_codegen::QuantizerForms> {
    use kvq_codegen::{QuantizerForm, QuantizerForms};
    let pick = |t: &kvq_spec::TensorQuant, f: QuantizerForm| {
        if f.supports(t, head_dim, spec.page) {
            f
        } else {
            QuantizerForm::Tiled
        }
    };
    QuantizerForm::ALL
        .into_iter()
        .map(|f| QuantizerForms {
            k: pick(&spec.k, f),
            v: pick(&spec.v, f),
        })
        .collect()
}

#[test]
fn every_cache_variant_renders() {
    use kvq_codegen::cache_kernels_with;
    let dump = std::env::var_os("KVQ_DUMP_DIR");
    for (i, text) in SCHEMES.iter().enumerate() {
        let spec = SchemeSpec::parse(text).unwrap();
        for head_dim in [64, 96, 128, 256] {
            for dtype in [Dtype::F16, Dtype::Bf16] {
                for forms in forms_of(&spec, head_dim) {
                    let k = cache_kernels_with(&spec, head_dim, dtype, forms)
                        .unwrap_or_else(|e| panic!("{text} {forms}: {e}"));
                    assert!(k.source.contains(&k.append.name));
                    assert_eq!(k.k_quantizers.is_some(), spec.k.is_quantized());
                    assert_eq!(k.v_quantizers.is_some(), spec.v.is_quantized());
                    assert_eq!(k.quantizer_forms, forms);
                    if let Some(dir) = &dump {
                        let path = std::path::Path::new(dir).join(format!(
                            "cache_s{i}_d{head_dim}_{dtype}_{}_{}.cu",
                            forms.k, forms.v
                        ));
                        std::fs::write(path, &k.source).unwrap();
                    }
                }
            }
        }
    }
}

#[test]
fn unsupported_quantizer_forms_are_typed_errors() {
    use kvq_codegen::{cache_kernels_with, CodegenError, QuantizerForm, QuantizerForms};
    // Token groups of 4 channels cannot give a lane 8 channels of one group.
    let spec = SchemeSpec::parse("k = int(8, token, group = 4), v = fp16").unwrap();
    let err = cache_kernels_with(
        &spec,
        128,
        Dtype::F16,
        QuantizerForms::both(QuantizerForm::Vectorized),
    )
    .unwrap_err();
    assert!(matches!(err, CodegenError::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("vectorized"), "{err}");
    // Token groups of 32 channels at head_dim 96 (12 chunks of 8 over 16 lanes) would cross rows.
    let spec = SchemeSpec::parse("k = int(2, channel), v = int(2, token, group = 32)").unwrap();
    assert!(cache_kernels_with(
        &spec,
        96,
        Dtype::F16,
        QuantizerForms::both(QuantizerForm::Coarsened)
    )
    .is_err());
    assert_eq!(
        QuantizerForms::default_for(&spec, 96),
        QuantizerForms {
            k: QuantizerForm::Vectorized,
            v: QuantizerForm::Tiled
        }
    );
    assert_eq!(
        QuantizerForms::default_for(&spec, 128),
        QuantizerForms::both(QuantizerForm::Vectorized)
    );
}

#[test]
fn short_staging_is_a_choice_only_for_kernels_staging_4_bit_k_and_v_generally() {
    let shape = KernelShape::new(128, 4, Dtype::F16);
    let changes = |text: &str| {
        let spec = SchemeSpec::parse(text).unwrap();
        let tune = TuneParams::default_for(&spec, &shape);
        let offered = TuneParams::candidates_for(&spec, &shape)
            .iter()
            .any(|t| t.short_staging);
        assert_eq!(
            offered,
            short_staging_changes(&spec, &shape, &tune),
            "{text}"
        );
        offered
    };
    assert!(changes(SCHEMES[2]));
    assert!(!changes(SCHEMES[1]));
    assert!(!changes(SCHEMES[5]));
    assert!(!changes(SCHEMES[0]));
    // XQuant has no GPU decode kernel, whatever its K and V would stage.
    assert!(!changes(
        "k = int(4, channel), v = int(4, token), source = x(latent)"
    ));
}

/// 1-bit codes at head_dim 64 give a thread half a word of a row (16 K codes, 8 V codes): the
/// tensor-core kernel takes them with its keys on the f16 path as subnormals, never the integer
/// path it takes at head_dim 128; a boosted plane over such keys keeps the generic kernel.
#[test]
fn one_bit_codes_at_head_dim_64_take_the_f16_path_of_the_tensor_core_kernel() {
    const K_SUB: &str = "static constexpr bool K_SUB = true;";
    let one_bit = SchemeSpec::parse("k = int(1, channel), v = int(1, token), local = 64").unwrap();
    for gqa in [1, 4, 8] {
        let d64 = source_at(&one_bit, 64, gqa, None);
        assert!(is_tensor_core_kernel(&d64), "gqa {gqa}");
        assert!(
            d64.contains(K_SUB) && !d64.contains("K_INT = true,"),
            "gqa {gqa}"
        );
        let d128 = source_at(&one_bit, 128, gqa, None);
        assert!(
            is_tensor_core_kernel(&d128) && d128.contains("K_INT = true,"),
            "gqa {gqa}"
        );
    }
    let calibquant1 = SchemeSpec::parse(SCHEMES[4]).unwrap();
    let d64 = source_at(&calibquant1, 64, 4, None);
    assert!(is_tensor_core_kernel(&d64) && d64.contains(K_SUB));
    let boosted = SchemeSpec::parse(
        "k = int(1, channel, boost = boost(3, ratio = 0.125)), v = int(1, token), local = 64",
    )
    .unwrap();
    let d64 = source_at(&boosted, 64, 4, None);
    assert!(!is_tensor_core_kernel(&d64));
    assert!(d64.contains("a boosted plane over 1-bit codes at head_dim 64"));
}
