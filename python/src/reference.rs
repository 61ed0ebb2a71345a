//! The CPU reference from Python: the numerics every GPU result is checked against, on host
//! float32 bytes, for `kvq.hf`'s reference perplexity.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use kvq::reference::every_token;
use kvq::reference::step::StepQueries;
use kvq::reference::synth::try_to_head_major;

use crate::{InvalidArgument, Plan};

/// Native-endian float32 values of a bytes-like buffer `name` of `want` values.
fn floats(name: &str, bytes: &[u8], want: usize) -> PyResult<Vec<f32>> {
    if bytes.len() != want * 4 {
        return Err(InvalidArgument::new_err(format!(
            "{name} holds {} bytes; expected {want} float32 values ({} bytes)",
            bytes.len(),
            want * 4
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Float32 values as a bytes object, native byte order.
fn f32_bytes<'py>(py: Python<'py>, x: &[f32]) -> Bound<'py, PyBytes> {
    let bytes: Vec<u8> = x.iter().flat_map(|f| f.to_ne_bytes()).collect();
    PyBytes::new(py, &bytes)
}

/// The next token's queries `q` (`[q_heads][head_dim]` float32 bytes) at `plan`'s shape.
fn plan_queries(plan: &Plan, q: &[u8]) -> PyResult<kvq::reference::attention::Queries> {
    let l = plan.plan.limits();
    let (qh, d) = (l.q_heads as usize, l.head_dim as usize);
    Ok(kvq::reference::attention::Queries {
        data: floats("q", q, qh * d)?,
        q_heads: qh,
        head_dim: d,
    })
}

/// Every token of one sequence attending as decoding sees it, on the CPU reference
/// (`kvq_reference::every_token`): `q` `[tokens][q_heads][head_dim]`, `k` and `v`
/// `[tokens][kv_heads][head_dim]`, float32 bytes. Returns `(out, lse)` as float32 bytes,
/// `[tokens][q_heads][head_dim]` and `[tokens][q_heads]`.
#[pyfunction]
pub fn _reference_every_token<'py>(
    py: Python<'py>,
    plan: &Plan,
    tokens: usize,
    q: &[u8],
    k: &[u8],
    v: &[u8],
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let l = plan.plan.limits();
    let (d, qh, kvh) = (l.head_dim as usize, l.q_heads as usize, l.kv_heads as usize);
    let q = floats("q", q, tokens * qh * d)?;
    let k = floats("k", k, tokens * kvh * d)?;
    let v = floats("v", v, tokens * kvh * d)?;
    let spec = *plan.plan.spec();
    let state = py
        .detach(|| {
            let k = try_to_head_major(&k, tokens, kvh, d, "k")?;
            let v = try_to_head_major(&v, tokens, kvh, d, "v")?;
            let q = StepQueries {
                data: q,
                q_len: tokens,
                q_heads: qh,
                head_dim: d,
            };
            every_token::attend(&spec, &k, &v, &q)
        })
        .map_err(|e| InvalidArgument::new_err(format!("reference attention: {e}")))?;
    Ok((f32_bytes(py, &state.out), f32_bytes(py, &state.lse)))
}

/// `[tokens][kv_heads][head_dim]` float32 bytes `name` as the reference's head-major tensor.
fn kv_tensor(
    name: &str,
    bytes: &[u8],
    tokens: usize,
    kv_heads: usize,
    d: usize,
) -> PyResult<kvq::reference::KvTensor> {
    let flat = floats(name, bytes, tokens * kv_heads * d)?;
    try_to_head_major(&flat, tokens, kv_heads, d, "tensor")
        .map_err(|e| InvalidArgument::new_err(format!("{name}: {e}")))
}

/// Codebooks for a codebook plan, trained by the CPU reference on `tokens` calibration tokens
/// (`k_pre_rope`, `v`: `[tokens][kv_heads][head_dim]` float32 bytes) with the quick schedule
/// (seconds; for tests and examples, not for a model's quality), as `kvq-codebooks-1` bytes.
#[pyfunction]
pub fn _reference_codebooks<'py>(
    py: Python<'py>,
    plan: &Plan,
    tokens: usize,
    k_pre_rope: &[u8],
    v: &[u8],
    seed: u64,
) -> PyResult<Bound<'py, PyBytes>> {
    use kvq::reference::commvq::{self, CalibrationData, TrainOptions};
    let l = plan.plan.limits();
    let (d, kvh) = (l.head_dim as usize, l.kv_heads as usize);
    let k = kv_tensor("k_pre_rope", k_pre_rope, tokens, kvh, d)?;
    let v = kv_tensor("v", v, tokens, kvh, d)?;
    let spec = *plan.plan.spec();
    let rope = kvq::reference::rope::Rope {
        theta: l.rope_theta,
    };
    let bytes = py
        .detach(|| {
            let data = CalibrationData {
                k_pre_rope: &k,
                v: &v,
                rope,
            };
            let books = commvq::train_with(&spec, &data, &TrainOptions::quick(seed))
                .map_err(|e| e.to_string())?;
            books
                .to_safetensors(&spec, kvh, d)
                .map_err(|e| e.to_string())
        })
        .map_err(|e| InvalidArgument::new_err(format!("training codebooks: {e}")))?;
    Ok(PyBytes::new(py, &bytes))
}

/// One sequence's attention on the CPU reference for a codebook plan: the sequence coded with
/// `codebooks` (`kvq-codebooks-1` bytes) from its keys before and after RoPE and its values
/// (`[tokens][kv_heads][head_dim]` float32 bytes), attended by the next token's queries `q`
/// (`[q_heads][head_dim]`). Returns the output, `[q_heads][head_dim]` float32 bytes.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn _reference_codebook_attend<'py>(
    py: Python<'py>,
    plan: &Plan,
    codebooks: &[u8],
    tokens: usize,
    k_pre_rope: &[u8],
    k: &[u8],
    v: &[u8],
    q: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    use kvq::reference::commvq::{Codebooks, CommVqCache};
    let l = plan.plan.limits();
    let (d, kvh) = (l.head_dim as usize, l.kv_heads as usize);
    let k_pre = kv_tensor("k_pre_rope", k_pre_rope, tokens, kvh, d)?;
    let k_post = kv_tensor("k", k, tokens, kvh, d)?;
    let v = kv_tensor("v", v, tokens, kvh, d)?;
    let q = plan_queries(plan, q)?;
    let spec = *plan.plan.spec();
    let rope = kvq::reference::rope::Rope {
        theta: l.rope_theta,
    };
    let out = py
        .detach(|| {
            let books =
                Codebooks::from_safetensors(codebooks, &spec, kvh, d).map_err(|e| e.to_string())?;
            let cache = CommVqCache::build_rotated(&spec, &k_pre, &k_post, &v, rope, &books)
                .map_err(|e| e.to_string())?;
            cache.attend(&q).map_err(|e| e.to_string())
        })
        .map_err(|e| InvalidArgument::new_err(format!("reference attention: {e}")))?;
    Ok(f32_bytes(py, &out))
}

/// A layer's XQuant projections as a `kvq-projections-1` file's bytes: the reference's SVD of
/// the model's `w_k` and `w_v` (`[d_model][kv_heads·head_dim]` float32, native byte order, as
/// `x @ w` multiplies them), for `scheme` (an XQuant built-in's name or scheme text). Load the
/// bytes into a plan's cache with `PagedCache.load_projections`. The SVD runs on the CPU with the
/// GIL released (8.7 s for a 4096 × 1024 weight on two cores, twice that for K and V:
/// docs/CODEBOOKS.md §3).
#[pyfunction]
#[pyo3(signature = (scheme, w_k, w_v, *, d_model, kv_heads, head_dim))]
pub fn xquant_projections<'py>(
    py: Python<'py>,
    scheme: &str,
    w_k: &[u8],
    w_v: &[u8],
    d_model: usize,
    kv_heads: usize,
    head_dim: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    use kvq::reference::xquant::Projections;
    let spec = kvq::schemes::resolve(scheme).map_err(crate::InvalidScheme::new_err)?;
    if !matches!(spec.source, kvq::CacheSource::X(_)) {
        return Err(InvalidArgument::new_err(format!(
            "`{spec}` caches K and V: projections serve XQuant schemes (source = x(...))"
        )));
    }
    let out = kv_heads * head_dim;
    let w_k = floats("w_k", w_k, d_model * out)?;
    let w_v = floats("w_v", w_v, d_model * out)?;
    let bytes = py
        .detach(|| {
            Projections::from_weights(&w_k, &w_v, d_model, kv_heads, head_dim)
                .map_err(|e| e.to_string())?
                .to_safetensors(&spec)
                .map_err(|e| e.to_string())
        })
        .map_err(|e| InvalidArgument::new_err(format!("XQuant projections: {e}")))?;
    Ok(PyBytes::new(py, &bytes))
}

/// The CPU reference's attention over an XQuant plan's cache of `tokens` tokens of layer input
/// `x` (`[tokens][d_model]` float32 bytes) with the projections of a `kvq-projections-1` file's
/// bytes — the latents rounded to f16 before they are stored, as the GPU's writes round them —
/// K rebuilt in f16 as the GPU's decode does, attended by the next token's queries `q`
/// (`[q_heads][head_dim]`). Returns the output, `[q_heads][head_dim]` float32 bytes.
#[pyfunction]
pub fn _reference_xquant_attend<'py>(
    py: Python<'py>,
    plan: &Plan,
    projections: &[u8],
    tokens: usize,
    x: &[u8],
    q: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    use kvq::reference::attention;
    use kvq::reference::xquant::{Projections, XQuantCache};
    let l = plan.plan.limits();
    let (d, kvh, dm) = (l.head_dim as usize, l.kv_heads as usize, l.d_model as usize);
    let x = floats("x", x, tokens * dm)?;
    let q = plan_queries(plan, q)?;
    let spec = *plan.plan.spec();
    let rope = kvq::reference::rope::Rope {
        theta: l.rope_theta,
    };
    let out = py
        .detach(|| {
            let p = Projections::from_safetensors(projections, &spec, dm, kvh, d)
                .map_err(|e| e.to_string())?;
            let f16 = |v: Vec<f32>| -> Vec<f32> {
                v.into_iter()
                    .map(|x| {
                        kvq::runtime::tune::synth::round_to_word(x, kvq::codegen::Dtype::F16).1
                    })
                    .collect()
            };
            let (lk, lv) = (f16(p.k.project(&x)), f16(p.v.project(&x)));
            let cache =
                XQuantCache::from_latents(&spec, &lk, &lv, &p, rope).map_err(|e| e.to_string())?;
            attention::decode(&q, &cache.dequantize_f16_rebuild(), None).map_err(|e| e.to_string())
        })
        .map_err(|e| InvalidArgument::new_err(format!("reference attention: {e}")))?;
    Ok(f32_bytes(py, &out))
}

/// An XQuant-CL stack on the CPU reference, rounded where the GPU's writes round: layer `l`
/// caches the deltas of its layer input `x[l]` (`[tokens][d_model]` float32 bytes) against the
/// accumulator of the layers before it (zeros at the first), each delta rounded to the plan's
/// dtype and its latents to f16, with the projections `projections[l]` (`kvq-projections-1`
/// bytes); hands on `XQuantCache::next_accumulator` rounded to the plan's dtype; and attends
/// with `q[l]` (`[q_heads][head_dim]`). Returns each layer's output, float32 bytes.
#[pyfunction]
pub fn _reference_xquant_cross_layer_attend<'py>(
    py: Python<'py>,
    plan: &Plan,
    projections: Vec<Vec<u8>>,
    tokens: usize,
    x: Vec<Vec<u8>>,
    q: Vec<Vec<u8>>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    use kvq::codegen::Dtype;
    use kvq::reference::attention;
    use kvq::reference::xquant::{Projections, XQuantCache};
    use kvq::runtime::tune::synth::round_to_word;
    let l = plan.plan.limits();
    let (d, kvh, dm) = (l.head_dim as usize, l.kv_heads as usize, l.d_model as usize);
    if x.len() != projections.len() || q.len() != projections.len() {
        return Err(InvalidArgument::new_err(format!(
            "{} layers of projections, {} of x and {} of q",
            projections.len(),
            x.len(),
            q.len()
        )));
    }
    let x = x
        .iter()
        .map(|x| floats("x", x, tokens * dm))
        .collect::<PyResult<Vec<_>>>()?;
    let q = q
        .iter()
        .map(|q| plan_queries(plan, q))
        .collect::<PyResult<Vec<_>>>()?;
    let (spec, io) = (*plan.plan.spec(), plan.plan.dtype());
    let rope = kvq::reference::rope::Rope {
        theta: l.rope_theta,
    };
    let round = |v: Vec<f32>, dtype: Dtype| -> Vec<f32> {
        v.into_iter().map(|x| round_to_word(x, dtype).1).collect()
    };
    let outs = py
        .detach(|| {
            let mut x_hat = vec![0f32; tokens * dm];
            let mut outs = Vec::new();
            for ((bytes, x), q) in projections.iter().zip(&x).zip(&q) {
                let p = Projections::from_safetensors(bytes, &spec, dm, kvh, d)
                    .map_err(|e| e.to_string())?;
                let delta = round(x.iter().zip(&x_hat).map(|(a, b)| a - b).collect(), io);
                let dk = round(p.k.project(&delta), Dtype::F16);
                let dv = round(p.v.project(&delta), Dtype::F16);
                let base = (p.k.project(&x_hat), p.v.project(&x_hat));
                let cache = XQuantCache::from_cross_layer_latents(
                    &spec,
                    (&dk, &dv),
                    (&base.0, &base.1),
                    &p,
                    rope,
                )
                .map_err(|e| e.to_string())?;
                let rebuilt = cache.dequantize_f16_rebuild();
                outs.push(attention::decode(q, &rebuilt, None).map_err(|e| e.to_string())?);
                let next = XQuantCache::next_accumulator(&p, &x_hat, &dk, &dv)
                    .map_err(|e| e.to_string())?;
                x_hat = round(next, io);
            }
            Ok::<_, String>(outs)
        })
        .map_err(|e| InvalidArgument::new_err(format!("reference attention: {e}")))?;
    Ok(outs.iter().map(|o| f32_bytes(py, o)).collect())
}
