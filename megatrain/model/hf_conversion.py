"""A checkpoint's tensors as the generic path's model names them: transformers' own conversion mapping (Mixtral's
per-expert w1/w2/w3 into fused expert tensors, say), run one target tensor at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from megatrain.model.hf_model import meta_model


def natural_key(name: str) -> tuple[Any, ...]:
    """Sorts "experts.2" before "experts.10"."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def checkpoint_tensors(hf: dict[str, Any], stored: Iterable[tuple[str, Callable[[], torch.Tensor]]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's own (name, tensor) pairs from a checkpoint's (name, read) pairs, converted as transformers converts
    them on loading (Mixtral's per-expert w1/w2/w3 into fused expert tensors, say): its own conversion mapping, run
    on one target tensor at a time, so a checkpoint is never held in memory whole. Names the mapping does not know
    pass through unchanged (for the loader to refuse)."""
    import copy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    model = meta_model(hf)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    own = model.state_dict()
    pending: dict[str, Any] = {}  # target name -> its converter, collecting its sources' readers
    # numbers in names in numeric order: a fused expert tensor stacks experts 0, 1, 2, ..., 10, not 0, 1, 10, 11, 2
    for name, read in sorted(stored, key=lambda item: natural_key(item[0])):
        target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, own)
        if target not in own and name in own:
            target, pattern = name, None
        if pattern is None:
            yield target, read()
        else:
            pending.setdefault(target, copy.deepcopy(by_pattern[pattern])).add_tensor(target, name, pattern, read)
    for target, converter in pending.items():
        yield from converter.convert(target, model=model, config=model.config).items()
        converter.collected_tensors.clear()
