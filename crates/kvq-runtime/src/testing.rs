//! Helpers GPU and NVRTC tests call first, so they skip visibly on machines without CUDA and
//! fail loudly where CUDA is required.
//!
//! * [`Need::gate`]: for test files with their own harness (`harness = false`; with the
//!   `testing` feature, the `harness` submodule is that harness): [`Gate::Run`] runs the test,
//!   [`Gate::Skip`] reports it as ignored with the reason (so the summary counts it as ignored,
//!   not passed), [`Gate::Fail`] fails it with the reason: a skip under `KVQ_REQUIRE_GPU=1`
//!   (set on the GPU machine) or `KVQ_REQUIRE_NVRTC=1` (`.ci/cuda-env.sh` sets it after
//!   installing libnvrtc from pip).
//! * [`Skip`]: what a test body returns when something it needs turns out to be missing once it
//!   runs (a C compiler, CUDA headers), with the `KVQ_REQUIRE_*` flags that make that a failure.
//! * [`require_nvrtc`] / [`require_gpu`]: for tests under libtest's own harness, which cannot
//!   report a test as ignored at run time: `Some` when NVRTC loads / a GPU opens; otherwise print
//!   `skipping <test>: <reason>` and return `None`, or panic under the `KVQ_REQUIRE_*` flag.
//!   Skip lines are written to the process's stderr directly, past libtest's output capture, so
//!   they show in a plain `cargo test` run; the summary still counts such a test as passed, so
//!   new tests use the harness instead.

use std::fmt::Display;
use std::io::Write;

use crate::device::Device;
use crate::nvrtc::{self, NvrtcVersion};

#[cfg(feature = "testing")]
pub mod harness;
#[cfg(feature = "testing")]
pub mod layer_stack;

/// Environment variable that repeats a randomized test run: the seed [`run_seed`] returns.
pub const KVQ_SEED: &str = "KVQ_SEED";

/// The seed of a randomized test run: `KVQ_SEED` when set, else the clock's nanoseconds
/// (fresh inputs each run). Printed as `KVQ_SEED=<seed>`, so a failing run can be repeated.
pub fn run_seed() -> u64 {
    let s = std::env::var(KVQ_SEED)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("{KVQ_SEED}={s}");
    s
}

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
    /// What this machine lacks for the need, if anything: opens device 0 (for [`Need::Gpu`]) and
    /// loads NVRTC. A missing GPU is required by `KVQ_REQUIRE_GPU`; a missing NVRTC by
    /// `KVQ_REQUIRE_NVRTC` or `KVQ_REQUIRE_GPU` (every kvq GPU test JIT-compiles).
    pub fn missing(self) -> Option<Skip> {
        if self == Need::Gpu {
            if let Err(e) = Device::open(0) {
                return Some(
                    Skip::unless(
                        &[KVQ_REQUIRE_GPU],
                        format!("no usable GPU: {}", e.summary()),
                    )
                    .with_detail(e),
                );
            }
        }
        nvrtc::version().err().map(|e| {
            Skip::unless(
                &[KVQ_REQUIRE_NVRTC, KVQ_REQUIRE_GPU],
                format!("NVRTC is unusable: {}", e.summary()),
            )
            .with_detail(e)
        })
    }

    /// Looks at the machine ([`Need::missing`]) and the `KVQ_REQUIRE_*` flags.
    pub fn gate(self) -> Gate {
        self.missing().map_or(Gate::Run, |skip| skip.gate())
    }
}

/// A test cannot run here: why, and the `KVQ_REQUIRE_*` flags under which that is a failure
/// rather than a skip. Test bodies under [`Need::gate`]'s kind of harness return it (as
/// `Err(Skip)`) for what they find missing once they run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skip {
    reason: String,
    detail: Option<String>,
    required_by: &'static [&'static str],
}

impl Skip {
    /// A skip that no flag turns into a failure (the test checks something that only a
    /// machine *without* a library shows, say).
    pub fn because(reason: impl Display) -> Skip {
        Skip::unless(&[], reason)
    }

    /// A skip for `reason`, a failure when any of `flags` is set to a true value.
    pub fn unless(flags: &'static [&'static str], reason: impl Display) -> Skip {
        Skip {
            reason: reason.to_string(),
            detail: None,
            required_by: flags,
        }
    }

    /// Adds the full story behind the one-line reason (an error's whole message, with what to
    /// do), for the failure message only: the summary line of a skip stays short.
    pub fn with_detail(self, detail: impl Display) -> Skip {
        Skip {
            detail: Some(detail.to_string()),
            ..self
        }
    }

    /// Why the test cannot run, in a line.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// [`Gate::Fail`] naming the first of the flags that is set (with the detail), else
    /// [`Gate::Skip`] with the one-line reason.
    pub fn gate(&self) -> Gate {
        match self.required_by.iter().find(|flag| env_flag(flag)) {
            Some(flag) => Gate::Fail(match &self.detail {
                Some(detail) => format!("{flag}=1 but {}\n{detail}", self.reason),
                None => format!("{flag}=1 but {}", self.reason),
            }),
            None => Gate::Skip(self.reason.clone()),
        }
    }
}

impl Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
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

/// The C compiler the fake-library tests build with (`$CC`, else `cc`), once `<cc> --version`
/// runs; otherwise a [`Skip`] that `KVQ_REQUIRE_CC=1` makes a failure.
pub fn c_compiler() -> Result<String, Skip> {
    host_compiler("CC", "cc", "C")
}

/// The C++ compiler (`$CXX`, else `c++`) of the tests that compile kernel headers for the host,
/// as [`c_compiler`] finds its compiler.
pub fn cxx_compiler() -> Result<String, Skip> {
    host_compiler("CXX", "c++", "C++")
}

fn host_compiler(var: &str, default: &str, language: &str) -> Result<String, Skip> {
    let cc = std::env::var(var).unwrap_or_else(|_| default.to_string());
    let missing =
        |why: String| Skip::unless(&[KVQ_REQUIRE_CC], format!("no {language} compiler: {why}"));
    match std::process::Command::new(&cc).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(cc),
        Ok(out) => Err(missing(format!(
            "`{cc} --version` exited with {}",
            out.status
        ))),
        Err(e) => Err(missing(format!("`{cc}`: {e}"))),
    }
}

/// Compiles `c_source` with the C compiler `cc` (see [`c_compiler`]) into a shared library at
/// `dir/names[0]` and copies it to the other names; `Err` says what failed.
pub fn build_fake_library(
    cc: &str,
    dir: &std::path::Path,
    names: &[&str],
    c_source: &str,
) -> Result<(), String> {
    let first = names.first().ok_or("no file name given")?;
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let source = dir.join(format!("{first}.c"));
    std::fs::write(&source, c_source).map_err(|e| format!("write {}: {e}", source.display()))?;
    let out = std::process::Command::new(cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join(first))
        .arg(&source)
        .output()
        .map_err(|e| format!("run `{cc}`: {e}"))?;
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
    Ok(())
}
