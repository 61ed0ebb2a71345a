//! Helpers shared by the CLI test files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

// kvq-runtime's harness: a test without its GPU, NVRTC or C compiler shows as ignored, with the
// reason. Not every file that includes this module uses all of it.
#[allow(unused_imports)]
pub use kvq::runtime::testing::harness::{checked, needs, plain, run as run_trials};

/// A fresh folder under the system temp dir, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("kvq-cli-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `kvq args…` with its cache folder in `cache` (so no user state leaks in). `KVQ_BIN` runs a
/// staged binary instead (the GPU machine has no cargo).
pub fn kvq(args: &[&str], cache: &Path) -> Output {
    command(args, cache).output().expect("run kvq")
}

/// As [`kvq`], with every GPU hidden from the process (`CUDA_VISIBLE_DEVICES=-1`: an invalid
/// first index leaves no device visible), so what `kvq` does without a GPU is checked on any
/// machine, the GPU machine included.
pub fn kvq_without_gpu(args: &[&str], cache: &Path) -> Output {
    command(args, cache)
        .env("CUDA_VISIBLE_DEVICES", "-1")
        .output()
        .expect("run kvq")
}

fn command(args: &[&str], cache: &Path) -> Command {
    let mut c = Command::new(
        std::env::var("KVQ_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvq").to_string()),
    );
    c.args(args)
        .env("KVQ_CACHE_DIR", cache)
        .env_remove("KVQ_TUNE");
    c
}

/// Stdout of a run that must have succeeded (stdout and stderr in the failure message).
pub fn ok(o: &Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "exit {:?}\n{out}\n{err}", o.status);
    out
}

/// Stdout and stderr of a run, as text.
pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Writes f16 tensors `(name, shape, little-endian bytes)` as a safetensors file.
pub fn write_f16_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<u8>)]) {
    use safetensors::tensor::TensorView;
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            let view = TensorView::new(safetensors::Dtype::F16, shape.clone(), bytes).unwrap();
            (name.clone(), view)
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, &None).unwrap()).unwrap();
}
