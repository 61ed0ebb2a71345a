//! [`SequenceSnapshot`]: one sequence's device state copied back, and its byte-for-byte comparison
//! with the CPU reference's store of the same tokens.

use kvq_reference::int::IntCache;

/// What one sequence holds on the device, for checks against the CPU reference.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceSnapshot {
    /// Tokens held.
    pub len: usize,
    /// K page blocks in logical order, each `[kv_head][block]` bytes.
    pub k_pages: Vec<Vec<u8>>,
    /// V page blocks in logical order.
    pub v_pages: Vec<Vec<u8>>,
    /// `[kv_head][sink][head_dim]` f16 bits.
    pub k_sink: Vec<u16>,
    /// V sink, as K's.
    pub v_sink: Vec<u16>,
    /// `[kv_head][capacity][head_dim]` f16 bits (ring).
    pub k_tail: Vec<u16>,
    /// V tail ring, as K's.
    pub v_tail: Vec<u16>,
}

impl SequenceSnapshot {
    /// Where this state differs from `reference` (the reference's store of the same tokens, with
    /// the cache's KV heads and head_dim): pages byte for byte per head, the FP16 sinks, and the
    /// tail ring's live slots. Empty when bit-exact.
    pub fn differences(&self, reference: &IntCache) -> Vec<String> {
        let mut diffs = Vec::new();
        let sides = [
            (
                "K",
                &self.k_pages,
                reference.k(),
                &self.k_sink,
                &self.k_tail,
            ),
            (
                "V",
                &self.v_pages,
                reference.v(),
                &self.v_sink,
                &self.v_tail,
            ),
        ];
        for (name, pages, store, sink, tail) in sides {
            let (heads, d) = (store.kv_heads(), store.head_dim());
            if pages.len() != store.pages() {
                diffs.push(format!(
                    "{name}: {} pages on the GPU, {} in the reference",
                    pages.len(),
                    store.pages()
                ));
                continue;
            }
            let block = store.block_bytes();
            for (j, page) in pages.iter().enumerate() {
                for h in 0..heads {
                    let Some(want) = store.block(j, h) else {
                        diffs.push(format!("{name} page {j} head {h}: no reference block"));
                        continue;
                    };
                    let have = page.get(h * block..(h + 1) * block).unwrap_or(&[]);
                    if have != want {
                        let first = have.iter().zip(want).position(|(a, b)| a != b);
                        let n = have.iter().zip(want).filter(|(a, b)| a != b).count();
                        diffs.push(format!(
                            "{name} page {j} head {h}: {n} bytes differ, first at byte {}",
                            first.unwrap_or(have.len().min(want.len()))
                        ));
                    }
                }
            }
            let want_sink: Vec<u16> = store.sink().iter().map(|h| h.to_bits()).collect();
            if *sink != want_sink {
                diffs.push(format!("{name} sink differs"));
            }
            if let Some(regions) = store.regions() {
                let cap = store.tail_capacity();
                let want_tail = store.tail();
                for t in regions.tail() {
                    let Some(slot) = store.tail_slot(t) else {
                        diffs.push(format!("{name} tail token {t}: no reference slot"));
                        continue;
                    };
                    for h in 0..heads {
                        let at = (h * cap + slot) * d;
                        let want: Vec<u16> =
                            want_tail[at..at + d].iter().map(|x| x.to_bits()).collect();
                        if tail.get(at..at + d) != Some(&want[..]) {
                            diffs.push(format!("{name} tail token {t} head {h} differs"));
                        }
                    }
                }
            }
        }
        diffs
    }
}
