"""The memory plan as `megatrain plan` prints it (megatrain/memory/plan.py: MemoryPlan.report)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatrain.memory.plan import MemoryPlan

GiB = 2**30


def report(plan: MemoryPlan) -> str:
    def row(name: str, n: int) -> str:
        return f"  {name:<42}{n / GiB:>10.2f} GiB"
    size = f"{plan.params / 1e9:.3f} G" if plan.params >= 1e8 else f"{plan.params / 1e6:.3f} M"
    tiles = f"{plan.tile_tokens}-token tiles" if plan.tile_tokens else "untiled"
    micro = f" x {plan.micro_batches} micro-batches ({plan.schedule})" if plan.micro_batches > 1 else ""
    lines = [f"memory plan for {plan.model} ({size} params), batch {plan.batch} x {plan.seq} tokens{micro}, "
             f"{tiles}", "host:" if plan.nodes == 1 else f"host (each of {plan.nodes} nodes):"]
    moments = "Adam m,v" if plan.nodes == 1 else f"1/{plan.nodes} of Adam m,v"
    if plan.frozen_bytes:
        lines += [row(f"arena: frozen base ({plan.frozen_dtype}, no grads or Adam)", plan.frozen_bytes)]
    trained = "params" if not plan.frozen_bytes else f"{plan.adapter_params / 1e6:.1f} M adapters"
    lines += [row(f"arena: {trained} + {moments} (fp32)",
                  plan.arena_bytes - plan.grads_bytes - plan.bf16_copy_bytes - plan.frozen_bytes
                  - plan.reference_bytes)]
    if plan.bf16_copy_bytes:
        lines.append(row("arena: bf16 copy of the weights", plan.bf16_copy_bytes))
    if plan.reference_bytes:
        lines.append(row("arena: initial weights (the KL reference)", plan.reference_bytes))
    lines += [row(f"arena: gradients (grads = {plan.grads})", plan.grads_bytes)]
    lines.append(f"  arena: {plan.arena_host_bytes / max(plan.params, 1):.1f} B per parameter in host memory")
    if plan.tier is not None:  # the arena's rows above are its whole size; these states are on disk instead
        lines += [row(f"arena: on NVMe ({', '.join(k for k, _ in plan.tier.on_disk)}), less staging",
                      -plan.tier.saved_bytes)]
    lines += [row("offloaded checkpoints (pinned)", plan.host_checkpoints)] if plan.host_checkpoints else []
    lines += [row("processes (Ray, actors)", plan.process_bytes),
              row("total", plan.host_total), row("available", plan.host_free), row("/dev/shm free", plan.shm_free)]
    lines += ["gpu:" if plan.on_gpu else "compute device (CPU path, shares host memory):"]
    grads_row = "gradients (all, until the step ends)" if plan.grads == "device" else "gradient buffers"
    kept = "all" if plan.checkpoint_budget is None else f"budget {plan.checkpoint_budget / GiB:.2f} GiB"
    lines += [row("weight buffers (2 layers + head)", plan.gpu_weights), row(grads_row, plan.gpu_grads),
              row(f"device checkpoints ({kept})", plan.gpu_checkpoints)]
    lines += [row("checkpoint transfer buffers (2)", plan.gpu_transfer)] if plan.gpu_transfer else []
    lines += [row(f"one layer's recompute ({tiles})", plan.gpu_working), row("loss chunk", plan.gpu_loss)]
    if plan.gpu_resident:
        lines.append(row(f"{plan.resident_units} resident units and their Adam state", plan.gpu_resident))
    lines += [row(f"{len(plan.kept.indices)} layers' kept activations", plan.kept.bytes)] if plan.kept.bytes else []
    lines.append(row("total (with CUDA context)" if plan.on_gpu else "total", plan.gpu_total))
    if plan.gpu_free is not None:
        lines.append(row("free", plan.gpu_free))
    if plan.nodes > 1:
        lines.append(f"network per step and node ({plan.nodes} nodes): {plan.network_bytes / GiB:.2f} GiB sent "
                     "and as much received")
    if plan.on_gpu:
        lines.append(f"PCIe per step: {plan.h2d_bytes / GiB:.2f} GiB in, {plan.d2h_bytes / GiB:.2f} GiB out "
                     f"({plan.pcie_bytes_per_token / 2**20:.2f} MiB per token)")
    lines += [note for note in (plan.bf16_copy_note, plan.tier_note, plan.resident_note, plan.kept.describe())
              if note]
    problem = plan.host_problem() or plan.gpu_problem()
    lines.append("fits: yes" if problem is None else f"fits: NO: {problem}")
    return "\n".join(lines)

