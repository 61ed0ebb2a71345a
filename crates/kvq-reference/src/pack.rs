//! Bit packing of integer codes.
