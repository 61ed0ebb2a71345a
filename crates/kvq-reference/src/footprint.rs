//! Exact memory accounting: bytes per sequence and effective bits per element.
