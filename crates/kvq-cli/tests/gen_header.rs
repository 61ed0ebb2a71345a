//! The C header `kvq gen` writes is a stable surface: its names carry the caller's prefix and the
//! kernel's role, never a content hash, so an engine's C code compiles unchanged against the header
//! of another scheme or tuning, and two headers with different prefixes share one translation unit.
//! Runs under its own harness: without a C compiler the C test shows as ignored, with the reason
//! (a failure under `KVQ_REQUIRE_CC=1`).

mod common;

use std::path::Path;
use std::process::Command;

use common::{checked, kvq, ok, plain, run_trials, TempDir};
use kvq::runtime::testing::{c_compiler, Skip};

fn main() {
    run_trials(vec![
        plain(
            "header_names_do_not_change_with_the_scheme_or_tuning",
            header_names_do_not_change_with_the_scheme_or_tuning,
        ),
        plain(
            "a_bad_prefix_is_a_usage_error",
            a_bad_prefix_is_a_usage_error,
        ),
        checked(
            "two_headers_compile_together_in_c",
            two_headers_compile_together_in_c,
        ),
    ])
}

/// Generates kernels for d128 GQA 4 into `tmp/dir`: the header and the kernels' entry-point names.
fn gen(tmp: &TempDir, dir: &str, scheme: &str, extra: &[&str]) -> (String, Vec<String>) {
    let out = tmp.path().join(dir);
    let out_s = out.to_str().unwrap();
    let mut args = vec![
        "gen",
        "--scheme",
        scheme,
        "--head-dim",
        "128",
        "--gqa",
        "4",
        "--out",
        out_s,
    ];
    args.extend_from_slice(extra);
    ok(&kvq(&args, tmp.path()));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let entry_points = manifest["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["name"].as_str().unwrap().to_string())
        .collect();
    (
        std::fs::read_to_string(out.join("kvq_kernels.h")).unwrap(),
        entry_points,
    )
}

/// The identifiers a C caller writes: struct types and helper functions.
fn c_names(header: &str) -> Vec<String> {
    header
        .lines()
        .filter_map(|l| {
            l.strip_prefix("typedef struct ")
                .or_else(|| l.strip_prefix("static inline void "))
                .map(|r| r.split([' ', '(']).next().unwrap().to_string())
        })
        .collect()
}

fn header_names_do_not_change_with_the_scheme_or_tuning() {
    let tmp = TempDir::new("header-stable");
    let (a, a_entries) = gen(&tmp, "a", "kivi2", &[]);
    let (b, b_entries) = gen(&tmp, "b", "kitty", &["--threads", "256"]);
    assert_ne!(a_entries, b_entries, "the entry points differ by scheme");
    for n in ["kvq_decode_params", "kvq_decode_args", "kvq_combine_params"] {
        assert!(c_names(&a).contains(&n.to_string()), "{n} missing: {a}");
        assert!(c_names(&b).contains(&n.to_string()), "{n} missing: {b}");
    }
    // The content-hashed entry points appear only as the `_NAME` strings and nvcc declarations.
    for (h, entries) in [(&a, &a_entries), (&b, &b_entries)] {
        for e in entries {
            assert!(
                !c_names(h).iter().any(|n| n.contains(e.as_str())),
                "{e} is in a C name"
            );
        }
    }
}

fn a_bad_prefix_is_a_usage_error() {
    let tmp = TempDir::new("header-bad-prefix");
    let out = tmp.path().join("x");
    let o = kvq(
        &[
            "gen",
            "--scheme",
            "kivi2",
            "--head-dim",
            "128",
            "--out",
            out.to_str().unwrap(),
            "--prefix",
            "My-Engine",
        ],
        tmp.path(),
    );
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not a usable C prefix"), "{err}");
    assert!(!out.join("kvq_kernels.h").exists());
}

/// Two headers, one translation unit, C99 with warnings as errors: the engine's code names only
/// prefixed, role-based identifiers.
fn two_headers_compile_together_in_c() -> Result<(), Skip> {
    let cc = c_compiler()?;
    let tmp = TempDir::new("header-c");
    gen(&tmp, "kivi", "kivi2", &["--prefix", "kv2"]);
    gen(&tmp, "kitty", "kitty", &["--prefix", "kitty"]);
    let main = tmp.path().join("engine.c");
    std::fs::write(
        &main,
        r#"#include <string.h>
#include "kivi/kvq_kernels.h"
#include "kitty/kvq_kernels.h"

int main(void) {
    kv2_decode_params a;
    kitty_decode_params b;
    void* args_a[KV2_DECODE_NUM_PARAMS];
    void* args_b[KITTY_DECODE_NUM_PARAMS];
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    kv2_decode_args(&a, args_a);
    kitty_decode_args(&b, args_b);
    return (KV2_HEAD_DIM == KITTY_HEAD_DIM && strlen(KV2_DECODE_NAME) > 0
            && strcmp(KV2_SCHEME_LABEL, KITTY_SCHEME_LABEL) != 0) ? 0 : 1;
}
"#,
    )
    .unwrap();
    let exe = tmp.path().join("engine");
    let o = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(tmp.path())
        .arg(&main)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run = Command::new(Path::new(&exe)).status().unwrap();
    assert!(run.success(), "the engine's checks failed");
    Ok(())
}
