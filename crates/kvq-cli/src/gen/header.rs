//! The C header `kvq gen` writes: layout constants, then per kernel its launch constants, a
//! parameter struct and a helper filling `cuLaunchKernel`'s argument array.

use std::fmt::Write as _;

use kvq::codegen::{KernelShape, TuneParams};

use super::manifest::{KernelInfo, LayoutInfo};
use super::LAYOUT_VERSION;
use crate::scheme::Resolved;

/// The caller-chosen prefix of every name in the generated header (`kvq` by default): a C
/// identifier, so an engine's code names `kvq_decode_params` or `KVQ_HEAD_DIM` whatever the scheme,
/// shape or tuning, and two headers in one translation unit differ only by the prefix they were
/// generated with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CPrefix(String);

impl CPrefix {
    /// The lower-case form, for types and functions (`kvq`).
    pub fn lower(&self) -> &str {
        &self.0
    }

    /// The upper-case form, for macros (`KVQ`).
    pub fn upper(&self) -> String {
        self.0.to_ascii_uppercase()
    }
}

impl Default for CPrefix {
    fn default() -> Self {
        CPrefix("kvq".into())
    }
}

impl std::str::FromStr for CPrefix {
    type Err = String;

    /// Accepts `[a-z][a-z0-9_]*` up to 32 characters: lower case so that the macro form (upper
    /// case) cannot collide with the type form, and no leading `_`, which C reserves.
    fn from_str(s: &str) -> Result<Self, String> {
        let ok_start = s.chars().next().is_some_and(|c| c.is_ascii_lowercase());
        let ok_rest = s
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !ok_start || !ok_rest || s.len() > 32 {
            return Err(format!(
                "`{s}` is not a usable C prefix: it must start with a lower-case letter and \
                 hold only a-z, 0-9 and `_`, at most 32 characters (e.g. `kvq_kitty`)"
            ));
        }
        Ok(CPrefix(s.to_string()))
    }
}

/// The C header: layout constants, then per kernel its launch constants, a parameter struct, a
/// helper filling `cuLaunchKernel`'s argument array, and (under nvcc) the entry point's
/// declaration. Every name is `prefix` plus the kernel's role, never a content hash, so an engine's
/// code survives a change of scheme or tuning; the hashed entry-point name (what
/// `cuModuleGetFunction` needs) is the `_NAME` macro's value.
pub(super) fn header_text(
    prefix: &CPrefix,
    scheme: &Resolved,
    shape: &KernelShape,
    tune: &TuneParams,
    layout: &LayoutInfo,
    kernels: &[KernelInfo],
) -> String {
    let tag = prefix.upper();
    let mut h = String::new();
    let guard = format!("{tag}_KERNELS_H");
    let _ = writeln!(h, "/* kvq generated header — do not edit. */");
    let _ = writeln!(h, "/* scheme: {} */", scheme.spec);
    let _ = writeln!(
        h,
        "/* shape:  head_dim={} gqa={} dtype={}; tuning threads={} tile_tokens={} \
         min_warps_per_sm={} pack_heads={} short_staging={} store_scores={} */",
        shape.head_dim,
        shape.gqa,
        shape.dtype,
        tune.threads,
        tune.tile_tokens,
        tune.min_warps_per_sm,
        tune.pack_heads,
        tune.short_staging,
        tune.store_scores
    );
    let _ = writeln!(
        h,
        "/* layout: {LAYOUT_VERSION} (docs/LAYOUT.md, docs/KERNELS.md); launch shapes and \
         buffer shapes: manifest.json */"
    );
    let _ = writeln!(h, "#ifndef {guard}\n#define {guard}\n");
    let _ = writeln!(h, "#include <stdint.h>\n");
    let _ = writeln!(h, "#define {tag}_LAYOUT_VERSION \"{LAYOUT_VERSION}\"");
    let _ = writeln!(
        h,
        "#define {tag}_SCHEME \"{}\"",
        c_string(&scheme.spec.to_string())
    );
    let _ = writeln!(
        h,
        "#define {tag}_SCHEME_LABEL \"{}\"",
        c_string(&scheme.label())
    );
    let _ = writeln!(h, "#define {tag}_DTYPE \"{}\"", shape.dtype);
    let _ = writeln!(h, "#define {tag}_HEAD_DIM {}", shape.head_dim);
    let _ = writeln!(h, "#define {tag}_GQA {}", shape.gqa);
    let _ = writeln!(h, "#define {tag}_PAGE_TOKENS {}", layout.page_tokens);
    let _ = writeln!(h, "#define {tag}_SINK {}", layout.sink);
    let _ = writeln!(h, "#define {tag}_K_BLOCK_BYTES {}", layout.k.block_bytes);
    let _ = writeln!(h, "#define {tag}_V_BLOCK_BYTES {}", layout.v.block_bytes);
    let _ = writeln!(
        h,
        "#define {tag}_K_TAIL_CAPACITY {}",
        layout.k.tail_capacity
    );
    let _ = writeln!(
        h,
        "#define {tag}_V_TAIL_CAPACITY {}",
        layout.v.tail_capacity
    );
    kernel_declarations(&mut h, prefix, kernels);
    let _ = writeln!(h, "\n#endif /* {guard} */");

    ascii(&h)
}

/// Per kernel: its launch constants, parameter struct, argument helper and (under nvcc) the entry
/// point's declaration, inside `extern "C"` for C++.
pub(super) fn kernel_declarations(h: &mut String, prefix: &CPrefix, kernels: &[KernelInfo]) {
    let (lower, tag) = (prefix.lower(), prefix.upper());
    let _ = writeln!(h, "\n#ifdef __cplusplus\nextern \"C\" {{\n#endif");
    for k in kernels {
        let role = k.role.to_ascii_lowercase();
        let upper = format!("{tag}_{}", role.to_ascii_uppercase());
        let ty = format!("{lower}_{role}_params");
        let _ = writeln!(h, "\n/* {} ({}): {}", k.role, k.file, k.about);
        let _ = writeln!(
            h,
            " * grid ({}, {}, {}), block {} threads, {} bytes of dynamic shared memory. */",
            k.grid[0], k.grid[1], k.grid[2], k.block[0], k.dynamic_shared_bytes
        );
        let _ = writeln!(h, "#define {upper}_NAME \"{}\"", k.name);
        let _ = writeln!(h, "#define {upper}_BLOCK {}", k.block[0]);
        let _ = writeln!(h, "#define {upper}_DYNAMIC_SMEM {}", k.dynamic_shared_bytes);
        let _ = writeln!(h, "#define {upper}_NUM_PARAMS {}", k.params.len());
        if let Some(runs) = k.runs_pieces {
            let _ = writeln!(h, "#define {upper}_RUNS_PIECES {}", u8::from(runs));
        }
        let _ = writeln!(h, "typedef struct {ty} {{");
        for p in &k.params {
            let about = if p.about.is_empty() {
                String::new()
            } else {
                format!(" /* {} */", p.about)
            };
            let _ = writeln!(h, "    {} {};{about}", p.c_type, p.name);
        }
        let _ = writeln!(h, "}} {ty};");
        let _ = writeln!(
            h,
            "/* Points args[i] at parameter i of *p, for cuLaunchKernel(..., kernelParams = args, ...). */"
        );
        let _ = writeln!(
            h,
            "static inline void {lower}_{role}_args({ty}* p, void* args[{}]) {{",
            k.params.len()
        );
        for p in &k.params {
            let _ = writeln!(h, "    args[{}] = (void*)&p->{};", p.index, p.name);
        }
        let _ = writeln!(h, "}}");
        let signature: Vec<String> = k
            .params
            .iter()
            .map(|p| format!("{} {}", p.c_type, p.name))
            .collect();
        let _ = writeln!(
            h,
            "#if defined(__CUDACC__)\n__global__ void {}({});\n#endif",
            k.name,
            signature.join(", ")
        );
    }
    let _ = writeln!(h, "\n#ifdef __cplusplus\n}}\n#endif");
}

/// `text` as the body of a C string literal: quotes and backslashes escaped.
fn c_string(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"")
}

/// The header in plain ASCII, so any C compiler and editor reads it as written.
pub(super) fn ascii(text: &str) -> String {
    let mut s = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '·' | '×' => s.push('*'),
            '→' => s.push_str("->"),
            '—' | '–' | '−' => s.push('-'),
            '≥' => s.push_str(">="),
            '≤' => s.push_str("<="),
            '…' => s.push_str("..."),
            c if c.is_ascii() => s.push(c),
            _ => s.push('?'),
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_lower_case_c_identifiers() {
        assert_eq!(
            "kvq_kitty2".parse::<CPrefix>().unwrap().upper(),
            "KVQ_KITTY2"
        );
        for bad in ["", "Kvq", "_kvq", "9kvq", "kv-q", "kvq.x", &"k".repeat(33)] {
            let e = bad.parse::<CPrefix>().unwrap_err();
            assert!(e.contains("C prefix"), "{bad}: {e}");
        }
    }

    #[test]
    fn c_strings_escape_quotes_and_backslashes() {
        assert_eq!(c_string(r#"a"b\c"#), r#"a\"b\\c"#);
    }
}
