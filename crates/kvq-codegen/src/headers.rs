//! The CUDA headers under the workspace's `kernels/include/` that every generated unit includes
//! (`#include "kvq/…"`): the algorithms, as plain CUDA C++. Embedded so nothing reads the source
//! tree at run time; a compile site hands all of them to NVRTC as in-memory headers, and
//! `kvq gen` writes them beside the units it ships.

/// Each header as `(name, text)`, the name as written in `#include "…"`.
macro_rules! embedded {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_str!(concat!("../../../kernels/include/", $name)))),*]
    };
}

/// Every kernel header, by the name units include it under. Append new headers here.
pub const KERNEL_HEADERS: &[(&str, &str)] = embedded![
    "kvq/common.cuh",
    "kvq/io.cuh",
    "kvq/tensor.cuh",
    "kvq/combine.cuh",
    "kvq/merge.cuh",
    "kvq/decode_common.cuh",
    "kvq/decode/constants.cuh",
    "kvq/decode/helpers.cuh",
    "kvq/decode/slabs.cuh",
    "kvq/decode/sources.cuh",
    "kvq/decode/ring.cuh",
    "kvq/decode/keys_f16.cuh",
    "kvq/decode/keys_int.cuh",
    "kvq/decode/keys_fp16_rows.cuh",
    "kvq/decode/keys_boost.cuh",
    "kvq/decode/values.cuh",
    "kvq/decode/shares.cuh",
    "kvq/decode/fold.cuh",
    "kvq/decode/softmax.cuh",
    "kvq/decode/params.cuh",
    "kvq/decode/calibrated.cuh",
    "kvq/decode/decode_kernel.cuh",
    "kvq/decode_generic.cuh",
    "kvq/quantize.cuh",
    "kvq/quantize_regs.cuh",
    "kvq/cache.cuh",
    "kvq/codebook/side.cuh",
    "kvq/codebook/decode.cuh",
    "kvq/codebook/encode.cuh",
    "kvq/xquant/latents.cuh",
    "kvq/xquant/rebuild.cuh",
    "kvq/xquant/values.cuh",
    "kvq/hopper.cuh",
    "kvq/xquant/warpgroup.cuh",
    "kvq/xquant/scores.cuh",
    "kvq/xquant/decode.cuh",
    "kvq/xquant/project.cuh",
    "kvq/xquant/cross_layer.cuh",
];

/// [`KERNEL_HEADERS`]: what a compile site passes to NVRTC beside a generated unit.
pub fn kernel_headers() -> &'static [(&'static str, &'static str)] {
    KERNEL_HEADERS
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each header guards itself and is plain CUDA: no Tera syntax survived the move.
    #[test]
    fn headers_are_plain_cuda_with_pragma_once() {
        assert!(!KERNEL_HEADERS.is_empty());
        for (name, text) in KERNEL_HEADERS {
            assert!(name.starts_with("kvq/") && name.ends_with(".cuh"), "{name}");
            assert!(
                text.lines().any(|l| l.trim() == "#pragma once"),
                "{name} lacks #pragma once"
            );
            for tera in ["{{", "}}", "{%", "%}", "{#", "#}"] {
                assert!(!text.contains(tera), "{name} holds Tera syntax `{tera}`");
            }
        }
    }

    /// Every `#include "kvq/…"` of a header names an embedded header.
    #[test]
    fn header_includes_resolve_in_memory() {
        for (name, text) in KERNEL_HEADERS {
            for line in text.lines() {
                if let Some(rest) = line.trim().strip_prefix("#include \"") {
                    let included = rest.split('"').next().unwrap_or(rest);
                    assert!(
                        KERNEL_HEADERS.iter().any(|(n, _)| *n == included),
                        "{name} includes {included}, which is not embedded"
                    );
                }
            }
        }
    }

    #[test]
    fn names_are_unique() {
        for (i, (a, _)) in KERNEL_HEADERS.iter().enumerate() {
            assert!(KERNEL_HEADERS[i + 1..].iter().all(|(b, _)| a != b), "{a}");
        }
    }
}
