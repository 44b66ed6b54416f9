"""Generation by the streamed model: a batch of prompts, new tokens one at a time, a KV cache beside the pipeline.

A prefill streams each layer once for the left-padded prompts; each decoded token streams every layer again (or binds
the units held on the device for the call) and picks the next token, greedy or sampled from a generator per row, so a
prompt's tokens do not depend on its batch. The layers' math knows nothing of the cache (docs/design.md#generation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatrain.config import ConfigError, MegatrainError, ModelConfig
from megatrain.engine.weight_waits import NO_WAITS, ResidentCurrent, WeightWaits
from megatrain.memory.residency import held_for_generation, margin
from megatrain.model.layout import Unit
from megatrain.model.templates import KV, next_token_logits

if TYPE_CHECKING:
    from megatrain.engine.executor import Executor


@dataclass(frozen=True)
class Sampling:
    """How new tokens are picked. temperature 0: greedy (the most likely token, as transformers' greedy search);
    else sampled from softmax(logits / temperature) within the smallest set of tokens whose probability reaches top_p
    (transformers' TopPLogitsWarper), from a generator seeded with `seed`: the same seed repeats the same tokens."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()  # a row that picks one is done (none: rows run to max_new_tokens)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive number of tokens, got {self.max_new_tokens!r}.")
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be 0 (greedy) or positive, got {self.temperature!r}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}.")


@dataclass
class Generated:
    """Per prompt, its new tokens (the end-of-sequence token included where one ended the row) and whether one did."""

    token_ids: list[list[int]]
    finished: list[bool]
    held_units: list[int] = field(default_factory=list)  # held on the device for the call (beyond the resident)
    held_bytes: int = 0


class KVCache:
    """Per layer, the keys and values of every token so far on the device, [batch, kv_heads, capacity, head_dim] each
    (made at the layer's first tokens), and every key's position in its row (-1: padding)."""

    def __init__(self, layers: int, batch: int, capacity: int):
        self.capacity, self.length = capacity, 0
        self.keys: list[KV | None] = [None] * layers
        self.key_positions = torch.full((batch, 0), -1, dtype=torch.long)

    def add_positions(self, positions: torch.Tensor) -> None:
        """The positions [batch, n] of the tokens about to run (their keys come last)."""
        if self.length + positions.shape[1] > self.capacity:
            raise MegatrainError(f"the KV cache holds {self.capacity} tokens; {self.length + positions.shape[1]} "
                                 "were asked for.")
        self.key_positions = torch.cat((self.key_positions, positions), 1)

    def past(self, layer: int) -> KV | None:
        kv = self.keys[layer]
        return None if kv is None or not self.length else (kv[0][:, :, : self.length], kv[1][:, :, : self.length])

    def append(self, layer: int, new: KV) -> None:
        """Layer `layer`'s keys and values of the tokens running now (kept at length.. until `advance`)."""
        if self.keys[layer] is None:
            self.keys[layer] = tuple(t.new_empty(*t.shape[:2], self.capacity, t.shape[3]) for t in new)  # type: ignore
        end = self.length + new[0].shape[2]
        for cached, t in zip(self.keys[layer], new, strict=True):  # type: ignore[arg-type]
            cached[:, :, self.length : end] = t

    def advance(self) -> None:
        """Every layer has appended the tokens that ran: they are the past of the next ones."""
        self.length = self.key_positions.shape[1]


def cache_bytes(config: ModelConfig, batch: int, capacity: int, dtype: torch.dtype) -> int:
    """The KV cache's bytes on the device: every layer's keys and values of `capacity` tokens a row (the config's
    kv heads x head_dim; a generic-path model's own attention may differ a little)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * batch * capacity * config.kv_size * element


def check_cache_fits(config: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, free: int | None) -> None:
    """Refuses, before anything is allocated, a KV cache that would not fit the device's `free` bytes (None: the host,
    unchecked here) beside the layers' working memory (a tenth of it left)."""
    need = cache_bytes(config, batch, capacity, dtype)
    if free is not None and need > 0.9 * free:
        raise MegatrainError(f"the KV cache of {batch} prompts x {capacity} tokens needs {need / 2**30:.2f} GiB and "
                             f"the device has {free / 2**30:.2f} GiB free; generate fewer prompts at once, or fewer "
                             "tokens.")


def device_free(device: torch.device) -> int | None:
    """Free bytes on a GPU, those torch's allocator holds unused included (None: the CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [batch, longest] with each prompt at the right, its positions from 0 and -1 on the padding)."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    positions = torch.full((len(prompts), longest), -1, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        positions[row, longest - len(prompt):] = torch.arange(len(prompt))
    return ids, positions


def row_generators(seed: int, first_row: int, rows: int) -> list[torch.Generator]:
    """One generator per row, seeded from `seed` and the row's index among all the call's prompts."""
    return [torch.Generator().manual_seed((seed * 1_000_003 + first_row + r) % 2**63) for r in range(rows)]


def pick_next(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator]) -> torch.Tensor:
    """The next token of each row [batch] (host) from fp32 logits [batch, vocab]: their argmax where greedy, else a
    draw from the softmax of sampling_scores, as transformers samples, each row from its own generator."""
    if sampling.temperature == 0.0:
        return logits.argmax(-1).cpu()
    probs = sampling_scores(logits.float().cpu(), sampling).softmax(-1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)])


def sampling_scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits / temperature, -inf outside the smallest set of tokens whose probability reaches top_p (the most likely
    token always kept): transformers' TemperatureLogitsWarper, then its TopPLogitsWarper."""
    scores = logits / sampling.temperature
    if sampling.top_p < 1.0:
        ordered, order = scores.sort(-1)  # ascending, as TopPLogitsWarper: drop the tail up to 1 - top_p
        tail = ordered.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        tail[:, -1] = False
        scores = scores.masked_fill(tail.scatter(1, order, tail), float("-inf"))
    return scores


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts or any(not isinstance(p, (list, tuple)) or not p for p in prompts):
        raise MegatrainError("generate needs at least one prompt, each a non-empty list of token ids.")
    for p in prompts:
        bad = next((t for t in p if not isinstance(t, int) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise MegatrainError(f"token id {bad!r} of a prompt is outside the model's vocabulary [0, {vocab_size}); "
                                 "check the tokenizer matches the model.")


class HeldUnits:
    """Units copied onto the device once for a generate call (the compute dtype), bound from there for every token."""

    def __init__(self, ex: Executor, indices: list[int], waits: WeightWaits):
        self.streams, self.tensors = ex.streams, {}
        for index in indices:
            unit = ex.layout.units[index]
            waits.wait(unit)  # the update in, then copied once
            self.tensors[index] = ex._to_device(unit.range_of(ex.weights), ex.dtype)
        self.bytes = sum(t.numel() * t.element_size() for t in self.tensors.values())

    def holds(self, unit: Unit) -> bool:
        return unit.index in self.tensors

    def weights(self, unit: Unit) -> dict[str, torch.Tensor]:
        flat = self.tensors[unit.index]
        self.streams.compute_uses(flat)
        return unit.bind(flat)


class Generator:
    """Generation on an Executor's pipeline: its weight buffers, embedding rows, resident units and head (a LoRA run's:
    the frozen base streamed, its adapters beside it). budget: device bytes the call may hold weights in beyond the
    resident units (None: on a GPU what is free less the KV cache and a margin; on the CPU path none)."""

    def __init__(self, executor: Executor, budget: int | None = None):
        self.ex, self.budget = executor, budget
        self.held: HeldUnits | None = None
        arch = executor.arch if executor.lora is None else executor.lora.architecture.arch  # a LoRA run's family's
        if not hasattr(arch, "cached_layer"):
            raise MegatrainError(f"generation is not implemented for {executor.config.model_type}'s layers in "
                                 "megatrain; generate with transformers instead.")

    def generate(self, prompts: list[list[int]], sampling: Sampling, waits: WeightWaits = NO_WAITS,
                 first_row: int = 0, hold: bool = True) -> Generated:
        """New tokens for each prompt (token ids), the weights read once `waits` says they are current; first_row: the
        index of the first of these prompts among all the call's (the rows' sampling seeds); hold False: no unit kept
        for the call beyond the resident ones (every token streams the rest, as before: for a comparison)."""
        ex = self.ex
        check_prompts(prompts, ex.config.vocab_size)
        if len(ex.resident):
            waits = ResidentCurrent(waits, ex.resident)
        pad = ex.config.pad_token_id if ex.config.pad_token_id is not None else 0
        ids, positions = left_padded(prompts, pad)
        capacity = ids.shape[1] + sampling.max_new_tokens
        free = device_free(ex.device)
        check_cache_fits(ex.config, len(prompts), capacity, ex.dtype, free)
        cache = KVCache(len(ex.layout.layers), len(prompts), capacity)
        generators = row_generators(sampling.seed, first_row, len(prompts))
        ex.slots.invalidate()  # the optimizer may have rewritten the arena since the buffers were filled
        out: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        kv = cache_bytes(ex.config, len(prompts), capacity, ex.dtype)
        self.held = HeldUnits(ex, self._to_hold(free, kv) if hold else [], waits)
        try:
            with torch.no_grad():
                self._decode(ids, positions, cache, waits, sampling, generators, out, done)
            return Generated(out, done, sorted(self.held.tensors), self.held.bytes)
        finally:
            self.held = None  # the device memory goes back to the allocator

    def _to_hold(self, free: int | None, kv_bytes: int) -> list[int]:
        """Which units to keep on the device for the call (held_for_generation): within `budget` where given, else
        what the GPU has free beyond the KV cache, less the plan's margin."""
        ex = self.ex
        budget = self.budget
        if budget is None:
            room = 0 if free is None else free - kv_bytes
            budget = room - margin(room) if room > 0 else 0
        tied = all(t.name != "lm_head.weight" for t in ex.layout.head.slots)  # then the table is the head's matrix
        element = torch.empty((), dtype=ex.dtype).element_size()
        return held_for_generation([u.numel for u in ex.layout.units], len(ex.on_device), budget, element,
                                   skip=() if tied else (ex.layout.embed.index,))

    def _decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, waits: WeightWaits,
                sampling: Sampling, generators: list[torch.Generator], out: list[list[int]], done: list[bool]) -> None:
        """The prefill, then one new token a row at a time into `out` until each row is `done` or max_new_tokens."""
        logits = self._run(ids, positions, cache, waits)
        for number in range(sampling.max_new_tokens):
            tokens = pick_next(logits, sampling, generators)
            for row, token in enumerate(tokens.tolist()):
                if not done[row]:
                    out[row].append(token)
                    done[row] = token in sampling.eos_token_ids
            if all(done) or number == sampling.max_new_tokens - 1:
                break
            positions = positions[:, -1:] + 1  # every row's last token is a real one from the first new token on
            logits = self._run(tokens[:, None], positions, cache, waits)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, waits: WeightWaits) -> torch.Tensor:
        """Every layer on new tokens ids [b, n] at `positions`, their keys and values into the cache; the fp32 logits
        [b, vocab] of each row's last token."""
        ex, layers = self.ex, self.ex.layout.layers
        cache.add_positions(positions)
        batch = ex.arch.cached_batch(positions, cache.key_positions, ex.device, ex.dtype)  # type: ignore[attr-defined]
        self._fetch(0, waits, keep=layers[-1])  # into the buffer the last layer of the token before does not hold
        waits.wait(ex.layout.embed)
        rows, _, row_of_token = ex.embedding.gather(ids)
        x = ex.embedding.embedded(rows, row_of_token)
        for i, unit in enumerate(layers):
            slot, w = (-1, self.held.weights(unit)) if self._held(unit) else ex.slots.acquire(unit)
            w = w if ex.lora is None else ex.lora.bind(unit, w, ex.resident, ex._to_device)  # the adapters beside
            x, new = ex.arch.cached_layer(i)(x, w, cache.past(i), *batch.layer_args(i))  # type: ignore[attr-defined]
            ex.slots.release(slot)
            cache.append(i, new)
            if i + 1 < len(layers):
                self._fetch(i + 1, waits, keep=unit)
        cache.advance()
        return self._logits(x[:, -1], waits)

    def _held(self, unit: Unit) -> bool:
        return self.held is not None and self.held.holds(unit)

    def _fetch(self, i: int, waits: WeightWaits, keep: object) -> None:
        ex = self.ex
        if self._held(ex.layout.layers[i]):
            return
        waits.wait(ex.layout.layers[i])
        ex.slots.fetch(ex.layout.layers[i], keep=keep)  # type: ignore[arg-type]

    def _whole(self, unit: Unit, waits: WeightWaits) -> dict[str, torch.Tensor]:
        """The head's (or a tied head's table's) weights: held for the call, or copied in whole."""
        if self._held(unit):
            return self.held.weights(unit)  # type: ignore[union-attr]
        waits.wait(unit)
        return unit.bind(self.ex.slots.take_whole(unit))

    def _logits(self, x: torch.Tensor, waits: WeightWaits) -> torch.Tensor:
        """The head on the last layer's output at one position per row [b, hidden]: fp32 logits [b, vocab]."""
        ex = self.ex
        head_w = self._whole(ex.layout.head, waits)
        lm_head = head_w.get("lm_head.weight")
        if lm_head is None:  # tied: the embedding table is the output projection
            lm_head = self._whole(ex.layout.embed, waits)["embed_tokens.weight"]
        others = {name: t for name, t in head_w.items() if name != "lm_head.weight"}
        return next_token_logits(x, ex.arch.final_norm, others, lm_head, ex.arch.logit_softcap,
                                 getattr(ex.arch, "logits", None))
