//! Host-side bookkeeping of a paged cache: sequence slots, lengths and page allocation.
//!
//! Every change is checked before it is applied, so a failed call (pool exhausted, unknown sequence,
//! capacity) leaves the cache exactly as it was.

use kvq_reference::regions::TokenRegions;
use kvq_spec::{SchemeSpec, TensorQuant};

use crate::error::{Result, RuntimeError};

/// A sequence's handle: its slot in the cache's per-sequence buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

#[derive(Debug, Clone, PartialEq)]
struct Sequence {
    len: usize,
    /// Physical pages of logical page slots `0..`.
    pages: Vec<u32>,
}

/// Slots, lengths and pages of every sequence, and the free page list.
#[derive(Debug, Clone)]
pub struct PageBook {
    spec: SchemeSpec,
    slots: Vec<Option<Sequence>>,
    free: Vec<u32>,
    total_pages: usize,
    max_tokens: usize,
}

/// Page-table entries a call changed: `(slot, logical page, physical page)`.
pub type TableChanges = Vec<(usize, usize, u32)>;

impl PageBook {
    /// Empty slots and a full free list.
    pub fn new(spec: SchemeSpec, max_seqs: usize, total_pages: usize, max_tokens: usize) -> Self {
        Self {
            spec,
            slots: vec![None; max_seqs],
            // Popped from the end: hand out low pages first.
            free: (0..total_pages as u32).rev().collect(),
            total_pages,
            max_tokens,
        }
    }

    /// Logical page slots a sequence of `len` tokens holds (K and V share a slot).
    pub fn pages_for(&self, len: usize) -> usize {
        let page = self.spec.page as usize;
        [&self.spec.k, &self.spec.v]
            .iter()
            .map(|t| match t {
                TensorQuant::Fp16 => len.div_ceil(page),
                _ => {
                    TokenRegions::new(
                        len,
                        self.spec.sink as usize,
                        self.spec.local_of(t) as usize,
                        page,
                    )
                    .pages
                }
            })
            .max()
            .unwrap_or(0)
    }

    /// Most logical pages any sequence can hold.
    pub fn max_pages_per_seq(&self) -> usize {
        self.pages_for(self.max_tokens).max(1)
    }

    /// Longest sequence a slot can hold.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Pages not held by any sequence.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.total_pages
    }

    fn sequence(&self, id: SeqId) -> Result<&Sequence> {
        self.slots
            .get(id.0 as usize)
            .and_then(Option::as_ref)
            .ok_or(RuntimeError::UnknownSequence(id.0))
    }

    /// Tokens of a sequence.
    pub fn len(&self, id: SeqId) -> Result<usize> {
        Ok(self.sequence(id)?.len)
    }

    /// Physical pages of a sequence, in logical order.
    pub fn pages(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.sequence(id)?.pages)
    }

    /// Takes a free slot for a new, empty sequence.
    pub fn add(&mut self) -> Result<SeqId> {
        let slot = self
            .slots
            .iter()
            .position(Option::is_none)
            .ok_or(RuntimeError::NoFreeSlot(self.slots.len()))?;
        self.slots[slot] = Some(Sequence {
            len: 0,
            pages: Vec::new(),
        });
        Ok(SeqId(slot as u32))
    }

    /// Frees a sequence's slot and pages.
    pub fn remove(&mut self, id: SeqId) -> Result<()> {
        self.sequence(id)?;
        if let Some(seq) = self.slots[id.0 as usize].take() {
            self.free.extend(seq.pages.iter().rev());
        }
        Ok(())
    }

    /// Grows the listed sequences to the given lengths, allocating the pages they need. All or
    /// nothing: on any error nothing changed. Returns the page-table entries to write.
    pub fn grow(&mut self, growth: &[(SeqId, usize)]) -> Result<TableChanges> {
        let mut needed = 0;
        for (i, &(id, new_len)) in growth.iter().enumerate() {
            let seq = self.sequence(id)?;
            if growth[..i].iter().any(|(other, _)| *other == id) {
                return Err(RuntimeError::InvalidInput(format!(
                    "sequence {} is listed twice in one step",
                    id.0
                )));
            }
            if new_len > self.max_tokens {
                return Err(RuntimeError::CapacityExceeded {
                    id: id.0,
                    len: new_len,
                    max: self.max_tokens,
                });
            }
            needed += self.pages_for(new_len).saturating_sub(seq.pages.len());
        }
        if needed > self.free.len() {
            return Err(RuntimeError::PoolExhausted {
                needed,
                free: self.free.len(),
                total: self.total_pages,
            });
        }
        let mut changes = Vec::new();
        for &(id, new_len) in growth {
            let want = self.pages_for(new_len);
            let slot = id.0 as usize;
            let Some(seq) = self.slots[slot].as_mut() else {
                continue; // checked above
            };
            while seq.pages.len() < want {
                let Some(page) = self.free.pop() else { break };
                changes.push((slot, seq.pages.len(), page));
                seq.pages.push(page);
            }
            seq.len = new_len;
        }
        Ok(changes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kitty() -> SchemeSpec {
        SchemeSpec::parse(
            "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 128), sink = 32",
        )
        .unwrap()
    }

    #[test]
    fn pages_follow_the_token_regions() {
        let book = PageBook::new(kitty(), 4, 16, 4096);
        // K (local 0) quantizes a page at 32 + 128 tokens; V (local 128) at 32 + 256.
        assert_eq!(book.pages_for(159), 0);
        assert_eq!(book.pages_for(160), 1);
        assert_eq!(book.pages_for(288), 2);
        let fp16 = PageBook::new(SchemeSpec::parse("k = fp16, v = fp16").unwrap(), 1, 4, 1000);
        assert_eq!(fp16.pages_for(1), 1);
        assert_eq!(fp16.pages_for(129), 2);
    }

    #[test]
    fn pool_exhaustion_changes_nothing() {
        let mut book = PageBook::new(kitty(), 4, 3, 100_000);
        let a = book.add().unwrap();
        let b = book.add().unwrap();
        assert_eq!(book.grow(&[(a, 160 + 128)]).unwrap().len(), 2);
        let before = (
            book.len(a).unwrap(),
            book.pages(a).unwrap().to_vec(),
            book.free_pages(),
        );
        let err = book.grow(&[(a, 160 + 256), (b, 160 + 256)]).unwrap_err();
        assert!(
            matches!(
                err,
                RuntimeError::PoolExhausted {
                    needed: 4,
                    free: 1,
                    total: 3
                }
            ),
            "{err}"
        );
        assert_eq!(
            (
                book.len(a).unwrap(),
                book.pages(a).unwrap().to_vec(),
                book.free_pages()
            ),
            before
        );
        assert_eq!(book.len(b).unwrap(), 0);
    }

    #[test]
    fn unknown_duplicate_and_over_capacity_are_errors() {
        let mut book = PageBook::new(kitty(), 2, 8, 500);
        let a = book.add().unwrap();
        assert!(matches!(
            book.grow(&[(SeqId(1), 5)]),
            Err(RuntimeError::UnknownSequence(1))
        ));
        assert!(matches!(
            book.grow(&[(a, 5), (a, 6)]),
            Err(RuntimeError::InvalidInput(_))
        ));
        assert!(matches!(
            book.grow(&[(a, 501)]),
            Err(RuntimeError::CapacityExceeded {
                id: 0,
                len: 501,
                max: 500
            })
        ));
        book.add().unwrap();
        assert!(matches!(book.add(), Err(RuntimeError::NoFreeSlot(2))));
    }

    #[test]
    fn removed_sequences_return_their_pages() {
        let mut book = PageBook::new(kitty(), 2, 4, 100_000);
        let a = book.add().unwrap();
        book.grow(&[(a, 600)]).unwrap();
        let held = book.pages(a).unwrap().len();
        assert_eq!(book.free_pages(), 4 - held);
        book.remove(a).unwrap();
        assert_eq!(book.free_pages(), 4);
        assert!(matches!(book.len(a), Err(RuntimeError::UnknownSequence(0))));
        assert_eq!(book.add().unwrap(), a);
    }
}
