//! The rendered cache unit stays thin: scheme traits, layout constants, `#include`s and entry
//! points, whatever the scheme, head_dim, dtype or quantizer form. The algorithm is in the
//! kernel headers ([`kvq_codegen::KERNEL_HEADERS`]).

use kvq_codegen::{cache_kernels_with, Dtype, QuantizerForm, QuantizerForms, KERNEL_HEADERS};
use kvq_spec::SchemeSpec;

mod common;
use common::SCHEMES;

/// The most lines a rendered unit of any scheme may have.
const MOST_LINES: usize = 150;

fn forms_of(spec: &SchemeSpec, head_dim: u32) -> Vec<QuantizerForms> {
    let mut all: Vec<QuantizerForms> = QuantizerForm::ALL
        .into_iter()
        .map(|f| {
            let pick = |t| {
                if f.supports(t, head_dim, spec.page) {
                    f
                } else {
                    QuantizerForm::Tiled
                }
            };
            QuantizerForms {
                k: pick(&spec.k),
                v: pick(&spec.v),
            }
        })
        .collect();
    all.dedup();
    all
}

#[test]
fn every_cache_unit_is_thin_and_includes_only_kernel_headers() {
    let mut largest = 0;
    for text in SCHEMES {
        let spec = SchemeSpec::parse(text).unwrap();
        for head_dim in [64, 80, 96, 112, 128, 256] {
            if spec.check_shape(head_dim, 1).is_err() {
                continue; // a token group that does not divide the row
            }
            for dtype in [Dtype::F16, Dtype::Bf16] {
                for forms in forms_of(&spec, head_dim) {
                    let k = cache_kernels_with(&spec, head_dim, dtype, forms)
                        .unwrap_or_else(|e| panic!("{text} d{head_dim} {forms}: {e}"));
                    let lines: Vec<&str> = k.source.lines().collect();
                    largest = largest.max(lines.len());
                    assert!(
                        lines.len() <= MOST_LINES,
                        "{text} d{head_dim} {dtype} {forms}: {} lines",
                        lines.len()
                    );
                    for tera in ["{{", "{%", "{#"] {
                        assert!(!k.source.contains(tera), "{text}: `{tera}` left over");
                    }
                    // Only the three identifying lines are comments: no prose in the unit.
                    let comments = lines
                        .iter()
                        .filter(|l| l.trim_start().starts_with("//"))
                        .count();
                    assert_eq!(comments, 3, "{text} d{head_dim} {forms}");
                    let includes: Vec<&str> = lines
                        .iter()
                        .filter_map(|l| l.strip_prefix("#include \""))
                        .map(|rest| rest.trim_end_matches('"'))
                        .collect();
                    assert_eq!(includes, ["kvq/common.cuh", "kvq/cache.cuh"], "{text}");
                    for name in includes {
                        assert!(KERNEL_HEADERS.iter().any(|(n, _)| *n == name), "{name}");
                    }
                    // An entry point per kernel the metadata names, and only those.
                    let mut names = vec![&k.append.name, &k.commit.name, &k.prefill_copy.name];
                    for q in [&k.k_quantizers, &k.v_quantizers].into_iter().flatten() {
                        names.extend([&q.from_input.name, &q.from_ring.name]);
                    }
                    let entries = k.source.matches("extern \"C\" __global__").count();
                    assert_eq!(entries, names.len(), "{text}");
                    for name in names {
                        assert!(k.source.contains(&format!(" {name}(")), "{name}");
                    }
                }
            }
        }
    }
    assert!(largest > 50, "{largest}");
}
