//! More than 8 query heads a KV head: the tensor-core kernel takes them in head groups, one grid
//! row a group (`HeadGroups`), equal where the heads allow and with the last group starting early
//! where they do not; FP16 K and V take groups of up to 16, two head tiles a warp; layouts the
//! tensor cores do not serve keep the generic kernel.

use kvq_codegen::{
    decode_groups, decode_head_groups, decode_kernels, CodegenError, DecodeKernels, Dtype,
    HeadGroups, KernelShape, TuneParams, GENERIC_MAX_GQA, MAX_GQA,
};
use kvq_spec::{SchemeSpec, TensorQuant};

mod common;
use common::SCHEMES;

fn render(text: &str, gqa: u32) -> (SchemeSpec, KernelShape, DecodeKernels) {
    let spec = SchemeSpec::parse(text).unwrap();
    let shape = KernelShape::new(128, gqa, Dtype::F16);
    let kernels = decode_kernels(&spec, &shape, &TuneParams::default_for(&spec, &shape))
        .unwrap_or_else(|e| panic!("{text} gqa {gqa}: {e}"));
    (spec, shape, kernels)
}

fn is_tensor_core_kernel(source: &str) -> bool {
    source.contains("// kernel: tensor cores")
}

/// Most head tiles a warp of the scheme's tensor-core kernel holds at head_dim `d`: for FP16 K
/// and V two at 128 (as `render` gives) and four at 64, one for the rest.
fn most_tiles_at(text: &str, d: u32) -> u32 {
    let spec = SchemeSpec::parse(text).unwrap();
    let fp16 = [spec.k, spec.v]
        .iter()
        .all(|t| matches!(t, TensorQuant::Fp16));
    match (fp16, d) {
        (true, 64) => 4,
        (true, 128) => 2,
        _ => 1,
    }
}

fn tiles_past_eight(text: &str) -> u32 {
    most_tiles_at(text, 128)
}

/// The rows the scheme's tensor-core kernel takes for `gqa` query heads at head_dim `d`.
fn expected_groups_at(text: &str, d: u32, gqa: u32) -> HeadGroups {
    HeadGroups::for_gqa_in_tiles(gqa, most_tiles_at(text, d)).unwrap()
}

fn expected_groups(text: &str, gqa: u32) -> HeadGroups {
    expected_groups_at(text, 128, gqa)
}

/// The schemes whose kernels at GQA 8 are the tensor-core kernel (the others' layouts take the
/// generic kernel at any GQA).
fn tensor_core_schemes() -> Vec<&'static str> {
    let schemes: Vec<_> = SCHEMES
        .iter()
        .copied()
        .filter(|text| is_tensor_core_kernel(&render(text, 8).2.source))
        .collect();
    assert!(schemes.len() >= 8, "{schemes:?}");
    schemes
}

#[test]
fn more_than_eight_heads_take_the_tensor_cores_in_groups() {
    for text in tensor_core_schemes() {
        for gqa in [12, 16, 32] {
            let HeadGroups { groups, heads, .. } = expected_groups(text, gqa);
            let (spec, shape, k) = render(text, gqa);
            assert!(is_tensor_core_kernel(&k.source), "{text} gqa {gqa}");
            assert_eq!(k.head_groups, groups, "{text} gqa {gqa}");
            assert_eq!(decode_head_groups(&spec, &shape), groups);
            assert!(k
                .source
                .contains(&format!("static constexpr int GQA = {heads};")));
            assert!(k
                .source
                .contains(&format!("static constexpr int HEAD_GROUPS = {groups};")));
            let rows = match groups {
                1 => "kv_heads".to_string(),
                g => format!("kv_heads * {g}"),
            };
            assert_eq!(k.decode.grid[1], rows);
            if let Some(range) = &k.range {
                assert_eq!(range.grid[1], rows, "the range grid takes the same rows");
            }
            // The combine merges query heads, whatever the grid rows that wrote them.
            assert_eq!(k.combine.grid[0], "q_heads");
        }
    }
}

#[test]
fn a_head_group_runs_the_kernel_of_its_heads_but_for_where_it_reads_the_cache() {
    for text in tensor_core_schemes() {
        // Two rows of a CTA's heads against one: 16 and 8 heads, 32 and 16 with two tiles.
        let row_heads = 8 * tiles_past_eight(text);
        let (_, _, grouped) = render(text, 2 * row_heads);
        let (_, _, eight) = render(text, row_heads);
        let normalise = |k: &DecodeKernels| {
            let ids = [&k.decode.name, &k.combine.name]
                .into_iter()
                .chain(k.range.as_ref().map(|r| &r.name))
                .map(|name| name.rsplit('_').next().unwrap().to_string())
                .collect::<Vec<_>>();
            let mut source = k.source.clone();
            for id in ids {
                source = source.replace(&id, "ID");
            }
            source
                .lines()
                .filter(|l| {
                    !l.starts_with("// shape:")
                        && !l.contains("HEAD_GROUPS = ")
                        && !l.contains("QHEADS = ")
                })
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(normalise(&grouped), normalise(&eight), "{text}");
        // ... and every address into the cache's pools, sink and tail goes through the group's KV head.
        // The unit and the decode headers it includes.
        let text: String = std::iter::once(grouped.source.as_str())
            .chain(
                kvq_codegen::kernel_headers()
                    .iter()
                    .filter(|(name, _)| name.starts_with("kvq/decode/"))
                    .map(|(_, t)| *t),
            )
            .collect();
        let cache_reads: Vec<&str> = text
            .lines()
            .filter(|l| {
                ["pool + ", "sink + ", "tail + "]
                    .iter()
                    .any(|p| l.contains(p))
            })
            .collect();
        assert!(cache_reads.len() >= 2, "{text}: {cache_reads:#?}");
        for line in cache_reads {
            assert!(
                line.contains("kvh / HEAD_GROUPS") || line.contains("+ head_block *"),
                "{text}: {line}"
            );
        }
        for line in text.lines().filter(|l| l.contains("head_block =")) {
            assert!(line.contains("kvh / HEAD_GROUPS"), "{text}: {line}");
        }
        assert!(eight
            .source
            .contains("static constexpr int HEAD_GROUPS = 1;"));
        assert_eq!(eight.head_groups, 1);
        assert_eq!(eight.decode.grid[1], "kv_heads");
    }
}

#[test]
fn heads_without_equal_groups_take_the_tensor_cores_with_the_last_group_starting_early() {
    for text in tensor_core_schemes() {
        // Groups of 8 (two rows of 5, 6, 7; four of 8), or of 16 with two tiles (two of 15).
        let uneven = if tiles_past_eight(text) == 2 {
            vec![29]
        } else {
            vec![9, 11, 13, 29]
        };
        for gqa in uneven {
            let expected = expected_groups(text, gqa);
            let HeadGroups { groups, heads, .. } = expected;
            assert!(!expected.is_even());
            let (spec, shape, k) = render(text, gqa);
            assert!(is_tensor_core_kernel(&k.source), "{text} gqa {gqa}");
            assert_eq!((k.head_groups, k.group_heads), (groups, heads));
            assert_eq!(decode_head_groups(&spec, &shape), groups);
            assert_eq!(decode_groups(&spec, &shape), expected);
            assert_eq!(k.decode.grid[1], format!("kv_heads * {groups}"));
            for constant in [
                format!("static constexpr int GQA = {heads};"),
                format!("static constexpr int HEAD_GROUPS = {groups};"),
                format!("static constexpr int QHEADS = {gqa};"),
            ] {
                assert!(k.source.contains(&constant), "{text} gqa {gqa}: {constant}");
            }
            // Each kernel finds its first query head through the early start, and writes only
            // the heads it does not share with the row before: the headers' kernels do so where
            // the unit says UNEVEN_GROUPS.
            assert!(k
                .source
                .contains("static constexpr bool UNEVEN_GROUPS = true;"));
        }
        // Equal groups keep the plain head rows.
        let (_, _, even) = render(text, 32);
        assert!(even
            .source
            .contains("static constexpr bool UNEVEN_GROUPS = false;"));
        assert!(!even.source.contains("kvq_head_row(seq, kvh, kv_heads);"));
    }
}

#[test]
fn layouts_without_tensor_core_kernels_keep_the_generic_kernel_at_any_gqa() {
    let tensor_cores = tensor_core_schemes();
    let generic: Vec<_> = SCHEMES
        .iter()
        .copied()
        .filter(|text| !tensor_cores.contains(text))
        .collect();
    assert!(!generic.is_empty());
    for text in generic {
        for gqa in [11, 16] {
            let (spec, shape, k) = render(text, gqa);
            assert!(!is_tensor_core_kernel(&k.source), "{text} gqa {gqa}");
            assert_eq!((k.head_groups, k.group_heads), (1, gqa));
            assert_eq!(decode_head_groups(&spec, &shape), 1);
            assert_eq!(k.decode.grid[1], "kv_heads");
        }
    }
}

#[test]
fn stored_scores_take_the_same_floats_in_groups() {
    let text = "k = int(1, channel), v = int(1, channel), local = 128, calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)";
    let (_, _, grouped) = render(text, 16);
    assert!(grouped.stores_scores);
    // A row of the group's 8 scores a token for each of the two rows of a KV head.
    assert_eq!(
        grouped.score_floats(2, 3, 5),
        2 * 3 * 5 * 128 * 16 + 4,
        "the buffer holds every query head's score of every key"
    );
    // Uneven groups: every row's columns, the shared heads' scores twice.
    let (_, _, uneven) = render(text, 11);
    assert!(uneven.stores_scores);
    assert_eq!(uneven.score_columns(), 12);
    assert_eq!(uneven.score_floats(2, 3, 5), 2 * 3 * 5 * 128 * 12 + 4);
}

#[test]
fn past_the_generic_kernels_sixty_four_heads_only_the_tensor_cores_serve() {
    let shape_at = |d, gqa| KernelShape::new(d, gqa, Dtype::F16);
    let render_at = |text: &str, shape: &KernelShape| {
        let spec = SchemeSpec::parse(text).unwrap();
        decode_kernels(&spec, shape, &TuneParams::default_for(&spec, shape))
    };
    for text in tensor_core_schemes() {
        // Falcon 7B: 71 query heads over one KV head at head_dim 64; and the most taken, 128.
        for (d, gqa) in [(64, 71), (128, MAX_GQA)] {
            let k = render_at(text, &shape_at(d, gqa)).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(is_tensor_core_kernel(&k.source), "{text} gqa {gqa}");
            let HeadGroups { groups, heads, .. } = expected_groups_at(text, d, gqa);
            assert_eq!(
                (k.head_groups, k.group_heads),
                (groups, heads),
                "{text} gqa {gqa}"
            );
        }
        let past = render_at(text, &shape_at(128, MAX_GQA + 1)).unwrap_err();
        assert!(
            matches!(&past, CodegenError::Shape(m) if m.contains("expected 1..=128")),
            "{past}"
        );
    }
    // A layout only the generic kernel serves stops at its 64 heads, with the reason.
    let generic = SCHEMES
        .iter()
        .copied()
        .find(|text| !is_tensor_core_kernel(&render(text, 8).2.source))
        .unwrap();
    assert!(render_at(generic, &shape_at(128, GENERIC_MAX_GQA)).is_ok());
    let err = render_at(generic, &shape_at(128, GENERIC_MAX_GQA + 1)).unwrap_err();
    let CodegenError::Shape(message) = &err else {
        panic!("{err:?}")
    };
    assert!(
        message.contains("gqa = 65: the generic kernel")
            && message.contains("at most 64 query heads"),
        "{message}"
    );
}

#[test]
fn fp16_takes_up_to_sixteen_heads_a_cta_in_two_head_tiles_and_thirty_two_at_head_dim_64() {
    let fp16 = "k = fp16, v = fp16";
    let tiles = |source: &str| {
        [
            "static constexpr int HT = 1;",
            "static constexpr int HT = 2;",
        ]
        .iter()
        .position(|line| source.contains(line))
        .map(|i| i + 1)
    };
    for (gqa, groups, heads) in [
        (11, 1, 11),
        (16, 1, 16),
        (24, 2, 12),
        (29, 2, 15),
        (32, 2, 16),
    ] {
        let (_, _, k) = render(fp16, gqa);
        assert_eq!((k.head_groups, k.group_heads), (groups, heads), "gqa {gqa}");
        assert_eq!(tiles(&k.source), Some(2), "gqa {gqa}");
        assert!(k
            .source
            .contains(&format!("static constexpr int GQA = {heads};")));
    }
    // Up to 8 heads, and for every quantized scheme, one tile; at head_dim 256 FP16 too.
    assert_eq!(tiles(&render(fp16, 8).2.source), Some(1));
    for text in tensor_core_schemes().into_iter().filter(|t| *t != fp16) {
        let (_, _, k) = render(text, 16);
        assert_eq!(tiles(&k.source), Some(1), "{text}");
        assert_eq!((k.head_groups, k.group_heads), (2, 8), "{text}");
    }
    let spec = SchemeSpec::parse(fp16).unwrap();
    let at = |d, gqa| {
        let shape = KernelShape::new(d, gqa, Dtype::F16);
        decode_kernels(&spec, &shape, &TuneParams::default_for(&spec, &shape)).unwrap()
    };
    let k = at(256, 16);
    assert_eq!((k.head_groups, tiles(&k.source)), (2, Some(1)));
    // At head_dim 64 up to four tiles, as many as a row's heads fill: Falcon 180B's 29 heads a
    // KV head in one row, Falcon 7B's 71 over one KV head in three rows of 24.
    let holds =
        |source: &str, tiles: u32| source.contains(&format!("static constexpr int HT = {tiles};"));
    let k = at(64, 29);
    assert_eq!((k.head_groups, k.group_heads), (1, 29));
    assert!(holds(&k.source, 4));
    let k = at(64, 71);
    assert_eq!((k.head_groups, k.group_heads), (3, 24));
    assert!(holds(&k.source, 3));
    let k = at(64, 16);
    assert_eq!((k.head_groups, k.group_heads), (1, 16));
    assert!(holds(&k.source, 2));
    // The merge leaves both tiles' accumulators in shared memory: twice one tile's bytes.
    let (_, _, one) = render(fp16, 8);
    let (_, _, two) = render(fp16, 16);
    assert_eq!(
        two.decode.dynamic_shared_bytes,
        2 * one.decode.dynamic_shared_bytes
    );
}
