//! XQuant: cache quantized layer-input latents and rematerialise K and V.
