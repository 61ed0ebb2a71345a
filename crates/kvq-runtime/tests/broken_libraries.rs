//! A CUDA library that loads but is broken — lacking an entry point, too old, the wrong NVRTC
//! major — is a typed error naming the file, the symbol and what to do; never a panic.
//!
//! Fake `libcuda` / `libnvrtc` files are built with the C compiler at test time (where there is
//! none, the tests show as ignored, with the reason; `KVQ_REQUIRE_CC=1` makes that a failure),
//! and this test binary re-runs itself with `LD_LIBRARY_PATH` starting at their folder: the loader
//! reads it only at process start, and the runtime checks each library once per process.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvq_runtime::libs::{self, DRIVER_ENTRY_POINTS, NVRTC_ENTRY_POINTS};
use kvq_runtime::nvrtc::{self, CompileOptions, IncludeDirs, Output, Source};
use kvq_runtime::testing::harness::{checked, run};
use kvq_runtime::testing::{build_fake_library, c_compiler, fake_library_source, Skip};
use kvq_runtime::{Arch, Device, JitError};

const CHILD: &str = "KVQ_RUNTIME_BROKEN_LIB_CHILD";
const FAKE_DIR: &str = "KVQ_RUNTIME_FAKE_DIR";

/// The names cudarc tries first (`libcuda.so`, `libnvrtc.so`) and the sonames, so the fakes win
/// over any real library on the system path.
const DRIVER_NAMES: &[&str] = &["libcuda.so", "libcuda.so.1"];
const NVRTC_NAMES: &[&str] = &["libnvrtc.so", "libnvrtc.so.13"];

fn main() {
    run(vec![
        checked(
            "a_library_without_cuinit_or_nvrtcversion_is_a_typed_error",
            a_library_without_cuinit_or_nvrtcversion_is_a_typed_error,
        ),
        checked(
            "an_old_driver_and_another_nvrtc_major_are_typed_errors",
            an_old_driver_and_another_nvrtc_major_are_typed_errors,
        ),
    ])
}

fn fake_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvq-fake-cuda-{}-{name}", std::process::id()))
}

/// Builds the fakes in `dir`; a skip where there is no C compiler.
fn build(dir: &Path, driver: &str, nvrtc: &str) -> Result<(), Skip> {
    let cc = c_compiler()?;
    let _ = std::fs::remove_dir_all(dir);
    build_fake_library(&cc, dir, DRIVER_NAMES, driver).unwrap();
    build_fake_library(&cc, dir, NVRTC_NAMES, nvrtc).unwrap();
    Ok(())
}

fn run_child(test: &str, dir: &Path) -> String {
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(rest) if !rest.is_empty() => format!("{}:{rest}", dir.display()),
        _ => dir.display().to_string(),
    };
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env(FAKE_DIR, dir)
        .env("LD_LIBRARY_PATH", path)
        // The child checks that a broken driver reads as "no GPU"; a GPU machine's requirement
        // that GPU tests run does not apply to it.
        .env_remove("KVQ_REQUIRE_GPU")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("panicked"), "child {test} panicked:\n{text}");
    assert!(out.status.success(), "child {test} failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "child {test} ran nothing:\n{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
    text
}

fn child_dir() -> String {
    std::env::var(FAKE_DIR).unwrap()
}

fn a_library_without_cuinit_or_nvrtcversion_is_a_typed_error() -> Result<(), Skip> {
    const TEST: &str = "a_library_without_cuinit_or_nvrtcversion_is_a_typed_error";
    if std::env::var_os(CHILD).is_some() {
        child_incomplete();
        return Ok(());
    }
    let dir = fake_dir("incomplete");
    let driver = fake_library_source(DRIVER_ENTRY_POINTS, &["cuInit"], (13, 0));
    let nvrtc = fake_library_source(NVRTC_ENTRY_POINTS, &["nvrtcVersion"], (13, 0));
    build(&dir, &driver, &nvrtc)?;
    print!("{}", run_child(TEST, &dir));
    Ok(())
}

fn child_incomplete() {
    let dir = child_dir();
    assert!(libs::driver_present() && libs::nvrtc_present());

    let err = libs::ensure_driver().unwrap_err();
    let message = err.to_string();
    println!("driver: {message}");
    assert!(
        matches!(err, JitError::LibraryIncomplete { ref symbol, .. } if symbol == "cuInit"),
        "{err:?}"
    );
    assert!(err.is_environment());
    for want in [
        "libcuda.so",
        dir.as_str(),
        "lacks `cuInit`",
        "LD_LIBRARY_PATH",
        "R580",
    ] {
        assert!(message.contains(want), "no {want:?} in: {message}");
    }
    // Every driver entry point of the runtime says the same, without a panic.
    for e in [
        Device::open(0).unwrap_err(),
        kvq_runtime::device_count().unwrap_err(),
        kvq_runtime::driver_version().unwrap_err(),
    ] {
        assert!(matches!(e, JitError::LibraryIncomplete { .. }), "{e:?}");
    }
    assert!(
        kvq_runtime::testing::require_gpu("require_gpu with a broken driver (expected)").is_none()
    );

    let err = libs::ensure_nvrtc().unwrap_err();
    let message = err.to_string();
    println!("nvrtc: {message}");
    assert!(
        matches!(err, JitError::LibraryIncomplete { ref symbol, .. } if symbol == "nvrtcVersion"),
        "{err:?}"
    );
    assert!(err.is_nvrtc_unusable() && err.is_environment());
    for want in [
        "libnvrtc.so",
        dir.as_str(),
        "lacks `nvrtcVersion`",
        "nvidia-cuda-nvrtc",
    ] {
        assert!(message.contains(want), "no {want:?} in: {message}");
    }
    assert!(!nvrtc::is_available());
    let source = Source::new("k.cu", "extern \"C\" __global__ void k() {}");
    let options = CompileOptions::default().include_dirs(IncludeDirs::None);
    for e in [
        nvrtc::version().unwrap_err(),
        nvrtc::supported_archs().unwrap_err(),
        nvrtc::compile(&source, Arch::SM_90A, Output::Cubin, &options).unwrap_err(),
    ] {
        assert!(matches!(e, JitError::LibraryIncomplete { .. }), "{e:?}");
    }
    let summary = err.summary();
    assert!(summary.len() < 80, "{summary}");
}

fn an_old_driver_and_another_nvrtc_major_are_typed_errors() -> Result<(), Skip> {
    const TEST: &str = "an_old_driver_and_another_nvrtc_major_are_typed_errors";
    if std::env::var_os(CHILD).is_some() {
        child_old();
        return Ok(());
    }
    let dir = fake_dir("old");
    // A CUDA 12.4 driver has everything but the names from 12.8 on; an NVRTC 12.4 has every
    // entry point kvq calls, but cudarc's bindings are for 13.
    let driver = fake_library_source(DRIVER_ENTRY_POINTS, &["cuEventElapsedTime_v2"], (12, 4));
    let nvrtc = fake_library_source(NVRTC_ENTRY_POINTS, &[], (12, 4));
    build(&dir, &driver, &nvrtc)?;
    print!("{}", run_child(TEST, &dir));
    Ok(())
}

fn child_old() {
    let dir = child_dir();
    let err = Device::open(0).unwrap_err();
    let message = err.to_string();
    println!("driver: {message}");
    assert!(matches!(err, JitError::DriverTooOld { .. }), "{err:?}");
    assert!(err.is_environment());
    for want in [
        dir.as_str(),
        "CUDA 12.4",
        "CUDA 12.8",
        "cuEventElapsedTime_v2",
        "R580",
    ] {
        assert!(message.contains(want), "no {want:?} in: {message}");
    }

    let err = nvrtc::version().unwrap_err();
    let message = err.to_string();
    println!("nvrtc: {message}");
    assert!(
        matches!(err, JitError::NvrtcVersionMismatch { .. }),
        "{err:?}"
    );
    assert!(err.is_nvrtc_unusable());
    for want in [
        dir.as_str(),
        "NVRTC 12.4",
        "built for NVRTC 13",
        "LD_LIBRARY_PATH",
    ] {
        assert!(message.contains(want), "no {want:?} in: {message}");
    }
}
