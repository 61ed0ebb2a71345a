//! The GPU paths of the `kvq` binary: `demo` adds the kernel's error and latency columns, `eval`
//! adds the GPU column, `tune` stores a result that `tune` then reports as stored and `gen` and
//! `info` pick up, `bench` prints its table. Runs under its own harness: without a GPU each test
//! shows as ignored, with the reason; `KVQ_REQUIRE_GPU=1` makes that a failure.

mod common;
use common::{kvq, needs, ok, run_trials, TempDir};

use kvq::reference::synth::{random_kv, Tails};
use kvq::runtime::testing::Need;
use serde_json::Value;

fn main() {
    run_trials(vec![
        needs(
            Need::Gpu,
            "gpu_demo_adds_kernel_error_and_latency",
            gpu_demo_adds_kernel_error_and_latency,
        ),
        needs(
            Need::Gpu,
            "gpu_eval_adds_the_kernel_column",
            gpu_eval_adds_the_kernel_column,
        ),
        needs(
            Need::Gpu,
            "gpu_tune_stores_a_result_that_gen_and_info_pick_up",
            gpu_tune_stores_a_result_that_gen_and_info_pick_up,
        ),
        needs(
            Need::Gpu,
            "gpu_bench_prints_its_table",
            gpu_bench_prints_its_table,
        ),
    ]);
}

/// The cells of the row starting with `name`.
fn row<'a>(out: &'a str, name: &str) -> Vec<&'a str> {
    out.lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no row {name}:\n{out}"))
        .split_whitespace()
        .collect()
}

fn gpu_demo_adds_kernel_error_and_latency() {
    let tmp = TempDir::new("demo");
    let out = ok(&kvq(
        &[
            "demo",
            "--schemes",
            "kivi2,calibquant2,int8,xquant2,xquant-cl2",
            "--tokens",
            "512",
            "--calibration",
            "0",
            "--context",
            "4K",
            "--runs",
            "5",
        ],
        &tmp.0,
    ));
    println!("{out}");
    assert!(
        !out.starts_with("No usable GPU"),
        "the GPU was not used:\n{out}"
    );
    let header = out.lines().find(|l| l.starts_with("scheme ")).unwrap();
    assert!(header.contains("attn err (GPU)") && header.contains("latency µs"));
    for name in [
        "fp16",
        "kivi2",
        "calibquant2",
        "int8",
        "xquant2",
        "xquant-cl2",
    ] {
        let c = row(&out, name);
        // scheme bits saved err mse err_gpu latency x_fp16 launch…
        let cpu: f64 = c[3].parse().unwrap();
        let gpu: f64 = c[5].parse().unwrap_or_else(|_| panic!("{name}: {c:?}"));
        assert!(
            (gpu - cpu).abs() < 5e-3 + 0.02 * cpu,
            "{name}: GPU {gpu} vs CPU {cpu}"
        );
        let us: f64 = c[6].parse().unwrap_or_else(|_| panic!("{name}: {c:?}"));
        let speedup: f64 = c[7].parse().unwrap();
        assert!(us > 0.0 && speedup > 0.0, "{c:?}");
    }
    assert_eq!(row(&out, "fp16")[7], "1.00");
    // XQuant's latents decode on the GPU too (K rebuilt from them on tensor cores).
    assert!(row(&out, "xquant2").join(" ").contains("GPU kernel"));
    assert!(out.contains("JIT: compiled"), "{out}");
}

fn gpu_eval_adds_the_kernel_column() {
    let tmp = TempDir::new("eval");
    let (k, v) = random_kv(2, 700, 128, 3, Tails::Laplace).unwrap();
    let bytes = |t: &kvq::reference::KvTensor| -> Vec<u8> {
        // heads-first layout: the tensor's own order.
        t.data
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
            .collect()
    };
    let (kb, vb) = (bytes(&k), bytes(&v));
    let views = vec![
        (
            "layer.0.k".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![2, 700, 128], &kb)
                .unwrap(),
        ),
        (
            "layer.0.v".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![2, 700, 128], &vb)
                .unwrap(),
        ),
    ];
    let file = tmp.0.join("kv.safetensors");
    std::fs::write(&file, safetensors::serialize(views, &None).unwrap()).unwrap();
    let out = ok(&kvq(
        &[
            "eval",
            "--scheme",
            "kitty",
            "--kv",
            file.to_str().unwrap(),
            "--layout",
            "heads-first",
        ],
        &tmp.0,
    ));
    println!("{out}");
    let summary: Vec<&str> = out
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("all"))
        .unwrap()
        .split_whitespace()
        .collect();
    let (cpu, gpu): (f64, f64) = (summary[7].parse().unwrap(), summary[8].parse().unwrap());
    assert!(
        (gpu - cpu).abs() < 5e-3 + 0.02 * cpu,
        "GPU {gpu} vs CPU {cpu}"
    );
}

fn gpu_tune_stores_a_result_that_gen_and_info_pick_up() {
    let tmp = TempDir::new("tune");
    let args = [
        "tune",
        "--scheme",
        "kivi2",
        "--head-dim",
        "128",
        "--gqa",
        "4",
        "--kv-heads",
        "8",
        "--batch",
        "1",
        "--context",
        "4K",
        "--budget-s",
        "5",
    ];
    let out = ok(&kvq(&args, &tmp.0));
    println!("{out}");
    assert!(row(&out, "kivi2").contains(&"tuned") || out.contains("tuned (budget hit)"));
    let again = ok(&kvq(&args, &tmp.0));
    assert!(row(&again, "kivi2").contains(&"stored"), "{again}");
    let info = ok(&kvq(&["info"], &tmp.0));
    assert!(info.contains("1 tuned entries, 1 for this GPU"), "{info}");
    let dir = tmp.0.join("gen");
    ok(&kvq(
        &[
            "gen",
            "--scheme",
            "kivi2",
            "--head-dim",
            "128",
            "--gqa",
            "4",
            "--out",
            dir.to_str().unwrap(),
        ],
        &tmp.0,
    ));
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["tune"]["source"], "tuned");
    assert_eq!(m["tune"]["tuned"].as_array().unwrap().len(), 1);
    assert_eq!(m["tune"]["tuned"][0]["context_bucket"], 4096);
}

fn gpu_bench_prints_its_table() {
    let tmp = TempDir::new("bench");
    let stem = tmp.0.join("out/run");
    // A built-in and scheme text (one-pass 1-bit K and V, which no built-in has).
    let out = ok(&kvq(
        &[
            "bench",
            "--schemes",
            "kivi2; k = int(1, channel), v = int(1, channel), sink = 32, local = 128",
            "--batch",
            "1",
            "--context",
            "4K",
            "--runs",
            "3",
            "--warmup",
            "1",
            "--copy-gib",
            "0.25",
            "--out",
            stem.to_str().unwrap(),
        ],
        &tmp.0,
    ));
    println!("{out}");
    assert!(out.contains("kivi2") && out.contains("fp16"), "{out}");
    for ext in ["md", "json", "svg"] {
        assert!(tmp.0.join(format!("out/run.{ext}")).is_file(), "{ext}");
    }
    // Every row carries its one-launch read floor, a real time.
    let md = std::fs::read_to_string(tmp.0.join("out/run.md")).unwrap();
    assert!(md.contains("| read µs | × read |"), "{md}");
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.0.join("out/run.json")).unwrap())
            .unwrap();
    let rows = json["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{json}");
    for row in rows {
        let floor = row["read_floor_us"].as_f64().unwrap_or(f64::NAN);
        assert!(floor.is_finite() && floor > 0.0, "{row}");
        // Every row, the custom scheme's too, was checked against the CPU reference.
        let err = row["max_rel_error"].as_f64().unwrap_or(f64::NAN);
        assert!(err.is_finite() && err < 2e-3, "{row}");
    }
    assert!(
        rows.iter()
            .any(|r| r["scheme"].as_str().unwrap().starts_with("custom-")),
        "{json}"
    );
}
