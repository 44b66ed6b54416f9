"""Engine.generate's driver side and `megatrain generate`'s prompts: prompts (token ids, or text the model's tokenizer
encodes) go to the executor, which generates with a KV cache on the layers as they stream
(megatrain/engine/generation.py); completions come back as token ids and, where there is a tokenizer, text.

The end-of-sequence tokens a row stops at are the model's own, as transformers' generate reads them: its
generation_config.json's eos_token_id (one id or several), else config.json's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatrain.config import ConfigError, ModelConfig
from megatrain.data.tokenizers import Tokenizer, load_tokenizer
from megatrain.engine.generation import Sampling

log = logging.getLogger(__name__)
Prompt = str | list[int]


@dataclass
class Completions:
    """Per prompt: its token ids (as encoded), the new tokens (the end-of-sequence token included where one ended the
    row), whether one did, and the new tokens as text where the model has a tokenizer (None otherwise)."""

    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    finished: list[bool]
    texts: list[str] | None = None
    # per executor that generated: the units it kept on its device for the call beyond the run's resident ones, and
    # their bytes (megatrain/engine/generation.py)
    held_units: list[list[int]] = field(default_factory=list)
    held_bytes: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)


def model_tokenizer(model_dir: Path | None) -> Tokenizer | None:
    """The model directory's tokenizer.json, if it has one."""
    return load_tokenizer(model_dir) if model_dir is not None and (model_dir / "tokenizer.json").is_file() else None


def eos_ids(model_dir: Path | None, config: ModelConfig) -> tuple[int, ...]:
    """The tokens that end a row: generation_config.json's eos_token_id (an id or a list), else the config's."""
    file = None if model_dir is None else model_dir / "generation_config.json"
    eos: Any = config.eos_token_id
    if file is not None and file.is_file():
        eos = json.loads(file.read_text()).get("eos_token_id", eos)
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    return tuple(int(t) for t in eos)


def encoded(prompts: list[Prompt], tokenizer: Tokenizer | None) -> list[list[int]]:
    """Each prompt as token ids: text through the tokenizer, ids as given."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ConfigError("prompts must be a list: of strings, or of token-id lists.")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ConfigError("text prompts need the model's tokenizer, and this model directory has no "
                                  "tokenizer.json; pass token ids, or a tokenizer.")
            p = tokenizer.encode(p)
        out.append([int(t) for t in p])
    return out


def split_rows(rows: int, executors: int) -> list[tuple[int, int]]:
    """(first, end) of each executor's share of `rows` prompts, contiguous and as even as can be (none empty)."""
    n = max(1, min(rows, executors))
    bounds = [rows * k // n for k in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def completions(prompt_ids: list[list[int]], outs: list[dict[str, Any]], tokenizer: Tokenizer | None) -> Completions:
    """What the executors' generate calls returned (their shares of the prompts, in order), with the text of the new
    tokens where there is a tokenizer."""
    token_ids = [t for out in outs for t in out["token_ids"]]
    texts = None if tokenizer is None else [tokenizer.decode(t) for t in token_ids]
    return Completions(prompt_ids, token_ids, [f for out in outs for f in out["finished"]], texts,
                       [out["held_units"] for out in outs], [out["held_bytes"] for out in outs])


# ---- megatrain generate ----

def read_prompts(texts: list[str], file: str | None) -> list[Prompt]:
    """`megatrain generate`'s prompts: the --prompt texts, then the lines of the --prompts JSONL file ("prompt": a
    text, or "prompt_ids": token ids)."""
    prompts: list[Prompt] = list(texts)
    if file:
        path = Path(file)
        if not path.is_file():
            raise ConfigError(f"--prompts {path} is no file; give a JSONL file of {{\"prompt\": text}} lines.")
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not ("prompt" in row or "prompt_ids" in row):
                raise ConfigError(f"{path} line {number} has neither \"prompt\" nor \"prompt_ids\".")
            prompts.append(row["prompt_ids"] if "prompt_ids" in row else row["prompt"])
    if not prompts:
        raise ConfigError("megatrain generate needs a prompt: --prompt TEXT or --prompts FILE.jsonl.")
    return prompts


class Generating:
    """Engine.generate: pipelines/engine.py's Engine inherits it (its store, executor, updates and config)."""

    def generate(self, prompts: list[Prompt], max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, *, eos_token_ids: list[int] | None = None, tokenizer: Tokenizer | None = None,
                 hold_weights: bool = True) -> Completions:
        """Completions of a batch of prompts (texts, which the model's tokenizer encodes, or token-id lists) by the
        streamed model with the current weights, with a KV cache (megatrain/engine/generation.py): greedy where
        temperature is 0, else sampled (top_p; seed: the same seed repeats the same tokens, each prompt's drawn from a
        generator of its own). A row ends at one of eos_token_ids (None: the model's, from its generation_config.json
        or config.json) or after max_new_tokens. With several executors each generates a contiguous share of the
        prompts, all at once: the same tokens as one would give. hold_weights: each executor keeps as many units on
        its device for the call as fit beyond the resident ones (Completions.held_units; False: none)."""
        from pipelines.run_actors import get

        engine: Any = self
        engine._check_running()
        model_dir = get(engine.store.model_dir.remote())
        model_dir = None if model_dir is None else Path(model_dir)
        eos = tuple(eos_ids(model_dir, engine.config) if eos_token_ids is None else eos_token_ids)
        sampling = Sampling(max_new_tokens, temperature, top_p, seed, eos)
        tokenizer = tokenizer or model_tokenizer(model_dir)
        ids = encoded(prompts, tokenizer)
        shares = split_rows(len(ids), len(engine.executors))
        version, pending = engine.updates_applied, engine.pending
        refs = [ex.generate.remote(ids[first:end], sampling, version, pending, first, hold_weights)
                for ex, (first, end) in zip(engine.executors, shares, strict=False)]
        out = completions(ids, get(refs), tokenizer)
        if any(out.held_units):
            log.info("generate: %s held on the device for the call beyond the resident units (%s)",
                     "; ".join(f"executor {k}: {len(h)} units" for k, h in enumerate(out.held_units)),
                     ", ".join(f"{b / 2**30:.2f} GiB" for b in out.held_bytes))
        return out
