//! The built-in codebook and rematerialisation schemes (CommVQ, XQuant) on synthetic layers through
//! the CPU reference: error orderings the papers claim, finite outputs, exact rates, determinism.
//!
//! A synthetic layer's seed also draws its weights, and codebooks are per layer; so codebooks are
//! trained on one window of a sequence and evaluated on a later, disjoint window of the same layer.

use kvq::reference::attention::{self, mse, relative_error};
use kvq::reference::commvq::{
    self, CalibrationData, Codebooks, CommVqCache, EmSchedule, TrainOptions,
};
use kvq::reference::synth::{generate, SynthConfig, SynthKv};
use kvq::reference::{Dequantized, KvTensor};
use kvq::schemes::*;
use kvq::{Scheme, TensorQuant};
use std::sync::OnceLock;

const CALIBRATION: usize = 768;
const EVALUATION: usize = 512;

fn full_layer() -> &'static SynthKv {
    static LAYER: OnceLock<SynthKv> = OnceLock::new();
    LAYER.get_or_init(|| {
        generate(&SynthConfig {
            tokens: CALIBRATION + EVALUATION,
            kv_heads: 2,
            gqa: 4,
            head_dim: 128,
            d_model: 256,
            seed: 0x5eed,
            ..Default::default()
        })
    })
}

/// Tokens `start .. start + n` as a sequence of their own (keys re-rotated to positions `0..n`).
fn window(s: &SynthKv, start: usize, n: usize) -> SynthKv {
    let cut = |x: &KvTensor| {
        let mut out = KvTensor::zeros(x.kv_heads, n, x.head_dim);
        for h in 0..x.kv_heads {
            for t in 0..n {
                out.row_mut(h, t).copy_from_slice(x.row(h, start + t));
            }
        }
        out
    };
    let mut o = s.clone();
    o.k_pre_rope = cut(&s.k_pre_rope);
    o.v = cut(&s.v);
    o.k = o.k_pre_rope.clone();
    for h in 0..o.k.kv_heads {
        for t in 0..n {
            s.rope.apply(o.k.row_mut(h, t), t);
        }
    }
    o.config.tokens = n;
    o
}

fn calibration() -> &'static SynthKv {
    static W: OnceLock<SynthKv> = OnceLock::new();
    W.get_or_init(|| window(full_layer(), 0, CALIBRATION))
}

fn evaluation() -> &'static SynthKv {
    static W: OnceLock<SynthKv> = OnceLock::new();
    W.get_or_init(|| window(full_layer(), CALIBRATION, EVALUATION))
}

/// Fewer EM steps than the default keep debug-build tests quick; the ordering claims hold either way.
fn options(seed: u64) -> TrainOptions {
    TrainOptions {
        em: EmSchedule {
            steps: 4,
            ..Default::default()
        },
        ..TrainOptions::seeded(seed)
    }
}

fn train(spec: &kvq::SchemeSpec, cal: &SynthKv, seed: u64) -> Codebooks {
    let data = CalibrationData {
        k_pre_rope: &cal.k_pre_rope,
        v: &cal.v,
        rope: cal.rope,
    };
    commvq::train_with(spec, &data, &options(seed)).expect("training")
}

struct Evaluated {
    cache: CommVqCache,
    deq: Dequantized,
}

fn commvq_eval(spec: &kvq::SchemeSpec) -> Evaluated {
    let cb = train(spec, calibration(), 1);
    let e = evaluation();
    let cache = CommVqCache::build(spec, &e.k_pre_rope, &e.v, e.rope, &cb).expect("build");
    let deq = cache.dequantize();
    Evaluated { cache, deq }
}

fn commvq1() -> &'static Evaluated {
    static E: OnceLock<Evaluated> = OnceLock::new();
    E.get_or_init(|| commvq_eval(&CommVq1::SPEC))
}

fn commvq2() -> &'static Evaluated {
    static E: OnceLock<Evaluated> = OnceLock::new();
    E.get_or_init(|| commvq_eval(&CommVq2::SPEC))
}

/// Mean squared error relative to the tensor's mean square.
fn rel_mse(a: &[f32], b: &[f32]) -> f64 {
    mse(a, b) / mse(b, &vec![0.0f32; b.len()])
}

fn attention_error(deq: &Dequantized) -> f64 {
    let e = evaluation();
    let exact = attention::exact(&e.q, &e.k, &e.v).unwrap();
    let got = attention::decode(&e.q, deq, None).unwrap();
    relative_error(&got, &exact)
}

/// KIVI-style 1-bit asymmetric per-channel quantization of keys over groups of 128 tokens: each channel
/// of a group keeps its min and max, every value snaps to the nearer one.
fn kivi_1bit_keys(k: &KvTensor) -> Vec<f32> {
    let group = 128;
    let mut out = k.data.clone();
    for h in 0..k.kv_heads {
        for g0 in (0..k.tokens).step_by(group) {
            let toks = g0..(g0 + group).min(k.tokens);
            for c in 0..k.head_dim {
                let vals: Vec<f32> = toks.clone().map(|t| k.row(h, t)[c]).collect();
                let lo = vals.iter().cloned().fold(f32::INFINITY, f32::min);
                let hi = vals.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                for (t, x) in toks.clone().zip(vals) {
                    out[(h * k.tokens + t) * k.head_dim + c] =
                        if x - lo >= hi - x { hi } else { lo };
                }
            }
        }
    }
    out
}

#[test]
fn commvq_1bit_keys_beat_a_kivi_1bit_quantizer() {
    let e = evaluation();
    let ours = rel_mse(&commvq1().deq.k.data, &e.k.data);
    let kivi = rel_mse(&kivi_1bit_keys(&e.k), &e.k.data);
    println!("keys, relative MSE: CommVQ-1 {ours:.5}, KIVI 1-bit per-channel {kivi:.5}");
    assert!(ours < kivi, "CommVQ-1 {ours} !< KIVI-1 {kivi}");
}

#[test]
fn commvq_2bit_beats_1bit() {
    let e = evaluation();
    let (one, two) = (&commvq1().deq, &commvq2().deq);
    let (k1, k2) = (
        rel_mse(&one.k.data, &e.k.data),
        rel_mse(&two.k.data, &e.k.data),
    );
    let (v1, v2) = (
        rel_mse(&one.v.data, &e.v.data),
        rel_mse(&two.v.data, &e.v.data),
    );
    let (a1, a2) = (attention_error(one), attention_error(two));
    println!("CommVQ-1: K {k1:.5} V {v1:.4} attention {a1:.4}; CommVQ-2: K {k2:.5} V {v2:.4} attention {a2:.4}");
    assert!(k2 < k1 && v2 < v1 && a2 < a1);
}

#[test]
fn commvq_outputs_are_finite_and_codes_attend_like_the_dequantized_cache() {
    let e = evaluation();
    for ev in [commvq1(), commvq2()] {
        assert!(ev
            .deq
            .k
            .data
            .iter()
            .chain(&ev.deq.v.data)
            .all(|x| x.is_finite()));
        let fast = ev.cache.attend(&e.q).unwrap();
        let slow = attention::decode(&e.q, &ev.deq, None).unwrap();
        assert!(fast.iter().all(|x| x.is_finite()));
        assert!(relative_error(&fast, &slow) < 1e-5);
    }
}

#[test]
fn commvq_payload_is_the_declared_rate() {
    for (spec, ev, k_rate, v_rate) in [
        (CommVq1::SPEC, commvq1(), 10.0 * 6.0 / 64.0, 1.0),
        (CommVq2::SPEC, commvq2(), 21.0 * 6.0 / 64.0, 2.0),
    ] {
        let fp = ev.cache.footprint();
        let rate = |t: &TensorQuant| match t {
            TensorQuant::Codebook(c) => c.codebook.bits_per_scalar(128),
            _ => f64::NAN,
        };
        assert_eq!(rate(&spec.k), k_rate);
        assert_eq!(rate(&spec.v), v_rate);
        assert_eq!(fp.k.payload_bits_per_element(), k_rate);
        assert_eq!(fp.v.payload_bits_per_element(), v_rate);
        // 512 tokens = 4 whole pages: nothing left in FP16.
        assert_eq!(fp.k.fp16_elements + fp.v.fp16_elements, 0);
        println!(
            "{}: K {:.4} + V {:.4} payload bits/scalar, {:.4} with scales; codebooks {} KiB per layer",
            spec,
            fp.k.payload_bits_per_element(),
            fp.v.payload_bits_per_element(),
            fp.bits_per_element(),
            fp.codebook_bytes() / 1024
        );
    }
}

#[test]
fn commvq_training_is_deterministic_for_a_seed() {
    let cal = window(full_layer(), 0, 256);
    let a = train(&CommVq1::SPEC, &cal, 42);
    assert_eq!(a, train(&CommVq1::SPEC, &cal, 42));
    assert_ne!(a, train(&CommVq1::SPEC, &cal, 43));
}

fn projections() -> &'static kvq::reference::xquant::Projections {
    static P: OnceLock<kvq::reference::xquant::Projections> = OnceLock::new();
    P.get_or_init(|| {
        let s = full_layer();
        let c = s.config;
        kvq::reference::xquant::Projections::from_weights(
            &s.layer.w_k,
            &s.layer.w_v,
            c.d_model,
            c.kv_heads,
            c.head_dim,
        )
        .expect("SVD")
    })
}

/// Rows `start .. start + n` of a `[tokens][d_model]` activation.
fn rows(x: &[f32], start: usize, n: usize) -> Vec<f32> {
    let d = full_layer().layer.d_model;
    x[start * d..(start + n) * d].to_vec()
}

fn xquant_eval(spec: &kvq::SchemeSpec) -> (Dequantized, f64) {
    let e = evaluation();
    let x = rows(&full_layer().layer.x, CALIBRATION, EVALUATION);
    let cache = kvq::reference::xquant::XQuantCache::build(spec, &x, projections(), e.rope)
        .expect("xquant");
    let bits = cache.page_bits_per_kv_element();
    (cache.dequantize(), bits)
}

#[test]
fn xquant_error_falls_with_bits() {
    let e = evaluation();
    let mut last = f64::INFINITY;
    for (name, spec) in [
        ("XQuant-2", XQuant2::SPEC),
        ("XQuant-3", XQuant3::SPEC),
        ("XQuant-4", XQuant4::SPEC),
    ] {
        let (deq, bits) = xquant_eval(&spec);
        assert!(deq.k.data.iter().chain(&deq.v.data).all(|x| x.is_finite()));
        let err = attention_error(&deq);
        println!(
            "{name}: attention {err:.4}, K {:.5}, V {:.4}, {bits:.3} bits per K/V element",
            rel_mse(&deq.k.data, &e.k.data),
            rel_mse(&deq.v.data, &e.v.data)
        );
        assert!(err.is_finite() && err < last, "{name}: {err} !< {last}");
        last = err;
    }
}

#[test]
fn xquant_cl_beats_xquant_at_two_bits() {
    let e = evaluation();
    let l = &full_layer().layer;
    let (x_prev, x) = (
        rows(&l.x_prev, CALIBRATION, EVALUATION),
        rows(&l.x, CALIBRATION, EVALUATION),
    );
    let p = projections();
    // The previous layer starts the chain (zero accumulator); this synthetic layer's weights serve both.
    let zeros = vec![0.0f32; x.len()];
    let (_, x_hat_prev) = kvq::reference::xquant::XQuantCache::build_cross_layer(
        &XQuantCl2::SPEC,
        &x_prev,
        &zeros,
        p,
        e.rope,
    )
    .expect("layer i-1");
    let (cl, x_hat) = kvq::reference::xquant::XQuantCache::build_cross_layer(
        &XQuantCl2::SPEC,
        &x,
        &x_hat_prev,
        p,
        e.rope,
    )
    .expect("layer i");
    assert!(x_hat.iter().all(|v| v.is_finite()));
    let deq = cl.dequantize();
    let (cl_err, plain_err) = (
        attention_error(&deq),
        attention_error(&xquant_eval(&XQuant2::SPEC).0),
    );
    println!(
        "XQuant-CL-2: attention {cl_err:.4} (XQuant-2 {plain_err:.4}), {:.3} bits per K/V element",
        cl.page_bits_per_kv_element()
    );
    assert!(cl_err.is_finite() && cl_err < plain_err);
}

/// CommVQ at head_dim 80 and 112 (40 and 56 RoPE pairs): a key codebook of 8 pairs a code divides
/// both and evaluates like any other shape; the built-ins' 64 pairs a code do not, and say so.
#[test]
fn commvq_at_head_dims_that_are_not_multiples_of_32() {
    use kvq::evaluate::{self, EvalError, Workload};
    let spec: kvq::SchemeSpec = "k = codebook(rope_commutative, levels = 16, residuals = 2, \
         pairs_per_code = 8, span = token), v = codebook(additive, rows = 64)"
        .parse()
        .unwrap();
    for d in [80, 112] {
        let cfg = SynthConfig {
            tokens: 256,
            kv_heads: 1,
            head_dim: d,
            d_model: 96,
            ..SynthConfig::default()
        };
        let w = Workload::generate(&cfg, 256).unwrap();
        let e = evaluate::evaluate(&spec, &w).unwrap_or_else(|e| panic!("d{d}: {e}"));
        assert!(
            e.output_error.is_finite() && e.output_error < 1.0,
            "d{d}: {e:?}"
        );
        assert!(
            e.k_rel_mse.is_finite() && e.v_rel_mse.is_finite(),
            "d{d}: {e:?}"
        );
        assert_eq!(
            evaluate::memory(&spec, d as u32, 1, 256).unwrap(),
            e.memory,
            "d{d}"
        );
        for builtin in [CommVq1::SPEC, CommVq2::SPEC] {
            let err = evaluate::evaluate(&builtin, &w).unwrap_err();
            assert!(matches!(err, EvalError::Reference(_)), "d{d}: {err:?}");
            assert_eq!(
                err.to_string(),
                format!(
                    "k: `pairs_per_code = 64` does not divide the {} RoPE pairs of head_dim {d}",
                    d / 2
                ),
            );
        }
    }
}
