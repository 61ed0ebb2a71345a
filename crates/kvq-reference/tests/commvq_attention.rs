//! Attention computed from the codes (RoPE folded into `q·C`, values reordered to `(p·S)·C`) equals
//! attention over the dequantized K̂/V̂.

mod commvq_common;
use commvq_common::*;
use half::f16;
use kvq_reference::attention::{self, Queries};
use kvq_reference::commvq::CommVqCache;

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

#[test]
fn commuted_scores_match_scores_of_the_rotated_decoded_keys() {
    for span in ["head", "token"] {
        let spec = small_scheme(span);
        let cb = train(&spec, &layer(256, 1), 5);
        let s = layer(300, 2);
        let cache = CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &cb).unwrap();
        let deq = cache.dequantize();
        let scores = cache.scores(&s.q).unwrap();
        let d = s.q.head_dim;
        let group = s.q.q_heads / s.k.kv_heads;
        let mut worst: f64 = 0.0;
        for qh in 0..s.q.q_heads {
            for t in 0..s.k.tokens {
                let want = dot(s.q.head(qh), deq.k.row(qh / group, t)) / (d as f64).sqrt();
                worst = worst.max(rel(scores[qh * s.k.tokens + t], want, 1e-2));
            }
        }
        assert!(
            worst < 1e-5,
            "span {span}: worst relative score difference {worst}"
        );
    }
}

#[test]
fn rotating_the_query_back_equals_rotating_the_key() {
    // q·RoPE_t(k̂) = RoPE_{−t}(q)·k̂ for the pre-RoPE reconstruction k̂: the codebook never sees RoPE.
    let spec = small_scheme("head");
    let cb = train(&spec, &layer(256, 1), 5);
    let s = layer(300, 2);
    let cache = CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &cb).unwrap();
    let deq = cache.dequantize();
    let q = s.q.head(0);
    for t in cache.k().regions().quantized().step_by(17) {
        let mut pre = deq.k.row(0, t).to_vec();
        s.rope.unapply(&mut pre, t);
        let mut q_back = q.to_vec();
        s.rope.unapply(&mut q_back, t);
        let (a, b) = (dot(q, deq.k.row(0, t)), dot(&q_back, &pre));
        assert!(rel(a, b, 1e-2) < 1e-5, "token {t}: {a} vs {b}");
    }
}

#[test]
fn reordered_values_and_attention_match_the_dequantized_path() {
    for span in ["head", "token"] {
        let spec = small_scheme(span);
        let cb = train(&spec, &layer(256, 1), 5);
        let s = layer(300, 2);
        let cache = CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &cb).unwrap();
        let deq = cache.dequantize();
        let probs = attention::probabilities(&s.q, &deq.k, &deq.k_quantized, None).unwrap();
        let fast = cache.weighted_values(&probs, s.q.q_heads).unwrap();
        let slow = attention::weighted_values(&probs, s.q.q_heads, &deq.v);
        assert!(
            attention::relative_error(&fast, &slow) < 1e-5,
            "span {span}"
        );
        let fast = cache.attend(&s.q).unwrap();
        let slow = attention::decode(&s.q, &deq, None).unwrap();
        assert!(
            attention::relative_error(&fast, &slow) < 1e-5,
            "span {span}"
        );
    }
}

#[test]
fn fp16_regions_hold_rounded_originals_and_pages_are_flagged() {
    let spec = small_scheme("head");
    let cb = train(&spec, &layer(256, 1), 5);
    let s = layer(300, 2);
    let cache = CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &cb).unwrap();
    let deq = cache.dequantize();
    // 300 tokens: 4 sink, then whole pages of 64 leaving at least 32 local: 4 pages (4..260), tail 40.
    assert_eq!(cache.k().regions().quantized(), 4..260);
    for t in 0..300 {
        assert_eq!(deq.k_quantized[t], (4..260).contains(&t));
        if !(4..260).contains(&t) {
            for h in 0..2 {
                let round = |x: &[f32]| {
                    x.iter()
                        .map(|v| f16::from_f32(*v).to_f32())
                        .collect::<Vec<_>>()
                };
                assert_eq!(deq.k.row(h, t), round(s.k.row(h, t)).as_slice());
                assert_eq!(deq.v.row(h, t), round(s.v.row(h, t)).as_slice());
            }
        }
    }
    assert!(deq.k.data.iter().chain(&deq.v.data).all(|x| x.is_finite()));
}

#[test]
fn queries_of_the_wrong_shape_are_rejected() {
    let spec = small_scheme("head");
    let cb = train(&spec, &layer(256, 1), 5);
    let s = layer(128, 2);
    let cache = CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &cb).unwrap();
    let q = Queries {
        data: vec![0.0; 3 * 64],
        q_heads: 3,
        head_dim: 64,
    };
    assert!(cache.scores(&q).is_err());
    assert!(cache.weighted_values(&[0.0; 7], 2).is_err());
}
