//! The cache kernels of every GPU built-in compile with real NVRTC to CUBIN for sm_90a at the
//! head_dims whose rows are not whole 32-channel units (80 and 112: idle lanes past a row's
//! chunks in the register forms, per-element paths in the naive and tiled ones), f16 and bf16:
//! the default page quantizer forms at both, every form at 80 in f16. Needs no GPU: CI installs
//! libnvrtc from pip and sets `KVQ_REQUIRE_NVRTC=1`, so this fails there rather than skips.
//! `gpu_paged` checks on a GPU that these kernels write the reference's bytes.

use kvq::codegen::{cache_kernels, cache_kernels_with, has_decode_kernel, Dtype, QuantizerForm};
use kvq::runtime::nvrtc::{self, CompileOptions, Output, Source};
use kvq::runtime::paged::forms_or_tiled;
use kvq::runtime::testing::require_nvrtc;
use kvq::runtime::Arch;
use kvq::schemes::BUILTIN;

#[test]
fn builtin_cache_kernels_compile_at_head_dims_80_and_112() {
    let Some(version) = require_nvrtc("builtin_cache_kernels_compile_at_head_dims_80_and_112")
    else {
        return;
    };
    let mut jobs = Vec::new();
    for b in BUILTIN.iter().filter(|b| has_decode_kernel(&b.spec)) {
        for head_dim in [80, 112] {
            for dtype in [Dtype::F16, Dtype::Bf16] {
                let k = cache_kernels(&b.spec, head_dim, dtype)
                    .unwrap_or_else(|e| panic!("{} d{head_dim} {dtype}: {e}", b.name));
                jobs.push((
                    b.name,
                    format!("d{head_dim} {dtype} {}", k.quantizer_forms),
                    k.source,
                ));
            }
        }
        let default = forms_or_tiled(&b.spec, 80, QuantizerForm::Vectorized);
        let mut seen = vec![default];
        for form in QuantizerForm::ALL {
            let forms = forms_or_tiled(&b.spec, 80, form);
            if !seen.contains(&forms) {
                seen.push(forms);
                let k = cache_kernels_with(&b.spec, 80, Dtype::F16, forms)
                    .unwrap_or_else(|e| panic!("{} d80 {forms}: {e}", b.name));
                jobs.push((b.name, format!("d80 f16 {forms}"), k.source));
            }
        }
    }
    assert!(jobs.len() >= 8 * 4, "{} jobs", jobs.len());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let chunk = jobs.len().div_ceil(threads);
    std::thread::scope(|s| {
        for part in jobs.chunks(chunk) {
            s.spawn(move || {
                for (name, what, source) in part {
                    let src = kvq::codegen::kernel_headers().iter().fold(
                        Source::new(format!("{name}.cu"), source.clone()),
                        |s, (header, text)| s.with_header(*header, *text),
                    );
                    nvrtc::compile(
                        &src,
                        Arch::SM_90A,
                        Output::Cubin,
                        &CompileOptions::default(),
                    )
                    .unwrap_or_else(|e| panic!("{name} {what} sm_90a: {e}"));
                }
            });
        }
    });
    println!(
        "compiled {} cache modules at head_dim 80 and 112 for sm_90a with NVRTC {version:?}",
        jobs.len()
    );
}
