//! Whether the CUDA shared libraries can be loaded, checked *before* any cudarc call.
//!
//! cudarc (feature `dynamic-loading`) opens `libcuda` and `libnvrtc` lazily on the first call into
//! them and **panics** when they are missing. Every path in this crate that reaches cudarc's
//! driver or NVRTC functions first calls [`ensure_driver`] or [`ensure_nvrtc`], which ask cudarc's
//! own `is_culib_present()` (the same candidate names, the same loader search) and turn a missing
//! library into a typed [`RuntimeError`].
//!
//! The answer is computed once per process: the dynamic loader reads `LD_LIBRARY_PATH` at program
//! start, so it cannot change later.

use std::sync::OnceLock;

use crate::error::{Result, RuntimeError};

/// Which CUDA library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lib {
    Driver,
    Nvrtc,
}

impl Lib {
    /// The stem cudarc searches for (`lib{stem}.so…`).
    fn stem(self) -> &'static str {
        match self {
            Lib::Driver => "cuda",
            Lib::Nvrtc => "nvrtc",
        }
    }
}

/// The file names cudarc tries for `lib`, in its order, without duplicates.
pub(crate) fn candidates(lib: Lib) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for name in cudarc::get_lib_name_candidates(lib.stem()) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// The file a user should provide: `libnvrtc.so.13` for cudarc's `cuda-13000` feature (the first
/// `lib{stem}.so.{major}` candidate), and the driver's soname `libcuda.so.1` on Linux; cudarc's
/// first candidate on other platforms.
pub(crate) fn primary_name(lib: Lib) -> String {
    let all = candidates(lib);
    if lib == Lib::Driver && cfg!(target_os = "linux") {
        return "libcuda.so.1".to_string();
    }
    let versioned_prefix = format!(
        "{}{}{}.",
        std::env::consts::DLL_PREFIX,
        lib.stem(),
        std::env::consts::DLL_SUFFIX
    );
    all.iter()
        .find(|n| n.starts_with(&versioned_prefix))
        .or_else(|| all.first())
        .cloned()
        .unwrap_or_else(|| lib.stem().to_string())
}

/// Whether the CUDA driver library (`libcuda`) can be loaded.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's candidate names and drops
    // whatever it opened; it never calls into the library.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

/// Whether the NVRTC library (`libnvrtc.so.13` and friends) can be loaded.
pub fn nvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: as in `driver_present`.
    *PRESENT.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
}

/// `Ok` when `libcuda` can be loaded, else [`RuntimeError::DriverNotFound`].
pub fn ensure_driver() -> Result<()> {
    if driver_present() {
        Ok(())
    } else {
        Err(RuntimeError::DriverNotFound {
            primary: primary_name(Lib::Driver),
            tried: candidates(Lib::Driver),
        })
    }
}

/// `Ok` when `libnvrtc` can be loaded, else [`RuntimeError::NvrtcNotFound`].
pub fn ensure_nvrtc() -> Result<()> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(RuntimeError::NvrtcNotFound {
            primary: primary_name(Lib::Nvrtc),
            tried: candidates(Lib::Nvrtc),
        })
    }
}

/// Whether the loaded driver exports `symbol` (newer cudarc bindings call versioned entry points,
/// e.g. `cuEventElapsedTime_v2`, that older drivers lack; cudarc panics on a missing symbol).
pub(crate) fn driver_has_symbol(symbol: &str) -> bool {
    if !driver_present() {
        return false;
    }
    // SAFETY: the library is present (checked above), so `culib()` does not panic; we only look
    // the symbol up and never call it through this pointer type.
    unsafe {
        cudarc::driver::sys::culib()
            .get::<*const std::ffi::c_void>(symbol.as_bytes())
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primary_names_are_the_versioned_sonames() {
        if cfg!(target_os = "linux") {
            assert_eq!(primary_name(Lib::Nvrtc), "libnvrtc.so.13");
            assert_eq!(primary_name(Lib::Driver), "libcuda.so.1");
        }
        let c = candidates(Lib::Nvrtc);
        assert!(!c.is_empty());
        let mut dedup = c.clone();
        dedup.dedup();
        assert_eq!(c.len(), dedup.len());
    }
}
