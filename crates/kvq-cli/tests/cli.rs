//! The `kvq` binary as a user runs it: argument parsing, `schemes`, `gen` (files, manifest,
//! header, NVRTC check, sample), `demo` without a GPU, `eval` on a generated safetensors file,
//! `info`, and the messages and exit codes of mistakes.

mod common;
use common::{
    kvq, kvq_without_gpu, needs, plain, run_trials, text, write_f16_safetensors, TempDir,
};
use std::path::{Path, PathBuf};

use kvq::reference::synth::{random_kv, Tails};
use kvq::runtime::testing::Need;
use kvq::runtime::tune::{GpuKey, ProblemKey, TuneChoice, TuneEntry, TuneStore};
use kvq::runtime::DriverVersion;
use kvq::schemes::BUILTIN;
use serde_json::Value;

/// Runs under its own harness (`harness = false`) so the test that needs NVRTC shows as ignored,
/// with the reason, where NVRTC is missing (a failure under `KVQ_REQUIRE_NVRTC=1`).
fn main() {
    run_trials(vec![
        plain(
            "help_lists_every_subcommand_and_bad_flags_exit_2",
            help_lists_every_subcommand_and_bad_flags_exit_2,
        ),
        plain(
            "schemes_lists_every_builtin_with_text_and_bits",
            schemes_lists_every_builtin_with_text_and_bits,
        ),
        plain(
            "unknown_names_list_the_builtins_and_grammar_errors_point_at_the_column",
            unknown_names_list_the_builtins_and_grammar_errors_point_at_the_column,
        ),
        plain(
            "gen_writes_sources_header_and_manifest_for_every_gpu_builtin",
            gen_writes_sources_header_and_manifest_for_every_gpu_builtin,
        ),
        plain(
            "gen_uses_tuned_block_parameters_from_the_tune_file",
            gen_uses_tuned_block_parameters_from_the_tune_file,
        ),
        plain(
            "gen_packs_kittys_score_fragments_unless_the_flag_says_not_to",
            gen_packs_kittys_score_fragments_unless_the_flag_says_not_to,
        ),
        plain(
            "gen_takes_kivi4s_short_staging_path_only_when_the_flag_says_so",
            gen_takes_kivi4s_short_staging_path_only_when_the_flag_says_so,
        ),
        plain(
            "gen_stores_calibrated_scores_unless_the_flag_says_not_to",
            gen_stores_calibrated_scores_unless_the_flag_says_not_to,
        ),
        plain(
            "gen_says_where_untuned_launches_depend_on_the_gpus_memory",
            gen_says_where_untuned_launches_depend_on_the_gpus_memory,
        ),
        plain(
            "gen_takes_more_than_eight_query_heads_in_head_groups",
            gen_takes_more_than_eight_query_heads_in_head_groups,
        ),
        plain(
            "gen_names_the_block_of_untuned_launches_by_batch_and_context",
            gen_names_the_block_of_untuned_launches_by_batch_and_context,
        ),
        needs(
            Need::Nvrtc,
            "gen_output_compiles_with_nvrtc_for_every_gpu_builtin",
            gen_output_compiles_with_nvrtc_for_every_gpu_builtin,
        ),
        needs(
            Need::Nvrtc,
            "gen_output_compiles_from_its_files_as_the_readme_says",
            gen_output_compiles_from_its_files_as_the_readme_says,
        ),
        needs(
            Need::Nvrtc,
            "gen_xquant_output_compiles_from_its_files",
            gen_xquant_output_compiles_from_its_files,
        ),
        plain(
            "gen_sample_matches_the_manifest_layout",
            gen_sample_matches_the_manifest_layout,
        ),
        plain(
            "demo_without_a_gpu_prints_the_cpu_table_and_exits_0",
            demo_without_a_gpu_prints_the_cpu_table_and_exits_0,
        ),
        plain(
            "eval_reads_a_safetensors_capture_and_reports_every_layer_and_head",
            eval_reads_a_safetensors_capture_and_reports_every_layer_and_head,
        ),
        plain("eval_names_what_is_missing", eval_names_what_is_missing),
        plain(
            "info_reports_every_piece_and_never_fails",
            info_reports_every_piece_and_never_fails,
        ),
        plain(
            "tune_and_bench_need_a_gpu_and_say_so",
            tune_and_bench_need_a_gpu_and_say_so,
        ),
        plain(
            "bench_takes_scheme_text_beside_builtins",
            bench_takes_scheme_text_beside_builtins,
        ),
    ]);
}

fn gpu_builtins() -> Vec<&'static str> {
    BUILTIN
        .iter()
        .filter(|b| kvq::codegen::has_decode_kernel(&b.spec))
        .map(|b| b.name)
        .collect()
}

fn help_lists_every_subcommand_and_bad_flags_exit_2() {
    let tmp = TempDir::new("help");
    let o = kvq(&["--help"], tmp.path());
    let (out, _) = text(&o);
    assert!(o.status.success());
    for c in ["demo", "schemes", "gen", "tune", "bench", "info", "eval"] {
        assert!(out.contains(c), "{c} missing from help:\n{out}");
    }
    let o = kvq(&["gen", "--head-dim", "128"], tmp.path());
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("--scheme"), "{}", text(&o).1);
    let o = kvq(
        &[
            "gen",
            "--scheme",
            "kivi2",
            "--head-dim",
            "128",
            "--dtype",
            "f32",
            "--out",
            "x",
        ],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("unknown dtype `f32`"), "{}", text(&o).1);
    let o = kvq(&["demo", "--context", "4X"], tmp.path());
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("token count"), "{}", text(&o).1);
    let o = kvq(&["nonsense"], tmp.path());
    assert_eq!(o.status.code(), Some(2));
}

fn schemes_lists_every_builtin_with_text_and_bits() {
    let tmp = TempDir::new("schemes");
    let o = kvq(&["schemes"], tmp.path());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for b in BUILTIN {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("{} ", b.name)))
            .unwrap_or_else(|| panic!("no row for {}:\n{out}", b.name));
        assert!(line.contains(&b.spec.to_string()), "{line}");
    }
    assert!(out.contains("2.366"), "KIVI-2 at 32K:\n{out}");
    assert!(out.contains("CPU only") && out.contains("GPU + CPU"));
}

fn unknown_names_list_the_builtins_and_grammar_errors_point_at_the_column() {
    let tmp = TempDir::new("errors");
    let dir = tmp.path().join("out");
    let dir = dir.to_str().unwrap();
    let o = kvq(
        &[
            "gen",
            "--scheme",
            "kivi3",
            "--head-dim",
            "128",
            "--out",
            dir,
        ],
        tmp.path(),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown scheme `kivi3`"), "{err}");
    for b in BUILTIN {
        assert!(err.contains(b.name), "{} not listed: {err}", b.name);
    }
    let bad = "k = int(2, channel), v = int(2, tokn)";
    let o = kvq(
        &["gen", "--scheme", bad, "--head-dim", "128", "--out", dir],
        tmp.path(),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines[0].starts_with("error: `axis` must be one of") && lines[0].contains("column 33"),
        "{err}"
    );
    assert_eq!(lines[1], format!("  {bad}"));
    assert_eq!(lines[2], format!("  {}^^^^", " ".repeat(32)));
    // An XQuant scheme needs the model's width for its latents; other schemes refuse the flags.
    let o = kvq(
        &[
            "gen",
            "--scheme",
            "xquant2",
            "--head-dim",
            "128",
            "--out",
            dir,
        ],
        tmp.path(),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("give --kv-heads and --d-model"), "{err}");
    let o = kvq(
        &[
            "gen",
            "--scheme",
            "kivi2",
            "--head-dim",
            "128",
            "--d-model",
            "4096",
            "--out",
            dir,
        ],
        tmp.path(),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("are for XQuant schemes"), "{err}");
    // With them: the decode unit, the headers, and a manifest of the xquant family.
    let args = [
        "--head-dim",
        "128",
        "--kv-heads",
        "8",
        "--d-model",
        "4096",
        "--rebuild",
        "f32",
    ];
    let (m, _, xq) = gen_and_check("xquant-cl2", &args, &tmp);
    assert_eq!(m["family"], "xquant");
    assert_eq!(m["latent"]["rank"], 1024);
    assert_eq!(m["latent"]["rebuild"], "f32");
    assert_eq!(m["latent"]["cross_layer"], true);
    assert_eq!(
        m["layout"]["projection_file"]["format"],
        "kvq-projections-1"
    );
    assert!(xq.join("decode.cu").exists() && xq.join("include/kvq/xquant/rebuild.cuh").exists());
    let names: Vec<&str> = m["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "decode",
            "combine",
            "project_narrow",
            "project_wide",
            "project_reduce",
            "cl_delta",
            "cl_base",
            "cl_lift",
            "cl_lift_reduce"
        ]
    );
    assert!(m["layout"]["buffers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|b| b["name"] == "lift"));
    assert!(xq.join("cross_layer.cu").exists());
    // A codebook scheme: both units, the headers, and a manifest of the codebook family.
    let cb = tmp.path().join("commvq2");
    let o = kvq(
        &[
            "gen",
            "--scheme",
            "commvq2",
            "--head-dim",
            "128",
            "--out",
            cb.to_str().unwrap(),
        ],
        tmp.path(),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    for f in [
        "decode.cu",
        "encode.cu",
        "kvq_kernels.h",
        "README.md",
        "include/kvq/codebook/encode.cuh",
    ] {
        assert!(cb.join(f).is_file(), "{f} missing");
    }
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cb.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["family"], "codebook");
    assert_eq!(m["layout_version"], "kvq-codebook-layout-1");
    let roles: Vec<&str> = m["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        roles,
        [
            "decode",
            "combine",
            "store",
            "encode_k",
            "encode_v",
            "step_store",
            "step_encode_k",
            "step_encode_v",
            "step_commit",
            "set_length"
        ]
    );
    assert_eq!(m["layout"]["k"]["kind"], "rope_commutative");
    assert_eq!(m["layout"]["codebook_file"]["format"], "kvq-codebooks-1");
    let header = std::fs::read_to_string(cb.join("kvq_kernels.h")).unwrap();
    assert!(
        header.contains("KVQ_ENCODE_K_NAME")
            && header.contains("KVQ_STEP_COMMIT_NAME")
            && header.contains("double rope_theta"),
        "{header}"
    );
    // A shape the scheme cannot hold.
    let o = kvq(
        &[
            "gen",
            "--scheme",
            "kivi2",
            "--head-dim",
            "100",
            "--out",
            dir,
        ],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(!Path::new(dir).join("decode.cu").exists());
}

/// Generates into a fresh folder and checks the files, manifest and header against each other.
fn gen_and_check(scheme: &str, args: &[&str], tmp: &TempDir) -> (Value, String, PathBuf) {
    let dir = tmp
        .path()
        .join(scheme.replace(|c: char| !c.is_alphanumeric(), "_"));
    let d = dir.to_str().unwrap();
    let mut all = vec!["gen", "--scheme", scheme, "--out", d];
    all.extend_from_slice(args);
    let o = kvq(&all, tmp.path());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{scheme}: {out}\n{err}");
    for f in ["decode.cu", "kvq_kernels.h", "manifest.json"] {
        assert!(dir.join(f).is_file(), "{scheme}: {f} missing");
        assert!(out.contains(&format!("wrote {f}")), "{out}");
    }
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap())
            .expect("manifest parses");
    let header = std::fs::read_to_string(dir.join("kvq_kernels.h")).unwrap();
    assert!(header.is_ascii());
    assert_eq!(manifest["format"], "kvq-gen");
    assert_eq!(manifest["layout_version"], "kvq-layout-2");
    let kernels = manifest["kernels"].as_array().unwrap();
    assert!(kernels.len() >= 2);
    for k in kernels {
        let name = k["name"].as_str().unwrap();
        let params = k["params"].as_array().unwrap();
        let role = k["role"].as_str().unwrap();
        assert!(
            header.contains(&format!("typedef struct kvq_{role}_params {{")),
            "{role} has no parameter struct"
        );
        assert!(
            header.contains(&format!(
                "#define KVQ_{}_NAME \"{name}\"",
                role.to_ascii_uppercase()
            )),
            "{role}'s _NAME does not give the entry point {name}"
        );
        let signature: Vec<String> = params
            .iter()
            .map(|p| {
                format!(
                    "{} {}",
                    p["c_type"].as_str().unwrap(),
                    p["name"].as_str().unwrap()
                )
            })
            .collect();
        assert!(
            header.contains(&format!(
                "__global__ void {name}({});",
                signature.join(", ")
            )),
            "{name} not declared with its parameters"
        );
        assert!(header.contains(&format!("_NUM_PARAMS {}", params.len())));
        // The unit the manifest names (decode.cu, cache.cu, project.cu, …).
        let file = k["file"].as_str().unwrap();
        let source = std::fs::read_to_string(dir.join(file))
            .unwrap_or_else(|e| panic!("{name}'s unit {file}: {e}"));
        assert!(
            source.contains(&format!("{name}(")),
            "{name} not in {}",
            k["file"]
        );
        // The source's parameters, in order, have the manifest's names.
        let at = source.find(&format!("{name}(")).unwrap();
        let body = &source[at..at + source[at..].find(')').unwrap()];
        let mut last = 0;
        for p in params {
            let n = p["name"].as_str().unwrap();
            let pos = body[last..]
                .find(&format!(" {n}"))
                .unwrap_or_else(|| panic!("{name}: parameter {n} out of order in the source"));
            last += pos + n.len();
        }
        assert_eq!(k["block"][1], 1);
    }
    (manifest, out, dir)
}

/// The decode kernel's pieces as the manifest and header describe them: its last parameters
/// (then `out`, for a launch of one part), its grid, the scratch shapes, combine's `num_parts`,
/// and `runs_pieces` on the decode kernel only, matching the header's define.
fn check_pieces(m: &Value, dir: &Path) {
    let kernels = m["kernels"].as_array().unwrap();
    let role = |r: &str| kernels.iter().find(|k| k["role"] == r).unwrap();
    let names = |k: &Value| -> Vec<String> {
        k["params"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap().to_string())
            .collect()
    };
    let decode = role("decode");
    assert!(
        names(decode).ends_with(&[
            "num_pieces".to_string(),
            "piece_permille".to_string(),
            "out".to_string()
        ]),
        "{:?}",
        names(decode)
    );
    assert_eq!(decode["grid"][0], "num_splits + num_pieces");
    assert_eq!(names(role("combine")).last().unwrap(), "num_parts");
    // The range grid has its own split count, which decode takes to reduce its ranges.
    assert!(names(decode).contains(&"range_splits".to_string()));
    if let Some(range) = kernels.iter().find(|k| k["role"] == "score_range") {
        assert_eq!(range["grid"][0], "range_splits");
    }
    let range_rule = m["launch"]["range_splits"].as_str().unwrap();
    assert!(
        range_rule.contains("num_splits above 16 splits, else max(num_splits, ⌊num_splits·R/D⌋)"),
        "{range_rule}"
    );
    let ranges = m["launch"]["scratch"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == "score_range")
        .unwrap();
    assert_eq!(ranges["shape"], "[batch][kv_heads][gqa][range_splits][2]");
    for k in kernels {
        if k["file"] == "decode.cu" {
            for p in k["params"].as_array().unwrap() {
                assert_ne!(
                    p["about"], "",
                    "{} {}: no description",
                    k["role"], p["name"]
                );
            }
        }
        if k["role"] != "decode" {
            assert!(k.get("runs_pieces").is_none(), "{}", k["role"]);
        }
    }
    let runs = decode["runs_pieces"]
        .as_bool()
        .expect("decode has runs_pieces");
    // The default pieces an engine reproduces: the kernel's piece rule where it runs pieces (per
    // split where warp shares are long for 8-bit codes, per (sequence, KV head) where splits are
    // few for uncalibrated codes of at most 2 bits), none else.
    let rules = &m["tune"]["rules"];
    let pieces = rules["pieces"].as_str().unwrap();
    assert_eq!(pieces != "none", runs, "{pieces}");
    if runs {
        let bits = |t: &str| m["layout"][t]["bits"].as_u64();
        let (kb, vb) = (bits("k"), bits("v"));
        assert_eq!(
            pieces == "long_shares",
            kb.is_some_and(|b| b >= 8) && vb.is_some_and(|b| b >= 8),
            "{pieces} {kb:?} {vb:?}"
        );
    }
    // Split warps of quantized kernels may take half a chunk at short buckets.
    if ["k", "v"].iter().any(|t| m["layout"][*t]["bits"].is_u64()) {
        assert_eq!(rules["short_warps"], true, "{rules}");
    }
    let header = std::fs::read_to_string(dir.join("kvq_kernels.h")).unwrap();
    assert!(
        header.contains(&format!("_DECODE_RUNS_PIECES {}\n", u8::from(runs))),
        "header lacks the decode kernel's _RUNS_PIECES"
    );
    let scratch = m["launch"]["scratch"].as_array().unwrap();
    for n in ["part_acc", "part_ml"] {
        let b = scratch.iter().find(|b| b["name"] == n).unwrap();
        let shape = b["shape"].as_str().unwrap();
        assert!(shape.contains("[num_splits + num_pieces]"), "{n}: {shape}");
    }
    assert!(m["launch"]["num_pieces"]
        .as_str()
        .unwrap()
        .contains("num_pieces = 0"));
}

fn gen_writes_sources_header_and_manifest_for_every_gpu_builtin() {
    let tmp = TempDir::new("gen");
    for name in gpu_builtins() {
        let (m, _, dir) = gen_and_check(
            name,
            &["--head-dim", "128", "--gqa", "4", "--dtype", "bf16"],
            &tmp,
        );
        assert!(dir.join("cache.cu").is_file());
        assert_eq!(m["scheme"]["name"], name);
        assert_eq!(m["shape"]["gqa"], 4);
        assert_eq!(m["shape"]["dtype"], "bf16");
        assert_eq!(m["tune"]["source"], "default");
        // Layout numbers are the reference's.
        let spec = kvq::schemes::by_name(name).unwrap().spec;
        for (t, q) in [("k", spec.k), ("v", spec.v)] {
            let want = match q.as_int() {
                Some(iq) => {
                    kvq::reference::int::IntLayout::new(iq, 128, 128)
                        .unwrap()
                        .block_bytes
                }
                None => kvq::reference::int::fp16_block_bytes(128, 128),
            };
            assert_eq!(m["layout"][t]["block_bytes"], want, "{name} {t}");
        }
        let steps: Vec<&str> = m["launch"]["decode_steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap())
            .collect();
        if spec.calibrate.is_some() {
            assert_eq!(steps, ["score_range", "decode", "combine"]);
        } else {
            assert_eq!(steps, ["decode", "combine"]);
        }
        check_pieces(&m, &dir);
    }
    // Scheme text works too, and head_dim 512 has decode kernels only.
    let (m, out, dir) = gen_and_check(
        "k = int(3, channel), v = int(4, token, group = 32), sink = 16",
        &["--head-dim", "512"],
        &tmp,
    );
    assert!(m["scheme"]["name"].is_null());
    assert!(!dir.join("cache.cu").exists());
    assert!(out.contains("no cache kernels written"), "{out}");
}

fn gen_uses_tuned_block_parameters_from_the_tune_file() {
    let tmp = TempDir::new("tuned");
    let spec = kvq::schemes::by_name("kivi2").unwrap().spec;
    let file = tmp.path().join("tune.json");
    let mut store = TuneStore::empty(&file);
    store.insert(TuneEntry {
        gpu: GpuKey {
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            driver: DriverVersion {
                major: 13,
                minor: 0,
            },
        },
        problem: ProblemKey {
            scheme_hash: format!("{:016x}", spec.stable_hash()),
            head_dim: 128,
            gqa: 4,
            dtype: kvq::codegen::Dtype::F16,
            kv_heads: 8,
            batch_bucket: 16,
            context_bucket: 32768,
            candidates: kvq::runtime::tune::candidates_checksum(
                &spec,
                &kvq::codegen::KernelShape::new(128, 4, kvq::codegen::Dtype::F16),
            ),
        },
        scheme: spec.to_string(),
        choice: TuneChoice {
            params: kvq::codegen::TuneParams {
                threads: 256,
                tile_tokens: 16,
                min_warps_per_sm: 0,
                pack_heads: true,
                short_staging: false,
                store_scores: false,
            },
            splits: 3,
            pieces: kvq::runtime::Pieces::NONE,
        },
        tuned_us: 190.0,
        default_us: 200.0,
        measured_batch: 16,
        measured_len: 32768,
        candidates: 45,
        rejected: 0,
        tuned_at_unix: 1,
        kvq_version: "0.1.0".into(),
        codebook: None,
        xquant: None,
    });
    store.save().unwrap();
    let (m, _, dir) = gen_and_check(
        "kivi2",
        &["--head-dim", "128", "--gqa", "4"],
        &tmp, // tune.json sits in KVQ_CACHE_DIR
    );
    assert_eq!(m["tune"]["source"], "tuned");
    assert_eq!(m["tune"]["threads"], 256);
    let tuned = &m["tune"]["tuned"][0];
    assert_eq!(tuned["splits"], 3);
    assert_eq!(tuned["num_pieces"], 0);
    assert_eq!(tuned["matches_source"], true);
    let decode = std::fs::read_to_string(dir.join("decode.cu")).unwrap();
    assert!(decode.contains("threads=256 tile_tokens=16"));
    // Flags win; another shape has no tuned entry.
    let (m, _, _) = gen_and_check(
        "kivi2",
        &["--head-dim", "128", "--gqa", "4", "--threads", "64"],
        &tmp,
    );
    assert_eq!(m["tune"]["source"], "flags");
    assert_eq!(m["tune"]["threads"], 64);
    assert_eq!(m["tune"]["tuned"][0]["matches_source"], false);
    // kivi2's default holds twelve warps an SM; the flag lifts the floor, in the source too.
    assert_eq!(m["tune"]["min_warps_per_sm"], 12);
    let (m, _, dir) = gen_and_check(
        "kivi2",
        &["--head-dim", "128", "--gqa", "4", "--min-warps-per-sm", "0"],
        &tmp,
    );
    assert_eq!(m["tune"]["source"], "flags");
    assert_eq!(m["tune"]["min_warps_per_sm"], 0);
    assert_eq!(m["tune"]["tuned"][0]["min_warps_per_sm"], 0);
    let decode = std::fs::read_to_string(dir.join("decode.cu")).unwrap();
    assert!(
        decode.contains("static constexpr int MIN_CTAS = 1,"),
        "{decode}"
    );
    assert!(decode.contains("min_ctas_per_sm=1"));
    let (m, _, _) = gen_and_check("kivi2", &["--head-dim", "64"], &tmp);
    assert_eq!(m["tune"]["source"], "default");
    assert!(m["tune"]["tuned"].as_array().unwrap().is_empty());
}

/// Generates `scheme` at head_dim 128, GQA 4 with `flag` (none: the default) and checks that the
/// manifest's `tune.<field>` and the header's `<field>=` say `value`, and that the block
/// parameters came from `source`; returns the manifest and the decode source.
fn gen_with_tune_flag(
    scheme: &str,
    flag: &[&str],
    field: &str,
    value: bool,
    source: &str,
    tmp: &TempDir,
) -> (Value, String) {
    let at_gqa4 = ["--head-dim", "128", "--gqa", "4"];
    let (m, _, dir) = gen_and_check(scheme, &[&at_gqa4[..], flag].concat(), tmp);
    assert_eq!(m["tune"]["source"], source);
    assert_eq!(m["tune"][field], value);
    let header = std::fs::read_to_string(dir.join("kvq_kernels.h")).unwrap();
    assert!(header.contains(&format!("{field}={value}")), "{header}");
    let decode = std::fs::read_to_string(dir.join("decode.cu")).unwrap();
    (m, decode)
}

fn gen_packs_kittys_score_fragments_unless_the_flag_says_not_to() {
    let tmp = TempDir::new("pack");
    for (flag, packs, source) in [
        (&[][..], true, "default"),
        (&["--pack-heads", "false"][..], false, "flags"),
    ] {
        let (_, decode) = gen_with_tune_flag("kitty", flag, "pack_heads", packs, source, &tmp);
        assert!(decode.contains(&format!("static constexpr bool KVQ_PACK = {packs};")));
    }
}

fn gen_takes_kivi4s_short_staging_path_only_when_the_flag_says_so() {
    let tmp = TempDir::new("staging");
    for (flag, short, source) in [
        (&[][..], false, "default"),
        (&["--short-staging", "true"][..], true, "flags"),
    ] {
        let (m, decode) = gen_with_tune_flag("kivi4", flag, "short_staging", short, source, &tmp);
        // The unit states which staging path the headers compile (the short one keeps no skews).
        assert!(
            decode.contains(&format!("static constexpr bool KVQ_QUANT_FAST = {short}")),
            "{decode}"
        );
        // The runtime's untuned rule, for engines that pick between the two builds.
        let rules = &m["tune"]["rules"];
        assert_eq!(rules["default"]["short_staging_choice"], true, "{rules}");
        assert_eq!(rules["constants"]["short_staging_min_warp_tokens"], 4096);
    }
    let (m, _) = gen_with_tune_flag("kivi2", &[], "short_staging", false, "default", &tmp);
    assert_eq!(m["tune"]["rules"]["default"]["short_staging_choice"], false);
}

fn gen_stores_calibrated_scores_unless_the_flag_says_not_to() {
    let tmp = TempDir::new("stored");
    for (flag, stored, source) in [
        (&[][..], true, "default"),
        (&["--store-scores", "false"][..], false, "flags"),
    ] {
        let (m, decode) =
            gen_with_tune_flag("calibquant1", flag, "store_scores", stored, source, &tmp);
        assert_eq!(m["launch"]["stores_scores"], stored);
        assert!(decode.contains(&format!("static constexpr bool KVQ_STORED = {stored};")));
        // The scratch an engine allocates: sized where the kernels store scores.
        let scratch = m["launch"]["scratch"].as_array().unwrap();
        let scores = scratch.iter().find(|b| b["name"] == "scores").unwrap();
        assert_eq!(
            scores["shape"].as_str().unwrap().contains("max_pages·128"),
            stored,
            "{scores}"
        );
        let rules = &m["tune"]["rules"];
        assert_eq!(rules["default"]["store_scores"], true, "{rules}");
        assert_eq!(rules["constants"]["short_context_bucket"], 4096);
    }
    // Past GQA 4 only 1-bit keys keep storing their scores by default.
    for (scheme, any_gqa) in [("calibquant2", false), ("calibquant1", true)] {
        let (m, _, _) = gen_and_check(scheme, &["--head-dim", "128", "--gqa", "8"], &tmp);
        let rules = &m["tune"]["rules"];
        assert_eq!(rules["stored_scores_any_gqa"], any_gqa, "{scheme}");
        assert_eq!(rules["cta_gqa"], 8, "{scheme}");
        assert_eq!(rules["constants"]["stored_scores_max_gqa"], 4, "{scheme}");
    }
    let (m, _) = gen_with_tune_flag("kivi2", &[], "store_scores", false, "default", &tmp);
    assert_eq!(m["launch"]["stores_scores"], false);
    assert_eq!(m["tune"]["rules"]["default"]["store_scores"], false);
}

fn gen_says_where_untuned_launches_depend_on_the_gpus_memory() {
    let tmp = TempDir::new("fast-memory");
    // Whether any block of the scheme's rules changes on fast memory.
    let fast_of = |scheme: &str, head_dim: &str| {
        let args = ["--head-dim", head_dim, "--gqa", "4"];
        let (m, _, _) = gen_and_check(scheme, &args, &tmp);
        let rules = &m["tune"]["rules"];
        assert_eq!(rules["constants"]["fast_memory_gbps_per_sm"], 30.0);
        std::iter::once(&rules["default"])
            .chain(
                rules["rules"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| &r["block"]),
            )
            .any(|b| b["fast_memory"].as_array().is_some_and(|f| !f.is_empty()))
    };
    assert!(fast_of("kivi4", "128"));
    assert!(!fast_of("kivi4", "64"));
    assert!(!fast_of("kivi2", "128"));
    assert!(!fast_of("int8", "128"));
}

fn gen_takes_more_than_eight_query_heads_in_head_groups() {
    let tmp = TempDir::new("head-groups");
    let (m, _, dir) = gen_and_check("calibquant1", &["--head-dim", "128", "--gqa", "16"], &tmp);
    assert_eq!(m["version"], 5);
    let header = std::fs::read_to_string(dir.join("kvq_kernels.h")).unwrap();
    let decode_source = std::fs::read_to_string(dir.join("decode.cu")).unwrap();
    assert!(decode_source.contains("gqa=16 (2 head groups of 8)"));
    for role in ["decode", "score_range"] {
        let k = m["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|k| k["role"] == role)
            .unwrap_or_else(|| panic!("no {role} kernel"));
        assert_eq!(k["grid"][1], "kv_heads * 2", "{role}");
        assert!(header.contains("kv_heads * 2"), "the header names the grid");
    }
    let notes = m["launch"]["notes"].to_string();
    assert!(notes.contains("2 grid rows a KV head"), "{notes}");
    assert_eq!(m["tune"]["rules"]["grid_rows"], 2);
    assert_eq!(m["launch"]["score_columns"], 16);
    // Uneven groups: the last row starts early, and the stored scores take every row's columns.
    let (m, _, dir) = gen_and_check("calibquant1", &["--head-dim", "128", "--gqa", "11"], &tmp);
    let decode_source = std::fs::read_to_string(dir.join("decode.cu")).unwrap();
    assert!(decode_source
        .contains("gqa=11 (2 head groups of 6, the last sharing 1 with the one before)"));
    assert_eq!(m["kernels"][0]["grid"][1], "kv_heads * 2");
    assert_eq!(m["launch"]["score_columns"], 12);
    let notes = m["launch"]["notes"].to_string();
    assert!(
        notes.contains("the last row starts at query head gqa − 6 of its KV head"),
        "{notes}"
    );
    // Without head groups the manifest says nothing of them.
    let (m, _, _) = gen_and_check("calibquant1", &["--head-dim", "128", "--gqa", "8"], &tmp);
    assert_eq!(m["kernels"][0]["grid"][1], "kv_heads");
    assert!(!m["launch"]["notes"]
        .to_string()
        .contains("grid rows a KV head"));
    assert_eq!(m["launch"]["score_columns"], 8);
    assert_eq!(m["tune"]["rules"]["grid_rows"], 1);
}

/// A count of `v` (a JSON number).
fn count(v: &Value) -> usize {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}")) as usize
}

/// Whether `x` is in the span `{min, max?}`.
fn within(span: &Value, x: usize) -> bool {
    x >= count(&span["min"]) && span.get("max").map_or(true, |m| x <= count(m))
}

/// The next power of two at least `x`.
fn pow2(x: usize) -> usize {
    x.next_power_of_two()
}

/// The untuned launch `tune.rules` gives, evaluated from the JSON alone as
/// `tune.rules_evaluation` says (as an engine would): (threads, tile_tokens, min_warps_per_sm,
/// pack_heads, short_staging, store_scores, num_splits, num_pieces, piece_permille).
/// `per_sm`: CTAs an SM of the occupancy block's kernel.
#[allow(clippy::too_many_arguments)]
fn evaluate_rules(
    r: &Value,
    batch: usize,
    kv_heads: usize,
    max_len: usize,
    sms: usize,
    per_sm: usize,
    fast: bool,
) -> (u64, u64, u64, bool, bool, bool, usize, usize, usize) {
    let c = &r["constants"];
    let k = |name: &str| count(&c[name]);
    let pairs = batch * kv_heads * count(&r["grid_rows"]);
    let bucket = pow2(max_len.max(1));
    let rule_bucket = pow2(max_len.max(k("min_rule_bucket")));
    let warps_of = |b: &Value| count(&b["threads"]) / 32;
    let (mut rule, mut how) = (None, "");
    for row in r["rules"].as_array().unwrap() {
        let (w, b) = (&row["when"], &row["block"]);
        let applies = match w["kind"].as_str().unwrap() {
            "whole_pairs" => {
                let waves = pairs.div_ceil(sms);
                pairs > 0
                    && 1000 * pairs >= k("whole_pairs_fill_permille") * waves * sms
                    && within(&w["waves"], waves)
                    && within(&w["buckets"], rule_bucket)
            }
            "one_tile" => {
                let s = rule_bucket / (count(&b["tile_tokens"]) * warps_of(b));
                let floor = (count(&b["min_warps_per_sm"]) / warps_of(b)).max(1);
                within(&w["pairs"], pairs)
                    && (1..=k("max_splits")).contains(&s)
                    && pairs * s <= floor * sms
            }
            _ => within(&w["pairs"], pairs) && within(&w["buckets"], rule_bucket),
        };
        if applies {
            how = w["kind"].as_str().unwrap();
            if how == "few_pairs" && w["splits_from_default"] == true {
                how = "few_pairs_default";
            }
            rule = Some(b);
            break;
        }
    }
    let block = rule.unwrap_or(&r["default"]);
    let warps = warps_of(block);
    let warp_tokens = if r["short_warps"] == true && bucket <= k("short_context_bucket") {
        k("short_warp_tokens")
    } else {
        k("warp_tokens")
    };
    let splits_for = |slots: usize, warps: usize| {
        let most = (bucket / (warp_tokens * warps)).clamp(1, k("most_splits"));
        let lo = (k("fill_permille") * slots)
            .div_ceil(1000 * pairs)
            .clamp(1, most);
        (lo..=(2 * lo).min(most))
            .max_by_key(|&s| {
                let waves = (pairs * s).div_ceil(slots);
                (1000 * pairs * s / (waves * slots), std::cmp::Reverse(s))
            })
            .unwrap()
    };
    let mut splits = match how {
        "whole_pairs" => 1,
        "one_tile" => rule_bucket / (count(&block["tile_tokens"]) * warps),
        _ => splits_for(per_sm * sms, warps),
    };
    let short = block["short_staging_choice"] == true
        && (block["short_staging"] == true
            || bucket / (splits * warps) >= k("short_staging_min_warp_tokens"));
    let stored = block["store_scores"] == true
        && (how == "whole_pairs"
            || (bucket > k("short_context_bucket")
                && (count(&r["cta_gqa"]) <= k("stored_scores_max_gqa")
                    || r["stored_scores_any_gqa"] == true)));
    let (mut floor, mut tile, mut short) = (
        block["min_warps_per_sm"].as_u64().unwrap(),
        block["tile_tokens"].as_u64().unwrap(),
        short,
    );
    let entry = block["fast_memory"].as_array().and_then(|f| {
        f.iter()
            .find(|e| e["short_staging"] == short && e["store_scores"] == stored)
    });
    if let Some(e) = entry.filter(|_| fast && !["whole_pairs", "one_tile"].contains(&how)) {
        let twelve = k("fast_memory_warps_per_sm");
        let s12 = splits_for(sms * (twelve / warps), warps).max(1);
        let share = bucket / (s12 * warps);
        if share >= k("fast_memory_min_warp_tokens") {
            floor = twelve as u64;
            short = true;
            if e["tile64"] == true && share >= k("fast_memory_tile64_min_warp_tokens") {
                tile = 64;
            }
            splits = s12;
        }
    }
    let share = bucket / (splits * warps);
    let (pieces, permille) = match r["pieces"].as_str().unwrap() {
        _ if how == "whole_pairs" => (0, 0),
        "long_shares" if share >= k("long_shares_min_warp_tokens") => (
            k("long_shares_per_split") * splits,
            k("long_shares_permille"),
        ),
        "few_splits"
            if splits * warps <= k("few_splits_max_warps")
                && share >= k("few_splits_min_warp_tokens") =>
        {
            (k("few_splits_count"), k("few_splits_permille"))
        }
        _ => (0, 0),
    };
    (
        block["threads"].as_u64().unwrap(),
        tile,
        floor,
        block["pack_heads"] == true,
        short,
        stored,
        splits,
        pieces,
        permille,
    )
}

/// `kvq gen` writes the untuned launch rules as data (`tune.rules`): evaluated from the JSON alone,
/// as `tune.rules_evaluation` says, they give the runtime's untuned launch (block, split count,
/// pieces, staging path, stored scores, fast-memory occupancy) over a grid of batches, lengths,
/// SM counts, occupancies and memory speeds, for every GPU built-in at several shapes.
fn gen_names_the_block_of_untuned_launches_by_batch_and_context() {
    use kvq::runtime::tune::{Residency, TuneProblem};
    let tmp = TempDir::new("block");
    let mut compared = 0;
    for name in gpu_builtins() {
        for (head_dim, gqa) in [(128, 4), (128, 16), (64, 8), (256, 4)] {
            let args = [
                "--head-dim",
                &head_dim.to_string(),
                "--gqa",
                &gqa.to_string(),
            ];
            let (m, _, _) = gen_and_check(name, &args, &tmp);
            let rules = &m["tune"]["rules"];
            assert!(
                m["tune"]["rules_evaluation"]
                    .as_array()
                    .is_some_and(|e| !e.is_empty()),
                "{name}"
            );
            let spec = kvq::schemes::by_name(name).unwrap().spec;
            let shape = kvq::codegen::KernelShape::new(head_dim, gqa, kvq::codegen::Dtype::F16);
            for batch in [1, 2, 4, 8, 16, 24, 32, 64] {
                for max_len in [100, 512, 1024, 2048, 4096, 8192, 32768, 131072] {
                    for (sms, per_sm, fast) in [(132, 3, false), (132, 2, true), (114, 6, false)] {
                        let p = TuneProblem::new(spec, shape, 8, batch, max_len);
                        let h = kvq::runtime::tune::TuneChoice::heuristic(
                            &p,
                            Residency::new(sms, per_sm * sms).with_fast_memory(fast),
                        );
                        let want = (
                            u64::from(h.params.threads),
                            u64::from(h.params.tile_tokens),
                            u64::from(h.params.min_warps_per_sm),
                            h.params.pack_heads,
                            h.params.short_staging,
                            h.params.store_scores,
                            h.splits,
                            h.pieces.count,
                            h.pieces.permille as usize,
                        );
                        assert_eq!(
                            evaluate_rules(rules, batch, 8, max_len, sms, per_sm, fast),
                            want,
                            "{name} d{head_dim} gqa {gqa} B={batch} L={max_len} {sms} SMs"
                        );
                        compared += 1;
                    }
                }
            }
        }
    }
    assert!(compared > 1000, "{compared}");
}

fn gen_output_compiles_with_nvrtc_for_every_gpu_builtin() {
    let tmp = TempDir::new("nvrtc");
    for name in gpu_builtins() {
        let (m, out, dir) = gen_and_check(
            name,
            &["--head-dim", "128", "--gqa", "4", "--arch", "sm_90a"],
            &tmp,
        );
        for f in ["decode", "cache"] {
            assert!(
                out.contains(&format!("compiled {f}.cu for sm_90a with NVRTC")),
                "{name}: {out}"
            );
            assert!(dir.join(format!("{f}.sm_90a.cubin")).is_file());
        }
        assert_eq!(m["compiled"].as_array().unwrap().len(), 2);
    }
    let o = kvq(
        &[
            "gen",
            "--scheme",
            "kivi2",
            "--head-dim",
            "128",
            "--out",
            tmp.path().join("x").to_str().unwrap(),
            "--arch",
            "sm_1x",
        ],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("--arch"), "{}", text(&o).1);
}

/// What an engine does with the output: kitty at d128, its units compiled with NVRTC from the
/// written files alone, the headers found through `--include-path=<out>/include` as the README
/// says (no in-memory header), for sm_80 and sm_90a.
fn gen_output_compiles_from_its_files_as_the_readme_says() {
    use kvq::runtime::nvrtc::{compile, IncludeDirs};
    use kvq::runtime::{Arch, CompileOptions, Output, Source};
    let tmp = TempDir::new("gen-files");
    let (m, _, dir) = gen_and_check("kitty", &["--head-dim", "128", "--gqa", "4"], &tmp);
    assert_eq!(m["files"]["include"], "include/");
    let readme = std::fs::read_to_string(dir.join(m["files"]["readme"].as_str().unwrap())).unwrap();
    assert!(
        readme.contains("--include-path=<this folder>/include"),
        "{readme}"
    );
    let include = dir.join("include");
    // Every kernel header is written, byte for byte the one kvq compiles with.
    let mut shipped = 0;
    for (name, text) in kvq::codegen::kernel_headers() {
        let written = std::fs::read_to_string(include.join(name)).unwrap();
        assert_eq!(&written, text, "{name}");
        shipped += 1;
    }
    assert!(shipped >= 5, "{shipped} headers");
    let options = CompileOptions::default().include_dirs(IncludeDirs::Only(vec![include]));
    for file in ["decode.cu", "cache.cu"] {
        let code = std::fs::read_to_string(dir.join(file)).unwrap();
        assert!(
            code.contains("#include \"kvq/"),
            "{file} includes no kvq header"
        );
        let source = Source::new(file, code);
        for arch in [Arch::SM_80, Arch::SM_90A] {
            let c = compile(&source, arch, Output::Cubin, &options)
                .unwrap_or_else(|e| panic!("{file} for {arch} from the written files: {e}"));
            assert!(!c.image.is_empty());
        }
    }
}

/// An XQuant scheme's folder: its decode unit compiles from the written headers alone, for sm_80
/// and sm_90a, at both rebuild precisions, and the C header names the latent width. With
/// `--arch sm_90a` the f16 rebuild runs on warpgroup MMAs (that unit compiles for sm_90a only).
fn gen_xquant_output_compiles_from_its_files() {
    use kvq::runtime::nvrtc::{compile, IncludeDirs};
    use kvq::runtime::{Arch, CompileOptions, Output, Source};
    let tmp = TempDir::new("gen-xquant");
    for (scheme, rebuild) in [("xquant2", "f16"), ("xquant-cl2", "f32")] {
        let dir = tmp.path().join(scheme);
        let o = kvq(
            &[
                "gen",
                "--scheme",
                scheme,
                "--head-dim",
                "128",
                "--gqa",
                "4",
                "--kv-heads",
                "8",
                "--d-model",
                "4096",
                "--rebuild",
                rebuild,
                "--out",
                dir.to_str().unwrap(),
            ],
            tmp.path(),
        );
        let (_, err) = text(&o);
        assert!(o.status.success(), "{err}");
        let header = std::fs::read_to_string(dir.join("kvq_kernels.h")).unwrap();
        assert!(header.contains("#define KVQ_LATENT_RANK 1024"), "{header}");
        let options =
            CompileOptions::default().include_dirs(IncludeDirs::Only(vec![dir.join("include")]));
        // Both carry the cache writes' projection; XQuant-CL also its steps around it.
        let units: &[&str] = if scheme == "xquant2" {
            assert!(!dir.join("cross_layer.cu").exists());
            &["decode.cu", "project.cu"]
        } else {
            &["decode.cu", "project.cu", "cross_layer.cu"]
        };
        assert!(header.contains("kvq_xquant_project_wide_"), "{header}");
        assert_eq!(
            header.contains("kvq_xquant_cl_lift_reduce_"),
            scheme == "xquant-cl2",
            "{header}"
        );
        for unit in units {
            let source = Source::new(*unit, std::fs::read_to_string(dir.join(unit)).unwrap());
            for arch in [Arch::SM_80, Arch::SM_90A] {
                let c = compile(&source, arch, Output::Cubin, &options).unwrap_or_else(|e| {
                    panic!("{scheme} {unit} for {arch} from the written files: {e}")
                });
                assert!(!c.image.is_empty());
            }
        }
        let m: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap())
                .unwrap();
        assert_eq!(m["latent"]["mma"], "mma.sync");
    }
    // Hopper's folder: the warpgroup rebuild, its 384 threads, compiled by `--arch` itself (and
    // its manifest and header checked against each other).
    let hopper = TempDir::new("gen-xquant-sm90a");
    let args = [
        "--head-dim",
        "128",
        "--gqa",
        "4",
        "--kv-heads",
        "8",
        "--d-model",
        "4096",
        "--arch",
        "sm_90a",
    ];
    let (m, out, dir) = gen_and_check("xquant2", &args, &hopper);
    assert_eq!(m["latent"]["mma"], "wgmma");
    let decode = m["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["role"] == "decode")
        .unwrap_or_else(|| panic!("no decode kernel: {m}"));
    assert_eq!(decode["block"][0], 384, "{decode}");
    // The projection buffers name the K order the rebuild's fragments read up_k in.
    let text = m.to_string();
    assert!(
        text.contains("order = [0, 8, 2, 10, 4, 12, 6, 14, 1, 9, 3, 11, 5, 13, 7, 15]"),
        "{text}"
    );
    assert!(dir.join("decode.sm_90a.cubin").exists(), "{out}");
    let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
    assert!(readme.contains("sm_90a only"), "{readme}");
}

fn gen_sample_matches_the_manifest_layout() {
    let tmp = TempDir::new("sample");
    let (m, _, dir) = gen_and_check(
        "kitty",
        &[
            "--head-dim",
            "64",
            "--gqa",
            "2",
            "--sample",
            "--sample-lengths",
            "5,200,700",
        ],
        &tmp,
    );
    assert_eq!(m["sample"], "sample");
    let s: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("sample/sample.json")).unwrap())
            .unwrap();
    assert_eq!(s["batch"], 3);
    assert_eq!(s["q_heads"], 4);
    let size = |e: &str| match e {
        "u8" => 1,
        "i32" | "f32" => 4,
        _ => 2,
    };
    for f in s["files"].as_array().unwrap() {
        let bytes = std::fs::metadata(dir.join("sample").join(f["file"].as_str().unwrap()))
            .unwrap()
            .len() as usize;
        let n: usize = f["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .product();
        let want = (n * size(f["element"].as_str().unwrap())).max(1);
        assert!(
            bytes == want || (n == 0 && bytes <= 2),
            "{}: {bytes} bytes, shape gives {want}",
            f["name"]
        );
    }
    let block = m["layout"]["k"]["block_bytes"].as_u64().unwrap() as usize;
    let pool = &s["files"][0];
    assert_eq!(pool["name"], "k_pool");
    assert_eq!(pool["shape"][2].as_u64().unwrap() as usize, block);
    // A later run into the same folder without --sample leaves no stale sample behind.
    let o = kvq(
        &[
            "gen",
            "--scheme",
            "kivi2",
            "--head-dim",
            "64",
            "--out",
            dir.to_str().unwrap(),
        ],
        tmp.path(),
    );
    assert!(o.status.success());
    let expected = std::fs::read(dir.join("sample/expected.bin"));
    assert!(expected.is_err(), "stale sample left behind");
    let (_, _, dir) = gen_and_check(
        "kitty",
        &[
            "--head-dim",
            "64",
            "--gqa",
            "2",
            "--sample",
            "--sample-lengths",
            "5,200,700",
        ],
        &tmp,
    );
    let expected = std::fs::read(dir.join("sample/expected.bin")).unwrap();
    assert_eq!(expected.len(), 3 * 4 * 64 * 4);
    assert!(expected
        .chunks_exact(4)
        .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite()));
}

fn demo_without_a_gpu_prints_the_cpu_table_and_exits_0() {
    let tmp = TempDir::new("demo");
    let args = [
        "demo",
        "--tokens",
        "384",
        "--calibration",
        "256",
        "--context",
        "4K",
    ];
    // The GPUs hidden: the CPU table whatever the machine has.
    let o = kvq_without_gpu(&args, tmp.path());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let first = out.lines().next().unwrap();
    assert!(first.starts_with("No usable GPU"), "{first}");
    assert!(first.contains("CPU reference"));
    let header = out
        .lines()
        .find(|l| l.starts_with("scheme "))
        .expect("table header");
    assert!(header.contains("bits/elem @4K") && header.contains("attn err"));
    assert!(!header.contains("latency"), "{header}");
    for b in BUILTIN {
        let row = out
            .lines()
            .find(|l| l.starts_with(&format!("{} ", b.name)))
            .unwrap_or_else(|| panic!("no row for {}:\n{out}", b.name));
        let gpu = kvq::codegen::has_decode_kernel(&b.spec)
            || kvq::codegen::has_codebook_kernel(&b.spec)
            || kvq::codegen::has_xquant_kernel(&b.spec);
        assert_eq!(row.contains("CPU reference only"), !gpu, "{row}");
        assert_eq!(
            row.contains("GPU kernel (CPU reference here)"),
            gpu,
            "{row}"
        );
        // attn err is a number for every scheme.
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert!(cells[3].parse::<f64>().is_ok(), "{row}");
    }
}

fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

/// Writes a two-layer capture: layer 0 with queries, layer 1 without (the last-key proxy).
fn write_capture(path: &Path, tokens: usize, kv_heads: usize, head_dim: usize) {
    let (k0, v0) = random_kv(kv_heads, tokens, head_dim, 1, Tails::Laplace).unwrap();
    let (k1, v1) = random_kv(kv_heads, tokens, head_dim, 2, Tails::Laplace).unwrap();
    // [kv_heads][tokens][head_dim] → [tokens][kv_heads][head_dim].
    let tokens_first = |t: &kvq::reference::KvTensor| {
        let mut out = Vec::with_capacity(t.data.len());
        for tok in 0..t.tokens {
            for h in 0..t.kv_heads {
                out.extend_from_slice(t.row(h, tok));
            }
        }
        out
    };
    let q: Vec<f32> = (0..2 * kv_heads * head_dim)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let shape = vec![tokens, kv_heads, head_dim];
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = vec![
        (
            "layer.0.k".into(),
            shape.clone(),
            f16_bytes(&tokens_first(&k0)),
        ),
        (
            "layer.0.v".into(),
            shape.clone(),
            f16_bytes(&tokens_first(&v0)),
        ),
        (
            "layer.0.q".into(),
            vec![2 * kv_heads, head_dim],
            f16_bytes(&q),
        ),
        (
            "layer.1.k".into(),
            shape.clone(),
            f16_bytes(&tokens_first(&k1)),
        ),
        ("layer.1.v".into(), shape, f16_bytes(&tokens_first(&v1))),
    ];
    write_f16_safetensors(path, &data);
}

fn attn_err_of_layer(out: &str, layer: usize) -> f64 {
    let row = out
        .lines()
        .find(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            c.len() >= 8 && c[0] == layer.to_string() && c[1] == "all"
        })
        .unwrap_or_else(|| panic!("no summary row for layer {layer}:\n{out}"));
    row.split_whitespace().nth(7).unwrap().parse().unwrap()
}

fn eval_reads_a_safetensors_capture_and_reports_every_layer_and_head() {
    let tmp = TempDir::new("eval");
    let file = tmp.path().join("kv.safetensors");
    write_capture(&file, 600, 2, 64);
    let f = file.to_str().unwrap();
    let run = |scheme: &str| {
        let o = kvq(
            &["eval", "--scheme", scheme, "--kv", f, "--cpu"],
            tmp.path(),
        );
        let (out, err) = text(&o);
        assert!(o.status.success(), "{out}\n{err}");
        out
    };
    let out = run("kivi2");
    assert!(out.contains("2 layer(s)"), "{out}");
    assert!(
        out.contains("key at the last token"),
        "layer 1 uses the proxy:\n{out}"
    );
    for layer in 0..2 {
        for head in 0..2 {
            assert!(
                out.lines().any(|l| {
                    let c: Vec<&str> = l.split_whitespace().collect();
                    c.len() >= 7 && c[0] == layer.to_string() && c[1] == head.to_string()
                }),
                "no row for layer {layer} head {head}:\n{out}"
            );
        }
    }
    // Layer 1 caches one token fewer (its last key is the query).
    assert!(out.contains(" 599 "), "{out}");
    // The cache's bits per element for the capture and at a long context, where the FP16
    // windows weigh less.
    let bits = |at: &str| -> f64 {
        let line = out
            .lines()
            .find(|l| l.starts_with("layer 0: "))
            .unwrap_or_else(|| panic!("no bits line for layer 0:\n{out}"));
        let i = line.find(at).unwrap_or_else(|| panic!("{at:?} in {line}"));
        line[..i]
            .split_whitespace()
            .last()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (short, long) = (
        bits(" bits per element for these 600 tokens"),
        bits(" at 32768 tokens"),
    );
    assert!(long < short && long > 2.0 && long < 4.0, "{short} {long}");
    let kivi2 = attn_err_of_layer(&out, 0);
    let int8 = attn_err_of_layer(&run("int8"), 0);
    let fp16 = attn_err_of_layer(&run("fp16"), 0);
    assert!(
        fp16 < int8 && int8 < kivi2 && kivi2 < 1.0,
        "{fp16} {int8} {kivi2}"
    );
    // Printed with significant digits: INT8's error (about 10⁻³ here) is far from FP16's (none:
    // f16 inputs are stored exactly).
    assert!(fp16 < int8 / 10.0 && int8 > 1e-4, "{fp16} {int8}");
    // --json: the same results, per layer and head.
    let o = kvq(
        &["eval", "--scheme", "kivi2", "--kv", f, "--cpu", "--json"],
        tmp.path(),
    );
    let (json, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(v["scheme_text"], "k = int(bits = 2, axis = channel), v = int(bits = 2, axis = token), page = 128, local = 128");
    let layers = v["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 2, "{json}");
    assert_eq!(layers[0]["heads"].as_array().unwrap().len(), 2);
    assert_eq!(layers[1]["tokens"], 599);
    let e = layers[0]["attn_error"].as_f64().unwrap();
    assert!((e - kivi2).abs() <= 1e-3 * kivi2, "JSON {e}, table {kivi2}");
    let json_long = layers[0]["bits_per_element_long"].as_f64().unwrap();
    assert!(
        (json_long - long).abs() < 5e-4,
        "JSON {json_long}, table {long}"
    );
    // Scheme text and a layer filter.
    let o = kvq(
        &[
            "eval",
            "--scheme",
            "k = int(4, channel), v = int(4, token)",
            "--kv",
            f,
            "--layers",
            "1",
            "--cpu",
        ],
        tmp.path(),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("1 layer(s)"), "{out}");
}

fn eval_names_what_is_missing() {
    let tmp = TempDir::new("eval-missing");
    let missing = tmp.path().join("nope.safetensors");
    let o = kvq(
        &[
            "eval",
            "--scheme",
            "kivi2",
            "--kv",
            missing.to_str().unwrap(),
        ],
        tmp.path(),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("nope.safetensors") && err.contains("layer.{i}.k"),
        "{err}"
    );
    // A file whose layer has K but no V.
    let file = tmp.path().join("half.safetensors");
    let k = f16_bytes(&vec![0.5; 4 * 2 * 32]);
    write_f16_safetensors(&file, &[("layer.3.k".to_string(), vec![4, 2, 32], k)]);
    let o = kvq(
        &[
            "eval",
            "--scheme",
            "kivi2",
            "--kv",
            file.to_str().unwrap(),
            "--cpu",
        ],
        tmp.path(),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("no tensor `layer.3.v`"), "{err}");
    // Not a safetensors file at all.
    std::fs::write(&file, b"hello").unwrap();
    let o = kvq(
        &["eval", "--scheme", "kivi2", "--kv", file.to_str().unwrap()],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("not a safetensors file"));
    // XQuant reads the layer input and projections, and RoPE's base: each named when missing.
    let kv = f16_bytes(&vec![0.5; 300 * 2 * 128]);
    write_f16_safetensors(
        &file,
        &[
            ("layer.0.k".to_string(), vec![300, 2, 128], kv.clone()),
            ("layer.0.v".to_string(), vec![300, 2, 128], kv),
        ],
    );
    for (extra, want) in [
        (&[][..], "--rope-theta"),
        (&["--rope-theta", "10000"][..], "layer input"),
    ] {
        let mut args = vec![
            "eval",
            "--scheme",
            "xquant2",
            "--kv",
            file.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = kvq(&args, tmp.path());
        assert_eq!(o.status.code(), Some(2));
        assert!(text(&o).1.contains(want), "{}", text(&o).1);
    }
}

fn info_reports_every_piece_and_never_fails() {
    let tmp = TempDir::new("info");
    let o = kvq(&["info"], tmp.path());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for key in [
        "driver:",
        "GPUs:",
        "NVRTC:",
        "cache dir:",
        "module cache:",
        "tune file:",
    ] {
        assert!(out.contains(key), "{key} missing:\n{out}");
    }
    assert!(out.contains(tmp.path().to_str().unwrap()), "{out}");
    assert!(out.contains("0 tuned entries"), "{out}");
}

/// Runs with the GPUs hidden, so it checks the same on a machine with one.
fn tune_and_bench_need_a_gpu_and_say_so() {
    let tmp = TempDir::new("nogpu");
    for args in [
        &["tune", "--scheme", "kivi2", "--context", "4K"][..],
        &[
            "bench",
            "--schemes",
            "kivi2",
            "--context",
            "4K",
            "--batch",
            "1",
            "--pad-mib",
            "40",
        ][..],
    ] {
        let o = kvq_without_gpu(args, tmp.path());
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(3), "{args:?}: {err}");
        assert!(err.contains("needs a GPU"), "{err}");
    }
    // Codebook schemes tune too: without a GPU that is the missing GPU, not a usage error.
    let o = kvq_without_gpu(&["tune", "--scheme", "commvq2"], tmp.path());
    assert_eq!(o.status.code(), Some(3), "{}", text(&o).1);
    assert!(text(&o).1.contains("needs a GPU"), "{}", text(&o).1);
    // XQuant schemes tune too (their split count), by name.
    let o = kvq_without_gpu(&["tune", "--scheme", "xquant2,xquant-cl2"], tmp.path());
    assert_eq!(o.status.code(), Some(3), "{}", text(&o).1);
    assert!(text(&o).1.contains("needs a GPU"), "{}", text(&o).1);
    // Usage errors come first, GPU or not.
    let o = kvq_without_gpu(
        &["tune", "--scheme", "xquant2", "--d-model", "0"],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("--d-model"), "{}", text(&o).1);
    let o = kvq_without_gpu(&["bench", "--q-heads", "30"], tmp.path());
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    let o = kvq_without_gpu(&["bench", "--pad-mib", "-1"], tmp.path());
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    let o = kvq_without_gpu(
        &["bench", "--schemes", "xquant2", "--d-model", "0"],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    // Scheme text is read before the GPU is looked for: a mistake points at its column.
    let o = kvq_without_gpu(
        &["bench", "--schemes", "kivi2; k = int(5, channel), v = fp16"],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(text(&o).1.contains("column 9"), "{}", text(&o).1);
}

/// Runs with the GPUs hidden (gpu.rs runs the bench with scheme text on a GPU).
fn bench_takes_scheme_text_beside_builtins() {
    // Valid text gets as far as the GPU check (exit 3), as a built-in does.
    let tmp = TempDir::new("bench-text");
    let o = kvq_without_gpu(
        &[
            "bench",
            "--schemes",
            "calibquant1; k = int(1, channel), v = int(1, channel), sink = 32, local = 128",
            "--batch",
            "1",
            "--context",
            "4K",
        ],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(3), "{}", text(&o).1);
    let o = kvq_without_gpu(
        &[
            "bench",
            "--schemes",
            "k = int(2, channel), v = int(2, token), source = x(latent)",
        ],
        tmp.path(),
    );
    // XQuant text is timed by its own decode: as far as the GPU check too.
    assert_eq!(o.status.code(), Some(3), "{}", text(&o).1);
    let o = kvq_without_gpu(
        &["bench", "--schemes", "xquant2,kivi2", "--d-model", "2048"],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(3), "{}", text(&o).1);
}
