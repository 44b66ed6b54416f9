"""Which modules a LoRA run adapts: `target_modules` matched against the model's modules by PEFT's rule, each refusal
one sentence, before anything is allocated.

megatrain adapts the nn.Linear modules of the decoder layers, so a target must name one or more of them and nothing
else; what is refused and why: docs/design.md#targets."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config import ConfigError, ModelConfig
from megatrain.model.layout import unit_tensors

ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer of the model but its output projection
LINEAR = "Linear"  # the class name of what a target may name: torch.nn.Linear
CONV1D = "Conv1D"  # transformers' GPT-2-style linear layer, its weight stored (in, out)


def module_kinds(config: ModelConfig) -> dict[str, str]:
    """Every module of the model the text forward runs but the output projection, by its name in the transformers
    model, to its class name ("" where a native family does not say: never a Linear)."""
    own = getattr(config.family, "module_kinds", None)
    if own is not None:
        return own(config)
    embed, prefix, first, head = unit_tensors(config)
    kinds: dict[str, str] = {}
    for _, hf_name, _, _ in [*embed, *first, *head]:
        if not hf_name.startswith("lm_head."):
            kinds.update((module, "") for module in _owners(hf_name))
    for i in range(config.num_layers):
        for name, shape, _ in config.family.layer_tensors(config, i):
            kinds.update((module, kinds.get(module, "")) for module in _owners(f"{prefix}{i}.{name}"))
            if len(shape) == 2 and name.endswith(".weight"):
                kinds[f"{prefix}{i}.{name.removesuffix('.weight')}"] = LINEAR
    return kinds


def _owners(tensor_name: str) -> list[str]:
    """The modules that hold a tensor: "a.b.weight" -> ["a", "a.b"]."""
    parts = tensor_name.split(".")[:-1]
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def matches(name: str, target: str) -> bool:
    """PEFT's rule (check_target_module_exists for a list of targets)."""
    return name == target or name.endswith("." + target)


def resolve_targets(targets: tuple[str, ...], config: ModelConfig) -> tuple[str, ...]:
    """The targets as the run adapts them (all-linear: the decoder layers' Linear modules by last name), each checked
    and put in the order of the first module it names; ConfigError in one sentence for what megatrain cannot adapt."""
    return _resolve(targets, config)[0]


def adapted_modules(targets: tuple[str, ...], config: ModelConfig) -> frozenset[str]:
    """The decoder layers' Linear modules the targets adapt, by name in the transformers model (checked as
    resolve_targets checks them)."""
    return _resolve(targets, config)[1]


@dataclass
class _Modules:
    """What a model's targets are checked against (names as in `module_kinds`)."""

    model_type: str
    layer: dict[str, str]  # the decoder layers' modules (not the layers themselves) -> class
    in_layer: dict[str, str]  # each of those by its name in its layer: "model.layers.3.mlp.fc1" -> "mlp.fc1"
    outside: dict[str, str]  # every other module -> class
    matrices: dict[str, str]  # the decoder layers' matrices no nn.Linear holds, by name in the layer -> its module's
    fused: tuple[str, ...]  # the checkpoint's module names that transformers fuses on loading

    @property
    def linear(self) -> list[str]:
        return [n for n, k in self.layer.items() if k == LINEAR]

    @property
    def names(self) -> list[str]:
        """The decoder layers' Linear modules as users spell them (q_proj, ...), in layer order."""
        return list(dict.fromkeys(n.rpartition(".")[2] for n in self.linear))


def _modules(config: ModelConfig) -> _Modules:
    _, prefix, _, _ = unit_tensors(config)
    kinds = module_kinds(config)
    layer = {n: k for n, k in kinds.items() if n.startswith(prefix) and "." in n[len(prefix):]}
    return _Modules(config.model_type, layer, {n: n[len(prefix):].partition(".")[2] for n in layer},
                    {n: k for n, k in kinds.items() if not n.startswith(prefix)},
                    _other_matrices(config, prefix, kinds), getattr(config.family, "fused_names", lambda _: ())(config))


def _resolve(targets: tuple[str, ...], config: ModelConfig) -> tuple[tuple[str, ...], frozenset[str]]:
    m = _modules(config)
    linear, names = m.linear, m.names
    conv = [m.in_layer[n] for n, k in m.layer.items() if k == CONV1D]
    if conv and (ALL_LINEAR in targets or not linear):
        raise ConfigError(f"LoRA on this {m.model_type} model would adapt {conv[0]}, a GPT-2-style Conv1D that PEFT "
                          "adapts transposed (fan_in_fan_out), which megatrain's LoRA does not implement.")
    if not linear:
        raise ConfigError(f"the decoder layers of this {m.model_type} model have no nn.Linear projection, and those "
                          "are all megatrain's LoRA adapts.")
    if ALL_LINEAR in targets:
        reached = [n for n, k in m.outside.items() if k in (LINEAR, CONV1D)] + list(m.matrices)
        if reached:
            raise ConfigError(f"PEFT's all-linear on this {m.model_type} model would also adapt {reached[0]}, which "
                              f"megatrain's LoRA does not; list the projections as targets ({','.join(names)}).")
        targets = tuple(names)
    first: dict[str, int] = {}
    adapted: set[str] = set()
    for target in targets:
        hits = [n for n in m.layer if matches(m.in_layer[n], target)]
        refusal = _refusal(target, hits, m)
        if refusal:
            raise ConfigError(refusal)
        first[target] = linear.index(hits[0])
        adapted.update(hits)
    return tuple(sorted(targets, key=first.__getitem__)), frozenset(adapted)


def _refusal(target: str, hits: list[str], m: _Modules) -> str | None:
    """Why megatrain cannot adapt what `target` names (its `hits` among the decoder layers' modules), or None."""
    names, last = ", ".join(m.names), target.rpartition(".")[2]
    wrong = [n for n in hits if m.layer[n] != LINEAR]
    beside = [n for n in m.outside if matches(n, target)]
    params = [n for n in m.matrices if matches(n, target)]
    if beside:
        return (f"LoRA target {target} names {beside[0]} outside the decoder layers, which megatrain's LoRA does not "
                f"adapt; its decoder layers' projections are {names}.")
    if wrong and m.layer[wrong[0]] == CONV1D:
        return (f"LoRA target {target} names {m.in_layer[wrong[0]]}, a GPT-2-style Conv1D that PEFT adapts "
                "transposed (fan_in_fan_out), which megatrain's LoRA does not implement.")
    if wrong or params:
        what = (f"{m.in_layer[wrong[0]]}, a {m.layer[wrong[0]] or 'module'}" if wrong
                else f"{params[0]}, a matrix of a {m.matrices[params[0]]}")
        right = [m.in_layer[n] for n in hits if m.layer[n] == LINEAR]
        instead = (f"spell it so that it names nn.Linear modules alone (e.g. {right[0]})" if right
                   else f"its decoder layers' projections are {names}")
        return (f"LoRA target {target} names {what} and no nn.Linear (PEFT may adapt it through its parameters), "
                f"which megatrain's LoRA does not; {instead}.")
    if last in m.fused:
        others = ", ".join(n for n in m.names if n not in m.fused)
        return (f"LoRA target {target} names the checkpoint's {last} experts, which transformers fuses into one "
                f"tensor that PEFT adapts as a parameter and megatrain's LoRA does not; target the other projections "
                f"({others}).")
    if not hits and any(matches(n, target) for n in m.layer):
        return (f"LoRA target {target} picks decoder layers by their index, which megatrain's LoRA does not (every "
                f"layer gets the same adapters); name the projection alone, e.g. {last}.")
    if not hits:
        return (f"LoRA target {target} names no projection of this {m.model_type} model; its decoder layers have "
                f"{names} (or use targets=all-linear).")
    return None


def _other_matrices(config: ModelConfig, prefix: str, kinds: dict[str, str]) -> dict[str, str]:
    """The decoder layers' matrices that no nn.Linear holds, by name in the layer, to their module's class: an MoE's
    router weight or fused experts, which PEFT adapts as parameters where their names are targets (and, under
    all-linear, for the model types whose transformers 4 names it maps: Mixtral's router and experts)."""
    found: dict[str, str] = {}
    for i in range(config.num_layers):
        for name, shape, _ in config.family.layer_tensors(config, i):
            owner = kinds.get(f"{prefix}{i}.{name.rpartition('.')[0]}", "")
            if len(shape) >= 2 and owner != LINEAR:
                found.setdefault(name, owner or "module")
    return found
