"""Shrinks any transformers causal-LM config to a tiny one of the same model type and options.

Widths from tiny_widths.py; the depth from the layers themselves: at least one layer of every layer structure
survives, and the per-layer lists and layer counts are cut to match. Deterministic. The self-check and the
model-type sweep use it (docs/design.md#tiny-configs)."""

from __future__ import annotations

import re
from typing import Any

from megatrain.model.tiny_widths import is_int, renumber_token_ids, shrink_widths, token_ids, widths_of

MIN_LAYERS, SHORT_PREFIX, TOWER_LAYERS = 2, 4, 2
LAYER_COUNT = ("decoder_layers", "num_hidden_layers", "n_layer", "n_layers", "num_layers", "depth")
INDEX_LIST = re.compile(r"(idxs|indices|indexes|layer_ids|^mlp_only_layers|^moe_layers|^cross_attention_layers)$")
NOT_PER_LAYER = {"architectures", "time_step_limit", "mlp_multipliers", "ssm_multipliers", "supported_aspect_ratios",
                 "axial_pos_shape", "axial_pos_embds_dim", "attention_types", "eos_token_id"}
HEAD_COUNTS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "max_window_layers")
END_INDICES = ("moe_layer_end_index",)
TAIL_COUNTS = ("num_kv_shared_layers",)
SEGMENT = re.compile(r"^n_\w+_layers$")  # consecutive segments that add up to the depth (Dory)
TOWER_NAME = re.compile(r"vision|visual|image|audio|speech|video")


class TinyConfigError(ValueError):
    """The tiny config could not keep every layer structure of the real model."""


def as_config(config: Any) -> Any:
    """A transformers config from a config object or its dict (config.json's contents, where transformers writes
    infinities as {"__float__": "Infinity"})."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    decode = getattr(PretrainedConfig, "_decode_special_floats", lambda values: values)
    values = decode(dict(config))
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise TinyConfigError("the config has no model_type")
    return AutoConfig.for_model(model_type, **values)


def _count_keys(cls: type, values: dict[str, Any]) -> list[str]:
    """The keys that may hold the depth, the likeliest first (an encoder-decoder's causal LM is its decoder)."""
    mapped = getattr(cls, "attribute_map", {}).get("num_hidden_layers")
    keys = ["decoder_layers", *([mapped] if mapped else []), *LAYER_COUNT]
    return [k for i, k in enumerate(keys) if k not in keys[:i] and is_int(values.get(k))]


def _segments(values: dict[str, Any], depth: int) -> list[tuple[str, int, int]]:
    """(key, first, end) of layer-count segments that add up to the depth, in the config's order."""
    keys = [k for k, v in values.items() if SEGMENT.match(k) and is_int(v)]
    if not keys or sum(values[k] for k in keys) != depth:
        return []
    out, start = [], 0
    for key in keys:
        out.append((key, start, start + values[key]))
        start += values[key]
    return out


def _is_per_layer(key: str, value: Any, depth: int) -> bool:
    """A list with one entry per layer (`layer_types`, per-layer sizes), or a per-layer pattern string."""
    if isinstance(value, str):
        return key == "hybrid_override_pattern" and len(value) == depth
    return (isinstance(value, list) and len(value) == depth and key not in NOT_PER_LAYER
            and not INDEX_LIST.search(key) and "token" not in key)


def _per_layer_entries(values: dict[str, Any], depth: int, keys: set[str] | None
                       ) -> list[tuple[tuple[str, str], ...]]:
    """Each layer's entries of the per-layer lists (those named in `keys` where given: the real config's, so that a
    list that happens to be as long as the tiny stack is not taken for one), and the segment it is in."""
    lists = {k: v for k, v in sorted(values.items())
             if _is_per_layer(k, v, depth) and (keys is None or k in keys)}
    segments = _segments(values, depth)
    return [tuple((k, repr(v[i])) for k, v in lists.items())
            + tuple(("segment", key) for key, first, end in segments if first <= i < end) for i in range(depth)]


def _module_structure(layer: Any) -> tuple[Any, ...]:
    """A layer's modules: class, parameter names and shapes, buffers, string and flag attributes, which windows are
    set. The index of an entry in a list is left out: a list's length (experts, Zamba's per-layer adapters of a
    shared block) is no structure of its own."""
    parts = set()
    for indexed_name, module in layer.named_modules():
        name = re.sub(r"(^|\.)\d+(?=\.|$)", r"\1#", indexed_name)
        params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False))
        buffers = tuple(n for n, _ in module.named_buffers(recurse=False))
        attributes = vars(module).items()
        flags = tuple(sorted((k, v) for k, v in attributes
                             if not k.startswith("_") and isinstance(v, (str, bool)) and k != "training"))
        windows = tuple(sorted((k, v is None) for k, v in attributes if "window" in k or "chunk" in k))
        parts.add((name, type(module).__name__, params, buffers, flags, windows))
    return tuple(sorted(parts, key=repr))


def layer_structures(config: Any, per_layer_keys: set[str] | None = None
                     ) -> tuple[str | None, list[tuple[Any, ...]]]:
    """(the key of the language model's config that counts its layers, one hashable structure per layer), from the
    model `config` builds on the meta device; (None, []) where no stack of that many layers is found."""
    import torch

    from megatrain.model.hf_config import build_causal_lm

    with torch.device("meta"):
        model = build_causal_lm(config)
    text = text_config(config)
    values = text.to_dict()
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and not TOWER_NAME.search(name)]
    counts = [(key, values[key]) for key in _count_keys(type(text), values)]
    derived = getattr(text, "num_hidden_layers", None)  # counted from a per-layer list (Nemotron-H)
    for key, depth in [*counts, *([(None, derived)] if not counts and is_int(derived) else [])]:
        stacks = [m for _, m in lists if len(m) == depth]
        if stacks:
            stack = max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()))
            entries = _per_layer_entries(values, len(stack), per_layer_keys)
            return key, [(_module_structure(layer), entries[i]) for i, layer in enumerate(stack)]
    return None, []


def _choose_layers(structures: list[tuple[Any, ...]]) -> list[list[int]]:
    """Which layers to keep, in the order to try: docs/design.md#tiny-configs."""
    depth = len(structures)

    def prefix_with(copies: int) -> list[int]:
        needed = {s: min(copies, structures.count(s)) for s in set(structures)}
        n = next(n for n in range(1, depth + 1) if all(structures[:n].count(s) >= c for s, c in needed.items()))
        return list(range(min(depth, max(n, MIN_LAYERS))))

    firsts = sorted({s: i for i, s in reversed(list(enumerate(structures)))}.values())
    firsts = sorted([*firsts, *[i for i in range(depth) if i not in firsts][: max(0, MIN_LAYERS - len(firsts))]])
    prefix = prefix_with(1)
    candidates = [prefix, firsts] if len(prefix) <= SHORT_PREFIX else [firsts, prefix]
    candidates.append(prefix_with(2))
    return [c for i, c in enumerate(candidates) if c not in candidates[:i]]


def keep_layers(values: dict[str, Any], depth: int, kept: list[int], count_key: str | None) -> None:
    """Cuts a config dict (in place) to the layers `kept`, indices into its stack of `depth` layers."""
    position = {old: new for new, old in enumerate(kept)}
    for key, first, end in _segments(values, depth):
        values[key] = sum(first <= i < end for i in kept)
    if count_key is not None:
        values[count_key] = len(kept)
    for key, value in list(values.items()):
        if isinstance(value, list) and INDEX_LIST.search(key) and all(is_int(v) for v in value):
            values[key] = [position[v] for v in value if v in position]
        elif _is_per_layer(key, value, depth):
            values[key] = "".join(value[i] for i in kept) if isinstance(value, str) else [value[i] for i in kept]
        elif key in HEAD_COUNTS and is_int(value):
            values[key] = sum(i < value for i in kept)
        elif key in END_INDICES and is_int(value) and value >= 0:
            values[key] = sum(i <= value for i in kept) - 1
        elif key in TAIL_COUNTS and is_int(value):
            values[key] = sum(i >= depth - value for i in kept)
    compact = values.get("attention_types")  # gpt-neo: [[pattern, repeats], ...]
    if isinstance(compact, list) and all(isinstance(p, list) and len(p) == 2 and is_int(p[1]) for p in compact):
        expanded = [kind for pattern, repeats in compact for _ in range(repeats) for kind in pattern]
        if len(expanded) == depth:
            values["attention_types"] = [[[expanded[i] for i in kept], 1]]


def _cut_towers(values: dict[str, Any], cls: type, text_key: str | None) -> None:
    """Every sub-config but the language model's keeps its first TOWER_LAYERS layers."""
    from transformers import CONFIG_MAPPING

    for key, sub_cls in (getattr(cls, "sub_configs", {}) or {}).items():
        sub = values.get(key)
        if key == text_key or not isinstance(sub, dict):
            continue
        sub_cls = CONFIG_MAPPING.get(sub.get("model_type", ""), sub_cls)
        for count_key in _count_keys(sub_cls, sub)[:1]:
            if sub[count_key] > TOWER_LAYERS:
                keep_layers(sub, sub[count_key], list(range(TOWER_LAYERS)), count_key)


def text_config(config: Any) -> Any:
    """The language model's config: a multimodal config's text sub-config, else the config itself (whose decoder an
    encoder-decoder's causal LM is)."""
    text = config.get_text_config(decoder=True)
    return config if type(text) is type(config) else text


def _text_key(config: Any) -> str | None:
    """The key of the language model's config inside a multimodal config (None: the config is the text config)."""
    text = text_config(config)
    if text is config:
        return None
    for key in [*(getattr(config, "sub_configs", {}) or {}), "text_config", "language_config", "llm_config"]:
        if getattr(config, key, None) is text:
            return key
    raise TinyConfigError(f"cannot find the language model's config inside {type(config).__name__}")


def _build(cls: type, values: dict[str, Any], text_key: str | None, text_values: dict[str, Any]) -> Any:
    return cls.from_dict(dict(text_values) if text_key is None else {**values, text_key: text_values})


def _message(e: BaseException) -> str:
    cause = e.__cause__ if e.__cause__ is not None else e
    return f"{type(cause).__name__}: {' '.join(str(cause).split())[:200]}"


def tiny_config(config: Any) -> Any:
    """A tiny config of the same model type and options as `config` (a transformers config or its dict), with at
    least one layer of every structure the real model has. TinyConfigError where that cannot be had."""
    from megatrain.model.hf_config import transformers_module

    transformers_module()
    config = as_config(config)
    cls, text_key = type(config), _text_key(config)
    text = text_config(config)
    text_cls, text_dict = type(text), text.to_dict()
    text_widths = widths_of(text_cls, text_dict)
    text_values = shrink_widths(text_dict, text_cls, text_widths)
    values = shrink_widths(config.to_dict(), cls, text_widths) if text_key is not None else text_values
    renumber_token_ids(*([values] if text_key is None else [values, text_values]))
    _cut_towers(values, cls, text_key)
    wide = _build(cls, values, text_key, text_values)
    count_key, structures = layer_structures(wide)
    per_layer_keys = {k for k, v in text_config(wide).to_dict().items() if _is_per_layer(k, v, len(structures))}
    if not structures:  # no stack found: a few layers, unchecked
        for key in _count_keys(text_cls, text_values)[:1]:
            keep_layers(text_values, text_values[key], list(range(min(text_values[key], MIN_LAYERS))), key)
        return _build(cls, values, text_key, text_values)
    problems = []
    for kept in _choose_layers(structures):
        cut = {k: (list(v) if isinstance(v, list) else v) for k, v in text_values.items()}
        keep_layers(cut, len(structures), kept, count_key)
        try:
            tiny = _build(cls, values, text_key, cut)
            missing = set(structures) - set(layer_structures(tiny, per_layer_keys)[1])
        except Exception as e:  # this cut broke the config: the next candidate keeps more layers
            problems.append(f"keeping layers {kept}: {_message(e)}")
            continue
        if not missing:
            return tiny
        problems.append(f"keeping layers {kept} lost {len(missing)} of {len(set(structures))} layer structures")
    raise TinyConfigError("; ".join(problems))


def special_token_ids(config: Any) -> set[int]:
    """Every token id a config names (pad, bos, eos, image, ...), in the config and its sub-configs."""
    return token_ids(as_config(config).to_dict())
