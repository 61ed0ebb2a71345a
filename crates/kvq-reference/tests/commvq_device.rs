//! The CommVQ device layout (`kvq-codebook-layout-1`): one block per (page, KV head) holding the
//! reference's bits, FP16 sink/tail buffers, flat codebook tensors — and attention computed from those
//! arrays alone equals `CommVqCache::attend`.

use half::f16;
use kvq_reference::attention::{relative_error, Queries};
use kvq_reference::commvq::device::{block_rope_code, TokenSlot};
use kvq_reference::commvq::layout::unpack_stream;
use kvq_reference::commvq::{
    self, device_attend, CalibrationData, Codebooks, Coding, CommVqCache, DeviceCodebooks,
    DeviceLayout, DeviceSequence, SideKind, TensorCodebook, TrainOptions, DEVICE_LAYOUT_VERSION,
};
use kvq_reference::synth::{generate, SynthConfig, SynthKv};
use kvq_reference::RefError;
use kvq_spec::SchemeSpec;

/// The built-ins (`kvq::schemes::CommVq2`, `CommVq1`; kvq-reference does not depend on kvq).
const COMMVQ2: &str = concat!(
    "k = codebook(rope_commutative, levels = 64, residuals = 21, pairs_per_code = 64, span = token), ",
    "v = codebook(additive, rows = 256)"
);
const COMMVQ1: &str = concat!(
    "k = codebook(rope_commutative, levels = 64, residuals = 10, pairs_per_code = 64, span = token), ",
    "v = codebook(additive, rows = 128)"
);

/// RoPE keys and additive values with a sink, pages of 32 and a local window of 16.
fn custom(k_span: &str, extra: &str) -> String {
    format!(
        "k = codebook(rope_commutative, levels = 16, residuals = 3, pairs_per_code = 32, span = {k_span}), \
         v = codebook(additive, rows = 64), sink = 4, local = 16, page = 32{extra}"
    )
}

/// 2 KV heads, GQA 4.
fn layer(tokens: usize, head_dim: usize, seed: u64) -> SynthKv {
    generate(&SynthConfig {
        tokens,
        kv_heads: 2,
        gqa: 4,
        head_dim,
        d_model: 256,
        seed,
        ..Default::default()
    })
}

/// Quick codebooks (TrainOptions::quick): the layout does not care how good they are.
fn train(spec: &SchemeSpec, s: &SynthKv) -> Codebooks {
    let options = TrainOptions::quick(7);
    let data = CalibrationData {
        k_pre_rope: &s.k_pre_rope,
        v: &s.v,
        rope: s.rope,
    };
    commvq::train_with(spec, &data, &options).unwrap()
}

fn cache_of(spec: &SchemeSpec, cb: &Codebooks, s: &SynthKv, len: usize) -> CommVqCache {
    let mut s = s.clone();
    s.truncate(len);
    CommVqCache::build(spec, &s.k_pre_rope, &s.v, s.rope, cb).unwrap()
}

/// The first query head of every KV head: GQA 1.
fn gqa1(q: &Queries, kv_heads: usize) -> Queries {
    let group = q.q_heads / kv_heads;
    Queries {
        data: (0..kv_heads)
            .flat_map(|h| q.head(h * group).iter().copied())
            .collect(),
        q_heads: kv_heads,
        head_dim: q.head_dim,
    }
}

/// `device_attend` on the cache's device arrays against `CommVqCache::attend`, per query head, at
/// GQA 4 and GQA 1.
fn assert_device_matches(cache: &CommVqCache, q: &Queries, label: &str) {
    let layout = cache.device_layout().unwrap();
    let seq = cache.device_sequence().unwrap();
    let books = cache.device_codebooks().unwrap();
    let d = cache.head_dim();
    for q in [q.clone(), gqa1(q, cache.kv_heads())] {
        let got = device_attend(&layout, &seq, &books, cache.rope(), &q).unwrap();
        let want = cache.attend(&q).unwrap();
        for qh in 0..q.q_heads {
            let range = qh * d..(qh + 1) * d;
            let err = relative_error(&got[range.clone()], &want[range]);
            assert!(
                err < 1e-5,
                "{label}, {} tokens, {} query heads, head {qh}: relative error {err}",
                cache.tokens(),
                q.q_heads
            );
        }
    }
}

/// Trains `text` at `head_dim` and checks every length.
fn check_scheme(text: &str, head_dim: usize, lengths: &[usize]) {
    let spec = SchemeSpec::parse(text).unwrap();
    let s = layer(
        lengths.iter().copied().max().unwrap_or(1).max(160),
        head_dim,
        3,
    );
    let cb = train(&spec, &s);
    for &len in lengths {
        let cache = cache_of(&spec, &cb, &s, len);
        assert_device_matches(&cache, &s.q, &format!("`{text}` at head_dim {head_dim}"));
    }
}

#[test]
fn device_attention_equals_reference_for_builtin_commvq1_and_commvq2() {
    // Page 128, no sink, no local: 100 tokens are all tail, 256 fill two pages with an empty tail,
    // 300 leave a tail of 44.
    for text in [COMMVQ1, COMMVQ2] {
        check_scheme(text, 128, &[100, 256, 300]);
    }
}

#[test]
fn device_attention_equals_reference_with_sink_pages_and_tail_at_head_dim_64_and_128() {
    // Sink 4, local 16, page 32: 3 tokens fill part of the sink; 40 have no coded page; 52 one page
    // and a tail of 16; 151 four pages and a tail of 19.
    for head_dim in [64, 128] {
        for span in ["head", "token"] {
            check_scheme(&custom(span, ""), head_dim, &[3, 40, 52, 151]);
        }
    }
}

#[test]
fn device_attention_equals_reference_with_an_empty_tail() {
    // local = 0: 100 = 4 + 3·32 tokens leave no tail token at all; 37 leave one.
    let text = custom("head", "").replace("local = 16", "local = 0");
    for head_dim in [64, 128] {
        check_scheme(&text, head_dim, &[36, 37, 100]);
    }
    let spec = SchemeSpec::parse(&text).unwrap();
    let layout = DeviceLayout::new(&spec, 2, 64).unwrap();
    let r = layout.k.regions(100);
    assert_eq!((r.pages, r.tail().len()), (3, 0));
}

#[test]
fn device_attention_equals_reference_with_fp16_sides_additive_keys_and_calibration() {
    let texts = [
        custom("head", ", calibrate = calibrate(tau1 = 0.5, tau2 = 0.25)"),
        "k = codebook(rope_commutative, levels = 16, residuals = 3, pairs_per_code = 32), v = fp16, \
         sink = 4, local = 16, page = 32"
            .into(),
        "k = codebook(additive, rows = 64), v = fp16, sink = 4, local = 16, page = 32".into(),
        "k = fp16, v = codebook(additive, rows = 64), sink = 4, local = 16, page = 32".into(),
        "k = codebook(additive, rows = 128), v = codebook(additive, rows = 64), page = 32".into(),
    ];
    for text in &texts {
        check_scheme(text, 64, &[3, 40, 151]);
    }
}

/// Code `i` of a little-endian stream of `w`-bit codes, read bit by bit (independently of the crate).
fn read_code(words: &[u32], w: usize, i: usize) -> u32 {
    (0..w)
        .map(|b| ((words[(i * w + b) / 32] >> ((i * w + b) % 32)) & 1) << b)
        .sum()
}

fn le_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn le_halves(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect()
}

#[test]
fn device_blocks_hold_the_reference_code_bits_scales_and_fp16_rows() {
    for span in ["head", "token"] {
        let spec = SchemeSpec::parse(&custom(span, "")).unwrap();
        let s = layer(160, 64, 3);
        let cache = cache_of(&spec, &train(&spec, &s), &s, 151);
        let (layout, seq) = (
            cache.device_layout().unwrap(),
            cache.device_sequence().unwrap(),
        );
        let (k, v, h, page) = (cache.k(), cache.v(), 2, 32);
        let SideKind::Rope {
            residuals,
            groups,
            code_bits,
            stream_words,
            ..
        } = layout.k.kind
        else {
            panic!("keys are RoPE-coded: {:?}", layout.k.kind);
        };
        let (w, pages) = (code_bits as usize, k.regions().pages);
        assert_eq!((pages, seq.k.pages, seq.v.pages), (4, 4, 4));
        for p in 0..pages {
            for head in 0..h {
                let kb = &seq.k.blocks[layout.block_range(&layout.k, p, head)];
                // Codes: docs/CODEBOOKS.md §2's word_base, read from the reference's page-major words.
                for group in 0..groups {
                    for r in 0..residuals {
                        let base = p * k.layout().code_words
                            + ((head * groups + group) * residuals + r) * stream_words;
                        let stream = &k.codes()[base..base + stream_words];
                        for i in 0..page {
                            let code = read_code(stream, w, i) as usize;
                            let want = (
                                (code >> (w / 2)) as u32,
                                (code & ((1 << (w / 2)) - 1)) as u32,
                            );
                            assert_eq!(block_rope_code(&layout.k, kb, group, r, i), Some(want));
                            assert_eq!(unpack_stream(stream, code_bits, i), Some(code as u32));
                        }
                    }
                }
                let per_head = groups * residuals * stream_words;
                let at = p * k.layout().code_words + head * per_head;
                assert_eq!(
                    le_words(&kb[layout.k.codes.range()]),
                    &k.codes()[at..at + per_head]
                );
                // Scales: span = token repeats the token's one scale in every head's block.
                let vector = if span == "head" { head } else { 0 };
                let at = p * k.layout().scales + vector * page;
                assert_eq!(
                    le_halves(&kb[layout.k.scales.range()]),
                    &k.scales()[at..at + page]
                );
                // Values: book `head`'s [word][token] codes, then its factors.
                let vb = &seq.v.blocks[layout.block_range(&layout.v, p, head)];
                let words = 64 / 32 * page;
                let at = p * v.layout().code_words + head * words;
                assert_eq!(
                    le_words(&vb[layout.v.codes.range()]),
                    &v.codes()[at..at + words]
                );
                let at = p * v.layout().scales + head * page;
                assert_eq!(
                    le_halves(&vb[layout.v.scales.range()]),
                    &v.scales()[at..at + page]
                );
            }
        }
        // FP16 tokens: sink 0..4 and the 19 tail tokens 132..151 at ring slots 32..48 and 0..3; the
        // rest zero.
        for (side, t, stored) in [(&layout.k, &seq.k, k), (&layout.v, &seq.v, v)] {
            assert_eq!((side.sink, side.tail_cap), (4, 48));
            let mut used_sink = vec![false; t.sink.len()];
            let mut used_tail = vec![false; t.tail.len()];
            for head in 0..h {
                for tok in (0..4).chain(132..151) {
                    let want: Vec<u16> = stored
                        .fp16_row(head, tok, 64)
                        .iter()
                        .map(|x| f16::from_f32(*x).to_bits())
                        .collect();
                    let (buf, used, range) = match side.locate(151, tok) {
                        TokenSlot::Sink(row) => {
                            (&t.sink, &mut used_sink, layout.sink_row(side, head, row))
                        }
                        TokenSlot::Tail(slot) => {
                            // Slots count from the sink's end, not from the tail's start.
                            assert_eq!(slot, (tok - 4) % 48);
                            (&t.tail, &mut used_tail, layout.tail_row(side, head, slot))
                        }
                        other => panic!("token {tok} located in {other:?}"),
                    };
                    assert_eq!(&buf[range.clone()], &want[..], "token {tok}");
                    used[range].iter_mut().for_each(|u| *u = true);
                }
            }
            let unused_zero =
                |buf: &[u16], used: &[bool]| buf.iter().zip(used).all(|(x, u)| *u || *x == 0);
            assert!(unused_zero(&t.sink, &used_sink) && unused_zero(&t.tail, &used_tail));
            assert!(used_tail.iter().any(|u| !u), "the ring has unused slots");
        }
    }
}

#[test]
fn fp16_sides_store_every_token_in_zero_padded_pages() {
    let spec = SchemeSpec::parse("k = fp16, v = codebook(additive, rows = 64), page = 32").unwrap();
    let s = layer(160, 64, 3);
    let cache = cache_of(&spec, &train(&spec, &s), &s, 40);
    let (layout, seq) = (
        cache.device_layout().unwrap(),
        cache.device_sequence().unwrap(),
    );
    assert_eq!(layout.k.kind, SideKind::Fp16);
    assert_eq!((seq.k.pages, layout.k.block_bytes), (2, 32 * 64 * 2));
    assert!(seq.k.sink.is_empty() && seq.k.tail.is_empty());
    for head in 0..2 {
        for tok in 0..64 {
            let block = &seq.k.blocks[layout.block_range(&layout.k, tok / 32, head)];
            let row = le_halves(&block[(tok % 32) * 128..(tok % 32 + 1) * 128]);
            let want: Vec<u16> = if tok < 40 {
                cache
                    .k()
                    .fp16_row(head, tok, 64)
                    .iter()
                    .map(|x| f16::from_f32(*x).to_bits())
                    .collect()
            } else {
                vec![0; 64]
            };
            assert_eq!(row, want, "head {head} token {tok}");
        }
    }
}

#[test]
fn layout_offsets_are_the_documented_16_byte_aligned_sections() {
    assert_eq!(DEVICE_LAYOUT_VERSION, "kvq-codebook-layout-1");
    // CommVQ2 at D = 128, P = 128: 21 streams of 128 12-bit codes = 21·48 words; 128 f16 scales.
    let l = DeviceLayout::new(&SchemeSpec::parse(COMMVQ2).unwrap(), 8, 128).unwrap();
    assert_eq!((l.k.codes.offset, l.k.codes.bytes), (0, 21 * 48 * 4));
    assert_eq!(
        (l.k.scales.offset, l.k.scales.bytes, l.k.block_bytes),
        (4032, 256, 4288)
    );
    assert_eq!(l.k.tail_cap, 128);
    // 256 rows: 8 words × 128 tokens, then 128 f16 factors.
    assert_eq!(
        (l.v.codes.bytes, l.v.scales.offset, l.v.block_bytes),
        (4096, 4096, 4352)
    );
    // 2 levels (2-bit codes), one round, one group, P = 16: a 4-byte stream padded to 16.
    let tiny = SchemeSpec::parse(
        "k = codebook(rope_commutative, levels = 2, residuals = 1, pairs_per_code = 32), \
         v = fp16, page = 16, sink = 8, local = 5",
    )
    .unwrap();
    let l = DeviceLayout::new(&tiny, 2, 64).unwrap();
    assert_eq!(
        (l.k.codes.bytes, l.k.scales.offset, l.k.block_bytes),
        (4, 16, 48)
    );
    assert_eq!((l.k.sink, l.k.local, l.k.tail_cap), (8, 5, 21));
    assert_eq!(
        (l.v.rows.bytes, l.v.block_bytes, l.v.tail_cap),
        (16 * 64 * 2, 2048, 0)
    );
    for text in [COMMVQ1, COMMVQ2, &custom("head", ""), &custom("token", "")] {
        let l = DeviceLayout::new(&SchemeSpec::parse(text).unwrap(), 2, 128).unwrap();
        for side in [l.k, l.v] {
            for section in [side.rows, side.codes, side.scales] {
                assert_eq!(section.offset % 16, 0, "{text}");
            }
            assert_eq!(side.block_bytes % 16, 0, "{text}");
            assert!(side.scales.range().end <= side.block_bytes);
        }
    }
}

#[test]
fn device_codebooks_are_f16_pairs_and_exactly_scaled_rows() {
    let spec = SchemeSpec::parse(&custom("head", "")).unwrap();
    let s = layer(160, 64, 3);
    let cache = cache_of(&spec, &train(&spec, &s), &s, 151);
    let books = cache.device_codebooks().unwrap();
    let (Coding::Rope { codebook: kc, .. }, Coding::Additive(vc)) =
        (cache.k().coding(), cache.v().coding())
    else {
        panic!("codings");
    };
    assert_eq!(books.k_rope.len() * 2, kc.entries.len());
    for (packed, pair) in books.k_rope.iter().zip(kc.entries.chunks_exact(2)) {
        assert_eq!(f16::from_bits(*packed as u16).to_f32(), pair[0]);
        assert_eq!(f16::from_bits((*packed >> 16) as u16).to_f32(), pair[1]);
    }
    assert!(books.k_rows_scaled.is_empty() && books.k_mean.is_empty());
    assert_eq!(books.v_mean, vc.mean);
    let d = 64;
    for (n, x) in books.v_rows_scaled.iter().enumerate() {
        let (book, c) = (n / (64 * d), n % d);
        let exact = vc.table[n] as f64 * vc.channel_scale[book * d + c] as f64;
        assert_eq!(*x as f64, exact, "scaled row element {n}");
    }
}

#[test]
fn token_wide_additive_codebooks_are_refused_with_a_message_naming_them() {
    let text = custom("head", "").replace("rows = 64)", "rows = 64, span = token)");
    let spec = SchemeSpec::parse(&text).unwrap();
    let err = DeviceLayout::new(&spec, 2, 64).unwrap_err();
    let RefError::WrongEntryPoint(msg) = &err else {
        panic!("{err:?}");
    };
    assert!(
        msg.contains("span = token")
            && msg.contains("token-wide additive")
            && msg.contains("not in"),
        "{msg}"
    );
    // The reference still builds and attends such a cache; only its device form is refused.
    let s = layer(160, 64, 3);
    let cache = cache_of(&spec, &train(&spec, &s), &s, 100);
    assert!(cache.attend(&s.q).is_ok());
    assert!(matches!(
        cache.device_sequence(),
        Err(RefError::WrongEntryPoint(_))
    ));
    assert!(matches!(
        cache.device_codebooks(),
        Err(RefError::WrongEntryPoint(_))
    ));
}

#[test]
fn codebook_values_that_are_not_f16_exact_are_refused() {
    let spec = SchemeSpec::parse(&custom("head", "")).unwrap();
    let s = layer(160, 64, 3);
    let good = train(&spec, &s);
    // 0.1 has no exact f16; the reference stores f32 and would happily use it.
    let mut bad_key = good.clone();
    if let Some(TensorCodebook::RopeCommutative(c)) = &mut bad_key.k {
        c.entries[5] = 0.1;
    }
    let mut bad_value = good.clone();
    if let Some(TensorCodebook::Additive(c)) = &mut bad_value.v {
        c.table[7] = 0.1;
    }
    for (cb, what) in [
        (&bad_key, "key codebook value 5"),
        (&bad_value, "additive codebook value 7"),
    ] {
        let cache = cache_of(&spec, cb, &s, 100);
        assert!(cache.attend(&s.q).is_ok());
        let err = cache.device_codebooks().unwrap_err();
        let RefError::Mismatch(msg) = &err else {
            panic!("{err:?}");
        };
        assert!(
            msg.contains(what) && msg.contains("not exactly representable in f16"),
            "{msg}"
        );
    }
    assert!(cache_of(&spec, &good, &s, 100).device_codebooks().is_ok());
}

/// An edit of a sequence's or a layer's device arrays.
type Edit = Box<dyn Fn(&mut DeviceSequence, &mut DeviceCodebooks)>;

#[test]
fn device_attention_reads_the_device_arrays_and_checks_their_sizes() {
    let spec = SchemeSpec::parse(&custom("head", "")).unwrap();
    let s = layer(160, 64, 3);
    let cache = cache_of(&spec, &train(&spec, &s), &s, 151);
    let (layout, seq, books) = (
        cache.device_layout().unwrap(),
        cache.device_sequence().unwrap(),
        cache.device_codebooks().unwrap(),
    );
    let base = device_attend(&layout, &seq, &books, cache.rope(), &s.q).unwrap();
    // A changed key code, value factor, tail row or codebook tensor changes the output.
    let edits: Vec<(&str, Edit)> = vec![
        // Bit 1 of page 0's first key code (head 0, group 0, round 0, token 0).
        ("a key code bit", Box::new(|q, _| q.k.blocks[0] ^= 0b10)),
        ("a value factor", {
            // The low exponent bit of token 0's factor: the factor doubles or halves.
            let at = layout.v.scales.offset + 1;
            Box::new(move |q, _| q.v.blocks[at] ^= 0x04)
        }),
        (
            "a tail value",
            Box::new(|q, _| q.v.tail[3] = f16::from_f32(5.0).to_bits()),
        ),
        (
            "a key codebook entry",
            Box::new(|_, b| b.k_rope.iter_mut().for_each(|e| *e = e.rotate_left(16))),
        ),
        (
            "the value mean",
            Box::new(|_, b| b.v_mean.iter_mut().for_each(|m| *m += 1.0)),
        ),
    ];
    for (what, edit) in edits {
        let (mut q, mut b) = (seq.clone(), books.clone());
        edit(&mut q, &mut b);
        let out = device_attend(&layout, &q, &b, cache.rope(), &s.q).unwrap();
        assert!(
            relative_error(&out, &base) > 1e-6,
            "editing {what} changed nothing"
        );
    }
    let mut short = seq.clone();
    short.k.blocks.pop();
    assert!(matches!(
        device_attend(&layout, &short, &books, cache.rope(), &s.q),
        Err(RefError::Mismatch(_))
    ));
    let mut no_tail = seq.clone();
    no_tail.v.tail.clear();
    assert!(matches!(
        device_attend(&layout, &no_tail, &books, cache.rope(), &s.q),
        Err(RefError::Mismatch(_))
    ));
    let mut no_books = books.clone();
    no_books.k_rope.clear();
    assert!(matches!(
        device_attend(&layout, &seq, &no_books, cache.rope(), &s.q),
        Err(RefError::Mismatch(_))
    ));
    let odd = Queries {
        data: vec![0.0; 3 * 64],
        q_heads: 3,
        head_dim: 64,
    };
    assert!(matches!(
        device_attend(&layout, &seq, &books, cache.rope(), &odd),
        Err(RefError::Mismatch(_))
    ));
}
