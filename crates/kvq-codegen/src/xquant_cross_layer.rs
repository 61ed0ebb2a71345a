//! XQuant-CL's cache writes around the projection (`kernels/include/kvq/xquant/cross_layer.cuh`):
//! the delta against the accumulator the engine carries, the accumulator's latents into the
//! cache, and the next layer's accumulator through the lift matrix.

use crate::decode::{param, stable_id, KernelEntry};
use crate::templates::render;
use crate::{CodegenError, Dtype};
use serde::Serialize;

/// Threads of the element-wise kernels (delta, base rows).
const ELEMENTWISE_THREADS: u32 = 256;
/// The lift's tile (cross_layer.cuh's XCL_M × XCL_N, XCL_THREADS).
const LIFT_ROWS: u32 = 32;
const LIFT_COLUMNS: u32 = 128;
const LIFT_THREADS: u32 = 256;

/// The generated XQuant-CL write kernels for one `d_model`, latent width and input dtype.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct XQuantCrossLayerKernel {
    pub d_model: u32,
    pub rank: usize,
    pub dtype: Dtype,
    pub source: String,
    /// `delta = x − x_hat`, `[n][d_model]` in the dtype; any grid.
    pub delta: KernelEntry,
    /// The accumulator's f16 latent rows widened into the cache's f32 rows; any grid.
    pub base: KernelEntry,
    /// `x_hat_next = x_hat + [lat_k | lat_v]·lift`; grid (ceil(n / 32), ceil(d_model / 128)).
    pub lift: KernelEntry,
}

impl XQuantCrossLayerKernel {
    /// Grid of an element-wise kernel over `elements` values (at most 4 passes a thread's worth
    /// of CTAs on any GPU: the loops stride by the grid).
    pub fn elementwise_grid(elements: usize) -> u32 {
        elements
            .div_ceil(ELEMENTWISE_THREADS as usize)
            .clamp(1, 65_536) as u32
    }

    /// The lift's grid for `n` tokens.
    pub fn lift_grid(&self, n: usize) -> (u32, u32, u32) {
        (
            (n as u32).div_ceil(LIFT_ROWS),
            self.d_model.div_ceil(LIFT_COLUMNS),
            1,
        )
    }
}

#[derive(Serialize)]
struct Ctx {
    dtype: &'static str,
    d_model: u32,
    rank: usize,
    block: u32,
    delta_name: String,
    base_name: String,
    lift_name: String,
    lift_block: u32,
    lift_rows: u32,
    lift_columns: u32,
}

/// XQuant-CL's write kernels for a `d_model`-wide layer input in `dtype` and latents of `rank`
/// channels (the shapes the projection takes: `d_model` a multiple of 64, `rank` of 32).
pub fn xquant_cross_layer_kernel(
    dtype: Dtype,
    d_model: u32,
    rank: usize,
) -> Result<XQuantCrossLayerKernel, CodegenError> {
    if d_model == 0 || d_model % 64 != 0 || rank == 0 || rank % 32 != 0 || rank > 1 << 16 {
        return Err(CodegenError::Unsupported {
            family: "xquant cross-layer writes",
            what: format!(
                "d_model {d_model} and a latent of {rank} (multiples of 64 and 32; latents up to \
                 65,536)"
            ),
        });
    }
    let id = stable_id(&format!("xquant-cross-layer|{dtype:?}|{d_model}|{rank}"));
    let ctx = Ctx {
        dtype: match dtype {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        },
        d_model,
        rank,
        block: ELEMENTWISE_THREADS,
        delta_name: format!("kvq_xquant_cl_delta_{id}"),
        base_name: format!("kvq_xquant_cl_base_{id}"),
        lift_name: format!("kvq_xquant_cl_lift_{id}"),
        lift_block: LIFT_THREADS,
        lift_rows: LIFT_ROWS,
        lift_columns: LIFT_COLUMNS,
    };
    let source = render("xquant_cross_layer.cu.tera", &ctx)?;
    let any_grid = || -> [String; 3] {
        [
            "ceil(elements / 256), at most 65536".into(),
            "1".into(),
            "1".into(),
        ]
    };
    let delta = KernelEntry {
        name: ctx.delta_name.clone(),
        params: vec![
            param("const uint16_t*", "x"),
            param("const uint16_t*", "x_hat"),
            param("int32_t", "n"),
            param("uint16_t*", "delta"),
        ],
        grid: any_grid(),
        block: ELEMENTWISE_THREADS,
        dynamic_shared_bytes: 0,
    };
    let base = KernelEntry {
        name: ctx.base_name.clone(),
        params: vec![
            param("const uint16_t*", "lat_k"),
            param("const uint16_t*", "lat_v"),
            param("const int32_t*", "rows_at"),
            param("int32_t", "row0"),
            param("int32_t", "n"),
            param("float*", "base_k"),
            param("float*", "base_v"),
        ],
        grid: any_grid(),
        block: ELEMENTWISE_THREADS,
        dynamic_shared_bytes: 0,
    };
    let lift = KernelEntry {
        name: ctx.lift_name.clone(),
        params: vec![
            param("const uint16_t*", "x_hat"),
            param("const uint16_t*", "lat_k"),
            param("const uint16_t*", "lat_v"),
            param("const float*", "lift"),
            param("int32_t", "n"),
            param("uint16_t*", "x_hat_next"),
        ],
        grid: [
            format!("ceil(n / {LIFT_ROWS})"),
            format!("ceil(d_model / {LIFT_COLUMNS})"),
            "1".into(),
        ],
        block: LIFT_THREADS,
        dynamic_shared_bytes: 0,
    };
    Ok(XQuantCrossLayerKernel {
        d_model,
        rank,
        dtype,
        source,
        delta,
        base,
        lift,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_per_dtype_and_refuses_ragged_widths() {
        let k = xquant_cross_layer_kernel(Dtype::Bf16, 4096, 1024).unwrap();
        assert!(k.source.contains("static constexpr int XD = 4096;"));
        assert!(k.source.contains("KvqDtype::Bf16"));
        assert!(k.source.contains(&format!(
            "void __launch_bounds__(XCL_THREADS) {}(",
            k.lift.name
        )));
        assert!(!k.source.contains("{{") && !k.source.contains("{%"));
        assert_eq!(k.lift_grid(16), (1, 32, 1));
        assert_eq!(k.lift_grid(33), (2, 32, 1));
        let f = xquant_cross_layer_kernel(Dtype::F16, 576, 96).unwrap();
        assert_eq!(f.lift_grid(1), (1, 5, 1));
        assert_ne!(f.delta.name, k.delta.name);
        assert_eq!(XQuantCrossLayerKernel::elementwise_grid(0), 1);
        assert_eq!(XQuantCrossLayerKernel::elementwise_grid(1 << 40), 65_536);
        for (d, r) in [(100, 64), (96, 64), (4096, 48), (0, 32), (128, 0)] {
            assert!(xquant_cross_layer_kernel(Dtype::F16, d, r).is_err());
        }
    }
}
