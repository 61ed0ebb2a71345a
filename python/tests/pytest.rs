//! The Python package's tests (`python/tests/test_*.py` and the examples in `kvq/__init__.py`;
//! `test_engine.py` skips itself without torch and a GPU),
//! run with pytest against this build's extension module: `cargo test` builds `lib_kvq.so`, this
//! test lays it out as `kvq/_kvq.abi3.so` beside the package's Python files in a temporary folder
//! and runs `python -m pytest` there, as an installed wheel would be imported. Without Python or
//! pytest it shows as ignored, with the reason; `KVQ_REQUIRE_PYTHON=1` (CI) makes that a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvq_runtime::testing::harness::{checked, run};
use kvq_runtime::testing::Skip;

/// Set to `1` to turn a missing Python or pytest into a failure.
const KVQ_REQUIRE_PYTHON: &str = "KVQ_REQUIRE_PYTHON";

fn main() {
    run(vec![checked(
        "the_python_tests_pass_under_pytest",
        the_python_tests_pass_under_pytest,
    )])
}

/// `$KVQ_PYTHON` (else `python3`), once `-m pytest --version` runs with it.
fn python_with_pytest() -> Result<String, Skip> {
    let python = std::env::var("KVQ_PYTHON").unwrap_or_else(|_| "python3".into());
    let missing = |why: String| Skip::unless(&[KVQ_REQUIRE_PYTHON], why);
    match Command::new(&python)
        .args(["-m", "pytest", "--version"])
        .output()
    {
        Ok(out) if out.status.success() => Ok(python),
        Ok(out) => Err(missing(format!(
            "no pytest for `{python}` ({}): pip install pytest",
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
        Err(e) => Err(missing(format!("no Python: `{python}`: {e}"))),
    }
}

/// The extension module cargo built with these tests (`lib_kvq.so` in `target/<profile>/deps`).
fn extension_module() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's folder");
    let module = deps.join("lib_kvq.so");
    assert!(
        module.exists(),
        "no lib_kvq.so in {} (cargo builds the extension with the tests)",
        deps.display()
    );
    module
}

/// Copies the package's Python files and the extension module into `root/kvq`.
fn lay_out_package(root: &Path) {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("kvq");
    let package = root.join("kvq");
    std::fs::create_dir_all(&package).expect("create the package folder");
    for entry in std::fs::read_dir(&source).expect("python/kvq") {
        let path = entry.expect("a package file").path();
        if path.extension().is_some_and(|e| e == "py") {
            std::fs::copy(&path, package.join(path.file_name().unwrap())).expect("copy a .py file");
        } else if path.is_dir() && path.file_name().is_some_and(|n| n == "texts") {
            // The evaluation texts `kvq.eval` reads, as the wheel ships them.
            let texts = package.join("texts");
            std::fs::create_dir_all(&texts).expect("create the texts folder");
            for text in std::fs::read_dir(&path).expect("python/kvq/texts") {
                let text = text.expect("a text").path();
                std::fs::copy(&text, texts.join(text.file_name().unwrap())).expect("copy a text");
            }
        }
    }
    std::fs::copy(extension_module(), package.join("_kvq.abi3.so"))
        .expect("copy the extension module");
}

fn the_python_tests_pass_under_pytest() -> Result<(), Skip> {
    let python = python_with_pytest()?;
    let root = std::env::temp_dir().join(format!("kvq-python-{}", std::process::id()));
    lay_out_package(&root);
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let out = Command::new(&python)
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--doctest-modules",
        ])
        // kvq.engine and kvq.hf need torch (and transformers) to import, and their examples a
        // GPU; tests/test_engine.py and tests/test_hf.py run them where those are.
        .arg(format!(
            "--ignore={}",
            root.join("kvq").join("engine.py").display()
        ))
        .arg(format!(
            "--ignore={}",
            root.join("kvq").join("hf.py").display()
        ))
        .arg(root.join("kvq"))
        .arg(&tests)
        .env("PYTHONPATH", &root)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir(&root)
        .output()
        .expect("run pytest");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&root).ok();
    println!("{report}");
    assert!(out.status.success(), "pytest failed:\n{report}");
    assert!(report.contains(" passed"), "pytest ran no tests:\n{report}");
    Ok(())
}
