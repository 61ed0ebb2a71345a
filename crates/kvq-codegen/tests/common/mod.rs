//! What the decode-kernel tests share.

/// Integer and FP16 schemes covering every code path of the decode template.
pub const SCHEMES: &[&str] = &[
    "k = fp16, v = fp16",
    "k = int(2, channel), v = int(2, token), local = 128",
    "k = int(4, channel), v = int(4, token), local = 128",
    "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 128), sink = 32",
    "k = int(1, channel), v = int(1, channel), local = 128, calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)",
    "k = int(8, channel, symmetric), v = int(8, channel, symmetric)",
    "k = int(3, token, group = 32), v = int(3, channel), sink = 16, page = 64",
    "k = int(4, channel), v = fp16, sink = 4",
    "k = int(4, channel, symmetric, boost = boost(8, ratio = 0.25, by = variance)), v = int(2, token, group = 32), local = 64",
    "k = int(2, channel), v = int(2, channel), sink = 32, local = 128, calibrate = calibrate(tau1 = -1.25, tau2 = 0.75)",
];
