//! NVRTC compiles without a GPU. Runs under its own harness: where libnvrtc cannot be loaded, each
//! test shows as ignored, with the reason, and fails instead under `KVQ_REQUIRE_NVRTC=1` (CI).

use kvq_runtime::nvrtc::{self, CompileOptions, IncludeDirs, Output, Source};
use kvq_runtime::testing::harness::{checked, needs, run};
use kvq_runtime::testing::{Need, Skip, KVQ_REQUIRE_NVRTC};
use kvq_runtime::{Arch, JitError};

fn main() {
    let nvrtc = |name: &str, test: fn()| needs(Need::Nvrtc, name, test);
    run(vec![
        nvrtc(
            "compiles_header_free_kernel_to_ptx_and_cubin",
            compiles_header_free_kernel_to_ptx_and_cubin,
        ),
        nvrtc(
            "the_timers_spin_kernel_compiles",
            the_timers_spin_kernel_compiles,
        ),
        nvrtc(
            "fast_math_and_line_info_reach_nvrtc",
            fast_math_and_line_info_reach_nvrtc,
        ),
        nvrtc(
            "broken_kernel_error_quotes_the_numbered_source_line",
            broken_kernel_error_quotes_the_numbered_source_line,
        ),
        nvrtc(
            "errors_in_in_memory_headers_are_quoted_from_the_header",
            errors_in_in_memory_headers_are_quoted_from_the_header,
        ),
        nvrtc(
            "missing_cuda_header_names_the_searched_folders",
            missing_cuda_header_names_the_searched_folders,
        ),
        checked(
            "cuda_headers_from_the_environment_compile",
            cuda_headers_from_the_environment_compile,
        ),
        nvrtc(
            "unsupported_architecture_is_a_typed_error",
            unsupported_architecture_is_a_typed_error,
        ),
        checked(
            "without_nvrtc_compile_is_a_typed_error",
            without_nvrtc_compile_is_a_typed_error,
        ),
    ])
}

const AXPY: &str = r#"// header-free: no #include at all
extern "C" __global__ void axpy(float a, const float* __restrict__ x, float* __restrict__ y,
                                unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

const BROKEN: &str = r#"extern "C" __global__ void broken(float* out) {
    unsigned i = threadIdx.x;
    float scale = 2.0f;
    out[i] = undefined_value * scale;
    out[i + 1] = 0.0f;
}
"#;

fn header_free_options() -> CompileOptions {
    CompileOptions::default().include_dirs(IncludeDirs::None)
}

fn compiles_header_free_kernel_to_ptx_and_cubin() {
    let version = nvrtc::version().unwrap();
    assert!(version.major >= 12, "NVRTC {version}");
    let source = Source::new("axpy.cu", AXPY);
    for arch in [Arch::SM_80, Arch::SM_90A] {
        let ptx = nvrtc::compile(&source, arch, Output::Ptx, &header_free_options()).unwrap();
        let text = ptx.ptx().expect("PTX is text");
        assert!(text.contains(".visible .entry axpy("), "{text}");
        assert!(text.contains(&format!(".target {arch}")), "{arch}: {text}");
        assert!(!ptx.image.contains(&0), "PTX without the terminating NUL");
        assert_eq!(ptx.load_image().last(), Some(&0));

        let cubin = nvrtc::compile(&source, arch, Output::Cubin, &header_free_options()).unwrap();
        assert_eq!(
            &cubin.image[..4],
            b"\x7fELF",
            "{arch}: CUBIN is an ELF image"
        );
        assert!(cubin
            .options
            .contains(&format!("--gpu-architecture={arch}")));
        assert_eq!(cubin.arch, arch);
        assert_eq!(cubin.nvrtc, version);
        assert!(cubin.ptx().is_none());
    }
}

fn the_timers_spin_kernel_compiles() {
    let source = kvq_runtime::timing::spin_source();
    for arch in [Arch::SM_80, Arch::SM_90A] {
        let cubin = nvrtc::compile(&source, arch, Output::Cubin, &header_free_options()).unwrap();
        assert!(!cubin.image.is_empty(), "{arch}");
    }
}

fn fast_math_and_line_info_reach_nvrtc() {
    let source = Source::new(
        "div.cu",
        r#"extern "C" __global__ void div(float* y, const float* x) { y[threadIdx.x] = 1.0f / x[threadIdx.x]; }"#,
    );
    let precise =
        nvrtc::compile(&source, Arch::SM_80, Output::Ptx, &header_free_options()).unwrap();
    let fast = nvrtc::compile(
        &source,
        Arch::SM_80,
        Output::Ptx,
        &header_free_options().fast_math(true).line_info(true),
    )
    .unwrap();
    let (p, f) = (precise.ptx().unwrap(), fast.ptx().unwrap());
    assert!(p.contains("div.rn.f32") || p.contains("rcp.rn.f32"), "{p}");
    assert!(
        f.contains("approx"),
        "fast math uses approximate division: {f}"
    );
    assert!(f.contains(".loc"), "line info present");
}

fn broken_kernel_error_quotes_the_numbered_source_line() {
    let source = Source::new("broken.cu", BROKEN);
    let err =
        nvrtc::compile(&source, Arch::SM_90A, Output::Cubin, &header_free_options()).unwrap_err();
    let JitError::Compile(failure) = &err else {
        panic!("expected a compile error, got {err:?}");
    };
    assert_eq!(failure.code, "NVRTC_ERROR_COMPILATION");
    assert_eq!(failure.source_name, "broken.cu");
    assert_eq!(failure.arch, Arch::SM_90A);
    let errors: Vec<_> = failure
        .diagnostics
        .iter()
        .filter(|d| d.is_error())
        .collect();
    assert_eq!(errors.len(), 1, "{}", failure.log);
    assert_eq!((errors[0].file.as_str(), errors[0].line), ("broken.cu", 4));
    assert!(errors[0].message.contains("undefined_value"));

    let message = err.to_string();
    eprintln!("--- compile error as a user sees it ---\n{message}\n---");
    assert!(
        message.contains("could not compile `broken.cu` for sm_90a"),
        "{message}"
    );
    assert!(message.contains("broken.cu(4): error"), "{message}");
    assert!(
        message.contains("  > 4 |     out[i] = undefined_value * scale;"),
        "{message}"
    );
    assert!(
        message.contains("    3 |     float scale = 2.0f;"),
        "{message}"
    );
    assert!(
        message.contains("    5 |     out[i + 1] = 0.0f;"),
        "{message}"
    );
    assert!(
        message.contains("options: --std=c++17 --gpu-architecture=sm_90a"),
        "{message}"
    );
}

fn errors_in_in_memory_headers_are_quoted_from_the_header() {
    let source = Source::new(
        "main.cu",
        "#include \"helpers.cuh\"\nextern \"C\" __global__ void k(float* o) { o[0] = twice(1.0f); }\n",
    )
    .with_header(
        "helpers.cuh",
        "#pragma once\n__device__ float twice(float x) {\n  return x * two;\n}\n",
    );
    let err =
        nvrtc::compile(&source, Arch::SM_80, Output::Ptx, &header_free_options()).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, JitError::Compile(_)), "{message}");
    assert!(message.contains("helpers.cuh(3): error"), "{message}");
    assert!(message.contains("  > 3 |   return x * two;"), "{message}");

    // The same header, fixed, compiles: in-memory headers need no include folder.
    let fixed = Source::new("main.cu", source.code.clone()).with_header(
        "helpers.cuh",
        "#pragma once\n__device__ float twice(float x) { return x * 2.0f; }\n",
    );
    nvrtc::compile(&fixed, Arch::SM_80, Output::Ptx, &header_free_options()).unwrap();
}

fn missing_cuda_header_names_the_searched_folders() {
    let source = Source::new(
        "needs_fp16.cu",
        "#include <cuda_fp16.h>\nextern \"C\" __global__ void k(__half* o) { o[0] = __float2half(1.0f); }\n",
    );
    let options = CompileOptions::default().include_dirs(IncludeDirs::Only(vec![
        "/nonexistent/kvq-test/include".into(),
    ]));
    let err = nvrtc::compile(&source, Arch::SM_80, Output::Ptx, &options).unwrap_err();
    let message = err.to_string();
    eprintln!("--- missing header as a user sees it ---\n{message}\n---");
    let JitError::MissingHeader(missing) = &err else {
        panic!("expected MissingHeader, got {message}");
    };
    assert_eq!(missing.header, "cuda_fp16.h");
    assert_eq!(
        missing.included_from,
        Some(("needs_fp16.cu".to_string(), 1))
    );
    assert!(
        message.contains("/nonexistent/kvq-test/include (does not exist)"),
        "{message}"
    );
    assert!(message.contains("KVQ_CUDA_INCLUDE"), "{message}");
    assert!(err.is_environment());
}

fn cuda_headers_from_the_environment_compile() -> Result<(), Skip> {
    if let Some(skip) = Need::Nvrtc.missing() {
        return Err(skip);
    }
    let search = kvq_runtime::include::IncludeSearch::from_env();
    if search.dirs.is_empty() {
        let reason = format!(
            "no CUDA include folder (searched: {})",
            search
                .candidates
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        );
        // `.ci/cuda-env.sh` installs the headers with NVRTC: CI requires both.
        return Err(Skip::unless(&[KVQ_REQUIRE_NVRTC], reason));
    }
    let source = Source::new(
        "fp16.cu",
        "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n\
         extern \"C\" __global__ void k(__half* o, __nv_bfloat16* b) {\n\
           o[threadIdx.x] = __hadd(__float2half(1.0f), __float2half(2.0f));\n\
           b[threadIdx.x] = __float2bfloat16(3.0f);\n}\n",
    );
    for arch in [Arch::SM_80, Arch::SM_90A] {
        let cubin = nvrtc::compile(&source, arch, Output::Cubin, &CompileOptions::default())
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(&cubin.image[..4], b"\x7fELF");
    }
    Ok(())
}

fn unsupported_architecture_is_a_typed_error() {
    let supported = nvrtc::supported_archs().unwrap();
    assert!(
        supported.contains(&80) && supported.contains(&90),
        "{supported:?}"
    );
    let err = nvrtc::compile(
        &Source::new("axpy.cu", AXPY),
        "sm_35".parse().unwrap(),
        Output::Ptx,
        &header_free_options(),
    )
    .unwrap_err();
    assert!(matches!(err, JitError::UnsupportedArch { .. }), "{err}");
    assert!(
        err.to_string().contains("cannot compile for sm_35"),
        "{err}"
    );
}

/// Where NVRTC loads, tests/missing_libraries.rs checks this in a child process without it.
fn without_nvrtc_compile_is_a_typed_error() -> Result<(), Skip> {
    if nvrtc::is_available() {
        return Err(Skip::because(
            "NVRTC loads here; missing_libraries.rs checks this in a child process without it",
        ));
    }
    let err = nvrtc::compile(
        &Source::new("axpy.cu", AXPY),
        Arch::SM_80,
        Output::Ptx,
        &header_free_options(),
    )
    .unwrap_err();
    assert!(matches!(err, JitError::NvrtcNotFound { .. }), "{err}");
    assert!(err.to_string().contains("libnvrtc.so.13"), "{err}");
    assert!(err.is_environment());
    Ok(())
}
