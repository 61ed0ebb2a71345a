//! The error type of the JIT layer, [`JitError`], with messages a user can act on.
//!
//! Each variant says what failed, what was looked at, and what to do about it. Compile failures
//! carry NVRTC's log with the generated source quoted, line-numbered, around every error
//! ([`CompileFailure`]); a missing CUDA header names every folder that was searched
//! ([`MissingHeader`]). Nothing in this crate panics on a missing library, a missing GPU or a
//! bad kernel: those all come back as values of this type.

use std::fmt;
use std::path::PathBuf;

use crate::arch::{Arch, InvalidArch};
use crate::diagnostics::Diagnostic;
use crate::include::IncludeCandidate;
use crate::version::{DriverVersion, NvrtcVersion};

/// `Result` with [`JitError`].
pub type Result<T, E = JitError> = std::result::Result<T, E>;

/// The `what` of a library error about `libcuda`.
pub(crate) const DRIVER_LIBRARY: &str = "CUDA driver library";
/// The `what` of a library error about `libnvrtc`.
pub(crate) const NVRTC_LIBRARY: &str = "NVRTC library";

/// Everything that can go wrong between CUDA source and a finished launch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JitError {
    /// `libcuda` could not be loaded.
    #[error(
        "CUDA driver library not found: could not load {primary} through the dynamic loader \
         (LD_LIBRARY_PATH, then the system library path). Install the NVIDIA driver, or add the \
         folder that holds {primary} to LD_LIBRARY_PATH before starting the program. (Names \
         tried: {}.)",
        tried.join(", ")
    )]
    DriverNotFound {
        /// The file the driver normally provides (`libcuda.so.1`).
        primary: String,
        /// Every name cudarc tried.
        tried: Vec<String>,
    },

    /// `libnvrtc` could not be loaded.
    #[error(
        "NVRTC library not found: could not load {primary} through the dynamic loader \
         (LD_LIBRARY_PATH, then the system library path; CUDA_HOME is not searched). Install \
         NVRTC for CUDA 13 (a CUDA 13 toolkit, or `python3 -m pip install \
         nvidia-cuda-nvrtc==13.0.*`) and add the folder that holds {primary} (for the pip \
         package: <site-packages>/nvidia/cu13/lib) to LD_LIBRARY_PATH before starting the \
         program. (Names tried: {}.)",
        tried.join(", ")
    )]
    NvrtcNotFound {
        /// The file to provide (`libnvrtc.so.13`).
        primary: String,
        /// Every name cudarc tried.
        tried: Vec<String>,
    },

    /// The driver loaded but there is no GPU with this ordinal.
    #[error("{}", no_gpu_message(*ordinal, *count))]
    NoGpu {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },

    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {code}: {description}")]
    Driver {
        /// What was being done (`cuInit`, `create context on GPU 0`, …).
        call: String,
        /// The `CUresult` name.
        code: String,
        /// The driver's description of it.
        description: String,
    },

    /// The driver library is older than an entry point kvq calls.
    #[error(
        "the CUDA driver {library} is {driver}, older than CUDA {since}, which introduced `{symbol}` \
         that kvq calls: install the NVIDIA driver for CUDA 13 or newer (R580 or newer), or remove \
         the folder that holds this libcuda from LD_LIBRARY_PATH if a newer driver is installed"
    )]
    DriverTooOld {
        /// The file loaded (`libcuda.so.1 (/usr/lib/…/libcuda.so.1)`).
        library: String,
        /// The missing symbol.
        symbol: String,
        /// The first CUDA version that has it (`12.8`).
        since: String,
        /// The driver's CUDA version, as far as known.
        driver: String,
    },

    /// A CUDA library loaded but lacks an entry point kvq calls, though a library of its
    /// version should have it: a stub, a partial copy or a wrapper rather than the real thing.
    #[error(
        "the {what} {library} loads but lacks `{symbol}`{}, which kvq calls: it is not a complete \
         {what}. Fix: {advice}",
        if *others == 0 { String::new() } else { format!(" (and {others} more entry points)") }
    )]
    LibraryIncomplete {
        /// `CUDA driver library` or `NVRTC library`.
        what: &'static str,
        /// The file loaded, with its path where the loader tells it.
        library: String,
        /// The first missing entry point.
        symbol: String,
        /// How many more are missing.
        others: usize,
        /// What to do.
        advice: String,
    },

    /// A call into a CUDA library panicked inside the Rust bindings (caught: the library is
    /// unusable in this process, nothing else is affected).
    #[error(
        "the {what} {library} failed in its first call `{call}` inside the CUDA bindings \
         ({message}). Fix: {advice}"
    )]
    LibraryPanicked {
        /// `CUDA driver library` or `NVRTC library`.
        what: &'static str,
        /// The file loaded.
        library: String,
        /// The call.
        call: String,
        /// The bindings' panic message.
        message: String,
        /// What to do.
        advice: String,
    },

    /// The NVRTC found is not the major version kvq's bindings are built for.
    #[error(
        "the NVRTC library {library} is NVRTC {found}, but kvq is built for NVRTC \
         {expected_major} (cudarc's CUDA {expected_major} bindings): install NVRTC for CUDA \
         {expected_major} (`python3 -m pip install nvidia-cuda-nvrtc=={expected_major}.0.*`) and put \
         its folder (<site-packages>/nvidia/cu{expected_major}/lib) first on LD_LIBRARY_PATH"
    )]
    NvrtcVersionMismatch {
        /// The file loaded.
        library: String,
        /// Its version.
        found: NvrtcVersion,
        /// The major version kvq needs.
        expected_major: u32,
    },

    /// The driver cannot load what the NVRTC compiles (a driver older than the NVRTC).
    #[error(
        "the CUDA driver supports {driver} but NVRTC is {nvrtc}: a driver cannot load {output} \
         from a newer NVRTC. Update the NVIDIA driver to one for CUDA {nvrtc} or newer (R580 or \
         newer for CUDA 13)"
    )]
    DriverOlderThanNvrtc {
        /// The driver's CUDA version.
        driver: DriverVersion,
        /// The NVRTC version.
        nvrtc: NvrtcVersion,
        /// `CUBIN` (needs the driver's major version at least) or `PTX` (needs its version).
        output: &'static str,
    },

    /// An NVRTC call other than the compilation itself failed.
    #[error("NVRTC call {call} failed: {code}")]
    Nvrtc {
        /// Which call.
        call: String,
        /// The `nvrtcResult` name.
        code: String,
    },

    /// NVRTC rejected the source; the message quotes the source around each error.
    #[error("{0}")]
    Compile(Box<CompileFailure>),

    /// The source includes a header that is in none of the include folders.
    #[error("{0}")]
    MissingHeader(Box<MissingHeader>),

    /// The loaded NVRTC cannot target this architecture.
    #[error(
        "NVRTC {nvrtc} cannot compile for {arch}: it supports {}",
        supported.iter().map(|a| format!("sm_{a}")).collect::<Vec<_>>().join(", ")
    )]
    UnsupportedArch {
        /// The architecture asked for.
        arch: Arch,
        /// The NVRTC version loaded.
        nvrtc: NvrtcVersion,
        /// `nvrtcGetSupportedArchs`.
        supported: Vec<u32>,
    },

    /// An architecture name that does not parse.
    #[error(transparent)]
    InvalidArch(#[from] InvalidArch),

    /// The driver would not load a compiled module.
    #[error("could not load module `{module}` (built for {arch}): {code}: {description}{hint}")]
    ModuleLoad {
        /// The source's name.
        module: String,
        /// The architecture it was compiled for.
        arch: Arch,
        /// The `CUresult` name.
        code: String,
        /// The driver's description.
        description: String,
        /// What to try (may be empty; starts with ". " otherwise).
        hint: String,
    },

    /// A kernel name that the module does not define.
    #[error(
        "kernel `{function}` not found in module `{module}`: declare it `extern \"C\" __global__` \
         so its name is not mangled, and check the spelling"
    )]
    FunctionNotFound {
        /// The source's name.
        module: String,
        /// The kernel asked for.
        function: String,
    },

    /// A kernel launch failed, at submission or while it ran.
    #[error("kernel `{kernel}` failed {when}: {code}: {description}{hint}")]
    Launch {
        /// The kernel (or the step, for errors found at a synchronisation).
        kernel: String,
        /// `at launch` or `while running (reported at synchronize)`.
        when: String,
        /// The `CUresult` name.
        code: String,
        /// The driver's description.
        description: String,
        /// What to try (may be empty; starts with ". " otherwise).
        hint: String,
    },

    /// Reading or writing the on-disk cache failed where it could not be ignored.
    #[error("kvq cache: could not {action} {}: {source}", path.display())]
    CacheIo {
        /// What was being done (`create directory`, `write`, …).
        action: &'static str,
        /// Where.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// No place for the cache.
    #[error(
        "no cache directory: KVQ_CACHE_DIR is not set and the user cache directory is unknown \
         (HOME / XDG_CACHE_HOME unset); set KVQ_CACHE_DIR to a writable folder"
    )]
    NoCacheDir,

    /// An argument this crate cannot pass on (e.g. a NUL byte in source text, or no timed run).
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

fn no_gpu_message(ordinal: usize, count: usize) -> String {
    if count == 0 {
        "no CUDA GPU found: the driver loaded but reports 0 devices (check `nvidia-smi`, and that \
         CUDA_VISIBLE_DEVICES does not hide them)"
            .to_string()
    } else {
        format!(
            "no CUDA GPU with ordinal {ordinal}: the driver reports {count} device(s), ordinals \
             0..={} (check CUDA_VISIBLE_DEVICES)",
            count - 1
        )
    }
}

impl JitError {
    /// A failed driver call during `call`.
    pub fn driver(call: impl Into<String>, err: cudarc::driver::DriverError) -> JitError {
        let (code, description) = describe_driver_error(err);
        JitError::Driver {
            call: call.into(),
            code,
            description,
        }
    }

    /// A failed launch of `kernel`, as returned by cudarc's `LaunchArgs::launch`.
    pub fn launch(kernel: impl Into<String>, err: cudarc::driver::DriverError) -> JitError {
        let (code, description) = describe_driver_error(err);
        let hint = launch_hint(&code, false);
        JitError::Launch {
            kernel: kernel.into(),
            when: "at launch".into(),
            code,
            description,
            hint,
        }
    }

    /// An error surfaced at a synchronisation after `what` ran (kernel faults are reported there).
    pub fn async_failure(what: impl Into<String>, err: cudarc::driver::DriverError) -> JitError {
        let (code, description) = describe_driver_error(err);
        let hint = launch_hint(&code, true);
        JitError::Launch {
            kernel: what.into(),
            when: "while running (reported at synchronize)".into(),
            code,
            description,
            hint,
        }
    }

    /// Whether this error means NVRTC cannot be used here at all (absent, the wrong major
    /// version, incomplete, or failing in the bindings), as opposed to refusing one source:
    /// callers that compile only where NVRTC exists treat all of these like its absence.
    pub fn is_nvrtc_unusable(&self) -> bool {
        match self {
            JitError::NvrtcNotFound { .. } | JitError::NvrtcVersionMismatch { .. } => true,
            JitError::LibraryIncomplete { what, .. } | JitError::LibraryPanicked { what, .. } => {
                *what == NVRTC_LIBRARY
            }
            _ => false,
        }
    }

    /// Whether this error means "the machine lacks CUDA" (library, driver or GPU missing), as
    /// opposed to a bug: tests use this to decide between skipping and failing.
    pub fn is_environment(&self) -> bool {
        matches!(
            self,
            JitError::DriverNotFound { .. }
                | JitError::NvrtcNotFound { .. }
                | JitError::NoGpu { .. }
                | JitError::DriverTooOld { .. }
                | JitError::LibraryIncomplete { .. }
                | JitError::LibraryPanicked { .. }
                | JitError::NvrtcVersionMismatch { .. }
                | JitError::DriverOlderThanNvrtc { .. }
                | JitError::MissingHeader(_)
        )
    }
}

impl JitError {
    /// A short clause (about 60 characters at most) for a line such as "no usable GPU (…)": what is
    /// missing, without the list of names tried or the advice, which the full message
    /// (`Display`) and `kvq info` give. Errors without a short form are cut at a word.
    pub fn summary(&self) -> String {
        match self {
            JitError::DriverNotFound { primary, .. } => {
                format!("CUDA driver library {primary} not found")
            }
            JitError::NvrtcNotFound { primary, .. } => {
                format!("NVRTC library {primary} not found")
            }
            JitError::NoGpu { count: 0, .. } => "the driver reports no GPU".into(),
            JitError::NoGpu { ordinal, count } => {
                format!("no GPU {ordinal}: the driver reports {count}")
            }
            JitError::DriverTooOld { driver, since, .. } => {
                format!("the CUDA driver ({driver}) is older than CUDA {since}")
            }
            JitError::LibraryIncomplete { what, symbol, .. } => {
                format!("{} lacks `{symbol}`", short_library(what))
            }
            JitError::LibraryPanicked { what, call, .. } => {
                format!("{} failed in `{call}`", short_library(what))
            }
            JitError::NvrtcVersionMismatch {
                found,
                expected_major,
                ..
            } => format!("NVRTC is {found}, kvq needs NVRTC {expected_major}"),
            JitError::DriverOlderThanNvrtc { driver, nvrtc, .. } => {
                format!("the driver ({driver}) is older than NVRTC {nvrtc}")
            }
            JitError::MissingHeader(m) => format!("CUDA header `{}` not found", m.header),
            other => shorten(&other.to_string(), 60),
        }
    }
}

/// `libcuda` or `libnvrtc` for the `what` of a library error.
fn short_library(what: &str) -> &'static str {
    if what == NVRTC_LIBRARY {
        "libnvrtc"
    } else {
        "libcuda"
    }
}

/// The first line of `text`, cut at a word to at most `max` characters, with `…` when cut.
pub fn shorten(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or("");
    if line.chars().count() <= max {
        return line.to_string();
    }
    let cut: String = line.chars().take(max).collect();
    let at = cut.rfind(' ').unwrap_or(cut.len());
    format!("{}…", cut[..at].trim_end_matches([',', ':', ';']))
}

/// `(CUresult name, description)` of a driver error. Only called with a loaded driver (a
/// `DriverError` only exists after a driver call).
pub(crate) fn describe_driver_error(err: cudarc::driver::DriverError) -> (String, String) {
    let code = format!("{:?}", err.0);
    let description = err
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "no description from the driver".to_string());
    (code, description)
}

fn launch_hint(code: &str, asynchronous: bool) -> String {
    let hint = match code {
        "CUDA_ERROR_INVALID_VALUE" => {
            "check the grid and block dimensions, the dynamic shared memory size and the \
             number and types of the kernel arguments"
        }
        "CUDA_ERROR_OUT_OF_RESOURCES" | "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES" => {
            "too many threads, registers or shared memory for one block: lower the block size or \
             the registers per thread (CompileOptions::max_registers)"
        }
        "CUDA_ERROR_ILLEGAL_ADDRESS"
        | "CUDA_ERROR_MISALIGNED_ADDRESS"
        | "CUDA_ERROR_ILLEGAL_INSTRUCTION"
        | "CUDA_ERROR_HARDWARE_STACK_ERROR"
        | "CUDA_ERROR_LAUNCH_FAILED" => {
            "the kernel faulted; the CUDA context is unusable after this. Run the program under \
             `compute-sanitizer` to find the access"
        }
        _ if asynchronous => {
            "errors reported at a synchronisation may come from any kernel launched before it"
        }
        _ => "",
    };
    if hint.is_empty() {
        String::new()
    } else {
        format!(". {hint}")
    }
}

/// NVRTC's refusal of a source, with the source quoted around each error.
#[derive(Debug, Clone)]
pub struct CompileFailure {
    /// The source's name (as in the log's `name(line): error: …`).
    pub source_name: String,
    /// The target architecture.
    pub arch: Arch,
    /// The NVRTC version, when it could be queried.
    pub nvrtc: Option<NvrtcVersion>,
    /// The options NVRTC got.
    pub options: Vec<String>,
    /// The `nvrtcResult` name (`NVRTC_ERROR_COMPILATION`, `NVRTC_ERROR_INVALID_OPTION`, …).
    pub code: String,
    /// NVRTC's log, unchanged.
    pub log: String,
    /// The log with line-numbered source excerpts after each error.
    pub annotated_log: String,
    /// The parsed `file(line): severity: message` lines of the log.
    pub diagnostics: Vec<Diagnostic>,
}

impl fmt::Display for CompileFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nvrtc = self
            .nvrtc
            .map(|v| format!("NVRTC {v}"))
            .unwrap_or_else(|| "NVRTC".into());
        writeln!(
            f,
            "{nvrtc} could not compile `{}` for {} ({}):",
            self.source_name, self.arch, self.code
        )?;
        let body = self.annotated_log.trim_end();
        if body.is_empty() {
            writeln!(f, "(NVRTC wrote no log)")?;
        } else {
            writeln!(f, "{body}")?;
        }
        write!(f, "options: {}", self.options.join(" "))
    }
}

/// A header that none of the include folders holds.
#[derive(Debug, Clone)]
pub struct MissingHeader {
    /// The header's name as written in `#include`.
    pub header: String,
    /// The file that includes it, and the line, when the log says.
    pub included_from: Option<(String, usize)>,
    /// Every place that was considered, with what was found there.
    pub searched: Vec<IncludeCandidate>,
    /// NVRTC's log.
    pub log: String,
}

impl fmt::Display for MissingHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CUDA header `{}` not found", self.header)?;
        if let Some((file, line)) = &self.included_from {
            write!(f, " (included from {file} line {line})")?;
        }
        writeln!(f, ". Searched:")?;
        for candidate in &self.searched {
            writeln!(f, "  {candidate}")?;
        }
        writeln!(
            f,
            "Set KVQ_CUDA_INCLUDE to a CUDA 13 include folder (several separated by ':'), e.g. the \
             `include` folder of the pip package nvidia-cuda-runtime \
             (<site-packages>/nvidia/cu13/include), or set CUDA_HOME to a CUDA toolkit."
        )?;
        write!(f, "NVRTC log:\n{}", self.log.trim_end())
    }
}
