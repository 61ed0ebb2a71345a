//! XQuant-CL's cache writes around the projection (`kernels/include/kvq/xquant/cross_layer.cuh`):
//! the delta against the accumulator the engine carries, the accumulator's latents into the
//! cache, and the next layer's accumulator through the lift matrix.

use crate::decode::{param, stable_id, KernelEntry};
use crate::templates::render;
use crate::xquant_project::check_write_shape;
use crate::{CodegenError, Dtype};
use serde::Serialize;

/// Threads of the element-wise kernels (delta, base rows).
const ELEMENTWISE_THREADS: u32 = 256;
/// The lift's tile (cross_layer.cuh's XCL_M × XCL_N, XCL_THREADS).
const LIFT_ROWS: u32 = 32;
const LIFT_COLUMNS: u32 = 128;
const LIFT_THREADS: u32 = 256;
/// The lift's latent chunk (XCL_K).
const LIFT_CHUNK: usize = 32;

/// Partitions of the 2·rank latents whose sums add in order (cross_layer.cuh's XCL_P).
fn partitions(rank: usize) -> u32 {
    [16, 8, 4, 2]
        .into_iter()
        .find(|p| (2 * rank) % (p * LIFT_CHUNK) == 0)
        .unwrap_or(1) as u32
}

/// The generated XQuant-CL write kernels for one `d_model`, latent width and input dtype.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct XQuantCrossLayerKernel {
    pub d_model: u32,
    pub rank: usize,
    pub dtype: Dtype,
    /// Partitions of the 2·rank latents whose sums add in order (16, 8, 4 or 2).
    pub partitions: u32,
    pub source: String,
    /// `delta = x − x_hat`, `[n][d_model]` in the dtype; any grid.
    pub delta: KernelEntry,
    /// The accumulator's f16 latent rows into the cache's per-token rows; any grid.
    pub base: KernelEntry,
    /// `x_hat_next = x_hat + [lat_k | lat_v]·lift`; grid (ceil(n / 32), ceil(d_model / 128), 1
    /// or `partitions`): z = `partitions` writes each partition's f32 sums
    /// `[partitions][n][d_model]` for `lift_reduce`.
    pub lift: KernelEntry,
    /// A split lift's sums added in order, plus `x_hat`; grid ceil(n·d_model / 256).
    pub lift_reduce: KernelEntry,
}

impl XQuantCrossLayerKernel {
    /// Grid of an element-wise kernel over `elements` values (at most 4 passes a thread's worth
    /// of CTAs on any GPU: the loops stride by the grid).
    pub fn elementwise_grid(elements: usize) -> u32 {
        elements
            .div_ceil(ELEMENTWISE_THREADS as usize)
            .clamp(1, 65_536) as u32
    }

    /// The lift's grid for `n` tokens on a GPU of `sms` SMs: one partition a CTA (z > 1, then
    /// the reduce) while whole-sum CTAs would not fill the SMs.
    pub fn lift_grid(&self, n: usize, sms: u32) -> (u32, u32, u32) {
        let (x, y) = (
            (n as u32).div_ceil(LIFT_ROWS),
            self.d_model.div_ceil(LIFT_COLUMNS),
        );
        (x, y, if x * y < sms { self.partitions } else { 1 })
    }

    /// Bytes of the partition sums a lift of `n` tokens takes (0: none).
    pub fn lift_partial_bytes(&self, n: usize, sms: u32) -> usize {
        if n == 0 || self.lift_grid(n, sms).2 == 1 {
            return 0;
        }
        4 * self.partitions as usize * n * self.d_model as usize
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
    reduce_name: String,
    partitions: u32,
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
    check_write_shape("xquant cross-layer writes", d_model, rank)?;
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
        reduce_name: format!("kvq_xquant_cl_lift_reduce_{id}"),
        partitions: partitions(rank),
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
            param("const int32_t*", "slots"),
            param("const int32_t*", "seq_lens"),
            param("int32_t", "rows_a_slot"),
            param("int32_t", "row0"),
            param("int32_t", "n"),
            param("uint16_t*", "base_k"),
            param("uint16_t*", "base_v"),
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
            param("float*", "partial"),
        ],
        grid: [
            format!("ceil(n / {LIFT_ROWS})"),
            format!("ceil(d_model / {LIFT_COLUMNS})"),
            "1 or partitions".into(),
        ],
        block: LIFT_THREADS,
        dynamic_shared_bytes: 0,
    };
    let lift_reduce = KernelEntry {
        name: ctx.reduce_name.clone(),
        params: vec![
            param("const uint16_t*", "x_hat"),
            param("const float*", "partial"),
            param("int32_t", "n"),
            param("uint16_t*", "x_hat_next"),
        ],
        grid: ["ceil(n * d_model / 256)".into(), "1".into(), "1".into()],
        block: ELEMENTWISE_THREADS,
        dynamic_shared_bytes: 0,
    };
    Ok(XQuantCrossLayerKernel {
        d_model,
        rank,
        dtype,
        partitions: ctx.partitions,
        source,
        delta,
        base,
        lift,
        lift_reduce,
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
        assert!(k.source.contains("XCL_P == 16"));
        // A decode step's 16 tokens: 32 whole-sum CTAs would leave most of 132 SMs idle.
        assert_eq!(k.lift_grid(16, 132), (1, 32, 16));
        assert_eq!(k.lift_partial_bytes(16, 132), 4 * 16 * 16 * 4096);
        assert_eq!(k.lift_grid(4096, 132), (128, 32, 1));
        assert_eq!(k.lift_partial_bytes(4096, 132), 0);
        // 192 latents: 6 chunks of 32, two partitions.
        let f = xquant_cross_layer_kernel(Dtype::F16, 576, 96).unwrap();
        assert_eq!(f.partitions, 2);
        assert_eq!(f.lift_grid(1, 132), (1, 5, 2));
        assert_ne!(f.delta.name, k.delta.name);
        assert_eq!(XQuantCrossLayerKernel::elementwise_grid(0), 1);
        assert_eq!(XQuantCrossLayerKernel::elementwise_grid(1 << 40), 65_536);
        for (d, r) in [(100, 64), (96, 64), (4096, 48), (0, 32), (128, 0)] {
            assert!(xquant_cross_layer_kernel(Dtype::F16, d, r).is_err());
        }
    }
}
