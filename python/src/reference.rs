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
    let bytes = |x: &[f32]| x.iter().flat_map(|f| f.to_ne_bytes()).collect::<Vec<u8>>();
    Ok((
        PyBytes::new(py, &bytes(&state.out)),
        PyBytes::new(py, &bytes(&state.lse)),
    ))
}
