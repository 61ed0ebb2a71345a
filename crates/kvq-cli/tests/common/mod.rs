//! Helpers shared by the CLI test files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
    Command::new(std::env::var("KVQ_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvq").to_string()))
        .args(args)
        .env("KVQ_CACHE_DIR", cache)
        .env_remove("KVQ_TUNE")
        .output()
        .expect("run kvq")
}

/// Stdout of a run that must have succeeded (stdout and stderr in the failure message).
pub fn ok(o: &Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "exit {:?}\n{out}\n{err}", o.status);
    out
}
