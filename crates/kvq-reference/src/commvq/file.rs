//! Codebook files (`kvq-codebooks-1`): one layer's [`Codebooks`] as a safetensors file, so that
//! codebooks trained offline can be shipped to the device and loaded by an engine.
//!
//! - Tensors, all F16 (the reference keeps codebook values as f32 that f16 represents exactly;
//!   saving refuses a value that is not, so a load gives back the codebooks bit for bit):
//!   - RoPE-commutative keys: `k.entries` `[kv_heads, groups, residuals, levels, pairs_per_code, 2]`
//!     ([`KeyCodebook::entries`]' order; `groups = head_dim / (2·pairs_per_code)`).
//!   - Additive (`<side>` = `k` or `v`): `<side>.table` `[books, rows, dim]`,
//!     `<side>.channel_scale` `[books, dim]` (σ), `<side>.mean` `[books, dim]` (μ); `books` and `dim`
//!     follow the span (`head`: `kv_heads` books of `head_dim`; `token`: one of `kv_heads·head_dim`).
//!     The trainer rounds μ to f16 like every other value, so F16 loses nothing.
//!   - An FP16 side has no tensors.
//! - Metadata (`__metadata__`): `kvq.format` = [`CODEBOOK_FILE_FORMAT`], `kvq.scheme` = the scheme's
//!   canonical text, `kvq.kv_heads`, `kvq.head_dim` (decimal) and, for information,
//!   `kvq.device_layout` = [`DEVICE_LAYOUT_VERSION`].
//!
//! Loading checks, in order: the format, the scheme (the file's text parsed and compared with the
//! caller's [`SchemeSpec`]), `kv_heads` and `head_dim`, then every tensor's presence, dtype and shape
//! (an unknown tensor is an error too), then the codebooks' own checks against the scheme — each a
//! [`CodebookFileError`] variant naming what is wrong.

use super::additive::{self, AdditiveCodebook};
use super::device::DEVICE_LAYOUT_VERSION;
use super::key::KeyCodebook;
use super::train::{Codebooks, TensorCodebook};
use crate::resources::{self, AllocError};
use crate::tensor_file::{self, Expected, FileMeta, MetaProblem, TensorProblem};
use crate::RefError;
use half::f16;
use kvq_spec::{CacheSource, Codebook, CodebookQuant, SchemeSpec, TensorQuant};
use safetensors::tensor::{Metadata, TensorView};
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The format this module reads and writes (metadata `kvq.format`); bumped on any change a reader
/// would notice.
pub const CODEBOOK_FILE_FORMAT: &str = "kvq-codebooks-1";

/// Largest codebook file [`Codebooks::load`] reads (memory is checked too): far past one layer's
/// codebooks (CommVq2 at 64 KV heads × 128 is about 25 MB), so a path to a disk image or a device
/// is refused before it is read.
pub const CODEBOOK_FILE_LIMIT: u64 = 1 << 34;

const KEY_FORMAT: &str = "kvq.format";
const KEY_SCHEME: &str = "kvq.scheme";
const KEY_KV_HEADS: &str = "kvq.kv_heads";
const KEY_HEAD_DIM: &str = "kvq.head_dim";
const KEY_DEVICE_LAYOUT: &str = "kvq.device_layout";

/// Why a codebook file could not be written or read; each message names the problem.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodebookFileError {
    /// The file (or its temporary sibling, while saving) could not be read or written.
    #[error("{}: {why}", path.display())]
    Io { path: PathBuf, why: String },
    /// The bytes are not a safetensors file.
    #[error("not a safetensors file: {0}")]
    NotSafetensors(String),
    /// A safetensors file without the metadata entry every codebook file has.
    #[error("not a kvq codebook file: the safetensors metadata has no `{key}`")]
    MissingMetadata { key: &'static str },
    /// Another format, or a later version of this one.
    #[error(
        "unknown codebook file format `{found}` (metadata `kvq.format`); this build reads `{}`",
        CODEBOOK_FILE_FORMAT
    )]
    UnknownFormat { found: String },
    /// A metadata value that does not parse.
    #[error("metadata `{key}` = `{value}`: {why}")]
    BadMetadata {
        key: &'static str,
        value: String,
        why: String,
    },
    /// The codebooks were trained for other K/V codebook declarations (page, sink, local and
    /// calibration may differ: they do not shape a codebook).
    #[error("the codebooks were trained for the scheme `{found}`, whose K/V codebooks are not those of `{expected}`")]
    SchemeMismatch { expected: String, found: String },
    /// The codebooks were trained for another KV head count or head size.
    #[error("the codebooks are for {what} = {found}, but {what} = {expected} was asked for")]
    ShapeMismatch {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    /// A tensor the scheme needs is not in the file.
    #[error("tensor `{tensor}` is missing (shape {expected:?} expected)")]
    MissingTensor {
        tensor: String,
        expected: Vec<usize>,
    },
    /// A tensor the scheme has no use for: refused rather than ignored, since it means the file
    /// was written for something else.
    #[error("unexpected tensor `{tensor}`: the scheme stores only {expected}")]
    UnexpectedTensor { tensor: String, expected: String },
    #[error("tensor `{tensor}` is {found}, expected {expected}")]
    WrongDtype {
        tensor: String,
        expected: &'static str,
        found: String,
    },
    #[error("tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A value f16 does not represent exactly: writing it would change the codebooks.
    #[error(
        "tensor `{tensor}` holds {value} at flat index {index}, which f16 cannot represent exactly"
    )]
    NotF16Exact {
        tensor: String,
        index: usize,
        value: f32,
    },
    /// The caller's scheme and shape cannot hold CommVQ codebooks at all (integer, XQuant, or a
    /// shape the scheme refuses).
    #[error("the scheme cannot hold CommVQ codebooks at this shape: {0}")]
    Scheme(RefError),
    /// Codebooks that do not fit the scheme (the reference's own checks).
    #[error("the codebooks do not fit the scheme: {0}")]
    Codebooks(RefError),
    /// The safetensors encoder failed.
    #[error("cannot encode the codebook file: {0}")]
    Encode(String),
    /// A size larger than the machine's memory (or than 64 bits), refused before allocating.
    #[error(transparent)]
    Alloc(#[from] AllocError),
}

type Result<T> = std::result::Result<T, CodebookFileError>;

impl From<MetaProblem> for CodebookFileError {
    fn from(p: MetaProblem) -> Self {
        match p {
            MetaProblem::Missing { key } => CodebookFileError::MissingMetadata { key },
            MetaProblem::UnknownFormat { found } => CodebookFileError::UnknownFormat { found },
            MetaProblem::Bad { key, value, why } => {
                CodebookFileError::BadMetadata { key, value, why }
            }
        }
    }
}

/// Which side a tensor belongs to (its name prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    K,
    V,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::K => "k",
            Side::V => "v",
        }
    }
}

/// A tensor the scheme needs, named `<side>.<what>`.
fn expected(side: Side, what: &str, shape: Vec<usize>) -> Expected {
    Expected {
        name: format!("{}.{what}", side.name()),
        shape,
        dtype: Dtype::F16,
    }
}

/// Elements of a tensor, refused on overflow (a hand-built scheme may ask for anything).
fn element_count(e: &Expected) -> Result<usize> {
    resources::product(&e.shape).ok_or_else(|| {
        AllocError::overflow(format!("codebook tensor `{}` {:?}", e.name, e.shape)).into()
    })
}

/// The caller's scheme, checked once: what every entry point needs before touching tensors.
fn check_scheme(spec: &SchemeSpec, kv_heads: usize, head_dim: usize) -> Result<()> {
    let wrong = |why: String| CodebookFileError::Scheme(RefError::WrongEntryPoint(why));
    if spec.source != CacheSource::Kv {
        return Err(wrong(
            "it caches layer activations (XQuant), which have no CommVQ codebooks".into(),
        ));
    }
    for (side, t) in [(Side::K, &spec.k), (Side::V, &spec.v)] {
        if matches!(t, TensorQuant::Int(_)) {
            return Err(wrong(format!(
                "`{}` is integer-quantized, which has no codebook",
                side.name()
            )));
        }
    }
    if let TensorQuant::Codebook(CodebookQuant {
        codebook: Codebook::RopeCommutative { .. },
        ..
    }) = spec.v
    {
        return Err(wrong(
            "a RoPE-commutative codebook is for keys; values use an additive codebook".into(),
        ));
    }
    spec.check_shape_usize(head_dim, kv_heads)
        .map_err(|e| CodebookFileError::Scheme(e.into()))
}

/// The tensors one side of `spec` stores, in a fixed order.
fn expected_side(
    side: Side,
    t: &TensorQuant,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Vec<Expected>> {
    let TensorQuant::Codebook(c) = t else {
        return Ok(Vec::new());
    };
    Ok(match c.codebook {
        Codebook::RopeCommutative {
            levels,
            residuals,
            pairs_per_code,
        } => {
            let g = pairs_per_code as usize;
            // `check_shape` has made `2g` divide `head_dim`; `max(1)` keeps a hand-built zero from
            // dividing by zero all the same.
            let groups = head_dim / 2 / g.max(1);
            let shape = vec![kv_heads, groups, residuals as usize, levels as usize, g, 2];
            vec![expected(side, "entries", shape)]
        }
        Codebook::Additive { rows } => {
            let books = additive::books(c.span, kv_heads);
            let dim = kv_heads
                .checked_mul(head_dim)
                .map(|_| additive::dim(c.span, kv_heads, head_dim))
                .ok_or_else(|| AllocError::overflow("an additive codebook's vector size"))?;
            vec![
                expected(side, "table", vec![books, rows as usize, dim]),
                expected(side, "channel_scale", vec![books, dim]),
                expected(side, "mean", vec![books, dim]),
            ]
        }
    })
}

/// Every tensor of `spec`, K's first; their f32 total is checked against the memory available.
fn expected_tensors(spec: &SchemeSpec, kv_heads: usize, head_dim: usize) -> Result<Vec<Expected>> {
    let mut all = expected_side(Side::K, &spec.k, kv_heads, head_dim)?;
    all.extend(expected_side(Side::V, &spec.v, kv_heads, head_dim)?);
    let mut elements = 0usize;
    for e in &all {
        elements = elements
            .checked_add(element_count(e)?)
            .ok_or_else(|| AllocError::overflow("the codebook tensors"))?;
    }
    resources::check(resources::bytes_of::<f32>(elements), "the codebook tensors")?;
    Ok(all)
}

/// The reference's own checks of one side's codebook against the scheme (those
/// `CommVqCache::build` applies), plus: an FP16 side must have no codebook, so that nothing given
/// to `save` is silently dropped.
fn check_side(
    side: Side,
    t: &TensorQuant,
    cb: Option<&TensorCodebook>,
    kv_heads: usize,
    head_dim: usize,
) -> Result<()> {
    let name = side.name();
    let mismatch = |why: String| CodebookFileError::Codebooks(RefError::Mismatch(why));
    match (t, cb) {
        (TensorQuant::Fp16 | TensorQuant::Int(_), None) => Ok(()),
        (TensorQuant::Fp16 | TensorQuant::Int(_), Some(_)) => Err(mismatch(format!(
            "`{name}` is FP16 in the scheme, yet a codebook was given for it"
        ))),
        (TensorQuant::Codebook(_), None) => Err(mismatch(format!(
            "the scheme declares a codebook for `{name}`, and none was given"
        ))),
        (TensorQuant::Codebook(c), Some(cb)) => match (c.codebook, cb) {
            (
                Codebook::RopeCommutative {
                    levels,
                    residuals,
                    pairs_per_code,
                },
                TensorCodebook::RopeCommutative(k),
            ) => {
                k.check(kv_heads, head_dim)
                    .map_err(CodebookFileError::Codebooks)?;
                let want = (levels as usize, residuals as usize, pairs_per_code as usize);
                if (k.levels, k.residuals, k.pairs_per_code) != want {
                    return Err(mismatch(format!(
                        "`{name}` codebook has {} levels, {} residuals, {} pairs per code; the \
                         scheme asks for {levels}, {residuals}, {pairs_per_code}",
                        k.levels, k.residuals, k.pairs_per_code
                    )));
                }
                Ok(())
            }
            (Codebook::Additive { rows }, TensorCodebook::Additive(a)) => a
                .check(c.span, rows as usize, kv_heads, head_dim)
                .map_err(CodebookFileError::Codebooks),
            _ => Err(mismatch(format!(
                "`{name}` codebook is not of the kind the scheme declares"
            ))),
        },
    }
}

fn check_codebooks(
    cb: &Codebooks,
    spec: &SchemeSpec,
    kv_heads: usize,
    head_dim: usize,
) -> Result<()> {
    check_side(Side::K, &spec.k, cb.k.as_ref(), kv_heads, head_dim)?;
    check_side(Side::V, &spec.v, cb.v.as_ref(), kv_heads, head_dim)
}

/// The values of one side's tensors, in [`expected_side`]'s order.
fn side_values(cb: Option<&TensorCodebook>) -> Vec<&[f32]> {
    match cb {
        None => Vec::new(),
        Some(TensorCodebook::RopeCommutative(k)) => vec![&k.entries],
        Some(TensorCodebook::Additive(a)) => vec![&a.table, &a.channel_scale, &a.mean],
    }
}

/// Little-endian f16 bytes of `values`, refusing the first value f16 does not hold bit for bit.
fn f16_bytes(name: &str, values: &[f32]) -> Result<Vec<u8>> {
    let bytes = resources::bytes_of::<f16>(values.len()).and_then(|b| usize::try_from(b).ok());
    let mut out =
        resources::try_with_capacity(bytes.unwrap_or(usize::MAX), &format!("tensor `{name}`"))?;
    for (index, &value) in values.iter().enumerate() {
        let h = f16::from_f32(value);
        if h.to_f32().to_bits() != value.to_bits() {
            return Err(CodebookFileError::NotF16Exact {
                tensor: name.to_string(),
                index,
                value,
            });
        }
        out.extend_from_slice(&h.to_bits().to_le_bytes());
    }
    Ok(out)
}

/// The f32 values of an F16 tensor's little-endian bytes.
fn f16_values(name: &str, data: &[u8]) -> Result<Vec<f32>> {
    let mut out = resources::try_with_capacity(data.len() / 2, &format!("tensor `{name}`"))?;
    out.extend(
        data.chunks_exact(2)
            .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
    );
    Ok(out)
}

fn metadata(spec: &SchemeSpec, kv_heads: usize, head_dim: usize) -> HashMap<String, String> {
    [
        (KEY_FORMAT, CODEBOOK_FILE_FORMAT.to_string()),
        (KEY_SCHEME, spec.to_string()),
        (KEY_KV_HEADS, kv_heads.to_string()),
        (KEY_HEAD_DIM, head_dim.to_string()),
        (KEY_DEVICE_LAYOUT, DEVICE_LAYOUT_VERSION.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Reads and checks the metadata: format, then scheme, then `kv_heads` and `head_dim`.
fn check_metadata(
    meta: Option<&HashMap<String, String>>,
    spec: &SchemeSpec,
    kv_heads: usize,
    head_dim: usize,
) -> Result<()> {
    let meta = FileMeta(meta);
    meta.format(KEY_FORMAT, CODEBOOK_FILE_FORMAT)?;
    let (found, text) = meta.scheme(KEY_SCHEME)?;
    // Only the K and V declarations shape a codebook: page, sink, local and calibration do not,
    // so codebooks trained under one page size serve the same tensors under another.
    if (found.k, found.v, found.source) != (spec.k, spec.v, spec.source) {
        return Err(CodebookFileError::SchemeMismatch {
            expected: spec.to_string(),
            found: text.clone(),
        });
    }
    for (key, what, expected) in [
        (KEY_KV_HEADS, "kv_heads", kv_heads),
        (KEY_HEAD_DIM, "head_dim", head_dim),
    ] {
        let found = meta.count(key)?;
        if found != expected {
            return Err(CodebookFileError::ShapeMismatch {
                what,
                expected,
                found,
            });
        }
    }
    Ok(())
}

/// A safetensors error as this module's error.
fn not_safetensors(e: &safetensors::SafeTensorError, len: usize) -> CodebookFileError {
    CodebookFileError::NotSafetensors(tensor_file::safetensors_problem(e, len))
}

/// The tensors of `expected` from a parsed header and the data after it, checked for presence,
/// dtype and shape; then no others.
fn read_tensors(meta: &Metadata, data: &[u8], expected: &[Expected]) -> Result<Vec<Vec<f32>>> {
    let bytes = tensor_file::tensor_bytes(meta, data, expected).map_err(|p| match p {
        TensorProblem::Missing { tensor, expected } => {
            CodebookFileError::MissingTensor { tensor, expected }
        }
        TensorProblem::WrongDtype {
            tensor,
            expected,
            found,
        } => CodebookFileError::WrongDtype {
            tensor,
            expected,
            found,
        },
        TensorProblem::Shape {
            tensor,
            expected,
            found,
        } => CodebookFileError::TensorShape {
            tensor,
            expected,
            found,
        },
        TensorProblem::Unexpected { tensor, expected } => {
            CodebookFileError::UnexpectedTensor { tensor, expected }
        }
        TensorProblem::OutOfFile { tensor } => CodebookFileError::NotSafetensors(format!(
            "tensor `{tensor}`'s data offsets lie outside the file"
        )),
    })?;
    expected
        .iter()
        .zip(bytes)
        .map(|(e, b)| f16_values(&e.name, b))
        .collect()
}

/// One side's codebook from its tensors' values (in [`expected_side`]'s order).
fn side_codebook(
    t: &TensorQuant,
    values: &mut impl Iterator<Item = Vec<f32>>,
    kv_heads: usize,
    head_dim: usize,
) -> Option<TensorCodebook> {
    let TensorQuant::Codebook(c) = t else {
        return None;
    };
    Some(match c.codebook {
        Codebook::RopeCommutative {
            levels,
            residuals,
            pairs_per_code,
        } => TensorCodebook::RopeCommutative(KeyCodebook {
            kv_heads,
            head_dim,
            levels: levels as usize,
            residuals: residuals as usize,
            pairs_per_code: pairs_per_code as usize,
            entries: values.next().unwrap_or_default(),
        }),
        Codebook::Additive { rows } => TensorCodebook::Additive(AdditiveCodebook {
            span: c.span,
            kv_heads,
            head_dim,
            rows: rows as usize,
            table: values.next().unwrap_or_default(),
            channel_scale: values.next().unwrap_or_default(),
            mean: values.next().unwrap_or_default(),
        }),
    })
}

impl Codebooks {
    /// This layer's codebooks as a `kvq-codebooks-1` safetensors file, for `spec` at `kv_heads` ×
    /// `head_dim`. Refuses codebooks that do not fit the scheme (what [`CommVqCache::build`] would
    /// refuse) and values f16 does not hold exactly, so that loading gives back these codebooks.
    ///
    /// [`CommVqCache::build`]: super::CommVqCache::build
    pub fn to_safetensors(
        &self,
        spec: &SchemeSpec,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Vec<u8>> {
        check_scheme(spec, kv_heads, head_dim)?;
        check_codebooks(self, spec, kv_heads, head_dim)?;
        let expected = expected_tensors(spec, kv_heads, head_dim)?;
        let mut values = side_values(self.k.as_ref());
        values.extend(side_values(self.v.as_ref()));
        let mut bytes = Vec::with_capacity(expected.len());
        for (e, v) in expected.iter().zip(&values) {
            bytes.push(f16_bytes(&e.name, v)?);
        }
        let views = expected
            .iter()
            .zip(&bytes)
            .map(|(e, b)| {
                TensorView::new(Dtype::F16, e.shape.clone(), b)
                    .map(|v| (e.name.clone(), v))
                    .map_err(|err| CodebookFileError::Encode(format!("tensor `{}`: {err}", e.name)))
            })
            .collect::<Result<Vec<_>>>()?;
        safetensors::serialize(views, &Some(metadata(spec, kv_heads, head_dim)))
            .map_err(|e| CodebookFileError::Encode(e.to_string()))
    }

    /// Reads a `kvq-codebooks-1` file's bytes, checking that it holds codebooks for `spec` at
    /// `kv_heads` × `head_dim` (format, scheme, shape, tensors, then the codebooks themselves).
    pub fn from_safetensors(
        bytes: &[u8],
        spec: &SchemeSpec,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Codebooks> {
        let (header, meta) =
            SafeTensors::read_metadata(bytes).map_err(|e| not_safetensors(&e, bytes.len()))?;
        check_metadata(meta.metadata().as_ref(), spec, kv_heads, head_dim)?;
        check_scheme(spec, kv_heads, head_dim)?;
        let expected = expected_tensors(spec, kv_heads, head_dim)?;
        // The data follows the 8-byte length and the header.
        let data = header
            .checked_add(8)
            .and_then(|at| bytes.get(at..))
            .unwrap_or_default();
        let mut values = read_tensors(&meta, data, &expected)?.into_iter();
        let books = Codebooks {
            k: side_codebook(&spec.k, &mut values, kv_heads, head_dim),
            v: side_codebook(&spec.v, &mut values, kv_heads, head_dim),
        };
        check_codebooks(&books, spec, kv_heads, head_dim)?;
        Ok(books)
    }

    /// Writes [`to_safetensors`](Self::to_safetensors)' bytes to `path` through a temporary file
    /// in the same folder, renamed over `path` once complete: a reader never sees half a file.
    pub fn save(
        &self,
        path: &Path,
        spec: &SchemeSpec,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let bytes = self.to_safetensors(spec, kv_heads, head_dim)?;
        write_atomically(path, &bytes)
    }

    /// Reads `path` (a regular file of at most [`CODEBOOK_FILE_LIMIT`] bytes) as
    /// [`from_safetensors`](Self::from_safetensors) does.
    pub fn load(
        path: &Path,
        spec: &SchemeSpec,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Codebooks> {
        let bytes = resources::read_input_file(path, "the codebook file", CODEBOOK_FILE_LIMIT)
            .map_err(|e| CodebookFileError::Io {
                path: e.path,
                why: e.why,
            })?;
        Self::from_safetensors(&bytes, spec, kv_heads, head_dim)
    }
}

/// [`tensor_file::write_atomically`], its error naming `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    tensor_file::write_atomically(path, bytes, "the codebook file").map_err(|why| {
        CodebookFileError::Io {
            path: path.to_path_buf(),
            why,
        }
    })
}
