//! Bit-equality harness for two builds of kvq: dumps the raw bits of every GPU decode output (and
//! of the paged cache's state and decode) over a fixed grid of inputs, then compares two dumps.
//!
//! ```text
//! decode_dump <dir> [--schemes kivi2,kitty]   # needs a GPU; writes <dir>/<case>.bin
//! decode_dump --compare <dirA> <dirB>          # per case: identical / max ulp / max rel err
//! ```
//!
//! The grid: every built-in with a GPU decode kernel × head_dim {64, 128, 256} × {f16, bf16} ×
//! GQA {1, 4, 8, 16}, over two batches of odd lengths, each at the default split count, one
//! split and seven splits; and the paged cache (prefill, appends across pages, decode) for every
//! such scheme × head_dim × input dtype. Outputs are poisoned (all ones) before every launch.
//!
//! The inputs come from this file's own seeded generator, not from kvq's synthetic-data modules,
//! and only public APIs present in every build being compared are used, so two builds given the
//! same file see the same inputs. A case that fails to build or launch writes `<case>.err` with
//! the message instead. Without a GPU: says so and exits 2. `--compare` exits 0 when every case is
//! identical, 1 otherwise.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use half::{bf16, f16};
use kvq::codegen::{has_decode_kernel, Dtype, KernelShape, TuneParams};
use kvq::reference::int::IntCache;
use kvq::reference::KvTensor;
use kvq::runtime::{
    CacheConfig, DecodeKernel, DecodeScratch, Device, GpuCache, Jit, PagedKvCache, Pieces, SeqId,
};
use kvq::schemes::BUILTIN;
use kvq::SchemeSpec;

const KV_HEADS: usize = 2;
const HEAD_DIMS: [u32; 3] = [64, 128, 256];
const DTYPES: [Dtype; 2] = [Dtype::F16, Dtype::Bf16];
const GQAS: [u32; 4] = [1, 4, 8, 16];
/// Two batches of odd, unequal lengths: one spanning 1 to 20K tokens, one of near-equal middles.
const BATCHES: [(&str, &[usize]); 2] = [
    ("a", &[1, 127, 4097, 20011]),
    ("b", &[129, 777, 778, 779, 1283]),
];
/// Paged cache: prompt lengths, then appends to every sequence (crossing pages and windows).
const PROMPTS: [usize; 3] = [0, 200, 1100];
const APPENDS: usize = 300;

/// SplitMix64: the dump's own generator, so its inputs never change with kvq's.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, case: &str) -> Rng {
        let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
        for b in case.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        Rng(h)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Laplace (scale 0.4), heavy-tailed.
    fn laplace(&mut self) -> f32 {
        let m = -(1.0 - self.unit()).max(f32::MIN_POSITIVE).ln() * 0.4;
        if self.next() & 1 == 0 {
            m
        } else {
            -m
        }
    }
}

const SEED: u64 = 0x6b76_715f_6475_6d70;

/// `x` rounded to `dtype`: the device word and the value it holds.
fn word(x: f32, dtype: Dtype) -> (u16, f32) {
    match dtype {
        Dtype::F16 => {
            let h = f16::from_f32(x);
            (h.to_bits(), h.to_f32())
        }
        _ => {
            let h = bf16::from_f32(x);
            (h.to_bits(), h.to_f32())
        }
    }
}

fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::F16 => "f16",
        _ => "bf16",
    }
}

/// K and V `[kv_heads][tokens][head_dim]`: Laplace values plus a per-channel bias, one key channel
/// in 16 eightfold, every value an f16 (what a cache's f16 regions hold exactly).
fn kv(case: &str, tokens: usize, d: usize) -> (KvTensor, KvTensor) {
    let mut rng = Rng::new(SEED, case);
    let mut fill = |outliers: bool| {
        let ch: Vec<(f32, f32)> = (0..KV_HEADS * d)
            .map(|_| {
                let g = if outliers && rng.next() % 16 == 0 {
                    8.0
                } else {
                    1.0
                };
                (g, (rng.unit() - 0.5) * g)
            })
            .collect();
        let mut data = Vec::with_capacity(KV_HEADS * tokens * d);
        for h in 0..KV_HEADS {
            for _ in 0..tokens {
                for &(g, b) in &ch[h * d..(h + 1) * d] {
                    data.push(word(rng.laplace() * g + b, Dtype::F16).1);
                }
            }
        }
        KvTensor {
            data,
            kv_heads: KV_HEADS,
            tokens,
            head_dim: d,
        }
    };
    let k = fill(true);
    let v = fill(false);
    (k, v)
}

/// `n` query words of `dtype`, uniform in [-1.5, 1.5).
fn queries(case: &str, n: usize, dtype: Dtype) -> Vec<u16> {
    let mut rng = Rng::new(SEED, case);
    (0..n)
        .map(|_| word(3.0 * rng.unit() - 1.5, dtype).0)
        .collect()
}

fn words_to_bytes(words: &[u16]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Writes `<dir>/<case>.bin`, or `<dir>/<case>.err` with the message.
fn write_case(dir: &Path, case: &str, result: Result<Vec<u8>, String>) -> bool {
    let (path, bytes) = match result {
        Ok(b) => (dir.join(format!("{case}.bin")), b),
        Err(e) => {
            eprintln!("{case}: {e}");
            (dir.join(format!("{case}.err")), e.into_bytes())
        }
    };
    if let Err(e) = std::fs::write(&path, bytes) {
        eprintln!("cannot write {}: {e}", path.display());
        return false;
    }
    true
}

fn gpu_schemes(only: Option<&str>) -> Vec<(&'static str, SchemeSpec)> {
    let wanted: Option<Vec<&str>> = only.map(|s| s.split(',').map(str::trim).collect());
    BUILTIN
        .iter()
        .filter(|b| has_decode_kernel(&b.spec))
        .filter(|b| match &wanted {
            Some(w) => w.contains(&b.name),
            None => true,
        })
        .map(|b| (b.name, b.spec))
        .collect()
}

/// One decode case: every split choice of one kernel over one batch.
#[allow(clippy::too_many_arguments)]
fn decode_case(
    device: &Device,
    kernel: &DecodeKernel,
    gpu: &GpuCache,
    batch: usize,
    q_heads: usize,
    d: usize,
    dtype: Dtype,
    case: &str,
) -> Vec<(String, Result<Vec<u8>, String>)> {
    let stream = device.default_stream();
    let n = batch * q_heads * d;
    let q_words = queries(case, n, dtype);
    let mut out = Vec::new();
    let q = match stream.clone_htod(&q_words) {
        Ok(q) => q,
        Err(e) => return vec![(case.to_string(), Err(format!("upload q: {e}")))],
    };
    let sm = device.props().sm_count as usize;
    let default = kernel.default_splits(batch, KV_HEADS, gpu.max_len(), sm);
    let mut runs = vec![("s1".to_string(), Ok(1usize)), ("s7".to_string(), Ok(7))];
    runs.insert(
        0,
        ("sdefault".to_string(), default.map_err(|e| e.to_string())),
    );
    for (label, splits) in runs {
        let name = format!("{case}-{label}");
        let result = splits.and_then(|splits| {
            let pieces = if label == "sdefault" {
                kernel.default_pieces(gpu.max_len(), splits)
            } else {
                Pieces::NONE
            };
            let mut o = stream
                .clone_htod(&vec![0xFFFFu16; n])
                .map_err(|e| format!("poisoned output: {e}"))?;
            let mut scratch =
                DecodeScratch::with_pieces(&stream, batch, q_heads, d, splits, pieces)
                    .map_err(|e| format!("scratch: {e}"))?;
            kernel
                .attend(&stream, gpu.view(), &q, &mut o, &mut scratch)
                .map_err(|e| format!("launch: {e}"))?;
            let got: Vec<u16> = stream
                .clone_dtoh(&o)
                .map_err(|e| format!("download: {e}"))?;
            Ok(words_to_bytes(&got))
        });
        out.push((name, result));
    }
    out
}

/// The paged cache: prefill, appends, the state's bytes and a decode over it.
fn paged_case(
    device: &Device,
    jit: &Jit,
    spec: &SchemeSpec,
    d: usize,
    dtype: Dtype,
    case: &str,
) -> Result<(Vec<u8>, Vec<u8>), String> {
    let stream = device.default_stream();
    let cfg = CacheConfig {
        kv_heads: KV_HEADS,
        head_dim: d,
        max_seqs: PROMPTS.len(),
        pool_pages: 256,
        max_tokens: 4096,
        input_dtype: dtype,
    };
    let mut cache = PagedKvCache::new(jit, stream.clone(), spec, cfg).map_err(|e| e.to_string())?;
    // Token-major `[tokens][kv_heads][d]` words of each sequence.
    let words: Vec<(Vec<u16>, Vec<u16>)> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let (k, v) = kv(&format!("{case}-seq{i}"), p + APPENDS, d);
            let tm = |x: &KvTensor| -> Vec<u16> {
                (0..x.tokens)
                    .flat_map(|t| (0..KV_HEADS).map(move |h| (t, h)))
                    .flat_map(|(t, h)| x.row(h, t).iter().map(|&y| word(y, dtype).0))
                    .collect()
            };
            (tm(&k), tm(&v))
        })
        .collect();
    let row = KV_HEADS * d;
    let ids: Vec<SeqId> = PROMPTS
        .iter()
        .map(|_| cache.add_sequence().map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    for (i, &p) in PROMPTS.iter().enumerate() {
        let k = stream
            .clone_htod(&words[i].0[..p * row])
            .map_err(|e| e.to_string())?;
        let v = stream
            .clone_htod(&words[i].1[..p * row])
            .map_err(|e| e.to_string())?;
        cache
            .prefill(ids[i], &k, &v, p, dtype)
            .map_err(|e| format!("prefill: {e}"))?;
    }
    for step in 0..APPENDS {
        let mut kb = Vec::new();
        let mut vb = Vec::new();
        for (i, &p) in PROMPTS.iter().enumerate() {
            kb.extend_from_slice(&words[i].0[(p + step) * row..(p + step + 1) * row]);
            vb.extend_from_slice(&words[i].1[(p + step) * row..(p + step + 1) * row]);
        }
        let k = stream.clone_htod(&kb).map_err(|e| e.to_string())?;
        let v = stream.clone_htod(&vb).map_err(|e| e.to_string())?;
        cache
            .append(&ids, &k, &v, dtype)
            .map_err(|e| format!("append: {e}"))?;
    }
    let mut state = Vec::new();
    for &id in &ids {
        let s = cache.snapshot(id).map_err(|e| format!("snapshot: {e}"))?;
        for page in s.k_pages.iter().chain(&s.v_pages) {
            state.extend_from_slice(page);
        }
        for words in [&s.k_sink, &s.v_sink, &s.k_tail, &s.v_tail] {
            state.extend(words_to_bytes(words));
        }
    }
    // Decode over it, as an engine does: an f16 kernel of 4 query heads per KV head.
    let shape = KernelShape::new(d as u32, 4, Dtype::F16);
    let kernel = DecodeKernel::load(jit, spec, &shape, &TuneParams::default_for(spec, &shape))
        .map_err(|e| format!("decode kernel: {e}"))?;
    let q_heads = KV_HEADS * 4;
    let n = PROMPTS.len() * q_heads * d;
    let q = stream
        .clone_htod(&queries(case, n, Dtype::F16))
        .map_err(|e| e.to_string())?;
    let mut out = stream
        .clone_htod(&vec![0xFFFFu16; n])
        .map_err(|e| e.to_string())?;
    let sm = device.props().sm_count as usize;
    let splits = kernel
        .default_splits(PROMPTS.len(), KV_HEADS, cache.max_len(), sm)
        .map_err(|e| e.to_string())?;
    let pieces = kernel.default_pieces(cache.max_len(), splits);
    let mut scratch =
        DecodeScratch::with_pieces(&stream, PROMPTS.len(), q_heads, d, splits, pieces)
            .map_err(|e| e.to_string())?;
    cache
        .attend(&kernel, &q, &mut out, &mut scratch)
        .map_err(|e| format!("attend: {e}"))?;
    let got: Vec<u16> = stream.clone_dtoh(&out).map_err(|e| e.to_string())?;
    Ok((words_to_bytes(&got), state))
}

/// Loads every decode kernel of the grid (the paged decode's among them) once, on all cores (NVRTC is the slow part and the JIT is
/// thread-safe), so the cases below find them in the JIT's cache. Errors are left for the cases
/// to record.
fn prewarm(jit: &Jit, schemes: &[(&'static str, SchemeSpec)]) {
    let mut shapes = Vec::new();
    for (_, spec) in schemes {
        for d in HEAD_DIMS {
            for dtype in DTYPES {
                for gqa in GQAS {
                    shapes.push((*spec, KernelShape::new(d, gqa, dtype)));
                }
            }
        }
    }
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .min(16);
    let chunk = shapes.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for part in shapes.chunks(chunk) {
            s.spawn(move || {
                for (spec, shape) in part {
                    let _ =
                        DecodeKernel::load(jit, spec, shape, &TuneParams::default_for(spec, shape));
                }
            });
        }
    });
}

fn dump(dir: &Path, only: Option<&str>) -> ExitCode {
    let device = match Device::open(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("decode_dump needs a GPU: no usable GPU ({e})");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!("cannot create {}: {e}", dir.display());
        return ExitCode::from(2);
    }
    let jit = match Jit::new(&device) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("JIT: {e}");
            return ExitCode::from(2);
        }
    };
    let schemes = gpu_schemes(only);
    println!(
        "device {}; schemes {:?}",
        device.props().name,
        schemes.iter().map(|(n, _)| *n).collect::<Vec<_>>()
    );
    let started = std::time::Instant::now();
    prewarm(&jit, &schemes);
    println!(
        "compiled the decode kernels in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let (mut written, mut ok) = (0usize, true);
    for (name, spec) in &schemes {
        for &d in &HEAD_DIMS {
            for (label, lens) in BATCHES {
                let caches: Result<Vec<IntCache>, String> = lens
                    .iter()
                    .enumerate()
                    .map(|(i, &len)| {
                        let (k, v) = kv(&format!("{name}-d{d}-{label}-seq{i}"), len, d as usize);
                        IntCache::build(spec, &k, &v).map_err(|e| e.to_string())
                    })
                    .collect();
                let gpu = caches.and_then(|c| {
                    let refs: Vec<&IntCache> = c.iter().collect();
                    GpuCache::upload(&device.default_stream(), &refs).map_err(|e| e.to_string())
                });
                for dtype in DTYPES {
                    for gqa in GQAS {
                        let case =
                            format!("decode-{name}-d{d}-{}-g{gqa}-{label}", dtype_name(dtype));
                        let shape = KernelShape::new(d, gqa, dtype);
                        let results = match &gpu {
                            Err(e) => vec![(case.clone(), Err(format!("cache: {e}")))],
                            Ok(gpu) => match DecodeKernel::load(
                                &jit,
                                spec,
                                &shape,
                                &TuneParams::default_for(spec, &shape),
                            ) {
                                Err(e) => vec![(case.clone(), Err(format!("load: {e}")))],
                                Ok(kernel) => decode_case(
                                    &device,
                                    &kernel,
                                    gpu,
                                    lens.len(),
                                    KV_HEADS * gqa as usize,
                                    d as usize,
                                    dtype,
                                    &case,
                                ),
                            },
                        };
                        for (case, result) in results {
                            ok &= write_case(dir, &case, result);
                            written += 1;
                        }
                    }
                }
            }
            for dtype in DTYPES {
                let case = format!("paged-{name}-d{d}-{}", dtype_name(dtype));
                match paged_case(&device, &jit, spec, d as usize, dtype, &case) {
                    Ok((out, state)) => {
                        ok &= write_case(dir, &case, Ok(out));
                        ok &= write_case(dir, &format!("{case}-state"), Ok(state));
                        written += 2;
                    }
                    Err(e) => {
                        ok &= write_case(dir, &case, Err(e));
                        written += 1;
                    }
                }
            }
            println!(
                "{name} d{d}: done ({written} cases, {:.0} s)",
                started.elapsed().as_secs_f64()
            );
        }
    }
    println!("wrote {written} cases to {}", dir.display());
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn case_files(dir: &Path) -> Result<BTreeSet<String>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".bin") || n.ends_with(".err"))
        .collect())
}

/// A 16-bit float word as a signed integer ordered like the values it holds.
fn ordered(w: u16) -> i32 {
    if w & 0x8000 != 0 {
        -i32::from(w & 0x7FFF)
    } else {
        i32::from(w)
    }
}

fn compare(a: &Path, b: &Path) -> ExitCode {
    let (fa, fb) = match (case_files(a), case_files(b)) {
        (Ok(x), Ok(y)) => (x, y),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let (mut same, mut differ) = (0usize, 0usize);
    for file in fa.union(&fb) {
        let case = file.trim_end_matches(".bin").trim_end_matches(".err");
        let verdict = match (std::fs::read(a.join(file)), std::fs::read(b.join(file))) {
            (Err(_), _) => format!("only in {}", b.display()),
            (_, Err(_)) => format!("only in {}", a.display()),
            (Ok(x), Ok(y)) if x == y => "identical".to_string(),
            (Ok(x), Ok(y)) if file.ends_with(".err") => format!(
                "errors differ: {:?} vs {:?}",
                String::from_utf8_lossy(&x),
                String::from_utf8_lossy(&y)
            ),
            (Ok(x), Ok(y)) if x.len() != y.len() => {
                format!("sizes differ: {} vs {} bytes", x.len(), y.len())
            }
            (Ok(x), Ok(y)) if case.ends_with("-state") => {
                let n = x.iter().zip(&y).filter(|(p, q)| p != q).count();
                format!("{n} of {} state bytes differ", x.len())
            }
            (Ok(x), Ok(y)) => {
                let bf = case.contains("-bf16-") && case.starts_with("decode-");
                let value = |w: u16| {
                    if bf {
                        bf16::from_bits(w).to_f64()
                    } else {
                        f16::from_bits(w).to_f64()
                    }
                };
                let (mut ulp, mut rel, mut n) = (0i32, 0.0f64, 0usize);
                for (p, q) in x.chunks_exact(2).zip(y.chunks_exact(2)) {
                    let (p, q) = (
                        u16::from_le_bytes([p[0], p[1]]),
                        u16::from_le_bytes([q[0], q[1]]),
                    );
                    if p == q {
                        continue;
                    }
                    n += 1;
                    ulp = ulp.max((ordered(p) - ordered(q)).abs());
                    let (vp, vq) = (value(p), value(q));
                    let r = (vp - vq).abs() / vq.abs().max(f64::MIN_POSITIVE);
                    rel = if r.is_nan() {
                        f64::INFINITY
                    } else {
                        rel.max(r)
                    };
                }
                format!(
                    "{n} of {} outputs differ, max {ulp} ulp, max rel err {rel:.3e}",
                    x.len() / 2
                )
            }
        };
        if verdict == "identical" {
            same += 1;
        } else {
            differ += 1;
        }
        println!("{case}: {verdict}");
    }
    println!("{same} identical, {differ} not");
    if differ == 0 && same > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn usage() -> ExitCode {
    eprintln!("usage: decode_dump <dir> [--schemes a,b] | decode_dump --compare <dirA> <dirB>");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["--compare", a, b] => compare(Path::new(a), Path::new(b)),
        [dir] => dump(&PathBuf::from(dir), None),
        [dir, "--schemes", only] => dump(&PathBuf::from(dir), Some(only)),
        _ => usage(),
    }
}
