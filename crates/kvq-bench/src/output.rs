//! A run's files: `STEM.md` (the table), `STEM.json` (every figure, readable back) and
//! `STEM.svg` (the latency plot), and drawing them again from a saved JSON without a GPU.

use std::path::{Path, PathBuf};

use crate::error::{BenchError, Result};
use crate::plot;
use crate::report::BenchResults;

/// `STEM.ext` (the stem may hold dots of its own: `results/h200.b16` gives `results/h200.b16.md`).
pub fn with_extension(stem: &Path, ext: &str) -> PathBuf {
    let mut s = stem.as_os_str().to_owned();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

fn write(path: PathBuf, text: &str) -> Result<PathBuf> {
    std::fs::write(&path, text).map_err(|source| BenchError::Write {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// Writes `STEM.md`, `STEM.json` (with `json`) and `STEM.svg`, creating the stem's folder; returns
/// the files written. Stops at the first file that cannot be written.
pub fn write_files(stem: &Path, results: &BenchResults, json: bool) -> Result<Vec<PathBuf>> {
    if let Some(dir) = stem.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| BenchError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let mut written = vec![write(with_extension(stem, "md"), &results.markdown())?];
    if json {
        written.push(write(with_extension(stem, "json"), &results.json())?);
    }
    let svg = with_extension(stem, "svg");
    plot::write_svg(results, &svg)?;
    written.push(svg);
    Ok(written)
}

/// Reads results saved as JSON and writes their table and plot again, to `out` or beside the
/// JSON (`results/h200.json` → `results/h200.{md,svg}`); measures nothing and needs no GPU.
pub fn replot(json: &Path, out: Option<&Path>) -> Result<(BenchResults, Vec<PathBuf>)> {
    let results = BenchResults::read_json_file(json).map_err(|why| BenchError::Read {
        path: json.to_path_buf(),
        why,
    })?;
    let stem = out.map_or_else(|| json.with_extension(""), Path::to_path_buf);
    let written = write_files(&stem, &results, false)?;
    Ok((results, written))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_extension_is_added_after_the_whole_stem() {
        assert_eq!(
            with_extension(Path::new("results/h200.b16"), "md"),
            PathBuf::from("results/h200.b16.md")
        );
    }

    #[test]
    fn a_missing_results_file_is_a_read_error_naming_it() {
        let missing = std::env::temp_dir().join(format!("kvq-replot-{}.json", std::process::id()));
        let err = replot(&missing, None).unwrap_err();
        assert!(matches!(err, BenchError::Read { .. }), "{err}");
        assert!(
            err.to_string().contains(&missing.display().to_string()),
            "{err}"
        );
    }
}
