//! Property tests of the bit packing: every width round-trips at any row length, padding stays zero,
//! and planes sit where docs/LAYOUT.md says.

use kvq_reference::pack::{
    pack_plane, pack_row, plane_words, planes, read_words, row_words, unpack_plane, unpack_row,
    write_words,
};
use proptest::prelude::*;

fn codes(bits: u8) -> impl Strategy<Value = Vec<u8>> {
    let max = ((1u16 << bits) - 1) as u8;
    prop::collection::vec(0..=max, 0..300)
}

fn width_and_codes() -> impl Strategy<Value = (u8, Vec<u8>)> {
    prop::sample::select(vec![1u8, 2, 3, 4, 8]).prop_flat_map(|b| (Just(b), codes(b)))
}

proptest! {
    #[test]
    fn rows_round_trip((bits, codes) in width_and_codes()) {
        let words = pack_row(&codes, bits).unwrap();
        prop_assert_eq!(words.len(), row_words(bits, codes.len()).unwrap());
        prop_assert_eq!(unpack_row(&words, bits, codes.len()).unwrap(), codes.clone());
        // Through bytes, as a GPU upload would see them.
        let mut bytes = vec![0u8; words.len() * 4];
        write_words(&words, &mut bytes).unwrap();
        prop_assert_eq!(read_words(&bytes).unwrap(), words);
    }

    #[test]
    fn padding_bits_are_zero((bits, codes) in width_and_codes()) {
        let words = pack_row(&codes, bits).unwrap();
        let mut at = 0;
        for &w in planes(bits).unwrap() {
            let n = plane_words(w, codes.len());
            let used = codes.len() * w as usize;
            if n > 0 && used % 32 != 0 {
                let last = words[at + n - 1];
                prop_assert_eq!(last >> (used % 32), 0);
            }
            at += n;
        }
    }

    #[test]
    fn code_i_is_at_word_i_over_per_word(
        (bits, codes) in prop::sample::select(vec![1u8, 2, 4, 8]).prop_flat_map(|b| (Just(b), codes(b)))
    ) {
        let words = pack_row(&codes, bits).unwrap();
        let per = 32 / bits as usize;
        for (i, &c) in codes.iter().enumerate() {
            let got = (words[i / per] >> ((i % per) * bits as usize)) & ((1u32 << bits) - 1);
            prop_assert_eq!(got, c as u32);
        }
    }

    #[test]
    fn planes_extract_bit_ranges(
        width in prop::sample::select(vec![1u8, 2, 4]),
        shift in 0u8..4,
        codes in prop::collection::vec(any::<u8>(), 1..200),
    ) {
        let mut words = vec![0u32; plane_words(width, codes.len())];
        pack_plane(&codes, width, shift, &mut words).unwrap();
        let back = unpack_plane(&words, width, codes.len()).unwrap();
        let mask = (1u8 << width) - 1;
        for (c, b) in codes.iter().zip(back) {
            prop_assert_eq!((c >> shift) & mask, b);
        }
    }
}

#[test]
fn three_bit_rows_take_three_words_per_32_codes() {
    assert_eq!(row_words(3, 32).unwrap(), 3);
    assert_eq!(row_words(3, 128).unwrap(), 12);
    assert_eq!(row_words(3, 33).unwrap(), 3 + 2);
    assert_eq!(row_words(2, 128).unwrap(), 8);
    assert_eq!(row_words(1, 1).unwrap(), 1);
    assert_eq!(row_words(8, 0).unwrap(), 0);
}

#[test]
fn wrong_sizes_and_widths_are_errors_not_panics() {
    assert!(row_words(5, 32).is_err());
    assert!(pack_row(&[8], 3).is_err());
    assert!(unpack_row(&[0; 2], 3, 32).is_err());
    assert!(pack_plane(&[1, 2], 3, 0, &mut [0]).is_err());
    assert!(pack_plane(&[1, 2], 2, 0, &mut [0, 0]).is_err());
    assert!(read_words(&[1, 2, 3]).is_err());
    assert!(write_words(&[1], &mut [0; 3]).is_err());
}
