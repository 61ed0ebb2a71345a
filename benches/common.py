"""Helpers the bench scripts share (they put their own folder on sys.path when run as scripts)."""


def parse_tokens(text):
    """Comma-separated counts, K = 1024: "4K,32K" -> [4096, 32768]."""
    out = []
    for part in text.split(","):
        part = part.strip()
        scale = 1
        if part[-1:] in ("K", "k"):
            scale, part = 1024, part[:-1]
        out.append(int(part) * scale)
    return out
