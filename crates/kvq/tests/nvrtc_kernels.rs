//! Every built-in integer/FP16 scheme's decode kernels compile with real NVRTC to CUBIN for sm_80
//! and sm_90a, at every supported head_dim, both dtypes and GQA 1/4/8. Needs no GPU: CI installs
//! libnvrtc from pip and sets `KVQ_REQUIRE_NVRTC=1`, so this fails there rather than skip.

use kvq::codegen::{decode_kernels, CodegenError, Dtype, KernelShape, TuneParams};
use kvq::runtime::nvrtc::{self, CompileOptions, Output, Source};
use kvq::runtime::testing::require_nvrtc;
use kvq::runtime::Arch;
use kvq::schemes::BUILTIN;
use kvq::{CacheSource, TensorQuant};

#[test]
fn every_builtin_decode_kernel_compiles_for_sm80_and_sm90a() {
    let Some(version) = require_nvrtc("every_builtin_decode_kernel_compiles_for_sm80_and_sm90a")
    else {
        return;
    };
    let mut jobs = Vec::new();
    for b in BUILTIN {
        let gpu_scheme = b.spec.source == CacheSource::Kv
            && ![b.spec.k, b.spec.v]
                .iter()
                .any(|t| matches!(t, TensorQuant::Codebook(_)));
        for head_dim in [64, 96, 128, 256] {
            for dtype in [Dtype::F16, Dtype::Bf16] {
                for gqa in [1, 4, 8] {
                    let shape = KernelShape::new(head_dim, gqa, dtype);
                    match decode_kernels(&b.spec, &shape, &TuneParams::default_for(&shape)) {
                        Ok(k) => {
                            assert!(gpu_scheme, "{} should have no decode kernel yet", b.name);
                            jobs.push((b.name, shape, k.source));
                        }
                        // Codebook and XQuant schemes run in the CPU reference only (for now), and
                        // say so with a typed error.
                        Err(CodegenError::Unsupported { .. }) if !gpu_scheme => {}
                        Err(e) => panic!("{} {shape:?}: {e}", b.name),
                    }
                }
            }
        }
    }
    assert_eq!(
        jobs.len(),
        8 * 4 * 2 * 3,
        "every integer/FP16 built-in renders"
    );
    // Every block shape the tuner may pick, for schemes whose staging ring changes with it (tile
    // and warps size the cp.async stages; INT8 stages only at 32- and 16-token tiles).
    for b in BUILTIN
        .iter()
        .filter(|b| ["kivi2", "kitty", "int8"].contains(&b.name))
    {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        for tune in TuneParams::candidates().filter(|t| *t != TuneParams::default_for(&shape)) {
            let k = decode_kernels(&b.spec, &shape, &tune)
                .unwrap_or_else(|e| panic!("{} {tune:?}: {e}", b.name));
            jobs.push((b.name, shape, k.source));
        }
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let chunk = jobs.len().div_ceil(threads);
    std::thread::scope(|s| {
        for part in jobs.chunks(chunk) {
            s.spawn(move || {
                for (name, shape, source) in part {
                    for arch in [Arch::SM_80, Arch::SM_90A] {
                        let src = Source::new(format!("{name}.cu"), source.clone());
                        nvrtc::compile(&src, arch, Output::Cubin, &CompileOptions::default())
                            .unwrap_or_else(|e| panic!("{name} {shape:?} {arch}: {e}"));
                    }
                }
            });
        }
    });
    println!(
        "compiled {} decode modules × 2 architectures with NVRTC {version:?}",
        jobs.len()
    );
}
