//! Snapshots of rendered kernel source: a template change shows up as a reviewed diff.
//! Regenerate with `INSTA_UPDATE=always cargo test -p kvq-codegen --test snapshots` and review.

use kvq_codegen::{decode_kernels, CodegenError, Dtype, KernelShape, TuneParams};
use kvq_spec::SchemeSpec;

fn render(text: &str, head_dim: u32, gqa: u32, dtype: Dtype) -> String {
    let spec = SchemeSpec::parse(text).unwrap();
    let shape = KernelShape::new(head_dim, gqa, dtype);
    decode_kernels(&spec, &shape, &TuneParams::default_for(&spec, &shape))
        .unwrap()
        .source
}

#[test]
fn kivi2_d128_gqa4_f16() {
    insta::assert_snapshot!(render(
        "k = int(2, channel), v = int(2, token), local = 128",
        128,
        4,
        Dtype::F16
    ));
}

#[test]
fn kitty_d128_gqa8_bf16() {
    insta::assert_snapshot!(render(
        "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 128), sink = 32",
        128,
        8,
        Dtype::Bf16
    ));
}

#[test]
fn calibquant1_d64_gqa1_f16() {
    insta::assert_snapshot!(render(
        "k = int(1, channel), v = int(1, channel), local = 128, calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)",
        64,
        1,
        Dtype::F16
    ));
}

#[test]
fn fp16_d256_gqa4_f16() {
    insta::assert_snapshot!(render("k = fp16, v = fp16", 256, 4, Dtype::F16));
}

/// Falcon 7B's 71 query heads over one KV head at head_dim 64: FP16 in three head tiles a warp,
/// three rows of 24 heads, the last starting one head early.
#[test]
fn fp16_d64_gqa71_f16() {
    insta::assert_snapshot!(render("k = fp16, v = fp16", 64, 71, Dtype::F16));
}

#[test]
fn the_kernel_header_names_scheme_shape_and_tuning() {
    let src = render(
        "k = int(8, channel, symmetric), v = int(8, channel, symmetric)",
        128,
        4,
        Dtype::F16,
    );
    let head: Vec<&str> = src.lines().take(4).collect();
    assert!(
        head[1].contains("k = int(bits = 8, axis = channel, symmetric)"),
        "{head:?}"
    );
    assert!(
        head[2].contains("head_dim=128 gqa=4 dtype=f16 page=128"),
        "{head:?}"
    );
    // 8-bit codes default to 32-token tiles: only those let the cp.async ring fit.
    assert!(head[3].contains("threads=128 tile_tokens=32"), "{head:?}");
}

#[test]
fn schemes_without_a_gpu_kernel_and_bad_shapes_are_typed_errors() {
    let shape = KernelShape::new(128, 4, Dtype::F16);
    let tune = TuneParams {
        threads: 128,
        tile_tokens: 64,
        min_warps_per_sm: 0,
        pack_heads: true,
        short_staging: false,
        store_scores: false,
    };
    let xquant =
        SchemeSpec::parse("k = int(2, channel), v = int(2, token), source = x(latent)").unwrap();
    assert!(matches!(
        decode_kernels(&xquant, &shape, &tune),
        Err(CodegenError::Unsupported { .. })
    ));
    let commvq = SchemeSpec::parse("k = fp16, v = codebook(additive, rows = 256)").unwrap();
    assert!(matches!(
        decode_kernels(&commvq, &shape, &tune),
        Err(CodegenError::Unsupported { .. })
    ));
    let kivi = SchemeSpec::parse("k = int(2, channel), v = int(2, token)").unwrap();
    let bad_dim = KernelShape::new(100, 4, Dtype::F16);
    assert!(matches!(
        decode_kernels(&kivi, &bad_dim, &tune),
        Err(CodegenError::SchemeShape(_))
    ));
    let bad_tune = TuneParams {
        threads: 96,
        ..tune
    };
    assert!(matches!(
        decode_kernels(&kivi, &shape, &bad_tune),
        Err(CodegenError::Shape(_))
    ));
    let bad_occupancy = TuneParams {
        min_warps_per_sm: 20,
        ..tune
    };
    assert!(matches!(
        decode_kernels(&kivi, &shape, &bad_occupancy),
        Err(CodegenError::Shape(e)) if e.contains("min_warps_per_sm = 20")
    ));
    let no_gqa = KernelShape::new(128, 0, Dtype::F16);
    assert!(matches!(
        decode_kernels(&kivi, &no_gqa, &tune),
        Err(CodegenError::Shape(_))
    ));
}

#[test]
fn kitty_cache_kernels_d128_f16() {
    let spec = SchemeSpec::parse(
        "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 128), sink = 32",
    )
    .unwrap();
    insta::assert_snapshot!(
        kvq_codegen::cache_kernels(&spec, 128, Dtype::F16)
            .unwrap()
            .source
    );
}
