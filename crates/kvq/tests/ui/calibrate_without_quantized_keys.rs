#[kvq::scheme(k = fp16, v = int(2, token), calibrate = calibrate(tau1 = 0.6, tau2 = 0.1))]
struct NothingToCalibrate;

fn main() {}
