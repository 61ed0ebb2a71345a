//! The standing guarantee of issue 56, run in CI: each fuzz target for a bounded time
//! (`KVQ_FUZZ_SECONDS`, default 20 s each; the two run in parallel) must give no finding, and
//! the concrete repros of the issue that reach these paths replay clean.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvq::schemes::Kitty;
use kvq::{Scheme, SchemeSpec};
use kvq_fuzz::exec::{Executor, DEFAULT_STACK};
use kvq_fuzz::Target;

const EXE: &str = env!("CARGO_BIN_EXE_kvq-fuzz");

fn seconds() -> String {
    std::env::var("KVQ_FUZZ_SECONDS").unwrap_or_else(|_| "20".into())
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("kvq-fuzz-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the test's scratch folder");
    dir
}

/// Runs `kvq-fuzz <target>` for the bounded time and fails with its report on any finding.
fn fuzz_for_a_while(target: Target) {
    let dir = scratch(target.name());
    let seed = std::env::var("KVQ_FUZZ_SEED").unwrap_or_else(|_| "56".into());
    let out = Command::new(EXE)
        .arg(target.name())
        .args(["--seconds", &seconds(), "--seed", &seed, "--no-minimize"])
        .arg("--findings")
        .arg(dir.join("findings"))
        .output()
        .expect("run kvq-fuzz");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let summary = stdout.lines().next().unwrap_or("(no summary)");
    // Shown with `--nocapture`, and in the failure message: the inputs executed and the time.
    eprintln!("{summary}");
    assert!(
        out.status.success() && summary.contains(" 0 finding(s)"),
        "kvq-fuzz {} found something (seed {seed}; exit {}):\n{stdout}\n{stderr}",
        target.name(),
        out.status
    );
    let executed: u64 = summary
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(executed > 0, "no input ran: {summary}");
}

#[test]
fn scheme_target_runs_clean_for_a_bounded_time() {
    fuzz_for_a_while(Target::Scheme);
}

#[test]
fn safetensors_target_runs_clean_for_a_bounded_time() {
    fuzz_for_a_while(Target::Safetensors);
}

/// Replays one input in a child process, where a stack overflow or an abort cannot take the
/// test binary down with it.
fn replay_in_child(target: Target, name: &str, input: &[u8]) {
    let dir = scratch(name);
    let file = dir.join(format!("{name}.input"));
    std::fs::write(&file, input).expect("write the input");
    let out = Command::new(EXE)
        .arg(target.name())
        .arg("--replay")
        .arg(&file)
        .output()
        .expect("run kvq-fuzz --replay");
    assert!(
        out.status.success(),
        "{name}: replay failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn nested(depth: usize) -> Vec<u8> {
    format!("k = {}{}, v = fp16", "a(".repeat(depth), ")".repeat(depth)).into_bytes()
}

#[test]
fn deeply_nested_scheme_text_is_an_error_not_a_stack_overflow() {
    // Issue 56: 20,000 levels aborted the CLI; 5,000 aborted a 2 MiB thread. The replay runs on
    // a 1 MiB stack.
    replay_in_child(Target::Scheme, "nested-20000", &nested(20_000));
    replay_in_child(Target::Scheme, "nested-5000", &nested(5_000));
    let keyed = format!(
        "k = {}1{}, v = fp16",
        "int(b = ".repeat(3_000),
        ")".repeat(3_000)
    );
    replay_in_child(Target::Scheme, "nested-keyed-3000", keyed.as_bytes());
}

/// Runs `f` as a fuzz check on a 1 MiB worker (panics caught and reported).
fn run_check(f: fn(&[u8]) -> Result<(), String>) {
    let mut exec = Executor::new(DEFAULT_STACK, Duration::from_secs(120));
    if let Err(finding) = exec.run(f, b"") {
        panic!("{finding}");
    }
}

#[test]
fn kitty_past_head_dim_256_builds_or_is_refused_alike_in_reference_and_codegen() {
    // Issue 56: the reference panicked at head_dim 288/512/544 (a u8 slot table) while
    // `check_shape` accepted the shape and codegen rendered a kernel for it.
    run_check(|_| {
        for spec in [Kitty::SPEC, kvq::schemes::KittyPro::SPEC] {
            for head_dim in [256, 288, 512, 544, 1024] {
                kvq_fuzz::scheme::check_at(&spec, head_dim, 1, 0)?;
                kvq_fuzz::scheme::check_at(&spec, head_dim, 1, u64::MAX)?;
            }
        }
        Ok(())
    });
}

#[test]
fn token_span_codebook_at_u32_max_kv_heads_does_not_overflow() {
    // Issue 56: `head_dim * kv_heads` overflowed in `check_shape` (a panic in debug builds).
    run_check(|_| {
        let spec: SchemeSpec = "k = codebook(additive, rows = 512, span = token), v = fp16"
            .parse()
            .map_err(|e| format!("{e}"))?;
        for kv_heads in [u32::MAX, u32::MAX - 1, 1 << 31] {
            let _ = spec.check_shape(128, kv_heads);
            let _ = spec.check_shape(1024, kv_heads);
        }
        Ok(())
    });
}

#[test]
fn page_beyond_the_range_names_a_range_that_is_valid() {
    // Issue 56: `page = 1e20` said "0..=1048576", but 0 is refused too.
    let err = SchemeSpec::parse("k = fp16, v = fp16, page = 1e20").expect_err("page = 1e20");
    assert!(
        !err.message.contains("0..="),
        "the message offers 0, which `page` refuses: {}",
        err.message
    );
    replay_in_child(
        Target::Scheme,
        "page-1e20",
        b"k = fp16, v = fp16, page = 1e20",
    );
}

#[test]
fn a_window_of_1e_minus_400_is_not_silently_zero() {
    // Issue 56: `sink = 1e-400` was accepted as 0.
    for text in [
        "k = fp16, v = fp16, sink = 1e-400",
        "k = fp16, v = fp16, local = 1e-400",
    ] {
        let parsed = SchemeSpec::parse(text);
        assert!(parsed.is_err(), "`{text}` parsed as {parsed:?}");
        replay_in_child(Target::Scheme, "tiny-window", text.as_bytes());
    }
}

#[test]
fn memory_accounting_of_absurd_sizes_returns_without_overflow() {
    // Found by the scheme target: `evaluate::memory` multiplies lengths, heads and widths
    // unchecked (kvq-reference `footprint::tensor`, kvq `evaluate::commvq_tensor`), a panic in
    // debug builds and a wrapped, wrong size in release. An absurd size is an error naming
    // the shape, never an overflow.
    run_check(|_| {
        for text in [
            "k = fp16, v = fp16",
            "k = int(2, channel), v = int(2, token), local = 128",
            "k = codebook(rope_commutative, levels = 64, residuals = 21, pairs_per_code = 64, span = token), v = codebook(additive, rows = 256)",
            "k = int(2, channel), v = int(2, token), source = x(latent)",
        ] {
            let spec: SchemeSpec = text.parse().map_err(|e| format!("{e}"))?;
            for kv_heads in [1, u32::MAX] {
                for len in [1u64 << 60, u64::MAX] {
                    if let Ok(m) = kvq::evaluate::memory(&spec, 128, kv_heads, len) {
                        return Err(format!("{text}: {kv_heads} heads × {len} tokens counted as {} bytes", m.bytes()));
                    }
                }
            }
        }
        Ok(())
    });
}

#[test]
fn a_page_of_a_million_tokens_past_the_memory_bound_is_an_error_not_an_abort() {
    // Found by the scheme target: `page = 1048576` passes the grammar and `check_shape`, and the
    // reference allocates its page and FP16 buffers whole, as a device cache holds them (4 GiB
    // at head_dim 1024 for a 1-token sequence), which aborted where memory is short. The
    // replay's allocator refuses single allocations over 1 GiB, as a smaller machine would, and
    // the library's guard (bounded alike) must refuse first with a typed error.
    replay_in_child(
        Target::Scheme,
        "page-1048576",
        b"v = fp16, k = int(4, channel), page = 1048576",
    );
}
