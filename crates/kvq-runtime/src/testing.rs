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
