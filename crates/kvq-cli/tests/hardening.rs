//! Bad input to `kvq eval`, `gen` and `demo` as the built binary sees it: every case ends in a
//! bounded time with exit 2 and a sentence naming the file or flag — no hang, no abort, no silent
//! perfect score.

mod common;
use common::TempDir;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// Runs `kvq args…` and kills it after `limit`: a run that has not ended by then fails the test
/// instead of hanging it.
fn kvq_within(args: &[&str], cache: &Path, limit: Duration) -> Output {
    let bin = std::env::var("KVQ_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvq").to_string());
    let mut child = Command::new(bin)
        .args(args)
        .env("KVQ_CACHE_DIR", cache)
        .env_remove("KVQ_TUNE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kvq");
    let started = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("`kvq {}` did not end within {limit:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn kvq(args: &[&str], cache: &Path) -> Output {
    kvq_within(args, cache, Duration::from_secs(120))
}

/// Exit 2 and stderr, with every expected piece in it.
fn usage_error(o: &Output, pieces: &[&str]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(2), "stdout:\n{out}\nstderr:\n{err}");
    for p in pieces {
        assert!(err.contains(p), "`{p}` missing from:\n{err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

/// Deterministic values with some spread (no RNG dependency).
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// Writes f16 tensors `(name, shape)` filled from [`values`].
fn write_f16(path: &Path, tensors: &[(&str, Vec<usize>)]) {
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .enumerate()
        .map(|(i, (n, s))| {
            let count = s.iter().product();
            (
                n.to_string(),
                s.clone(),
                f16_bytes(&values(count, i as u32 + 1)),
            )
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F16, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, &None).unwrap()).unwrap();
}

/// A file with a hand-written header (8-byte length, JSON, then `data`).
fn write_raw(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn eval_refuses_device_nodes_fifos_and_directories_without_reading_them() {
    let tmp = TempDir::new("hard-devices");
    // `--kv /dev/zero` read forever and grew without bound.
    for dev in ["/dev/zero", "/dev/urandom"] {
        if !Path::new(dev).exists() {
            continue;
        }
        let o = kvq_within(
            &["eval", "--scheme", "kivi2", "--kv", dev, "--cpu"],
            tmp.path(),
            Duration::from_secs(20),
        );
        usage_error(&o, &[dev, "must be a regular file", "a character device"]);
    }
    let fifo = tmp.path().join("kv.fifo");
    let made = Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success());
    if made {
        let o = kvq_within(
            &[
                "eval",
                "--scheme",
                "kivi2",
                "--kv",
                fifo.to_str().unwrap(),
                "--cpu",
            ],
            tmp.path(),
            Duration::from_secs(20),
        );
        usage_error(&o, &["kv.fifo", "a FIFO"]);
    }
    let o = kvq(
        &[
            "eval",
            "--scheme",
            "kivi2",
            "--kv",
            tmp.path().to_str().unwrap(),
            "--cpu",
        ],
        tmp.path(),
    );
    usage_error(&o, &["a directory"]);
}

#[test]
fn eval_names_layout_when_the_file_is_read_in_the_other_axis_order() {
    let tmp = TempDir::new("hard-layout");
    let file = tmp.path().join("hf.safetensors");
    let f = file.to_str().unwrap();
    // Heads-first [8 heads, 600 tokens, 32]: read tokens-first, 8 "tokens" of 600 "heads" scored
    // `attn err 0.0000` with nothing quantized, exit 0.
    write_f16(
        &file,
        &[
            ("layer.0.k", vec![8, 600, 32]),
            ("layer.0.v", vec![8, 600, 32]),
        ],
    );
    let o = kvq(
        &["eval", "--scheme", "kivi2", "--kv", f, "--cpu"],
        tmp.path(),
    );
    usage_error(
        &o,
        &["8 token(s) × 600 KV heads", "pass --layout heads-first"],
    );
    let o = kvq(
        &[
            "eval",
            "--scheme",
            "kivi2",
            "--kv",
            f,
            "--layout",
            "heads-first",
            "--cpu",
        ],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // With captured queries, their head count tells the layouts apart.
    write_f16(
        &file,
        &[
            ("layer.0.k", vec![8, 600, 32]),
            ("layer.0.v", vec![8, 600, 32]),
            ("layer.0.q", vec![32, 32]),
        ],
    );
    let o = kvq(
        &["eval", "--scheme", "kivi2", "--kv", f, "--cpu"],
        tmp.path(),
    );
    usage_error(
        &o,
        &[
            "`layer.0.q` has shape [32, 32]",
            "pass --layout heads-first",
        ],
    );
    // The reverse: a tokens-first file read heads-first.
    write_f16(
        &file,
        &[
            ("layer.0.k", vec![600, 8, 32]),
            ("layer.0.v", vec![600, 8, 32]),
        ],
    );
    let o = kvq(
        &[
            "eval",
            "--scheme",
            "kivi2",
            "--kv",
            f,
            "--layout",
            "heads-first",
            "--cpu",
        ],
        tmp.path(),
    );
    usage_error(&o, &["pass --layout tokens-first"]);
}

#[test]
fn eval_refuses_a_capture_where_nothing_would_be_quantized() {
    let tmp = TempDir::new("hard-short");
    let file = tmp.path().join("short.safetensors");
    let f = file.to_str().unwrap();
    write_f16(
        &file,
        &[
            ("layer.0.k", vec![100, 2, 32]),
            ("layer.0.v", vec![100, 2, 32]),
        ],
    );
    // kivi2 keeps 128 local tokens and quantizes pages of 128: 99 cached tokens are all FP16.
    let o = kvq(
        &["eval", "--scheme", "kivi2", "--kv", f, "--cpu"],
        tmp.path(),
    );
    usage_error(
        &o,
        &[
            "0 tokens quantized",
            "99 cached token(s)",
            "at least 256 cached tokens",
        ],
    );
    // FP16 quantizes nothing by design: its near-zero error is the true answer.
    let o = kvq(
        &["eval", "--scheme", "fp16", "--kv", f, "--cpu"],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Long enough: some tokens quantized, exit 0.
    write_f16(
        &file,
        &[
            ("layer.0.k", vec![300, 2, 32]),
            ("layer.0.v", vec![300, 2, 32]),
        ],
    );
    let o = kvq(
        &["eval", "--scheme", "kivi2", "--kv", f, "--cpu"],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn eval_states_broken_safetensors_files_in_sentences() {
    let tmp = TempDir::new("hard-st");
    let file = tmp.path().join("bad.safetensors");
    let f = file.to_str().unwrap();
    let run = |pieces: &[&str]| {
        let o = kvq(
            &["eval", "--scheme", "kivi2", "--kv", f, "--cpu"],
            tmp.path(),
        );
        let err = usage_error(&o, pieces);
        for raw in [
            "HeaderTooSmall",
            "InvalidOffset(",
            "TensorInvalidInfo",
            "ValidationOverflow",
        ] {
            assert!(!err.contains(raw), "a bare variant name:\n{err}");
        }
    };
    std::fs::write(&file, b"abc").unwrap();
    run(&[
        "bad.safetensors",
        "the file is 3 bytes, shorter than the 8-byte header length",
    ]);
    let mut b = (1u64 << 40).to_le_bytes().to_vec();
    b.extend_from_slice(b"{}");
    std::fs::write(&file, &b).unwrap();
    run(&["a header of 1099511627776 bytes"]);
    let mut b = 5000u64.to_le_bytes().to_vec();
    b.extend_from_slice(b"{}");
    std::fs::write(&file, &b).unwrap();
    run(&["a header of 5000 bytes, but only 2 bytes follow"]);
    // V's data does not start where K's ends.
    write_raw(
        &file,
        r#"{"layer.0.k":{"dtype":"F16","shape":[2,2,2],"data_offsets":[0,16]},"layer.0.v":{"dtype":"F16","shape":[2,2,2],"data_offsets":[20,36]}}"#,
        &[0u8; 36],
    );
    run(&["tensor `layer.0.v`'s data offsets lie outside the file"]);
    // A 2^60 shape: refused from the header, nothing allocated.
    write_raw(
        &file,
        r#"{"layer.0.k":{"dtype":"F16","shape":[1152921504606846976,2,64],"data_offsets":[0,16]},"layer.0.v":{"dtype":"F16","shape":[2,2,2],"data_offsets":[16,32]}}"#,
        &[0u8; 32],
    );
    run(&["tensor `layer.0.k`", "overflows 64 bits"]);
    write_raw(
        &file,
        r#"{"layer.0.k":{"dtype":"F16","shape":[1048576,1048576,1048576],"data_offsets":[0,16]},"layer.0.v":{"dtype":"F16","shape":[2,2,2],"data_offsets":[16,32]}}"#,
        &[0u8; 32],
    );
    run(&["tensor `layer.0.k`", "differs from its data offsets"]);
    write_raw(&file, r#"{"layer.0.k": [1,2"#, &[]);
    run(&["the header is not the JSON of a safetensors file"]);
}

#[test]
fn eval_refuses_non_finite_values_empty_tensors_and_other_dtypes() {
    let tmp = TempDir::new("hard-values");
    let file = tmp.path().join("v.safetensors");
    let f = file.to_str().unwrap();
    let run = |pieces: &[&str]| {
        let o = kvq(
            &["eval", "--scheme", "kivi2", "--kv", f, "--cpu"],
            tmp.path(),
        );
        usage_error(&o, pieces);
    };
    let n = 300 * 2 * 32;
    let mut k = f16_bytes(&values(n, 1));
    let v = f16_bytes(&values(n, 2));
    // NaN (f16 0x7E00) at token 7, head 1, channel 3.
    let at = (7 * 2 + 1) * 32 + 3;
    k[2 * at..2 * at + 2].copy_from_slice(&0x7E00u16.to_le_bytes());
    let views = vec![
        (
            "layer.0.k".to_string(),
            TensorView::new(Dtype::F16, vec![300, 2, 32], &k).unwrap(),
        ),
        (
            "layer.0.v".to_string(),
            TensorView::new(Dtype::F16, vec![300, 2, 32], &v).unwrap(),
        ),
    ];
    std::fs::write(&file, safetensors::serialize(views, &None).unwrap()).unwrap();
    run(&["tensor `layer.0.k` holds NaN at index [7, 1, 3]"]);
    // An f64 past f32's range.
    let mut v64: Vec<u8> = values(n, 3)
        .iter()
        .flat_map(|x| (*x as f64).to_le_bytes())
        .collect();
    v64[..8].copy_from_slice(&1e300f64.to_le_bytes());
    let k64: Vec<u8> = values(n, 4)
        .iter()
        .flat_map(|x| (*x as f64).to_le_bytes())
        .collect();
    let views = vec![
        (
            "layer.0.k".to_string(),
            TensorView::new(Dtype::F64, vec![300, 2, 32], &k64).unwrap(),
        ),
        (
            "layer.0.v".to_string(),
            TensorView::new(Dtype::F64, vec![300, 2, 32], &v64).unwrap(),
        ),
    ];
    std::fs::write(&file, safetensors::serialize(views, &None).unwrap()).unwrap();
    run(&[
        "tensor `layer.0.v` holds inf at index [0, 0, 0]",
        "past f32's range",
    ]);
    // Zero tokens.
    write_f16(
        &file,
        &[("layer.0.k", vec![0, 2, 32]), ("layer.0.v", vec![0, 2, 32])],
    );
    run(&["K/V [0, 2, 32] is empty"]);
    // An integer dtype.
    let ints = vec![0u8; 300 * 2 * 32 * 4];
    let views = vec![
        (
            "layer.0.k".to_string(),
            TensorView::new(Dtype::I32, vec![300, 2, 32], &ints).unwrap(),
        ),
        (
            "layer.0.v".to_string(),
            TensorView::new(Dtype::I32, vec![300, 2, 32], &ints).unwrap(),
        ),
    ];
    std::fs::write(&file, safetensors::serialize(views, &None).unwrap()).unwrap();
    run(&["dtype I32; expected f16, bf16, f32 or f64"]);
}

#[test]
fn gen_and_demo_refuse_sizes_past_the_machine_before_allocating() {
    let tmp = TempDir::new("hard-sizes");
    let out = tmp.path().join("out");
    // `--sample-lengths 100000000` aborted with `memory allocation of 102400000000 bytes failed`;
    // 10^9 tokens (6 TB of sample) is past any machine the tests run on.
    let r = kvq_within(
        &[
            "gen",
            "--scheme",
            "kivi2",
            "--head-dim",
            "128",
            "--sample",
            "--sample-lengths",
            "1000000000",
            "--out",
            out.to_str().unwrap(),
        ],
        tmp.path(),
        Duration::from_secs(60),
    );
    usage_error(&r, &["--sample-lengths", "(6144000000000 bytes) of memory"]);
    assert!(
        !out.join("decode.cu").exists(),
        "a refused sample leaves no half-written folder"
    );
    let r = kvq(
        &[
            "gen",
            "--scheme",
            "kivi2",
            "--head-dim",
            "128",
            "--sample",
            "--sample-lengths",
            "3000000000",
            "--out",
            out.to_str().unwrap(),
        ],
        tmp.path(),
    );
    usage_error(&r, &["3000000000 tokens is more than the kernels' i32"]);
    let r = kvq_within(
        &["demo", "--cpu", "--tokens", "1000000000"],
        tmp.path(),
        Duration::from_secs(60),
    );
    usage_error(
        &r,
        &["1000000000 + 1024 held-out tokens", "bytes) of memory"],
    );
    let r = kvq_within(
        &["demo", "--cpu", "--tokens", "4611686018427387904"],
        tmp.path(),
        Duration::from_secs(60),
    );
    usage_error(&r, &["overflows"]);
}

#[test]
fn gen_refuses_a_named_tune_file_that_is_missing_or_unusable() {
    let tmp = TempDir::new("hard-tune");
    let out = tmp.path().join("out");
    let run = |file: &Path, pieces: &[&str]| {
        let o = kvq(
            &[
                "gen",
                "--scheme",
                "kivi2",
                "--head-dim",
                "128",
                "--out",
                out.to_str().unwrap(),
                "--tune-file",
                file.to_str().unwrap(),
            ],
            tmp.path(),
        );
        usage_error(&o, pieces);
    };
    run(
        &tmp.path().join("missing.json"),
        &["missing.json", "No such file"],
    );
    let corrupt = tmp.path().join("corrupt.json");
    std::fs::write(
        &corrupt,
        "{\"format\": \"kvq-tune\", \"version\": 2, \"entries\": [",
    )
    .unwrap();
    run(&corrupt, &["corrupt.json", "--tune-file", "not valid JSON"]);
    let foreign = tmp.path().join("foreign.json");
    std::fs::write(&foreign, "{\"a\": 1}").unwrap();
    run(&foreign, &["foreign.json", "not a kvq tuning file"]);
    run(tmp.path(), &["a directory"]);
    // Without --tune-file a damaged default file stays a note: it is a cache, not the user's input.
    std::fs::write(tmp.path().join("tune.json"), "garbage").unwrap();
    let o = kvq(
        &[
            "gen",
            "--scheme",
            "kivi2",
            "--head-dim",
            "128",
            "--out",
            out.to_str().unwrap(),
        ],
        tmp.path(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Boosted schemes past head_dim 256 panicked in `eval` and `gen --sample`, and `gen --arch`
/// compiled a kernel for a layout the reference cannot store: every command now refuses the shape
/// with kvq-spec's one reason.
#[test]
fn boosted_schemes_past_head_dim_256_are_refused_everywhere() {
    let tmp = TempDir::new("hard-boost-width");
    let reason = "boosted tensors support head_dim at most 256, got 512";
    let out = tmp.path().join("gen");
    for extra in [&["--sample"][..], &["--arch", "sm_90a"][..]] {
        let mut args = vec![
            "gen",
            "--scheme",
            "kitty",
            "--head-dim",
            "512",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        usage_error(&kvq(&args, tmp.path()), &[reason]);
        assert!(!out.join("decode.cu").exists(), "{extra:?} wrote sources");
    }
    let file = tmp.path().join("wide.safetensors");
    for d in [288usize, 512, 544] {
        write_f16(
            &file,
            &[
                ("layer.0.k", vec![300, 1, d]),
                ("layer.0.v", vec![300, 1, d]),
            ],
        );
        let o = kvq(
            &[
                "eval",
                "--scheme",
                "kitty",
                "--kv",
                file.to_str().unwrap(),
                "--cpu",
            ],
            tmp.path(),
        );
        usage_error(&o, &[&format!("at most 256, got {d}")]);
    }
}

/// The bench's measurement switches are flags, checked before any GPU is opened.
#[test]
fn bench_switches_refuse_bad_text_before_opening_a_gpu() {
    let tmp = TempDir::new("hard-switches");
    let o = kvq(&["bench", "--pieces", "7,1500"], tmp.path());
    usage_error(&o, &["--pieces `7,1500`", "PER_SPLIT,PERMILLE"]);
    let o = kvq(&["bench", "--pdl", "maybe"], tmp.path());
    usage_error(&o, &["--pdl `maybe`", "`on` or `off`"]);
}
