//! The integer/FP16 store at every head_dim that is a multiple of 16, in particular the ones that are
//! not a multiple of 32 (80, 112, 176, 208, …): code rows end in a zero-padded word, every section
//! and block stays 16-byte aligned, the stored bytes decode to exactly what quantizing each group
//! directly gives, and the footprint equals the bytes built.

use half::f16;
use kvq_reference::footprint;
use kvq_reference::int::{
    align, decode_page, select_boosted, IntCache, IntLayout, Quantizer, TensorStore, NOT_BOOSTED,
};
use kvq_reference::pack;
use kvq_reference::{KvTensor, RefError};
use kvq_spec::{Axis, Boost, BoostCriterion, IntQuant, SchemeSpec, ShapeError, TensorQuant};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DIMS: [usize; 11] = [16, 48, 80, 96, 112, 160, 176, 192, 208, 240, 256];

fn spec(text: &str) -> SchemeSpec {
    SchemeSpec::parse(text).unwrap_or_else(|e| panic!("`{text}`: {e:?}"))
}

fn random(kv_heads: usize, tokens: usize, head_dim: usize, seed: u64) -> KvTensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let data = (0..kv_heads * tokens * head_dim)
        .map(|i| rng.random_range(-3.0f32..3.0) * if i % head_dim == 5 { 10.0 } else { 1.0 })
        .collect();
    KvTensor::new(data, kv_heads, tokens, head_dim).unwrap()
}

fn int(bits: u8, axis: Axis, symmetric: bool, boost: Option<(u8, f32)>) -> IntQuant {
    IntQuant {
        bits,
        axis,
        group: None,
        symmetric,
        boost: boost.map(|(bits, ratio)| Boost {
            bits,
            ratio,
            by: BoostCriterion::Magnitude,
        }),
        local: None,
    }
}

/// Every width on both axes, and the boosts the grammar allows (base and high plane 1, 2 or 4 bits).
fn quantizers() -> Vec<IntQuant> {
    let mut out = Vec::new();
    for bits in [1, 2, 3, 4, 8] {
        for axis in [Axis::Channel, Axis::Token] {
            out.push(int(bits, axis, false, None));
        }
        if bits > 1 {
            // A symmetric code needs a sign and a magnitude: 2 bits at least.
            out.push(int(bits, Axis::Channel, true, None));
        }
    }
    for (base, high, ratio) in [(2, 4, 0.125), (2, 4, 0.25), (1, 2, 0.5), (4, 8, 0.25)] {
        out.push(int(base, Axis::Channel, false, Some((high, ratio))));
    }
    out
}

/// Words of a row of `d` codes: `ceil(d·w/32)` per plane (a 3-bit code is a 2-bit and a 1-bit plane).
fn expected_row_words(bits: u8, d: usize) -> usize {
    let plane = |w: usize| (d * w).div_ceil(32);
    match bits {
        3 => plane(2) + plane(1),
        b => plane(usize::from(b)),
    }
}

#[test]
fn every_section_is_16_byte_aligned_and_only_the_slot_table_pads() {
    for d in DIMS {
        for q in quantizers() {
            for page in [16, 32, 48, 128] {
                let l = IntLayout::new(&q, d, page).unwrap();
                let what = format!("{q:?} d{d} page {page}");
                assert_eq!(l.row_words, expected_row_words(q.bits, d), "{what}");
                assert_eq!(l.codes.bytes, page * 4 * l.row_words, "{what}");
                for s in l.sections() {
                    assert_eq!(s.offset % 16, 0, "{what}: {s:?}");
                }
                assert_eq!(l.block_bytes % 16, 0, "{what}");
                // Rows of a page are a multiple of 16 tokens, scales are 2·d or 2·page·(d/G)
                // bytes and the map d bytes: all multiples of 16 at d % 16 == 0, so only the
                // slot table (k bytes, last) is followed by padding.
                let slots = l.boost.map_or(0, |b| b.channels);
                assert_eq!(l.padding(), align(slots) - slots, "{what}");
            }
        }
    }
}

#[test]
fn row_sizes_at_80_and_112_are_pinned() {
    // (bits, words at d = 80, words at d = 112): the last word of a row is partly padding when
    // d·w is not a multiple of 32 (1-bit rows, and the 1-bit plane of 3-bit rows).
    for (bits, w80, w112) in [(1, 3, 4), (2, 5, 7), (3, 8, 11), (4, 10, 14), (8, 20, 28)] {
        for (d, words) in [(80, w80), (112, w112)] {
            let l = IntLayout::new(&int(bits, Axis::Channel, false, None), d, 128).unwrap();
            assert_eq!(l.row_words, words, "{bits}-bit d{d}");
            assert_eq!(pack::row_words(bits, d).unwrap(), words);
        }
    }
}

#[test]
fn kitty_page_at_head_dim_80() {
    // k = round(0.125 · 80) = 10 boosted channels; 2-bit rows of 80 codes are 5 words (20 B).
    let l = IntLayout::new(&int(2, Axis::Channel, false, Some((4, 0.125))), 80, 128).unwrap();
    let at = |s: kvq_reference::int::Section| (s.offset, s.bytes);
    assert_eq!(at(l.codes), (0, 2560));
    assert_eq!(at(l.high), (2560, 512));
    assert_eq!(at(l.scales), (3072, 160));
    assert_eq!(at(l.zeros), (3232, 160));
    assert_eq!(at(l.map), (3392, 80));
    assert_eq!(at(l.slots), (3472, 10));
    assert_eq!((l.block_bytes, l.padding()), (3488, 6));
    // V: 2-bit token axis, one scale/zero per token.
    let v = IntLayout::new(&int(2, Axis::Token, false, None), 80, 128).unwrap();
    assert_eq!(
        (at(v.codes), at(v.scales), at(v.zeros), v.block_bytes),
        ((0, 2560), (2560, 256), (2816, 256), 3072)
    );
}

/// The values of a page quantized group by group with [`Quantizer`] directly, without packing.
fn direct(q: &IntQuant, values: &[f32], page: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; values.len()];
    match q.axis {
        Axis::Token => {
            let quant = Quantizer::new(q.bits, q.symmetric).unwrap();
            let g = q.group.map_or(d, |g| g as usize);
            for (x, o) in values.chunks_exact(g).zip(out.chunks_exact_mut(g)) {
                let p = quant.params(x).unwrap();
                for (v, r) in x.iter().zip(o) {
                    *r = quant.decode(quant.encode(*v, p), p);
                }
            }
        }
        Axis::Channel => {
            let boosted = match q.boost {
                Some(b) => {
                    let k = kvq_reference::int::boosted_channels(b.ratio, d);
                    select_boosted(values, page, d, k, b.by)
                }
                None => vec![false; d],
            };
            for c in 0..d {
                let bits = match q.boost {
                    Some(b) if boosted[c] => b.bits,
                    _ => q.bits,
                };
                let quant = Quantizer::new(bits, q.symmetric).unwrap();
                let column: Vec<f32> = (0..page).map(|t| values[t * d + c]).collect();
                let p = quant.params(&column).unwrap();
                for (t, v) in column.iter().enumerate() {
                    out[t * d + c] = quant.decode(quant.encode(*v, p), p);
                }
            }
        }
    }
    out
}

/// Checks one built store against direct quantization: pages bit-exact, FP16 windows f16-exact,
/// the padding bits of every row's last word zero.
fn check_store(store: &TensorStore, x: &KvTensor) {
    let d = x.head_dim;
    let deq = store.dequantize();
    let TensorQuant::Int(q) = *store.quant() else {
        for (a, b) in x.data.iter().zip(&deq.data) {
            assert_eq!(f16::from_f32(*a).to_f32(), *b);
        }
        return;
    };
    let l = store.layout().expect("int layout");
    let page = store.page();
    for head in 0..x.kv_heads {
        for t in 0..x.tokens {
            let row = deq.row(head, t);
            if !store.is_quantized(t) {
                for (a, b) in x.row(head, t).iter().zip(row) {
                    assert_eq!(f16::from_f32(*a).to_f32(), *b, "d{d} t{t}");
                }
            }
        }
        for p in 0..store.pages() {
            let block = store.block(p, head).unwrap();
            let tokens = store.regions().unwrap().page_tokens(p);
            let values = &x.head(head)[tokens.start * d..tokens.end * d];
            let want = direct(&q, values, page, d);
            let got = &deq.head(head)[tokens.start * d..tokens.end * d];
            assert_eq!(got, &want[..], "d{d} {q:?} page {p}");
            assert_eq!(decode_page(l, block).unwrap(), want);
            // Unused bits of each plane's last word are zero (LAYOUT.md §1).
            for t in 0..page {
                let at = l.codes.offset + t * l.row_words * 4;
                let words = pack::read_words(&block[at..at + l.row_words * 4]).unwrap();
                let mut start = 0;
                for &w in pack::planes(q.bits).unwrap() {
                    let n = pack::plane_words(w, d);
                    let used = d * usize::from(w) - 32 * (n - 1);
                    if used < 32 {
                        assert_eq!(words[start + n - 1] >> used, 0, "d{d} {q:?} row {t}");
                    }
                    start += n;
                }
            }
            if let Some(b) = l.boost {
                let map = &block[l.map.range()];
                assert_eq!(
                    map.iter().filter(|&&s| s != NOT_BOOSTED).count(),
                    b.channels
                );
            }
        }
    }
}

fn schemes() -> Vec<&'static str> {
    vec![
        "k = fp16, v = fp16, page = 16",
        "k = int(1, channel), v = int(1, channel), sink = 5, local = 16, page = 16",
        "k = int(2, channel), v = int(2, token), local = 32, page = 32",
        "k = int(3, channel), v = int(3, token), page = 16",
        "k = int(4, channel), v = int(4, token), sink = 5, local = 7, page = 16",
        "k = int(8, channel, symmetric), v = int(8, channel, symmetric), page = 16",
        "k = int(4, token, symmetric), v = int(2, token, symmetric), page = 16",
        "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 16), sink = 4, page = 16",
        "k = int(1, channel, boost = boost(2, ratio = 0.5, by = variance)), v = fp16, page = 16",
        "k = int(4, channel, boost = boost(8, ratio = 0.25)), v = int(1, token), page = 32",
    ]
}

#[test]
fn stores_round_trip_at_every_multiple_of_16() {
    for (i, text) in schemes().into_iter().enumerate() {
        let s = spec(text);
        for (j, d) in DIMS.into_iter().enumerate() {
            if let Err(e) = s.check_shape(d as u32, 2) {
                // Only a boost too narrow to select a channel of 16 may be refused.
                assert!(
                    matches!(e, ShapeError::Boost { channels: 0, .. }) && d == 16,
                    "`{text}` d{d}: {e}"
                );
                continue;
            }
            for tokens in [0, 1, 37, 100] {
                let seed = (i * 100 + j * 10 + tokens) as u64;
                let k = random(2, tokens, d, seed);
                let v = random(2, tokens, d, seed ^ 1);
                let cache = IntCache::build(&s, &k, &v).unwrap();
                check_store(cache.k(), &k);
                check_store(cache.v(), &v);
                let f = footprint::scheme(&s, d as u32, 2, tokens as u64).unwrap();
                assert_eq!(
                    f.total_bytes(),
                    cache.allocated_bytes() as u64,
                    "`{text}` d{d}"
                );
                assert_eq!(f.k.bytes(), cache.k().allocated_bytes() as u64);
                assert_eq!(f.v.bytes(), cache.v().allocated_bytes() as u64);
            }
        }
    }
}

#[test]
fn a_head_dim_off_the_grid_is_refused_with_its_reason() {
    let s = spec("k = int(2, channel), v = int(2, token)");
    for d in [8, 40, 72, 100] {
        let x = random(1, 4, d, 0);
        match IntCache::build(&s, &x, &x) {
            Err(RefError::Shape(ShapeError::HeadDim(got))) => assert_eq!(got as usize, d),
            other => panic!("d{d}: {other:?}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Pack → unpack of rows of any multiple-of-16 length is the identity, padding zero.
    #[test]
    fn rows_of_any_multiple_of_16_round_trip(
        bits in prop::sample::select(vec![1u8, 2, 3, 4, 8]),
        sixteens in 1usize..=16,
        seed in any::<u64>(),
    ) {
        let n = 16 * sixteens;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let codes: Vec<u8> = (0..n).map(|_| rng.random_range(0..(1u16 << bits)) as u8).collect();
        let words = pack::pack_row(&codes, bits).unwrap();
        prop_assert_eq!(words.len(), expected_row_words(bits, n));
        prop_assert_eq!(pack::unpack_row(&words, bits, n).unwrap(), codes);
    }
}
