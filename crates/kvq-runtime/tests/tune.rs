//! The autotuner's contract through the public API: `KVQ_TUNE` parsing, the store's location and
//! JSON round trip, the candidate-set checksum in its keys, damaged files, and the candidate set
//! of the issue's shape. The tuner's GPU contract, and that the launch rules' untuned choice is
//! never slower than the tuner's beyond noise, are in `tune_gpu.rs`.

use std::fs;
use std::path::PathBuf;

use kvq_codegen::{Dtype, KernelShape, TuneParams};
use kvq_runtime::tune::{
    candidates, candidates_checksum, GpuKey, Residency, TuneChoice, TuneEntry, TunePolicy,
    TuneProblem, TuneStore, KVQ_TUNE, TUNE_FILE,
};
use kvq_runtime::{DriverVersion, RuntimeError};

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvq-tune-it-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

fn problem(batch: usize, len: usize) -> TuneProblem {
    TuneProblem::new(
        "k = int(2, channel), v = int(2, token)".parse().unwrap(),
        KernelShape::new(128, 4, Dtype::F16),
        8,
        batch,
        len,
    )
}

fn h100() -> GpuKey {
    GpuKey {
        name: "NVIDIA H100 80GB HBM3".into(),
        compute_capability: (9, 0),
        sm_count: 132,
        driver: DriverVersion {
            major: 13,
            minor: 0,
        },
    }
}

fn entry(p: &TuneProblem, splits: usize) -> TuneEntry {
    TuneEntry {
        gpu: h100(),
        problem: p.key(),
        scheme: p.spec.to_string(),
        choice: TuneChoice {
            params: TuneParams {
                threads: 128,
                tile_tokens: 64,
                min_warps_per_sm: 0,
                pack_heads: false,
                short_staging: false,
                store_scores: false,
            },
            splits,
            pieces: kvq_runtime::Pieces::NONE,
        },
        tuned_us: 100.0,
        default_us: 110.0,
        measured_batch: p.batch,
        measured_len: p.max_len,
        candidates: 45,
        rejected: 1,
        tuned_at_unix: 1_800_000_000,
        kvq_version: "0.1.0".into(),
        codebook: None,
        xquant: None,
    }
}

/// The only test here that touches the environment (tests in one binary share it).
#[test]
fn environment_selects_the_policy_and_the_store_location() {
    std::env::remove_var(KVQ_TUNE);
    assert_eq!(TunePolicy::from_env().unwrap(), TunePolicy::Cached);
    for (text, want) in [
        ("off", TunePolicy::Off),
        ("cached", TunePolicy::Cached),
        ("Full", TunePolicy::Full),
    ] {
        std::env::set_var(KVQ_TUNE, text);
        assert_eq!(TunePolicy::from_env().unwrap(), want);
    }
    std::env::set_var(KVQ_TUNE, "always");
    assert!(matches!(
        TunePolicy::from_env(),
        Err(RuntimeError::InvalidInput(m)) if m.contains("always")
    ));
    std::env::remove_var(KVQ_TUNE);

    let dir = temp_dir("env");
    std::env::set_var("KVQ_CACHE_DIR", &dir);
    assert_eq!(TuneStore::default_path().unwrap(), dir.join(TUNE_FILE));
    std::env::remove_var("KVQ_CACHE_DIR");
}

#[test]
fn results_survive_a_round_trip_keyed_by_gpu_and_bucket() {
    let dir = temp_dir("roundtrip");
    let path = dir.join(TUNE_FILE);
    let mut store = TuneStore::open(&path);
    let p = problem(16, 32_768);
    store.insert(entry(&p, 4));
    store.save().unwrap();

    let back = TuneStore::open(&path);
    assert!(back.warning().is_none());
    // Same buckets: found. Other batch bucket, other GPU: not found.
    assert_eq!(
        back.lookup(&h100(), &problem(9, 20_000).key())
            .unwrap()
            .choice
            .splits,
        4
    );
    assert!(back.lookup(&h100(), &problem(17, 32_768).key()).is_none());
    let mut h200 = h100();
    h200.name = "NVIDIA H200".into();
    assert!(back.lookup(&h200, &p.key()).is_none());
    let mut new_driver = h100();
    new_driver.driver.minor = 1;
    assert!(back.lookup(&new_driver, &p.key()).is_none());

    let text = fs::read_to_string(&path).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["format"], "kvq-tune");
    assert_eq!(json["version"], 3);
    let e = &json["entries"][0];
    assert_eq!(
        e["problem"]["candidates"],
        candidates_checksum(&p.spec, &p.shape).as_str()
    );
    assert_eq!(e["problem"]["batch_bucket"], 16);
    assert_eq!(e["problem"]["context_bucket"], 32_768);
    assert_eq!(e["problem"]["dtype"], "f16");
    assert_eq!(e["choice"]["tile_tokens"], 64);
    assert_eq!(e["choice"]["min_warps_per_sm"], 0);
    assert_eq!(e["choice"]["pack_heads"], false);
    assert_eq!(e["choice"]["short_staging"], false);
    assert_eq!(e["gpu"]["compute_capability"], serde_json::json!([9, 0]));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_corrupt_file_is_a_warning_never_an_error() {
    let dir = temp_dir("corrupt");
    fs::create_dir_all(&dir).unwrap();
    let path = dir.join(TUNE_FILE);
    fs::write(&path, "{ this is not json").unwrap();
    let mut store = TuneStore::open(&path);
    assert!(store.entries().is_empty());
    assert!(store.warning().unwrap().contains("not valid JSON"));
    store.insert(entry(&problem(1, 4096), 16));
    store.save().unwrap();
    assert_eq!(TuneStore::open(&path).entries().len(), 1);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn the_issue_shape_searches_every_block_shape_around_the_heuristic_splits() {
    // An H100 holding three of the default's four-warp decode CTAs per SM: 396 resident. At 4K
    // tokens the split count stops at 32 tokens per warp (min_warp_tokens): 4096 / (32 · 4) = 32.
    for (batch, len, default_splits) in [(1, 32_768, 49), (16, 32_768, 3), (1, 4096, 32)] {
        let p = problem(batch, len);
        assert_eq!(TuneParams::default_for(&p.spec, &p.shape).threads, 128);
        let all = candidates(&p, Residency::new(132, 396));
        assert_eq!(all[0].splits, default_splits, "B={batch} L={len}");
        assert_eq!(all[0].params, TuneParams::default_for(&p.spec, &p.shape));
        assert!(all.len() >= TuneParams::candidates_for(&p.spec, &p.shape).len() * 4);
        assert!(all.iter().any(|c| c.splits < default_splits));
        assert!(all.iter().any(|c| c.splits > default_splits));
    }
}

#[test]
fn a_changed_candidate_set_misses_the_results_chosen_from_the_old_one() {
    let dir = temp_dir("checksum");
    let path = dir.join(TUNE_FILE);
    let p = problem(16, 32_768);
    let mut stale = entry(&p, 4);
    stale.problem.candidates = "0123456789abcdef".into();
    let mut store = TuneStore::open(&path);
    store.insert(stale);
    store.save().unwrap();
    let back = TuneStore::open(&path);
    assert_eq!(back.entries().len(), 1);
    assert!(back.lookup(&h100(), &p.key()).is_none());
    // The checksum follows the scheme and shape's candidate set, not the batch or length.
    assert_eq!(problem(1, 100).key().candidates, p.key().candidates);
    let int8 = TuneProblem::new(
        "k = int(8, channel, symmetric), v = int(8, channel, symmetric)"
            .parse()
            .unwrap(),
        p.shape,
        8,
        16,
        32_768,
    );
    assert_ne!(int8.key().candidates, p.key().candidates);
    let _ = fs::remove_dir_all(&dir);
}

/// A codebook scheme's result: keyed by the codebook candidate set (not the integer one), its
/// launch shape stored beside the choice, and read back although its threads and tile are not
/// integer-decode parameters.
#[test]
fn codebook_results_round_trip_under_their_own_candidate_key() {
    let commvq1: kvq_spec::SchemeSpec =
        "k = codebook(rope_commutative, levels = 64, residuals = 10, \
         pairs_per_code = 64, span = token), v = codebook(additive, rows = 128)"
            .parse()
            .unwrap();
    let p = TuneProblem::new(commvq1, KernelShape::new(128, 4, Dtype::F16), 8, 16, 32_768);
    let key = kvq_runtime::codebook::codebook_problem_key(&p).unwrap();
    assert!(key.candidates.starts_with("cb-"), "{key}");
    let params = kvq_codegen::CodebookParams {
        threads: 512,
        tile: 128,
        book_in_shared_memory: true,
    };
    let mut e = entry(&p, 12);
    e.problem = key.clone();
    e.choice.params.threads = 512;
    e.choice.params.tile_tokens = 128;
    e.codebook = Some(params);
    let dir = temp_dir("codebook");
    let path = dir.join(TUNE_FILE);
    let mut store = TuneStore::empty(&path);
    store.insert(e.clone());
    store.save().unwrap();
    let back = TuneStore::open(&path);
    assert_eq!(back.lookup(&h100(), &key), Some(&e));
    // The integer key of the same problem finds nothing.
    assert_eq!(back.lookup(&h100(), &p.key()), None);
    // A codebook entry of an impossible launch is skipped, not used.
    let mut bad = e.clone();
    bad.codebook = Some(kvq_codegen::CodebookParams {
        threads: 100,
        ..params
    });
    let mut store = TuneStore::empty(&path);
    store.insert(bad);
    assert_eq!(store.lookup(&h100(), &key), None);
    let _ = fs::remove_dir_all(&dir);
}
