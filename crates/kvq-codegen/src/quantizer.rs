//! The forms a page quantizer kernel can take — the naive, tiled, coarsened and vectorized
//! organisations of the GPU INT8-quantization study — and which of them a tensor's layout allows.
//! Every form writes the same bytes (the reference's); they differ only in speed, so the runtime's
//! tuner may pick any supported one.

use std::fmt;
use std::str::FromStr;

use kvq_reference::int::IntLayout;
use kvq_spec::{Axis, SchemeSpec, TensorQuant};
use serde::{Deserialize, Serialize};

/// How a page quantizer kernel is organised. One CTA quantizes one page of one KV head in all forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantizerForm {
    /// Values read from global memory as they are needed (twice: reductions, then encoding);
    /// codes through a shared buffer. The baseline.
    Naive,
    /// The page staged in shared memory with 16-byte copies, then every phase works from there.
    Tiled,
    /// The page held in registers, each thread 8 channels × several rows, read as 16-bit values.
    Coarsened,
    /// As coarsened, with one 16-byte load per row chunk (input rows must be 16-byte aligned).
    Vectorized,
}

/// Register forms keep at most this many rows per thread (8 channels each: 32 registers).
const MAX_ROWS_PER_THREAD: u32 = 8;
/// Register forms gather a row's high plane with per-slot shuffle sources and masks held in
/// registers (three per pass of `head_dim / 8` slots); high rows of at most 7 words keep them few.
const MAX_HIGH_ROW_WORDS: usize = 7;
/// Register forms fold Kitty's scores over at most this many row classes in shared memory.
const MAX_ROW_CLASSES: u32 = 32;

impl QuantizerForm {
    /// Every form, slowest expected first.
    pub const ALL: [QuantizerForm; 4] = [
        QuantizerForm::Naive,
        QuantizerForm::Tiled,
        QuantizerForm::Coarsened,
        QuantizerForm::Vectorized,
    ];

    /// The name used in manifests, tuning files and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            QuantizerForm::Naive => "naive",
            QuantizerForm::Tiled => "tiled",
            QuantizerForm::Coarsened => "coarsened",
            QuantizerForm::Vectorized => "vectorized",
        }
    }

    /// Holds the page in registers.
    pub fn in_registers(self) -> bool {
        matches!(self, QuantizerForm::Coarsened | QuantizerForm::Vectorized)
    }

    /// Whether this form implements `quant` at this head_dim and page size. Naive and tiled cover
    /// every integer layout; the register forms need head_dim 32 or a multiple of 16 from 64 to
    /// 256 (a row's 8-channel chunks over a power of two of lanes, the lanes past the row idle),
    /// pages of at most 256 tokens, and token groups of a multiple of 8 channels that are the
    /// whole row or a power of two of chunks of a row of a power of two of chunks (a group's
    /// lanes reduce with butterfly shuffles).
    pub fn supports(self, quant: &TensorQuant, head_dim: u32, page: u32) -> bool {
        let TensorQuant::Int(q) = quant else {
            return false;
        };
        if !self.in_registers() {
            return true;
        }
        let group_ok = match q.axis {
            Axis::Channel => true,
            Axis::Token => {
                let group = q.group.unwrap_or(head_dim);
                group % 8 == 0 && (group == head_dim || (head_dim / 8).is_power_of_two())
            }
        };
        let high_ok = IntLayout::new(q, head_dim as usize, page as usize)
            .map(|l| {
                l.boost
                    .map_or(true, |b| b.high_row_words <= MAX_HIGH_ROW_WORDS)
            })
            .unwrap_or(false);
        group_ok && high_ok && register_shape(head_dim, page).is_some()
    }

    /// The form used when nothing was tuned: vectorized where supported, else tiled.
    pub fn default_for(quant: &TensorQuant, head_dim: u32, page: u32) -> QuantizerForm {
        if QuantizerForm::Vectorized.supports(quant, head_dim, page) {
            QuantizerForm::Vectorized
        } else {
            QuantizerForm::Tiled
        }
    }
}

impl fmt::Display for QuantizerForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for QuantizerForm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        QuantizerForm::ALL
            .into_iter()
            .find(|f| f.as_str() == s)
            .ok_or_else(|| {
                format!("unknown quantizer form `{s}` (naive, tiled, coarsened, vectorized)")
            })
    }
}

/// The quantizer forms of a scheme's two tensors (ignored for FP16 tensors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QuantizerForms {
    pub k: QuantizerForm,
    pub v: QuantizerForm,
}

impl QuantizerForms {
    /// The same form for both tensors.
    pub fn both(form: QuantizerForm) -> QuantizerForms {
        QuantizerForms { k: form, v: form }
    }

    /// [`QuantizerForm::default_for`] of each tensor.
    pub fn default_for(spec: &SchemeSpec, head_dim: u32) -> QuantizerForms {
        QuantizerForms {
            k: QuantizerForm::default_for(&spec.k, head_dim, spec.page),
            v: QuantizerForm::default_for(&spec.v, head_dim, spec.page),
        }
    }
}

impl fmt::Display for QuantizerForms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "k {}, v {}", self.k, self.v)
    }
}

/// Threads and rows per thread of a register form: 8 channels per lane, `head_dim / 8` chunks a
/// row over the next power of two of lanes (`lanes_per_row`), the page padded to a power of two
/// `N`, at most 8 rows per thread and 32 row classes (threads / lanes per row). `None` for other
/// head_dims or when the page is too large for that.
pub(crate) fn register_shape(head_dim: u32, page: u32) -> Option<(u32, u32)> {
    let shape_ok = head_dim == 32 || (head_dim % 16 == 0 && (64..=256).contains(&head_dim));
    if !shape_ok || page == 0 {
        return None;
    }
    let lanes = lanes_per_row(head_dim);
    let n = page.next_power_of_two();
    let most = (MAX_ROW_CLASSES * lanes).min(1024);
    let threads = (n * lanes / MAX_ROWS_PER_THREAD).clamp(32, most);
    let rows = n * lanes / threads;
    (1..=MAX_ROWS_PER_THREAD)
        .contains(&rows)
        .then_some((threads, rows))
}

/// Lanes a row of a register form takes: its `head_dim / 8` chunks of 8 channels, rounded up to
/// a power of two (kvq/quantize_regs.cuh's `KvqRegShape::LPR`).
pub(crate) fn lanes_per_row(head_dim: u32) -> u32 {
    (head_dim / 8).next_power_of_two()
}

/// Row classes and rows per class of the naive/tiled forms' Kitty fold: the classes' partials
/// (classes · head_dim floats) reuse the page's code buffer (page · head_dim bytes).
pub(crate) fn fold_shape(page: u32) -> (u32, u32) {
    let n = page.next_power_of_two();
    let mut classes = 1;
    while classes * 2 <= MAX_ROW_CLASSES && classes * 2 * 4 <= page {
        classes *= 2;
    }
    (classes, n / classes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_shapes_cover_the_page_with_at_most_eight_rows_per_thread() {
        for d in [
            32, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256,
        ] {
            for page in (16..=256).step_by(16) {
                let (threads, rows) = register_shape(d, page).expect("supported");
                let lanes_per_row = lanes_per_row(d);
                assert!(lanes_per_row * 8 >= d && lanes_per_row.is_power_of_two());
                let classes = threads / 32 * (32 / lanes_per_row);
                assert!(
                    classes * rows >= page && classes <= 32 && rows <= 8,
                    "{d} {page}"
                );
                assert_eq!(classes * rows, page.next_power_of_two());
            }
        }
        assert_eq!(register_shape(128, 128), Some((256, 8)));
        assert_eq!(register_shape(128, 512), None);
        // Rows of 10 or 12 chunks take 16 lanes, as head_dim 128's do.
        assert_eq!(register_shape(80, 128), Some((256, 8)));
        assert_eq!(register_shape(96, 128), Some((256, 8)));
        assert_eq!(register_shape(48, 128), None);
        assert_eq!(register_shape(272, 128), None);
    }

    #[test]
    fn token_groups_in_registers_are_whole_rows_or_power_of_two_lanes() {
        let token = |group: &str, d: u32| {
            let spec = SchemeSpec::parse(&format!(
                "k = int(2, channel), v = int(2, token{group}), local = 128"
            ))
            .unwrap();
            QuantizerForm::Vectorized.supports(&spec.v, d, spec.page)
        };
        assert!(token("", 80) && token("", 96) && token("", 112) && token("", 128));
        assert!(token(", group = 32", 128) && token(", group = 16", 64));
        // 96 channels are 12 chunks: a 16- or 32-channel group's lanes would cross rows.
        assert!(!token(", group = 32", 96) && !token(", group = 16", 80));
    }

    #[test]
    fn fold_partials_fit_the_code_buffer() {
        for page in (16..=1024).step_by(16) {
            let (classes, rows) = fold_shape(page);
            assert!(classes * 4 <= page && classes <= 32);
            assert_eq!(classes * rows, page.next_power_of_two());
        }
    }

    #[test]
    fn forms_parse_and_print() {
        for f in QuantizerForm::ALL {
            assert_eq!(f.as_str().parse::<QuantizerForm>(), Ok(f));
        }
        assert!("fast".parse::<QuantizerForm>().is_err());
    }
}
