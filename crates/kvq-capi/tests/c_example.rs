//! examples/plan.c, compiled against the committed include/kvq.h and linked with this crate's
//! shared library, prints the same plan the Rust API makes, and refusals with their status and
//! message. Runs under kvq's harness: without a C compiler the test shows as ignored, with the
//! reason (a failure under `KVQ_REQUIRE_CC=1`).

use std::path::{Path, PathBuf};
use std::process::Command;

use kvq_capi::{KvqPlan, KvqPlanLimits, KVQ_DTYPE_F16};
use kvq_runtime::testing::harness::{checked, run};
use kvq_runtime::testing::{c_compiler, Skip, KVQ_REQUIRE_GPU, KVQ_REQUIRE_NVRTC};

fn main() {
    run(vec![
        checked(
            "the_c_example_prints_the_rust_plan_and_the_refusals",
            the_c_example_prints_the_rust_plan_and_the_refusals,
        ),
        checked(
            "the_gpu_examples_compile_against_kvq_h_and_cuda_h",
            the_gpu_examples_compile_against_kvq_h_and_cuda_h,
        ),
        checked(
            "the_merge_example_runs_on_a_gpu",
            the_merge_example_runs_on_a_gpu,
        ),
        checked(
            "the_decode_example_runs_on_a_gpu",
            the_decode_example_runs_on_a_gpu,
        ),
    ])
}

/// The folders of CUDA's headers (`cuda.h`), from `KVQ_CUDA_INCLUDE` (`.ci/cuda-env.sh` sets it),
/// or a skip that `KVQ_REQUIRE_NVRTC=1` makes a failure.
fn cuda_include() -> Result<Vec<String>, Skip> {
    let dirs: Vec<String> = std::env::var("KVQ_CUDA_INCLUDE")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty() && Path::new(d).join("cuda.h").exists())
        .map(str::to_string)
        .collect();
    if dirs.is_empty() {
        return Err(Skip::unless(
            &[KVQ_REQUIRE_NVRTC],
            "no cuda.h: KVQ_CUDA_INCLUDE names no folder with it (source .ci/cuda-env.sh)",
        ));
    }
    Ok(dirs)
}

/// `cc` on `examples/{name}` with kvq.h and cuda.h, plus `extra` arguments; panics with the
/// compiler's output when it fails.
fn compile_example(cc: &str, cuda: &[String], name: &str, extra: &[&str]) {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cmd = Command::new(cc);
    cmd.args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(crate_dir.join("include"));
    for dir in cuda {
        cmd.arg("-I").arg(dir);
    }
    let result = cmd
        .arg(crate_dir.join("examples").join(name))
        .args(extra)
        .output()
        .expect("run the C compiler");
    assert!(
        result.status.success(),
        "`{cc}` failed on examples/{name}:\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
}

fn the_gpu_examples_compile_against_kvq_h_and_cuda_h() -> Result<(), Skip> {
    let cc = c_compiler()?;
    let cuda = cuda_include()?;
    for name in ["merge.c", "decode.c"] {
        let out = std::env::temp_dir().join(format!("kvq-capi-{name}-{}.o", std::process::id()));
        compile_example(&cc, &cuda, name, &["-c", "-o", out.to_str().unwrap()]);
        std::fs::remove_file(&out).ok();
    }
    Ok(())
}

fn the_merge_example_runs_on_a_gpu() -> Result<(), Skip> {
    run_on_a_gpu("merge.c", &[])
}

fn the_decode_example_runs_on_a_gpu() -> Result<(), Skip> {
    run_on_a_gpu("decode.c", &[])?;
    run_on_a_gpu("decode.c", &["kivi2"])
}

/// Builds `examples/{name}` against the cdylib and runs it with `args` on GPU 0: it must exit 0
/// and print `ok`.
fn run_on_a_gpu(name: &str, args: &[&str]) -> Result<(), Skip> {
    if let Err(e) = kvq::runtime::device_count().and_then(|n| {
        (n > 0).then_some(n).ok_or(kvq::runtime::JitError::NoGpu {
            ordinal: 0,
            count: 0,
        })
    }) {
        return Err(Skip::unless(
            &[KVQ_REQUIRE_GPU],
            format!("no usable GPU: {e}"),
        ));
    }
    let cc = c_compiler()?;
    let cuda = cuda_include()?;
    let lib = library_dir();
    let exe = std::env::temp_dir().join(format!("kvq-capi-{name}-{}", std::process::id()));
    compile_example(
        &cc,
        &cuda,
        name,
        &[
            "-L",
            lib.to_str().unwrap(),
            "-lkvq_capi",
            &format!("-Wl,-rpath,{}", lib.display()),
            "-l:libcuda.so.1",
            "-lm",
            "-o",
            exe.to_str().unwrap(),
        ],
    );
    let run = Command::new(&exe)
        .args(args)
        .output()
        .expect("run the example");
    std::fs::remove_file(&exe).ok();
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}");
    assert!(
        run.status.success() && stdout.contains("ok"),
        "examples/{name} {args:?} failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    Ok(())
}

/// The folder holding `libkvq_capi.so`: this test binary's own (`target/<profile>/deps`), where
/// cargo builds the crate's cdylib beside it.
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe
        .parent()
        .expect("the test binary's folder")
        .to_path_buf();
    assert!(
        deps.join("libkvq_capi.so").exists(),
        "no libkvq_capi.so in {} (cargo builds the cdylib with the tests)",
        deps.display()
    );
    deps
}

/// The example built into `out`, or why it could not be.
fn build_example(cc: &str, out: &Path) -> PathBuf {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = library_dir();
    let exe = out.join("plan");
    let result = Command::new(cc)
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("examples/plan.c"))
        .arg("-L")
        .arg(&lib)
        .arg("-lkvq_capi")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run the C compiler");
    assert!(
        result.status.success(),
        "`{cc}` failed on examples/plan.c:\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
    exe
}

/// The value of the first `key value` line of `text`.
fn value<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no `{key}` line in:\n{text}"))
}

fn the_c_example_prints_the_rust_plan_and_the_refusals() -> Result<(), Skip> {
    let cc = c_compiler()?;
    let out = std::env::temp_dir().join(format!("kvq-capi-c-example-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let exe = build_example(&cc, &out);
    let run = Command::new(&exe)
        .args(["kitty", "96"])
        .output()
        .expect("run the example");
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(
        run.status.success(),
        "the example failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    std::fs::remove_dir_all(&out).ok();

    let limits = KvqPlanLimits {
        head_dim: 96,
        q_heads: 32,
        kv_heads: 8,
        dtype: KVQ_DTYPE_F16,
        max_seqs: 16,
        max_seq_len: 32768,
        pool_pages: 16 * 256,
        max_q_len: 1,
        rope_theta: 0.0,
        d_model: 0,
    };
    let plan = KvqPlan::new("kitty", &limits).unwrap();
    let info = plan.info();
    assert_eq!(value(&stdout, "scheme"), plan.spec().to_string());
    assert_eq!(value(&stdout, "page_tokens"), info.page_tokens.to_string());
    assert_eq!(
        value(&stdout, "max_pages_per_seq"),
        info.max_pages_per_seq.to_string()
    );
    assert_eq!(value(&stdout, "page_bytes"), info.page_bytes.to_string());
    assert_eq!(value(&stdout, "total_bytes"), info.total_bytes.to_string());
    assert_eq!(value(&stdout, "buffers_sum"), info.total_bytes.to_string());
    assert_eq!(
        value(&stdout, "buffer k_pool"),
        format!("{} align 256", plan.sizes().k_pool_bytes)
    );
    assert_eq!(value(&stdout, "version"), env!("CARGO_PKG_VERSION"));
    assert_eq!(
        value(&stdout, "past_the_end"),
        "KVQ_STATUS_INVALID_ARGUMENT"
    );
    assert_eq!(
        value(&stdout, "bad_scheme"),
        "KVQ_STATUS_INVALID_SCHEME null"
    );
    assert!(
        value(&stdout, "bad_scheme_message").contains("chanel"),
        "{stdout}"
    );
    assert_eq!(
        value(&stdout, "bad_heads"),
        "KVQ_STATUS_INVALID_ARGUMENT null"
    );
    assert!(
        value(&stdout, "bad_heads_message").contains("not a multiple of limits.kv_heads (6)"),
        "{stdout}"
    );
    Ok(())
}
