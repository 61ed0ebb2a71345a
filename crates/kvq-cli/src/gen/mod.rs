//! `kvq gen`: everything another engine needs to run kvq's kernels without kvq — the generated
//! CUDA units, the kernel headers they include (`include/kvq/…`), a C header with each entry point
//! and a parameter struct per kernel, a `manifest.json` with launch shapes, the page-block layout
//! and tuned values, and a README saying how to compile the units. Works without a GPU; `--arch`
//! also compiles the units with NVRTC (where it loads) to check them.
//!
//! This module runs the steps ([`generate`]); `params` chooses the block parameters, `manifest`
//! and `header` write the two descriptions of the kernels, and `rules` gives the manifest the
//! runtime's untuned launch rules as data.

mod codebook;
mod family;
mod header;
mod manifest;
mod params;
mod rules;
mod xquant;

use std::path::{Path, PathBuf};

use kvq::codegen::{
    cache_kernels, decode_kernels, has_codebook_kernel, has_xquant_kernel, KernelShape,
};
use kvq::reference::resources;
use kvq::runtime::nvrtc::{self, CompileOptions, Output, Source};
use kvq::runtime::tune::TuneStore;
use kvq::runtime::Arch;

pub use self::header::CPrefix;
use self::manifest::{CompiledInfo, Manifest};
use crate::error::{CliError, Result};
use crate::sample::{self, SampleSpec};
use crate::scheme::Resolved;

/// The layout version lives with the layout it names (kvq-reference), so it moves with any byte.
pub use kvq::reference::int::LAYOUT_VERSION;

/// Identifies the manifest's format; `MANIFEST_VERSION` changes when a field changes meaning.
pub const MANIFEST_FORMAT: &str = "kvq-gen";
/// See [`MANIFEST_FORMAT`].
pub const MANIFEST_VERSION: u32 = 5;

/// File names inside the output folder.
pub const DECODE_FILE: &str = "decode.cu";
/// See [`DECODE_FILE`].
pub const CACHE_FILE: &str = "cache.cu";
/// See [`DECODE_FILE`].
pub const HEADER_FILE: &str = "kvq_kernels.h";
/// See [`DECODE_FILE`].
pub const MANIFEST_FILE: &str = "manifest.json";
/// See [`DECODE_FILE`]: how to compile the units.
pub const README_FILE: &str = "README.md";
/// The folder the kernel headers go to: a unit's `#include "kvq/common.cuh"` finds
/// `include/kvq/common.cuh` with `include` on the include path.
pub const INCLUDE_DIR: &str = "include";

/// What `kvq gen` was asked for.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub scheme: Resolved,
    pub shape: KernelShape,
    pub out: PathBuf,
    /// Compile with NVRTC for this architecture.
    pub arch: Option<Arch>,
    /// Block parameters from the flags (each overrides the tuned or default value).
    pub threads: Option<u32>,
    pub tile_tokens: Option<u32>,
    pub min_warps_per_sm: Option<u32>,
    pub pack_heads: Option<bool>,
    pub short_staging: Option<bool>,
    pub store_scores: Option<bool>,
    /// Where tuned results are read from (`None`: the default `tune.json`).
    pub tune_file: Option<PathBuf>,
    /// Also write a sample batch with its reference output.
    pub sample: Option<SampleSpec>,
    /// The prefix of every name in the C header (`kvq_decode_params`, `KVQ_HEAD_DIM`, ...).
    pub prefix: CPrefix,
    /// XQuant schemes: the model's KV heads and input width, and the rebuild's precision.
    pub xquant: XQuantRequest,
}

/// What an XQuant scheme's kernels need beyond the shape (refused for other schemes).
#[derive(Debug, Clone, Default)]
pub struct XQuantRequest {
    pub kv_heads: Option<u32>,
    pub d_model: Option<u32>,
    pub rebuild: Option<kvq::codegen::RebuildPrecision>,
}

/// What was written, for the listing and for tests.
#[derive(Debug, Clone)]
pub struct GenOutcome {
    pub files: Vec<(PathBuf, u64)>,
    pub kernels: Vec<String>,
    pub compiled: Vec<String>,
    pub notes: Vec<String>,
}

fn write_file(path: &Path, bytes: &[u8], files: &mut Vec<(PathBuf, u64)>) -> Result<()> {
    std::fs::write(path, bytes).map_err(|source| CliError::Write {
        path: path.to_path_buf(),
        source,
    })?;
    files.push((path.to_path_buf(), bytes.len() as u64));
    Ok(())
}

/// Writes the kernel headers under `out/include/`, each at the path units include it by.
fn write_headers(out: &Path, files: &mut Vec<(PathBuf, u64)>) -> Result<()> {
    for (name, text) in kvq::codegen::kernel_headers() {
        let path = out.join(INCLUDE_DIR).join(name);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| CliError::Write {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        write_file(&path, text.as_bytes(), files)?;
    }
    Ok(())
}

/// The output's README: what each file is and how to compile the units (NVRTC with the headers
/// on the include path or in memory, or nvcc).
fn readme_text(req: &GenRequest, writes_cache: bool) -> String {
    let arch = req
        .arch
        .map_or_else(|| "sm_90a".to_string(), |a| a.to_string());
    let mut units = format!("`{DECODE_FILE}`");
    if writes_cache {
        units.push_str(&format!(" and `{CACHE_FILE}`"));
    }
    format!(
        "# kvq generated kernels

scheme: `{scheme}`; head_dim {head_dim}, GQA {gqa}, {dtype}.

- `{DECODE_FILE}`: the decode unit (decode, combine and, for calibrated schemes, the score-range \
pass).
{cache_line}- `{INCLUDE_DIR}/kvq/`: the kernels' code, CUDA headers the units `#include \"kvq/…\"`.
- `{HEADER_FILE}`: C header with launch constants and a parameter struct per kernel.
- `{MANIFEST_FILE}`: entry points, launch shapes, the page-block layout, tuning.

## Compiling

Each unit ({units}) is C++17 and needs the headers under `{INCLUDE_DIR}/` and no CUDA toolkit \
header. Compile it for the GPU's architecture (`{arch}` below; `sm_90a` on Hopper, `sm_80` on \
Ampere), load the CUBIN with `cuModuleLoadData` and look the entry points up by the names in \
`{MANIFEST_FILE}`.

- NVRTC with an include path: options `--std=c++17 --gpu-architecture={arch} \
--include-path=<this folder>/{INCLUDE_DIR}`.
- NVRTC with in-memory headers: hand every file under `{INCLUDE_DIR}/` to `nvrtcCreateProgram` as \
a header named by its path below `{INCLUDE_DIR}/` (`kvq/common.cuh`, ...); no option needed.
- nvcc: `nvcc -std=c++17 -arch={arch} -cubin -I {INCLUDE_DIR} {DECODE_FILE} -o decode.cubin`.
",
        scheme = req.scheme.spec,
        head_dim = req.shape.head_dim,
        gqa = req.shape.gqa,
        dtype = req.shape.dtype,
        cache_line = if writes_cache {
            format!(
                "- `{CACHE_FILE}`: the cache unit (append, commit, prefill copy, page quantizers).\n"
            )
        } else {
            String::new()
        },
    )
}

/// Removes outputs of an earlier `kvq gen` into the same folder that this run will not rewrite
/// (CUBINs, a cache source, a sample, kernel headers of another kvq), so the folder never mixes two
/// schemes. Only kvq's own file names are touched; failures are ignored (the files are then simply
/// left).
fn remove_stale(out: &Path, writes_cache: bool, writes_sample: bool) {
    let _ = std::fs::remove_dir_all(out.join(INCLUDE_DIR).join("kvq"));
    if let Ok(entries) = std::fs::read_dir(out) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let cubin = (name.starts_with("decode.")
                || name.starts_with("cache.")
                || name.starts_with("encode."))
                && name.ends_with(".cubin");
            // A codebook scheme's encode unit is rewritten by its own run.
            if cubin || (!writes_cache && name == CACHE_FILE) || name == codebook::ENCODE_FILE {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let sample = out.join(crate::sample::SAMPLE_DIR);
    if !writes_sample && sample.join("sample.json").is_file() {
        let _ = std::fs::remove_dir_all(sample);
    }
}

/// Compiles each source with NVRTC for `arch` and writes its CUBIN next to it: what was compiled,
/// for the manifest and the listing. Without a usable libnvrtc it notes so and compiles nothing.
fn compile_sources(
    out: &Path,
    arch: Arch,
    sources: &[(&str, &str)],
    files: &mut Vec<(PathBuf, u64)>,
    notes: &mut Vec<String>,
) -> Result<(Vec<CompiledInfo>, Vec<String>)> {
    let mut compiled = Vec::new();
    let mut lines = Vec::new();
    for &(file, code) in sources {
        let source = kvq::codegen::kernel_headers()
            .iter()
            .fold(Source::new(file, code.to_string()), |s, (header, text)| {
                s.with_header(*header, *text)
            });
        match nvrtc::compile(&source, arch, Output::Cubin, &CompileOptions::default()) {
            Ok(c) => {
                let stem = file.trim_end_matches(".cu");
                let name = format!("{stem}.{arch}.cubin");
                write_file(&out.join(&name), &c.image, files)?;
                lines.push(format!(
                    "compiled {file} for {arch} with NVRTC {}: {} bytes of CUBIN ({name})",
                    c.nvrtc,
                    c.image.len()
                ));
                compiled.push(CompiledInfo {
                    file: name,
                    arch: arch.to_string(),
                    nvrtc: c.nvrtc.to_string(),
                    bytes: c.image.len(),
                });
            }
            // A missing or broken NVRTC leaves the sources uncompiled, said in a note: the files
            // an engine needs are written either way.
            Err(e) if e.is_nvrtc_unusable() => {
                notes.push(format!("{file} not compiled: {e}"));
                break;
            }
            Err(e) => return Err(CliError::Runtime(e.into())),
        }
    }
    Ok((compiled, lines))
}

/// Largest tuning file `kvq gen` reads: a few hundred bytes an entry, so far more than any GPU's
/// results, and small enough that a wrong path (a disk image, a model) is refused at once.
pub const TUNE_FILE_LIMIT: u64 = 64 << 20;

/// The tuning file the user named with `--tune-file`. Unlike the default file (a cache: absent or
/// damaged, it is ignored with a note), a named file must exist and parse — the user meant it.
fn named_tune_file(path: &Path) -> Result<TuneStore> {
    resources::read_input_file(path, "the tuning file (--tune-file)", TUNE_FILE_LIMIT).map_err(
        |e| CliError::Input {
            path: e.path,
            why: e.why,
        },
    )?;
    let store = TuneStore::load_quietly(path);
    match store.warning() {
        None => Ok(store),
        Some(w) => {
            // The store's warning is worded for a cache it will replace; keep just the reason.
            let prefix = format!("ignoring tuning results in {}: ", path.display());
            let why = w
                .strip_prefix(&prefix)
                .and_then(|r| r.split_once("; it will be replaced"))
                .map_or(w, |(why, _)| why);
            Err(CliError::Input {
                path: path.to_path_buf(),
                why: format!("the tuning file (--tune-file) cannot be used: {why}"),
            })
        }
    }
}

/// Writes the folder; see the module docs.
pub fn generate(req: &GenRequest) -> Result<GenOutcome> {
    let spec = &req.scheme.spec;
    let shape = &req.shape;
    if has_xquant_kernel(spec) {
        return xquant::generate(req);
    }
    let x = &req.xquant;
    if x.kv_heads.is_some() || x.d_model.is_some() || x.rebuild.is_some() {
        return Err(CliError::Usage(format!(
            "--kv-heads, --d-model and --rebuild are for XQuant schemes; `{}` is not one",
            req.scheme.label()
        )));
    }
    if has_codebook_kernel(spec) {
        return codebook::generate(req);
    }
    if !req.scheme.has_gpu_kernel() {
        return Err(CliError::Unsupported(format!(
            "`{}` has no kernels in `kvq gen` yet; schemes: fp16, kivi2, kivi4, kitty, kitty-pro, \
             calibquant1, calibquant2, int8, commvq1, commvq2, xquant2, xquant3, xquant4, \
             xquant-cl2, or scheme text of fp16/int(...)/codebook(...) tensors or integer latents",
            req.scheme.label()
        )));
    }
    // A sample that cannot be made is refused before any file is written.
    if let Some(s) = &req.sample {
        sample::check(s, shape)?;
    }
    let (store, tune_file) = match &req.tune_file {
        Some(p) => (Some(named_tune_file(p)?), Some(p.clone())),
        None => match TuneStore::default_path() {
            Ok(p) => (Some(TuneStore::load_quietly(&p)), Some(p)),
            Err(_) => (None, None),
        },
    };
    let mut notes = Vec::new();
    if let Some(w) = store.as_ref().and_then(|s| s.warning()) {
        notes.push(w.to_string());
    }
    let tuned = store
        .as_ref()
        .map(|s| params::tuned_entries(s, spec, shape))
        .unwrap_or_default();
    let (params, params_source) = params::choose_params(req, shape, &tuned)?;
    let decode = decode_kernels(spec, shape, &params)?;
    let cache = match cache_kernels(spec, shape.head_dim, shape.dtype) {
        Ok(c) => Some(c),
        Err(e) => {
            notes.push(format!("no cache kernels written: {e}"));
            None
        }
    };
    let layout = manifest::layout_info(spec, shape)?;

    let kernels = manifest::kernel_infos(&decode, cache.as_ref(), shape.dtype);

    std::fs::create_dir_all(&req.out).map_err(|source| CliError::Write {
        path: req.out.clone(),
        source,
    })?;
    remove_stale(&req.out, cache.is_some(), req.sample.is_some());
    let mut files = Vec::new();
    write_file(
        &req.out.join(DECODE_FILE),
        decode.source.as_bytes(),
        &mut files,
    )?;
    if let Some(c) = &cache {
        write_file(&req.out.join(CACHE_FILE), c.source.as_bytes(), &mut files)?;
    }
    write_headers(&req.out, &mut files)?;
    let readme = readme_text(req, cache.is_some());
    write_file(&req.out.join(README_FILE), readme.as_bytes(), &mut files)?;
    let header = header::header_text(&req.prefix, &req.scheme, shape, &params, &layout, &kernels);
    write_file(&req.out.join(HEADER_FILE), header.as_bytes(), &mut files)?;

    // Compile before the manifest, so it records what was checked.
    let (compiled, compiled_lines) = match req.arch {
        Some(arch) => {
            let mut sources = vec![(DECODE_FILE, decode.source.as_str())];
            if let Some(c) = &cache {
                sources.push((CACHE_FILE, c.source.as_str()));
            }
            compile_sources(&req.out, arch, &sources, &mut files, &mut notes)?
        }
        None => (Vec::new(), Vec::new()),
    };

    let sample_file = match &req.sample {
        Some(s) => {
            let written = sample::write(&req.out, spec, shape, s)?;
            let rel = written.dir_name.clone();
            files.extend(written.files);
            notes.push(written.summary);
            Some(rel)
        }
        None => None,
    };

    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: MANIFEST_VERSION,
        kvq_version: env!("CARGO_PKG_VERSION").into(),
        layout_version: LAYOUT_VERSION.into(),
        scheme: manifest::scheme_info(&req.scheme),
        shape: *shape,
        files: {
            let mut names = manifest::file_names(cache.is_some());
            names.insert("include".into(), format!("{INCLUDE_DIR}/"));
            names.insert("readme".into(), README_FILE.into());
            names
        },
        launch: manifest::launch_info(&decode, &kernels),
        kernels,
        layout,
        tune: manifest::tune_info(
            spec,
            shape,
            &params,
            params_source,
            tune_file.as_deref(),
            &tuned,
        ),
        compiled,
        sample: sample_file,
    };
    if params_source == "tuned" {
        notes.push(format!(
            "block parameters from {} tuned result(s): threads {} tile_tokens {} \
             min_warps_per_sm {} pack_heads {} short_staging {} store_scores {}",
            tuned.len(),
            params.threads,
            params.tile_tokens,
            params.min_warps_per_sm,
            params.pack_heads,
            params.short_staging,
            params.store_scores
        ));
    }
    finish(
        &req.out,
        &manifest,
        &manifest.kernels,
        files,
        compiled_lines,
        notes,
    )
}

/// Writes `manifest.json` last and lists what the run wrote.
fn finish<M: serde::Serialize>(
    out: &Path,
    manifest: &M,
    kernels: &[manifest::KernelInfo],
    mut files: Vec<(PathBuf, u64)>,
    compiled: Vec<String>,
    notes: Vec<String>,
) -> Result<GenOutcome> {
    let json = serde_json::to_string_pretty(manifest)
        .map_err(|e| CliError::Usage(format!("manifest: {e}")))?;
    write_file(&out.join(MANIFEST_FILE), json.as_bytes(), &mut files)?;
    Ok(GenOutcome {
        files,
        kernels: kernels
            .iter()
            .map(|k| format!("{:<18} {}", k.role, k.name))
            .collect(),
        compiled,
        notes,
    })
}
