//! CUDA C++ → PTX or CUBIN with NVRTC, for an explicit [`Arch`]; no GPU needed.
//!
//! This talks to `cudarc::nvrtc::sys` directly rather than through cudarc's safe `compile_ptx`,
//! because kvq needs what that API lacks: CUBIN output (`nvrtcGetCUBIN`, which requires a real
//! `sm_XX` architecture), in-memory headers, an architecture chosen at run time
//! (`CompileOptions.arch` there is `&'static str`), and no panics (cudarc's safe layer unwraps
//! on NUL bytes and on a missing library). The library's presence is checked first
//! ([`crate::libs::ensure_nvrtc`]).
//!
//! Options always passed: `--std=c++17` (configurable) and `--gpu-architecture=<arch>`. Opt-in:
//! `--use_fast_math`, `--generate-line-info`, `--maxrregcount`, `-D` defines, include folders
//! (by default those [`IncludeSearch`] finds; none are needed for header-free sources).

use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::nvrtc::sys;
use serde::{Deserialize, Serialize};

use crate::arch::Arch;
use crate::diagnostics::{annotate_log, parse_log};
use crate::error::{CompileFailure, JitError, MissingHeader, Result};
use crate::include::{CandidateStatus, IncludeCandidate, IncludeSearch};
use crate::libs::ensure_nvrtc;
pub use crate::version::NvrtcVersion;

fn nvrtc_code(r: sys::nvrtcResult) -> String {
    format!("{r:?}")
}

fn check(call: &str, r: sys::nvrtcResult) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(JitError::Nvrtc {
            call: call.to_string(),
            code: nvrtc_code(r),
        })
    }
}

/// Whether NVRTC can be used in this process: it loads, is NVRTC 13 and has every entry point
/// kvq calls ([`crate::libs::ensure_nvrtc`]).
pub fn is_available() -> bool {
    ensure_nvrtc().is_ok()
}

/// The loaded NVRTC's version; [`JitError::NvrtcNotFound`] if there is none (or the error
/// that makes it unusable).
pub fn version() -> Result<NvrtcVersion> {
    // Asked once, when the library is first checked.
    crate::libs::nvrtc_version()
}

/// The architectures the loaded NVRTC can target, as numbers (75, 80, …, 90, 100, 120).
pub fn supported_archs() -> Result<Vec<u32>> {
    static ARCHS: OnceLock<Vec<u32>> = OnceLock::new();
    if let Some(a) = ARCHS.get() {
        return Ok(a.clone());
    }
    ensure_nvrtc()?;
    let mut n: c_int = 0;
    // SAFETY: the library is present; `n` is valid for writes.
    check("nvrtcGetNumSupportedArchs", unsafe {
        sys::nvrtcGetNumSupportedArchs(&mut n)
    })?;
    let mut archs: Vec<c_int> = vec![0; n.max(0) as usize];
    if !archs.is_empty() {
        // SAFETY: `archs` has room for the `n` entries NVRTC writes.
        check("nvrtcGetSupportedArchs", unsafe {
            sys::nvrtcGetSupportedArchs(archs.as_mut_ptr())
        })?;
    }
    let archs: Vec<u32> = archs.into_iter().map(|a| a.max(0) as u32).collect();
    Ok(ARCHS.get_or_init(|| archs).clone())
}

/// What to produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Output {
    /// PTX text: portable to later GPUs, JIT-compiled by the driver at load.
    Ptx,
    /// Machine code for exactly the given architecture: loads without driver JIT.
    Cubin,
}

impl Output {
    /// File extension for this output.
    pub fn extension(self) -> &'static str {
        match self {
            Output::Ptx => "ptx",
            Output::Cubin => "cubin",
        }
    }
}

/// A header handed to NVRTC in memory (found by `#include "name"` without any include folder).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Header {
    /// The name used in `#include`.
    pub name: String,
    /// Its text.
    pub contents: String,
}

/// A CUDA C++ translation unit: a name (used in NVRTC's messages), the code, and in-memory
/// headers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Source {
    /// Name shown in diagnostics, e.g. `kvq_decode_kivi2_d128.cu`.
    pub name: String,
    /// The CUDA C++ text.
    pub code: String,
    /// Headers NVRTC sees without an include folder.
    pub headers: Vec<Header>,
}

impl Source {
    /// A source without headers.
    pub fn new(name: impl Into<String>, code: impl Into<String>) -> Source {
        Source {
            name: name.into(),
            code: code.into(),
            headers: Vec::new(),
        }
    }

    /// Adds an in-memory header.
    pub fn with_header(mut self, name: impl Into<String>, contents: impl Into<String>) -> Source {
        self.headers.push(Header {
            name: name.into(),
            contents: contents.into(),
        });
        self
    }
}

/// Where NVRTC looks for `#include <…>` files.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum IncludeDirs {
    /// `KVQ_CUDA_INCLUDE`, else `$CUDA_HOME/include`, else `/usr/local/cuda/include`, each with
    /// its `cccl` subfolder when present; nothing when none exists.
    #[default]
    Auto,
    /// No include folders (header-free sources).
    None,
    /// Exactly these folders.
    Only(Vec<PathBuf>),
}

/// NVRTC options kvq exposes. The architecture is not here: it is an argument of every compile.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    /// The C++ dialect (`--std=`); `c++17` by default.
    pub std: String,
    /// `--use_fast_math` (approximate division, sqrt, transcendental functions; flush to zero).
    pub fast_math: bool,
    /// `--generate-line-info`, for profilers and compute-sanitizer.
    pub line_info: bool,
    /// `--maxrregcount=N`.
    pub max_registers: Option<u32>,
    /// `-D NAME` / `-D NAME=VALUE`.
    pub defines: Vec<(String, Option<String>)>,
    /// Include folders.
    pub include_dirs: IncludeDirs,
    /// Any other NVRTC options, passed last, unchanged.
    pub extra: Vec<String>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            std: "c++17".into(),
            fast_math: false,
            line_info: false,
            max_registers: None,
            defines: Vec::new(),
            include_dirs: IncludeDirs::Auto,
            extra: Vec::new(),
        }
    }
}

impl CompileOptions {
    /// Sets `--use_fast_math`.
    pub fn fast_math(mut self, on: bool) -> Self {
        self.fast_math = on;
        self
    }

    /// Sets `--generate-line-info`.
    pub fn line_info(mut self, on: bool) -> Self {
        self.line_info = on;
        self
    }

    /// Adds `-D name=value`.
    pub fn define(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.defines.push((name.into(), Some(value.into())));
        self
    }

    /// Adds a raw NVRTC option.
    pub fn option(mut self, option: impl Into<String>) -> Self {
        self.extra.push(option.into());
        self
    }

    /// Sets the include folders.
    pub fn include_dirs(mut self, dirs: IncludeDirs) -> Self {
        self.include_dirs = dirs;
        self
    }

    /// The exact NVRTC arguments for `arch`, and the include search behind them.
    pub fn resolve(&self, arch: Arch) -> ResolvedOptions {
        let mut args = vec![format!("--std={}", self.std), arch.nvrtc_option()];
        if self.fast_math {
            args.push("--use_fast_math".into());
        }
        if self.line_info {
            args.push("--generate-line-info".into());
        }
        if let Some(n) = self.max_registers {
            args.push(format!("--maxrregcount={n}"));
        }
        for (name, value) in &self.defines {
            match value {
                Some(v) => args.push(format!("--define-macro={name}={v}")),
                None => args.push(format!("--define-macro={name}")),
            }
        }
        let search = match &self.include_dirs {
            IncludeDirs::Auto => IncludeSearch::from_env(),
            IncludeDirs::None => IncludeSearch::default(),
            IncludeDirs::Only(dirs) => IncludeSearch {
                candidates: dirs
                    .iter()
                    .map(|d| IncludeCandidate {
                        origin: "CompileOptions::include_dirs".into(),
                        path: Some(d.clone()),
                        status: if d.is_dir() {
                            CandidateStatus::Used
                        } else {
                            CandidateStatus::Missing
                        },
                    })
                    .collect(),
                dirs: dirs.clone(),
            },
        };
        for dir in &search.dirs {
            args.push(format!("--include-path={}", dir.display()));
        }
        args.extend(self.extra.iter().cloned());
        ResolvedOptions {
            arch,
            args,
            include_search: search,
        }
    }
}

/// Options turned into NVRTC arguments for one architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedOptions {
    /// The target.
    pub arch: Arch,
    /// The arguments, in the order NVRTC gets them. Part of the cache key.
    pub args: Vec<String>,
    /// How the include folders were found (named in [`JitError::MissingHeader`]).
    pub include_search: IncludeSearch,
}

/// A compiled module image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compiled {
    /// PTX or CUBIN.
    pub output: Output,
    /// The target architecture.
    pub arch: Arch,
    /// The NVRTC that produced it.
    pub nvrtc: NvrtcVersion,
    /// The NVRTC arguments used.
    pub options: Vec<String>,
    /// PTX text (no trailing NUL) or CUBIN bytes.
    pub image: Vec<u8>,
    /// NVRTC's log (warnings); empty for images read from the disk cache.
    pub log: String,
}

impl Compiled {
    /// The PTX text, for PTX output.
    pub fn ptx(&self) -> Option<&str> {
        match self.output {
            Output::Ptx => std::str::from_utf8(&self.image).ok(),
            Output::Cubin => None,
        }
    }

    /// The bytes `cuModuleLoadData` takes: CUBIN as is, PTX with a terminating NUL.
    pub fn load_image(&self) -> Vec<u8> {
        let mut bytes = self.image.clone();
        if self.output == Output::Ptx {
            bytes.push(0);
        }
        bytes
    }
}

/// Compiles `source` for `arch`. Needs libnvrtc, not a GPU.
pub fn compile(
    source: &Source,
    arch: Arch,
    output: Output,
    options: &CompileOptions,
) -> Result<Compiled> {
    compile_resolved(source, output, &options.resolve(arch))
}

/// Compiles with already resolved options (what the disk cache keyed on).
pub fn compile_resolved(
    source: &Source,
    output: Output,
    options: &ResolvedOptions,
) -> Result<Compiled> {
    ensure_nvrtc()?;
    let nvrtc = version()?;
    let arch = options.arch;
    let supported = supported_archs()?;
    if !supported.is_empty() && !supported.contains(&arch.sm()) {
        return Err(JitError::UnsupportedArch {
            arch,
            nvrtc,
            supported,
        });
    }

    let program = Program::create(source)?;
    let c_options = options
        .args
        .iter()
        .map(|o| c_string(o, "an NVRTC option"))
        .collect::<Result<Vec<_>>>()?;
    let option_ptrs: Vec<*const c_char> = c_options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `program.handle` is a live program; the option pointers stay valid (owned by
    // `c_options`) for the duration of the call.
    let status = unsafe {
        sys::nvrtcCompileProgram(
            program.handle,
            option_ptrs.len() as c_int,
            option_ptrs.as_ptr(),
        )
    };
    let log = program.log()?;
    if status != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(compile_error(
            source,
            options,
            nvrtc,
            nvrtc_code(status),
            log,
        ));
    }
    let image = match output {
        Output::Ptx => program.ptx()?,
        Output::Cubin => program.cubin()?,
    };
    if image.is_empty() {
        return Err(JitError::Nvrtc {
            call: format!("nvrtcGet{}", output.extension().to_uppercase()),
            code: format!("empty {} for {arch}", output.extension()),
        });
    }
    Ok(Compiled {
        output,
        arch,
        nvrtc,
        options: options.args.clone(),
        image,
        log,
    })
}

fn c_string(text: &str, what: &str) -> Result<CString> {
    CString::new(text).map_err(|e| {
        JitError::InvalidInput(format!(
            "{what} contains a NUL byte at offset {}",
            e.nul_position()
        ))
    })
}

/// The header named in NVRTC's `cannot open source file "X"` (or, with no include folder at
/// all, `could not open source file "X" (no directories in search list)`), and where it was
/// included.
fn missing_header(log: &str) -> Option<(String, Option<(String, usize)>)> {
    const NEEDLE: &str = "open source file \"";
    for line in log.lines() {
        if let Some(start) = line.find(NEEDLE) {
            let rest = &line[start + NEEDLE.len()..];
            let header = rest.split('"').next().unwrap_or(rest).to_string();
            let at = crate::diagnostics::Diagnostic::parse(line).map(|d| (d.file, d.line));
            return Some((header, at));
        }
    }
    None
}

fn compile_error(
    source: &Source,
    options: &ResolvedOptions,
    nvrtc: NvrtcVersion,
    code: String,
    log: String,
) -> JitError {
    if let Some((header, included_from)) = missing_header(&log) {
        let in_memory = source.headers.iter().any(|h| h.name == header);
        if !in_memory {
            return JitError::MissingHeader(Box::new(MissingHeader {
                header,
                included_from,
                searched: options.include_search.candidates.clone(),
                log,
            }));
        }
    }
    let mut files: Vec<(&str, &str)> = vec![(source.name.as_str(), source.code.as_str())];
    files.extend(
        source
            .headers
            .iter()
            .map(|h| (h.name.as_str(), h.contents.as_str())),
    );
    JitError::Compile(Box::new(CompileFailure {
        source_name: source.name.clone(),
        arch: options.arch,
        nvrtc: Some(nvrtc),
        options: options.args.clone(),
        code,
        annotated_log: annotate_log(&log, &files),
        diagnostics: parse_log(&log),
        log,
    }))
}

/// An `nvrtcProgram` destroyed on drop, with the C strings it points into.
struct Program {
    handle: sys::nvrtcProgram,
    _strings: Vec<CString>,
}

impl Program {
    fn create(source: &Source) -> Result<Program> {
        let code = c_string(&source.code, &format!("source `{}`", source.name))?;
        let name = c_string(&source.name, "a source name")?;
        let mut header_contents = Vec::with_capacity(source.headers.len());
        let mut header_names = Vec::with_capacity(source.headers.len());
        for h in &source.headers {
            header_contents.push(c_string(&h.contents, &format!("header `{}`", h.name))?);
            header_names.push(c_string(&h.name, "a header name")?);
        }
        let contents: Vec<*const c_char> = header_contents.iter().map(|s| s.as_ptr()).collect();
        let names: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
        let (contents_ptr, names_ptr) = if contents.is_empty() {
            (std::ptr::null(), std::ptr::null())
        } else {
            (contents.as_ptr(), names.as_ptr())
        };
        let mut handle: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: the library is present (callers checked); every pointer is a live C string
        // owned by the vectors kept in the returned `Program`; the two arrays have
        // `contents.len()` entries each.
        let status = unsafe {
            sys::nvrtcCreateProgram(
                &mut handle,
                code.as_ptr(),
                name.as_ptr(),
                contents.len() as c_int,
                contents_ptr,
                names_ptr,
            )
        };
        check("nvrtcCreateProgram", status)?;
        let mut strings = vec![code, name];
        strings.extend(header_contents);
        strings.extend(header_names);
        Ok(Program {
            handle,
            _strings: strings,
        })
    }

    fn log(&self) -> Result<String> {
        let mut size = 0usize;
        // SAFETY: live program; `size` valid for writes.
        check("nvrtcGetProgramLogSize", unsafe {
            sys::nvrtcGetProgramLogSize(self.handle, &mut size)
        })?;
        let mut buf = vec![0u8; size.max(1)];
        // SAFETY: `buf` holds `size` bytes as NVRTC asked.
        check("nvrtcGetProgramLog", unsafe {
            sys::nvrtcGetProgramLog(self.handle, buf.as_mut_ptr().cast())
        })?;
        Ok(String::from_utf8_lossy(trim_nul(&buf)).into_owned())
    }

    fn ptx(&self) -> Result<Vec<u8>> {
        let mut size = 0usize;
        // SAFETY: live, compiled program.
        check("nvrtcGetPTXSize", unsafe {
            sys::nvrtcGetPTXSize(self.handle, &mut size)
        })?;
        let mut buf = vec![0u8; size];
        if size > 0 {
            // SAFETY: `buf` holds `size` bytes.
            check("nvrtcGetPTX", unsafe {
                sys::nvrtcGetPTX(self.handle, buf.as_mut_ptr().cast())
            })?;
        }
        Ok(trim_nul(&buf).to_vec())
    }

    fn cubin(&self) -> Result<Vec<u8>> {
        let mut size = 0usize;
        // SAFETY: live, compiled program.
        check("nvrtcGetCUBINSize", unsafe {
            sys::nvrtcGetCUBINSize(self.handle, &mut size)
        })?;
        let mut buf = vec![0u8; size];
        if size > 0 {
            // SAFETY: `buf` holds `size` bytes.
            check("nvrtcGetCUBIN", unsafe {
                sys::nvrtcGetCUBIN(self.handle, buf.as_mut_ptr().cast())
            })?;
        }
        Ok(buf)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: the handle came from nvrtcCreateProgram and is destroyed once; a failure
            // here cannot be acted on and is ignored.
            let _ = unsafe { sys::nvrtcDestroyProgram(&mut self.handle) };
        }
    }
}

fn trim_nul(bytes: &[u8]) -> &[u8] {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    &bytes[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolved_options_have_std_and_arch_first() {
        let opts = CompileOptions::default()
            .fast_math(true)
            .line_info(true)
            .define("HEAD_DIM", "128")
            .include_dirs(IncludeDirs::None)
            .option("--extra-device-vectorization");
        let r = opts.resolve(Arch::SM_90A);
        assert_eq!(
            r.args,
            [
                "--std=c++17",
                "--gpu-architecture=sm_90a",
                "--use_fast_math",
                "--generate-line-info",
                "--define-macro=HEAD_DIM=128",
                "--extra-device-vectorization"
            ]
        );
    }

    #[test]
    fn only_include_dirs_are_passed_and_recorded() {
        let r = CompileOptions::default()
            .include_dirs(IncludeDirs::Only(vec!["/nonexistent/inc".into()]))
            .resolve(Arch::SM_80);
        assert!(r
            .args
            .contains(&"--include-path=/nonexistent/inc".to_string()));
        assert_eq!(
            r.include_search.candidates[0].status,
            CandidateStatus::Missing
        );
    }

    #[test]
    fn finds_missing_header_in_log() {
        let log = "k.cu(3): catastrophic error: cannot open source file \"cuda_fp16.h\"\n";
        let (h, at) = missing_header(log).unwrap();
        assert_eq!(h, "cuda_fp16.h");
        assert_eq!(at, Some(("k.cu".to_string(), 3)));
    }

    #[test]
    fn finds_missing_header_without_include_dirs() {
        let log = "k.cu(2): catastrophic error: could not open source file \"cuda_bf16.h\" \
                   (no directories in search list)\n";
        assert_eq!(missing_header(log).unwrap().0, "cuda_bf16.h");
    }

    #[test]
    fn nul_in_source_is_a_typed_error() {
        let e = c_string("a\0b", "source `x.cu`").unwrap_err();
        assert!(matches!(e, JitError::InvalidInput(_)));
        assert!(e.to_string().contains("offset 1"));
    }
}
