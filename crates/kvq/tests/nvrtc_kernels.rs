//! Every built-in integer/FP16 scheme's decode kernels and cache kernels compile with real NVRTC
//! to CUBIN for sm_90a, and for sm_80 at GQA 4 of each (scheme, head_dim): decode at head_dim 64,
//! 128 and 256 with GQA 1/4/16 (16 in two head groups of 8) in f16 and 4 in bf16, and at head_dim
//! 128 also GQA 12 (head groups of 6), 11 (two of 6, the second starting a head early) and 29
//! (four of 8, the last starting three heads early), and at head_dim 64 GQA 71 (Falcon 7B's
//! multi-query attention: nine rows of 8, past the generic kernel's 64); decode at 80, 96, 112,
//! 160 and 192 (rows read as several slabs); the tuner's other block shapes and occupancies
//! (sm_90a); cache kernels in every page quantizer form at 128 and 80, and the default forms at
//! 64, 96, 112 and 256 (sm_80 at 128, and at 80 and 112 in f16); the merge of attention states at
//! four head sizes. Decode also for calibrated schemes whose range pass keeps the f16 path, and
//! for the uncalibrated layouts `gpu_decode` adds, which no built-in takes. The only path that
//! differs between the two architectures is the overlapped launch (`griddepcontrol`, sm_90 on),
//! compiled away for sm_80. Needs no GPU: CI installs libnvrtc from pip and sets
//! `KVQ_REQUIRE_NVRTC=1`, so these fail there rather than skip. Runs under its own harness:
//! without NVRTC each test shows as ignored, with the reason.

mod common;
use common::{needs, other_calibrated_schemes, other_uncalibrated_schemes, run_trials};
use kvq::codegen::{
    cache_kernels_with, codebook_encode_kernels, codebook_kernels, decode_kernels,
    has_decode_kernel, merge_kernel, xquant_kernels, CodegenError, Dtype, KernelShape,
    QuantizerForm, RebuildMma, RebuildPrecision, TuneParams,
};
use kvq::runtime::nvrtc::{self, CompileOptions, Output, Source};
use kvq::runtime::paged::forms_or_tiled;
use kvq::runtime::testing::Need;
use kvq::runtime::Arch;
use kvq::schemes::BUILTIN;

fn main() {
    run_trials(vec![
        needs(
            Need::Nvrtc,
            "every_builtin_decode_kernel_compiles_for_sm80_and_sm90a",
            every_builtin_decode_kernel_compiles_for_sm80_and_sm90a,
        ),
        needs(
            Need::Nvrtc,
            "every_builtin_cache_kernel_compiles_in_every_quantizer_form",
            every_builtin_cache_kernel_compiles_in_every_quantizer_form,
        ),
        needs(
            Need::Nvrtc,
            "the_merge_kernel_compiles_for_sm80_and_sm90a",
            the_merge_kernel_compiles_for_sm80_and_sm90a,
        ),
        needs(
            Need::Nvrtc,
            "codebook_decode_kernels_compile_for_sm80_and_sm90a",
            codebook_decode_kernels_compile_for_sm80_and_sm90a,
        ),
        needs(
            Need::Nvrtc,
            "codebook_encode_kernels_compile_for_sm80_and_sm90a",
            codebook_encode_kernels_compile_for_sm80_and_sm90a,
        ),
        needs(
            Need::Nvrtc,
            "xquant_decode_kernels_compile_for_sm80_and_sm90a",
            xquant_decode_kernels_compile_for_sm80_and_sm90a,
        ),
        needs(
            Need::Nvrtc,
            "xquant_warpgroup_decodes_fit_a_cta_and_stay_asynchronous",
            xquant_warpgroup_decodes_fit_a_cta_and_stay_asynchronous,
        ),
    ])
}

/// Shared memory one CTA may take on sm_90 (227 KiB, after opting in).
const SM90_CTA_SHARED: u64 = 227 * 1024;

/// The bytes of static shared memory ptxas reports for `entry` in a `--ptxas-options=-v` log.
fn ptxas_static_shared(log: &str, entry: &str) -> Option<u64> {
    let start = format!("Compiling entry function '{entry}'");
    let mut lines = log.lines().skip_while(|l| !l.contains(&start));
    lines.find_map(|l| {
        let (before, _) = l.split_once(" bytes smem")?;
        before.rsplit(' ').next()?.parse().ok()
    })
}

/// Where the runtime picks the warpgroup rebuild on Hopper, the decode's static shared memory
/// (as ptxas counts it) and its dynamic shared memory fit one CTA: the launch would fail
/// otherwise (4-bit V rows at 1,024 latents once asked for 215 KiB of dynamic memory). And ptxas
/// keeps its warpgroup MMAs asynchronous: a register an MMA in flight owns, written or read by
/// other instructions, or too few registers for the MMAs' pipeline, makes it wait after every
/// MMA of the kernel (its "Potential Performance Loss" notes), which costs more than the
/// overlap the design is for.
fn xquant_warpgroup_decodes_fit_a_cta_and_stay_asynchronous() {
    let mut checked = 0;
    for text in ["xquant2", "xquant3", "xquant4"] {
        let spec = kvq::schemes::by_name(text).unwrap().spec;
        for (d, gqa, kv, d_model) in [
            (128, 4, 8, 4096),
            (128, 8, 8, 8192),
            (64, 8, 4, 4096),
            (64, 1, 2, 256),
        ] {
            let shape = KernelShape::new(d, gqa, Dtype::F16);
            let precision = RebuildPrecision::F16;
            if RebuildMma::best(&spec, &shape, (kv, d_model), precision, true)
                != RebuildMma::Warpgroup
            {
                continue;
            }
            let k = xquant_kernels(
                &spec,
                &shape,
                kv,
                d_model,
                (precision, RebuildMma::Warpgroup),
            )
            .unwrap_or_else(|e| panic!("{text} {shape:?}: {e}"));
            let src = kvq::codegen::kernel_headers().iter().fold(
                Source::new("xquant.cu", k.source.clone()),
                |s, (header, body)| s.with_header(*header, *body),
            );
            let mut options = CompileOptions::default();
            options.extra.push("--ptxas-options=-v".into());
            let c = nvrtc::compile(&src, Arch::SM_90A, Output::Cubin, &options)
                .unwrap_or_else(|e| panic!("{text} {shape:?}: {e}"));
            let serialised: Vec<&str> = c
                .log
                .lines()
                .filter(|l| l.contains("Potential Performance Loss"))
                .collect();
            assert!(
                serialised.is_empty(),
                "{text} {shape:?}: ptxas serialises the warpgroup MMAs:\n{}",
                serialised.join("\n")
            );
            let fixed = ptxas_static_shared(&c.log, &k.decode.name)
                .unwrap_or_else(|| panic!("no shared memory count for the decode in:\n{}", c.log));
            let total = fixed + u64::from(k.decode.dynamic_shared_bytes);
            assert!(
                total <= SM90_CTA_SHARED,
                "{text} {shape:?} kv {kv} d_model {d_model}: {fixed} static + {} dynamic bytes",
                k.decode.dynamic_shared_bytes
            );
            checked += 1;
        }
    }
    assert!(checked >= 6, "only {checked} warpgroup decodes checked");
}

/// Codebook schemes the GPU decode takes: the CommVQ built-ins and custom codebooks on either
/// side, beside FP16, with the head sizes they allow.
pub const CODEBOOK_GPU_SCHEMES: &[(&str, &[u32])] = &[
    ("commvq1", &[128, 256]),
    ("commvq2", &[128]),
    (
        "k = codebook(rope_commutative, levels = 16, residuals = 3, pairs_per_code = 32, span = head), \
         v = codebook(additive, rows = 64), sink = 16, local = 32, page = 64",
        &[64, 128],
    ),
    (
        "k = codebook(rope_commutative, levels = 32, residuals = 40, pairs_per_code = 32), v = fp16",
        &[64],
    ),
    (
        "k = fp16, v = codebook(additive, rows = 128), sink = 8",
        &[64, 128],
    ),
    (
        "k = codebook(additive, rows = 128), v = codebook(additive, rows = 96), page = 32",
        &[128],
    ),
];

/// The codebook decode unit and its combine for every scheme above, GQA 1/4/8, f16 and bf16.
fn codebook_decode_kernels_compile_for_sm80_and_sm90a() {
    let mut jobs = Vec::new();
    for (text, dims) in CODEBOOK_GPU_SCHEMES {
        let spec: kvq::SchemeSpec = match kvq::schemes::by_name(text) {
            Some(b) => b.spec,
            None => text.parse().unwrap_or_else(|e| panic!("{text}: {e}")),
        };
        for &d in *dims {
            for gqa in [1, 4, 8] {
                for dtype in [Dtype::F16, Dtype::Bf16] {
                    let shape = KernelShape::new(d, gqa, dtype);
                    let k = codebook_kernels(&spec, &shape, 8)
                        .unwrap_or_else(|e| panic!("{text} {shape:?}: {e}"));
                    jobs.push(("codebook_decode", shape, k.source));
                }
            }
        }
    }
    compile_all_for(&jobs, |shape| shape.gqa == 4);
}

/// The codebook cache-filling unit (rows and page encoders) for every scheme above, f16 and bf16.
fn codebook_encode_kernels_compile_for_sm80_and_sm90a() {
    let mut jobs = Vec::new();
    for (text, dims) in CODEBOOK_GPU_SCHEMES {
        let spec: kvq::SchemeSpec = match kvq::schemes::by_name(text) {
            Some(b) => b.spec,
            None => text.parse().unwrap_or_else(|e| panic!("{text}: {e}")),
        };
        for &d in *dims {
            for dtype in [Dtype::F16, Dtype::Bf16] {
                let k = codebook_encode_kernels(&spec, d, dtype, 8)
                    .unwrap_or_else(|e| panic!("{text} d{d} {dtype:?}: {e}"));
                jobs.push(("codebook_encode", (d, dtype), k.source));
            }
        }
    }
    compile_all_for(&jobs, |(_, dtype)| *dtype == Dtype::F16);
}

/// XQuant's latent decode: the built-ins at 2, 3 and 4 bits, XQuant-CL and a grouped custom
/// scheme, head_dim 32 to 256, GQA 1 to 8, latents of 96 (SmolLM2-like) to 1024 channels, both
/// dtypes and both rebuild precisions, on mma.sync and, where the runtime would pick it, on
/// Hopper's warpgroup MMAs (every N of `wgmma m64nNk16` the decode uses: 32, 64, 96, 128).
fn xquant_decode_kernels_compile_for_sm80_and_sm90a() {
    let mut jobs = Vec::new();
    for text in [
        "xquant2",
        "xquant3",
        "xquant4",
        "xquant-cl2",
        "k = int(2, channel), v = int(2, token, group = 32), sink = 4, local = 32, page = 64, source = x(latent)",
    ] {
        let spec: kvq::SchemeSpec = match kvq::schemes::by_name(text) {
            Some(b) => b.spec,
            None => text.parse().unwrap_or_else(|e| panic!("{text}: {e}")),
        };
        for (d, gqa, dtype, d_model, precision) in [
            (64, 1, Dtype::F16, 96, RebuildPrecision::F32),
            (64, 7, Dtype::Bf16, 576, RebuildPrecision::F16),
            (128, 4, Dtype::F16, 4096, RebuildPrecision::F16),
            (128, 8, Dtype::Bf16, 4096, RebuildPrecision::F32),
            (256, 2, Dtype::F16, 1024, RebuildPrecision::F32),
            (96, 3, Dtype::F16, 384, RebuildPrecision::F16),
            (32, 2, Dtype::Bf16, 128, RebuildPrecision::F16),
        ] {
            let shape = KernelShape::new(d, gqa, dtype);
            let k = xquant_kernels(&spec, &shape, 8, d_model, (precision, RebuildMma::Sync))
                .unwrap_or_else(|e| panic!("{text} {shape:?}: {e}"));
            jobs.push(("xquant", (shape, RebuildMma::Sync), k.source));
            // Hopper's warpgroup rebuild wherever it applies (sm_90a only).
            if RebuildMma::best(&spec, &shape, (8, d_model), precision, true) == RebuildMma::Warpgroup {
                let k = xquant_kernels(&spec, &shape, 8, d_model, (precision, RebuildMma::Warpgroup))
                    .unwrap_or_else(|e| panic!("{text} {shape:?} warpgroup: {e}"));
                jobs.push(("xquant", (shape, RebuildMma::Warpgroup), k.source));
            }
        }
    }
    compile_all_for(&jobs, |(shape, mma)| {
        shape.dtype == Dtype::F16 && *mma == RebuildMma::Sync
    });
    // The cache writes' projection, both input dtypes.
    let mut project = Vec::new();
    for (dtype, d_model, rank) in [(Dtype::F16, 4096, 1024), (Dtype::Bf16, 576, 192)] {
        let k = kvq::codegen::xquant_project_kernel(dtype, d_model, rank)
            .unwrap_or_else(|e| panic!("projection {dtype} {d_model} {rank}: {e}"));
        project.push((
            "xquant_project",
            format!("{dtype} {d_model}→{rank}"),
            k.source,
        ));
        let cl = kvq::codegen::xquant_cross_layer_kernel(dtype, d_model, rank)
            .unwrap_or_else(|e| panic!("cross-layer writes {dtype} {d_model} {rank}: {e}"));
        project.push((
            "xquant_cross_layer",
            format!("{dtype} {d_model}→{rank}"),
            cl.source,
        ));
    }
    compile_all(&project);
}

fn every_builtin_decode_kernel_compiles_for_sm80_and_sm90a() {
    let version = nvrtc::version().unwrap();
    let mut jobs = Vec::new();
    for b in BUILTIN {
        let gpu_scheme = has_decode_kernel(&b.spec);
        for head_dim in [64, 128, 256] {
            for dtype in [Dtype::F16, Dtype::Bf16] {
                // The dtype changes only the 16-bit conversions: bf16 at the benchmarked GQA.
                let (heads, more_heads): (&[u32], &[u32]) = match (dtype, head_dim) {
                    (Dtype::Bf16, _) => (&[4], &[]),
                    (Dtype::F16, 128) => (&[1, 4, 16], &[11, 12, 29]),
                    (Dtype::F16, 64) => (&[1, 4, 16], &[71]),
                    (Dtype::F16, _) => (&[1, 4, 16], &[]),
                };
                for &gqa in heads.iter().chain(more_heads) {
                    let shape = KernelShape::new(head_dim, gqa, dtype);
                    match decode_kernels(&b.spec, &shape, &TuneParams::default_for(&b.spec, &shape))
                    {
                        Ok(k) => {
                            assert!(gpu_scheme, "{} should have no decode kernel yet", b.name);
                            jobs.push((b.name, shape, k.source));
                        }
                        // Codebook and XQuant schemes have their own decodes (tested above), and
                        // the integer path says so with a typed error.
                        Err(CodegenError::Unsupported { .. }) if !gpu_scheme => {}
                        Err(e) => panic!("{} {shape:?}: {e}", b.name),
                    }
                }
            }
        }
    }
    assert_eq!(
        jobs.len(),
        8 * (3 * 4 + 3 + 1),
        "every integer/FP16 built-in renders"
    );
    // Every block shape the tuner may pick, for schemes whose staging ring changes with it (tile
    // and warps size the cp.async stages; INT8 stages only at 32- and 16-token tiles; CalibQuant-2
    // at 256 threads and 64-token tiles takes its channel-axis subnormal V through the loop
    // without a ring).
    for b in BUILTIN
        .iter()
        .filter(|b| ["kivi2", "kitty", "int8", "calibquant1", "calibquant2"].contains(&b.name))
    {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let default = TuneParams::default_for(&b.spec, &shape);
        for tune in TuneParams::candidates().filter(|t| {
            *t != default
                && t.min_warps_per_sm == default.min_warps_per_sm
                && t.pack_heads
                && !t.short_staging
                && t.store_scores == default.store_scores
        }) {
            let k = decode_kernels(&b.spec, &shape, &tune)
                .unwrap_or_else(|e| panic!("{} {tune:?}: {e}", b.name));
            jobs.push((b.name, shape, k.source));
        }
    }
    // The other occupancy the tuner offers each GPU built-in's default block (twelve warps an SM
    // for the 4- and 8-bit kernels, none for the rest), Kitty's kernels without packing,
    // KIVI-4's on the short staging path and CalibQuant's with the keys scored twice.
    for b in BUILTIN.iter() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let default = TuneParams::default_for(&b.spec, &shape);
        for tune in TuneParams::candidates_for(&b.spec, &shape)
            .into_iter()
            .filter(|t| {
                (t.threads, t.tile_tokens) == (default.threads, default.tile_tokens)
                    && *t != default
            })
        {
            let k = decode_kernels(&b.spec, &shape, &tune)
                .unwrap_or_else(|e| panic!("{} {tune:?}: {e}", b.name));
            jobs.push((b.name, shape, k.source));
        }
    }
    // Head sizes read as several slabs (kvq/decode/slabs.cuh): slabs reaching past the row (80,
    // 96, 112 and 160 for the 1- and 2-bit schemes) and slabs of 16 and 32 channels, at GQA 4 for
    // sm_80 and sm_90a, and at 80 also GQA 7 for sm_90a.
    let mut slabbed = Vec::new();
    for b in BUILTIN.iter().filter(|b| has_decode_kernel(&b.spec)) {
        for (head_dim, gqa, dtype) in [
            (80, 4, Dtype::F16),
            (80, 7, Dtype::Bf16),
            (96, 4, Dtype::Bf16),
            (112, 4, Dtype::F16),
            (160, 4, Dtype::F16),
            (192, 4, Dtype::F16),
        ] {
            let shape = KernelShape::new(head_dim, gqa, dtype);
            let k = decode_kernels(&b.spec, &shape, &TuneParams::default_for(&b.spec, &shape))
                .unwrap_or_else(|e| panic!("{} {shape:?}: {e}", b.name));
            assert!(
                k.slow_path.is_none(),
                "{} {shape:?}: {:?}",
                b.name,
                k.slow_path
            );
            slabbed.push((b.name, shape, k.source));
        }
    }
    // The generic kernel, which no built-in takes at these head_dims: 3-bit codes (token-axis keys
    // at 128; at 80, a lane's channels past the row) and a head past 256 channels.
    let three_bit = |text: &str| kvq::SchemeSpec::parse(text).unwrap();
    let token_keys =
        three_bit("k = int(3, token, group = 32), v = int(3, channel), sink = 16, page = 64");
    let channel_keys = three_bit("k = int(3, channel), v = int(3, channel), local = 64");
    let kivi2 = kvq::schemes::by_name("kivi2").expect("built-in").spec;
    for (name, spec, shape) in [
        ("3-bit", token_keys, KernelShape::new(128, 4, Dtype::F16)),
        ("3-bit", channel_keys, KernelShape::new(80, 1, Dtype::Bf16)),
        ("kivi2", kivi2, KernelShape::new(288, 4, Dtype::F16)),
    ] {
        let k = decode_kernels(&spec, &shape, &TuneParams::default_for(&spec, &shape))
            .unwrap_or_else(|e| panic!("{name} {shape:?}: {e}"));
        assert!(
            k.slow_path.is_some(),
            "{name} {shape:?}: the generic kernel"
        );
        jobs.push((name, shape, k.source));
    }
    // Calibrated keys of other widths and layouts, whose range pass keeps the f16 path, with
    // stored scores (the default) and, at GQA 4, with the keys scored twice.
    for (name, spec) in other_calibrated_schemes() {
        for head_dim in [64, 128, 256] {
            for gqa in [1, 4, 8] {
                let shape = KernelShape::new(head_dim, gqa, Dtype::Bf16);
                let default = TuneParams::default_for(&spec, &shape);
                let twice = TuneParams {
                    store_scores: false,
                    ..default
                };
                for tune in [default, twice].iter().take(if gqa == 4 { 2 } else { 1 }) {
                    let k = decode_kernels(&spec, &shape, tune)
                        .unwrap_or_else(|e| panic!("{name} {shape:?}: {e}"));
                    assert!(
                        k.range.is_some(),
                        "{name}: a calibrated scheme has a range pass"
                    );
                    assert!(
                        !k.source.contains("typedef KvqIntFold KvqRangeFold;"),
                        "{name} {shape:?}: its range pass should keep the f16 path"
                    );
                    jobs.push((name, shape, k.source));
                }
            }
        }
    }
    // Uncalibrated layouts no built-in has (FP16 keys with 2-bit values, 1-bit K and V with
    // token- or channel-axis V), which gpu_decode runs on the GPU.
    for (name, spec) in other_uncalibrated_schemes() {
        for head_dim in [64, 128, 256] {
            let shape = KernelShape::new(head_dim, 4, Dtype::Bf16);
            let k = decode_kernels(&spec, &shape, &TuneParams::default_for(&spec, &shape))
                .unwrap_or_else(|e| panic!("{name} {shape:?}: {e}"));
            jobs.push((name, shape, k.source));
        }
    }
    // sm_80 differs from sm_90a in the architecture's paths (the overlapped launch), not in the
    // shape's or the tuning's: GQA 4 of each (scheme, head_dim) in f16, and at 128 in bf16, stand
    // for the grid, and the tuning variants after it are compiled for sm_90a only. That keeps
    // CI's 2-core run well inside its time.
    let grid = 8 * (3 * 4 + 3 + 1);
    let sm80 = |shape: &KernelShape| {
        shape.gqa == 4 && (shape.dtype == Dtype::F16 || shape.head_dim == 128)
    };
    let (grid_jobs, rest) = jobs.split_at(grid);
    compile_all_for(grid_jobs, sm80);
    compile_all_for(rest, |_| false);
    compile_all_for(&slabbed, |shape| shape.gqa == 4);
    println!(
        "compiled {} decode modules for sm_90a, {} of them also for sm_80, with NVRTC {version:?}",
        jobs.len() + slabbed.len(),
        grid_jobs.iter().filter(|j| sm80(&j.1)).count()
            + slabbed.iter().filter(|j| j.1.gqa == 4).count()
    );
}

/// Cache units of a scheme at `head_dim` in f16, one for each distinct pair of forms the
/// quantizer forms give it (a form a tensor does not take falls back to tiled), past `skip`.
fn every_form(
    b: &kvq::schemes::Builtin,
    head_dim: u32,
    skip: &[kvq::codegen::QuantizerForms],
) -> Vec<(&'static str, String, String)> {
    let mut seen = skip.to_vec();
    let mut out = Vec::new();
    for form in QuantizerForm::ALL {
        let forms = forms_or_tiled(&b.spec, head_dim, form);
        if !seen.contains(&forms) {
            seen.push(forms);
            let k = cache_kernels_with(&b.spec, head_dim, Dtype::F16, forms)
                .unwrap_or_else(|e| panic!("{} d{head_dim} {forms}: {e}", b.name));
            out.push((b.name, format!("d{head_dim} f16 {forms}"), k.source));
        }
    }
    out
}

fn every_builtin_cache_kernel_compiles_in_every_quantizer_form() {
    let version = nvrtc::version().unwrap();
    let mut jobs = Vec::new();
    // Rows that are not whole 32-channel units (idle lanes past a row's chunks in the register
    // forms, per-element paths in the naive and tiled ones) for sm_90a: the default forms at 80
    // and 112 in both dtypes, and every other form at 80.
    let mut wide = Vec::new();
    let cache = |b: &kvq::schemes::Builtin, head_dim: u32, dtype: Dtype| {
        let k = kvq::codegen::cache_kernels(&b.spec, head_dim, dtype)
            .unwrap_or_else(|e| panic!("{} d{head_dim} {dtype}: {e}", b.name));
        (b.name, format!("d{head_dim} {dtype:?}"), k.source)
    };
    for b in BUILTIN.iter().filter(|b| has_decode_kernel(&b.spec)) {
        // Every form at the benchmarked shape; the default forms at the other head_dims and bf16.
        jobs.extend(every_form(b, 128, &[]));
        for (head_dim, dtype) in [(64, Dtype::Bf16), (96, Dtype::F16), (256, Dtype::Bf16)] {
            jobs.push(cache(b, head_dim, dtype));
        }
        for head_dim in [80, 112] {
            for dtype in [Dtype::F16, Dtype::Bf16] {
                wide.push(cache(b, head_dim, dtype));
            }
        }
        wide.extend(every_form(
            b,
            80,
            &[forms_or_tiled(&b.spec, 80, QuantizerForm::Vectorized)],
        ));
    }
    assert!(wide.len() >= 8 * 4, "{} jobs at 80 and 112", wide.len());
    // sm_80 for every form at 128, and at 80 and 112 for the default forms in f16 (the other
    // head sizes, forms and bf16 take the same architecture paths).
    let sm80 = |what: &String| what.starts_with("d128 ") || what == "d80 F16" || what == "d112 F16";
    compile_all_for(&jobs, sm80);
    compile_all_for(&wide, sm80);
    println!(
        "compiled {} cache modules for sm_90a, {} of them also for sm_80, with NVRTC {version:?}",
        jobs.len() + wide.len(),
        jobs.iter().chain(&wide).filter(|j| sm80(&j.1)).count()
    );
}

/// The merge of attention states (scheme-independent) at one- and several-slab head sizes, both
/// dtypes.
fn the_merge_kernel_compiles_for_sm80_and_sm90a() {
    let mut jobs = Vec::new();
    for head_dim in [64, 80, 112, 256] {
        for dtype in [Dtype::F16, Dtype::Bf16] {
            let k = merge_kernel(head_dim, dtype)
                .unwrap_or_else(|e| panic!("merge d{head_dim} {dtype}: {e}"));
            jobs.push(("merge", format!("d{head_dim} {dtype}"), k.source));
        }
    }
    compile_all(&jobs);
}

/// Compiles every (name, what, source) for sm_80 and sm_90a on all cores; panics naming the first
/// that fails.
fn compile_all<W: std::fmt::Debug + Sync>(jobs: &[(&str, W, String)]) {
    compile_all_for(jobs, |_| true);
}

/// [`compile_all`], with sm_80 only for the jobs `sm80` keeps (sm_90a for every job).
fn compile_all_for<W: std::fmt::Debug + Sync>(
    jobs: &[(&str, W, String)],
    sm80: impl Fn(&W) -> bool + Sync,
) {
    let sm80 = &sm80;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let chunk = jobs.len().div_ceil(threads);
    std::thread::scope(|s| {
        for part in jobs.chunks(chunk) {
            s.spawn(move || {
                for (name, what, source) in part {
                    let archs: &[Arch] = if sm80(what) {
                        &[Arch::SM_80, Arch::SM_90A]
                    } else {
                        &[Arch::SM_90A]
                    };
                    for &arch in archs {
                        let src = kvq::codegen::kernel_headers().iter().fold(
                            Source::new(format!("{name}.cu"), source.clone()),
                            |s, (header, text)| s.with_header(*header, *text),
                        );
                        nvrtc::compile(&src, arch, Output::Cubin, &CompileOptions::default())
                            .unwrap_or_else(|e| panic!("{name} {what:?} {arch}: {e}"));
                    }
                }
            });
        }
    });
}
