//! How a sequence's tokens split into FP16 sink, quantized pages and FP16 tail for one tensor.
//!
//! Sink = the first `sink` tokens. The tail (FP16) holds the most recent `local` tokens plus the
//! tokens that wait for a page to fill (the Q-buffer). Pages = every whole page between them.
//! The split depends only on the length, so bulk prefill and lazy token-by-token append produce the
//! same split (a page is quantized once `local + page` tokens wait in the tail).

use kvq_spec::{SchemeSpec, TensorQuant};
use std::ops::Range;

/// The split of `len` tokens for one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRegions {
    pub len: usize,
    pub sink_end: usize,
    pub pages: usize,
    pub page: usize,
}

impl TokenRegions {
    pub fn new(len: usize, sink: usize, local: usize, page: usize) -> Self {
        let sink_end = sink.min(len);
        let rest = len - sink_end;
        let pages = rest.saturating_sub(local) / page;
        Self {
            len,
            sink_end,
            pages,
            page,
        }
    }

    pub fn sink(&self) -> Range<usize> {
        0..self.sink_end
    }

    /// Tokens of quantized page `p`.
    pub fn page_tokens(&self, p: usize) -> Range<usize> {
        let start = self.sink_end + p * self.page;
        start..start + self.page
    }

    /// All tokens held in quantized pages.
    pub fn quantized(&self) -> Range<usize> {
        self.sink_end..self.sink_end + self.pages * self.page
    }

    /// FP16 tokens after the pages (Q-buffer + local window).
    pub fn tail(&self) -> Range<usize> {
        self.quantized().end..self.len
    }

    pub fn is_quantized(&self, token: usize) -> bool {
        self.quantized().contains(&token)
    }
}

/// The first cache length at which a page of `tensor` fills and is quantized (`None` for an FP16
/// tensor): `sink + local + page`, where [`TokenRegions::new`] first counts a page.
pub fn first_page_fill(spec: &SchemeSpec, tensor: &TensorQuant) -> Option<usize> {
    tensor
        .is_quantized()
        .then(|| (spec.sink + spec.local_of(tensor) + spec.page) as usize)
}

/// The cache lengths up to `up_to` at which a page of K or V fills and is quantized, ascending
/// (a step that shows its tokens the cache as one-token decoding does ends before each).
pub fn page_fill_lengths(spec: &SchemeSpec, up_to: usize) -> Vec<usize> {
    let mut out: Vec<usize> = [&spec.k, &spec.v]
        .into_iter()
        .filter_map(|t| first_page_fill(spec, t))
        .flat_map(|first| (first..=up_to).step_by(spec.page as usize))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_every_token_once() {
        for len in [0, 1, 31, 32, 33, 159, 160, 161, 288, 289, 1000] {
            let r = TokenRegions::new(len, 32, 128, 128);
            assert_eq!(r.sink().end, r.quantized().start);
            assert_eq!(r.quantized().end, r.tail().start);
            assert_eq!(r.tail().end, len);
            assert!(r.tail().len() < 128 + 128 || len < 32);
            assert!(len <= 32 || r.tail().len() >= 128.min(len - 32));
        }
    }

    #[test]
    fn page_fills_are_where_the_regions_gain_a_page() {
        let spec = SchemeSpec::parse(
            "k = int(2, channel), v = int(2, token, local = 64), sink = 16, page = 32",
        )
        .unwrap();
        let fills = page_fill_lengths(&spec, 400);
        for len in 1..=400 {
            let grows = |local| {
                TokenRegions::new(len, 16, local, 32).pages
                    > TokenRegions::new(len - 1, 16, local, 32).pages
            };
            assert_eq!(fills.contains(&len), grows(0) || grows(64), "length {len}");
        }
        let fp16 = SchemeSpec::parse("k = fp16, v = fp16").unwrap();
        assert!(page_fill_lengths(&fp16, 1000).is_empty());
    }

    #[test]
    fn pages_appear_only_when_local_and_a_page_wait() {
        assert_eq!(TokenRegions::new(32 + 128 + 127, 32, 128, 128).pages, 0);
        assert_eq!(TokenRegions::new(32 + 128 + 128, 32, 128, 128).pages, 1);
        assert_eq!(TokenRegions::new(256, 0, 0, 128).pages, 2);
    }
}
