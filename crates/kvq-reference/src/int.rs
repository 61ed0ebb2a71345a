//! Integer quantization (KIVI, Kitty, CalibQuant, INT8) and the FP16 regions.
