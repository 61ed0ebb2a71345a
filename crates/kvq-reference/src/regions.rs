//! How a sequence's tokens split into FP16 sink, quantized pages and FP16 tail for one tensor.
//!
//! Sink = the first `sink` tokens. The tail (FP16) holds the most recent `local` tokens plus the
//! tokens that wait for a page to fill (the Q-buffer). Pages = every whole page between them.
//! The split depends only on the length, so bulk prefill and lazy token-by-token append produce the
//! same split (a page is quantized once `local + page` tokens wait in the tail).

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
    fn pages_appear_only_when_local_and_a_page_wait() {
        assert_eq!(TokenRegions::new(32 + 128 + 127, 32, 128, 128).pages, 0);
        assert_eq!(TokenRegions::new(32 + 128 + 128, 32, 128, 128).pages, 1);
        assert_eq!(TokenRegions::new(256, 0, 0, 128).pages, 2);
    }
}
