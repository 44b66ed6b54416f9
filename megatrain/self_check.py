"""The self-check: a model on the generic path is trained only once megatrain matched transformers on a tiny copy of it.

`verify` shrinks the config (tiny_config.py), runs one batch through transformers and megatrain's executor in fp32 on
the CPU, and refuses the model in one sentence naming the part that differs; where no tiny model can be had it warns
and trains unchecked. Verdicts are cached. The tolerance and the cache key: docs/design.md#the-self-check."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain.config import ConfigError, MegatrainError, ModelConfig
from megatrain.engine.executor import Executor
from megatrain.model.hf_config import build_causal_lm
from megatrain.model.layout import ModelLayout, Unit
from megatrain.model.tiny_config import special_token_ids, text_config, tiny_config

log = logging.getLogger(__name__)

WITHIN_ROUNDING = "fp64: within fp32 rounding"  # how fp64_verdict says a difference is rounding
REL_TOL = 1e-5
# transformers' fp32 runs that give its own distance from fp64 (beyond_fp32_rounding) beside the reference's own: the
# loss scaled by one part in 2^20 either way (no power of two: every product's rounding moves)
FP32_LOSS_SCALES = (1.0 + 2**-20, 1.0 - 2**-20)
BATCH, SEQ, SEED, DROPOUT_SEED = 3, 16, 0, 123
CACHE_FORMAT = 3  # bump when what a cached verdict means changes
Grads = dict[str, torch.Tensor]


class SelfCheckError(ConfigError):
    """megatrain's path differs from transformers on a tiny model of the same type and options: refused."""


class NoReference(Exception):
    """transformers' own tiny model, or its loss and gradients, cannot be had: nothing to check against."""


def first_line(e: BaseException, limit: int = 300, lines: int | None = None) -> str:
    """"Type: message" on one line, of the message's first `lines` lines (None: all of them)."""
    text = " ".join(" ".join(str(e).strip().splitlines()[:lines]).split())
    return f"{type(e).__name__}: {text[:limit]}" if text else type(e).__name__


ZERO_BUT_ROUNDING = 1e-6  # a gradient this small against the model's largest is zero in exact arithmetic


def relative_error(actual: torch.Tensor, expected: torch.Tensor, largest: float = 0.0) -> float:
    """max |actual - expected| / max |expected| (the absolute difference where expected is all zero); `largest`: the
    model's largest gradient, the scale of an expected gradient that is zero but for rounding."""
    scale = expected.abs().max().item()
    if scale < ZERO_BUT_ROUNDING * largest:
        scale = largest
    diff = (actual.double() - expected.double()).abs().max().item()
    return diff / scale if scale > 0 else diff


def largest_gradient(grads: Grads) -> float:
    return max((g.abs().max().item() for g in grads.values()), default=0.0)


# ---- transformers' side ----

def build_hf(config: Any) -> torch.nn.Module:
    """The tiny HF model in fp32 from a fixed seed, every parameter moved off its init value (biases and norms get
    real gradients), in train mode; eager attention where the model has it. NoReference where it cannot be built."""
    for attention in ("eager", "sdpa", None):
        torch.manual_seed(SEED)
        try:
            model = build_causal_lm(config, attn_implementation=attention, dtype=torch.float32)
            break
        except (ValueError, ImportError, NotImplementedError) as e:
            if attention is None:
                raise NoReference(f"transformers cannot build it: {first_line(e)}") from None
    languages = getattr(config, "languages", None)
    if languages and hasattr(model, "set_default_language"):
        model.set_default_language(languages[0])  # X-MOD: the adapter of which language
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.train()  # as megatrain trains: dropout where the config enables it (DROPOUT_SEED draws it)


def hf_loss_and_grads(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, loss_scale: float = 1.0
                      ) -> tuple[torch.Tensor, Grads]:
    """transformers' own loss and gradients; a parameter the loss does not reach has a zero gradient. loss_scale: the
    backward starts from the loss times it, the gradients divided by it after: the same math, other roundings."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(DROPOUT_SEED)
    loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss  # training: no cache
    (loss * loss_scale if loss_scale != 1.0 else loss).backward()
    grads = {n: (p.grad / loss_scale if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for n, p in model.named_parameters()}
    return loss.detach(), grads


def text_batch(vocab: int, special: set[int]) -> torch.Tensor:
    """BATCH x SEQ random token ids of the vocabulary, none of them a special token (an image token would ask the
    model for pixels)."""
    allowed = torch.tensor([i for i in range(vocab) if i not in special])
    picks = torch.randint(0, len(allowed), (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return allowed[picks]


@dataclass
class Reference:
    """transformers' tiny model, the batch, and its loss and gradients on it."""

    model: torch.nn.Module
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss: torch.Tensor
    grads: Grads

    @property
    def result(self) -> tuple[torch.Tensor, Grads]:
        return self.loss, self.grads


def reference(tiny: Any) -> Reference:
    """transformers' side of the comparison for a tiny config; NoReference where it cannot be had (where its forward
    fails, the exception is the NoReference's cause)."""
    hf = build_hf(tiny)
    input_ids = text_batch(text_config(tiny).vocab_size, special_token_ids(tiny))
    labels = input_ids.clone()
    try:
        loss, grads = hf_loss_and_grads(hf, input_ids, labels)
    except Exception as e:
        raise NoReference(f"transformers' own forward on a text batch fails: {first_line(e)}") from e
    if not torch.isfinite(loss) or not all(torch.isfinite(g).all() for g in grads.values()):
        raise NoReference("transformers' own loss or gradients are not finite")
    return Reference(hf, input_ids, labels, loss, grads)


# ---- the comparison ----

def errors_of(ours: tuple[torch.Tensor, Grads], theirs: tuple[torch.Tensor, Grads]) -> dict[str, float]:
    """The relative error of the loss ("loss") and of every gradient transformers has; inf for a tensor transformers
    trains that megatrain has no gradient for, and for one megatrain gives a gradient transformers does not train
    (a persistent buffer: it streams frozen)."""
    (loss, grads), (hf_loss, hf_grads) = ours, theirs
    errors = {"loss": relative_error(loss, hf_loss)}
    largest = largest_gradient(hf_grads)
    for name, g in hf_grads.items():
        if name in grads:
            errors[name] = relative_error(grads[name], g, largest)
        elif g.abs().max() > 0:
            errors[name] = float("inf")
    errors.update((n, float("inf")) for n in set(grads) - set(hf_grads) if grads[n].abs().max() > 0)
    return errors


def compare(ours: tuple[torch.Tensor, Grads], theirs: tuple[torch.Tensor, Grads]) -> tuple[float, str]:
    """(the largest relative error over the loss and every gradient, what it is: 'loss' or the worst tensor with
    how many differ)."""
    grads, hf_grads = ours[1], theirs[1]
    missing = sorted(n for n, g in hf_grads.items() if n not in grads and g.abs().max() > 0)
    if missing:
        return float("inf"), f"no gradient for {len(missing)} tensors transformers trains, e.g. {missing[0]}"
    # a persistent buffer (a router's correction bias) streams as a frozen tensor: its gradient must be zero
    extra = sorted(n for n in set(grads) - set(hf_grads) if grads[n].abs().max() > 0)
    if extra:
        return float("inf"), f"gradients for {len(extra)} tensors transformers does not train, e.g. {extra[0]}"
    errors = errors_of(ours, theirs)
    worst = max(errors, key=lambda n: errors[n])
    bad = [n for n, e in errors.items() if not e <= REL_TOL]
    what = f"{worst}" if worst == "loss" else f"grad {worst}"
    return errors[worst], f"{what} (loss {errors['loss']:.1e}; {len(bad)} of {len(errors)} tensors over 1e-5)"


def beyond_fp32_rounding(ref: Reference, ours: tuple[torch.Tensor, Grads]) -> dict[str, tuple[float, float]]:
    """The tensors (the loss, gradients) of `ours` further from an fp64 run of transformers than twice transformers'
    own fp32 distance from it (and than 1e-5): name -> (ours, transformers fp32) distances from fp64. Transformers'
    distance is the farthest of its fp32 runs, the reference's and one with the loss scaled by each of
    FP32_LOSS_SCALES: one run's roundings may land near fp64 by chance where a gradient sums terms that cancel (a
    linear attention's decay, A_log), and any other order of the same sums (megatrain's) then looks wrong by a factor
    that is luck. Raises what the fp64 run raises (a kernel without fp64)."""
    exact = copy.deepcopy(ref.model).double()
    if hasattr(exact, "set_experts_implementation"):
        exact.set_experts_implementation("eager")  # torch's grouped matmul has no fp64 kernel
    exact_loss, exact_grads = hf_loss_and_grads(exact, ref.input_ids, ref.labels)
    exact_all = {"loss": exact_loss, **exact_grads}
    largest = largest_gradient(exact_grads)
    fp32: dict[str, float] = {}
    runs = [ref.result, *(hf_loss_and_grads(ref.model, ref.input_ids, ref.labels, s) for s in FP32_LOSS_SCALES)]
    for loss, grads in runs:
        for n, g in {"loss": loss, **grads}.items():
            if n in exact_all:
                fp32[n] = max(fp32.get(n, 0.0), relative_error(g, exact_all[n].float(), largest))
    ours_all = {"loss": ours[0], **ours[1]}
    distances = {n: (relative_error(ours_all[n], g.float(), largest), fp32[n])
                 for n, g in exact_all.items() if n in ours_all}
    return {n: d for n, d in distances.items() if d[0] > 2 * max(d[1], REL_TOL / 2)}


def fp64_verdict(ref: Reference, ours: tuple[torch.Tensor, Grads]) -> str:
    """Whether a difference is fp32 rounding (beyond_fp32_rounding), in words."""
    try:
        over = beyond_fp32_rounding(ref, ours)
    except Exception as e:  # no fp64 kernel somewhere: no verdict
        return f"no fp64 reference ({first_line(e, 80)})"
    if not over:
        return f"{WITHIN_ROUNDING} (transformers' own fp32 is as far from fp64)"
    name = max(over, key=lambda n: over[n][0] / max(over[n][1], REL_TOL / 2))
    return (f"fp64: {len(over)} tensors beyond fp32 rounding, most {name} (ours {over[name][0]:.1e}, "
            f"transformers fp32 {over[name][1]:.1e} from fp64)")


# ---- megatrain's side, with the layers' inputs and outputs of both forwards ----

Activations = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (its input, its output) in the forward


def layer_prefix(unit: Unit) -> str:
    """The HF module name of a layer unit ("model.layers.3"): its tensors' HF names less their names in the layer."""
    slot = unit.slots[0]
    return slot.hf_name[: len(slot.hf_name) - len(slot.name)].rstrip(".")


class _RecordingLayer:
    """A layer function that keeps its input and output of the forward (no grad), for finding a difference."""

    def __init__(self, fn: Any, index: int, seen: Activations):
        self.fn, self.index, self.seen = fn, index, seen

    def __call__(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        y = self.fn(x, *args)
        if not torch.is_grad_enabled():
            self.seen[self.index] = (x.detach().clone(), y.detach().clone())
        return y

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)


def megatrain_run(config: ModelConfig, ref: Reference, seen: Activations | None = None
                  ) -> tuple[torch.Tensor, Grads]:
    """megatrain's loss and gradients on transformers' weights, through the executor on plain fp32 CPU tensors (no
    arena); `seen` gets every layer's input and output of the forward."""
    layout = ModelLayout.build(config)
    params, grads = torch.zeros(layout.numel), torch.zeros(layout.numel)
    state = ref.model.state_dict()
    views = layout.hf_views(params)
    missing = sorted(set(views) - set(state))
    if missing:
        raise ConfigError(f"megatrain's layout holds {len(missing)} tensors transformers' model does not have, "
                          f"e.g. {missing[0]}.")
    with torch.no_grad():
        for name, view in views.items():
            view.copy_(state[name])
    executor = Executor(config, layout, params, grads, "cpu", "fp32")
    try:
        if seen is not None:  # the executor asks its architecture for each layer's function as it runs it
            arch, layer = executor.arch, executor.arch.layer
            arch.layer = lambda i: _RecordingLayer(layer(i), i, seen)
        torch.manual_seed(DROPOUT_SEED)  # the same dropout masks as transformers' run
        out = executor.run(ref.input_ids, ref.labels)
    finally:
        executor.close()
    return torch.tensor(out.loss), {n: g.clone() for n, g in layout.hf_views(grads).items()}


def hf_activations(ref: Reference, layout: ModelLayout) -> Activations:
    """transformers' layers' inputs and outputs in its forward on the batch (the layers found by the layout's
    names; a layer not found is left out)."""
    seen: Activations = {}
    inputs: dict[int, torch.Tensor] = {}
    handles = []
    for unit in layout.layers:
        try:
            module = ref.model.get_submodule(layer_prefix(unit))
        except AttributeError:
            continue

        def before(module: Any, args: Any, kwargs: Any, i: int = unit.layer) -> None:
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor):
                inputs[i] = x.detach().clone()

        def after(module: Any, args: Any, output: Any, i: int = unit.layer) -> None:
            y = output[0] if isinstance(output, (tuple, list)) else output
            if i in inputs and isinstance(y, torch.Tensor):
                seen[i] = (inputs[i], y.detach().clone())

        handles += [module.register_forward_pre_hook(before, with_kwargs=True), module.register_forward_hook(after)]
    try:
        with torch.no_grad():
            torch.manual_seed(DROPOUT_SEED)
            ref.model(input_ids=ref.input_ids, labels=ref.labels, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


# ---- which part differs ----

def layer_name(ref: Reference, unit: Unit) -> str:
    """"layer 1 (Qwen3NextDecoderLayer, linear_attention)": its index in the tiny model, class and layer type."""
    try:
        cls = type(ref.model.get_submodule(layer_prefix(unit))).__name__
    except AttributeError:
        cls = "decoder layer"
    types = getattr(text_config(ref.model.config), "layer_types", None)
    kind = types[unit.layer] if isinstance(types, (list, tuple)) and unit.layer < len(types) else None
    return f"layer {unit.layer} ({cls}{f', {kind}' if kind else ''})"


def differing_part(ref: Reference, layout: ModelLayout, ours: Activations, theirs: Activations,
                   errors: dict[str, float]) -> tuple[str, float]:
    """(the part that differs, its relative error): the first layer whose forward input or output differs (its input
    at layer 0: the embedding); else the loss (the head where its gradients differ too); else the first part in
    backward order whose gradients differ (head, layers from the top, embedding); else the worst tensor."""
    for unit in layout.layers:
        i = unit.layer
        if i not in ours or i not in theirs:
            break
        # where modules run before the first layer (GPT-2's position embedding), they run in its function: the
        # embedding is then judged with that layer's output
        pre = any(slot.name.startswith("pre.") for slot in unit.slots)
        if i == 0 and not pre and (e := relative_error(ours[i][0], theirs[i][0])) > REL_TOL:
            return "the embedding (the first layer's input)", e
        if (e := relative_error(ours[i][1], theirs[i][1])) > REL_TOL:
            return f"the output of {layer_name(ref, unit)}", e
    names = {layout.head.index: "the head (final norm, lm_head, logits)", layout.embed.index: "the embedding"}
    by_unit = {u.index: max((errors[s.hf_name] for s in u.slots if s.hf_name in errors), default=0.0)
               for u in layout.units}
    if errors["loss"] > REL_TOL:
        return (names[layout.head.index] if by_unit[layout.head.index] > REL_TOL else "the loss"), errors["loss"]
    for unit in [layout.head, *reversed(layout.layers), layout.embed]:
        if by_unit[unit.index] > REL_TOL:
            return f"the gradient of {names.get(unit.index) or layer_name(ref, unit)}", by_unit[unit.index]
    worst = max(errors, key=lambda n: errors[n])
    return f"the gradient of {worst}", errors[worst]


# ---- the check, cached ----

def cache_dir() -> Path:
    root = os.environ.get("MEGATRAIN_CACHE_DIR") or Path.home() / ".cache" / "megatrain"
    return Path(root) / "self-check"


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    import transformers

    try:
        from importlib.metadata import version

        megatrain_version = version("megatrain")
    except Exception:  # not installed: run from a checkout
        megatrain_version = "unknown"
    source = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        source.update(path.read_bytes())
    return {"transformers": transformers.__version__, "torch": torch.__version__, "megatrain": megatrain_version,
            "megatrain_source": source.hexdigest()[:16], "format": str(CACHE_FORMAT)}


def cache_key(tiny: Any) -> str:
    """sha256 of the tiny config (sorted JSON) and the versions (docs/design.md#the-self-check)."""
    text = json.dumps({"config": tiny.to_dict(), **_versions()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_cached(path: Path) -> dict[str, Any] | None:
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(verdict, dict) or not isinstance(verdict.get("passed"), bool):
        return None
    return verdict if verdict["passed"] or isinstance(verdict.get("refusal"), str) else None


def _write_cached(path: Path, verdict: dict[str, Any]) -> None:
    """Atomically; a cache that cannot be written costs a check next time, nothing more."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(verdict, f, indent=1)
        os.replace(f.name, path)
    except OSError as e:
        log.warning("could not cache the self-check's verdict in %s (%s)", path, e)


def refusal(model_type: str, part: str, error: float) -> str:
    """The one sentence that refuses a model whose tiny copy differs in `part` by `error`."""
    by = "in which tensors get a gradient" if error == float("inf") else f"by {error:.1e} relative"
    return (f"megatrain refuses this {model_type} model: on a tiny random model of the same type and options, {part} "
            f"differs from transformers' {by}, so training it would be silently wrong; nothing was allocated: please "
            "report it to megatrain with this sentence and the model's config.json.")


def check(config: ModelConfig, tiny: Any) -> str | None:
    """The self-check of `config` on its tiny config, uncached: None where megatrain is exact, else the refusal.
    NoReference where transformers' side cannot be had."""
    model_type = config.model_type
    try:
        ref = reference(tiny)
    except NoReference:
        raise
    except Exception as e:  # transformers' side, whatever its failure: nothing to check against
        raise NoReference(first_line(e)) from e
    seen: Activations = {}
    try:
        small = ModelConfig.from_hf(json.loads(tiny.to_json_string(use_diff=False)))
        ours = megatrain_run(small, ref, seen)
    except MegatrainError as e:
        return (f"megatrain refuses this {model_type} model: its self-check could not train a tiny random model of "
                f"the same type and options ({' '.join(str(e).split()).rstrip('.')}); nothing was allocated.")
    except Exception as e:  # megatrain's own path crashed: the real model would meet the same code
        return (f"megatrain refuses this {model_type} model: its self-check crashed on a tiny random model of the "
                f"same type and options ({first_line(e, lines=1)}); nothing was allocated: please report it to "
                "megatrain with this sentence and the model's config.json.")
    errors = errors_of(ours, ref.result)
    worst = max(errors.values())
    if worst <= REL_TOL:
        return None
    try:
        if worst < float("inf") and not beyond_fp32_rounding(ref, ours):
            return None  # rounding: transformers' own fp32 is as far from fp64
    except Exception as e:  # no fp64 kernel somewhere: the 1e-5 judgement stands
        log.debug("self-check of %s: no fp64 reference (%s)", model_type, first_line(e))
    layout = ModelLayout.build(small)
    return refusal(model_type, *differing_part(ref, layout, seen, hf_activations(ref, layout), errors))


def verify(config: ModelConfig) -> None:
    """Refuses (SelfCheckError) a model of the generic path whose tiny copy megatrain does not train exactly; a model
    of a native family (no hf_config) passes untouched. See docs/design.md#the-self-check."""
    if config.hf_config is None:
        return
    start = time.monotonic()
    try:
        tiny = tiny_config(config.hf_config)
    except Exception as e:
        log.warning("megatrain's self-check could not run for this %s model (no tiny copy of it: %s); it trains "
                    "unchecked", config.model_type, first_line(e, 200))
        return
    path = cache_dir() / f"{cache_key(tiny)}.json"
    cached = _read_cached(path)
    if cached is None:
        try:
            with torch.random.fork_rng(devices=[]):  # its fixed seeds leave the caller's random state as it was
                sentence = check(config, tiny)
        except NoReference as e:
            log.warning("megatrain's self-check could not run for this %s model (transformers' tiny copy of it: "
                        "%s); it trains unchecked", config.model_type, e)
            return
        cached = {"passed": sentence is None, "refusal": sentence, "model_type": config.model_type,
                  "seconds": round(time.monotonic() - start, 2), **_versions()}
        _write_cached(path, cached)
        log.info("self-check of %s: %s in %.1fs", config.model_type, "exact" if sentence is None else "refused",
                 time.monotonic() - start)
    if not cached["passed"]:
        raise SelfCheckError(cached["refusal"])
