//! What the generators of the families with their own decodes (codebook, XQuant) share: the
//! manifest's opening fields, launch section, file roles, buffer rows and split scratch, the C
//! header's opening constants, the README's compiling section, and writing the folder's units,
//! headers, README and C header.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use kvq::codegen::KernelShape;
use serde::Serialize;

use super::header;
use super::manifest::{scheme_info, CompiledInfo, KernelInfo, SchemeInfo};
use super::{
    compile_sources, remove_stale, write_file, write_headers, GenRequest, HEADER_FILE, INCLUDE_DIR,
    MANIFEST_FILE, MANIFEST_FORMAT, MANIFEST_VERSION, README_FILE,
};
use crate::error::{CliError, Result};

/// A buffer an engine allocates or fills: its shape in the manifest's names, element type, role.
#[derive(Serialize)]
pub(super) struct BufferInfo {
    pub name: &'static str,
    pub shape: String,
    pub element: &'static str,
    pub about: String,
}

pub(super) fn buffer(
    name: &'static str,
    shape: &str,
    element: &'static str,
    about: &str,
) -> BufferInfo {
    BufferInfo {
        name,
        shape: shape.into(),
        element,
        about: about.into(),
    }
}

/// The manifest's opening fields, the same for every family (flattened into its manifest).
#[derive(Serialize)]
pub(super) struct ManifestHead {
    format: &'static str,
    version: u32,
    family: &'static str,
    kvq_version: &'static str,
    layout_version: &'static str,
    scheme: SchemeInfo,
    shape: KernelShape,
}

impl ManifestHead {
    pub(super) fn new(
        req: &GenRequest,
        family: &'static str,
        layout_version: &'static str,
    ) -> Self {
        ManifestHead {
            format: MANIFEST_FORMAT,
            version: MANIFEST_VERSION,
            family,
            kvq_version: env!("CARGO_PKG_VERSION"),
            layout_version,
            scheme: scheme_info(&req.scheme),
            shape: req.shape,
        }
    }
}

/// How a family's decode step and cache filling launch (`fill_steps` where kvq gen writes
/// cache-filling kernels).
#[derive(Serialize)]
pub(super) struct LaunchInfo {
    /// The decode step's kernels in stream order (roles of `kernels`).
    pub decode_steps: Vec<String>,
    pub notes: Vec<String>,
    pub num_splits: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fill_steps: Vec<String>,
    pub scratch: Vec<BufferInfo>,
}

/// The folder's files by role: each unit (role, file name), the C header, the kernel headers'
/// folder and the README.
pub(super) fn file_names(units: &[(&str, &str)]) -> BTreeMap<String, String> {
    let mut names: BTreeMap<String, String> = units
        .iter()
        .map(|(role, file)| (role.to_string(), file.to_string()))
        .collect();
    names.insert("header".into(), HEADER_FILE.into());
    names.insert("include".into(), format!("{INCLUDE_DIR}/"));
    names.insert("readme".into(), README_FILE.into());
    names
}

/// The split partials a decode writes and the combine reads.
pub(super) fn split_scratch() -> Vec<BufferInfo> {
    vec![
        buffer(
            "part_acc",
            "[batch·q_heads][num_splits][head_dim]",
            "f32",
            "partial outputs",
        ),
        buffer(
            "part_ml",
            "[batch·q_heads][num_splits][2]",
            "f32",
            "partials' (max, denominator)",
        ),
    ]
}

/// The C header's opening: guard, layout version and the scheme's and shape's constants. Returns
/// the guard's name for the closing line.
pub(super) fn header_prologue(
    h: &mut String,
    req: &GenRequest,
    layout_version: &str,
    layout_doc: &str,
) -> String {
    let tag = req.prefix.upper();
    let guard = format!("{tag}_KERNELS_H");
    let _ = writeln!(h, "/* kvq generated header — do not edit. */");
    let _ = writeln!(h, "/* scheme: {} */", req.scheme.spec);
    let _ = writeln!(
        h,
        "/* layout: {layout_version} ({layout_doc}); launch and buffer shapes: manifest.json */"
    );
    let _ = writeln!(
        h,
        "#ifndef {guard}\n#define {guard}\n\n#include <stdint.h>\n"
    );
    let _ = writeln!(h, "#define {tag}_LAYOUT_VERSION \"{layout_version}\"");
    let _ = writeln!(h, "#define {tag}_SCHEME_LABEL \"{}\"", req.scheme.label());
    let _ = writeln!(h, "#define {tag}_DTYPE \"{}\"", req.shape.dtype);
    let _ = writeln!(h, "#define {tag}_HEAD_DIM {}", req.shape.head_dim);
    let _ = writeln!(h, "#define {tag}_GQA {}", req.shape.gqa);
    guard
}

/// The C header's close: every kernel's declarations after the constants, the guard, ASCII only.
pub(super) fn header_epilogue(
    mut h: String,
    req: &GenRequest,
    kernels: &[KernelInfo],
    guard: &str,
) -> String {
    header::kernel_declarations(&mut h, &req.prefix, kernels);
    let _ = writeln!(h, "\n#endif /* {guard} */");
    header::ascii(&h)
}

/// The README's section on compiling `units` for `arch` (NVRTC or nvcc, the headers on the
/// include path, the dynamic shared memory attribute).
pub(super) fn compiling_section(arch: &str, first_unit: &str) -> String {
    format!(
        "## Compiling

Each unit is C++17 and needs the headers under `{INCLUDE_DIR}/` and no CUDA toolkit header. \
Compile it for the GPU's architecture (`{arch}` below), load the CUBIN with `cuModuleLoadData`, \
look the entry points up by the names in `{MANIFEST_FILE}`, and before launching a kernel whose \
dynamic shared memory is not 0 set its `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` to it.

- NVRTC: options `--std=c++17 --gpu-architecture={arch} --include-path=<this folder>/{INCLUDE_DIR}`.
- nvcc: `nvcc -std=c++17 -arch={arch} -cubin -I {INCLUDE_DIR} {first_unit} -o decode.cubin`.
"
    )
}

/// The architecture a README names: `--arch`, else sm_90a.
pub(super) fn arch_name(req: &GenRequest) -> String {
    req.arch
        .map_or_else(|| "sm_90a".to_string(), |a| a.to_string())
}

/// What [`write_folder`] wrote: the files with their sizes, and what `--arch` compiled (for the
/// manifest and for the listing).
pub(super) struct Written {
    pub files: Vec<(PathBuf, u64)>,
    pub compiled: Vec<CompiledInfo>,
    pub compiled_lines: Vec<String>,
}

/// Writes the folder's files: the units (name, source), the kernel headers, the README and the C
/// header, then compiles the units with `--arch`.
pub(super) fn write_folder(
    req: &GenRequest,
    units: &[(&str, &str)],
    readme: &str,
    c_header: &str,
    notes: &mut Vec<String>,
) -> Result<Written> {
    std::fs::create_dir_all(&req.out).map_err(|source| CliError::Write {
        path: req.out.clone(),
        source,
    })?;
    remove_stale(&req.out, false, req.sample.is_some());
    let mut files = Vec::new();
    for (name, source) in units {
        write_file(&req.out.join(name), source.as_bytes(), &mut files)?;
    }
    write_headers(&req.out, &mut files)?;
    write_file(&req.out.join(README_FILE), readme.as_bytes(), &mut files)?;
    write_file(&req.out.join(HEADER_FILE), c_header.as_bytes(), &mut files)?;
    let (compiled, compiled_lines) = match req.arch {
        Some(arch) => compile_sources(&req.out, arch, units, &mut files, notes)?,
        None => (Vec::new(), Vec::new()),
    };
    Ok(Written {
        files,
        compiled,
        compiled_lines,
    })
}
