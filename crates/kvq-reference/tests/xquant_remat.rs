//! XQuant: the SVD latents reproduce the projections, near-lossless latents rematerialise K/V, V is
//! never rematerialised in attention, and XQuant-CL's accumulator tracks the layer inputs.

use kvq_reference::attention::{self, mse, relative_error};
use kvq_reference::synth::{generate, SynthConfig, SynthKv};
use kvq_reference::xquant::{LatentProjection, Projections, XQuantCache};
use kvq_reference::RefError;
use kvq_spec::SchemeSpec;

fn layer(d_model: usize) -> SynthKv {
    generate(&SynthConfig {
        tokens: 300,
        kv_heads: 2,
        gqa: 2,
        head_dim: 64,
        d_model,
        seed: 3,
        ..Default::default()
    })
}

fn projections(s: &SynthKv) -> Projections {
    let c = s.config;
    Projections::from_weights(
        &s.layer.w_k,
        &s.layer.w_v,
        c.d_model,
        c.kv_heads,
        c.head_dim,
    )
    .unwrap()
}

fn rel_mse(a: &[f32], b: &[f32]) -> f64 {
    mse(a, b) / mse(b, &vec![0.0f32; b.len()])
}

#[test]
fn latent_projections_factor_the_weights() {
    // d_model < kv width (rank = d_model) and d_model > kv width (rank = kv width).
    for (d_model, out) in [(96, 128), (160, 64)] {
        let w: Vec<f32> = (0..d_model * out)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.3)
            .collect();
        let p = LatentProjection::from_weight(&w, d_model, out).unwrap();
        assert_eq!(p.rank, d_model.min(out).div_ceil(32) * 32);
        let mut rebuilt = vec![0.0f32; d_model * out];
        for i in 0..d_model {
            let row = p.expand(&p.down[i * p.rank..(i + 1) * p.rank]);
            rebuilt[i * out..(i + 1) * out].copy_from_slice(&row);
        }
        assert!(relative_error(&rebuilt, &w) < 1e-5, "{d_model}×{out}");
        for a in 0..p.rank.min(d_model) {
            let n: f64 = (0..d_model)
                .map(|i| (p.down[i * p.rank + a] as f64).powi(2))
                .sum();
            assert!((n - 1.0).abs() < 1e-5);
        }
        assert!(p.singular.windows(2).all(|s| s[0] >= s[1]));
    }
}

#[test]
fn eight_bit_latents_rematerialise_k_and_v() {
    for d_model in [96, 160] {
        let s = layer(d_model);
        let spec = SchemeSpec::parse("k = int(8, channel), v = int(8, token), source = x(latent)")
            .unwrap();
        let cache = XQuantCache::build(&spec, &s.layer.x, &projections(&s), s.rope).unwrap();
        let deq = cache.dequantize();
        let (ek, ev) = (
            rel_mse(&deq.k.data, &s.k.data),
            rel_mse(&deq.v.data, &s.v.data),
        );
        assert!(ek < 1e-4 && ev < 1e-4, "d_model {d_model}: K {ek}, V {ev}");
        let exact = attention::exact(&s.q, &s.k, &s.v).unwrap();
        let out = attention::decode(&s.q, &deq, None).unwrap();
        assert!(relative_error(&out, &exact) < 1e-2);
        // 300 tokens, pages of 128, no local window: two pages quantized, 44 FP16 tokens.
        assert_eq!(deq.k_quantized.iter().filter(|q| **q).count(), 256);
    }
}

#[test]
fn values_need_no_rematerialisation() {
    let s = layer(96);
    let spec =
        SchemeSpec::parse("k = int(4, channel), v = int(4, token), source = x(latent)").unwrap();
    let cache = XQuantCache::build(&spec, &s.layer.x, &projections(&s), s.rope).unwrap();
    let deq = cache.dequantize();
    let probs = attention::probabilities(&s.q, &deq.k, &deq.k_quantized, None).unwrap();
    // Σ p_t (l̂_t · up) = (Σ p_t l̂_t) · up on the cached latents …
    let fast = cache.weighted_values(&probs, s.q.q_heads).unwrap();
    let slow = attention::weighted_values(&probs, s.q.q_heads, &deq.v);
    assert!(relative_error(&fast, &slow) < 1e-5);
    // … and Σ p_t (x_t · W_v) = (Σ p_t x_t) · W_v on the exact layer input.
    let (dm, d, l) = (s.layer.d_model, s.config.head_dim, s.config.tokens);
    let kvd = s.config.kv_heads * d;
    let group = s.q.q_heads / s.config.kv_heads;
    let direct = attention::weighted_values(&probs, s.q.q_heads, &s.v);
    for qh in 0..s.q.q_heads {
        let head = qh / group;
        let mut mix = vec![0.0f64; dm];
        for t in 0..l {
            for (m, x) in mix.iter_mut().zip(&s.layer.x[t * dm..(t + 1) * dm]) {
                *m += probs[qh * l + t] * *x as f64;
            }
        }
        for c in 0..d {
            let o: f64 = (0..dm)
                .map(|i| mix[i] * s.layer.w_v[i * kvd + head * d + c] as f64)
                .sum();
            let want = direct[qh * d + c] as f64;
            assert!(
                (o - want).abs() <= 1e-4 * want.abs().max(1e-2),
                "head {qh} ch {c}: {o} vs {want}"
            );
        }
    }
}

/// The accumulator the synthetic layer's previous layer (`x_prev`, first of its chain) hands on.
fn accumulator_of_previous_layer(spec: &SchemeSpec, s: &SynthKv, p: &Projections) -> Vec<f32> {
    let zeros = vec![0.0f32; s.layer.x_prev.len()];
    XQuantCache::build_cross_layer(spec, &s.layer.x_prev, &zeros, p, s.rope)
        .unwrap()
        .1
}

#[test]
fn cross_layer_accumulator_tracks_the_inputs() {
    let s = layer(96);
    let p = projections(&s);
    let spec = SchemeSpec::parse("k = int(8, channel), v = int(8, token), source = x(cross_layer)")
        .unwrap();
    // Layer i−1 starts the chain (accumulator zero); layer i stores its delta against X̂_{i−1}.
    let x_hat_prev = accumulator_of_previous_layer(&spec, &s, &p);
    assert!(rel_mse(&x_hat_prev, &s.layer.x_prev) < 1e-4);
    let (cache, x_hat) =
        XQuantCache::build_cross_layer(&spec, &s.layer.x, &x_hat_prev, &p, s.rope).unwrap();
    assert!(rel_mse(&x_hat, &s.layer.x) < 1e-4);
    let deq = cache.dequantize();
    assert!(rel_mse(&deq.k.data, &s.k.data) < 1e-4 && rel_mse(&deq.v.data, &s.v.data) < 1e-4);
    // The delta is smaller than X, so the same bits quantize it more finely.
    let spec2 =
        SchemeSpec::parse("k = int(2, channel), v = int(2, token), source = x(cross_layer)")
            .unwrap();
    let plain2 =
        SchemeSpec::parse("k = int(2, channel), v = int(2, token), source = x(latent)").unwrap();
    let (cl, _) =
        XQuantCache::build_cross_layer(&spec2, &s.layer.x, &x_hat_prev, &p, s.rope).unwrap();
    let plain = XQuantCache::build(&plain2, &s.layer.x, &p, s.rope).unwrap();
    let (e_cl, e_plain) = (
        rel_mse(&cl.dequantize().k.data, &s.k.data),
        rel_mse(&plain.dequantize().k.data, &s.k.data),
    );
    assert!(e_cl < e_plain, "CL {e_cl} !< plain {e_plain}");
}

#[test]
fn wrong_inputs_are_typed_errors() {
    let s = layer(96);
    let p = projections(&s);
    let latent =
        SchemeSpec::parse("k = int(4, channel), v = int(4, token), source = x(latent)").unwrap();
    let cross =
        SchemeSpec::parse("k = int(4, channel), v = int(4, token), source = x(cross_layer)")
            .unwrap();
    let kv = SchemeSpec::parse("k = int(4, channel), v = int(4, token)").unwrap();
    assert!(matches!(
        XQuantCache::build(&kv, &s.layer.x, &p, s.rope),
        Err(RefError::WrongEntryPoint(_))
    ));
    assert!(matches!(
        XQuantCache::build(&cross, &s.layer.x, &p, s.rope),
        Err(RefError::WrongEntryPoint(_))
    ));
    assert!(matches!(
        XQuantCache::build_cross_layer(&latent, &s.layer.x, &s.layer.x_prev, &p, s.rope),
        Err(RefError::WrongEntryPoint(_))
    ));
    let mut x = s.layer.x.clone();
    x[5 * 96 + 7] = f32::INFINITY;
    let err = XQuantCache::build(&latent, &x, &p, s.rope).unwrap_err();
    assert!(
        matches!(
            err,
            RefError::NonFinite {
                tensor: "x",
                token: 5,
                channel: 7,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(matches!(
        XQuantCache::build(&latent, &x[..100], &p, s.rope),
        Err(RefError::Mismatch(_))
    ));
    assert!(matches!(
        XQuantCache::build_cross_layer(&cross, &s.layer.x, &s.layer.x_prev[..96 * 10], &p, s.rope),
        Err(RefError::Mismatch(_))
    ));
    assert!(Projections::from_weights(&s.layer.w_k[1..], &s.layer.w_v, 96, 2, 64).is_err());
}

#[test]
fn latents_from_elsewhere_store_as_the_layer_input_does() {
    let s = layer(96);
    let p = projections(&s);
    let spec: SchemeSpec = "k = int(4, channel), v = int(4, token), source = x(latent)"
        .parse()
        .unwrap();
    let x = &s.layer.x[..200 * 96];
    let built = XQuantCache::build(&spec, x, &p, s.rope).unwrap();
    let given =
        XQuantCache::from_latents(&spec, &p.k.project(x), &p.v.project(x), &p, s.rope).unwrap();
    assert_eq!(built, given);
    let short = p.v.project(&x[..199 * 96]);
    assert!(matches!(
        XQuantCache::from_latents(&spec, &p.k.project(x), &short, &p, s.rope),
        Err(RefError::Mismatch(_))
    ));
    let cl: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(cross_layer)"
        .parse()
        .unwrap();
    assert!(matches!(
        XQuantCache::from_latents(&cl, &p.k.project(x), &p.v.project(x), &p, s.rope),
        Err(RefError::WrongEntryPoint(_))
    ));
}

#[test]
fn an_f16_rebuild_moves_k_by_f16_roundings_only() {
    let s = layer(96);
    let p = projections(&s);
    let spec: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(latent)"
        .parse()
        .unwrap();
    let cache = XQuantCache::build(&spec, &s.layer.x[..150 * 96], &p, s.rope).unwrap();
    let (exact, f16) = (cache.dequantize(), cache.dequantize_f16_rebuild());
    assert_eq!(exact.v.data, f16.v.data);
    let err = relative_error(&f16.k.data, &exact.k.data);
    // Two roundings of 2^-11 a product, partly cancelling over 96 latents: well below 2^-8,
    // and not zero.
    println!("relative K error of the f16 rebuild: {err:.3e}");
    assert!(err > 0.0 && err < 2f64.powi(-8), "{err}");
}

#[test]
fn cross_layer_latents_from_elsewhere_store_as_the_chain_does() {
    let s = layer(96);
    let p = projections(&s);
    let spec: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(cross_layer)"
        .parse()
        .unwrap();
    let x_hat_prev = accumulator_of_previous_layer(&spec, &s, &p);
    let (built, _) =
        XQuantCache::build_cross_layer(&spec, &s.layer.x, &x_hat_prev, &p, s.rope).unwrap();
    let delta: Vec<f32> = s
        .layer
        .x
        .iter()
        .zip(&x_hat_prev)
        .map(|(a, b)| a - b)
        .collect();
    let given = XQuantCache::from_cross_layer_latents(
        &spec,
        (&p.k.project(&delta), &p.v.project(&delta)),
        (&p.k.project(&x_hat_prev), &p.v.project(&x_hat_prev)),
        &p,
        s.rope,
    )
    .unwrap();
    assert_eq!(built, given);
    let short = p.k.project(&x_hat_prev[..96]);
    assert!(matches!(
        XQuantCache::from_cross_layer_latents(
            &spec,
            (&p.k.project(&delta), &p.v.project(&delta)),
            (&short, &p.v.project(&x_hat_prev)),
            &p,
            s.rope,
        ),
        Err(RefError::Mismatch(_))
    ));
}

#[test]
fn cross_layer_tokens_do_not_depend_on_their_page_closing() {
    // d_model 96 < 2R = 128 (the lift solves in d_model) and 384 > 2R (in the latents' width).
    for d in [96usize, 384] {
        cross_layer_streaming_case(d);
    }
}

fn cross_layer_streaming_case(d: usize) {
    // 300 tokens close two pages of 128; 100 close none. A streaming cache writes a token long
    // before its page closes, so its delta, its accumulator's latents and the accumulator it hands
    // the next layer must be those of the whole build.
    let s = layer(d);
    let p = projections(&s);
    let spec: SchemeSpec = "k = int(2, channel), v = int(2, token), source = x(cross_layer)"
        .parse()
        .unwrap();
    let x_hat_prev = accumulator_of_previous_layer(&spec, &s, &p);
    let (whole, next_whole) =
        XQuantCache::build_cross_layer(&spec, &s.layer.x, &x_hat_prev, &p, s.rope).unwrap();
    let (part, next_part) = XQuantCache::build_cross_layer(
        &spec,
        &s.layer.x[..100 * d],
        &x_hat_prev[..100 * d],
        &p,
        s.rope,
    )
    .unwrap();
    assert_eq!(next_part, next_whole[..100 * d]);
    let (wb, pb) = (
        whole.accumulator_latents().unwrap(),
        part.accumulator_latents().unwrap(),
    );
    let r = p.k.rank;
    assert_eq!((pb.0, pb.1), (&wb.0[..100 * r], &wb.1[..100 * r]));
    // Where the latent spaces span X's, the accumulator is X to the deltas' f16 rounding.
    if d <= 2 * r {
        assert!(rel_mse(&next_whole, &s.layer.x) < 1e-4);
    }
    // The lift as a matrix gives the same accumulator.
    let lift = p.lift_matrix().unwrap();
    let delta: Vec<f32> = s.layer.x[..d]
        .iter()
        .zip(&x_hat_prev[..d])
        .map(|(a, b)| a - b)
        .collect();
    let rows: Vec<f32> =
        p.k.project(&delta)
            .into_iter()
            .chain(p.v.project(&delta))
            .map(|v| half::f16::from_f32(v).to_f32())
            .collect();
    for c in 0..d {
        let want = x_hat_prev[c]
            + rows
                .iter()
                .enumerate()
                .map(|(j, v)| v * lift[j * d + c])
                .sum::<f32>();
        let err = (want - next_whole[c]).abs();
        assert!(
            err < 1e-4,
            "d_model {d} channel {c}: {want} vs {}",
            next_whole[c]
        );
    }
}
