//! Projection files (`kvq-projections-1`): one layer's XQuant [`Projections`] as a safetensors
//! file, so that the SVD runs once per model (offline, on the CPU) and an engine loads its result.
//!
//! - Tensors (`<side>` = `k` or `v`): `<side>.down` `[d_model, rank]` and `<side>.up`
//!   `[rank, kv_heads·head_dim]` as F32 (the reference's values, bit for bit; a kernel rounds them
//!   to its input format itself), `<side>.singular` `[min(d_model, kv_heads·head_dim)]` as F64.
//! - Metadata: `kvq.format` = [`PROJECTION_FILE_FORMAT`], `kvq.scheme` (the scheme's canonical
//!   text), `kvq.d_model`, `kvq.kv_heads`, `kvq.head_dim`, `kvq.rank` (decimal).
//!
//! Loading checks, in order: the format, that the file's scheme and the caller's both cache the
//! layer input (`source = x(…)`) the same way, the shape (`d_model`, `kv_heads`, `head_dim`,
//! `rank`), every tensor's presence, dtype and shape (an unknown tensor is an error too), then that
//! every value is finite — each a [`ProjectionFileError`] naming what is wrong. Bits and page sizes
//! do not shape a projection: a file serves every scheme with the same source at the same shape.

use super::projection::{LatentProjection, Projections};
use crate::resources::{self, AllocError};
use crate::tensor_file::{self, Expected, FileMeta, MetaProblem};
use kvq_spec::{CacheSource, SchemeSpec};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The format this module reads and writes (metadata `kvq.format`).
pub const PROJECTION_FILE_FORMAT: &str = "kvq-projections-1";

/// Largest projection file [`Projections::load`] reads: a 16384-wide model's two projections at
/// full rank in f32 are 2 GiB; a path to a disk image is refused before it is read.
pub const PROJECTION_FILE_LIMIT: u64 = 1 << 34;

const KEY_FORMAT: &str = "kvq.format";
const KEY_SCHEME: &str = "kvq.scheme";
const SHAPE_KEYS: [(&str, &str); 4] = [
    ("kvq.d_model", "d_model"),
    ("kvq.kv_heads", "kv_heads"),
    ("kvq.head_dim", "head_dim"),
    ("kvq.rank", "rank"),
];

/// Why a projection file could not be written or read; each message names the problem.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProjectionFileError {
    /// The file (or its temporary sibling, while saving) could not be read or written.
    #[error("{}: {why}", path.display())]
    Io { path: PathBuf, why: String },
    /// The bytes are not a safetensors file.
    #[error("not a safetensors file: {0}")]
    NotSafetensors(String),
    /// A safetensors file without a metadata entry every projection file has.
    #[error("not a kvq projection file: the safetensors metadata has no `{key}`")]
    MissingMetadata { key: &'static str },
    /// Another format, or a later version of this one.
    #[error(
        "unknown projection file format `{found}` (metadata `kvq.format`); this build reads `{}`",
        PROJECTION_FILE_FORMAT
    )]
    UnknownFormat { found: String },
    /// A metadata value that does not parse.
    #[error("metadata `{key}` = `{value}`: {why}")]
    BadMetadata {
        key: &'static str,
        value: String,
        why: String,
    },
    /// The caller's scheme caches K and V, not the layer input: it has no projections.
    #[error("`{0}` caches K and V, not the layer input (source = x(latent) or x(cross_layer))")]
    NotXQuant(String),
    /// The file was made for a scheme with another source.
    #[error("the projections were made for `{found}`, whose source is not that of `{expected}`")]
    SourceMismatch { expected: String, found: String },
    /// Another shape than the caller's (or than the projections', when saving).
    #[error("the projections are for {what} = {found}, but {what} = {expected} was asked for")]
    ShapeMismatch {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    /// A tensor missing, of another dtype or shape, or one the format has no use for.
    #[error("{0}")]
    Tensors(String),
    /// A NaN or infinite value: such a projection would poison every key it rebuilds.
    #[error("tensor `{tensor}` holds {value} at flat index {index}")]
    NonFinite {
        tensor: String,
        index: usize,
        value: f64,
    },
    /// The safetensors encoder failed.
    #[error("cannot encode the projection file: {0}")]
    Encode(String),
    /// A size larger than the machine's memory, refused before allocating.
    #[error(transparent)]
    Alloc(#[from] AllocError),
}

type Result<T> = std::result::Result<T, ProjectionFileError>;

impl From<MetaProblem> for ProjectionFileError {
    fn from(p: MetaProblem) -> Self {
        match p {
            MetaProblem::Missing { key } => ProjectionFileError::MissingMetadata { key },
            MetaProblem::UnknownFormat { found } => ProjectionFileError::UnknownFormat { found },
            MetaProblem::Bad { key, value, why } => {
                ProjectionFileError::BadMetadata { key, value, why }
            }
        }
    }
}

/// The shape a file records: `[d_model, kv_heads, head_dim, rank]`.
fn shape_of(p: &Projections) -> [usize; 4] {
    [p.d_model(), p.kv_heads, p.head_dim, p.k.rank]
}

fn expected_tensors(d_model: usize, out: usize, rank: usize) -> Vec<Expected> {
    let r = d_model.min(out);
    ["k", "v"]
        .into_iter()
        .flat_map(|side| {
            [
                ("down", vec![d_model, rank], Dtype::F32),
                ("up", vec![rank, out], Dtype::F32),
                ("singular", vec![r], Dtype::F64),
            ]
            .into_iter()
            .map(move |(what, shape, dtype)| Expected {
                name: format!("{side}.{what}"),
                shape,
                dtype,
            })
        })
        .collect()
}

fn check_source(spec: &SchemeSpec) -> Result<()> {
    match spec.source {
        CacheSource::X(_) => Ok(()),
        CacheSource::Kv => Err(ProjectionFileError::NotXQuant(spec.to_string())),
    }
}

fn check_finite(name: &str, values: impl Iterator<Item = f64>) -> Result<()> {
    for (index, value) in values.enumerate() {
        if !value.is_finite() {
            return Err(ProjectionFileError::NonFinite {
                tensor: name.to_string(),
                index,
                value,
            });
        }
    }
    Ok(())
}

impl Projections {
    /// This layer's projections as a `kvq-projections-1` safetensors file for `spec` (which must
    /// cache the layer input). Refuses non-finite values and projections whose sides disagree on
    /// the shape.
    pub fn to_safetensors(&self, spec: &SchemeSpec) -> Result<Vec<u8>> {
        check_source(spec)?;
        let [d_model, kv_heads, head_dim, rank] = shape_of(self);
        let out = kv_heads * head_dim;
        for (what, expected, found) in [
            ("d_model", d_model, self.v.d_model),
            ("rank", rank, self.v.rank),
            ("output width", out, self.k.out),
            ("output width", out, self.v.out),
        ] {
            if expected != found {
                return Err(ProjectionFileError::ShapeMismatch {
                    what,
                    expected,
                    found,
                });
            }
        }
        let mut buffers: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (e, side) in expected_tensors(d_model, out, rank)
            .into_iter()
            .zip([&self.k, &self.k, &self.k, &self.v, &self.v, &self.v])
        {
            let bytes: Vec<u8> = if e.name.ends_with("singular") {
                check_finite(&e.name, side.singular.iter().copied())?;
                side.singular.iter().flat_map(|x| x.to_le_bytes()).collect()
            } else {
                let values = if e.name.ends_with("down") {
                    &side.down
                } else {
                    &side.up
                };
                check_finite(&e.name, values.iter().map(|x| *x as f64))?;
                values.iter().flat_map(|x| x.to_le_bytes()).collect()
            };
            buffers.push((e.name, e.dtype, e.shape, bytes));
        }
        let views = buffers
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|err| ProjectionFileError::Encode(format!("tensor `{name}`: {err}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut meta: HashMap<String, String> = HashMap::new();
        meta.insert(KEY_FORMAT.into(), PROJECTION_FILE_FORMAT.into());
        meta.insert(KEY_SCHEME.into(), spec.to_string());
        for ((key, _), value) in SHAPE_KEYS.iter().zip(shape_of(self)) {
            meta.insert((*key).into(), value.to_string());
        }
        safetensors::serialize(views, &Some(meta))
            .map_err(|e| ProjectionFileError::Encode(e.to_string()))
    }

    /// Reads a `kvq-projections-1` file's bytes, checking that it serves `spec` at `d_model` ×
    /// `kv_heads` × `head_dim` (format, source, shape, tensors, values).
    pub fn from_safetensors(
        bytes: &[u8],
        spec: &SchemeSpec,
        d_model: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Projections> {
        check_source(spec)?;
        let (header, meta) = SafeTensors::read_metadata(bytes).map_err(|e| {
            ProjectionFileError::NotSafetensors(tensor_file::safetensors_problem(&e, bytes.len()))
        })?;
        let m = FileMeta(meta.metadata().as_ref());
        m.format(KEY_FORMAT, PROJECTION_FILE_FORMAT)?;
        let (found, text) = m.scheme(KEY_SCHEME)?;
        if found.source != spec.source {
            return Err(ProjectionFileError::SourceMismatch {
                expected: spec.to_string(),
                found: text.clone(),
            });
        }
        let mut shape = [0usize; 4];
        for (slot, (key, _)) in shape.iter_mut().zip(SHAPE_KEYS) {
            *slot = m.count(key)?;
        }
        let out = kv_heads * head_dim;
        let rank = d_model.min(out).div_ceil(32) * 32;
        for ((_, what), (expected, found)) in SHAPE_KEYS
            .iter()
            .zip([d_model, kv_heads, head_dim, rank].into_iter().zip(shape))
        {
            if expected != found {
                return Err(ProjectionFileError::ShapeMismatch {
                    what,
                    expected,
                    found,
                });
            }
        }
        let data = header
            .checked_add(8)
            .and_then(|at| bytes.get(at..))
            .unwrap_or_default();
        let expected = expected_tensors(d_model, out, rank);
        let bytes_of = tensor_file::tensor_bytes(&meta, data, &expected)
            .map_err(|p| ProjectionFileError::Tensors(p.to_string()))?;
        let raw: Vec<(String, &[u8])> = expected
            .iter()
            .map(|e| e.name.clone())
            .zip(bytes_of)
            .collect();
        let take = |name: &str| -> &[u8] {
            raw.iter()
                .find(|(n, _)| n == name)
                .map(|(_, b)| *b)
                .unwrap_or_default()
        };
        let side = |s: &str| -> Result<LatentProjection> {
            let down = tensor_file::f32_values(&format!("{s}.down"), take(&format!("{s}.down")))?;
            let up = tensor_file::f32_values(&format!("{s}.up"), take(&format!("{s}.up")))?;
            let singular =
                tensor_file::f64_values(&format!("{s}.singular"), take(&format!("{s}.singular")))?;
            check_finite(&format!("{s}.down"), down.iter().map(|x| *x as f64))?;
            check_finite(&format!("{s}.up"), up.iter().map(|x| *x as f64))?;
            check_finite(&format!("{s}.singular"), singular.iter().copied())?;
            Ok(LatentProjection {
                d_model,
                out,
                rank,
                down,
                up,
                singular,
            })
        };
        Ok(Projections {
            kv_heads,
            head_dim,
            k: side("k")?,
            v: side("v")?,
        })
    }

    /// Writes [`to_safetensors`](Self::to_safetensors)' bytes to `path` through a temporary file
    /// renamed over `path` once complete.
    pub fn save(&self, path: &Path, spec: &SchemeSpec) -> Result<()> {
        let bytes = self.to_safetensors(spec)?;
        tensor_file::write_atomically(path, &bytes, "the projection file").map_err(|why| {
            ProjectionFileError::Io {
                path: path.to_path_buf(),
                why,
            }
        })
    }

    /// Reads `path` (a regular file of at most [`PROJECTION_FILE_LIMIT`] bytes) as
    /// [`from_safetensors`](Self::from_safetensors) does.
    pub fn load(
        path: &Path,
        spec: &SchemeSpec,
        d_model: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Projections> {
        let bytes = resources::read_input_file(path, "the projection file", PROJECTION_FILE_LIMIT)
            .map_err(|e| ProjectionFileError::Io {
                path: e.path,
                why: e.why,
            })?;
        Self::from_safetensors(&bytes, spec, d_model, kv_heads, head_dim)
    }
}
