//! XQuant's cache-write projection (`kernels/include/kvq/xquant/project.cuh`): new tokens'
//! latents `X·[down_k | down_v]` on tensor cores, as the f16 rows the integer store's append and
//! prefill kernels take (docs/LAYOUT.md §10).

use crate::decode::{param, stable_id, KernelEntry};
use crate::templates::render;
use crate::{CodegenError, Dtype};
use serde::Serialize;

/// Threads of the reduce kernel.
const REDUCE_THREADS: u32 = 256;

/// Partitions of d_model (kernels/include/kvq/xquant/project.cuh): sums added in a fixed order
/// whatever the batch, so a narrow launch can give each partition its own CTAs.
fn partitions(d_model: u32) -> u32 {
    [4, 2, 1]
        .into_iter()
        .find(|p| d_model % (64 * p) == 0)
        .unwrap_or(1)
}

/// One of the projection's tile shapes (kernels/include/kvq/xquant/project.cuh): tokens and
/// latent columns a CTA, d_model a pipeline chunk, stages. Both sum every latent in the same order,
/// so the shape never changes a latent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProjectTile {
    pub rows: u32,
    pub columns: u32,
    pub threads: u32,
    chunk: u32,
    stages: u32,
}

impl ProjectTile {
    /// Prefills: 128 tokens × 64 latents a CTA (two CTAs an SM fit its shared memory).
    pub const WIDE: Self = Self {
        rows: 128,
        columns: 64,
        threads: 256,
        chunk: 32,
        stages: 3,
    };
    /// A decode step's few tokens: 32 × 16, many CTAs to stream down, long chunks in flight.
    pub const NARROW: Self = Self {
        rows: 32,
        columns: 16,
        threads: 64,
        chunk: 64,
        stages: 6,
    };

    fn smem_bytes(self) -> u32 {
        // Staged rows: a chunk plus 8 halves (ldmatrix rows on distinct banks); X's rows and
        // down's two parts a stage. Then the tile's f32 sums of the partitions done so far.
        self.stages * (self.rows + 2 * self.columns) * (self.chunk + 8) * 2
            + self.rows * self.columns * 4
    }
}

/// The generated projection kernels for one `d_model`, latent width and input dtype.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct XQuantProjectKernel {
    pub d_model: u32,
    pub rank: usize,
    pub dtype: Dtype,
    /// Partitions of d_model whose sums add in order (1, 2 or 4).
    pub partitions: u32,
    pub source: String,
    /// Grid (ceil(n / 128), 2·rank / 64, 1) (the rank is a multiple of 32).
    pub wide: KernelEntry,
    /// Grid (ceil(n / 32), 2·rank / 16, 1 or `partitions`): z = `partitions` writes each
    /// partition's f32 sums `[partitions][n][2·rank]` for `reduce`.
    pub narrow: KernelEntry,
    /// Grid ceil(n·2·rank / 256): a split narrow launch's sums added in order into the rows.
    pub reduce: KernelEntry,
}

/// How `n` tokens launch: the tile and its grid; a grid over several partitions (z > 1) is
/// followed by the reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProjectLaunch {
    pub tile: ProjectTile,
    pub grid: (u32, u32, u32),
}

impl ProjectLaunch {
    /// Whether each CTA sums one partition of d_model (then the reduce adds them).
    pub fn split(&self) -> bool {
        self.grid.2 > 1
    }
}

impl XQuantProjectKernel {
    /// The launch for `n` new tokens on a GPU of `sms` SMs: the wide tile where its CTAs fill
    /// the SMs, else the narrow one, split over the partitions while its whole-sum CTAs would not
    /// fill them.
    pub fn launch(&self, n: usize, sms: u32) -> ProjectLaunch {
        let grid = |t: ProjectTile| {
            (
                (n as u32).div_ceil(t.rows),
                (2 * self.rank as u32).div_ceil(t.columns),
            )
        };
        let (wx, wy) = grid(ProjectTile::WIDE);
        if wx * wy >= sms {
            return ProjectLaunch {
                tile: ProjectTile::WIDE,
                grid: (wx, wy, 1),
            };
        }
        let (x, y) = grid(ProjectTile::NARROW);
        let z = if x * y < sms { self.partitions } else { 1 };
        ProjectLaunch {
            tile: ProjectTile::NARROW,
            grid: (x, y, z),
        }
    }

    /// The entry of `tile`.
    pub fn entry(&self, tile: ProjectTile) -> &KernelEntry {
        if tile == ProjectTile::WIDE {
            &self.wide
        } else {
            &self.narrow
        }
    }

    /// The reduce's grid for `n` tokens.
    pub fn reduce_grid(&self, n: usize) -> u32 {
        (n * 2 * self.rank).div_ceil(REDUCE_THREADS as usize) as u32
    }
}

#[derive(Serialize)]
struct TileCtx {
    name: String,
    tile: &'static str,
    rows: u32,
    columns: u32,
    threads: u32,
    smem_bytes: u32,
}

#[derive(Serialize)]
struct Ctx {
    dtype: &'static str,
    d_model: u32,
    rank: usize,
    partitions: u32,
    tiles: Vec<TileCtx>,
    reduce_name: String,
}

/// Refuses a layer input width or latent width the cache writes' kernels do not tile: `d_model` a
/// multiple of 64 (as model widths are), `rank` of 32 (as `kvq_reference::xquant::projection`
/// pads it), latents up to 65,536.
pub(crate) fn check_write_shape(
    family: &'static str,
    d_model: u32,
    rank: usize,
) -> Result<(), CodegenError> {
    if d_model == 0 || d_model % 64 != 0 || rank == 0 || rank % 32 != 0 || rank > 1 << 16 {
        return Err(CodegenError::Unsupported {
            family,
            what: format!(
                "d_model {d_model} and a latent of {rank} (multiples of 64 and 32; latents up to \
                 65,536)"
            ),
        });
    }
    Ok(())
}

/// The projection from a `d_model`-wide layer input in `dtype` to latents of `rank` channels
/// (`d_model` a multiple of 64, as model widths are; `rank` of 32, as
/// `kvq_reference::xquant::projection` pads it).
pub fn xquant_project_kernel(
    dtype: Dtype,
    d_model: u32,
    rank: usize,
) -> Result<XQuantProjectKernel, CodegenError> {
    check_write_shape("xquant projection", d_model, rank)?;
    let id = stable_id(&format!("xquant-project|{dtype:?}|{d_model}|{rank}"));
    let tiles = [
        (
            ProjectTile::NARROW,
            "XpNarrow",
            format!("kvq_xquant_project_narrow_{id}"),
        ),
        (
            ProjectTile::WIDE,
            "XpWide",
            format!("kvq_xquant_project_wide_{id}"),
        ),
    ];
    let ctx = Ctx {
        dtype: match dtype {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        },
        d_model,
        rank,
        partitions: partitions(d_model),
        reduce_name: format!("kvq_xquant_project_reduce_{id}"),
        tiles: tiles
            .iter()
            .map(|(t, tile, name)| TileCtx {
                name: name.clone(),
                tile,
                rows: t.rows,
                columns: t.columns,
                threads: t.threads,
                smem_bytes: t.smem_bytes(),
            })
            .collect(),
    };
    let source = render("xquant_project.cu.tera", &ctx)?;
    let entry = |t: ProjectTile, name: &str| KernelEntry {
        name: name.to_string(),
        params: vec![
            param("const uint16_t*", "x"),
            param("int32_t", "n"),
            param("const uint16_t*", "down_hi"),
            param("const uint16_t*", "down_lo"),
            param("uint16_t*", "lat_k"),
            param("uint16_t*", "lat_v"),
            param("float*", "partial"),
        ],
        grid: [
            format!("ceil(n / {})", t.rows),
            format!("2 * rank / {}", t.columns),
            "1 or partitions".into(),
        ],
        block: t.threads,
        dynamic_shared_bytes: t.smem_bytes(),
    };
    let reduce = KernelEntry {
        name: ctx.reduce_name.clone(),
        params: vec![
            param("const float*", "partial"),
            param("int32_t", "n"),
            param("uint16_t*", "lat_k"),
            param("uint16_t*", "lat_v"),
        ],
        grid: ["ceil(n * 2 * rank / 256)".into(), "1".into(), "1".into()],
        block: REDUCE_THREADS,
        dynamic_shared_bytes: 0,
    };
    Ok(XQuantProjectKernel {
        d_model,
        rank,
        dtype,
        partitions: ctx.partitions,
        reduce,
        source,
        narrow: entry(tiles[0].0, &tiles[0].2),
        wide: entry(tiles[1].0, &tiles[1].2),
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
        // 16 tokens: 16 wide CTAs would leave most of an H200's 132 SMs idle; 128 narrow ones
        // split four ways.
        assert_eq!(k.partitions, 4);
        let decode = k.launch(16, 132);
        assert_eq!(decode.tile, ProjectTile::NARROW);
        assert_eq!((decode.grid, decode.split()), ((1, 128, 4), true));
        assert_eq!(k.entry(decode.tile).block, 64);
        let prefill = k.launch(8192, 132);
        assert_eq!(
            (prefill.tile, prefill.grid),
            (ProjectTile::WIDE, (64, 32, 1))
        );
        assert_eq!(k.wide.dynamic_shared_bytes, 3 * 256 * 40 * 2 + 128 * 64 * 4);
        assert!(k.source.contains("XpWide::SMEM_BYTES == 94208"));
        // Latents of 96 (192 columns: three wide tiles, too few for 132 SMs); d_model 576 = 9
        // chunks of 64, one partition.
        let small = xquant_project_kernel(Dtype::F16, 576, 96).unwrap();
        assert_eq!(small.partitions, 1);
        assert_eq!(small.launch(16, 132).grid, (1, 12, 1));
        let f = xquant_project_kernel(Dtype::F16, 4096, 1024).unwrap();
        assert_ne!(f.narrow.name, k.narrow.name);
        for (d, r) in [(100, 64), (96, 64), (4096, 48), (0, 32), (128, 0)] {
            assert!(xquant_project_kernel(Dtype::F16, d, r).is_err());
        }
    }
}
