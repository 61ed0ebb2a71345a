//! The compiled-module disk cache with real NVRTC output: a second compile of the same source is
//! a hit, a changed option is a miss, a damaged entry is recompiled. Runs under its own harness:
//! without NVRTC the tests show as ignored, with the reason (failures under
//! `KVQ_REQUIRE_NVRTC=1`). The NVRTC-free behaviour is unit-tested in the crate.

use std::fs;
use std::path::PathBuf;

use kvq_runtime::nvrtc::{CompileOptions, IncludeDirs, Output, Source};
use kvq_runtime::testing::harness::{all_need, run};
use kvq_runtime::testing::Need;
use kvq_runtime::{Arch, CacheKey, CacheStats, DiskCache, Origin};

const FILL: &str = r#"extern "C" __global__ void fill(float* out, float value, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"#;

fn main() {
    run(all_need(
        Need::Nvrtc,
        &[
            (
                "second_compile_hits_changed_option_misses_corrupt_entry_recompiles",
                second_compile_hits_changed_option_misses_corrupt_entry_recompiles,
            ),
            (
                "compile_errors_are_not_cached",
                compile_errors_are_not_cached,
            ),
            (
                "concurrent_compiles_of_one_source_agree",
                concurrent_compiles_of_one_source_agree,
            ),
        ],
    ))
}

fn fresh_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvq-runtime-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

fn stats(hits: u64, misses: u64, corrupt: u64) -> CacheStats {
    CacheStats {
        hits,
        misses,
        corrupt,
        write_errors: 0,
    }
}

fn second_compile_hits_changed_option_misses_corrupt_entry_recompiles() {
    let dir = fresh_dir("disk-cache");
    let cache = DiskCache::open(&dir).unwrap();
    let source = Source::new("fill.cu", FILL);
    let options = CompileOptions::default().include_dirs(IncludeDirs::None);

    let (first, origin) = cache
        .compile(&source, Arch::SM_90A, Output::Cubin, &options)
        .unwrap();
    assert_eq!(origin, Origin::Compiled);
    assert_eq!(cache.stats(), stats(0, 1, 0));

    let (second, origin) = cache
        .compile(&source, Arch::SM_90A, Output::Cubin, &options)
        .unwrap();
    assert_eq!(origin, Origin::DiskCache);
    assert_eq!(second.image, first.image);
    assert_eq!(second.options, first.options);
    assert_eq!(cache.stats(), stats(1, 1, 0));

    // A second DiskCache on the same folder (a new process, in effect) hits too.
    let reopened = DiskCache::open(&dir).unwrap();
    let (_, origin) = reopened
        .compile(&source, Arch::SM_90A, Output::Cubin, &options)
        .unwrap();
    assert_eq!(origin, Origin::DiskCache);
    assert_eq!(
        reopened.stats().to_string(),
        "compiled 0 modules (1 cache hit)"
    );
    println!("warm start: {}", reopened.stats());

    // Changed option, architecture, output kind or source: misses.
    let fast = options.clone().fast_math(true);
    let (_, origin) = cache
        .compile(&source, Arch::SM_90A, Output::Cubin, &fast)
        .unwrap();
    assert_eq!(origin, Origin::Compiled);
    let (_, origin) = cache
        .compile(&source, Arch::SM_80, Output::Cubin, &options)
        .unwrap();
    assert_eq!(origin, Origin::Compiled);
    let (_, origin) = cache
        .compile(&source, Arch::SM_90A, Output::Ptx, &options)
        .unwrap();
    assert_eq!(origin, Origin::Compiled);
    let edited = Source::new("fill.cu", FILL.replace("value;", "value + 1.0f;"));
    let (_, origin) = cache
        .compile(&edited, Arch::SM_90A, Output::Cubin, &options)
        .unwrap();
    assert_eq!(origin, Origin::Compiled);
    assert_eq!(cache.stats(), stats(1, 5, 0));

    // Damage the first entry: it is detected, recompiled, rewritten, and then hits again.
    let key = CacheKey::new(
        &source,
        &options.resolve(Arch::SM_90A),
        Output::Cubin,
        kvq_runtime::nvrtc::version().unwrap(),
    );
    let path = cache.entry_path(&key, Output::Cubin);
    let mut bytes = fs::read(&path).unwrap();
    let middle = bytes.len() - first.image.len() / 2;
    bytes[middle] ^= 0x5a;
    fs::write(&path, &bytes).unwrap();
    let (again, origin) = cache
        .compile(&source, Arch::SM_90A, Output::Cubin, &options)
        .unwrap();
    assert_eq!(origin, Origin::Compiled);
    assert_eq!(again.image, first.image);
    let (_, origin) = cache
        .compile(&source, Arch::SM_90A, Output::Cubin, &options)
        .unwrap();
    assert_eq!(origin, Origin::DiskCache);

    // A truncated entry too.
    fs::write(&path, &bytes[..bytes.len() / 3]).unwrap();
    let (_, origin) = cache
        .compile(&source, Arch::SM_90A, Output::Cubin, &options)
        .unwrap();
    assert_eq!(origin, Origin::Compiled);
    assert_eq!(cache.stats(), stats(2, 7, 2));
    println!("{}", cache.stats());

    let _ = fs::remove_dir_all(&dir);
}

fn compile_errors_are_not_cached() {
    let dir = fresh_dir("disk-cache-errors");
    let cache = DiskCache::open(&dir).unwrap();
    let bad = Source::new("bad.cu", "extern \"C\" __global__ void k() { nope; }");
    let options = CompileOptions::default().include_dirs(IncludeDirs::None);
    for _ in 0..2 {
        let err = cache
            .compile(&bad, Arch::SM_80, Output::Cubin, &options)
            .unwrap_err();
        assert!(matches!(err, kvq_runtime::JitError::Compile(_)), "{err}");
    }
    assert_eq!(cache.stats(), stats(0, 2, 0));
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
    let _ = fs::remove_dir_all(&dir);
}

fn concurrent_compiles_of_one_source_agree() {
    let dir = fresh_dir("disk-cache-threads");
    let cache = DiskCache::open(&dir).unwrap();
    let source = Source::new("fill.cu", FILL);
    let options = CompileOptions::default().include_dirs(IncludeDirs::None);
    let images: Vec<Vec<u8>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    cache
                        .compile(&source, Arch::SM_80, Output::Cubin, &options)
                        .unwrap()
                        .0
                        .image
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(images.windows(2).all(|w| w[0] == w[1]));
    let s = cache.stats();
    assert_eq!(s.hits + s.misses, 4);
    assert_eq!((s.corrupt, s.write_errors), (0, 0));
    let entries: Vec<_> = fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).collect();
    assert_eq!(entries.len(), 1, "one entry, no temporary files left");
    let _ = fs::remove_dir_all(&dir);
}
