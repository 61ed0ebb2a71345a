//! The merge kernel: attention states `(O, LSE)` computed over disjoint parts of each query row's
//! tokens (on several GPUs) into the state over all of them. It depends on the head size and the
//! I/O dtype only, not on the scheme: every scheme's decode writes the same `(O, LSE)`.

use serde::Serialize;

use crate::decode::KernelEntry;
use crate::shape::Dtype;
use crate::templates::render;
use crate::CodegenError;

/// Threads of a merge CTA: four rows, one warp each.
pub const MERGE_THREADS: u32 = 128;

/// A merge unit and its entry point.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MergeKernel {
    /// Channels per head.
    pub head_dim: u32,
    /// Element type of the outputs merged and written.
    pub dtype: Dtype,
    /// The CUDA unit (includes `kvq/merge.cuh`).
    pub source: String,
    /// Its `extern "C"` entry point; grid `ceil(rows / 4)`.
    pub entry: KernelEntry,
}

#[derive(Serialize)]
struct MergeCtx {
    name: String,
    head_dim: u32,
    dtype: String,
    dtype_enum: &'static str,
    threads: u32,
}

/// The merge unit for rows of `head_dim` channels in `dtype`: any multiple of 16 from 16 to 256.
///
/// ```
/// use kvq_codegen::{merge_kernel, Dtype};
/// let k = merge_kernel(128, Dtype::Bf16).unwrap();
/// assert_eq!(k.entry.name, "kvq_merge_d128_bf16");
/// assert!(k.source.lines().count() < 20);
/// assert!(merge_kernel(100, Dtype::F16).is_err());
/// ```
pub fn merge_kernel(head_dim: u32, dtype: Dtype) -> Result<MergeKernel, CodegenError> {
    if head_dim == 0 || head_dim > 256 || head_dim % 16 != 0 {
        return Err(CodegenError::Shape(format!(
            "merge of head_dim {head_dim} (a multiple of 16 from 16 to 256)"
        )));
    }
    let (suffix, dtype_enum) = match dtype {
        Dtype::F16 => ("f16", "F16"),
        Dtype::Bf16 => ("bf16", "Bf16"),
    };
    let name = format!("kvq_merge_d{head_dim}_{suffix}");
    let source = render(
        "merge.cu.tera",
        &MergeCtx {
            name: name.clone(),
            head_dim,
            dtype: dtype.to_string(),
            dtype_enum,
            threads: MERGE_THREADS,
        },
    )?;
    let param = |ty: &str, name: &str| (ty.to_string(), name.to_string());
    Ok(MergeKernel {
        head_dim,
        dtype,
        source,
        entry: KernelEntry {
            name,
            params: vec![
                param("const uint16_t*", "out_parts"),
                param("const float*", "lse_parts"),
                param("int32_t", "parts"),
                param("int32_t", "rows"),
                param("uint16_t*", "out"),
                param("float*", "lse"),
            ],
            grid: [
                format!("ceil(rows / {})", MERGE_THREADS / 32),
                "1".into(),
                "1".into(),
            ],
            block: MERGE_THREADS,
            dynamic_shared_bytes: 0,
        },
    })
}
