//! Steps of several query tokens: causal rows equal one-token decode over each row's prefix, the
//! LSE is the log-sum-exp of the scores, and merged partial states equal the whole.

use kvq_reference::attention::{self, Queries};
use kvq_reference::int::IntCache;
use kvq_reference::step::{self, AttentionState, StepQueries};
use kvq_reference::{synth, Dequantized, KvTensor, RefError};
use kvq_spec::SchemeSpec;

const CALIBRATED: &str =
    "k = int(2, channel), v = int(2, token), sink = 8, local = 32, page = 32, \
                          calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)";
const PLAIN: &str = "k = int(4, channel), v = int(2, token), local = 32, page = 32";

fn cache(text: &str, tokens: usize, seed: u64) -> (SchemeSpec, Dequantized, Queries) {
    let spec = SchemeSpec::parse(text).unwrap();
    let s = synth::generate(&synth::SynthConfig {
        tokens,
        head_dim: 64,
        kv_heads: 2,
        gqa: 3,
        d_model: 96,
        seed,
        ..Default::default()
    });
    let kv = IntCache::build(&spec, &s.k, &s.v).unwrap().dequantize();
    (spec, kv, s.q)
}

fn prefix(t: &KvTensor, n: usize) -> KvTensor {
    let mut data = Vec::with_capacity(t.kv_heads * n * t.head_dim);
    for h in 0..t.kv_heads {
        for i in 0..n {
            data.extend_from_slice(t.row(h, i));
        }
    }
    KvTensor::new(data, t.kv_heads, n, t.head_dim).unwrap()
}

fn token_queries(q: &StepQueries, i: usize) -> Queries {
    Queries {
        data: q.token(i).to_vec(),
        q_heads: q.q_heads,
        head_dim: q.head_dim,
    }
}

#[test]
fn a_one_token_step_is_decode() {
    for text in [CALIBRATED, PLAIN] {
        let (spec, kv, q) = cache(text, 200, 1);
        let state = step::attend(&StepQueries::single(&q), &kv, spec.calibrate.as_ref()).unwrap();
        let decoded = attention::decode(&q, &kv, spec.calibrate.as_ref()).unwrap();
        assert_eq!(state.out, decoded, "{text}");
        assert!(state.lse.iter().all(|l| l.is_finite()));
    }
}

#[test]
fn each_query_token_sees_its_prefix() {
    for text in [CALIBRATED, PLAIN] {
        let (spec, kv, q) = cache(text, 150, 2);
        let q = StepQueries::repeat(&q, 5);
        let state = step::attend(&q, &kv, spec.calibrate.as_ref()).unwrap();
        for i in 0..q.q_len {
            let n = kv.k.tokens - q.q_len + i + 1;
            let seen = Dequantized {
                k: prefix(&kv.k, n),
                v: prefix(&kv.v, n),
                k_quantized: kv.k_quantized[..n].to_vec(),
            };
            let want =
                attention::decode(&token_queries(&q, i), &seen, spec.calibrate.as_ref()).unwrap();
            let got = &state.out[i * want.len()..(i + 1) * want.len()];
            assert_eq!(got, &want[..], "{text}: query token {i}");
        }
    }
}

#[test]
fn later_tokens_do_not_reach_earlier_rows() {
    let (spec, kv, q) = cache(CALIBRATED, 120, 3);
    let q = StepQueries::repeat(&q, 4);
    let before = step::attend(&q, &kv, spec.calibrate.as_ref()).unwrap();
    let mut changed = kv.clone();
    let last = kv.k.tokens - 1;
    for h in 0..kv.k.kv_heads {
        changed
            .k
            .row_mut(h, last)
            .iter_mut()
            .for_each(|x| *x += 3.0);
        changed
            .v
            .row_mut(h, last)
            .iter_mut()
            .for_each(|x| *x -= 5.0);
    }
    let after = step::attend(&q, &changed, spec.calibrate.as_ref()).unwrap();
    let row = q.q_heads * q.head_dim;
    assert_eq!(
        before.out[..3 * row],
        after.out[..3 * row],
        "rows before the last"
    );
    assert_eq!(before.lse[..3 * q.q_heads], after.lse[..3 * q.q_heads]);
    assert_ne!(before.out[3 * row..], after.out[3 * row..], "the last row");
}

#[test]
fn lse_is_the_log_sum_exp_of_the_scores() {
    let (_, kv, q) = cache(PLAIN, 90, 4);
    let q = StepQueries::repeat(&q, 3);
    let state = step::attend(&q, &kv, None).unwrap();
    let group = q.q_heads / kv.k.kv_heads;
    let scale = 1.0 / (kv.k.head_dim as f64).sqrt();
    for i in 0..q.q_len {
        let visible = kv.k.tokens - q.q_len + i + 1;
        for h in 0..q.q_heads {
            let sum: f64 = (0..visible)
                .map(|t| {
                    let s: f64 = q
                        .row(i, h)
                        .iter()
                        .zip(kv.k.row(h / group, t))
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    (s * scale).exp()
                })
                .sum();
            let got = state.lse[i * q.q_heads + h] as f64;
            assert!(
                (got - sum.ln()).abs() < 1e-5,
                "row {i} head {h}: {got} against {}",
                sum.ln()
            );
        }
    }
}

fn close(a: &AttentionState, b: &AttentionState, what: &str) {
    assert!(
        attention::relative_error(&a.out, &b.out) < 1e-6,
        "{what}: outputs"
    );
    for (x, y) in a.lse.iter().zip(&b.lse) {
        assert!((x - y).abs() < 1e-5, "{what}: lse {x} against {y}");
    }
}

#[test]
fn merged_parts_equal_the_whole() {
    for (n, text) in [CALIBRATED, PLAIN].iter().enumerate() {
        let (spec, kv, q) = cache(text, 160, 5 + n as u64);
        let q = StepQueries::repeat(&q, 6);
        let cal = spec.calibrate.as_ref();
        let whole = step::attend(&q, &kv, cal).unwrap();
        let t = kv.k.tokens;
        // Cuts at page edges and inside pages; the last part holds only some rows' tokens
        // (t − 3..t), one part is empty.
        for cuts in [vec![80], vec![0, 37, 96], vec![50, 50, 157], vec![t - 3]] {
            let mut edges = vec![0];
            edges.extend(&cuts);
            edges.push(t);
            let parts: Vec<AttentionState> = edges
                .windows(2)
                .map(|w| step::attend_part(&q, &kv, cal, w[0]..w[1]).unwrap())
                .collect();
            close(
                &step::merge(&parts).unwrap(),
                &whole,
                &format!("{text} cuts {cuts:?}"),
            );
            // The order of the parts does not matter.
            let reversed: Vec<AttentionState> = parts.into_iter().rev().collect();
            close(&step::merge(&reversed).unwrap(), &whole, "reversed");
        }
    }
}

#[test]
fn a_part_no_row_sees_is_empty() {
    let (_, kv, q) = cache(PLAIN, 64, 7);
    let q = StepQueries::repeat(&q, 4);
    // Token 63 is seen only by the last query token.
    let part = step::attend_part(&q, &kv, None, 63..64).unwrap();
    let rows = q.q_heads;
    assert!(part.lse[..3 * rows].iter().all(|l| *l == f32::NEG_INFINITY));
    assert!(part.out[..3 * rows * q.head_dim].iter().all(|x| *x == 0.0));
    assert!(part.lse[3 * rows..].iter().all(|l| l.is_finite()));
    // Merged with itself, an unseen row stays unseen.
    let m = step::merge(&[part.clone(), part]).unwrap();
    assert!(m.lse[..3 * rows].iter().all(|l| *l == f32::NEG_INFINITY));
}

#[test]
fn bad_steps_are_errors() {
    let (_, kv, q) = cache(PLAIN, 40, 8);
    let mismatch = |r: Result<AttentionState, RefError>| matches!(r, Err(RefError::Mismatch(_)));
    assert!(mismatch(step::attend(
        &StepQueries::repeat(&q, 0),
        &kv,
        None
    )));
    assert!(mismatch(step::attend(
        &StepQueries::repeat(&q, 41),
        &kv,
        None
    )));
    let mut short = StepQueries::repeat(&q, 2);
    short.data.pop();
    assert!(mismatch(step::attend(&short, &kv, None)));
    let two = StepQueries::repeat(&q, 2);
    assert!(mismatch(step::attend_part(&two, &kv, None, 30..41)));
    assert!(mismatch(step::merge(&[])));
    let a = step::attend(&two, &kv, None).unwrap();
    let b = step::attend(&StepQueries::repeat(&q, 3), &kv, None).unwrap();
    let e = step::merge(&[a, b]).unwrap_err().to_string();
    assert!(e.contains("merging a state"), "{e}");
}
