"""The model-type sweep (benchmarks/model_sweep.py) against the table it wrote (docs/model_types.json and .md):
representative model types classified as the table says, none of them silently wrong or crashing (the ones that
still are: strict xfails, which turn into failures once fixed, until the table is written again), the markdown
generated from the JSON, and, marked slow, every causal-LM model type of the installed transformers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import transformers

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is no installed package (`python3 -m pytest` finds it anyway)
    sys.path.insert(0, str(REPO))

from benchmarks.model_sweep import (  # noqa: E402
    DOCS_JSON,
    DOCS_MD,
    Result,
    causal_lm_types,
    check_model_type,
    decoder_only_share,
    markdown,
    read_table,
    sweep,
)

TABLE_VERSION, TABLE = read_table(DOCS_JSON)
BY_TYPE = {r.model_type: r for r in TABLE}
SAME_TRANSFORMERS = TABLE_VERSION == transformers.__version__
# dense, learned positions (GPT-2), another stack layout (GPT-NeoX), a logit scale (Cohere), muP multipliers
# (Granite), a final norm with a bias (StarCoder2), a norm without weights (OLMo), MLA + MoE with a dense prefix
# (DeepSeek-V3), hybrid linear / full attention + MoE (Qwen3-Next), MoE (Mixtral), an embedding norm (BLOOM), a
# vision-language model whose towers pass through (Gemma 3), an embedding container and a prediction head
# (ModernBERT decoder), a sliding window (Mistral), an encoder refused for what it is (BERT), a linear attention whose
# decay's gradients fp32 rounds to 1e-4 of fp64 (LaRA mini: refused while one fp32 run of transformers gave the
# rounding's scale, self_check.FP32_LOSS_SCALES)
REPRESENTATIVE = ["llama", "gpt2", "gpt_neox", "cohere", "granite", "starcoder2", "olmo", "deepseek_v3", "qwen3_next",
                  "mixtral", "bloom", "gemma3", "modernbert-decoder", "mistral", "bert", "lara_mini"]
SILENT_OR_CRASH = ("wrong", "crash")
needs_table_transformers = pytest.mark.skipif(
    not SAME_TRANSFORMERS, reason=f"the table is of transformers {TABLE_VERSION}, {transformers.__version__} is "
                                  "installed: run benchmarks/model_sweep.py again")


def known_bad(model_type: str) -> list[pytest.MarkDecorator]:
    """A strict xfail where the table says the type is still wrong or crashes: fixing it fails the test until the
    table is written again."""
    row = BY_TYPE.get(model_type)
    if row is None or row.outcome not in SILENT_OR_CRASH:
        return []
    return [pytest.mark.xfail(strict=True, reason=f"{row.outcome}: {row.detail[:200]}")]


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    """Each representative type run once through the sweep's check, in this process."""
    workdir = tmp_path_factory.mktemp("sweep")
    return {t: check_model_type(t, workdir) for t in REPRESENTATIVE}


@needs_table_transformers
@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_representative_types_are_as_the_table_says(model_type: str, checked: dict[str, Result]) -> None:
    result, row = checked[model_type], BY_TYPE[model_type]
    assert result.outcome == row.outcome, (f"{model_type} is now {result.outcome} ({result.detail}); the table says "
                                           f"{row.outcome}: run benchmarks/model_sweep.py again")


@needs_table_transformers
@pytest.mark.parametrize("model_type", [pytest.param(t, marks=known_bad(t)) for t in REPRESENTATIVE])
def test_representative_types_are_never_silently_wrong_or_crash(model_type: str, checked: dict[str, Result]) -> None:
    result = checked[model_type]
    assert result.outcome not in SILENT_OR_CRASH, f"{model_type}: {result.outcome}: {result.detail}"


def test_table_markdown_is_written_from_the_json() -> None:
    assert DOCS_MD.read_text() == markdown(TABLE, TABLE_VERSION), "run benchmarks/model_sweep.py again"
    assert all(r.outcome in ("exact", "wrong", "crash", "refused", "unbuildable") for r in TABLE)


def test_table_meets_the_bar() -> None:
    """What the table of the whole sweep records: nothing wrong, nothing crashed; at least 85% of the decoder-only
    types exact; fewer than 10 unbuildable, each with why."""
    outcomes = [r.outcome for r in TABLE]
    assert "wrong" not in outcomes and "crash" not in outcomes
    exact, decoders = decoder_only_share(TABLE)
    assert exact >= 0.85 * decoders, f"{exact} of {decoders} decoder-only types exact"
    unbuildable = [r for r in TABLE if r.outcome == "unbuildable"]
    assert len(unbuildable) < 10 and all(r.detail for r in unbuildable)


@needs_table_transformers
def test_table_has_every_causal_lm_type() -> None:
    assert [r.model_type for r in TABLE] == causal_lm_types()


@needs_table_transformers
@pytest.mark.slow
def test_whole_sweep_is_as_the_table_says(tmp_path: Path) -> None:
    """Every causal-LM model type in worker processes, as `python benchmarks/model_sweep.py` runs them."""
    results = sweep(causal_lm_types(), timeout=300, log_dir=tmp_path, progress=False)
    changed = {r.model_type: (BY_TYPE[r.model_type].outcome, r.outcome, r.detail[:120]) for r in results
               if r.outcome != BY_TYPE[r.model_type].outcome}
    assert not changed, f"(table, now, detail) of the types that changed; run the sweep again: {changed}"
