//! Which form each page quantizer takes (naive, tiled, coarsened, vectorized — they write the same
//! bytes at different speeds), chosen per GPU like the decode kernels' configuration:
//!
//! ```text
//! choose_forms(policy)
//!   off    ─▶ QuantizerForms::default_for (vectorized where the layout allows, else tiled)
//!   cached ─▶ stored result for (GPU, scheme, head_dim, dtype) in <cache dir>/tune-quantizers.json
//!   full   ─▶ stored result, else tune_forms now and store it:
//!        every form (tiled where a tensor's layout does not support it), on a prefill larger than
//!        4× L2; gate: a small prefill bit-exact with the CPU reference; winner: fastest that passed
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use kvq_codegen::{Dtype, QuantizerForm, QuantizerForms};
use kvq_reference::int::IntCache;
use kvq_reference::resources::read_input_file;
use kvq_reference::KvTensor;
use kvq_spec::SchemeSpec;
use serde::{Deserialize, Serialize};

use super::cache::{CacheConfig, PagedKvCache};
use crate::disk_cache::cache_root;
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::tune::store::{unix_now, write_atomically};
use crate::tune::synth::{round_to_word, word_to_f32, SynthRng};
use crate::tune::{GpuKey, TunePolicy};

/// Name of the file under the cache root.
pub const FORMS_FILE: &str = "tune-quantizers.json";

/// KV heads of the tuning workload (the forms' speed does not depend on it: one CTA per head-page).
const TUNE_KV_HEADS: usize = 8;
/// Timed repetitions per form.
const TUNE_RUNS: usize = 10;

/// One tuned result: the fastest correct forms of a scheme's page quantizers on one GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FormsEntry {
    /// Where it was measured.
    pub gpu: GpuKey,
    /// The scheme's canonical text.
    pub scheme: String,
    /// Channels per head.
    pub head_dim: u32,
    /// Input dtype of the prefilled K/V.
    pub dtype: Dtype,
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

#[derive(Debug, Default, Serialize, Deserialize)]
struct FormsFile {
    entries: Vec<FormsEntry>,
}

fn store_path() -> Result<PathBuf> {
    Ok(cache_root()?.join(FORMS_FILE))
}

/// The largest quantizer-forms file read. An entry (with its candidates' timings) is a few
/// kilobytes of JSON, so 64 MiB holds thousands of tuned (GPU, scheme, shape) problems, while a
/// stray huge file at the path is refused before it is read into memory.
pub const MAX_FORMS_FILE_BYTES: u64 = 64 << 20;

/// Stored entries; a missing or unreadable file is empty (it is a cache of measurements).
fn load_entries() -> Vec<FormsEntry> {
    match store_path() {
        Ok(path) => load_entries_from(&path),
        Err(_) => Vec::new(),
    }
}

/// The entries of the file at `path`. It is read through [`read_input_file`], so a FIFO, device
/// node or directory there, or a file past [`MAX_FORMS_FILE_BYTES`], counts as unreadable (empty)
/// instead of blocking the open or reading without end.
fn load_entries_from(path: &Path) -> Vec<FormsEntry> {
    read_input_file(path, "the quantizer tuning file", MAX_FORMS_FILE_BYTES)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<FormsFile>(&bytes).ok())
        .map(|f| f.entries)
        .unwrap_or_default()
}

/// Adds (or replaces) an entry; written atomically (temporary file, then rename).
fn save_entry(entry: FormsEntry) -> Result<()> {
    let path = store_path()?;
    let mut entries = load_entries();
    entries.retain(|e| !same_problem(e, &entry.gpu, &entry.scheme, entry.head_dim, entry.dtype));
    entries.push(entry);
    let text = serde_json::to_string_pretty(&FormsFile { entries }).map_err(|e| {
        RuntimeError::CacheIo {
            action: "encode quantizer tuning results for",
            path: path.clone(),
            source: std::io::Error::other(e),
        }
    })?;
    write_atomically(&path, text.as_bytes())
}

fn same_problem(e: &FormsEntry, gpu: &GpuKey, scheme: &str, head_dim: u32, dtype: Dtype) -> bool {
    e.gpu == *gpu && e.scheme == scheme && e.head_dim == head_dim && e.dtype == dtype
}

/// The stored forms for this GPU and problem, if they are still supported.
pub fn stored_forms(
    gpu: &GpuKey,
    spec: &SchemeSpec,
    head_dim: u32,
    dtype: Dtype,
) -> Option<QuantizerForms> {
    let scheme = spec.to_string();
    load_entries()
        .into_iter()
        .find(|e| same_problem(e, gpu, &scheme, head_dim, dtype))
        .map(|e| e.forms)
        .filter(|f| {
            let ok = |form: QuantizerForm, t: &kvq_spec::TensorQuant| {
                !t.is_quantized() || form.supports(t, head_dim, spec.page)
            };
            ok(f.k, &spec.k) && ok(f.v, &spec.v)
        })
}

/// The forms `policy` selects (see the module docs).
pub fn choose_forms(
    jit: &Jit,
    stream: &Arc<CudaStream>,
    spec: &SchemeSpec,
    head_dim: u32,
    dtype: Dtype,
    policy: TunePolicy,
) -> Result<QuantizerForms> {
    let default = QuantizerForms::default_for(spec, head_dim);
    if policy == TunePolicy::Off || !(spec.k.is_quantized() || spec.v.is_quantized()) {
        return Ok(default);
    }
    let gpu = GpuKey::of(jit.device().props());
    if let Some(forms) = stored_forms(&gpu, spec, head_dim, dtype) {
        return Ok(forms);
    }
    if policy == TunePolicy::Cached {
        return Ok(default);
    }
    let entry = tune_forms(jit, stream, spec, head_dim, dtype)?;
    let forms = entry.forms;
    save_entry(entry)?;
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
    let mut candidates: Vec<QuantizerForms> = QuantizerForm::ALL
        .into_iter()
        .map(|f| forms_or_tiled(spec, head_dim, f))
        .collect();
    candidates.dedup();
    let mut timings = Vec::new();
    for forms in candidates {
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
        scheme: spec.to_string(),
        head_dim,
        dtype,
        forms: best,
        candidates: timings,
        tuned_at_unix: unix_now(),
        kvq_version: env!("CARGO_PKG_VERSION").to_string(),
    })
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::device::DriverVersion;
    use crate::tune::store::tests::{make_fifo, promptly};

    fn entry() -> FormsEntry {
        FormsEntry {
            gpu: GpuKey {
                name: "NVIDIA H100 80GB HBM3".into(),
                compute_capability: (9, 0),
                sm_count: 132,
                driver: DriverVersion {
                    major: 13,
                    minor: 0,
                },
            },
            scheme: "k = int(2, channel), v = int(2, token)".into(),
            head_dim: 128,
            dtype: Dtype::F16,
            forms: QuantizerForms::both(QuantizerForm::Tiled),
            candidates: Vec::new(),
            tuned_at_unix: 1_700_000_000,
            kvq_version: "0.1.0".into(),
        }
    }

    #[test]
    fn a_fifo_device_or_oversized_forms_file_is_empty_promptly_never_a_hang() {
        let dir = std::env::temp_dir().join(format!("kvq-forms-special-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(FORMS_FILE);
        let load = |path: &Path| {
            let path = path.to_path_buf();
            promptly(move || load_entries_from(&path))
        };

        let text = serde_json::to_string(&FormsFile {
            entries: vec![entry()],
        })
        .unwrap();
        std::fs::write(&path, text).unwrap();
        assert_eq!(load(&path), vec![entry()]);

        std::fs::remove_file(&path).unwrap();
        make_fifo(&path);
        assert!(load(&path).is_empty());

        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert!(load(&path).is_empty());

        // Sparse: only the stated size is past the limit.
        std::fs::remove_file(&path).unwrap();
        std::fs::File::create(&path)
            .unwrap()
            .set_len(MAX_FORMS_FILE_BYTES + 1)
            .unwrap();
        assert!(load(&path).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
