//! `kvq eval`: a scheme's error on the user's own captured K/V (a safetensors file), per layer and
//! per KV head, on the CPU reference — and on the GPU kernel too when a GPU is usable.
//!
//! Tensor names and shapes (docs/CLI.md):
//! - `layer.{i}.k`, `layer.{i}.v`: `[tokens, kv_heads, head_dim]` (or `[kv_heads, tokens, head_dim]`
//!   with `--layout heads-first`), f16, bf16, f32 or f64; keys after RoPE, as the cache sees them;
//! - `layer.{i}.q` (optional): the next token's queries `[q_heads, head_dim]` (a leading 1 is
//!   accepted), `q_heads` a multiple of `kv_heads`. Without it, each KV head's query is its own key
//!   at the last token and the cache holds the tokens before it (a proxy: in trained models a
//!   head's queries and keys point the same way; capture real queries for real numbers).

mod families;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kvq::codegen::{Dtype, KernelShape, TuneParams};
use kvq::evaluate;
use kvq::reference::attention::{self, Queries};
use kvq::reference::every_token;
use kvq::reference::int::IntCache;
use kvq::reference::regions;
use kvq::reference::resources;
use kvq::reference::step::{self, StepQueries};
use kvq::reference::synth::try_to_head_major;
use kvq::reference::Dequantized;
use kvq::reference::KvTensor;
use safetensors::{Dtype as StDtype, SafeTensorError, SafeTensors};

use crate::error::{CliError, Result};
use crate::gpu::{self, Gpu};
use crate::scheme::Resolved;
use crate::table::{Align, Table};

/// Axis order of the K/V tensors in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvLayout {
    /// `[tokens, kv_heads, head_dim]` (a decode engine's per-layer K/V).
    TokensFirst,
    /// `[kv_heads, tokens, head_dim]` (Hugging Face's `past_key_values` without the batch axis).
    HeadsFirst,
}

/// What to evaluate.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    pub scheme: Resolved,
    pub file: PathBuf,
    pub layout: KvLayout,
    /// Only these layers (all found when empty).
    pub layers: Vec<usize>,
    /// Skip the GPU even when one is usable.
    pub cpu_only: bool,
    pub device: usize,
    /// Print JSON instead of the table.
    pub json: bool,
    /// The model's RoPE base (CommVQ and XQuant apply RoPE themselves).
    pub rope_theta: Option<f64>,
    /// Evaluate a whole sequence's queries at the last token only.
    pub last_query: bool,
}

/// One layer's data as the reference takes it.
pub struct Layer {
    pub index: usize,
    pub k: KvTensor,
    pub v: KvTensor,
    pub q: Queries,
    /// Whether `q` came from the file (else the last-key proxy).
    pub captured_queries: bool,
    /// A whole sequence's queries (`layer.{i}.q` with a token axis): every token's decode step
    /// is evaluated, `q` then being the last token's.
    pub steps: Option<StepQueries>,
    /// Pre-RoPE keys, the layer input and projections, calibration tokens (CommVQ, XQuant).
    pub extra: families::Extra,
}

/// Per-head results of one layer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HeadResult {
    pub head: usize,
    pub k_rel_mse: f64,
    pub v_rel_mse: f64,
    pub attn_error: f64,
    pub gpu_error: Option<f64>,
}

/// One layer's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LayerResult {
    pub index: usize,
    pub tokens: usize,
    pub quantized_tokens: usize,
    pub kv_heads: usize,
    pub q_heads: usize,
    pub head_dim: usize,
    pub captured_queries: bool,
    /// Decode steps evaluated: 1 for one query, else those of a whole sequence's queries whose
    /// cache held a quantized token (`attn_error` is their mean, `worst_step_error` the largest).
    pub steps: usize,
    pub worst_step_error: f64,
    /// ‖x̂ − x‖² / ‖x‖² of the layer's K and V (the mean of the heads' for integer schemes).
    pub k_rel_mse: f64,
    pub v_rel_mse: f64,
    pub attn_error: f64,
    pub gpu_error: Option<f64>,
    pub heads: Vec<HeadResult>,
    pub bits_per_element: f64,
    /// Bits per element of the same layer's cache at [`LONG_CONTEXT`] tokens, where the FP16
    /// windows weigh little.
    pub bits_per_element_long: f64,
    /// A note printed under the table: why the GPU column is empty for this layer, or which
    /// queries a scheme was evaluated at.
    pub gpu_note: Option<String>,
}

/// The context the long-context bits per element are given at.
pub const LONG_CONTEXT: u64 = 32768;

fn input(path: &Path, why: impl Into<String>) -> CliError {
    CliError::Input {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

fn expected_names(i: &str) -> String {
    format!(
        "`layer.{i}.k` and `layer.{i}.v` of shape [tokens, kv_heads, head_dim] (f16, bf16, f32 or \
         f64), optional `layer.{i}.q` of shape [q_heads, head_dim]"
    )
}

/// Values of a tensor as f32, allocated through the memory guard; NaN, ±Inf and f64 values past
/// f32's range are refused with their position (a cache of them would be silently broken).
fn to_f32(
    path: &Path,
    name: &str,
    dtype: StDtype,
    shape: &[usize],
    data: &[u8],
) -> Result<Vec<f32>> {
    let size = match dtype {
        StDtype::F16 | StDtype::BF16 => 2,
        StDtype::F32 => 4,
        StDtype::F64 => 8,
        other => {
            return Err(input(
                path,
                format!("tensor `{name}` has dtype {other:?}; expected f16, bf16, f32 or f64"),
            ))
        }
    };
    let count = data.len() / size;
    let mut out =
        resources::try_with_capacity::<f32>(count, &format!("tensor `{name}` {shape:?} as f32"))
            .map_err(|e| input(path, e.to_string()))?;
    let chunks = data.chunks_exact(size);
    match dtype {
        StDtype::F16 => out.extend(
            chunks.map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
        ),
        StDtype::BF16 => out.extend(
            chunks.map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
        ),
        StDtype::F32 => out.extend(chunks.map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        _ => out.extend(chunks.map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            f64::from_le_bytes(a) as f32
        })),
    }
    if let Some(i) = out.iter().position(|x| !x.is_finite()) {
        // The index in the file's own axes, so the user can find it in their capture.
        let mut at = Vec::with_capacity(shape.len());
        let mut rest = i;
        for &d in shape.iter().rev() {
            at.push(rest % d.max(1));
            rest /= d.max(1);
        }
        at.reverse();
        return Err(input(
            path,
            format!(
                "tensor `{name}` holds {} at index {at:?}{}; K, V and queries must be finite",
                out[i],
                if dtype == StDtype::F64 {
                    " (or a value past f32's range)"
                } else {
                    ""
                }
            ),
        ));
    }
    Ok(out)
}

/// Largest K/V file `kvq eval` reads (memory is checked too): far past any one capture, so a
/// path to a disk image or a device is refused before it is read.
pub const KV_FILE_LIMIT: u64 = 1 << 40;

/// Reads the file with its size known and checks it is a safetensors file; the errors are
/// sentences naming the file and, where there is one, the tensor.
fn read_safetensors(path: &Path) -> Result<Vec<u8>> {
    resources::read_input_file(path, "the K/V file", KV_FILE_LIMIT).map_err(|e| {
        // A missing file gets the expected contents (the user may be about to write it); a
        // device or a directory only needs to be told apart from a file.
        let why = if e.not_found {
            format!(
                "{}; expected a safetensors file with {}",
                e.why,
                expected_names("{i}")
            )
        } else {
            e.why
        };
        input(path, why)
    })
}

/// The header's tensor entries, where the header is readable JSON: to name the tensor behind a
/// safetensors error that does not.
fn header_entries(bytes: &[u8]) -> Vec<(String, serde_json::Value)> {
    let Some(n) = bytes
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
    else {
        return Vec::new();
    };
    let Some(header) = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_add(8))
        .and_then(|end| bytes.get(8..end))
    else {
        return Vec::new();
    };
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(header) {
        Ok(map) => map
            .into_iter()
            .filter(|(k, _)| k != "__metadata__")
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The first tensor whose shape × dtype size overflows or disagrees with its data offsets.
fn tensor_with_bad_size(bytes: &[u8], overflow: bool) -> Option<String> {
    header_entries(bytes).into_iter().find_map(|(name, v)| {
        let dtype: StDtype = serde_json::from_value(v.get("dtype")?.clone()).ok()?;
        let shape: Vec<u64> = serde_json::from_value(v.get("shape")?.clone()).ok()?;
        let (s, e): (u64, u64) = serde_json::from_value(v.get("data_offsets")?.clone()).ok()?;
        let bytes_needed = shape
            .iter()
            .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d));
        let bad = match bytes_needed {
            None => overflow,
            Some(b) => !overflow && Some(b) != e.checked_sub(s),
        };
        bad.then(|| {
            format!("tensor `{name}` (shape {shape:?}, {dtype:?}, data_offsets [{s}, {e}])")
        })
    })
}

/// A safetensors error as a sentence (the crate's own are bare variant names).
fn safetensors_problem(e: &SafeTensorError, bytes: &[u8]) -> String {
    let len = bytes.len();
    let header_len = bytes
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0);
    match e {
        SafeTensorError::HeaderTooSmall => format!(
            "the file is {len} bytes, shorter than the 8-byte header length a safetensors file \
             starts with"
        ),
        SafeTensorError::HeaderTooLarge => format!(
            "its first 8 bytes give a header of {header_len} bytes, more than the 100 MB \
             safetensors allows (the file is {len} bytes)"
        ),
        SafeTensorError::InvalidHeaderLength => format!(
            "its first 8 bytes give a header of {header_len} bytes, but only {} bytes follow",
            len.saturating_sub(8)
        ),
        SafeTensorError::InvalidHeader => "the header is not valid UTF-8 text".into(),
        SafeTensorError::InvalidHeaderStart => "the header does not start with `{`".into(),
        SafeTensorError::InvalidHeaderDeserialization | SafeTensorError::JsonError(_) => {
            let detail = usize::try_from(header_len)
                .ok()
                .and_then(|n| bytes.get(8..n.checked_add(8)?))
                .and_then(|h| serde_json::from_slice::<serde_json::Value>(h).err())
                .map_or(String::new(), |e| format!(" ({e})"));
            format!(
                "the header is not the JSON of a safetensors file (a map from tensor names to \
                 dtype, shape and data_offsets){detail}"
            )
        }
        SafeTensorError::TensorNotFound(name) => format!("there is no tensor `{name}`"),
        SafeTensorError::TensorInvalidInfo => format!(
            "{} has a shape and dtype whose size differs from its data offsets",
            tensor_with_bad_size(bytes, false).unwrap_or_else(|| "a tensor".into())
        ),
        SafeTensorError::InvalidOffset(name) => format!(
            "tensor `{name}`'s data offsets lie outside the file or do not start where the \
             previous tensor's data ends"
        ),
        SafeTensorError::IoError(e) => format!("cannot read it: {e}"),
        SafeTensorError::InvalidTensorView(dtype, shape, n) => {
            format!("a {dtype:?} tensor of shape {shape:?} cannot hold {n} bytes")
        }
        SafeTensorError::MetadataIncompleteBuffer => format!(
            "the tensors' data offsets do not cover the {} bytes of data after the header exactly",
            (len as u64).saturating_sub(header_len.saturating_add(8))
        ),
        SafeTensorError::ValidationOverflow => format!(
            "{} has a shape whose size in bytes overflows 64 bits",
            tensor_with_bad_size(bytes, true).unwrap_or_else(|| "a tensor".into())
        ),
    }
}

/// Reads the layers of the file (all, or `only`).
pub fn read_layers(path: &Path, layout: KvLayout, only: &[usize]) -> Result<Vec<Layer>> {
    let bytes = read_safetensors(path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        input(
            path,
            format!(
                "not a safetensors file: {}",
                safetensors_problem(&e, &bytes)
            ),
        )
    })?;
    let names: BTreeSet<String> = st.names().into_iter().cloned().collect();
    let mut indices = BTreeSet::new();
    for n in &names {
        let mut parts = n.split('.');
        if let (Some("layer"), Some(i), Some("k" | "v" | "q"), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        {
            if let Ok(i) = i.parse::<usize>() {
                indices.insert(i);
            }
        }
    }
    if indices.is_empty() {
        let found: Vec<&str> = names.iter().take(8).map(String::as_str).collect();
        return Err(input(
            path,
            format!(
                "no tensor named `layer.{{i}}.k`/`layer.{{i}}.v` (found {}{}); expected {}",
                if found.is_empty() {
                    "no tensors".to_string()
                } else {
                    found.join(", ")
                },
                if names.len() > 8 { ", …" } else { "" },
                expected_names("{i}")
            ),
        ));
    }
    for i in only {
        if !indices.contains(i) {
            return Err(input(
                path,
                format!(
                    "no layer {i} (layers in the file: {}); expected {}",
                    indices
                        .iter()
                        .map(|i| i.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    expected_names(&i.to_string())
                ),
            ));
        }
    }
    let mut layers = Vec::new();
    for i in indices
        .into_iter()
        .filter(|i| only.is_empty() || only.contains(i))
    {
        let get_named = |name: String| -> Result<Option<(Vec<usize>, Vec<f32>)>> {
            if !names.contains(&name) {
                return Ok(None);
            }
            let view = st.tensor(&name).map_err(|e| {
                input(
                    path,
                    format!("tensor `{name}`: {}", safetensors_problem(&e, &bytes)),
                )
            })?;
            let shape = view.shape().to_vec();
            let values = to_f32(path, &name, view.dtype(), &shape, view.data())?;
            Ok(Some((shape, values)))
        };
        let get = |t: &str| get_named(format!("layer.{i}.{t}"));
        let missing = |t: &str| {
            input(
                path,
                format!(
                    "layer {i}: no tensor `layer.{i}.{t}`; expected {}",
                    expected_names(&i.to_string())
                ),
            )
        };
        let (k_shape, k) = get("k")?.ok_or_else(|| missing("k"))?;
        let (v_shape, v) = get("v")?.ok_or_else(|| missing("v"))?;
        if k_shape.len() != 3 || k_shape != v_shape {
            return Err(input(
                path,
                format!(
                    "layer {i}: K has shape {k_shape:?} and V {v_shape:?}; expected both \
                     [tokens, kv_heads, head_dim] (or [kv_heads, tokens, head_dim] with \
                     --layout heads-first)"
                ),
            ));
        }
        let (tokens, kv_heads, head_dim) = match layout {
            KvLayout::TokensFirst => (k_shape[0], k_shape[1], k_shape[2]),
            KvLayout::HeadsFirst => (k_shape[1], k_shape[0], k_shape[2]),
        };
        if tokens == 0 || kv_heads == 0 || head_dim == 0 {
            return Err(input(
                path,
                format!(
                    "layer {i}: K/V {k_shape:?} is empty; expected {}",
                    expected_names(&i.to_string())
                ),
            ));
        }
        // A file read in the other axis order swaps tokens and KV heads: a few "tokens" that no
        // scheme quantizes, and thousands of "heads". Both checks below name --layout.
        let (this, other) = match layout {
            KvLayout::TokensFirst => ("tokens-first", "heads-first"),
            KvLayout::HeadsFirst => ("heads-first", "tokens-first"),
        };
        let read_as = format!(
            "layer {i}: K and V have shape {k_shape:?}, read with --layout {this} as {tokens} \
             token(s) × {kv_heads} KV heads × head_dim {head_dim}"
        );
        let mut q = get("q")?;
        // A whole sequence's queries: [tokens, q_heads, head_dim] (heads-first: [q_heads, tokens,
        // head_dim]), one per cached token, kept token-major for the reference.
        let mut steps = None;
        if let Some((shape, values)) = &q {
            let token_axis = match layout {
                KvLayout::TokensFirst => 0,
                KvLayout::HeadsFirst => 1,
            };
            if shape.len() == 3 && tokens > 1 && shape[token_axis] == tokens {
                let q_heads = shape[1 - token_axis];
                if shape[2] != head_dim || q_heads == 0 || q_heads % kv_heads != 0 {
                    return Err(input(
                        path,
                        format!(
                            "{read_as}; `layer.{i}.q` has shape {shape:?}: a whole sequence's \
                             queries must be [{}] with q_heads a multiple of {kv_heads} KV heads",
                            match layout {
                                KvLayout::TokensFirst => format!("{tokens}, q_heads, {head_dim}"),
                                KvLayout::HeadsFirst => format!("q_heads, {tokens}, {head_dim}"),
                            }
                        ),
                    ));
                }
                let data = match layout {
                    KvLayout::TokensFirst => values.clone(),
                    // [q_heads][tokens][d] read as "tokens" of q_heads rows: token-major out.
                    KvLayout::HeadsFirst => {
                        let what = format!("`layer.{i}.q`");
                        try_to_head_major(values, q_heads, tokens, head_dim, &what)
                            .map_err(|e| input(path, e.to_string()))?
                            .data
                    }
                };
                let last = data[(tokens - 1) * q_heads * head_dim..].to_vec();
                steps = Some(StepQueries {
                    data,
                    q_len: tokens,
                    q_heads,
                    head_dim,
                });
                q = Some((vec![q_heads, head_dim], last));
            }
        }
        if let Some((shape, _)) = &q {
            let dims: &[usize] = if shape.len() == 3 && shape[0] == 1 {
                &shape[1..]
            } else {
                shape
            };
            if dims.len() != 2 || dims[1] != head_dim || dims[0] == 0 || dims[0] % kv_heads != 0 {
                // `tokens` is the KV head count of the other reading.
                let hint = if dims.len() == 2 && dims[1] == head_dim && dims[0] % tokens == 0 {
                    format!(
                        "; read with --layout {other} it has {tokens} KV heads, which fits: pass \
                         --layout {other}"
                    )
                } else {
                    String::new()
                };
                return Err(input(
                    path,
                    format!(
                        "{read_as}; `layer.{i}.q` has shape {shape:?}, and it must be [q_heads, \
                         {head_dim}] (the next token's) or {whole} (every token's), with q_heads \
                         a multiple of {kv_heads} KV heads{hint}",
                        whole = match layout {
                            KvLayout::TokensFirst => format!("[{tokens}, q_heads, {head_dim}]"),
                            KvLayout::HeadsFirst => format!("[q_heads, {tokens}, {head_dim}]"),
                        }
                    ),
                ));
            }
        }
        if kv_heads > tokens {
            return Err(input(
                path,
                format!(
                    "{read_as}: more KV heads than tokens is how a {other} file reads this way — \
                     pass --layout {other} (a capture with fewer tokens than KV heads is too \
                     short to evaluate)"
                ),
            ));
        }
        let to_tensor = |flat: Vec<f32>, t: &str| -> Result<KvTensor> {
            let name = format!("layer.{i}.{t}");
            match layout {
                KvLayout::TokensFirst => {
                    try_to_head_major(&flat, tokens, kv_heads, head_dim, &format!("`{name}`"))
                        .map_err(|e| input(path, e.to_string()))
                }
                KvLayout::HeadsFirst => KvTensor::new(flat, kv_heads, tokens, head_dim)
                    .map_err(|e| input(path, format!("`{name}`: {e}"))),
            }
        };
        let (mut k, mut v) = (to_tensor(k, "k")?, to_tensor(v, "v")?);
        let extra = read_extra(
            i,
            path,
            layout,
            (tokens, kv_heads, head_dim),
            &get,
            &get_named,
        )?;
        let (q, captured) = match q {
            Some((_, values)) => {
                // The shape was checked above: [q_heads, head_dim] or [1, q_heads, head_dim].
                let q_heads = values.len() / head_dim;
                (
                    Queries {
                        data: values,
                        q_heads,
                        head_dim,
                    },
                    true,
                )
            }
            None => {
                if tokens < 2 {
                    return Err(input(
                        path,
                        format!(
                            "layer {i}: one token and no `layer.{i}.q`: the last-key proxy needs \
                             at least 2 tokens (or add the queries)"
                        ),
                    ));
                }
                let mut data = Vec::with_capacity(kv_heads * head_dim);
                for h in 0..kv_heads {
                    data.extend_from_slice(k.row(h, tokens - 1));
                }
                k = k.prefix(tokens - 1);
                v = v.prefix(tokens - 1);
                (
                    Queries {
                        data,
                        q_heads: kv_heads,
                        head_dim,
                    },
                    false,
                )
            }
        };
        layers.push(Layer {
            index: i,
            k,
            v,
            q,
            captured_queries: captured,
            steps,
            extra,
        });
    }
    Ok(layers)
}

type Tensor = Option<(Vec<usize>, Vec<f32>)>;

/// The tensors CommVQ and XQuant read beyond K, V and the queries, each checked against the
/// layer's shape (`tokens`, `kv_heads`, `head_dim`).
fn read_extra(
    i: usize,
    path: &Path,
    layout: KvLayout,
    (tokens, kv_heads, head_dim): (usize, usize, usize),
    get: &dyn Fn(&str) -> Result<Tensor>,
    get_named: &dyn Fn(String) -> Result<Tensor>,
) -> Result<families::Extra> {
    let bad = |name: &str, shape: &[usize], want: String| {
        input(
            path,
            format!("layer {i}: `{name}` has shape {shape:?}; expected {want}"),
        )
    };
    // A K/V-shaped tensor of any token count, in the file's layout.
    let kv_like = |name: String, want_tokens: Option<usize>| -> Result<Option<KvTensor>> {
        let Some((shape, flat)) = get_named(name.clone())? else {
            return Ok(None);
        };
        let (t, h) = match (layout, shape.as_slice()) {
            (KvLayout::TokensFirst, [t, h, d]) if *d == head_dim => (*t, *h),
            (KvLayout::HeadsFirst, [h, t, d]) if *d == head_dim => (*t, *h),
            _ => (0, 0),
        };
        if h != kv_heads || t == 0 || want_tokens.is_some_and(|w| w != t) {
            let axes = match layout {
                KvLayout::TokensFirst => "[tokens, kv_heads, head_dim]",
                KvLayout::HeadsFirst => "[kv_heads, tokens, head_dim]",
            };
            let tokens_note = want_tokens.map_or(String::new(), |w| format!(", {w} tokens"));
            return Err(bad(
                &name,
                &shape,
                format!("{axes} with {kv_heads} KV heads of {head_dim}{tokens_note}"),
            ));
        }
        let tensor = match layout {
            KvLayout::TokensFirst => try_to_head_major(&flat, t, h, head_dim, &format!("`{name}`"))
                .map_err(|e| input(path, e.to_string()))?,
            KvLayout::HeadsFirst => KvTensor::new(flat, h, t, head_dim)
                .map_err(|e| input(path, format!("`{name}`: {e}")))?,
        };
        Ok(Some(tensor))
    };
    let mut e = families::Extra {
        k_pre_rope: kv_like(format!("layer.{i}.k_pre_rope"), Some(tokens))?,
        calib_v: kv_like(format!("calib.{i}.v"), None)?,
        ..Default::default()
    };
    e.calib_k = match kv_like(format!("calib.{i}.k_pre_rope"), None)? {
        Some(k) => Some((k, false)),
        None => kv_like(format!("calib.{i}.k"), None)?.map(|k| (k, true)),
    };
    if let (Some((k, _)), Some(v)) = (&e.calib_k, &e.calib_v) {
        if k.tokens != v.tokens {
            return Err(input(
                path,
                format!(
                    "layer {i}: calibration keys hold {} tokens and `calib.{i}.v` {}",
                    k.tokens, v.tokens
                ),
            ));
        }
    }
    for (t, slot) in [("x", &mut e.x), ("x_prev", &mut e.x_prev)] {
        if let Some((shape, flat)) = get(t)? {
            if shape.len() != 2 || shape[0] != tokens || shape[1] == 0 {
                return Err(bad(
                    &format!("layer.{i}.{t}"),
                    &shape,
                    format!("[{tokens}, d_model]"),
                ));
            }
            if e.d_model != 0 && e.d_model != shape[1] {
                return Err(bad(
                    &format!("layer.{i}.{t}"),
                    &shape,
                    format!("[{tokens}, {}]", e.d_model),
                ));
            }
            e.d_model = shape[1];
            *slot = Some(flat);
        }
    }
    let out = kv_heads * head_dim;
    for (t, slot) in [("w_k", &mut e.w_k), ("w_v", &mut e.w_v)] {
        if let Some((shape, flat)) = get(t)? {
            if e.d_model == 0 || shape != [e.d_model, out] {
                let d_model = if e.d_model == 0 {
                    "d_model (that of `layer.{i}.x`)".to_string()
                } else {
                    e.d_model.to_string()
                };
                return Err(bad(
                    &format!("layer.{i}.{t}"),
                    &shape,
                    format!("[{d_model}, {out}] (in × out: a torch Linear's weight transposed)"),
                ));
            }
            *slot = Some(flat);
        }
    }
    Ok(e)
}

fn rel_mse(a: &[f32], b: &[f32]) -> f64 {
    let power = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / b.len().max(1) as f64;
    attention::mse(a, b) / power.max(f64::MIN_POSITIVE)
}

/// Evaluates one layer: CPU reference always, the GPU kernel when `gpu` is given.
pub fn evaluate_layer(
    scheme: &Resolved,
    layer: &Layer,
    gpu: Option<&Gpu>,
    path: &Path,
) -> Result<LayerResult> {
    evaluate_layer_with(scheme, layer, gpu, None, path)
}

/// [`evaluate_layer`] with the model's RoPE base, which CommVQ and XQuant schemes need.
pub fn evaluate_layer_with(
    scheme: &Resolved,
    layer: &Layer,
    gpu: Option<&Gpu>,
    rope_theta: Option<f64>,
    path: &Path,
) -> Result<LayerResult> {
    let spec = &scheme.spec;
    let (h, n, d) = (layer.k.kv_heads, layer.k.tokens, layer.k.head_dim);
    let gqa = layer.q.q_heads / h;
    spec.check_shape_usize(d, h).map_err(|e| {
        CliError::Unsupported(format!(
            "layer {}: `{}` cannot cache {h} KV heads × head_dim {d}: {e}",
            layer.index,
            scheme.label()
        ))
    })?;
    let family = evaluate::Family::of(spec)?;
    if family != evaluate::Family::Int {
        return families::evaluate_layer(spec, &scheme.label(), family, layer, rope_theta, path);
    }
    let cache = IntCache::build(spec, &layer.k, &layer.v)
        .map_err(|e| input(path, format!("layer {}: {e}", layer.index)))?;
    let deq = cache.dequantize();
    let quantized_v = (0..n).filter(|&t| cache.v().is_quantized(t)).count();
    let quantized_k = deq.k_quantized.iter().filter(|q| **q).count();
    // A scheme that quantizes nothing of this capture would score as FP16 does: a near-zero error
    // that says nothing about the scheme. Refuse it, with the length that would measure something.
    if let (Some(needed), 0, 0) = (first_page_fill(spec), quantized_k, quantized_v) {
        // The window of the tensor whose page fills first.
        let local = needed - (spec.sink + spec.page) as usize;
        let cached = if layer.captured_queries {
            String::new()
        } else {
            " (one more in the file: its last key is the query)".into()
        };
        return Err(input(
            path,
            format!(
                "layer {}: 0 tokens quantized — `{}` keeps the first {} (sink) and the last {} \
                 (local) tokens in FP16 and quantizes whole pages of {} between them, so of the \
                 {n} cached token(s){cached} none is quantized and the error would be FP16's, not \
                 the scheme's; a capture needs at least {needed} cached tokens (check --layout if \
                 the file has more)",
                layer.index,
                scheme.label(),
                spec.sink,
                local,
                spec.page
            ),
        ));
    }
    let layer_err =
        |e: kvq::reference::RefError| input(path, format!("layer {}: {e}", layer.index));
    let exact = attention::exact(&layer.q, &layer.k, &layer.v).map_err(layer_err)?;
    let out = attention::decode(&layer.q, &deq, spec.calibrate.as_ref()).map_err(layer_err)?;
    let rows = gqa * d;
    // Every decode step of a whole sequence's queries: each token over the cache as it stood
    // then, against exact attention over the unquantized tokens up to it.
    let per_step = match &layer.steps {
        Some(q) => Some(every_step_errors(spec, layer, q, rows).map_err(layer_err)?),
        None => None,
    };
    // The GPU column is extra: a shape the kernels do not cover leaves it empty, with a note.
    let mut gpu_note = None;
    let gpu_out = match gpu {
        Some(_) if per_step.is_some() => {
            gpu_note = Some(format!(
                "layer {}: whole-sequence queries are evaluated on the CPU reference (the GPU \
                 column covers one query a layer)",
                layer.index
            ));
            None
        }
        Some(dev) => {
            let shape = KernelShape::new(d as u32, gqa as u32, Dtype::F16);
            let (q_bits, _) = gpu::to_device_words(&layer.q.data, Dtype::F16);
            match gpu::decode_once(
                dev,
                &shape,
                &TuneParams::default_for(spec, &shape),
                &[&cache],
                &q_bits,
            ) {
                Ok(o) => Some(o),
                Err(e) => {
                    gpu_note = Some(format!("layer {}: no GPU result: {e}", layer.index));
                    None
                }
            }
        }
        None => None,
    };
    let heads: Vec<HeadResult> = (0..h)
        .map(|head| HeadResult {
            head,
            k_rel_mse: rel_mse(deq.k.head(head), layer.k.head(head)),
            v_rel_mse: rel_mse(deq.v.head(head), layer.v.head(head)),
            attn_error: match &per_step {
                Some(s) => s.head_means[head],
                None => attention::relative_error(
                    &out[head * rows..(head + 1) * rows],
                    &exact[head * rows..(head + 1) * rows],
                ),
            },
            gpu_error: gpu_out.as_ref().map(|o| {
                attention::relative_error(
                    &o[head * rows..(head + 1) * rows],
                    &exact[head * rows..(head + 1) * rows],
                )
            }),
        })
        .collect();
    let memory = evaluate::memory(spec, d as u32, h as u32, n as u64)?;
    let long = evaluate::memory(spec, d as u32, h as u32, LONG_CONTEXT)?;
    Ok(LayerResult {
        index: layer.index,
        tokens: n,
        quantized_tokens: quantized_k.max(quantized_v),
        kv_heads: h,
        q_heads: layer.q.q_heads,
        head_dim: d,
        captured_queries: layer.captured_queries,
        steps: per_step.as_ref().map_or(1, |s| s.steps),
        worst_step_error: per_step
            .as_ref()
            .map_or(attention::relative_error(&out, &exact), |s| s.worst),
        attn_error: per_step
            .as_ref()
            .map_or(attention::relative_error(&out, &exact), |s| s.mean),
        gpu_error: gpu_out
            .as_ref()
            .map(|o| attention::relative_error(o, &exact)),
        k_rel_mse: heads.iter().map(|x| x.k_rel_mse).sum::<f64>() / h as f64,
        v_rel_mse: heads.iter().map(|x| x.v_rel_mse).sum::<f64>() / h as f64,
        heads,
        bits_per_element: memory.bits_per_element(),
        bits_per_element_long: long.bits_per_element(),
        gpu_note,
    })
}

/// Attention errors of every decode step of a whole sequence that saw a quantized token.
struct StepErrors {
    steps: usize,
    mean: f64,
    worst: f64,
    /// Per KV head, the mean over those steps of its query heads' error.
    head_means: Vec<f64>,
}

fn every_step_errors(
    spec: &kvq::SchemeSpec,
    layer: &Layer,
    q: &StepQueries,
    rows: usize,
) -> std::result::Result<StepErrors, kvq::reference::RefError> {
    let n = layer.k.tokens;
    let got = every_token::attend(spec, &layer.k, &layer.v, q)?;
    let raw = Dequantized {
        k: layer.k.clone(),
        v: layer.v.clone(),
        k_quantized: vec![false; n],
    };
    let exact = step::attend(q, &raw, None)?;
    // FP16, which quantizes nothing by design, is measured at every step.
    let first = first_page_fill(spec).unwrap_or(1);
    let width = q.q_heads * q.head_dim;
    let h = layer.k.kv_heads;
    let (mut sum, mut worst, mut head_sums) = (0.0, 0.0f64, vec![0.0; h]);
    for t in first.saturating_sub(1)..n {
        let (a, b) = (
            &got.out[t * width..(t + 1) * width],
            &exact.out[t * width..(t + 1) * width],
        );
        let e = attention::relative_error(a, b);
        sum += e;
        worst = worst.max(e);
        for (head, s) in head_sums.iter_mut().enumerate() {
            let r = head * rows..(head + 1) * rows;
            *s += attention::relative_error(&a[r.clone()], &b[r]);
        }
    }
    let steps = n + 1 - first.max(1);
    Ok(StepErrors {
        steps,
        mean: sum / steps as f64,
        worst,
        head_means: head_sums.into_iter().map(|s| s / steps as f64).collect(),
    })
}

/// The first cache length at which a page of K or V is quantized (`None` for FP16).
fn first_page_fill(spec: &kvq::SchemeSpec) -> Option<usize> {
    [&spec.k, &spec.v]
        .into_iter()
        .filter_map(|t| regions::first_page_fill(spec, t))
        .min()
}

/// Renders the per-layer/per-head table.
pub fn render(results: &[LayerResult]) -> String {
    let gpu = results.iter().any(|r| r.gpu_error.is_some());
    let mut columns = vec![
        ("layer", Align::Right),
        ("kv head", Align::Left),
        ("tokens", Align::Right),
        ("quantized", Align::Right),
        ("bits/elem", Align::Right),
        ("K rel MSE", Align::Right),
        ("V rel MSE", Align::Right),
        ("attn err", Align::Right),
    ];
    if gpu {
        columns.push(("attn err (GPU)", Align::Right));
    }
    let mut t = Table::new(&columns);
    let sci = |x: f64| format!("{x:.3e}");
    for r in results {
        for hr in &r.heads {
            let mut cells = vec![
                r.index.to_string(),
                hr.head.to_string(),
                r.tokens.to_string(),
                r.quantized_tokens.to_string(),
                String::new(),
                sci(hr.k_rel_mse),
                sci(hr.v_rel_mse),
                sci(hr.attn_error),
            ];
            if gpu {
                cells.push(hr.gpu_error.map_or("–".into(), sci));
            }
            t.row(cells);
        }
        let mut cells = vec![
            r.index.to_string(),
            "all".into(),
            r.tokens.to_string(),
            r.quantized_tokens.to_string(),
            format!("{:.3}", r.bits_per_element),
            sci(r.k_rel_mse),
            sci(r.v_rel_mse),
            sci(r.attn_error),
        ];
        if gpu {
            cells.push(r.gpu_error.map_or("–".into(), sci));
        }
        t.row(cells);
    }
    t.render()
}

/// Runs `kvq eval`: the header lines and the table.
pub fn run(opts: &EvalOptions) -> Result<String> {
    let mut layers = read_layers(&opts.file, opts.layout, &opts.layers)?;
    if opts.last_query {
        // `q` already holds the last token's queries; dropping the others leaves that one step.
        for l in &mut layers {
            l.steps = None;
        }
    }
    let mut lines = vec![format!(
        "{} ({}) on {}: {} layer(s)",
        opts.scheme.label(),
        opts.scheme.spec,
        opts.file.display(),
        layers.len()
    )];
    let gpu = if opts.cpu_only {
        lines.push("GPU: not used (--cpu)".into());
        None
    } else if !opts.scheme.has_gpu_kernel() {
        lines.push("GPU: not used (eval's GPU column covers the integer and FP16 schemes)".into());
        None
    } else {
        match gpu::open(opts.device) {
            Ok(g) => {
                lines.push(format!("GPU: {}", g.device.props()));
                Some(g)
            }
            Err(e) => {
                lines.push(format!(
                    "GPU: not used ({}; `kvq info` says why)",
                    e.summary()
                ));
                None
            }
        }
    };
    let mut results = Vec::new();
    for l in &layers {
        results.push(evaluate_layer_with(
            &opts.scheme,
            l,
            gpu.as_ref(),
            opts.rope_theta,
            &opts.file,
        )?);
    }
    let mean = results.iter().map(|r| r.attn_error).sum::<f64>() / results.len().max(1) as f64;
    if opts.json {
        // Serialising plain numbers and strings cannot fail; a failure would still be an error.
        let json_err = |e: serde_json::Error| CliError::Usage(format!("JSON of the results: {e}"));
        let report = serde_json::json!({
            "scheme": opts.scheme.label(),
            "scheme_text": opts.scheme.spec.to_string(),
            "file": opts.file.display().to_string(),
            "gpu": gpu.as_ref().map(|g| g.device.props().to_string()),
            "long_context_tokens": LONG_CONTEXT,
            "mean_attn_error": mean,
            "layers": serde_json::to_value(&results).map_err(json_err)?,
        });
        let text = serde_json::to_string_pretty(&report).map_err(json_err)?;
        return Ok(text + "\n");
    }
    if results.iter().any(|r| !r.captured_queries) {
        lines.push(
            "queries: no `layer.{i}.q` for some layers; there each KV head's query is its key at \
             the last token, and the cache holds the tokens before it (a proxy; capture the \
             queries for real numbers)"
                .into(),
        );
    }
    lines.push(
        "K/V rel MSE: ‖x̂ − x‖² / ‖x‖² per head; attn err: ‖o − o*‖/‖o*‖ of the head's query \
         heads against exact attention over the unquantized K/V; bits/elem: this layer's cache \
         (payload + metadata + FP16 windows)."
            .into(),
    );
    let mut s = lines.join("\n");
    s.push_str("\n\n");
    s.push_str(&render(&results));
    s.push_str(&format!(
        "\nmean attention error over {} layer(s): {mean:.3e}\n",
        results.len()
    ));
    for r in &results {
        s.push_str(&format!(
            "layer {}: {:.3} bits per element for these {} tokens, {:.3} at {} tokens\n",
            r.index, r.bits_per_element, r.tokens, r.bits_per_element_long, LONG_CONTEXT
        ));
    }
    for r in results.iter().filter(|r| r.steps > 1) {
        s.push_str(&format!(
            "layer {}: whole-sequence queries: attn err is the mean over {} decode steps (from the first \
             whose cache held a quantized token; all of them for FP16; the worst {:.3e})\n",
            r.index, r.steps, r.worst_step_error
        ));
    }
    for note in results.iter().filter_map(|r| r.gpu_note.as_ref()) {
        s.push_str(&format!("note: {note}\n"));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    /// Writes `tensors` as a safetensors file of `dtype` (f16 or f32) values.
    fn write_as(path: &Path, dtype: StDtype, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
        let encode = |x: &f32| match dtype {
            StDtype::F16 => half::f16::from_f32(*x).to_bits().to_le_bytes().to_vec(),
            _ => x.to_le_bytes().to_vec(),
        };
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(n, s, v)| (n.clone(), s.clone(), v.iter().flat_map(encode).collect()))
            .collect();
        let views: Vec<(String, TensorView<'_>)> = bytes
            .iter()
            .map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
            .collect();
        std::fs::write(path, safetensors::serialize(views, &None).unwrap()).unwrap();
    }

    fn write_file(path: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
        let owned: Vec<_> = tensors
            .iter()
            .map(|(n, s, v)| (n.to_string(), s.clone(), v.clone()))
            .collect();
        write_as(path, StDtype::F16, &owned);
    }

    #[test]
    fn layers_read_in_both_layouts_and_missing_tensors_are_named() {
        let dir = std::env::temp_dir().join(format!("kvq-eval-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kv.safetensors");
        // [tokens 3, heads 2, dim 2]: value = 100·token + 10·head + channel.
        let vals: Vec<f32> = (0..3)
            .flat_map(|t| {
                (0..2).flat_map(move |h| (0..2).map(move |c| (100 * t + 10 * h + c) as f32))
            })
            .collect();
        write_file(
            &path,
            &[
                ("layer.0.k", vec![3, 2, 2], vals.clone()),
                ("layer.0.v", vec![3, 2, 2], vals.clone()),
                ("layer.1.k", vec![3, 2, 2], vals.clone()),
            ],
        );
        let err = read_layers(&path, KvLayout::TokensFirst, &[])
            .err()
            .unwrap();
        assert!(err.to_string().contains("no tensor `layer.1.v`"), "{err}");
        let layers = read_layers(&path, KvLayout::TokensFirst, &[0]).unwrap();
        let l = &layers[0];
        // Last-key proxy: two cached tokens, query of head 1 = key of token 2, head 1.
        assert_eq!((l.k.tokens, l.k.kv_heads, l.k.head_dim), (2, 2, 2));
        assert_eq!(l.k.row(1, 1), &[110.0, 111.0]);
        assert_eq!(l.q.head(1), &[210.0, 211.0]);
        assert!(!l.captured_queries);
        // Read heads-first, [3 tokens, 2 heads] is 3 heads of 2 tokens: refused, naming --layout.
        let err = read_layers(&path, KvLayout::HeadsFirst, &[0])
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("pass --layout tokens-first"),
            "{err}"
        );
        // The same values as [2 heads][3 tokens][2]: head 1 token 0 = flat row 3.
        write_file(
            &path,
            &[
                ("layer.0.k", vec![2, 3, 2], vals.clone()),
                ("layer.0.v", vec![2, 3, 2], vals.clone()),
            ],
        );
        let layers = read_layers(&path, KvLayout::HeadsFirst, &[0]).unwrap();
        assert_eq!((layers[0].k.kv_heads, layers[0].k.tokens), (2, 2));
        assert_eq!(layers[0].k.row(1, 0), &[110.0, 111.0]);
        let err = read_layers(&path, KvLayout::TokensFirst, &[5])
            .err()
            .unwrap();
        assert!(err.to_string().contains("no layer 5"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn write_f32(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
        write_as(path, StDtype::F32, tensors);
    }

    /// `[kv_heads][tokens][head_dim]` as a capture's `[tokens, kv_heads, head_dim]` tensor.
    fn tokens_first(name: &str, x: &KvTensor) -> (String, Vec<usize>, Vec<f32>) {
        let (h, n, d) = (x.kv_heads, x.tokens, x.head_dim);
        let mut out = Vec::with_capacity(x.data.len());
        for t in 0..n {
            for j in 0..h {
                out.extend_from_slice(x.row(j, t));
            }
        }
        (name.to_string(), vec![n, h, d], out)
    }

    /// A synthetic layer written as a capture (K, V, queries, pre-RoPE keys, layer inputs,
    /// projections, calibration tokens) scores exactly as `kvq demo`'s evaluation of the same
    /// layer for CommVQ and XQuant; pre-RoPE keys derived from the post-RoPE ones with
    /// --rope-theta score within rounding of it; what is missing is named.
    #[test]
    fn codebook_and_activation_schemes_read_their_tensors() {
        let dir = std::env::temp_dir().join(format!("kvq-eval-families-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("capture.safetensors");
        let cfg = kvq::reference::synth::SynthConfig {
            tokens: 320,
            kv_heads: 2,
            gqa: 2,
            head_dim: 128,
            d_model: 96,
            ..Default::default()
        };
        let w = evaluate::Workload::generate(&cfg, 128).unwrap();
        let (s, held) = (w.data(), w.held_out().unwrap());
        let (n, dm, hd) = (cfg.tokens, cfg.d_model, cfg.kv_heads * cfg.head_dim);
        let mut tensors = vec![
            tokens_first("layer.0.k", &s.k),
            tokens_first("layer.0.v", &s.v),
            (
                "layer.0.q".into(),
                vec![s.q.q_heads, cfg.head_dim],
                s.q.data.clone(),
            ),
            tokens_first("layer.0.k_pre_rope", &s.k_pre_rope),
            tokens_first("calib.0.k_pre_rope", &held.k_pre_rope),
            tokens_first("calib.0.v", &held.v),
            ("layer.0.x".into(), vec![n, dm], s.layer.x.clone()),
            ("layer.0.x_prev".into(), vec![n, dm], s.layer.x_prev.clone()),
            ("layer.0.w_k".into(), vec![dm, hd], s.layer.w_k.clone()),
            ("layer.0.w_v".into(), vec![dm, hd], s.layer.w_v.clone()),
        ];
        write_f32(&path, &tensors);
        let theta = Some(s.rope.theta);
        let layers = read_layers(&path, KvLayout::TokensFirst, &[]).unwrap();
        for name in ["commvq2", "xquant2", "xquant-cl2"] {
            let scheme = crate::scheme::resolve(name).unwrap();
            let want = evaluate::evaluate(&scheme.spec, &w).unwrap();
            let got = evaluate_layer_with(&scheme, &layers[0], None, theta, &path).unwrap();
            assert_eq!(got.attn_error, want.output_error, "{name}");
            assert_eq!(
                (got.k_rel_mse, got.v_rel_mse),
                (want.k_rel_mse, want.v_rel_mse),
                "{name}"
            );
            assert_eq!(
                got.bits_per_element,
                want.memory.bits_per_element(),
                "{name}"
            );
            let err = evaluate_layer_with(&scheme, &layers[0], None, None, &path)
                .err()
                .unwrap();
            assert!(err.to_string().contains("--rope-theta"), "{name}: {err}");
        }
        // Pre-RoPE keys rotated back from the post-RoPE ones.
        tensors.retain(|(n, _, _)| n != "layer.0.k_pre_rope" && n != "layer.0.w_v");
        write_f32(&path, &tensors);
        let layers = read_layers(&path, KvLayout::TokensFirst, &[]).unwrap();
        let commvq = crate::scheme::resolve("commvq2").unwrap();
        let want = evaluate::evaluate(&commvq.spec, &w).unwrap().output_error;
        let got = evaluate_layer_with(&commvq, &layers[0], None, theta, &path).unwrap();
        assert!(
            (got.attn_error - want).abs() < 0.05 * want,
            "{} vs {want}",
            got.attn_error
        );
        let xquant = crate::scheme::resolve("xquant2").unwrap();
        let err = evaluate_layer_with(&xquant, &layers[0], None, theta, &path)
            .err()
            .unwrap();
        assert!(err.to_string().contains("`layer.0.w_v`"), "{err}");
        tensors.retain(|(n, _, _)| !n.starts_with("calib."));
        write_f32(&path, &tensors);
        let layers = read_layers(&path, KvLayout::TokensFirst, &[]).unwrap();
        let err = evaluate_layer_with(&commvq, &layers[0], None, theta, &path)
            .err()
            .unwrap();
        assert!(err.to_string().contains("calib.0.v"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Whole-sequence queries read the same in both layouts; evaluated over every decode step,
    /// a capture one token past the first page fill has one step, which equals the single-query
    /// evaluation of its last token's queries, and a longer one averages its steps.
    #[test]
    fn whole_sequence_queries_evaluate_every_decode_step() {
        let dir = std::env::temp_dir().join(format!("kvq-eval-steps-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kv.safetensors");
        let scheme = crate::scheme::resolve(
            "k = int(2, channel), v = int(2, token, local = 32), sink = 8, page = 32",
        )
        .unwrap();
        let (kvh, qh, d) = (2usize, 4usize, 64usize);
        let mut x = 1u64;
        let mut noise = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((x >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
                })
                .collect()
        };
        let heads_first = |v: &[f32], n: usize, h: usize| -> Vec<f32> {
            let mut out = vec![0.0; v.len()];
            for t in 0..n {
                for j in 0..h {
                    out[(j * n + t) * d..(j * n + t + 1) * d]
                        .copy_from_slice(&v[(t * h + j) * d..(t * h + j + 1) * d]);
                }
            }
            out
        };
        let (k, v, q) = (
            noise(100 * kvh * d),
            noise(100 * kvh * d),
            noise(100 * qh * d),
        );
        // The first page (K) fills at 8 + 32 = 40 tokens.
        let n = 40;
        let (k40, v40, q40) = (&k[..n * kvh * d], &v[..n * kvh * d], &q[..n * qh * d]);
        write_file(
            &path,
            &[
                ("layer.0.k", vec![n, kvh, d], k40.to_vec()),
                ("layer.0.v", vec![n, kvh, d], v40.to_vec()),
                ("layer.0.q", vec![n, qh, d], q40.to_vec()),
            ],
        );
        let tokens_first = read_layers(&path, KvLayout::TokensFirst, &[]).unwrap();
        let whole = evaluate_layer(&scheme, &tokens_first[0], None, &path).unwrap();
        assert_eq!(whole.steps, 1);
        write_file(
            &path,
            &[
                ("layer.0.k", vec![kvh, n, d], heads_first(k40, n, kvh)),
                ("layer.0.v", vec![kvh, n, d], heads_first(v40, n, kvh)),
                ("layer.0.q", vec![qh, n, d], heads_first(q40, n, qh)),
            ],
        );
        let read = read_layers(&path, KvLayout::HeadsFirst, &[]).unwrap();
        assert_eq!(read[0].steps, tokens_first[0].steps);
        write_file(
            &path,
            &[
                ("layer.0.k", vec![n, kvh, d], k40.to_vec()),
                ("layer.0.v", vec![n, kvh, d], v40.to_vec()),
                ("layer.0.q", vec![qh, d], q40[(n - 1) * qh * d..].to_vec()),
            ],
        );
        let single = read_layers(&path, KvLayout::TokensFirst, &[]).unwrap();
        let one = evaluate_layer(&scheme, &single[0], None, &path).unwrap();
        assert!(
            (one.attn_error - whole.attn_error).abs() <= 1e-6 * one.attn_error,
            "{} vs {}",
            one.attn_error,
            whole.attn_error
        );
        write_file(
            &path,
            &[
                ("layer.0.k", vec![100, kvh, d], k.clone()),
                ("layer.0.v", vec![100, kvh, d], v.clone()),
                ("layer.0.q", vec![100, qh, d], q.clone()),
            ],
        );
        let long = read_layers(&path, KvLayout::TokensFirst, &[]).unwrap();
        let r = evaluate_layer(&scheme, &long[0], None, &path).unwrap();
        assert_eq!(r.steps, 100 - 40 + 1);
        assert!(r.worst_step_error >= r.attn_error && r.attn_error > 0.0);
        // `--last-query`: the last token's step alone, as a file holding only its queries.
        let mut opts = EvalOptions {
            scheme: scheme.clone(),
            file: path.clone(),
            layout: KvLayout::TokensFirst,
            layers: Vec::new(),
            cpu_only: true,
            device: 0,
            json: true,
            rope_theta: None,
            last_query: true,
        };
        let last: serde_json::Value = serde_json::from_str(&run(&opts).unwrap()).unwrap();
        write_file(
            &path,
            &[
                ("layer.0.k", vec![100, kvh, d], k.clone()),
                ("layer.0.v", vec![100, kvh, d], v.clone()),
                ("layer.0.q", vec![qh, d], q[99 * qh * d..].to_vec()),
            ],
        );
        opts.last_query = false;
        let alone: serde_json::Value = serde_json::from_str(&run(&opts).unwrap()).unwrap();
        assert_eq!(last["layers"][0]["steps"], 1);
        assert_eq!(
            last["layers"][0]["attn_error"],
            alone["layers"][0]["attn_error"]
        );
        assert_ne!(last["layers"][0]["attn_error"], r.attn_error);
        write_file(
            &path,
            &[
                ("layer.0.k", vec![100, kvh, d], k.clone()),
                ("layer.0.v", vec![100, kvh, d], v.clone()),
                ("layer.0.q", vec![100, qh, d], q.clone()),
            ],
        );
        // FP16 quantizes nothing: every step, each at f16's rounding of the inputs (none here).
        let fp16 = crate::scheme::resolve("fp16").unwrap();
        let r = evaluate_layer(&fp16, &long[0], None, &path).unwrap();
        assert_eq!(r.steps, 100);
        assert!(r.attn_error < 1e-6 && r.worst_step_error < 1e-6, "{r:?}");
        // A query file whose token axis does not match is named with both accepted shapes.
        write_file(
            &path,
            &[
                ("layer.0.k", vec![100, kvh, d], k),
                ("layer.0.v", vec![100, kvh, d], v),
                ("layer.0.q", vec![99, qh, d], q[..99 * qh * d].to_vec()),
            ],
        );
        let err = read_layers(&path, KvLayout::TokensFirst, &[])
            .err()
            .unwrap();
        assert!(
            err.to_string()
                .contains("[100, q_heads, 64] (every token's)"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
