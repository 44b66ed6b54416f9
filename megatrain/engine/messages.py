"""What an executor actor's step hands the driver (ExecutorStep; several executors' merged into one), and what an
evaluation does (Evaluation): dataclasses, not string-keyed dicts."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class ExecutorStep:
    """One train_step of an executor (actors/executor.py), or of all of them, merged."""

    loss: float  # the step's loss summed over its labelled tokens' share (the mean, once merged)
    tokens: int
    seq: int
    unit_norms_sq: list[float]  # per unit, the squared norm of (this executor's slice of) its gradient
    updates: list[Any] = field(default_factory=list)  # the workers' update calls handed out in the backward (refs)
    skipped_units: list[int] = field(default_factory=list)  # units whose gradient was not finite (final updates)
    speculated: list[int] = field(default_factory=list)  # units updated beside the backward
    resident: list[int] = field(default_factory=list)  # units resident on the executor's device
    stats: dict[str, Any] = field(default_factory=dict)  # the stall accounting (StepStats.to_dict)
    spans: list[Any] = field(default_factory=list)  # the trace's, when tracing
    speculated_any: bool = False  # merged: whether some node's workers updated a unit beside the backward
    loss_metrics: dict[str, Any] = field(default_factory=dict)  # what the step's loss reported (TokenLoss.reported)


@dataclass
class Evaluation:
    loss: float
    tokens: int


def merged(outs: list[ExecutorStep], nodes: int = 1) -> ExecutorStep:
    """One step's result from its executors' (data parallel, `nodes` nodes' in rank order): losses, tokens and each
    unit's squared norm (of each one's slice of the summed gradient) added up; the first's stall accounting. The
    units updated beside the backward: `speculated`, those every executor handed out (on every node); and
    `speculated_any`, whether some node's workers updated one (its executors all handed it out)."""
    per_node = len(outs) // nodes
    handed_out = [set(out.speculated) for out in outs]
    speculated_any = any(set.intersection(*handed_out[m * per_node : (m + 1) * per_node]) for m in range(nodes))
    if len(outs) == 1:
        return replace(outs[0], speculated_any=speculated_any)
    norms = [out.unit_norms_sq for out in outs]
    return replace(outs[0], loss=sum(out.loss for out in outs), tokens=sum(out.tokens for out in outs),
                   unit_norms_sq=[sum(unit) for unit in zip(*norms, strict=True)] if all(norms) else [],
                   skipped_units=sorted({u for out in outs for u in out.skipped_units}),
                   updates=[ref for out in outs for ref in out.updates],
                   speculated=sorted(set.intersection(*handed_out)), speculated_any=speculated_any,
                   spans=[span for out in outs for span in out.spans])
