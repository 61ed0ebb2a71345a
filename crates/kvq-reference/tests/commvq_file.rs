//! Codebook files (`kvq-codebooks-1`): a layer's codebooks saved as safetensors load back bit for
//! bit, and every file that is not codebooks for the caller's scheme and shape is a typed error
//! whose message names the problem.

use half::f16;
use kvq_reference::commvq::{
    self, CalibrationData, CodebookFileError, Codebooks, CommVqCache, TensorCodebook, TrainOptions,
    CODEBOOK_FILE_FORMAT, DEVICE_LAYOUT_VERSION,
};
use kvq_reference::synth::{generate, SynthConfig, SynthKv};
use kvq_spec::SchemeSpec;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;

/// RoPE keys and additive values with every region (sink, pages, local window).
const ROPE_ADDITIVE: &str =
    "k = codebook(rope_commutative, levels = 8, residuals = 2, pairs_per_code = 32), \
     v = codebook(additive, rows = 64), page = 32, sink = 4, local = 16";
/// Token-wide spans: one additive book over both heads (`dim = 128`).
const TOKEN_SPANS: &str = "k = codebook(rope_commutative, levels = 8, residuals = 2, pairs_per_code = 32, span = token), \
     v = codebook(additive, rows = 64, span = token), page = 32";
const FP16_ADDITIVE: &str = "k = fp16, v = codebook(additive, rows = 64), page = 32";
const ADDITIVE_FP16: &str = "k = codebook(additive, rows = 64), v = fp16, page = 32";

fn spec(text: &str) -> SchemeSpec {
    SchemeSpec::parse(text).unwrap()
}

/// 2 KV heads of 64 channels, 256 tokens.
fn layer() -> &'static SynthKv {
    static LAYER: OnceLock<SynthKv> = OnceLock::new();
    LAYER.get_or_init(|| {
        generate(&SynthConfig {
            tokens: 256,
            kv_heads: KV_HEADS,
            gqa: 2,
            head_dim: HEAD_DIM,
            d_model: 96,
            seed: 5,
            ..Default::default()
        })
    })
}

/// Quick codebooks (TrainOptions::quick): the file does not care how good they are.
fn train(text: &str) -> Codebooks {
    let options = TrainOptions::quick(11);
    let s = layer();
    let data = CalibrationData {
        k_pre_rope: &s.k_pre_rope,
        v: &s.v,
        rope: s.rope,
    };
    commvq::train_with(&spec(text), &data, &options).unwrap()
}

/// The RoPE + additive codebooks, trained once for all tests.
fn rope_additive() -> &'static Codebooks {
    static BOOKS: OnceLock<Codebooks> = OnceLock::new();
    BOOKS.get_or_init(|| train(ROPE_ADDITIVE))
}

/// The file of [`rope_additive`].
fn rope_additive_file() -> Vec<u8> {
    rope_additive()
        .to_safetensors(&spec(ROPE_ADDITIVE), KV_HEADS, HEAD_DIM)
        .unwrap()
}

/// A fresh, empty folder of this test's own.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvq-commvq-file-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every value's f32 bits, side by side (`==` on f32 would let `-0.0` pass for `0.0`).
fn bits(cb: &Codebooks) -> Vec<Vec<u32>> {
    let side = |t: &Option<TensorCodebook>| -> Vec<Vec<u32>> {
        let to_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect();
        match t {
            None => Vec::new(),
            Some(TensorCodebook::RopeCommutative(k)) => vec![to_bits(&k.entries)],
            Some(TensorCodebook::Additive(a)) => vec![
                to_bits(&a.table),
                to_bits(&a.channel_scale),
                to_bits(&a.mean),
            ],
        }
    };
    let mut out = side(&cb.k);
    out.extend(side(&cb.v));
    out
}

/// A file's tensors as owned `(dtype, shape, bytes)` and its metadata, to be edited and rewritten.
struct Parts {
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
    metadata: Option<HashMap<String, String>>,
}

impl Parts {
    fn of(bytes: &[u8]) -> Self {
        let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
        let st = SafeTensors::deserialize(bytes).unwrap();
        let mut tensors: Vec<_> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
            .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        Self {
            tensors,
            metadata: meta.metadata().clone(),
        }
    }

    fn tensor(&mut self, name: &str) -> &mut (String, Dtype, Vec<usize>, Vec<u8>) {
        self.tensors.iter_mut().find(|t| t.0 == name).unwrap()
    }

    fn set_metadata(&mut self, key: &str, value: &str) {
        self.metadata
            .get_or_insert_with(HashMap::new)
            .insert(key.into(), value.into());
    }

    fn bytes(&self) -> Vec<u8> {
        let views: Vec<_> = self
            .tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize(views, &self.metadata).unwrap()
    }
}

/// Loads `bytes` as the RoPE + additive scheme's file at 2 × 64.
fn load_rope_additive(bytes: &[u8]) -> Result<Codebooks, CodebookFileError> {
    Codebooks::from_safetensors(bytes, &spec(ROPE_ADDITIVE), KV_HEADS, HEAD_DIM)
}

fn assert_names(e: &CodebookFileError, words: &[&str]) {
    let s = e.to_string();
    for w in words {
        assert!(s.contains(w), "`{s}` does not mention `{w}`");
    }
}

#[test]
fn save_then_load_gives_the_same_codebooks_bit_for_bit_and_the_same_cache() {
    let dir = scratch("round-trip");
    let s = layer();
    for (i, text) in [ROPE_ADDITIVE, TOKEN_SPANS, FP16_ADDITIVE, ADDITIVE_FP16]
        .into_iter()
        .enumerate()
    {
        let spec = spec(text);
        let books = if text == ROPE_ADDITIVE {
            rope_additive().clone()
        } else {
            train(text)
        };
        let path = dir.join(format!("layer{i}.safetensors"));
        books.save(&path, &spec, KV_HEADS, HEAD_DIM).unwrap();
        let loaded = Codebooks::load(&path, &spec, KV_HEADS, HEAD_DIM).unwrap();
        assert_eq!(loaded, books, "{text}");
        assert_eq!(bits(&loaded), bits(&books), "{text}");
        let build =
            |cb: &Codebooks| CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, cb).unwrap();
        assert!(build(&loaded) == build(&books), "{text}: caches differ");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_file_holds_f16_tensors_of_the_documented_shapes_and_the_metadata() {
    let parts = Parts::of(&rope_additive_file());
    let found: Vec<(&str, Dtype, &[usize])> = parts
        .tensors
        .iter()
        .map(|(n, d, s, _)| (n.as_str(), *d, s.as_slice()))
        .collect();
    // [kv_heads, groups, residuals, levels, pairs_per_code, 2]; additive [books, rows, dim].
    assert_eq!(
        found,
        vec![
            ("k.entries", Dtype::F16, &[2, 1, 2, 8, 32, 2][..]),
            ("v.channel_scale", Dtype::F16, &[2, 64][..]),
            ("v.mean", Dtype::F16, &[2, 64][..]),
            ("v.table", Dtype::F16, &[2, 64, 64][..]),
        ]
    );
    let meta = parts.metadata.unwrap();
    let scheme = spec(ROPE_ADDITIVE).to_string();
    let want: HashMap<String, String> = [
        ("kvq.format", CODEBOOK_FILE_FORMAT),
        ("kvq.scheme", scheme.as_str()),
        ("kvq.kv_heads", "2"),
        ("kvq.head_dim", "64"),
        ("kvq.device_layout", DEVICE_LAYOUT_VERSION),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    assert_eq!(meta, want);
    // Token-wide spans: one additive book over both heads.
    let tokens = Parts::of(
        &train(TOKEN_SPANS)
            .to_safetensors(&spec(TOKEN_SPANS), KV_HEADS, HEAD_DIM)
            .unwrap(),
    );
    assert_eq!(tokens.tensors[3].0, "v.table");
    assert_eq!(tokens.tensors[3].2, vec![1, 64, 128]);
}

#[test]
fn codebooks_for_another_scheme_are_a_scheme_mismatch_showing_both_texts() {
    let e = Codebooks::from_safetensors(
        &rope_additive_file(),
        &spec(FP16_ADDITIVE),
        KV_HEADS,
        HEAD_DIM,
    )
    .unwrap_err();
    let (want, found) = (
        spec(FP16_ADDITIVE).to_string(),
        spec(ROPE_ADDITIVE).to_string(),
    );
    assert_eq!(
        e,
        CodebookFileError::SchemeMismatch {
            expected: want.clone(),
            found: found.clone()
        }
    );
    assert_names(&e, &[&want, &found]);
}

#[test]
fn codebooks_serve_the_same_tensors_under_another_page_sink_and_local() {
    // Regions do not shape a codebook: the file trained under page 32, sink 4, local 16 loads for
    // the same K/V declarations under page 64 without a sink or window.
    let other = "k = codebook(rope_commutative, levels = 8, residuals = 2, pairs_per_code = 32), \
                 v = codebook(additive, rows = 64), page = 64";
    let loaded =
        Codebooks::from_safetensors(&rope_additive_file(), &spec(other), KV_HEADS, HEAD_DIM)
            .unwrap();
    assert_eq!(bits(&loaded), bits(rope_additive()));
}

#[test]
fn codebooks_of_the_same_family_with_other_residuals_are_a_scheme_mismatch() {
    let other = ROPE_ADDITIVE.replace("residuals = 2", "residuals = 3");
    let e = Codebooks::from_safetensors(&rope_additive_file(), &spec(&other), KV_HEADS, HEAD_DIM)
        .unwrap_err();
    assert!(
        matches!(e, CodebookFileError::SchemeMismatch { .. }),
        "{e:?}"
    );
    assert_names(&e, &["residuals = 3", "residuals = 2"]);
}

#[test]
fn codebooks_for_other_kv_heads_are_a_shape_mismatch() {
    let e = Codebooks::from_safetensors(&rope_additive_file(), &spec(ROPE_ADDITIVE), 4, HEAD_DIM)
        .unwrap_err();
    assert_eq!(
        e,
        CodebookFileError::ShapeMismatch {
            what: "kv_heads",
            expected: 4,
            found: 2
        }
    );
    assert_names(&e, &["kv_heads = 2", "kv_heads = 4"]);
}

#[test]
fn codebooks_for_another_head_dim_are_a_shape_mismatch() {
    let e = Codebooks::from_safetensors(&rope_additive_file(), &spec(ROPE_ADDITIVE), KV_HEADS, 128)
        .unwrap_err();
    assert_eq!(
        e,
        CodebookFileError::ShapeMismatch {
            what: "head_dim",
            expected: 128,
            found: 64
        }
    );
    assert_names(&e, &["head_dim = 64", "head_dim = 128"]);
}

#[test]
fn a_missing_tensor_is_refused_by_name() {
    let mut parts = Parts::of(&rope_additive_file());
    parts.tensors.retain(|t| t.0 != "v.mean");
    let e = load_rope_additive(&parts.bytes()).unwrap_err();
    assert!(
        matches!(&e, CodebookFileError::MissingTensor { tensor, .. } if tensor == "v.mean"),
        "{e:?}"
    );
    assert_names(&e, &["`v.mean`", "missing", "[2, 64]"]);
}

#[test]
fn an_extra_tensor_is_refused_by_name() {
    let mut parts = Parts::of(&rope_additive_file());
    parts
        .tensors
        .push(("k.bias".into(), Dtype::F16, vec![2], vec![0; 4]));
    let e = load_rope_additive(&parts.bytes()).unwrap_err();
    assert!(
        matches!(&e, CodebookFileError::UnexpectedTensor { tensor, .. } if tensor == "k.bias"),
        "{e:?}"
    );
    assert_names(&e, &["unexpected tensor `k.bias`", "`k.entries`"]);
}

#[test]
fn an_f32_tensor_where_f16_is_expected_is_a_dtype_error() {
    let mut parts = Parts::of(&rope_additive_file());
    let t = parts.tensor("v.table");
    let f32_bytes: Vec<u8> =
        t.3.chunks_exact(2)
            .flat_map(|b| {
                f16::from_bits(u16::from_le_bytes([b[0], b[1]]))
                    .to_f32()
                    .to_le_bytes()
            })
            .collect();
    (t.1, t.3) = (Dtype::F32, f32_bytes);
    let e = load_rope_additive(&parts.bytes()).unwrap_err();
    assert_eq!(
        e,
        CodebookFileError::WrongDtype {
            tensor: "v.table".into(),
            expected: "F16",
            found: "F32".into()
        }
    );
    assert_names(&e, &["`v.table`", "F32", "F16"]);
}

#[test]
fn a_tensor_of_another_shape_is_refused_naming_both_shapes() {
    let mut parts = Parts::of(&rope_additive_file());
    // The same values without the `groups` axis: [2, 2, 8, 32, 2] instead of [2, 1, 2, 8, 32, 2].
    parts.tensor("k.entries").2 = vec![2, 2, 8, 32, 2];
    let e = load_rope_additive(&parts.bytes()).unwrap_err();
    assert_eq!(
        e,
        CodebookFileError::TensorShape {
            tensor: "k.entries".into(),
            expected: vec![2, 1, 2, 8, 32, 2],
            found: vec![2, 2, 8, 32, 2]
        }
    );
    assert_names(
        &e,
        &["`k.entries`", "[2, 2, 8, 32, 2]", "[2, 1, 2, 8, 32, 2]"],
    );
}

#[test]
fn saving_a_value_f16_cannot_hold_is_refused_naming_tensor_and_index() {
    let mut books = rope_additive().clone();
    let Some(TensorCodebook::Additive(v)) = &mut books.v else {
        panic!("values use an additive codebook");
    };
    v.mean[5] = 0.1;
    let dir = scratch("not-f16");
    let path = dir.join("layer.safetensors");
    let e = books
        .save(&path, &spec(ROPE_ADDITIVE), KV_HEADS, HEAD_DIM)
        .unwrap_err();
    assert_eq!(
        e,
        CodebookFileError::NotF16Exact {
            tensor: "v.mean".into(),
            index: 5,
            value: 0.1
        }
    );
    assert_names(&e, &["`v.mean`", "index 5", "0.1"]);
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "nothing written"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bytes_that_are_not_a_safetensors_file_are_refused() {
    for bytes in [&b""[..], b"not a safetensors file at all", &[255; 16]] {
        let e = load_rope_additive(bytes).unwrap_err();
        assert!(
            matches!(e, CodebookFileError::NotSafetensors(_)),
            "{bytes:?}: {e:?}"
        );
        assert_names(&e, &["not a safetensors file"]);
    }
    let e = load_rope_additive(b"x").unwrap_err();
    assert_names(&e, &["1 bytes", "8-byte header"]);
}

#[test]
fn a_safetensors_file_without_the_kvq_metadata_is_refused() {
    let mut parts = Parts::of(&rope_additive_file());
    parts.metadata = None;
    let e = load_rope_additive(&parts.bytes()).unwrap_err();
    assert_eq!(e, CodebookFileError::MissingMetadata { key: "kvq.format" });
    assert_names(&e, &["not a kvq codebook file", "`kvq.format`"]);

    let mut parts = Parts::of(&rope_additive_file());
    parts.metadata.as_mut().unwrap().remove("kvq.scheme");
    let e = load_rope_additive(&parts.bytes()).unwrap_err();
    assert_eq!(e, CodebookFileError::MissingMetadata { key: "kvq.scheme" });
}

#[test]
fn another_format_or_version_is_an_unknown_format() {
    let mut parts = Parts::of(&rope_additive_file());
    parts.set_metadata("kvq.format", "kvq-codebooks-2");
    let e = load_rope_additive(&parts.bytes()).unwrap_err();
    assert_eq!(
        e,
        CodebookFileError::UnknownFormat {
            found: "kvq-codebooks-2".into()
        }
    );
    assert_names(&e, &["`kvq-codebooks-2`", CODEBOOK_FILE_FORMAT]);
}

#[test]
fn unreadable_metadata_values_are_refused_naming_the_key() {
    let mut parts = Parts::of(&rope_additive_file());
    parts.set_metadata("kvq.scheme", "k = int(5, channel), v = fp16");
    let e = load_rope_additive(&parts.bytes()).unwrap_err();
    assert!(
        matches!(
            e,
            CodebookFileError::BadMetadata {
                key: "kvq.scheme",
                ..
            }
        ),
        "{e:?}"
    );
    assert_names(&e, &["`kvq.scheme`", "not a valid scheme"]);

    let mut parts = Parts::of(&rope_additive_file());
    parts.set_metadata("kvq.head_dim", "sixty-four");
    let e = load_rope_additive(&parts.bytes()).unwrap_err();
    assert!(
        matches!(
            e,
            CodebookFileError::BadMetadata {
                key: "kvq.head_dim",
                ..
            }
        ),
        "{e:?}"
    );
    assert_names(&e, &["`kvq.head_dim`", "sixty-four"]);
}

#[test]
fn codebooks_that_do_not_fit_the_scheme_are_refused_on_save_and_on_load() {
    // Trained for 2 residuals, saved as the 3-residual scheme: the reference's own check.
    let other = ROPE_ADDITIVE.replace("residuals = 2", "residuals = 3");
    let e = rope_additive()
        .to_safetensors(&spec(&other), KV_HEADS, HEAD_DIM)
        .unwrap_err();
    assert!(matches!(e, CodebookFileError::Codebooks(_)), "{e:?}");
    assert_names(&e, &["do not fit the scheme", "2 residuals"]);

    // A codebook for an FP16 side would be dropped silently: refused.
    let e = rope_additive()
        .to_safetensors(&spec(FP16_ADDITIVE), KV_HEADS, HEAD_DIM)
        .unwrap_err();
    assert!(matches!(e, CodebookFileError::Codebooks(_)), "{e:?}");
    assert_names(&e, &["`k` is FP16"]);

    // A zero channel scale in the file: the additive codebook's own check on load.
    let mut parts = Parts::of(&rope_additive_file());
    parts.tensor("v.channel_scale").3[..2].copy_from_slice(&f16::ZERO.to_bits().to_le_bytes());
    let e = load_rope_additive(&parts.bytes()).unwrap_err();
    assert!(matches!(e, CodebookFileError::Codebooks(_)), "{e:?}");
    assert_names(&e, &["non-positive channel scale"]);
}

#[test]
fn a_scheme_without_codebooks_is_refused() {
    let int = spec("k = int(2, channel), v = int(2, token)");
    let e = Codebooks { k: None, v: None }
        .to_safetensors(&int, KV_HEADS, HEAD_DIM)
        .unwrap_err();
    assert!(matches!(e, CodebookFileError::Scheme(_)), "{e:?}");
    assert_names(&e, &["integer-quantized"]);
}

#[test]
fn a_file_declaring_absurd_sizes_is_refused_before_allocating() {
    // 10^9 KV heads: `v.table` alone would be 10^9 × 64 × 64 f32 (16 TB).
    let text = spec(FP16_ADDITIVE).to_string();
    let mut parts = Parts {
        tensors: Vec::new(),
        metadata: None,
    };
    for (k, v) in [
        ("kvq.format", CODEBOOK_FILE_FORMAT),
        ("kvq.scheme", &text),
        ("kvq.kv_heads", "1000000000"),
        ("kvq.head_dim", "64"),
    ] {
        parts.set_metadata(k, v);
    }
    let e = Codebooks::from_safetensors(&parts.bytes(), &spec(FP16_ADDITIVE), 1_000_000_000, 64)
        .unwrap_err();
    assert!(matches!(e, CodebookFileError::Alloc(_)), "{e:?}");
    assert_names(&e, &["the codebook tensors", "bytes"]);
}

#[test]
fn save_leaves_only_the_file_and_replaces_an_older_one() {
    let dir = scratch("atomic");
    let path = dir.join("layer.safetensors");
    let spec = spec(ROPE_ADDITIVE);
    let mut older = rope_additive().clone();
    let Some(TensorCodebook::Additive(v)) = &mut older.v else {
        panic!("values use an additive codebook");
    };
    v.mean[0] = if v.mean[0] == 0.5 { 0.25 } else { 0.5 };
    older.save(&path, &spec, KV_HEADS, HEAD_DIM).unwrap();
    rope_additive()
        .save(&path, &spec, KV_HEADS, HEAD_DIM)
        .unwrap();
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("layer.safetensors")]);
    let loaded = Codebooks::load(&path, &spec, KV_HEADS, HEAD_DIM).unwrap();
    assert_eq!(&loaded, rope_additive());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn saving_into_a_missing_folder_is_an_io_error_naming_the_path() {
    let dir = scratch("missing-folder");
    let path = dir.join("no-such-folder").join("layer.safetensors");
    let e = rope_additive()
        .save(&path, &spec(ROPE_ADDITIVE), KV_HEADS, HEAD_DIM)
        .unwrap_err();
    assert!(
        matches!(&e, CodebookFileError::Io { path: p, .. } if *p == path),
        "{e:?}"
    );
    assert_names(&e, &[&path.display().to_string(), "cannot create"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn loading_a_missing_file_is_an_io_error_naming_the_path() {
    let dir = scratch("missing-file");
    let path = dir.join("absent.safetensors");
    let e = Codebooks::load(&path, &spec(ROPE_ADDITIVE), KV_HEADS, HEAD_DIM).unwrap_err();
    assert!(
        matches!(&e, CodebookFileError::Io { path: p, .. } if *p == path),
        "{e:?}"
    );
    assert_names(&e, &[&path.display().to_string(), "the codebook file"]);
    let _ = std::fs::remove_dir_all(&dir);
}
