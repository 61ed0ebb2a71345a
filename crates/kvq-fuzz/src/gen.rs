//! Seeded input generators: grammar-aware scheme text, well-formed and broken safetensors files,
//! and byte-level mutations of a seed corpus. The same seed gives the same inputs.

use rand::Rng;
use serde_json::{json, Map, Value};

/// Scheme texts every run starts from: each built-in's canonical text, the examples of
/// docs/GRAMMAR.md as written there (multi-line, positional arguments), and a few variants.
pub fn scheme_corpus() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = kvq::schemes::BUILTIN
        .iter()
        .map(|b| b.spec.to_string().into_bytes())
        .collect();
    for text in [
        "k = fp16, v = fp16",
        "k = int(2, channel), v = int(2, token), local = 128",
        "k = int(2, channel, boost = boost(4, ratio = 0.125, by = magnitude)),\nv = int(2, token, local = 128),\nsink = 32,\npage = 128",
        "k = int(1, channel),\nv = int(1, channel),\nsink = 32,\nlocal = 128,\ncalibrate = calibrate(tau1 = -1.5, tau2 = 3.25)",
        "k = int(8, channel, symmetric), v = int(8, channel, symmetric)",
        "k = codebook(rope_commutative, levels = 64, residuals = 21, pairs_per_code = 64, span = token),\nv = codebook(additive, rows = 256)",
        "k = int(2, channel), v = int(2, token), source = x(latent)",
        "k = int(2, channel), v = int(2, token), source = x(cross_layer)",
        "k = codebook(additive, rows = 512, span = token), v = int(4, token, group = 32, symmetric)",
        "k = int(2, channel, boost = boost(2, ratio = 0.125)), v = int(2, token)",
        "k = int(2, token, group = 24), v = fp16",
        "k = fp16, v = int(2, token), calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)",
        "k = int(bits = 3, axis = token, group = 64), v = int(4, channel, group = 32), page = 32",
        "k = int(2, channel, boost = boost(bits = 6, ratio = 0.5, by = variance)), v = fp16, page = 16",
        "k = codebook(additive, rows = 32), v = codebook(additive, rows = 64, span = token), page = 16",
    ] {
        out.push(text.as_bytes().to_vec());
    }
    out
}

const KEYS: &[&str] = &[
    "k",
    "v",
    "page",
    "sink",
    "local",
    "calibrate",
    "source",
    "bits",
    "axis",
    "group",
    "symmetric",
    "boost",
    "ratio",
    "by",
    "rope_commutative",
    "levels",
    "residuals",
    "pairs_per_code",
    "additive",
    "rows",
    "span",
    "tau1",
    "tau2",
];

const WORDS: &[&str] = &[
    "fp16",
    "int",
    "codebook",
    "channel",
    "token",
    "magnitude",
    "variance",
    "head",
    "x",
    "kv",
    "latent",
    "cross_layer",
    "true",
    "false",
    "calibrate",
    "boost",
    "symmetric",
    "additive",
    "rope_commutative",
    "inf",
    "nan",
    "NaN",
    "_",
    "a",
    "K",
    "V",
];

/// Numbers at and past every limit of the grammar, and spellings the lexer must refuse.
const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "1",
    "-1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "8",
    "9",
    "16",
    "24",
    "31",
    "32",
    "48",
    "64",
    "96",
    "128",
    "256",
    "512",
    "1024",
    "4096",
    "65536",
    "65537",
    "1048576",
    "1048577",
    "1048592",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "4294967312",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999999",
    "1e20",
    "1e-400",
    "1e400",
    "-1e400",
    "1e308",
    "2e-45",
    "1e-45",
    "0.125",
    ".25",
    "0.5",
    "0.999999999",
    "1.0000001",
    "0.0000001",
    "1_000",
    "1__0",
    "_1",
    "1_",
    "1e",
    "1e+",
    "1.",
    "-.5",
    "+3",
    "--1",
    "0x10",
    "0.5f32",
    "1e-3",
    "128.0",
    "1.28e2",
    "16e0",
    "NaN",
    "inf",
    "-10000",
    "10000",
    "10000.0001",
    "-10000.0001",
    "3.4028235e38",
    "3.4028236e38",
];

/// Numbers a valid scheme takes somewhere (pages, windows, groups).
const PLAUSIBLE: &[&str] = &[
    "0", "16", "32", "64", "128", "256", "1", "2", "4", "8", "100", "1024",
];

fn plausible<R: Rng>(rng: &mut R) -> String {
    if rng.random_bool(0.8) {
        pick(rng, PLAUSIBLE).to_string()
    } else {
        number(rng)
    }
}

/// A `k`/`v` value, valid more often than not.
fn tensor<R: Rng>(rng: &mut R) -> String {
    match rng.random_range(0..100) {
        0..=39 => int_call(rng, 1),
        40..=57 => codebook_call(rng, 1),
        58..=79 => "fp16".into(),
        _ => value(rng, 1),
    }
}

/// Punctuation and separators, to break the structure.
const PUNCT: &[&str] = &[
    "(", ")", ",", "=", " ", "\n", "\t", "\r\n", "", "((", "))", ",,", "==", "é", "\u{0}",
    "\u{feff}",
];

fn pick<'a, R: Rng>(rng: &mut R, xs: &[&'a str]) -> &'a str {
    xs[rng.random_range(0..xs.len())]
}

fn number<R: Rng>(rng: &mut R) -> String {
    if rng.random_bool(0.8) {
        pick(rng, NUMBERS).to_string()
    } else {
        match rng.random_range(0..4) {
            0 => rng.random_range(0..2048u32).to_string(),
            1 => (16 * rng.random_range(0..70000u32)).to_string(),
            2 => format!("{}", rng.random::<f32>()),
            _ => format!(
                "{:e}",
                rng.random::<f64>() * 10f64.powi(rng.random_range(-400..400))
            ),
        }
    }
}

/// A plausible value: mostly the shapes the grammar takes, with wrong ones mixed in.
fn value<R: Rng>(rng: &mut R, depth: u32) -> String {
    let r = rng.random_range(0..100);
    if depth > 3 || r < 25 {
        return if rng.random_bool(0.5) {
            number(rng)
        } else {
            pick(rng, WORDS).to_string()
        };
    }
    match r {
        25..=44 => int_call(rng, depth),
        45..=54 => codebook_call(rng, depth),
        55..=62 => format!("calibrate(tau1 = {}, tau2 = {})", number(rng), number(rng)),
        63..=69 => format!("x({})", pick(rng, &["latent", "cross_layer", "kv", ""])),
        _ => {
            let n = rng.random_range(0..4);
            let args: Vec<String> = (0..n).map(|_| arg(rng, depth + 1)).collect();
            format!("{}({})", pick(rng, WORDS), args.join(", "))
        }
    }
}

fn arg<R: Rng>(rng: &mut R, depth: u32) -> String {
    if rng.random_bool(0.5) {
        format!("{} = {}", pick(rng, KEYS), value(rng, depth))
    } else {
        value(rng, depth)
    }
}

fn int_call<R: Rng>(rng: &mut R, depth: u32) -> String {
    let bits = pick(
        rng,
        &[
            "1", "2", "3", "4", "8", "2", "4", "2", "4", "5", "0", "bits = 2",
        ],
    );
    let axis = pick(
        rng,
        &[
            "channel",
            "token",
            "channel",
            "token",
            "axis = token",
            "axis = channel",
            "head",
        ],
    );
    let mut args = vec![bits.to_string(), axis.to_string()];
    for _ in 0..rng.random_range(0..3) {
        args.push(match rng.random_range(0..6) {
            0 => format!("group = {}", plausible(rng)),
            1 => "symmetric".into(),
            2 => format!(
                "symmetric = {}",
                pick(rng, &["true", "false", "1", "maybe"])
            ),
            3 => format!("local = {}", plausible(rng)),
            4 => format!(
                "boost = boost({}, ratio = {}, by = {})",
                pick(rng, &["3", "4", "6", "8", "2", "5"]),
                pick(
                    rng,
                    &[
                        "0.125",
                        "0.25",
                        "0.5",
                        "0.01",
                        "0.99",
                        "0",
                        "1",
                        "1e-400",
                        "NaN",
                        "0.0009765625"
                    ]
                ),
                pick(rng, &["magnitude", "variance", "size"])
            ),
            _ => arg(rng, depth + 1),
        });
    }
    format!("int({})", args.join(", "))
}

fn codebook_call<R: Rng>(rng: &mut R, depth: u32) -> String {
    let mut args = Vec::new();
    if rng.random_bool(0.5) {
        args.push("rope_commutative".to_string());
        args.push(format!(
            "levels = {}",
            pick(
                rng,
                &["2", "4", "16", "64", "256", "65536", "131072", "3", "1"]
            )
        ));
        args.push(format!(
            "residuals = {}",
            pick(rng, &["1", "2", "10", "21", "64", "65", "0"])
        ));
        args.push(format!(
            "pairs_per_code = {}",
            pick(
                rng,
                &["1", "2", "8", "16", "64", "128", "1024", "1025", "3"]
            )
        ));
    } else {
        args.push("additive".to_string());
        args.push(format!(
            "rows = {}",
            pick(
                rng,
                &["32", "64", "128", "256", "512", "1024", "65536", "65568", "33", "0"]
            )
        ));
    }
    if rng.random_bool(0.4) {
        args.push(format!("span = {}", pick(rng, &["head", "token", "page"])));
    }
    if rng.random_bool(0.1) {
        args.push(arg(rng, depth + 1));
    }
    format!("codebook({})", args.join(", "))
}

/// An integer tensor by the table's rules (packing widths, boost bits, channel groups = page).
fn valid_int<R: Rng>(rng: &mut R, boost_ok: bool, page: &mut Option<u32>) -> String {
    let bits = [1u32, 2, 3, 4, 8][rng.random_range(0..5)];
    let channel = rng.random_bool(0.5);
    let mut args = vec![
        bits.to_string(),
        if channel { "channel" } else { "token" }.to_string(),
    ];
    if channel {
        if rng.random_bool(0.2) {
            let g = [16u32, 32, 64, 128, 256][rng.random_range(0..5)];
            let g = page.unwrap_or(g);
            *page = Some(g);
            args.push(format!("group = {g}"));
        }
        if boost_ok && [1, 2, 4].contains(&bits) && rng.random_bool(0.4) {
            let extra = [1u32, 2, 4][rng.random_range(0..3)];
            let ratio = ["0.125", "0.25", "0.5", "0.03125", "0.9", "0.01"][rng.random_range(0..6)];
            let by = ["magnitude", "variance"][rng.random_range(0..2)];
            args.push(format!(
                "boost = boost({}, ratio = {ratio}, by = {by})",
                bits + extra
            ));
        }
    } else if rng.random_bool(0.3) {
        let width = match bits {
            1 | 3 => 32,
            2 => 16,
            4 => 8,
            _ => 4,
        };
        args.push(format!(
            "group = {}",
            width * [1u32, 2, 4, 8][rng.random_range(0..4)]
        ));
    }
    if bits != 1 && rng.random_bool(0.2) {
        args.push("symmetric".into());
    }
    if rng.random_bool(0.2) {
        args.push(format!(
            "local = {}",
            ["0", "16", "128", "100"][rng.random_range(0..4)]
        ));
    }
    format!("int({})", args.join(", "))
}

fn valid_codebook<R: Rng>(rng: &mut R, key: bool) -> String {
    let span = ["", ", span = head", ", span = token"][rng.random_range(0..3)];
    if key && rng.random_bool(0.6) {
        let levels = [2u32, 4, 16, 64, 256][rng.random_range(0..5)];
        let ppc = [1u32, 2, 4, 8, 16, 64][rng.random_range(0..6)];
        let log = levels.trailing_zeros();
        // residuals · log2(levels) / pairs_per_code below 16 bits per scalar.
        let most = ((16 * ppc - 1) / log).clamp(1, 64);
        let residuals = rng.random_range(1..=most.min(12));
        format!("codebook(rope_commutative, levels = {levels}, residuals = {residuals}, pairs_per_code = {ppc}{span})")
    } else {
        let rows = 32 * [1u32, 2, 4, 8, 16][rng.random_range(0..5)];
        format!("codebook(additive, rows = {rows}{span})")
    }
}

/// A scheme valid by construction (the grammar's rules followed), for the stages past the parser.
pub fn valid_scheme<R: Rng>(rng: &mut R) -> Vec<u8> {
    let mut page = None;
    let family = rng.random_range(0..10);
    let (k, v, source) = match family {
        0..=5 => {
            let t = |rng: &mut R, page: &mut Option<u32>| {
                if rng.random_bool(0.2) {
                    "fp16".to_string()
                } else {
                    valid_int(rng, true, page)
                }
            };
            (t(rng, &mut page), t(rng, &mut page), None)
        }
        6..=7 => {
            let k = if rng.random_bool(0.2) {
                "fp16".into()
            } else {
                valid_codebook(rng, true)
            };
            let v = if rng.random_bool(0.2) {
                "fp16".into()
            } else {
                valid_codebook(rng, false)
            };
            (k, v, None)
        }
        _ => (
            valid_int(rng, false, &mut page),
            valid_int(rng, false, &mut page),
            Some(["x(latent)", "x(cross_layer)"][rng.random_range(0..2)]),
        ),
    };
    let mut items = vec![format!("k = {k}"), format!("v = {v}")];
    // Now and then the grammar's largest values, which the reference must store or refuse.
    const PAGES: [u32; 12] = [16, 32, 64, 128, 256, 16, 32, 64, 128, 256, 4096, 1048576];
    let page = page.or_else(|| rng.random_bool(0.4).then(|| PAGES[rng.random_range(0..12)]));
    if let Some(p) = page {
        items.push(format!("page = {p}"));
    }
    if rng.random_bool(0.4) {
        items.push(format!(
            "sink = {}",
            [0u32, 1, 4, 32, 100, 0, 1, 4, 32, 1048576][rng.random_range(0..10)]
        ));
    }
    if rng.random_bool(0.4) {
        items.push(format!(
            "local = {}",
            [0u32, 16, 128, 200, 0, 16, 128, 1048576][rng.random_range(0..8)]
        ));
    }
    if k != "fp16" && rng.random_bool(0.2) {
        items.push(format!(
            "calibrate = calibrate(tau1 = {}, tau2 = {})",
            ["-1.5", "0", "0.6", "-10000"][rng.random_range(0..4)],
            ["3.25", "0.1", "10000", "-2"][rng.random_range(0..4)]
        ));
    }
    if let Some(s) = source {
        items.push(format!("source = {s}"));
    }
    items.join(", ").into_bytes()
}

/// Scheme text from the grammar: `k = …, v = …` and scheme-level keys, sometimes broken.
pub fn scheme_text<R: Rng>(rng: &mut R) -> Vec<u8> {
    if rng.random_bool(0.01) {
        return nested(rng);
    }
    if rng.random_bool(0.5) {
        return valid_scheme(rng);
    }
    let mut items = vec![
        format!("k = {}", tensor(rng)),
        format!("v = {}", tensor(rng)),
    ];
    for _ in 0..rng.random_range(0..4) {
        let key = pick(
            rng,
            &[
                "page",
                "sink",
                "local",
                "calibrate",
                "source",
                "page",
                "sink",
                "k",
            ],
        );
        let v = match key {
            "calibrate" => format!("calibrate(tau1 = {}, tau2 = {})", number(rng), number(rng)),
            "source" => pick(
                rng,
                &[
                    "kv",
                    "x(latent)",
                    "x(cross_layer)",
                    "x",
                    "x(latent, latent)",
                ],
            )
            .into(),
            "k" => tensor(rng),
            _ => plausible(rng),
        };
        items.push(format!("{key} = {v}"));
    }
    if rng.random_bool(0.05) {
        items.push(arg(rng, 1));
    }
    // Shuffle a little: the grammar takes items in any order.
    if rng.random_bool(0.3) {
        let i = rng.random_range(0..items.len());
        let j = rng.random_range(0..items.len());
        items.swap(i, j);
    }
    let sep = pick(rng, &[", ", ",", ",\n", " , "]);
    let mut text = items.join(sep);
    if rng.random_bool(0.1) {
        text.push(',');
    }
    if rng.random_bool(0.05) {
        let at = rng.random_range(0..=text.len());
        let at = (0..=at)
            .rev()
            .find(|i| text.is_char_boundary(*i))
            .unwrap_or(0);
        text.insert_str(at, pick(rng, PUNCT));
    }
    text.into_bytes()
}

/// Deeply nested calls (`k = a(a(…)), v = fp16`), up to 100,000 levels.
pub fn nested<R: Rng>(rng: &mut R) -> Vec<u8> {
    let depth = [50usize, 500, 2000, 5000, 20_000, 100_000][rng.random_range(0..6)];
    let word = pick(rng, &["a", "int", "boost", "x", "codebook"]);
    let keyed = rng.random_bool(0.3);
    let mut s = String::from("k = ");
    for _ in 0..depth {
        s.push_str(word);
        s.push('(');
        if keyed {
            s.push_str("b = ");
        }
    }
    for _ in 0..depth {
        s.push(')');
    }
    s.push_str(", v = fp16");
    s.into_bytes()
}

/// One byte-level mutation of `data`: insert, delete, duplicate, splice with `other`, flip,
/// replace a run with an interesting token.
pub fn mutate<R: Rng>(rng: &mut R, data: &mut Vec<u8>, other: &[u8]) {
    let len = data.len();
    let pos = |rng: &mut R, n: usize| if n == 0 { 0 } else { rng.random_range(0..=n) };
    match rng.random_range(0..9) {
        0 if len > 0 => {
            let i = rng.random_range(0..len);
            data[i] ^= 1 << rng.random_range(0..8);
        }
        1 => {
            let i = pos(rng, len);
            data.insert(i, rng.random());
        }
        2 if len > 0 => {
            let i = rng.random_range(0..len);
            let n = rng.random_range(1..=(len - i).min(16));
            data.drain(i..i + n);
        }
        3 if len > 0 => {
            let i = rng.random_range(0..len);
            let n = rng.random_range(1..=(len - i).min(32));
            let chunk: Vec<u8> = data[i..i + n].to_vec();
            let at = pos(rng, len);
            data.splice(at..at, chunk);
        }
        4 if !other.is_empty() => {
            let i = rng.random_range(0..other.len());
            let n = rng.random_range(1..=(other.len() - i));
            let at = pos(rng, len);
            let cut = rng.random_range(at..=len);
            data.splice(at..cut, other[i..i + n].iter().copied());
        }
        5 => {
            let token = match rng.random_range(0..3) {
                0 => number(rng),
                1 => pick(rng, WORDS).to_string(),
                _ => pick(rng, KEYS).to_string(),
            };
            let at = pos(rng, len);
            let cut = (at + rng.random_range(0..6)).min(len);
            data.splice(at..cut, token.bytes());
        }
        6 => {
            let at = pos(rng, len);
            data.splice(at..at, pick(rng, PUNCT).bytes());
        }
        7 if len > 0 => {
            let i = rng.random_range(0..len);
            data[i] = [
                b'(', b')', b',', b'=', b' ', 0xff, 0, b'9', b'.', b'e', b'-',
            ][rng.random_range(0..11)];
        }
        _ => data.truncate(rng.random_range(0..=len)),
    }
}

/// One scheme input: grammar text, or 1–8 mutations of a corpus entry (or of generated text).
pub fn scheme_input<R: Rng>(rng: &mut R, corpus: &[Vec<u8>]) -> Vec<u8> {
    let base = rng.random_range(0..10);
    let mut data = if base < 5 || corpus.is_empty() {
        scheme_text(rng)
    } else {
        corpus[rng.random_range(0..corpus.len())].clone()
    };
    if base < 4 {
        return data;
    }
    let other = if corpus.is_empty() {
        Vec::new()
    } else {
        corpus[rng.random_range(0..corpus.len())].clone()
    };
    let n = if rng.random_bool(0.5) {
        1
    } else {
        rng.random_range(2..=6)
    };
    for _ in 0..n {
        mutate(rng, &mut data, &other);
    }
    data
}

/// A tensor entry of a file being built: name, dtype, shape and its bytes.
struct Tensor {
    name: String,
    dtype: &'static str,
    shape: Vec<u64>,
    data: Vec<u8>,
}

fn elem_size(dtype: &str) -> usize {
    match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        _ => 1,
    }
}

/// Values of the given dtype: mostly ordinary numbers, sometimes NaN, infinities, f16 overflow.
fn values<R: Rng>(rng: &mut R, dtype: &str, n: usize) -> Vec<u8> {
    let special = rng.random_bool(0.1);
    let mut out = Vec::with_capacity(n * elem_size(dtype));
    for i in 0..n {
        let mut x: f32 = rng.random::<f32>() * 4.0 - 2.0;
        if special && i % 97 == 3 {
            x = [f32::NAN, f32::INFINITY, -f32::INFINITY, 70000.0, 1e-30, 0.0]
                [rng.random_range(0..6)];
        }
        match dtype {
            "F16" => out.extend(half::f16::from_f32(x).to_bits().to_le_bytes()),
            "BF16" => out.extend(half::bf16::from_f32(x).to_bits().to_le_bytes()),
            "F32" => out.extend(x.to_le_bytes()),
            "F64" => out.extend(f64::from(x).to_le_bytes()),
            d => {
                let mut b = vec![0u8; elem_size(d)];
                rng.fill_bytes(&mut b);
                out.extend(b);
            }
        }
    }
    out
}

fn serialize(tensors: &[Tensor], metadata: Option<Value>) -> (Value, Vec<u8>) {
    let mut header = Map::new();
    let mut data = Vec::new();
    for t in tensors {
        let start = data.len();
        data.extend_from_slice(&t.data);
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [start, data.len()]}),
        );
    }
    if let Some(m) = metadata {
        header.insert("__metadata__".into(), m);
    }
    (Value::Object(header), data)
}

fn frame(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + header.len() + data.len());
    out.extend((header.len() as u64).to_le_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// A small, well-formed `kvq eval` file: one to three layers of K/V (and sometimes queries).
fn valid_tensors<R: Rng>(rng: &mut R) -> Vec<Tensor> {
    let dtype = ["F16", "BF16", "F32", "F64", "F16", "F32"][rng.random_range(0..6)];
    let head_dim = [32u64, 64, 128, 16, 33, 96, 256][rng.random_range(0..7)];
    let kv_heads = [1u64, 2, 4, 3][rng.random_range(0..4)];
    let tokens = [1u64, 2, 17, 160, 300, 129][rng.random_range(0..6)];
    let tokens = tokens.min((20_000 / (kv_heads * head_dim)).max(1));
    let mut out = Vec::new();
    for layer in 0..rng.random_range(1..=2u32) {
        let heads_first = rng.random_bool(0.3);
        let shape = if heads_first {
            vec![kv_heads, tokens, head_dim]
        } else {
            vec![tokens, kv_heads, head_dim]
        };
        let n = (tokens * kv_heads * head_dim) as usize;
        for t in ["k", "v"] {
            out.push(Tensor {
                name: format!("layer.{layer}.{t}"),
                dtype,
                shape: shape.clone(),
                data: values(rng, dtype, n),
            });
        }
        if rng.random_bool(0.4) {
            let q_heads = kv_heads * [1u64, 2, 4][rng.random_range(0..3)];
            let shape = if rng.random_bool(0.5) {
                vec![q_heads, head_dim]
            } else {
                vec![1, q_heads, head_dim]
            };
            out.push(Tensor {
                name: format!("layer.{layer}.q"),
                dtype,
                shape,
                data: values(rng, dtype, (q_heads * head_dim) as usize),
            });
        }
    }
    out
}

/// Numbers that break shapes, offsets and lengths.
fn wild_u64<R: Rng>(rng: &mut R) -> Value {
    let v: u64 = [
        0,
        1,
        2,
        u64::from(u32::MAX),
        u64::from(u32::MAX) + 1,
        1 << 40,
        1 << 62,
        u64::MAX / 2,
        u64::MAX,
        usize::MAX as u64 / 8 + 1,
    ][rng.random_range(0..10)];
    match rng.random_range(0..10) {
        0 => json!(-1),
        1 => json!(1.5),
        2 => json!("12"),
        3 => json!(null),
        _ => json!(v),
    }
}

/// Sets `field` of tensor `name` when that entry is an object (an earlier mutation may have
/// replaced it by something else).
fn set(map: &mut Map<String, Value>, name: &str, field: &str, value: Value) {
    if let Some(Value::Object(t)) = map.get_mut(name) {
        t.insert(field.into(), value);
    }
}

/// Mutates the header's JSON: dtype, shape (huge or overflowing dims), offsets past the end or
/// overlapping, names, metadata, removed or extra fields.
fn mutate_header<R: Rng>(rng: &mut R, header: &mut Value) {
    let Value::Object(map) = header else { return };
    let names: Vec<String> = map.keys().cloned().collect();
    if names.is_empty() {
        return;
    }
    let name = names[rng.random_range(0..names.len())].clone();
    match rng.random_range(0..12) {
        0 => {
            let d = [
                "F16", "BF16", "F32", "F64", "I8", "U8", "BOOL", "F8_E4M3", "I64", "C64", "f16",
                "", "F16 ",
            ][rng.random_range(0..13)];
            set(map, &name, "dtype", json!(d));
        }
        1 => {
            if let Some(Value::Array(s)) = map.get_mut(&name).and_then(|t| t.get_mut("shape")) {
                if !s.is_empty() {
                    let i = rng.random_range(0..s.len());
                    s[i] = wild_u64(rng);
                }
            }
        }
        2 => {
            let dims = rng.random_range(0..6);
            let shape: Vec<Value> = (0..dims)
                .map(|_| {
                    if rng.random_bool(0.5) {
                        wild_u64(rng)
                    } else {
                        json!(rng.random_range(0..300))
                    }
                })
                .collect();
            set(map, &name, "shape", Value::Array(shape));
        }
        3 => {
            if let Some(Value::Array(o)) =
                map.get_mut(&name).and_then(|t| t.get_mut("data_offsets"))
            {
                if !o.is_empty() {
                    let i = rng.random_range(0..o.len());
                    o[i] = wild_u64(rng);
                }
            }
        }
        4 => {
            // Overlap: this tensor takes another's offsets.
            let other = names[rng.random_range(0..names.len())].clone();
            if let Some(o) = map.get(&other).and_then(|t| t.get("data_offsets")).cloned() {
                set(map, &name, "data_offsets", o);
            }
        }
        5 => {
            let a: u64 = rng.random_range(0..100_000);
            let b: u64 = rng.random_range(0..100_000);
            set(map, &name, "data_offsets", json!([a, b]));
        }
        6 => {
            let new = [
                "layer.0.k",
                "layer.0.v",
                "layer.0.q",
                "layer.1.k",
                "layer.99999999999999999999.k",
                "layer..k",
                "layer.-1.v",
                "layer.0.k.x",
                "__metadata__",
                "",
            ][rng.random_range(0..10)];
            if let Some(v) = map.remove(&name) {
                map.insert(new.into(), v);
            }
        }
        7 => {
            map.remove(&name);
        }
        8 => {
            let field = ["dtype", "shape", "data_offsets"][rng.random_range(0..3)];
            if let Some(Value::Object(t)) = map.get_mut(&name) {
                t.remove(field);
            }
        }
        9 => {
            map.insert(
                "__metadata__".into(),
                [
                    json!({"a": "b"}),
                    json!({"a": 1}),
                    json!([]),
                    json!("x"),
                    json!(null),
                ][rng.random_range(0..5)]
                .clone(),
            );
        }
        10 => {
            if let Some(Value::Object(t)) = map.get_mut(&name) {
                t.insert("extra".into(), json!([1, 2, 3]));
            }
        }
        _ => {
            map.insert(
                name.clone(),
                [json!(null), json!(1), json!([]), json!("F16"), json!({})][rng.random_range(0..5)]
                    .clone(),
            );
        }
    }
}

/// One safetensors input: a valid small file, or one with a mutated header, length prefix or bytes.
pub fn safetensors_input<R: Rng>(rng: &mut R) -> Vec<u8> {
    let tensors = valid_tensors(rng);
    let meta = rng.random_bool(0.2).then(|| json!({"format": "pt"}));
    let (mut header, mut data) = serialize(&tensors, meta);
    // 0: valid; 1-5: header JSON; 6: data length; 7: length prefix; 8: bytes; 9: truncation.
    let mode = [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9][rng.random_range(0..12)];
    if (1..=5).contains(&mode) {
        for _ in 0..rng.random_range(1..=3) {
            mutate_header(rng, &mut header);
        }
    }
    let mut header_bytes = serde_json::to_vec(&header).unwrap_or_default();
    if rng.random_bool(0.1) {
        // Padding, as safetensors writers align the data to 8 bytes.
        header_bytes.extend(std::iter::repeat(b' ').take(rng.random_range(0..8)));
    }
    if mode == 6 {
        // Data shorter or longer than the header says.
        let n = data.len();
        if rng.random_bool(0.5) {
            data.truncate(rng.random_range(0..=n));
        } else {
            data.extend(std::iter::repeat(0u8).take(rng.random_range(1..64)));
        }
    }
    let mut file = frame(&header_bytes, &data);
    match mode {
        7 => {
            // The length prefix.
            let len = header_bytes.len() as u64;
            let v = [
                0,
                1,
                2,
                7,
                8,
                len.saturating_sub(1),
                len + 1,
                len + data.len() as u64,
                len + data.len() as u64 + 1,
                u64::from(u32::MAX),
                100_000_001,
                1 << 40,
                u64::MAX,
            ][rng.random_range(0..13)];
            file[..8].copy_from_slice(&v.to_le_bytes());
        }
        8 => {
            let other = frame(b"{}", &[]);
            for _ in 0..rng.random_range(1..=8) {
                mutate(rng, &mut file, &other);
            }
        }
        9 => {
            let n = file.len();
            file.truncate(rng.random_range(0..=n.min(64)));
        }
        _ => {}
    }
    file
}
