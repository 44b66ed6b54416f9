"""The widths of a tiny config: every size of a transformers config made tiny, by what its key names (hidden 64, heads
of 16, experts of 32, vocabulary 256, ...); sub-configs the same way. The depth is left to
megatrain/model/tiny_config.py. The rules: docs/design.md#tiny-configs."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE, EXPERT_INTERMEDIATE = 64, 4, 16, 128, 32
VOCAB, POSITIONS, WINDOW, EXPERTS, TOP_K, RANK, STATE = 256, 64, 8, 16, 2, 32, 16


@dataclasses.dataclass(frozen=True)
class Widths:
    """A real (sub-)config's own sizes: the rules scale by them, and ints equal to them follow them."""
    hidden: int | None = None
    intermediate: int | None = None
    head_dim: int | None = None
    heads: int | None = None
    positions: int | None = None

    def followed(self) -> dict[int, int]:
        pairs = {self.hidden: HIDDEN, self.intermediate: INTERMEDIATE, self.head_dim: HEAD_DIM}
        return {k: v for k, v in pairs.items() if k is not None}


Shrink = Callable[[Any, Widths], Any]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _each(shrink: Callable[[int], int]) -> Shrink:
    """A rule for a size: positive ints (and per-layer lists of them) shrink; None and anything else stay."""
    def rule(value: Any, _: Widths) -> Any:
        if is_int(value) and value > 0:
            return shrink(value)
        if isinstance(value, list) and value and all(is_int(v) for v in value):
            return [shrink(v) if v > 0 else v for v in value]
        return value
    return rule


def _kv_heads(value: Any, widths: Widths) -> Any:
    """Multi-head stays multi-head, multi-query stays multi-query, anything between becomes grouped (2 of 4); None
    (multi-head where the model derives it) is made explicit: some models' code reads it unguarded."""
    if value is None and widths.heads is not None:
        return HEADS
    return _each(lambda kv: HEADS if kv == widths.heads else 1 if kv == 1 else 2)(value, widths)


def _head_dim(value: Any, widths: Widths) -> Any:
    # None where the model derives it (hidden / heads = 16 here too): some models' code reads it unguarded
    return HEAD_DIM if value is None else _each(lambda _: HEAD_DIM)(value, widths)


def _rotary_dim(value: Any, widths: Widths) -> Any:
    """A partial rotary width keeps its share of the head (at least one pair)."""
    if not is_int(value) or not widths.head_dim:
        return value
    return HEAD_DIM if value >= widths.head_dim else max(2, 2 * round(HEAD_DIM * value / widths.head_dim / 2))


def _scaled_by_hidden(value: Any, widths: Widths) -> Any:
    """A width that only sets a ratio to the hidden size (MiniCPM's muP base width): the ratio is kept."""
    if not is_int(value) or not widths.hidden:
        return value
    return max(1, round(HIDDEN * value / widths.hidden))


def scaled_positions(value: Any, widths: Widths) -> Any:
    """original_max_position_embeddings keeps its ratio to max_position_embeddings (the rope scaling's factor)."""
    if not is_int(value) or not widths.positions:
        return value
    return max(1, min(value, round(POSITIONS * value / widths.positions)))


RULES: list[tuple[re.Pattern[str], Shrink]] = [(re.compile(pattern), rule) for pattern, rule in [
    # attention heads (mamba heads and groups are set with their widths in _shrink_mamba)
    (r"^(num_key_value_heads|n_kv_heads|num_kv_heads|multi_query_group_num|n_head_kv|kv_n_heads|num_query_groups|"
     r"swa_num_key_value_heads|linear_num_key_heads|indexer_kv_heads)$", _kv_heads),
    (r"^(num_attention_heads|n_head|n_heads|num_heads|attention_heads|swa_num_attention_heads|linear_num_value_heads|"
     r"linear_num_heads|indexer_n_heads|index_n_heads|num_attention_heads_per_layer|decoder_attention_heads|"
     r"encoder_attention_heads|conf_num_attention_heads)$", _each(lambda _: HEADS)),
    # multi-head latent attention (DeepSeek-V2/V3): low ranks, and a head split into rope and no-rope parts
    (r"^(q_lora_rank|kv_lora_rank|o_lora_rank)$", _each(lambda _: RANK)),
    (r"^qk_rope_head_dim$", _each(lambda _: HEAD_DIM // 2)),
    (r"^(qk_nope_head_dim|v_head_dim)$", _each(lambda _: HEAD_DIM)),
    (r"^head_dim$", _head_dim),
    (r"^(kv_channels|d_head|d_kv|dim_head|attention_head_dim|attention_head_size|swa_head_dim|linear_key_head_dim|"
     r"linear_value_head_dim|linear_head_dim|index_head_dim|indexer_head_dim)$", _each(lambda _: HEAD_DIM)),
    (r"^rotary_dim$", _rotary_dim),
    # feed-forward widths: an expert's (and a shared expert's) smaller than a dense layer's
    (r"^(moe_intermediate_size|expert_ffn_hidden_size|expert_intermediate_size|shared_expert_intermediate_size|"
     r"shared_intermediate_size|shared_experts_intermediate_size|moe_shared_expert_intermediate_size|"
     r"moe_latent_size)$", _each(lambda _: EXPERT_INTERMEDIATE)),
    (r"^(intermediate_size|ffn_hidden_size|n_inner|ffn_dim|d_ff|dff|dim_ff|d_inner|feed_forward_size|"
     r"intermediate_size_mlp|dense_intermediate_size|prefix_dense_intermediate_size|mlp_dim|decoder_ffn_dim|"
     r"encoder_ffn_dim)$", _each(lambda _: INTERMEDIATE)),
    (r"^(block_multiple_of|ffn_round_up_to_multiple_of|intermediate_multiple_size)$", _each(lambda v: min(v, 16))),
    # MoE: few experts, top-2 routing, expert groups of two where the router picks groups first
    (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$", _each(lambda v: min(v, EXPERTS))),
    (r"^(num_experts_per_tok|num_experts_per_token|moe_topk|moe_top_k|moe_k|top_k|top_k_experts|"
     r"num_selected_experts)$", _each(lambda v: min(v, TOP_K))),
    (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts|zero_expert_num)$", _each(lambda v: min(v, 1))),
    (r"^(n_group|num_expert_group)$", _each(lambda v: min(v, 2))),
    (r"^topk_group$", _each(lambda v: 1)),
    # low ranks of adapters and per-layer inputs
    (r"^(laurel_rank|adapter_rank|hc_lowrank|loop_gate_rank|gated_norm_rank|time_step_rank|mamba_dt_rank)$",
     _each(lambda v: min(v, 8))),
    (r"^(hidden_size_per_layer_input|ple_embed_dim)$", _each(lambda v: min(v, HEAD_DIM))),
    (r"^hidden_size_global$", _each(lambda _: HIDDEN)),  # BLT's global transformer
    (r"^dim_model_base$", _scaled_by_hidden),
    # towers besides the language model: two layers of encoder
    (r"^(encoder_layers|num_encoder_layers)$", _each(lambda v: min(v, 2))),
    # the sequence: positions, and windows and chunks shorter than a self-check's batch
    (r"^(max_position_embeddings|n_positions|n_ctx|max_seq_len|seq_length|max_sequence_length|context_length|"
     r"model_max_length|max_target_positions|max_source_positions)$", _each(lambda v: min(v, POSITIONS))),
    (r"^original_max_position_embeddings$", scaled_positions),
    (r"^(sliding_window|sliding_window_size|attention_window_size|window_size|local_attention_window_len|"
     r"attention_chunk_size|local_attention|chunk_size|mamba_chunk_size|index_topk|index_block_size)$",
     _each(lambda v: min(v, WINDOW))),
    (r"^(mamba_d_state|ssm_state_size|state_size)$", _each(lambda v: min(v, STATE))),
]]
MAMBA_HEADS = ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
MAMBA_HEAD_DIM = ("mamba_d_head", "mamba_head_dim", "mamba_headdim")
MAMBA_EXPAND = ("mamba_expand", "expand")
MAMBA_GROUPS = ("mamba_n_groups", "n_groups", "mamba_ngroups")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "n_embed", "dim", "embed_dim")
# ints that are neither sizes nor follow one
NOT_A_SIZE = re.compile(r"token|vocab|position|layer|seed|rate|image|patch|channel|bins|_id$|offset|idx|index|"
                        r"window|max_|num_|^n_|multiple|groups|cycles|passes|buckets|stride|kernel|factor|loops")
PROJECTION = re.compile(r"out|proj|adapter")
TOKEN_ID = re.compile(r"(_token_id|_token_index|_token_ids|^(pad|bos|eos|eod|sep|cls|mask|unk)_id)$")


def widths_of(cls: type, values: dict[str, Any]) -> Widths:
    aliases = getattr(cls, "attribute_map", {})

    def first_int(*names: str) -> int | None:
        for name in names:
            value = values.get(aliases.get(name, name))
            if isinstance(value, list) and value and is_int(value[0]):
                value = value[0]  # a per-layer list (Gemma 3n's intermediate sizes)
            if is_int(value):
                return value
        return None

    hidden = first_int(*HIDDEN_KEYS)
    heads = first_int("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads")
    head_dim = first_int("head_dim", "kv_channels", "d_head", "attention_head_dim")
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    return Widths(hidden, first_int("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim", "d_ff"), head_dim,
                  heads, first_int("max_position_embeddings", "n_positions", "n_ctx"))


@functools.cache
def _derived_keys(cls: type) -> frozenset[str]:
    """Keys that are neither a field of the config nor an alias of one: its __post_init__ computes them (DeepSeek's
    qk_head_dim)."""
    if not dataclasses.is_dataclass(cls):
        return frozenset()
    aliases = getattr(cls, "attribute_map", {})
    fields = {f.name for f in dataclasses.fields(cls)} | set(aliases) | set(aliases.values())
    try:
        return frozenset(set(cls().to_dict()) - fields)
    except Exception:  # a config without defaults: nothing is known to be derived
        return frozenset()


def _rederived(cls: type, values: dict[str, Any], key: str) -> bool:
    """Whether `key` (a field whose default is None) holds what __post_init__ derives when it is None (Zamba's
    attention_hidden_size = 2 x hidden): then the tiny config derives it again."""
    try:
        return getattr(cls.from_dict({**values, key: None}), key, None) == values[key]
    except Exception:
        return False


def _none_default_fields(cls: type) -> set[str]:
    if not dataclasses.is_dataclass(cls):
        return set()
    return {f.name for f in dataclasses.fields(cls) if f.default is None}


def _shrink_rope(rope: Any, widths: Widths, rotary_pairs: int) -> Any:
    """rope_parameters / rope_scaling (maybe one per layer type): per-frequency lists and mrope sections resized to
    the tiny head, the original context length kept in proportion."""
    if not isinstance(rope, dict) or not rope:
        return rope
    if all(isinstance(v, dict) for v in rope.values()):
        return {k: _shrink_rope(v, widths, rotary_pairs) for k, v in rope.items()}
    out = dict(rope)
    for key, value in rope.items():
        if key == "original_max_position_embeddings":
            out[key] = scaled_positions(value, widths)
        elif key in ("short_factor", "long_factor", "ext_factor") and isinstance(value, list) and value:
            out[key] = [value[i * len(value) // rotary_pairs] for i in range(rotary_pairs)]
        elif key == "mrope_section" and isinstance(value, list) and value:
            total, sections = sum(value), []
            for i, part in enumerate(value):
                rest = rotary_pairs - sum(sections)
                sections.append(rest if i == len(value) - 1 else max(1, round(rotary_pairs * part / total)))
            out[key] = sections
    return out


def _rope_partial(values: dict[str, Any]) -> float:
    partial = values.get("partial_rotary_factor")
    for rope in (values.get("rope_parameters"), values.get("rope_scaling")):
        if isinstance(rope, dict) and not partial:
            nested = [rope] + [v for v in rope.values() if isinstance(v, dict)]
            partial = next((r["partial_rotary_factor"] for r in nested if "partial_rotary_factor" in r), None)
    return float(partial) if partial else 1.0


def _shrink_mamba(values: dict[str, Any], out: dict[str, Any]) -> None:
    """A mamba mixer's heads x head width must make expand x hidden; its state groups must divide the heads."""
    heads_keys, dim_keys = MAMBA_HEADS, MAMBA_HEAD_DIM
    if "num_attention_heads" not in values and any(is_int(values.get(k)) for k in MAMBA_EXPAND):
        heads_keys, dim_keys = (*heads_keys, "num_heads"), (*dim_keys, "head_dim")  # Mamba-2: its heads are its own
    head_key = next((k for k in heads_keys if is_int(values.get(k))), None)
    dim_key = next((k for k in dim_keys if is_int(values.get(k))), None)
    if head_key is None and dim_key is None:
        return
    inner = next((values[k] for k in MAMBA_EXPAND if is_int(values.get(k))), 2) * HIDDEN
    if values.get("mamba_d_ssm") is not None:
        out["mamba_d_ssm"] = inner
    heads = inner // HEAD_DIM if dim_key is not None or head_key is None else min(values[head_key], HEADS)
    if head_key is not None:
        out[head_key] = heads
    if dim_key is not None:
        out[dim_key] = inner // heads
    for key in MAMBA_GROUPS:
        if is_int(values.get(key)):
            out[key] = 1 if values[key] == 1 else 2


def shrink_widths(values: dict[str, Any], cls: type, text: Widths | None = None) -> dict[str, Any]:
    """Every size of one (sub-)config's dict made tiny (docs/design.md#tiny-configs); `text`: the language model's
    widths, which a tower's projector follows too."""
    from transformers import CONFIG_MAPPING

    widths = widths_of(cls, values)
    sub_configs = dict(getattr(cls, "sub_configs", {}) or {})
    own, language = widths.followed(), (text.followed() if text else {})
    derived, none_default = _derived_keys(cls), _none_default_fields(cls)
    out: dict[str, Any] = {}
    for key, value in values.items():
        rule = next((rule for pattern, rule in RULES if pattern.search(key)), None)
        if key in derived or (is_int(value) and rule is None and key in none_default
                              and _rederived(cls, values, key)):
            continue
        if isinstance(value, dict) and key in sub_configs and "model_type" in value:
            sub_cls = sub_configs[key]
            if sub_cls.__name__ == "AutoConfig" or not dataclasses.is_dataclass(sub_cls):
                sub_cls = CONFIG_MAPPING.get(value["model_type"], sub_cls)
            out[key] = shrink_widths(value, sub_cls, text or widths)
        elif rule is not None:
            out[key] = rule(value, widths)
        elif key == "vocab_size" or ("vocab" in key and "offset" not in key and is_int(value) and value > VOCAB):
            out[key] = VOCAB if is_int(value) else value
        elif key == "query_pre_attn_scalar" and value == widths.head_dim:
            out[key] = HEAD_DIM  # Gemma's 1 / sqrt(head_dim) attention scale
        elif key in HIDDEN_KEYS and is_int(value) and value == widths.hidden:
            out[key] = HIDDEN
        elif is_int(value) and value in {**own, **language} and not NOT_A_SIZE.search(key):
            # a width named otherwise (word_embed_proj_dim, lru_width); what a tower hands the language model (its
            # projector's or adapter's output) follows the language model's widths first
            feeds_language = PROJECTION.search(key) and value in language
            out[key] = language[value] if feeds_language or value not in own else own[value]
        else:
            out[key] = value
    _shrink_mamba(values, out)
    if is_int(values.get("head_dim")) and values["head_dim"] == values.get("qk_rope_head_dim"):
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA models whose head_dim is the rope part (LongCat)
    rotary_pairs = max(1, int(out.get("rotary_dim") or HEAD_DIM * _rope_partial(out)) // 2)
    if is_int(out.get("qk_rope_head_dim")):
        rotary_pairs = out["qk_rope_head_dim"] // 2
    for key in ("rope_parameters", "rope_scaling"):
        if key in out:
            out[key] = _shrink_rope(out[key], widths, rotary_pairs)
    return out


def _token_id_values(values: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """(dict, key) of every special token id in a config dict and its sub-config dicts."""
    found = []
    for key, value in values.items():
        if isinstance(value, dict) and "model_type" in value:
            found.extend(_token_id_values(value))
        elif isinstance(key, str) and TOKEN_ID.search(key):
            found.append((values, key))
    return found


def token_ids(values: dict[str, Any]) -> set[int]:
    ids = set()
    for holder, key in _token_id_values(values):
        value = holder[key]
        ids.update(v for v in (value if isinstance(value, list) else [value]) if is_int(v) and v >= 0)
    return ids


def renumber_token_ids(*configs: dict[str, Any]) -> None:
    """Special token ids beyond the tiny vocabulary get distinct ids from its top down (the same new id wherever an
    old one appears); ids inside it stay."""
    ids = set().union(*(token_ids(values) for values in configs))
    free = (i for i in range(VOCAB - 1, -1, -1) if i not in ids)
    new = {old: (old if old < VOCAB else next(free)) for old in sorted(ids)}
    for values in configs:
        for holder, key in _token_id_values(values):
            value = holder[key]
            if isinstance(value, list):
                holder[key] = [new.get(v, v) if is_int(v) else v for v in value]
            elif is_int(value):
                holder[key] = new.get(value, value)
