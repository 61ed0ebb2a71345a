//! With the CUDA libraries out of reach, every entry point returns a typed error — no panics.
//!
//! The dynamic loader reads LD_LIBRARY_PATH only at process start, so this test re-runs its own
//! binary with LD_LIBRARY_PATH pointing nowhere and checks the errors there (the child skips
//! what the system's default library path still provides; where that is everything, the test
//! shows as ignored, with the reason).

use std::process::Command;

use kvq_runtime::nvrtc::{self, CompileOptions, IncludeDirs, Output, Source};
use kvq_runtime::testing::harness::{checked, run};
use kvq_runtime::testing::{Need, Skip};
use kvq_runtime::{Arch, Device, DiskCache, JitError};

const CHILD: &str = "KVQ_RUNTIME_TEST_CHILD";

fn main() {
    run(vec![
        checked(
            "bogus_library_path_gives_typed_errors",
            bogus_library_path_gives_typed_errors,
        ),
        checked(
            "missing_headers_name_every_searched_folder",
            missing_headers_name_every_searched_folder,
        ),
    ])
}

/// Runs `test` in a child process with `envs` set and `remove` unset: its output, or the reason
/// the child reported it ignored.
fn run_child(test: &str, envs: &[(&str, &str)], remove: &[&str]) -> Result<String, Skip> {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"]);
    cmd.env(CHILD, "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    for k in remove {
        cmd.env_remove(k);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child {test} failed:\n{text}");
    if text.contains("1 ignored") {
        let reason = text
            .lines()
            .find_map(|l| l.split_once(" ... ignored (")?.1.strip_suffix(')'))
            .unwrap_or("the child skipped every part");
        return Err(Skip::because(reason));
    }
    assert!(
        text.contains("1 passed"),
        "child {test} ran nothing:\n{text}"
    );
    Ok(text)
}

fn bogus_library_path_gives_typed_errors() -> Result<(), Skip> {
    if std::env::var_os(CHILD).is_some() {
        return child_without_libraries();
    }
    let text = run_child(
        "bogus_library_path_gives_typed_errors",
        &[("LD_LIBRARY_PATH", "/nonexistent/kvq-bogus-lib")],
        &["KVQ_REQUIRE_NVRTC", "KVQ_REQUIRE_GPU"],
    )?;
    print!("{text}");
    Ok(())
}

/// Checks the NVRTC and the driver errors, each where the system's default library path does
/// not provide the library anyway; a skip when it provides both.
fn child_without_libraries() -> Result<(), Skip> {
    let source = Source::new("k.cu", "extern \"C\" __global__ void k() {}");
    let options = CompileOptions::default().include_dirs(IncludeDirs::None);

    let nvrtc_checked = !nvrtc::is_available();
    if !nvrtc_checked {
        kvq_runtime::testing::skip(
            "bogus_library_path_gives_typed_errors (NVRTC part)",
            &"libnvrtc is on the system's default library path",
        );
    } else {
        let err = nvrtc::compile(&source, Arch::SM_90A, Output::Cubin, &options).unwrap_err();
        assert!(matches!(err, JitError::NvrtcNotFound { .. }), "{err:?}");
        let message = err.to_string();
        assert!(message.contains("libnvrtc.so.13"), "{message}");
        assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
        assert!(message.contains("nvidia-cuda-nvrtc"), "{message}");
        println!("NVRTC error: {message}");

        assert!(matches!(
            nvrtc::version(),
            Err(JitError::NvrtcNotFound { .. })
        ));
        assert!(matches!(
            nvrtc::supported_archs(),
            Err(JitError::NvrtcNotFound { .. })
        ));
        let dir = std::env::temp_dir().join(format!("kvq-nolib-{}", std::process::id()));
        let cache = DiskCache::open(&dir).unwrap();
        let err = cache
            .compile(&source, Arch::SM_80, Output::Ptx, &options)
            .unwrap_err();
        assert!(matches!(err, JitError::NvrtcNotFound { .. }), "{err:?}");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            kvq_runtime::testing::require_nvrtc("require_nvrtc without NVRTC (expected)").is_none()
        );
    }

    let driver_checked = !kvq_runtime::libs::driver_present();
    if !driver_checked {
        kvq_runtime::testing::skip(
            "bogus_library_path_gives_typed_errors (driver part)",
            &"libcuda is on the system's default library path",
        );
    } else {
        let err = Device::open(0).unwrap_err();
        assert!(matches!(err, JitError::DriverNotFound { .. }), "{err:?}");
        let message = err.to_string();
        assert!(message.contains("libcuda.so.1"), "{message}");
        println!("driver error: {message}");
        assert!(matches!(
            kvq_runtime::device_count(),
            Err(JitError::DriverNotFound { .. })
        ));
        assert!(matches!(
            kvq_runtime::driver_version(),
            Err(JitError::DriverNotFound { .. })
        ));
        assert!(
            kvq_runtime::testing::require_gpu("require_gpu without a driver (expected)").is_none()
        );
    }
    if nvrtc_checked || driver_checked {
        Ok(())
    } else {
        Err(Skip::because(
            "libnvrtc and libcuda are both on the system's default library path",
        ))
    }
}

fn missing_headers_name_every_searched_folder() -> Result<(), Skip> {
    if std::env::var_os(CHILD).is_some() {
        child_missing_headers();
        return Ok(());
    }
    // The error comes from a real compile.
    if let Some(skip) = Need::Nvrtc.missing() {
        return Err(skip);
    }
    // The default location is searched last: where it exists, the header is found there.
    if std::path::Path::new(kvq_runtime::include::DEFAULT_CUDA_INCLUDE).is_dir() {
        return Err(Skip::because(format!(
            "{} exists here",
            kvq_runtime::include::DEFAULT_CUDA_INCLUDE
        )));
    }
    let text = run_child(
        "missing_headers_name_every_searched_folder",
        &[
            ("KVQ_CUDA_INCLUDE", "/nonexistent/kvq-a:/nonexistent/kvq-b"),
            ("CUDA_HOME", "/nonexistent/kvq-cuda-home"),
        ],
        &[],
    )?;
    print!("{text}");
    Ok(())
}

fn child_missing_headers() {
    let source = Source::new(
        "needs_headers.cu",
        "// generated\n#include <cuda_bf16.h>\nextern \"C\" __global__ void k() {}\n",
    );
    let err = nvrtc::compile(
        &source,
        Arch::SM_80,
        Output::Ptx,
        &CompileOptions::default(),
    )
    .unwrap_err();
    let message = err.to_string();
    println!("missing header error: {message}");
    assert!(matches!(err, JitError::MissingHeader(_)), "{message}");
    for expected in [
        "CUDA header `cuda_bf16.h` not found (included from needs_headers.cu line 2)",
        "KVQ_CUDA_INCLUDE: /nonexistent/kvq-a (does not exist)",
        "KVQ_CUDA_INCLUDE: /nonexistent/kvq-b (does not exist)",
        "$CUDA_HOME/include: /nonexistent/kvq-cuda-home/include (does not exist)",
        "default location: /usr/local/cuda/include (does not exist)",
    ] {
        assert!(
            message.contains(expected),
            "missing {expected:?} in:\n{message}"
        );
    }
}
