//! The C header `kvq gen` writes: layout constants, then per kernel its launch constants, a
//! parameter struct and a helper filling `cuLaunchKernel`'s argument array.

use std::fmt::Write as _;

use kvq::codegen::{KernelShape, TuneParams};

use super::manifest::{KernelInfo, LayoutInfo};
use super::LAYOUT_VERSION;
use crate::scheme::Resolved;

/// A C identifier fragment: letters, digits and `_`, upper-case.
pub(super) fn macro_tag(label: &str, shape: &KernelShape) -> String {
    let clean: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!(
        "KVQ_{clean}_D{}_G{}_{}",
        shape.head_dim,
        shape.gqa,
        shape.dtype.to_string().to_ascii_uppercase()
    )
}

/// The C header: layout constants, then per kernel its launch constants, a parameter struct, a
/// helper filling `cuLaunchKernel`'s argument array, and (under nvcc) the entry point's
/// declaration.
pub(super) fn header_text(
    tag: &str,
    scheme: &Resolved,
    shape: &KernelShape,
    tune: &TuneParams,
    layout: &LayoutInfo,
    kernels: &[KernelInfo],
) -> String {
    let mut h = String::new();
    let guard = format!("{tag}_H");
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
    let _ = writeln!(h, "\n#ifdef __cplusplus\nextern \"C\" {{\n#endif");
    for k in kernels {
        let upper = format!("{tag}_{}", k.role.to_ascii_uppercase());
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
        let _ = writeln!(h, "typedef struct {}_params {{", k.name);
        for p in &k.params {
            let about = if p.about.is_empty() {
                String::new()
            } else {
                format!(" /* {} */", p.about)
            };
            let _ = writeln!(h, "    {} {};{about}", p.c_type, p.name);
        }
        let _ = writeln!(h, "}} {}_params;", k.name);
        let _ = writeln!(
            h,
            "/* Points args[i] at parameter i of *p, for cuLaunchKernel(..., kernelParams = args, ...). */"
        );
        let _ = writeln!(
            h,
            "static inline void {}_args({}_params* p, void* args[{}]) {{",
            k.name,
            k.name,
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
    let _ = writeln!(
        h,
        "\n#ifdef __cplusplus\n}}\n#endif\n\n#endif /* {guard} */"
    );
    ascii(&h)
}

/// The header in plain ASCII, so any C compiler and editor reads it as written.
fn ascii(text: &str) -> String {
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
    use kvq::codegen::Dtype;

    #[test]
    fn macro_tags_are_identifiers() {
        let shape = KernelShape::new(128, 4, Dtype::Bf16);
        assert_eq!(macro_tag("kitty-pro", &shape), "KVQ_KITTY_PRO_D128_G4_BF16");
    }
}
