//! Which form each page quantizer takes (naive, tiled, coarsened, vectorized — they write the same
//! bytes at different speeds), chosen per GPU by the same tuner and store as the decode kernels'
//! configuration:
//!
//! ```text
//! choose_forms(policy)
//!   off    ─▶ QuantizerForms::default_for (vectorized where the layout allows, else tiled)
//!   cached ─▶ stored result for (GPU, scheme, head_dim, dtype, candidate checksum) in
//!             <cache dir>/tune.json, else the default
//!   full   ─▶ stored result, else tune_forms now and store it:
//!        every form (tiled where a tensor's layout does not support it), on a prefill larger than
//!        4× L2; gate: a small prefill bit-exact with the CPU reference; winner: fastest that passed
//! ```

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use kvq_codegen::{Dtype, QuantizerForm, QuantizerForms};
use kvq_reference::int::IntCache;
use kvq_reference::KvTensor;
use kvq_spec::SchemeSpec;
use serde::{Deserialize, Serialize};

use super::cache::{CacheConfig, PagedKvCache};
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::tune::store::{checksum, unix_now};
use crate::tune::synth::{round_to_word, word_to_f32, SynthRng};
use crate::tune::{GpuKey, TunePolicy, TuneStore};

/// KV heads of the tuning workload (the forms' speed does not depend on it: one CTA per head-page).
const TUNE_KV_HEADS: usize = 8;
/// Timed repetitions per form.
const TUNE_RUNS: usize = 10;

/// What a quantizer-forms result was measured for: the scheme, head size and input dtype, and a
/// checksum of the candidate forms ([`forms_candidates`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FormsKey {
    /// `SchemeSpec::stable_hash` as 16 hex digits.
    pub scheme_hash: String,
    /// Channels per head.
    pub head_dim: u32,
    /// Input dtype of the prefilled K/V.
    pub dtype: Dtype,
    /// Checksum of the candidate set.
    pub candidates: String,
}

impl FormsKey {
    /// The key of `spec`'s page quantizers at `head_dim` and `dtype`.
    pub fn of(spec: &SchemeSpec, head_dim: u32, dtype: Dtype) -> FormsKey {
        let set = forms_candidates(spec, head_dim);
        FormsKey {
            scheme_hash: format!("{:016x}", spec.stable_hash()),
            head_dim,
            dtype,
            candidates: checksum(serde_json::to_string(&set).unwrap_or_default().as_bytes()),
        }
    }
}

impl fmt::Display for FormsKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "quantizers of scheme {} d{} {} candidates {}",
            self.scheme_hash, self.head_dim, self.dtype, self.candidates
        )
    }
}

/// One tuned result: the fastest correct forms of a scheme's page quantizers on one GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FormsEntry {
    /// Where it was measured.
    pub gpu: GpuKey,
    /// What it was measured for.
    pub problem: FormsKey,
    /// The scheme's canonical text (for people reading the file; matching uses the hash).
    pub scheme: String,
    /// The winner.
    pub forms: QuantizerForms,
    /// Every candidate timed.
    pub candidates: Vec<FormTiming>,
    /// When, in seconds since the Unix epoch.
    pub tuned_at_unix: u64,
    /// The kvq-runtime version that measured it.
    pub kvq_version: String,
}

/// One candidate's measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FormTiming {
    /// The candidate.
    pub forms: QuantizerForms,
    /// Median µs of the workload's K and V page quantizers.
    pub median_us: f64,
    /// Read + written bytes / median time.
    pub gbps: f64,
    /// Its bytes equalled the reference's (only those can win).
    pub bit_exact: bool,
}

/// Every candidate the tuner times for `spec`'s page quantizers at `head_dim`: each form for both
/// tensors, tiled where a tensor's layout does not support it, without repeats.
pub fn forms_candidates(spec: &SchemeSpec, head_dim: u32) -> Vec<QuantizerForms> {
    let mut out: Vec<QuantizerForms> = QuantizerForm::ALL
        .into_iter()
        .map(|f| forms_or_tiled(spec, head_dim, f))
        .collect();
    out.dedup();
    out
}

/// Whether `forms` still suits `spec`'s tensors at `head_dim`.
fn supported(forms: &QuantizerForms, spec: &SchemeSpec, head_dim: u32) -> bool {
    let ok = |form: QuantizerForm, t: &kvq_spec::TensorQuant| {
        !t.is_quantized() || form.supports(t, head_dim, spec.page)
    };
    ok(forms.k, &spec.k) && ok(forms.v, &spec.v)
}

/// The stored forms in `store` for this GPU and problem, if they are still supported.
pub fn stored_forms_in(
    store: &TuneStore,
    gpu: &GpuKey,
    spec: &SchemeSpec,
    head_dim: u32,
    dtype: Dtype,
) -> Option<QuantizerForms> {
    store
        .lookup_forms(gpu, &FormsKey::of(spec, head_dim, dtype))
        .map(|e| e.forms)
        .filter(|f| supported(f, spec, head_dim))
}

/// The default store (`<cache dir>/tune.json`), empty without a cache folder.
fn default_store() -> TuneStore {
    match TuneStore::default_path() {
        Ok(path) => TuneStore::load_quietly(path),
        Err(_) => TuneStore::empty(PathBuf::new()),
    }
}

/// The stored forms for this GPU and problem in the default store, if they are still supported.
pub fn stored_forms(
    gpu: &GpuKey,
    spec: &SchemeSpec,
    head_dim: u32,
    dtype: Dtype,
) -> Option<QuantizerForms> {
    stored_forms_in(&default_store(), gpu, spec, head_dim, dtype)
}

/// The forms `policy` selects (see the module docs), from the default store.
pub fn choose_forms(
    jit: &Jit,
    stream: &Arc<CudaStream>,
    spec: &SchemeSpec,
    head_dim: u32,
    dtype: Dtype,
    policy: TunePolicy,
) -> Result<QuantizerForms> {
    let mut store = default_store();
    choose_forms_in(&mut store, policy, jit, stream, spec, head_dim, dtype)
}

/// The forms `policy` selects with `store`'s results; a result tuned now is saved there.
pub fn choose_forms_in(
    store: &mut TuneStore,
    policy: TunePolicy,
    jit: &Jit,
    stream: &Arc<CudaStream>,
    spec: &SchemeSpec,
    head_dim: u32,
    dtype: Dtype,
) -> Result<QuantizerForms> {
    let default = QuantizerForms::default_for(spec, head_dim);
    if policy == TunePolicy::Off || !(spec.k.is_quantized() || spec.v.is_quantized()) {
        return Ok(default);
    }
    let gpu = GpuKey::of(jit.device().props());
    if let Some(forms) = stored_forms_in(store, &gpu, spec, head_dim, dtype) {
        return Ok(forms);
    }
    if policy == TunePolicy::Cached {
        return Ok(default);
    }
    let entry = tune_forms(jit, stream, spec, head_dim, dtype)?;
    let forms = entry.forms;
    store.insert_forms(entry);
    store.save()?;
    Ok(forms)
}

/// `form` for each tensor whose layout supports it, tiled for the others.
pub fn forms_or_tiled(spec: &SchemeSpec, head_dim: u32, form: QuantizerForm) -> QuantizerForms {
    let pick = |t| {
        if form.supports(t, head_dim, spec.page) {
            form
        } else {
            QuantizerForm::Tiled
        }
    };
    QuantizerForms {
        k: pick(&spec.k),
        v: pick(&spec.v),
    }
}

/// Random `[tokens][kv_heads][head_dim]` words of `dtype` (uniform in ±3, one channel in 16 eight
/// times larger, so boost and outlier paths are taken).
fn synthetic_words(tokens: usize, kv_heads: usize, d: usize, dtype: Dtype, seed: u64) -> Vec<u16> {
    let mut rng = SynthRng::new(seed);
    (0..tokens * kv_heads * d)
        .map(|i| {
            let x = 3.0 * rng.symmetric() * if i % d % 16 == 3 { 8.0 } else { 1.0 };
            round_to_word(x, dtype).0
        })
        .collect()
}

/// The values of `[tokens][kv_heads][head_dim]` words, head-major as the reference takes them.
fn head_major(words: &[u16], tokens: usize, kv_heads: usize, d: usize, dtype: Dtype) -> KvTensor {
    let mut data = vec![0.0f32; words.len()];
    for (i, &w) in words.iter().enumerate() {
        let (t, h, c) = (i / (kv_heads * d), i / d % kv_heads, i % d);
        data[(h * tokens + t) * d + c] = word_to_f32(w, dtype);
    }
    KvTensor {
        data,
        kv_heads,
        tokens,
        head_dim: d,
    }
}

fn upload(stream: &Arc<CudaStream>, words: &[u16]) -> Result<CudaSlice<u16>> {
    stream
        .clone_htod(words)
        .map_err(|e| RuntimeError::driver("upload tuning input", e))
}

/// A cache with room for one sequence of `tokens` tokens, and that sequence (empty).
#[allow(clippy::too_many_arguments)]
fn one_sequence(
    jit: &Jit,
    stream: &Arc<CudaStream>,
    spec: &SchemeSpec,
    kv_heads: usize,
    head_dim: usize,
    tokens: usize,
    dtype: Dtype,
    forms: QuantizerForms,
) -> Result<(PagedKvCache, super::SeqId)> {
    let cfg = CacheConfig {
        kv_heads,
        head_dim,
        max_seqs: 1,
        pool_pages: tokens / spec.page as usize + 1,
        max_tokens: tokens,
        input_dtype: dtype,
    };
    let mut cache = PagedKvCache::with_forms(jit, stream.clone(), spec, cfg, forms)?;
    let id = cache.add_sequence()?;
    Ok((cache, id))
}

/// Whether a prefill of a few pages with `forms` gives exactly the reference's page bytes.
fn bit_exact(
    jit: &Jit,
    stream: &Arc<CudaStream>,
    spec: &SchemeSpec,
    head_dim: u32,
    dtype: Dtype,
    forms: QuantizerForms,
) -> Result<bool> {
    let (heads, d) = (2usize, head_dim as usize);
    let tokens = spec.sink as usize + 256 + 6 * spec.page as usize;
    let kb = synthetic_words(tokens, heads, d, dtype, 0x6b65_7973);
    let vb = synthetic_words(tokens, heads, d, dtype, 0x7661_6c73);
    let (mut cache, id) = one_sequence(jit, stream, spec, heads, d, tokens, dtype, forms)?;
    cache.prefill(
        id,
        &upload(stream, &kb)?,
        &upload(stream, &vb)?,
        tokens,
        dtype,
    )?;
    let snap = cache.snapshot(id)?;
    let (kt, vt) = (
        head_major(&kb, tokens, heads, d, dtype),
        head_major(&vb, tokens, heads, d, dtype),
    );
    let reference =
        IntCache::build(spec, &kt, &vt).map_err(|e| RuntimeError::InvalidInput(e.to_string()))?;
    for (pages, store) in [
        (&snap.k_pages, reference.k()),
        (&snap.v_pages, reference.v()),
    ] {
        if pages.len() != store.pages() {
            return Ok(false);
        }
        for (j, page) in pages.iter().enumerate() {
            for h in 0..heads {
                let want = store.block(j, h);
                let have = page.get(h * store.block_bytes()..(h + 1) * store.block_bytes());
                if want.is_none() || have != want {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}

/// Times every candidate form on a prefill workload larger than 4× L2 and returns the fastest
/// bit-exact one (the heuristic default if none is faster).
pub fn tune_forms(
    jit: &Jit,
    stream: &Arc<CudaStream>,
    spec: &SchemeSpec,
    head_dim: u32,
    dtype: Dtype,
) -> Result<FormsEntry> {
    let props = jit.device().props();
    let d = head_dim as usize;
    let page_bytes = spec.page as usize * TUNE_KV_HEADS * d * 2 * 2;
    let pages = (4 * props.l2_bytes as usize).div_ceil(page_bytes).max(8);
    let tokens = spec.sink as usize + pages * spec.page as usize + 256;
    let kb = synthetic_words(tokens, TUNE_KV_HEADS, d, dtype, 1);
    let vb = synthetic_words(tokens, TUNE_KV_HEADS, d, dtype, 2);
    let (k, v) = (upload(stream, &kb)?, upload(stream, &vb)?);
    let mut timings = Vec::new();
    for forms in forms_candidates(spec, head_dim) {
        let exact = bit_exact(jit, stream, spec, head_dim, dtype, forms)?;
        let (mut cache, id) =
            one_sequence(jit, stream, spec, TUNE_KV_HEADS, d, tokens, dtype, forms)?;
        cache.prefill(id, &k, &v, tokens, dtype)?;
        let t = cache.time_packed_prefill_quantizers(&[(id, tokens)], &k, &v, TUNE_RUNS)?;
        timings.push(FormTiming {
            forms,
            median_us: t.median_us,
            gbps: t.gbps(),
            bit_exact: exact,
        });
    }
    let best = timings
        .iter()
        .filter(|t| t.bit_exact)
        .min_by(|a, b| a.median_us.total_cmp(&b.median_us))
        .map(|t| t.forms)
        .ok_or_else(|| {
            RuntimeError::InvalidInput(format!(
                "no page quantizer form of `{spec}` matched the reference on this GPU"
            ))
        })?;
    Ok(FormsEntry {
        gpu: GpuKey::of(props),
        problem: FormsKey::of(spec, head_dim, dtype),
        scheme: spec.to_string(),
        forms: best,
        candidates: timings,
        tuned_at_unix: unix_now(),
        kvq_version: env!("CARGO_PKG_VERSION").to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DriverVersion;

    fn gpu() -> GpuKey {
        GpuKey {
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            driver: DriverVersion {
                major: 13,
                minor: 0,
            },
        }
    }

    fn entry(spec: &SchemeSpec, key: FormsKey) -> FormsEntry {
        FormsEntry {
            gpu: gpu(),
            problem: key,
            scheme: spec.to_string(),
            forms: QuantizerForms::both(QuantizerForm::Tiled),
            candidates: Vec::new(),
            tuned_at_unix: 1_700_000_000,
            kvq_version: "0.1.0".into(),
        }
    }

    #[test]
    fn forms_share_the_decode_store_and_miss_when_the_candidates_change() {
        let dir = std::env::temp_dir().join(format!("kvq-forms-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join(crate::tune::TUNE_FILE);
        let spec: SchemeSpec = "k = int(2, channel), v = int(2, token)".parse().unwrap();
        let key = FormsKey::of(&spec, 128, Dtype::F16);
        let mut store = TuneStore::empty(&path);
        store.insert_forms(entry(&spec, key.clone()));
        store.save().unwrap();
        let back = TuneStore::load_quietly(&path);
        assert!(back.warning().is_none(), "{:?}", back.warning());
        assert_eq!(back.forms_entries().len(), 1);
        assert_eq!(
            stored_forms_in(&back, &gpu(), &spec, 128, Dtype::F16),
            Some(QuantizerForms::both(QuantizerForm::Tiled))
        );
        // Another head size or dtype is another problem.
        assert_eq!(stored_forms_in(&back, &gpu(), &spec, 64, Dtype::F16), None);
        assert_eq!(
            stored_forms_in(&back, &gpu(), &spec, 128, Dtype::Bf16),
            None
        );
        // A result chosen from another candidate set is not read.
        let mut stale = TuneStore::empty(&path);
        let mut other = key.clone();
        other.candidates = "0000000000000000".into();
        stale.insert_forms(entry(&spec, other));
        assert_eq!(
            stored_forms_in(&stale, &gpu(), &spec, 128, Dtype::F16),
            None
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_candidate_checksum_follows_the_candidate_set() {
        let kivi2: SchemeSpec = "k = int(2, channel), v = int(2, token)".parse().unwrap();
        let int8: SchemeSpec = "k = int(8, channel, symmetric), v = int(8, channel, symmetric)"
            .parse()
            .unwrap();
        let same = |a: &SchemeSpec, b: &SchemeSpec| {
            FormsKey::of(a, 128, Dtype::F16).candidates
                == FormsKey::of(b, 128, Dtype::F16).candidates
        };
        assert!(same(&kivi2, &kivi2));
        assert_eq!(
            same(&kivi2, &int8),
            forms_candidates(&kivi2, 128) == forms_candidates(&int8, 128)
        );
        assert_eq!(FormsKey::of(&kivi2, 128, Dtype::F16).candidates.len(), 16);
    }
}
