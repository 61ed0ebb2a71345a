//! The head_dim rule: every positive multiple of 16, with the boosted bound and the per-tensor
//! divisibility rules (token groups, RoPE pairs) still applied on top of it.

use kvq_spec::{SchemeSpec, ShapeError, HEAD_DIM_MULTIPLE, MAX_BOOSTED_HEAD_DIM};

fn parse(text: &str) -> SchemeSpec {
    text.parse()
        .unwrap_or_else(|e| panic!("`{text}` does not parse: {e:?}"))
}

#[test]
fn every_positive_multiple_of_16_and_nothing_else() {
    assert_eq!(HEAD_DIM_MULTIPLE, 16);
    for text in [
        "k = fp16, v = fp16",
        "k = int(2, channel), v = int(2, token), local = 128",
        "k = int(3, channel), v = int(3, token)",
        "k = int(1, channel), v = int(1, channel), sink = 32, local = 128",
        "k = int(8, channel, symmetric), v = int(8, channel, symmetric)",
    ] {
        let spec = parse(text);
        for d in 0..=1024u32 {
            let got = spec.check_shape(d, 8);
            if d > 0 && d % 16 == 0 {
                assert_eq!(got, Ok(()), "`{text}` at head_dim {d}");
            } else {
                assert_eq!(got, Err(ShapeError::HeadDim(d)), "`{text}` at head_dim {d}");
            }
        }
    }
}

#[test]
fn the_refusal_names_the_rule() {
    let spec = parse("k = int(2, channel), v = int(2, token)");
    assert_eq!(
        spec.check_shape(72, 8).unwrap_err().to_string(),
        "head_dim 72 is not supported: it must be a positive multiple of 16"
    );
    assert_eq!(spec.check_shape(0, 8), Err(ShapeError::HeadDim(0)));
    assert_eq!(spec.check_shape(8, 8), Err(ShapeError::HeadDim(8)));
}

#[test]
fn models_with_heads_of_80_and_112_channels_are_accepted() {
    // Phi-2 and StableLM (80), and the other widths the issue names, for every integer form.
    let kitty = parse(
        "k = int(2, channel, boost = boost(4, ratio = 0.125, by = magnitude)), \
         v = int(2, token, local = 128), sink = 32, page = 128",
    );
    for d in [16, 48, 80, 96, 112, 160, 176, 192, 208, 240, 256] {
        assert_eq!(kitty.check_shape(d, 8), Ok(()), "kitty at {d}");
    }
}

#[test]
fn the_boosted_bound_still_holds_at_multiples_of_16() {
    let kitty = parse("k = int(2, channel, boost = boost(4, ratio = 0.125)), v = fp16");
    assert_eq!(kitty.check_shape(MAX_BOOSTED_HEAD_DIM, 1), Ok(()));
    assert_eq!(
        kitty.check_shape(MAX_BOOSTED_HEAD_DIM + 16, 1),
        Err(ShapeError::BoostHeadDim {
            tensor: "k",
            head_dim: MAX_BOOSTED_HEAD_DIM + 16
        })
    );
    // A ratio that selects no channel of a narrow head is still refused, not rounded up.
    let tiny = parse("k = int(2, channel, boost = boost(4, ratio = 0.02)), v = fp16");
    assert!(matches!(
        tiny.check_shape(16, 1),
        Err(ShapeError::Boost { channels: 0, .. })
    ));
    assert_eq!(tiny.check_shape(48, 1), Ok(()));
}

#[test]
fn token_groups_and_rope_pairs_must_still_divide() {
    // Groups are multiples of 32 (grammar), so a group never divides 80 unless it is 80 itself,
    // which the grammar cannot spell: a grouped token axis is refused at 80, with its reason.
    let grouped = parse("k = fp16, v = int(2, token, group = 32)");
    assert_eq!(
        grouped.check_shape(80, 1).unwrap_err().to_string(),
        "v: token-axis `group = 32` does not divide head_dim 80"
    );
    assert_eq!(grouped.check_shape(96, 1), Ok(()));
    // Without a group, a token's scale covers the whole head: any multiple of 16 works.
    let whole = parse("k = fp16, v = int(2, token)");
    assert_eq!(whole.check_shape(80, 1), Ok(()));

    // 80 channels are 40 RoPE pairs: codes of 8 pairs divide them, codes of 16 do not.
    let eight = parse(
        "k = codebook(rope_commutative, levels = 4, residuals = 1, pairs_per_code = 8), v = fp16",
    );
    assert_eq!(eight.check_shape(80, 1), Ok(()));
    let sixteen = parse(
        "k = codebook(rope_commutative, levels = 4, residuals = 1, pairs_per_code = 16), v = fp16",
    );
    assert_eq!(
        sixteen.check_shape(80, 1),
        Err(ShapeError::Pairs {
            tensor: "k",
            pairs: 16,
            half: 40,
            head_dim: 80
        })
    );
}
