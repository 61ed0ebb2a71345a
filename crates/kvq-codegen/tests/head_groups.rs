//! More than 8 query heads a KV head: the tensor-core kernel takes them in head groups, one grid
//! row a group (`HeadGroups`), equal where the heads allow and with the last group starting early
//! where they do not; layouts the tensor cores do not serve keep the generic kernel.

use kvq_codegen::{
    decode_groups, decode_head_groups, decode_kernels, CodegenError, DecodeKernels, Dtype,
    HeadGroups, KernelShape, TuneParams, GENERIC_MAX_GQA, MAX_GQA,
};
use kvq_spec::SchemeSpec;

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
        for (gqa, groups, heads) in [(12, 2, 6), (16, 2, 8), (32, 4, 8)] {
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
            let rows = format!("kv_heads * {groups}");
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
        let (_, _, grouped) = render(text, 16);
        let (_, _, eight) = render(text, 8);
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
                .filter(|l| !l.starts_with("// shape:") && !l.contains("HEAD_GROUPS = "))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(normalise(&grouped), normalise(&eight), "{text}");
        // ... and every address into the cache's pools, sink and tail goes through the group's KV head.
        let cache_reads: Vec<&str> = grouped
            .source
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
        for line in grouped
            .source
            .lines()
            .filter(|l| l.contains("head_block ="))
        {
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
        for (gqa, groups, heads) in [(9, 2, 5), (11, 2, 6), (13, 2, 7), (29, 4, 8)] {
            let (spec, shape, k) = render(text, gqa);
            assert!(is_tensor_core_kernel(&k.source), "{text} gqa {gqa}");
            assert_eq!((k.head_groups, k.group_heads), (groups, heads));
            assert_eq!(decode_head_groups(&spec, &shape), groups);
            assert_eq!(
                decode_groups(&spec, &shape),
                HeadGroups::for_gqa(gqa).unwrap()
            );
            assert_eq!(k.decode.grid[1], format!("kv_heads * {groups}"));
            for constant in [
                format!("static constexpr int GQA = {heads};"),
                format!("static constexpr int HEAD_GROUPS = {groups};"),
                format!("static constexpr int QHEADS = {gqa};"),
            ] {
                assert!(k.source.contains(&constant), "{text} gqa {gqa}: {constant}");
            }
            // Each kernel finds its first query head through the early start, and writes only
            // the heads it does not share with the row before.
            let kernels = 1 + usize::from(k.range.is_some());
            assert_eq!(
                k.source
                    .matches("const long head_row = kvq_head_row(seq, kvh, kv_heads);")
                    .count(),
                kernels,
                "{text} gqa {gqa}"
            );
            assert!(k.source.contains("if (h >= kvq_heads_shared(kvh))"));
            assert!(k
                .source
                .contains("for (int e = kvq_heads_shared(kvh) * D + threadIdx.x;"));
        }
        // Equal groups keep the plain head rows.
        let (_, _, even) = render(text, 16);
        assert!(!even.source.contains("kvq_head_row") && !even.source.contains("QHEADS"));
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
        for (d, gqa, groups) in [(64, 71, 9), (128, MAX_GQA, 16)] {
            let k = render_at(text, &shape_at(d, gqa)).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(is_tensor_core_kernel(&k.source), "{text} gqa {gqa}");
            assert_eq!(
                (k.head_groups, k.group_heads),
                (groups, 8),
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
