//! Helpers GPU and NVRTC tests call first, so they skip cleanly on machines without CUDA and
//! fail loudly where CUDA is required.
//!
//! * [`require_nvrtc`]: `Some(version)` when NVRTC loads; otherwise prints
//!   `skipping <test>: <reason>` and returns `None` — or panics with the reason when
//!   `KVQ_REQUIRE_NVRTC=1` (CI sets it after installing libnvrtc from pip).
//! * [`require_gpu`]: `Some(device 0)` when a GPU opens *and* NVRTC loads (every kvq GPU test
//!   JIT-compiles); otherwise skips — or panics when `KVQ_REQUIRE_GPU=1` (set on the GPU
//!   machine), or, for a missing NVRTC, when `KVQ_REQUIRE_NVRTC=1`.
//!
//! Skip lines are written to the process's stderr directly, past libtest's output capture, so
//! they show in a plain `cargo test` run.
//!
//! Test files with their own harness (`harness = false`, libtest-mimic) ask [`Need::gate`] once
//! before running: [`Gate::Run`] runs the test, [`Gate::Skip`] reports it as ignored with the
//! reason (so the summary counts it as ignored, not passed), [`Gate::Fail`] fails it with the
//! reason (a skip under `KVQ_REQUIRE_GPU=1` / `KVQ_REQUIRE_NVRTC=1`).

use std::fmt::Display;
use std::io::Write;

use crate::device::Device;
use crate::nvrtc::{self, NvrtcVersion};

/// Set to `1` to turn GPU-test skips into failures.
pub const KVQ_REQUIRE_GPU: &str = "KVQ_REQUIRE_GPU";
/// Set to `1` to turn NVRTC-test skips into failures.
pub const KVQ_REQUIRE_NVRTC: &str = "KVQ_REQUIRE_NVRTC";

/// Whether environment variable `name` is set to a true value (`1`, `true`, `yes`, `on`).
pub fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
        .unwrap_or(false)
}

/// What a test needs from the machine beyond a CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// NVRTC loads (compile-only tests).
    Nvrtc,
    /// A GPU opens and NVRTC loads (every kvq GPU test JIT-compiles).
    Gpu,
}

/// What a test with a [`Need`] does on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gate {
    /// Everything it needs is here.
    Run,
    /// Something is missing: report the test as ignored, with this reason.
    Skip(String),
    /// Something is missing and the environment requires it: fail with this reason.
    Fail(String),
}

impl Need {
    /// Looks at the machine (opens device 0, loads NVRTC) and the `KVQ_REQUIRE_*` flags.
    pub fn gate(self) -> Gate {
        let nvrtc_missing = nvrtc::version()
            .err()
            .map(|e| format!("NVRTC is unusable: {e}"));
        let gpu_missing = match self {
            Need::Nvrtc => None,
            Need::Gpu => Device::open(0).err().map(|e| format!("no usable GPU: {e}")),
        };
        let set = |flag: &'static str| env_flag(flag).then_some(flag);
        let required = match (&gpu_missing, &nvrtc_missing) {
            (None, None) => return Gate::Run,
            (Some(_), _) => set(KVQ_REQUIRE_GPU),
            (None, Some(_)) => set(KVQ_REQUIRE_NVRTC).or_else(|| set(KVQ_REQUIRE_GPU)),
        };
        let reason = gpu_missing.or(nvrtc_missing).unwrap_or_default();
        match required {
            Some(flag) => Gate::Fail(format!("{flag}=1 but {reason}")),
            None => Gate::Skip(reason),
        }
    }
}

/// Prints `skipping <test>: <reason>` to stderr, uncaptured.
pub fn skip(test: &str, reason: &dyn Display) {
    // One write of the whole line, so parallel tests do not interleave inside it.
    let line = format!("skipping {test}: {reason}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// See the module docs.
pub fn require_nvrtc(test: &str) -> Option<NvrtcVersion> {
    match nvrtc::version() {
        Ok(v) => Some(v),
        Err(e) => {
            if env_flag(KVQ_REQUIRE_NVRTC) {
                panic!("{test}: {KVQ_REQUIRE_NVRTC}=1 but NVRTC is unusable: {e}");
            }
            skip(test, &e);
            None
        }
    }
}

/// See the module docs.
pub fn require_gpu(test: &str) -> Option<Device> {
    let device = match Device::open(0) {
        Ok(d) => d,
        Err(e) => {
            if env_flag(KVQ_REQUIRE_GPU) {
                panic!("{test}: {KVQ_REQUIRE_GPU}=1 but no GPU is usable: {e}");
            }
            skip(test, &e);
            return None;
        }
    };
    if let Err(e) = nvrtc::version() {
        if env_flag(KVQ_REQUIRE_GPU) || env_flag(KVQ_REQUIRE_NVRTC) {
            panic!("{test}: a GPU test needs NVRTC, which is unusable: {e}");
        }
        skip(test, &e);
        return None;
    }
    Some(device)
}

/// Set to `1` to turn skips for a missing C compiler (fake-library tests) into failures.
pub const KVQ_REQUIRE_CC: &str = "KVQ_REQUIRE_CC";

/// C source of a shared library exporting every entry point of `entries` except those in `omit`,
/// each a stub that returns 0 (success), with `cuDriverGetVersion` and `nvrtcVersion` reporting
/// `version` (`(13, 0)` → 13000 and 13.0). Tests load it in place of libcuda or libnvrtc to check
/// that a broken library is a typed error, never a panic; nothing but the version calls is ever
/// called on it.
pub fn fake_library_source(
    entries: &[crate::libs::EntryPoint],
    omit: &[&str],
    version: (u32, u32),
) -> String {
    let mut c = String::from("/* A fake CUDA library for kvq's tests. */\n");
    for e in entries.iter().filter(|e| !omit.contains(&e.name)) {
        match e.name {
            "cuDriverGetVersion" => c.push_str(&format!(
                "int cuDriverGetVersion(int *v) {{ *v = {}; return 0; }}\n",
                version.0 * 1000 + version.1 * 10
            )),
            "nvrtcVersion" => c.push_str(&format!(
                "int nvrtcVersion(int *major, int *minor) {{ *major = {}; *minor = {}; return 0; }}\n",
                version.0, version.1
            )),
            name => c.push_str(&format!("int {name}(void) {{ return 0; }}\n")),
        }
    }
    c
}

/// Compiles `c_source` into a shared library at `dir/names[0]` and copies it to the other names,
/// with `$CC` or `cc`. `Ok(false)` (after printing a skip line for `test`) when no C compiler
/// runs here, unless `KVQ_REQUIRE_CC=1`, which makes that a panic; `Err` when compiling fails.
pub fn build_fake_library(
    test: &str,
    dir: &std::path::Path,
    names: &[&str],
    c_source: &str,
) -> Result<bool, String> {
    let first = names.first().ok_or("no file name given")?;
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let source = dir.join(format!("{first}.c"));
    std::fs::write(&source, c_source).map_err(|e| format!("write {}: {e}", source.display()))?;
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let out = match std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join(first))
        .arg(&source)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            let reason = format!("no C compiler to build fake CUDA libraries (`{cc}`: {e})");
            if env_flag(KVQ_REQUIRE_CC) {
                panic!("{test}: {KVQ_REQUIRE_CC}=1 but {reason}");
            }
            skip(test, &reason);
            return Ok(false);
        }
    };
    if !out.status.success() {
        return Err(format!(
            "`{cc}` failed on {}:\n{}",
            source.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    for name in &names[1..] {
        std::fs::copy(dir.join(first), dir.join(name))
            .map_err(|e| format!("copy to {name}: {e}"))?;
    }
    Ok(true)
}
