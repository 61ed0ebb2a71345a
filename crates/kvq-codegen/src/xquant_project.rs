//! XQuant's cache-write projection (`kernels/include/kvq/xquant/project.cuh`): new tokens'
//! latents `X·[down_k | down_v]` on tensor cores, as the f16 rows the integer store's append and
//! prefill kernels take (docs/LAYOUT.md §10).

use crate::decode::{param, stable_id, KernelEntry};
use crate::templates::render;
use crate::{CodegenError, Dtype};
use serde::Serialize;

/// Threads of the projection CTA (four warps).
pub const XQUANT_PROJECT_THREADS: u32 = 128;
/// Rows (tokens) and latent columns a CTA computes.
const ROWS: u32 = 64;
const COLUMNS: u32 = 32;

/// The generated projection kernel for one `d_model`, latent width and input dtype.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct XQuantProjectKernel {
    pub d_model: u32,
    pub rank: usize,
    pub dtype: Dtype,
    pub source: String,
    /// Grid (ceil(n / 64), 2·rank / 32); static shared memory only.
    pub entry: KernelEntry,
}

impl XQuantProjectKernel {
    /// The launch grid for `n` new tokens.
    pub fn grid(&self, n: usize) -> (u32, u32) {
        ((n as u32).div_ceil(ROWS), (2 * self.rank as u32) / COLUMNS)
    }
}

#[derive(Serialize)]
struct Ctx {
    dtype: &'static str,
    d_model: u32,
    rank: usize,
    name: String,
}

/// The projection from a `d_model`-wide layer input in `dtype` to latents of `rank` channels
/// (both multiples of 32: `kvq_reference::xquant::projection` pads the latent, and model widths
/// are multiples of 64).
pub fn xquant_project_kernel(
    dtype: Dtype,
    d_model: u32,
    rank: usize,
) -> Result<XQuantProjectKernel, CodegenError> {
    if d_model == 0 || d_model % 32 != 0 || rank == 0 || rank % 32 != 0 || rank > 1 << 16 {
        return Err(CodegenError::Unsupported {
            family: "xquant projection",
            what: format!(
                "d_model {d_model} and a latent of {rank} (multiples of 32; latents up to 65,536)"
            ),
        });
    }
    let name = format!(
        "kvq_xquant_project_{}",
        stable_id(&format!("xquant-project|{dtype:?}|{d_model}|{rank}"))
    );
    let ctx = Ctx {
        dtype: match dtype {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        },
        d_model,
        rank,
        name: name.clone(),
    };
    let source = render("xquant_project.cu.tera", &ctx)?;
    Ok(XQuantProjectKernel {
        d_model,
        rank,
        dtype,
        source,
        entry: KernelEntry {
            name,
            params: vec![
                param("const uint16_t*", "x"),
                param("int32_t", "n"),
                param("const uint16_t*", "down_hi"),
                param("const uint16_t*", "down_lo"),
                param("uint16_t*", "lat_k"),
                param("uint16_t*", "lat_v"),
            ],
            grid: ["ceil(n / 64)".into(), "2 * rank / 32".into(), "1".into()],
            block: XQUANT_PROJECT_THREADS,
            dynamic_shared_bytes: 0,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_per_dtype_and_refuses_ragged_widths() {
        let k = xquant_project_kernel(Dtype::Bf16, 4096, 1024).unwrap();
        assert!(k.source.contains("static constexpr int XD = 4096;"));
        assert!(k.source.contains("KvqDtype::Bf16"));
        assert!(!k.source.contains("{{") && !k.source.contains("{%"));
        assert_eq!(k.grid(17), (1, 64));
        assert_eq!(k.grid(129), (3, 64));
        let f = xquant_project_kernel(Dtype::F16, 4096, 1024).unwrap();
        assert_ne!(f.entry.name, k.entry.name);
        for (d, r) in [(100, 64), (4096, 48), (0, 32), (64, 0)] {
            assert!(xquant_project_kernel(Dtype::F16, d, r).is_err());
        }
    }
}
