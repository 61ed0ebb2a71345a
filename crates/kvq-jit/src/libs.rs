//! Whether the CUDA shared libraries can be used, checked *before* any cudarc call.
//!
//! cudarc (feature `dynamic-loading`) opens `libcuda` and `libnvrtc` lazily on the first call into
//! them, resolves each entry point on its own first call, and **panics** when the library or the
//! entry point is missing. Every path in this crate that reaches cudarc's driver or NVRTC
//! functions first calls [`ensure_driver`] or [`ensure_nvrtc`]. Once per process, those open the
//! library exactly as cudarc will (its candidate names, in its order, through the same loader),
//! resolve every entry point in [`DRIVER_ENTRY_POINTS`] / [`NVRTC_ENTRY_POINTS`], and make the
//! first call (`cuDriverGetVersion` / `nvrtcVersion`) under [`std::panic::catch_unwind`]. A
//! missing library, a missing entry point, a version kvq cannot use, or a panic inside the
//! bindings becomes a typed [`JitError`] naming the file, the symbol and what to do.
//!
//! The answer is computed once per process: the dynamic loader reads `LD_LIBRARY_PATH` at program
//! start, so it cannot change later.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use crate::error::{JitError, Result, DRIVER_LIBRARY, NVRTC_LIBRARY};
use crate::version::{DriverVersion, NvrtcVersion};

/// The CUDA major version cudarc's bindings are built for (its `cuda-13000` feature): the NVRTC
/// kvq loads must be this major, and the driver at least this major to load what it compiles.
pub const CUDA_MAJOR: u32 = 13;

/// An entry point of a CUDA library, with the CUDA version whose library first exported it under
/// this exact name (versioned names such as `cuEventElapsedTime_v2` are newer than the plain
/// ones). The version tells "this library is too old" from "this is not a complete library".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryPoint {
    /// The symbol, exactly as cudarc looks it up.
    pub name: &'static str,
    /// `(major, minor)` of the first CUDA release that has it.
    pub since: (u32, u32),
}

const fn entry(name: &'static str, major: u32, minor: u32) -> EntryPoint {
    EntryPoint {
        name,
        since: (major, minor),
    }
}

/// Every `libcuda` entry point kvq can reach, called directly (`cudarc::driver::sys`) or through
/// cudarc's `result` and safe API (`CudaContext`, `CudaStream`, `CudaSlice`, `CudaEvent`,
/// `CudaModule`, `CudaFunction`, the launch builder, and their `Drop`s).
///
/// To keep it current: when kvq (any crate) starts using another cudarc driver function or
/// method, read which `sys::cu*` functions it calls (cudarc's `driver/result.rs` and
/// `driver/safe/*.rs`, including the `Drop` impls and the event tracking behind
/// `device_ptr`), and add each under the name its `load::<_F>("…")` gets in `driver/sys/mod.rs`
/// for the enabled `cuda-*` feature. A unit test checks that every `sys::cu*` call written in
/// the workspace's sources (this crate's and its siblings') is listed.
pub const DRIVER_ENTRY_POINTS: &[EntryPoint] = &[
    // Start-up and error text (`device_count`, `driver_version`, `DriverError` descriptions).
    entry("cuInit", 2, 0),
    entry("cuDriverGetVersion", 2, 2),
    entry("cuGetErrorName", 6, 0),
    entry("cuGetErrorString", 6, 0),
    // Device queries (`Device::open`).
    entry("cuDeviceGet", 2, 0),
    entry("cuDeviceGetCount", 2, 0),
    entry("cuDeviceGetName", 2, 0),
    entry("cuDeviceGetAttribute", 2, 0),
    entry("cuDeviceTotalMem_v2", 3, 2),
    // The primary context (`CudaContext::new`, its `Drop`, `bind_to_thread`, `synchronize`).
    entry("cuDevicePrimaryCtxRetain", 7, 0),
    entry("cuDevicePrimaryCtxRelease_v2", 11, 0),
    entry("cuCtxGetCurrent", 4, 0),
    entry("cuCtxSetCurrent", 4, 0),
    entry("cuCtxSynchronize", 2, 0),
    // A caller's stream: its context and that context's device (`stream_device`).
    entry("cuStreamGetCtx", 9, 2),
    entry("cuCtxPushCurrent_v2", 4, 0),
    entry("cuCtxPopCurrent_v2", 4, 0),
    entry("cuCtxGetDevice", 2, 0),
    // Modules and kernels (`Module::load`, `Module::function`, `allow_dynamic_shared`, the
    // occupancy query of `DecodeKernel`).
    entry("cuModuleLoadData", 2, 0),
    entry("cuModuleGetFunction", 2, 0),
    entry("cuModuleUnload", 2, 0),
    entry("cuFuncSetAttribute", 9, 0),
    entry("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", 6, 5),
    // Launches (cudarc's launch builder; `launch.rs`, with programmatic dependent launch).
    entry("cuLaunchKernel", 4, 0),
    entry("cuLaunchKernelEx", 12, 0),
    // Memory: stream-ordered allocation where the device has memory pools, plain otherwise.
    entry("cuMemAlloc_v2", 3, 2),
    entry("cuMemAllocAsync", 11, 2),
    entry("cuMemFree_v2", 3, 2),
    entry("cuMemFreeAsync", 11, 2),
    entry("cuMemGetInfo_v2", 3, 2),
    entry("cuMemsetD8Async", 3, 2),
    entry("cuMemcpyHtoDAsync_v2", 3, 2),
    entry("cuMemcpyDtoHAsync_v2", 3, 2),
    entry("cuMemcpyDtoDAsync_v2", 3, 2),
    entry("cuMemcpyPeerAsync", 4, 0),
    // Streams and events (`new_stream`, cudarc's per-buffer event tracking, timing).
    entry("cuStreamCreate", 2, 0),
    entry("cuStreamDestroy_v2", 4, 0),
    entry("cuStreamSynchronize", 2, 0),
    entry("cuStreamWaitEvent", 3, 2),
    entry("cuEventCreate", 2, 0),
    entry("cuEventRecord", 2, 0),
    entry("cuEventDestroy_v2", 4, 0),
    entry("cuEventElapsedTime_v2", 12, 8),
];

/// Every `libnvrtc` entry point kvq calls (all from [`crate::nvrtc`], through
/// `cudarc::nvrtc::sys`). Keep current as [`DRIVER_ENTRY_POINTS`] says; the same unit test
/// checks the `sys::nvrtc*` calls of this crate's source against it.
pub const NVRTC_ENTRY_POINTS: &[EntryPoint] = &[
    entry("nvrtcVersion", 7, 0),
    entry("nvrtcGetNumSupportedArchs", 11, 2),
    entry("nvrtcGetSupportedArchs", 11, 2),
    entry("nvrtcCreateProgram", 7, 0),
    entry("nvrtcCompileProgram", 7, 0),
    entry("nvrtcDestroyProgram", 7, 0),
    entry("nvrtcGetProgramLogSize", 7, 0),
    entry("nvrtcGetProgramLog", 7, 0),
    entry("nvrtcGetPTXSize", 7, 0),
    entry("nvrtcGetPTX", 7, 0),
    entry("nvrtcGetCUBINSize", 11, 1),
    entry("nvrtcGetCUBIN", 11, 1),
];

/// Which CUDA library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lib {
    Driver,
    Nvrtc,
}

impl Lib {
    /// The stem cudarc searches for first (`lib{stem}.so…`).
    fn stem(self) -> &'static str {
        match self {
            Lib::Driver => "cuda",
            Lib::Nvrtc => "nvrtc",
        }
    }

    /// Every stem cudarc's loader tries, in its order (Windows names its driver `nvcuda`).
    fn load_stems(self) -> &'static [&'static str] {
        match self {
            Lib::Driver => &["cuda", "nvcuda"],
            Lib::Nvrtc => &["nvrtc"],
        }
    }

    fn entry_points(self) -> &'static [EntryPoint] {
        match self {
            Lib::Driver => DRIVER_ENTRY_POINTS,
            Lib::Nvrtc => NVRTC_ENTRY_POINTS,
        }
    }

    /// What the library is, in messages.
    pub(crate) fn what(self) -> &'static str {
        match self {
            Lib::Driver => DRIVER_LIBRARY,
            Lib::Nvrtc => NVRTC_LIBRARY,
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

/// A library that loaded and passed the checks, kept open for the life of the process.
struct Loaded {
    /// `name (path)`, as messages show it.
    file: String,
    /// The first call's answer (`cuDriverGetVersion` / `nvrtcVersion`): `(major, minor)`, or the
    /// error code's name and description.
    version: std::result::Result<(u32, u32), (String, String)>,
    _handle: libloading::Library,
}

/// Why a library cannot be used; turned into a [`JitError`] on every ask.
#[derive(Clone, Debug)]
enum Failure {
    NotFound,
    MissingSymbols {
        file: String,
        missing: Vec<EntryPoint>,
        version: Option<(u32, u32)>,
    },
    Panicked {
        file: String,
        call: &'static str,
        message: String,
    },
    NvrtcMajor {
        file: String,
        version: (u32, u32),
    },
}

type Probe = std::result::Result<Loaded, Failure>;

fn driver_probe() -> &'static Probe {
    static PROBE: OnceLock<Probe> = OnceLock::new();
    PROBE.get_or_init(|| probe(Lib::Driver))
}

fn nvrtc_probe() -> &'static Probe {
    static PROBE: OnceLock<Probe> = OnceLock::new();
    PROBE.get_or_init(|| probe(Lib::Nvrtc))
}

/// The first of cudarc's candidates that the loader opens: the very library cudarc will use, as
/// it tries the same names in the same order (a second `dlopen` of a name returns the object
/// already loaded).
fn open_first(lib: Lib) -> Option<(String, libloading::Library)> {
    for stem in lib.load_stems() {
        for name in cudarc::get_lib_name_candidates(stem) {
            // SAFETY: loading runs the library's initialisers, exactly as cudarc's own first
            // call would.
            if let Ok(handle) = unsafe { libloading::Library::new(&name) } {
                return Some((name, handle));
            }
        }
    }
    None
}

fn symbol_address(handle: &libloading::Library, name: &str) -> Option<*const c_void> {
    // SAFETY: the symbol is only looked up; its address is read, never called through this type.
    unsafe {
        handle
            .get::<*const c_void>(name.as_bytes())
            .ok()
            .map(|s| *s)
    }
}

/// `name (path)` where the loader reveals the path of the object behind a found symbol.
fn describe_file(name: &str, handle: &libloading::Library, entries: &[EntryPoint]) -> String {
    let path = entries
        .iter()
        .find_map(|e| symbol_address(handle, e.name))
        .and_then(object_path);
    match path {
        Some(p) if p != name => format!("{name} ({p})"),
        _ => name.to_string(),
    }
}

#[cfg(unix)]
fn object_path(address: *const c_void) -> Option<String> {
    // SAFETY: `dladdr` only reads the loader's tables; `info` is plain data it fills in, and
    // `dli_fname` (when set) points at a NUL-terminated string owned by the loader.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(address, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        Some(
            std::ffi::CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

#[cfg(not(unix))]
fn object_path(_address: *const c_void) -> Option<String> {
    None
}

/// Runs `f`, the first call into a library through cudarc, turning a panic into a message.
fn catch<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string())
    })
}

/// `cuDriverGetVersion` through cudarc: `(major, minor)` or the error's name and description.
/// `describe`: whether the driver's error-text entry points are there to describe a failure.
fn call_driver_version(describe: bool) -> std::result::Result<(u32, u32), (String, String)> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: the library is loaded and exports the symbol (checked by the caller); `v` is valid
    // for writes. Needs no cuInit.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    match r.result() {
        Ok(()) => {
            let v = v.max(0) as u32;
            Ok((v / 1000, (v % 1000) / 10))
        }
        Err(e) if describe => Err(crate::error::describe_driver_error(e)),
        Err(e) => Err((
            format!("{:?}", e.0),
            "no description from the driver".into(),
        )),
    }
}

/// `nvrtcVersion` through cudarc.
fn call_nvrtc_version() -> std::result::Result<(u32, u32), (String, String)> {
    let (mut major, mut minor): (std::ffi::c_int, std::ffi::c_int) = (0, 0);
    // SAFETY: the library is loaded and exports the symbol (checked by the caller); both
    // pointers are valid for writes.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        Ok((major.max(0) as u32, minor.max(0) as u32))
    } else {
        Err((format!("{r:?}"), "nvrtcVersion failed".to_string()))
    }
}

fn probe(lib: Lib) -> Probe {
    let (name, handle) = open_first(lib).ok_or(Failure::NotFound)?;
    let entries = lib.entry_points();
    let file = describe_file(&name, &handle, entries);
    let missing: Vec<EntryPoint> = entries
        .iter()
        .filter(|e| symbol_address(&handle, e.name).is_none())
        .copied()
        .collect();
    let (call, version_symbol): (&'static str, &str) = match lib {
        Lib::Driver => ("cuDriverGetVersion", "cuDriverGetVersion"),
        Lib::Nvrtc => ("nvrtcVersion", "nvrtcVersion"),
    };
    // The first call through cudarc, only when its symbol is there, and never letting a panic of
    // the bindings out.
    let version = if missing.iter().any(|e| e.name == version_symbol) {
        None
    } else {
        let answer = match lib {
            Lib::Driver => {
                let describe = !missing.iter().any(|e| e.name.starts_with("cuGetError"));
                catch(|| call_driver_version(describe))
            }
            Lib::Nvrtc => catch(call_nvrtc_version),
        };
        match answer {
            Ok(v) => Some(v),
            Err(message) => {
                return Err(Failure::Panicked {
                    file,
                    call,
                    message,
                })
            }
        }
    };
    let known = version.as_ref().and_then(|v| v.as_ref().ok().copied());
    if lib == Lib::Nvrtc {
        if let Some(v) = known {
            if v.0 != CUDA_MAJOR {
                return Err(Failure::NvrtcMajor { file, version: v });
            }
        }
    }
    if !missing.is_empty() {
        return Err(Failure::MissingSymbols {
            file,
            missing,
            version: known,
        });
    }
    Ok(Loaded {
        file,
        version: version.unwrap_or_else(|| Err(("unknown".into(), "no version call".into()))),
        _handle: handle,
    })
}

fn failure_error(lib: Lib, failure: &Failure) -> JitError {
    match failure {
        Failure::NotFound => match lib {
            Lib::Driver => JitError::DriverNotFound {
                primary: primary_name(Lib::Driver),
                tried: candidates(Lib::Driver),
            },
            Lib::Nvrtc => JitError::NvrtcNotFound {
                primary: primary_name(Lib::Nvrtc),
                tried: candidates(Lib::Nvrtc),
            },
        },
        Failure::MissingSymbols {
            file,
            missing,
            version,
        } => {
            // A library older than the first release with a missing name is too old; one that
            // should have it is not a complete library (a stub, a partial copy, a wrapper).
            let too_old =
                version.and_then(|v| missing.iter().find(|e| e.since > v).map(|e| (v, e)));
            match (lib, too_old) {
                (Lib::Driver, Some((v, e))) => JitError::DriverTooOld {
                    library: file.clone(),
                    symbol: e.name.to_string(),
                    since: format!("{}.{}", e.since.0, e.since.1),
                    driver: DriverVersion {
                        major: v.0,
                        minor: v.1,
                    }
                    .to_string(),
                },
                _ => JitError::LibraryIncomplete {
                    what: lib.what(),
                    library: file.clone(),
                    symbol: missing[0].name.to_string(),
                    others: missing.len() - 1,
                    advice: install_advice(lib),
                },
            }
        }
        Failure::Panicked {
            file,
            call,
            message,
        } => JitError::LibraryPanicked {
            what: lib.what(),
            library: file.clone(),
            call: call.to_string(),
            message: message.clone(),
            advice: install_advice(lib),
        },
        Failure::NvrtcMajor { file, version } => JitError::NvrtcVersionMismatch {
            library: file.clone(),
            found: NvrtcVersion {
                major: version.0,
                minor: version.1,
            },
            expected_major: CUDA_MAJOR,
        },
    }
}

/// What to do about an unusable library.
fn install_advice(lib: Lib) -> String {
    match lib {
        Lib::Driver => format!(
            "install the NVIDIA driver for CUDA {CUDA_MAJOR} or newer (R580 or newer), or remove \
             the folder that holds this file from LD_LIBRARY_PATH so the system's driver is found"
        ),
        Lib::Nvrtc => format!(
            "install NVRTC for CUDA {CUDA_MAJOR} (`python3 -m pip install \
             nvidia-cuda-nvrtc=={CUDA_MAJOR}.0.*`) and put its folder first on LD_LIBRARY_PATH, \
             or remove the folder that holds this file from LD_LIBRARY_PATH"
        ),
    }
}

fn check(lib: Lib) -> Result<&'static Loaded> {
    let probe = match lib {
        Lib::Driver => driver_probe(),
        Lib::Nvrtc => nvrtc_probe(),
    };
    probe.as_ref().map_err(|f| failure_error(lib, f))
}

/// Whether a CUDA driver library (`libcuda`) loads at all (it may still be unusable:
/// [`ensure_driver`] says).
pub fn driver_present() -> bool {
    !matches!(driver_probe(), Err(Failure::NotFound))
}

/// Whether an NVRTC library (`libnvrtc.so.13` and friends) loads at all (it may still be
/// unusable: [`ensure_nvrtc`] says).
pub fn nvrtc_present() -> bool {
    !matches!(nvrtc_probe(), Err(Failure::NotFound))
}

/// `Ok` when `libcuda` loads and exports every entry point of [`DRIVER_ENTRY_POINTS`]; else
/// [`JitError::DriverNotFound`], [`JitError::DriverTooOld`],
/// [`JitError::LibraryIncomplete`] or [`JitError::LibraryPanicked`].
pub fn ensure_driver() -> Result<()> {
    check(Lib::Driver).map(|_| ())
}

/// `Ok` when `libnvrtc` loads, is NVRTC [`CUDA_MAJOR`] and exports every entry point of
/// [`NVRTC_ENTRY_POINTS`]; else [`JitError::NvrtcNotFound`],
/// [`JitError::NvrtcVersionMismatch`], [`JitError::LibraryIncomplete`] or
/// [`JitError::LibraryPanicked`].
pub fn ensure_nvrtc() -> Result<()> {
    check(Lib::Nvrtc).map(|_| ())
}

/// The driver's CUDA version (`cuDriverGetVersion`, asked once).
pub(crate) fn driver_version() -> Result<DriverVersion> {
    match &check(Lib::Driver)?.version {
        Ok((major, minor)) => Ok(DriverVersion {
            major: *major,
            minor: *minor,
        }),
        Err((code, description)) => Err(JitError::Driver {
            call: "cuDriverGetVersion".into(),
            code: code.clone(),
            description: description.clone(),
        }),
    }
}

/// The NVRTC version (`nvrtcVersion`, asked once).
pub(crate) fn nvrtc_version() -> Result<NvrtcVersion> {
    match &check(Lib::Nvrtc)?.version {
        Ok((major, minor)) => Ok(NvrtcVersion {
            major: *major,
            minor: *minor,
        }),
        Err((code, _)) => Err(JitError::Nvrtc {
            call: "nvrtcVersion".into(),
            code: code.clone(),
        }),
    }
}

/// The driver library as messages name it (`libcuda.so.1 (/usr/lib/…)`), once it passed.
pub(crate) fn driver_file() -> String {
    match driver_probe() {
        Ok(l) => l.file.clone(),
        Err(_) => primary_name(Lib::Driver),
    }
}

/// Runs `f`, a call into `libcuda` through cudarc's safe API that starts a GPU session (cuInit,
/// context creation), turning a panic inside the bindings into
/// [`JitError::LibraryPanicked`]. The entry-point check makes such a panic unexpected; this
/// keeps a library bug or an unlisted entry point from taking down a host engine. Not for hot
/// calls.
pub(crate) fn guard_driver<T>(call: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch(f).unwrap_or_else(|message| {
        Err(JitError::LibraryPanicked {
            what: Lib::Driver.what(),
            library: driver_file(),
            call: call.to_string(),
            message,
            advice: install_advice(Lib::Driver),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primary_names_are_the_versioned_sonames() {
        if cfg!(target_os = "linux") {
            assert_eq!(
                primary_name(Lib::Nvrtc),
                format!("libnvrtc.so.{CUDA_MAJOR}")
            );
            assert_eq!(primary_name(Lib::Driver), "libcuda.so.1");
        }
        let c = candidates(Lib::Nvrtc);
        assert!(!c.is_empty());
        let mut dedup = c.clone();
        dedup.dedup();
        assert_eq!(c.len(), dedup.len());
    }

    /// Every `sys::cu*(` / `sys::nvrtc*(` call written in the workspace's sources is in the lists
    /// (calls through cudarc's safe API are listed by reading cudarc: see the lists' docs).
    #[test]
    fn direct_calls_in_the_workspace_are_listed() {
        fn visit(dir: &std::path::Path, found: &mut Vec<(String, String)>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for e in entries.flatten() {
                let path = e.path();
                if path.is_dir() {
                    visit(&path, found);
                } else if path.extension().is_some_and(|x| x == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    for (i, _) in text.match_indices("sys::") {
                        let rest = &text[i + 5..];
                        let name: String = rest
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        let called = rest[name.len()..].starts_with('(');
                        if called && (name.starts_with("cu") || name.starts_with("nvrtc")) {
                            found.push((path.display().to_string(), name));
                        }
                    }
                }
            }
        }
        let mut found = Vec::new();
        let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        visit(&here.join("src"), &mut found);
        // The crates beside this one in the workspace (kvq-runtime and its dependants) reach the
        // driver through the same checks, so their direct calls must be listed too.
        if let Some(Ok(siblings)) = here.parent().map(std::fs::read_dir) {
            for crate_dir in siblings.flatten().map(|e| e.path()) {
                if crate_dir != here {
                    visit(&crate_dir.join("src"), &mut found);
                }
            }
        }
        assert!(found.iter().any(|(_, n)| n == "nvrtcCompileProgram"));
        assert!(found.iter().any(|(_, n)| n == "cuLaunchKernelEx"));
        for (file, name) in found {
            let listed = DRIVER_ENTRY_POINTS
                .iter()
                .chain(NVRTC_ENTRY_POINTS)
                .any(|e| e.name == name);
            assert!(listed, "{file} calls sys::{name}, which is in neither list");
        }
    }

    #[test]
    fn lists_have_no_duplicates() {
        for list in [DRIVER_ENTRY_POINTS, NVRTC_ENTRY_POINTS] {
            for (i, a) in list.iter().enumerate() {
                assert!(
                    !list[i + 1..].iter().any(|b| b.name == a.name),
                    "{}",
                    a.name
                );
            }
        }
    }

    #[test]
    fn a_missing_new_symbol_on_an_old_driver_reads_as_too_old() {
        let missing = vec![entry("cuEventElapsedTime_v2", 12, 8)];
        let old = failure_error(
            Lib::Driver,
            &Failure::MissingSymbols {
                file: "libcuda.so.1 (/x/libcuda.so.1)".into(),
                missing: missing.clone(),
                version: Some((12, 4)),
            },
        );
        assert!(matches!(old, JitError::DriverTooOld { .. }), "{old}");
        let text = old.to_string();
        assert!(
            text.contains("cuEventElapsedTime_v2") && text.contains("12.8"),
            "{text}"
        );
        let broken = failure_error(
            Lib::Driver,
            &Failure::MissingSymbols {
                file: "libcuda.so.1".into(),
                missing: vec![entry("cuInit", 2, 0)],
                version: None,
            },
        );
        assert!(
            matches!(broken, JitError::LibraryIncomplete { .. }),
            "{broken}"
        );
        assert!(broken.is_environment());
    }
}
