//! Reading NVRTC's log: find the `file(line): error: …` lines and quote the generated source
//! around each, with line numbers, so a compile error in generated code can be read without
//! dumping the whole source.

use serde::{Deserialize, Serialize};

/// One `file(line): severity: message` line of an NVRTC log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Diagnostic {
    /// The source or header name.
    pub file: String,
    /// 1-based line number.
    pub line: usize,
    /// `error`, `catastrophic error`, `warning #177-D`, `remark`, …
    pub severity: String,
    /// The rest of the line.
    pub message: String,
}

impl Diagnostic {
    /// Whether this is an error (plain or catastrophic) rather than a warning or remark.
    pub fn is_error(&self) -> bool {
        self.severity.contains("error")
    }

    /// Parses one log line; `None` if it is not a diagnostic.
    pub fn parse(line: &str) -> Option<Diagnostic> {
        let bytes = line.as_bytes();
        let mut search_from = 0;
        while let Some(rel) = line[search_from..].find('(') {
            let open = search_from + rel;
            let digits_start = open + 1;
            let mut end = digits_start;
            while end < bytes.len() && bytes[end].is_ascii_digit() {
                end += 1;
            }
            if end > digits_start && line[end..].starts_with("): ") && open > 0 {
                let file = line[..open].trim().to_string();
                let number = line[digits_start..end].parse().ok()?;
                let rest = &line[end + 3..];
                let (severity, message) = match rest.find(": ") {
                    Some(i) => (rest[..i].trim(), rest[i + 2..].trim()),
                    None => (rest.trim(), ""),
                };
                return Some(Diagnostic {
                    file,
                    line: number,
                    severity: severity.to_string(),
                    message: message.to_string(),
                });
            }
            search_from = open + 1;
        }
        None
    }
}

/// All diagnostics of a log, in order.
pub fn parse_log(log: &str) -> Vec<Diagnostic> {
    log.lines().filter_map(Diagnostic::parse).collect()
}

/// Lines of context shown before and after an error line.
pub const CONTEXT_LINES: usize = 2;

/// `log` with, after each error's block (the diagnostic line and NVRTC's own echo/caret lines),
/// the lines around it from whichever of `files` (`(name, text)`) it names.
pub fn annotate_log(log: &str, files: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(log.len() * 2);
    let mut pending: Option<String> = None;
    for line in log.lines() {
        let diagnostic = Diagnostic::parse(line);
        let ends_block = diagnostic.is_some()
            || line.trim().is_empty()
            || line.trim_start().starts_with(|c: char| c.is_ascii_digit());
        if ends_block {
            if let Some(excerpt) = pending.take() {
                out.push_str(&excerpt);
            }
        }
        out.push_str(line);
        out.push('\n');
        if let Some(d) = diagnostic.filter(Diagnostic::is_error) {
            if let Some((name, text)) = files.iter().find(|(name, _)| *name == d.file) {
                pending = Some(excerpt(name, text, d.line));
            }
        }
    }
    if let Some(excerpt) = pending.take() {
        out.push_str(&excerpt);
    }
    out
}

/// Lines `line-CONTEXT ..= line+CONTEXT` of `text`, numbered, the middle one marked with `>`.
pub fn excerpt(name: &str, text: &str, line: usize) -> String {
    let lines: Vec<&str> = text.split('\n').map(|l| l.trim_end_matches('\r')).collect();
    if line == 0 || line > lines.len() {
        return format!(
            "    (line {line} is outside {name}, which has {} lines)\n",
            lines.len()
        );
    }
    let first = line.saturating_sub(CONTEXT_LINES).max(1);
    let last = (line + CONTEXT_LINES).min(lines.len());
    let width = last.to_string().len();
    let mut out = String::new();
    for n in first..=last {
        let marker = if n == line { "  > " } else { "    " };
        out.push_str(&format!("{marker}{n:>width$} | {}\n", lines[n - 1]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nvrtc_lines() {
        let d = Diagnostic::parse("kernel.cu(12): error: identifier \"x\" is undefined").unwrap();
        assert_eq!(d.file, "kernel.cu");
        assert_eq!(d.line, 12);
        assert_eq!(d.severity, "error");
        assert_eq!(d.message, "identifier \"x\" is undefined");
        assert!(d.is_error());

        let d = Diagnostic::parse(
            "k.cu(1): catastrophic error: cannot open source file \"cuda_fp16.h\"",
        )
        .unwrap();
        assert_eq!(d.severity, "catastrophic error");
        assert!(d.is_error());

        let d =
            Diagnostic::parse("k (v2).cu(7): warning #177-D: variable \"y\" was declared").unwrap();
        assert_eq!(d.file, "k (v2).cu");
        assert_eq!(d.line, 7);
        assert!(!d.is_error());

        assert!(Diagnostic::parse("1 error detected in the compilation of \"k.cu\".").is_none());
        assert!(Diagnostic::parse("      out[i] = x;").is_none());
    }

    #[test]
    fn annotates_errors_with_numbered_source() {
        let src = "// line 1\nextern \"C\" __global__ void k(float* o) {\n  o[0] = x;\n}\n";
        let log = "k.cu(3): error: identifier \"x\" is undefined\n    o[0] = x;\n           ^\n\n\
                   1 error detected in the compilation of \"k.cu\".\n";
        let out = annotate_log(log, &[("k.cu", src)]);
        let expected =
            "k.cu(3): error: identifier \"x\" is undefined\n    o[0] = x;\n           ^\n\
                        \x20   1 | // line 1\n\
                        \x20   2 | extern \"C\" __global__ void k(float* o) {\n\
                        \x20 > 3 |   o[0] = x;\n\
                        \x20   4 | }\n\
                        \x20   5 | \n\
                        \n1 error detected in the compilation of \"k.cu\".\n";
        assert_eq!(out, expected);
    }

    #[test]
    fn excerpt_out_of_range_says_so() {
        assert!(excerpt("a.cu", "one line", 9).contains("outside a.cu"));
    }
}
