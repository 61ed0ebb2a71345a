//! The `kvq` command on a machine whose CUDA libraries load but are broken (a `libcuda` without
//! `cuInit`, a `libnvrtc` without `nvrtcVersion`), or absent: no panic; `demo` and `eval` fall
//! back to the CPU with a short reason, `info` prints the full one, `tune` exits 3 with it.
//! Also `KVQ_TUNE` with an unknown value, which `info` reports as the runtime's error.
//!
//! The fakes are built with the C compiler at test time; their folder goes first on
//! `LD_LIBRARY_PATH`. Runs under its own harness: without a C compiler (or, for the test of a
//! machine without CUDA, with libcuda on the system path) a test shows as ignored, with the
//! reason; `KVQ_REQUIRE_CC=1` makes a missing compiler a failure.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{checked, plain, run_trials, TempDir};
use kvq::runtime::libs::{DRIVER_ENTRY_POINTS, NVRTC_ENTRY_POINTS};
use kvq::runtime::testing::{build_fake_library, c_compiler, fake_library_source, Skip};

fn main() {
    run_trials(vec![
        checked(
            "broken_cuda_libraries_never_panic_the_cli",
            broken_cuda_libraries_never_panic_the_cli,
        ),
        checked(
            "without_cuda_demo_says_why_in_one_short_line",
            without_cuda_demo_says_why_in_one_short_line,
        ),
        plain(
            "info_reports_an_unknown_kvq_tune_as_an_error",
            info_reports_an_unknown_kvq_tune_as_an_error,
        ),
    ])
}

/// Runs `kvq args…` with `LD_LIBRARY_PATH` = `lib_path` (prepended to the current one when
/// `prepend`) and the extra environment `envs`.
fn kvq_with(
    args: &[&str],
    cache: &Path,
    lib_path: &str,
    prepend: bool,
    envs: &[(&str, &str)],
) -> Output {
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(rest) if prepend && !rest.is_empty() => format!("{lib_path}:{rest}"),
        _ => lib_path.to_string(),
    };
    let mut cmd = Command::new(
        std::env::var("KVQ_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvq").to_string()),
    );
    cmd.args(args)
        .env("KVQ_CACHE_DIR", cache)
        .env_remove("KVQ_TUNE")
        .env("LD_LIBRARY_PATH", path);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("run kvq")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The two-tensor capture `kvq eval` reads: one layer, 320 tokens (two pages quantized), 1 KV
/// head × 64, f16.
fn write_capture(path: &Path) {
    let (tokens, head_dim) = (320usize, 64usize);
    let values = |seed: usize| -> Vec<u8> {
        (0..tokens * head_dim)
            .map(|i| (((i * 31 + seed * 17) % 97) as f32 / 48.0) - 1.0)
            .flat_map(|x| half::f16::from_f32(x).to_bits().to_le_bytes())
            .collect()
    };
    let (k, v) = (values(1), values(2));
    let shape = vec![tokens, 1, head_dim];
    let views = vec![
        (
            "layer.0.k".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F16, shape.clone(), &k)
                .unwrap(),
        ),
        (
            "layer.0.v".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F16, shape, &v).unwrap(),
        ),
    ];
    std::fs::write(path, safetensors::serialize(views, &None).unwrap()).unwrap();
}

fn no_panic(what: &str, o: &Output) {
    let (out, err) = text(o);
    assert_ne!(o.status.code(), Some(101), "{what} panicked:\n{out}\n{err}");
    assert!(!err.contains("panicked"), "{what} panicked:\n{out}\n{err}");
}

fn broken_cuda_libraries_never_panic_the_cli() -> Result<(), Skip> {
    let cc = c_compiler()?;
    let tmp = TempDir::new("broken-cuda");
    let fakes = tmp.path().join("lib");
    // `libcuda.so` / `libnvrtc.so` are the names cudarc tries first, so the fakes win over any
    // real library on the system path.
    let driver = fake_library_source(DRIVER_ENTRY_POINTS, &["cuInit"], (13, 0));
    let nvrtc = fake_library_source(NVRTC_ENTRY_POINTS, &["nvrtcVersion"], (13, 0));
    build_fake_library(&cc, &fakes, &["libcuda.so", "libcuda.so.1"], &driver).unwrap();
    build_fake_library(&cc, &fakes, &["libnvrtc.so", "libnvrtc.so.13"], &nvrtc).unwrap();
    let lib = fakes.to_str().unwrap();
    let run = |args: &[&str]| kvq_with(args, tmp.path(), lib, true, &[]);

    let info = run(&["info"]);
    no_panic("info", &info);
    let (out, err) = text(&info);
    assert!(info.status.success(), "{out}\n{err}");
    let driver_line = out.lines().find(|l| l.starts_with("driver:")).unwrap();
    assert!(
        driver_line.contains("lacks `cuInit`") && driver_line.contains(lib),
        "{out}"
    );
    let nvrtc_line = out.lines().find(|l| l.starts_with("NVRTC:")).unwrap();
    assert!(
        nvrtc_line.contains("lacks `nvrtcVersion`") && nvrtc_line.contains(lib),
        "{out}"
    );

    let demo = run(&[
        "demo",
        "--schemes",
        "kivi2",
        "--tokens",
        "64",
        "--calibration",
        "64",
    ]);
    no_panic("demo", &demo);
    let (out, err) = text(&demo);
    assert!(demo.status.success(), "{out}\n{err}");
    let first = out.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("No usable GPU (libcuda lacks `cuInit`)"),
        "{out}"
    );
    assert!(
        first.chars().count() <= 120,
        "{} chars: {first}",
        first.len()
    );

    let capture = tmp.path().join("kv.safetensors");
    write_capture(&capture);
    let eval = run(&[
        "eval",
        "--scheme",
        "kivi2",
        "--kv",
        capture.to_str().unwrap(),
    ]);
    no_panic("eval", &eval);
    let (out, err) = text(&eval);
    assert!(eval.status.success(), "{out}\n{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("GPU: not used") && l.contains("lacks `cuInit`")),
        "{out}"
    );

    let tune = run(&["tune", "--scheme", "kivi4"]);
    no_panic("tune", &tune);
    let (out, err) = text(&tune);
    assert_eq!(tune.status.code(), Some(3), "{out}\n{err}");
    assert!(err.contains("lacks `cuInit`") && err.contains(lib), "{err}");

    let out_dir = tmp.path().join("gen");
    let gen = run(&[
        "gen",
        "--scheme",
        "kivi4",
        "--head-dim",
        "128",
        "--arch",
        "sm_90a",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    no_panic("gen --arch", &gen);
    let (out, err) = text(&gen);
    // A broken NVRTC is treated as a missing one: the files are written and a note says why
    // nothing was compiled.
    assert_eq!(gen.status.code(), Some(0), "{out}\n{err}");
    assert!(
        out.contains("decode.cu not compiled") && out.contains("lacks `nvrtcVersion`"),
        "{out}\n{err}"
    );
    assert!(out_dir.join("decode.cu").is_file());
    Ok(())
}

fn without_cuda_demo_says_why_in_one_short_line() -> Result<(), Skip> {
    // No LD_LIBRARY_PATH folder holds CUDA here; a machine whose system path does is skipped.
    if kvq::runtime::libs::driver_present() {
        return Err(Skip::because("libcuda is on the system library path"));
    }
    let tmp = TempDir::new("no-cuda-demo");
    let demo = kvq_with(
        &[
            "demo",
            "--schemes",
            "kivi2",
            "--tokens",
            "64",
            "--calibration",
            "64",
        ],
        tmp.path(),
        "/nonexistent/kvq-no-cuda",
        false,
        &[],
    );
    no_panic("demo", &demo);
    let (out, err) = text(&demo);
    assert!(demo.status.success(), "{out}\n{err}");
    let first = out.lines().next().unwrap_or_default();
    assert!(
        first.chars().count() <= 120,
        "{} chars: {first}",
        first.len()
    );
    assert!(
        first.contains("libcuda.so.1 not found") && first.contains("kvq info"),
        "{first}"
    );
    // The names tried are in `kvq info`.
    let info = kvq_with(
        &["info"],
        tmp.path(),
        "/nonexistent/kvq-no-cuda",
        false,
        &[],
    );
    let (out, _) = text(&info);
    assert!(out.contains("Names tried: libcuda.so"), "{out}");
    Ok(())
}

fn info_reports_an_unknown_kvq_tune_as_an_error() {
    let tmp = TempDir::new("bogus-tune");
    let info = kvq_with(
        &["info"],
        tmp.path(),
        "/nonexistent/kvq-no-cuda",
        true,
        &[("KVQ_TUNE", "bogus")],
    );
    no_panic("info", &info);
    let (out, err) = text(&info);
    assert!(info.status.success(), "{out}\n{err}");
    let line = out.lines().find(|l| l.starts_with("KVQ_TUNE:")).unwrap();
    assert!(
        line.contains("invalid")
            && line.contains("`bogus`")
            && line.contains("off, cached or full"),
        "{line}"
    );
}
