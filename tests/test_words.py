"""One word per idea (docs/design.md, "Words"): the names each idea had before are gone from megatrain/, actors/,
pipelines/ and the docs (read as text, like test_function_size.py reads the code)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("megatrain", "actors", "pipelines", "docs")
# the retired form -> the word for its idea
RETIRED = {
    r"(?i)\blayer[- ](input )?checkpoints?\b": "activation checkpoints (device / offloaded checkpoints)",
    r"\b(peak_)?kept_bytes\b": "device_bytes: the device checkpoints' bytes",
    r"\bkept\s*:\s*dict\[str, torch\.Tensor\]": "passthrough: the pass-through tensors",
    r"(?i)\bgradients? (are |were |stay )?kept\b|\bkept gradients?\b": "held gradients",
    r"\bput_back\b|\bput back\b": "roll back: a speculated update",
    r"\bunpublish\b": "roll_back_versions",
    r"\battempts?\s*[=:,)]|\.attempts?\b|`attempts?`": "a Speculation's number",  # the identifier, not the English
    r"\bdef finish\(|\.finish\(unit|\bdef keep\(|\bactors\.keep\(|\b_validate\(": "settle / confirm",
    r"(?i)\b(taken|took|takes?|taking) back\b|\"undo\"|\bundo \+|\bundo\s*[=:]|\b_undo\(":
        "rolled back (the span: roll_back)",
    r"(?i)\bkept (and updated )?on the (device|gpu|host)\b|\b(kept|keeps?) (resident|by one executor)\b|\bunits kept\b":
        "resident units / units held for generation",
    r"(?i)\bcopy( of (the|their) weights)? kept\b|\bno (bf16 )?copy (of them )?(is )?kept\b|\bkept as a bf16 copy\b":
        "the bf16 copy (in the arena; bf16_copy = keep is the setting's value)",
    r"(?i)\bbatches kept\b|\bkept batches\b": "logged batches (ReplayLog)",
    r"(?i)\b(buffers and|pipeline, its) checkpoints\b|\brecompute from their checkpoints\b":
        "activation checkpoints (a bare 'checkpoint' is a training checkpoint)",
    r"(?i)(\b|_)shadow": "the bf16 copy (bf16_copy, BF16_COPY_SEGMENT, bf16_copy_bytes)",
}


def files() -> list[Path]:
    found = [ROOT / "README.md"]
    for room in SOURCES:
        found += sorted(p for p in (ROOT / room).rglob("*") if p.suffix in (".py", ".md"))
    return found


def test_retired_words_are_gone() -> None:
    hits = []
    for path in files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]!r} -> {word}"
                     for pattern, word in RETIRED.items() if re.search(pattern, line)]
    assert hits == []


def test_the_patterns_find_the_retired_words() -> None:
    samples = ["every layer checkpoint on the device", "self.peak_kept_bytes", "kept: dict[str, torch.Tensor] = {}",
               "the gradients kept on the device", "w.put_back.remote(step)", "self.unpublish(step)",
               "Speculation(self.attempts)", "shard.finish(unit, step)", "steps took back their updates",
               "units kept on the device", "a bf16 copy of their weights kept", "the batches kept to replay them",
               "the pipeline's buffers and checkpoints", "store._refresh_shadow()"]
    for sample, pattern in zip(samples, RETIRED, strict=True):
        assert re.search(pattern, sample), (pattern, sample)
    rolled_back = list(RETIRED)[8]
    assert all(re.search(rolled_back, s) for s in ('"undo" if', "self._pass(u, 1.0, undo=True)", "self._undo(piece"))
    copy = list(RETIRED)[-1]
    assert all(re.search(copy, s) for s in ("SHADOW_SEGMENT", "plan.shadow_bytes", "the bf16 shadow", "shadow=True"))
