//! The scheme-text target: bytes → text → `SchemeSpec` → canonical text round trip →
//! `check_shape` over head_dims 0..=1024 and extreme KV-head counts → memory accounting →
//! CPU reference build and dequantize → CUDA source rendering.
//!
//! What it checks besides "no panic, no hang":
//! - a parse error's span lies inside the text, and its rendering works;
//! - the canonical text parses back to the same scheme and prints the same text;
//! - a scheme that renders a GPU decode kernel for a shape can also be stored by the reference at
//!   that shape (the same rule in the reference and codegen);
//! - template failures (`CodegenError::Template`, "a bug in kvq") are findings.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvq::codegen::{self, CodegenError, Dtype, KernelShape, TuneParams};
use kvq::evaluate::{self, EvalError, Family, Workload};
use kvq::reference::attention::Queries;
use kvq::reference::commvq::{AdditiveSchedule, EmSchedule, TrainOptions};
use kvq::reference::rope::Rope;
use kvq::reference::synth::{SynthConfig, SynthKv, SynthLayer};
use kvq::reference::KvTensor;
use kvq::{Codebook, SchemeSpec, TensorQuant};

/// KV-head counts `check_shape` and the memory accounting are tried with.
pub const KV_HEADS: [u32; 9] = [0, 1, 2, 3, 8, 64, 1 << 16, u32::MAX - 1, u32::MAX];

/// Head dims beyond 1024 that `check_shape` is also tried with.
pub const EXTRA_HEAD_DIMS: [u32; 7] = [1025, 2048, 4096, 65536, 1 << 31, u32::MAX - 31, u32::MAX];

/// Head dims the reference builds at: one from each list per scheme (by its hash), so a scheme
/// always builds at the same shapes and a finding replays.
pub const SMALL_HEAD_DIMS: [u32; 6] = [32, 64, 96, 128, 160, 256];
/// See [`SMALL_HEAD_DIMS`]; the shapes past 256 where boosted layouts changed width.
pub const LARGE_HEAD_DIMS: [u32; 5] = [288, 512, 544, 768, 1024];

/// Most `tokens × kv_heads × head_dim` values one reference build takes (keeps an input fast).
const BUILD_VALUES: usize = 320 * 1024;

/// Query heads per KV head the decode kernels are rendered for.
const GQAS: [u32; 7] = [1, 4, 8, 0, 65, 128, 129];

/// Inputs of this process that parsed (the rest stopped at a grammar error).
pub static PARSED: AtomicU64 = AtomicU64::new(0);

/// The target's check; see the module docs.
pub fn check(input: &[u8]) -> Result<(), String> {
    let text = String::from_utf8_lossy(input);
    // The command line's `--scheme` path: a built-in name or scheme text, with its messages.
    if let Err(e) = kvq_cli::scheme::resolve(&text) {
        let _ = e.report();
    }
    let _ = kvq_cli::scheme::resolve_list(&text, false);
    match SchemeSpec::parse(&text) {
        Err(e) => {
            if e.span.start > e.span.end || e.span.end > text.len() {
                return Err(format!(
                    "error span outside the text: {:?} in {} bytes ({})",
                    e.span,
                    text.len(),
                    e.message
                ));
            }
            let _ = e.render(&text);
            Ok(())
        }
        Ok(spec) => {
            PARSED.fetch_add(1, Ordering::Relaxed);
            check_spec(&spec)
        }
    }
}

/// Everything after a successful parse: see the module docs.
pub fn check_spec(spec: &SchemeSpec) -> Result<(), String> {
    TRACE_START.with(|t| t.set(Some(std::time::Instant::now())));
    round_trip(spec)?;
    let _ = kvq::schemes::label(spec);
    let _ = Family::of(spec);
    for kv_heads in KV_HEADS {
        for head_dim in (0..=1024).chain(EXTRA_HEAD_DIMS) {
            let _ = spec.check_shape(head_dim, kv_heads);
        }
    }
    trace("check_shape sweep");
    let h = spec.stable_hash();
    let small = SMALL_HEAD_DIMS[(h % SMALL_HEAD_DIMS.len() as u64) as usize];
    let large = LARGE_HEAD_DIMS[((h >> 8) % LARGE_HEAD_DIMS.len() as u64) as usize];
    let kv_heads = 1 + ((h >> 16) % 2) as u32;
    for (head_dim, kv_heads) in [(small, kv_heads), (large, 1)] {
        check_at(spec, head_dim, kv_heads, h)?;
        trace(&format!(
            "reference and codegen at head_dim {head_dim}, {kv_heads} KV heads"
        ));
    }
    // Last: a panic here would hide the stages above for every scheme.
    accounting(spec);
    trace("accounting");
    Ok(())
}

thread_local! {
    static TRACE_START: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) };
}

/// With `KVQ_FUZZ_TRACE` set, prints how long the current scheme's stages took so far.
fn trace(what: &str) {
    if std::env::var_os("KVQ_FUZZ_TRACE").is_some() {
        if let Some(t) = TRACE_START.with(|t| t.get()) {
            eprintln!("{:>8.1} ms  {what}", t.elapsed().as_secs_f64() * 1e3);
        }
    }
}

/// The canonical text parses back to the same scheme and prints the same text.
pub fn round_trip(spec: &SchemeSpec) -> Result<(), String> {
    let text = spec.to_string();
    match SchemeSpec::parse(&text) {
        Err(e) => Err(format!(
            "canonical text does not parse: `{text}`: {}",
            e.message
        )),
        Ok(again) if again != *spec => Err(format!(
            "canonical text parses to another scheme: `{text}` gives {again:?}, not {spec:?}"
        )),
        Ok(again) if again.to_string() != text => Err(format!(
            "canonical text is not stable: `{text}` prints as `{again}`"
        )),
        Ok(_) => Ok(()),
    }
}

/// Memory accounting of long and absurd sequences, at shapes `check_shape` takes.
fn accounting(spec: &SchemeSpec) {
    for head_dim in [32, 128, 1024] {
        for kv_heads in [1, 8, u32::MAX] {
            if spec.check_shape(head_dim, kv_heads).is_err() {
                continue;
            }
            for len in [0, 1, 1 << 20, u64::from(u32::MAX) + 1, u64::MAX] {
                let _ = evaluate::memory(spec, head_dim, kv_heads, len);
            }
        }
    }
}

/// Token counts a build takes: one token, and enough to fill the sink, the larger local window
/// and a page past them, capped at [`BUILD_VALUES`].
fn lengths(spec: &SchemeSpec, head_dim: u32, kv_heads: u32) -> Vec<usize> {
    let local = spec.local_of(&spec.k).max(spec.local_of(&spec.v)) as usize;
    let want = spec.sink as usize + local + spec.page as usize + 1;
    let cap = (BUILD_VALUES / (head_dim as usize * kv_heads as usize)).max(1);
    let mut out = vec![1, want.min(cap)];
    out.dedup();
    out
}

/// Whether a codebook scheme's training fits an input's time: levels × rounds × codes per head,
/// at head_dims up to 256.
fn codebook_cost_ok(spec: &SchemeSpec, head_dim: u32) -> bool {
    head_dim <= 256
        && [spec.k, spec.v].iter().all(|t| match t {
            TensorQuant::Codebook(c) => match c.codebook {
                Codebook::RopeCommutative {
                    levels,
                    residuals,
                    pairs_per_code,
                } => {
                    let groups = (head_dim / 2 / pairs_per_code.max(1)) as u64;
                    u64::from(levels) * u64::from(residuals) * groups <= 1 << 12
                }
                Codebook::Additive { rows } => rows <= 512,
            },
            _ => true,
        })
}

/// Tokens, head_dim, KV heads, calibration tokens.
type WorkloadKey = (usize, u32, u32, usize);

thread_local! {
    static WORKLOADS: RefCell<HashMap<WorkloadKey, Rc<Workload>>> =
        RefCell::new(HashMap::new());
}

thread_local! {
    static LAYERS: RefCell<HashMap<(u32, u32), Rc<SynthKv>>> = RefCell::new(HashMap::new());
}

fn synth_config(tokens: usize, head_dim: u32, kv_heads: u32) -> SynthConfig {
    SynthConfig {
        tokens,
        kv_heads: kv_heads as usize,
        gqa: 2,
        head_dim: head_dim as usize,
        d_model: 64,
        outlier_pairs: 2,
        sink_tokens: 2,
        seed: 7,
    }
}

/// Most tokens a synthetic layer holds: enough for the generated schemes' sink, local window and
/// a page past them.
const MAX_TOKENS: usize = 640;

/// Cheap deterministic values in about [-2, 2] (SplitMix64 of the index).
fn noise(i: u64) -> f32 {
    let mut z = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
}

/// A layer of uniform noise with outlier channels and a massive first token: what makes the
/// integer layouts' boost selection and scales work. Much cheaper than `synth::generate` in a
/// debug build; K is not `X·W_k` here, which changes XQuant's error figure but no code path.
fn cheap_layer(tokens: usize, head_dim: u32, kv_heads: u32) -> SynthKv {
    let (h, d, dm) = (kv_heads as usize, head_dim as usize, 64usize);
    let tensor = |salt: u64| {
        let mut t = KvTensor::zeros(h, tokens, d);
        for (i, x) in t.data.iter_mut().enumerate() {
            let (tok, c) = ((i / d) % tokens, i % d);
            let gain = if c % 17 == 3 { 8.0 } else { 1.0 } * if tok == 0 { 5.0 } else { 1.0 };
            *x = noise(i as u64 ^ salt) * gain;
        }
        t
    };
    let k_pre_rope = tensor(1 << 60);
    let rope = Rope::default();
    let mut k = k_pre_rope.clone();
    for head in 0..h {
        for t in 0..tokens {
            rope.apply(k.row_mut(head, t), t);
        }
    }
    let flat = |n: usize, salt: u64| (0..n).map(|i| noise(i as u64 ^ salt)).collect::<Vec<f32>>();
    SynthKv {
        config: synth_config(tokens, head_dim, kv_heads),
        k_pre_rope,
        k,
        v: tensor(2 << 60),
        q: Queries {
            data: flat(2 * h * d, 3 << 60),
            q_heads: 2 * h,
            head_dim: d,
        },
        rope,
        layer: SynthLayer {
            x: flat(tokens * dm, 4 << 60),
            x_prev: flat(tokens * dm, 5 << 60),
            w_k: flat(dm * h * d, 6 << 60),
            w_v: flat(dm * h * d, 7 << 60),
            d_model: dm,
        },
    }
}

/// The first `tokens` tokens of one long synthetic layer per shape (generating a layer per
/// length would dominate an input's time).
fn prefix_layer(tokens: usize, head_dim: u32, kv_heads: u32) -> SynthKv {
    let base = LAYERS.with(|m| m.borrow().get(&(head_dim, kv_heads)).cloned());
    let base = base.unwrap_or_else(|| {
        let most = (BUILD_VALUES / (head_dim as usize * kv_heads as usize)).clamp(1, MAX_TOKENS);
        let layer = Rc::new(cheap_layer(most, head_dim, kv_heads));
        LAYERS.with(|m| {
            let mut m = m.borrow_mut();
            if m.len() >= 16 {
                m.clear();
            }
            m.insert((head_dim, kv_heads), layer.clone());
        });
        layer
    });
    let mut s = (*base).clone();
    s.truncate(tokens);
    s
}

/// A workload of this shape (built once per worker thread and shape); codebook schemes get
/// `calibration` held-out tokens to train on, with light training.
fn workload(
    tokens: usize,
    head_dim: u32,
    kv_heads: u32,
    calibration: usize,
) -> Option<Rc<Workload>> {
    let key = (tokens, head_dim, kv_heads, calibration);
    if let Some(w) = WORKLOADS.with(|m| m.borrow().get(&key).cloned()) {
        return Some(w);
    }
    let w = if calibration == 0 {
        Workload::new(prefix_layer(tokens, head_dim, kv_heads)).ok()?
    } else {
        let light = TrainOptions {
            em: EmSchedule {
                steps: 1,
                ..Default::default()
            },
            additive: AdditiveSchedule {
                iterations: 1,
                sweeps: 1,
            },
            threads: 1,
            ..TrainOptions::seeded(7)
        };
        Workload::generate(&synth_config(tokens, head_dim, kv_heads), calibration)
            .ok()?
            .with_training(light)
    };
    let w = Rc::new(w);
    WORKLOADS.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() >= 32 {
            m.clear();
        }
        m.insert(key, w.clone());
    });
    Some(w)
}

/// Reference build + dequantize (through `evaluate`, the one entry point for every family) and
/// CUDA rendering at one head_dim.
pub fn check_at(spec: &SchemeSpec, head_dim: u32, kv_heads: u32, salt: u64) -> Result<(), String> {
    if spec.check_shape(head_dim, kv_heads).is_err() {
        return Ok(());
    }
    let family = Family::of(spec);
    let calibration = match family {
        Ok(Family::CommVq) if !codebook_cost_ok(spec, head_dim) => 0,
        Ok(Family::CommVq) => 32,
        _ => 0,
    };
    let mut refused = None;
    for tokens in lengths(spec, head_dim, kv_heads) {
        // Codebook training too slow for an input: the refusal without calibration still runs.
        let Some(w) = workload(tokens, head_dim, kv_heads, calibration) else {
            continue;
        };
        trace(&format!("workload of {tokens} tokens"));
        let evaluated = evaluate::evaluate(spec, &w);
        trace("evaluate");
        match evaluated {
            Ok(e) => {
                if !e.output_error.is_finite() {
                    return Err(format!(
                        "non-finite attention error: `{spec}` at head_dim {head_dim}, {kv_heads} KV \
                         heads, {tokens} tokens gives {}",
                        e.output_error
                    ));
                }
            }
            // Memory past the bound is the machine's limit, not a shape the reference refuses.
            Err(EvalError::Reference(kvq::reference::RefError::Alloc(_))) => {}
            Err(EvalError::Reference(r)) if kv_heads == 1 => {
                refused = Some((tokens, r.to_string()))
            }
            Err(_) => {}
        }
    }
    if codegen::has_decode_kernel(spec) {
        render(spec, head_dim, salt, refused.as_ref())?;
    }
    Ok(())
}

/// Decode and cache kernels for two GQA sizes and a dtype chosen by `salt`.
fn render(
    spec: &SchemeSpec,
    head_dim: u32,
    salt: u64,
    refused: Option<&(usize, String)>,
) -> Result<(), String> {
    let dtype = if salt >> 20 & 1 == 0 {
        Dtype::F16
    } else {
        Dtype::Bf16
    };
    let gqas = [
        GQAS[((salt >> 24) % 3) as usize],
        GQAS[3 + ((salt >> 28) % 4) as usize],
    ];
    let template = |e: &CodegenError| match e {
        CodegenError::Template { .. } => Err(format!(
            "template failure: `{spec}` at head_dim {head_dim}: {e}"
        )),
        _ => Ok(()),
    };
    for gqa in gqas {
        let shape = KernelShape::new(head_dim, gqa, dtype);
        let _ = codegen::decode_groups(spec, &shape);
        let tune = TuneParams::default_for(spec, &shape);
        let rendered = codegen::decode_kernels(spec, &shape, &tune);
        trace(&format!("decode kernels at gqa {gqa}"));
        match rendered {
            Ok(k) => {
                if let Some((tokens, why)) = refused {
                    return Err(format!(
                        "codegen renders a decode kernel the reference cannot store: `{spec}` at \
                         head_dim {head_dim} (gqa {gqa}) renders, but the reference refuses \
                         {tokens} tokens: {why}"
                    ));
                }
                if !k.source.contains(&k.decode.name) {
                    return Err(format!(
                        "decode source lacks its entry point: `{spec}` at head_dim {head_dim}"
                    ));
                }
            }
            Err(e) => template(&e)?,
        }
    }
    if let Err(e) = codegen::cache_kernels(spec, head_dim, dtype) {
        template(&e)?;
    }
    Ok(())
}
