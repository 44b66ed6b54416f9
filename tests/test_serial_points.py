"""The step's serial points (issue 25, item 6), each with results bit for bit those of the synchronous CPU path:
the loss is read only once the backward's top layer is queued, from a copy of its own on the D2H stream; the head's
weights are copied in right behind the last layer's where their update is in by then (else at the head, so that the
last layer's forward never waits for the head's update); layer 0's weights and the embedding rows go in the order
their updates end (the embedding's update never gates layer 0's copy); and micro-batches add their embedding
gradient rows into one buffer. The order is read from what the executor queues under the simulated streams, the
pool's order from a thread that marks units updated only once what must not wait for them has been queued."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatrain.config import ModelConfig
from megatrain.engine import embedding_rows, layer_passes
from megatrain.engine.embedding_rows import EmbeddingRows
from megatrain.engine.executor import Executor
from megatrain.engine.host_buffers import HostBuffers
from megatrain.engine.resident import ResidentUnits
from megatrain.engine.streams import Streams
from megatrain.engine.weight_waits import NO_WAITS, VersionWaits
from megatrain.memory.versions import VersionTable
from megatrain.model.layout import ModelLayout, Unit
from megatrain.model.templates import embed_backward, recompute_grads
from megatrain.telemetry import Recorder

CONFIG = ModelConfig(vocab_size=260, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                     intermediate_size=96)


@pytest.fixture(scope="module")
def model() -> tuple[ModelLayout, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    layout = ModelLayout.build(CONFIG)
    gen = torch.Generator().manual_seed(0)
    params = 0.05 * torch.randn(layout.numel, generator=gen)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=gen)
    return layout, params, (ids, ids.clone())


def _logged_run(model, monkeypatch, device: str, go_on: bool) -> tuple[list[str], object, torch.Tensor]:
    """One step, logging in order each layer's backward as compute takes it, the loss read, and each gradient
    landing; returns the log, the step's output and the gradients."""
    layout, params, batch = model
    log: list[str] = []
    seen: list[float] = []

    def logged(fn, x, *args, **kwargs):
        log.append("backward")
        return recompute_grads(fn, x, *args, **kwargs)

    def loss_ready(loss: float) -> bool:
        log.append("loss")
        seen.append(loss)
        return go_on

    def landed(unit: Unit, norm_sq: float) -> None:
        log.append(f"landed {unit.index}")

    monkeypatch.setattr(layer_passes, "recompute_grads", logged)
    grads = torch.zeros(layout.numel)
    executor = Executor(CONFIG, layout, params, grads, device=device)
    out = executor.run(*batch, loss_ready=loss_ready, grads_landed=landed)
    executor.close()
    assert seen == [out.loss]  # the number read is the step's loss
    return log, out, grads


@pytest.fixture(scope="module")
def reference(model):
    """The step on the synchronous CPU path: (its output, its gradients)."""
    layout, params, batch = model
    grads = torch.zeros(layout.numel)
    return Executor(CONFIG, layout, params, grads).run(*batch), grads


def _assert_same(out, grads, reference) -> None:
    ref_out, ref_grads = reference
    assert out.loss == ref_out.loss and out.unit_grad_norms_sq == ref_out.unit_grad_norms_sq
    assert torch.equal(grads, ref_grads)


@pytest.mark.parametrize("device", ["cpu", "cpu-async:0", "cpu-async:1"])
def test_the_loss_is_read_after_the_top_layer_backward_is_queued(model, reference, monkeypatch, device) -> None:
    log, out, grads = _logged_run(model, monkeypatch, device, go_on=True)
    assert log[:2] == ["backward", "loss"], log  # and before any gradient has left the device
    assert log.count("backward") == CONFIG.num_layers and log.count("loss") == 1
    _assert_same(out, grads, reference)


@pytest.mark.parametrize("device", ["cpu", "cpu-async:0"])
def test_a_refused_loss_sends_no_gradient_and_the_next_step_is_exact(model, reference, monkeypatch, device) -> None:
    layout, params, batch = model
    log, out, grads = _logged_run(model, monkeypatch, device, go_on=False)
    assert log == ["backward", "loss"] and out.unit_grad_norms_sq == [] and not grads.any()
    assert out.loss == reference[0].loss
    executor = Executor(CONFIG, layout, params, grads, device=device)
    executor.run(*batch, loss_ready=lambda loss: False)  # the same executor steps on after a refused one
    again = executor.run(*batch, loss_ready=lambda loss: True)
    executor.close()
    _assert_same(again, grads, reference)


# ---- the head's weights and layer 0's, each copied in as soon as its update is in (issue 25, item 6) ----

LAST, HEAD, EMBED, LAYER0 = CONFIG.num_layers - 1, CONFIG.num_layers + 1, 0, 1  # unit indices: embed, layers, head


class Pool:
    """The optimizer pool as the version table sees it: a thread that marks units updated in `order`, each only once
    the executor's log holds what `gates` says it waits for (a unit's update that must not gate that entry: were the
    executor to wait for it first, the two would wait for each other, and the gate's timeout says so)."""

    def __init__(self, order: list[int], gates: dict[int, str]):
        self.table = VersionTable(torch.zeros(CONFIG.num_layers + 2, 1, dtype=torch.int64))
        self.order, self.gates = order, gates
        self.log: list[str] = []
        self.timed_out: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for unit in self.order:
            gate, deadline = self.gates.get(unit), time.monotonic() + 30
            while gate is not None and gate not in self.log:
                if time.monotonic() > deadline:
                    self.timed_out.append(gate)
                    break
                time.sleep(0.001)
            self.table.set(unit, 0, 1)


def _traced_run(model, device: str, pool: Pool | None = None, micro_batches: int = 1):
    """One step logging, in the order the executor queues them, each unit's H2D ("h2d <unit>"), the gather of the
    embedding rows and each layer's forward; returns the log, the output and the gradients."""
    layout, params, batch = model
    log = [] if pool is None else pool.log
    grads = torch.zeros(layout.numel)
    executor = Executor(CONFIG, layout, params, grads, device=device)
    units = {u.range_of(executor.weights).data_ptr(): u.index for u in layout.units}
    copy, forward, gather = executor.streams.copy, executor.passes.forward, executor.embedding.gather

    def logged_copy(dst, src, stream):
        if src.data_ptr() in units:
            log.append(f"h2d {units[src.data_ptr()]}")
        copy(dst, src, stream)

    def logged_forward(i, *args):
        log.append(f"forward {i}")
        return forward(i, *args)

    def logged_gather(input_ids):
        log.append("gather")
        return gather(input_ids)

    executor.streams.copy, executor.passes.forward, executor.embedding.gather = logged_copy, logged_forward, \
        logged_gather
    waits = NO_WAITS if pool is None else VersionWaits(pool.table, 1)
    if pool is not None:
        pool.thread.start()
    out = executor.run(*batch, weight_waits=waits, micro_batches=micro_batches)
    executor.close()
    if pool is not None:
        pool.thread.join()
        assert pool.timed_out == [], pool.timed_out
    return log, out, grads


def test_the_heads_copy_is_queued_behind_the_last_layers_where_its_update_is_in(model, reference) -> None:
    log, out, grads = _traced_run(model, "cpu-async:0")
    assert log.index(f"h2d {LAST + 1}") < log.index(f"h2d {HEAD}") < log.index(f"forward {LAST}"), log
    _assert_same(out, grads, reference)
    # the head's update in only once the last layer's forward is queued: its copy waits for it at the head
    pool = Pool(order=[EMBED, *range(LAYER0, HEAD), HEAD], gates={HEAD: f"forward {LAST}"})
    log, out, grads = _traced_run(model, "cpu-async:0", pool)
    assert log.index(f"forward {LAST}") < log.index(f"h2d {HEAD}"), log
    _assert_same(out, grads, reference)


@pytest.mark.parametrize("pool_order", ["backward", "forward"])
def test_layer_0_and_the_embedding_rows_go_in_the_order_their_updates_end(model, reference, pool_order) -> None:
    """The pool updates units in backward order where updates go beside the backward (the embedding's last), in
    forward order after the step (the embedding's first): layer 0's H2D never waits for the embedding's update in the
    one, nor the gather for layer 0's in the other."""
    if pool_order == "backward":
        pool = Pool(order=[HEAD, *range(LAST + 1, EMBED, -1), EMBED], gates={EMBED: f"h2d {LAYER0}"})
    else:
        pool = Pool(order=list(range(HEAD + 1)), gates={LAYER0: "gather"})
    log, out, grads = _traced_run(model, "cpu-async:0", pool)
    first, second = (f"h2d {LAYER0}", "gather") if pool_order == "backward" else ("gather", f"h2d {LAYER0}")
    assert log.index(first) < log.index(second) < log.index("forward 0"), log
    _assert_same(out, grads, reference)


def test_the_version_table_says_which_unit_is_in_first_without_waiting_where_one_is() -> None:
    table = VersionTable(torch.zeros(4, 2, dtype=torch.int64))
    table.set(3, 0, 1)
    assert not table.reached(3, 1) and table.wait_first([1, 3], 1, timeout=0.0) is None  # one column of two
    table.set(3, 1, 1)
    assert table.reached(3, 1) and table.wait_first([1, 3], 1) == 3
    table.table[1] = 1
    assert table.wait_first([1, 3], 1) == 1  # both: the first asked for
    later = threading.Timer(0.01, table.set, (2, 1, 1))
    table.set(2, 0, 1)
    later.start()
    assert table.wait_first([0, 2], 1) == 2 and table.wait(2, 1)


# ---- the embedding's gradient rows summed over micro-batches in one buffer ----

def test_micro_batches_scatter_the_embeddings_gradient_into_one_buffer(model, monkeypatch) -> None:
    """Each micro-batch's token gradients are added into the one buffer of the step's rows (no buffer per micro-batch
    added afterwards): the sum of one batch of all their tokens, bit for bit, within fp32 rounding of fp64."""
    layout, _, _ = model
    gen = torch.Generator().manual_seed(1)
    k, tokens, rows = 4, 24, 10
    token_rows = [torch.randint(0, rows, (2, tokens // 2), generator=gen) for _ in range(k)]
    token_grads = [torch.randn(2, tokens // 2, CONFIG.hidden_size, generator=gen) for _ in range(k)]
    seen: list[torch.Tensor | None] = []

    def logged(grad_x, row_index, num_rows, into=None):
        seen.append(into)
        return embed_backward(grad_x, row_index, num_rows, into)

    monkeypatch.setattr(embedding_rows, "embed_backward", logged)
    embedding = EmbeddingRows(layout.embed, torch.zeros(1), ResidentUnits(layout, 0, torch.device("cpu"),
                              torch.float32), torch.float32, None, None, HostBuffers(Streams()), lambda t: t,
                              Recorder(enabled=False))
    summed = embedding.grad_rows(list(token_grads), token_rows, torch.arange(rows))
    assert seen[0] is None and all(into is summed for into in seen[1:]) and len(seen) == k
    whole = embed_backward(torch.cat(token_grads), torch.cat(token_rows), rows)
    assert torch.equal(summed, whole)
    exact = embed_backward(torch.cat(token_grads).double(), torch.cat(token_rows), rows)
    magnitude = embed_backward(torch.cat(token_grads).double().abs(), torch.cat(token_rows), rows)
    assert ((summed.double() - exact).abs() <= k * tokens * torch.finfo(torch.float32).eps * magnitude).all()


def test_micro_batches_are_exact_under_simulated_streams(model) -> None:
    _, out, grads = _traced_run(model, "cpu", micro_batches=2)
    _, async_out, async_grads = _traced_run(model, "cpu-async:0", micro_batches=2)
    _assert_same(async_out, async_grads, (out, grads))
