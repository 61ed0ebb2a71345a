//! include/kvq.h is what cbindgen generates from this crate's sources: an engine compiling against
//! the committed header sees exactly the library's types and functions. `KVQ_BLESS=1` rewrites the
//! header instead of failing.

use std::path::Path;

#[test]
fn the_committed_header_is_what_the_sources_generate() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    let path = dir.join("include/kvq.h");
    if std::env::var_os("KVQ_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write include/kvq.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/kvq.h differs from what the sources generate; rerun with KVQ_BLESS=1 and \
         commit it. Generated:\n{generated}"
    );
}
