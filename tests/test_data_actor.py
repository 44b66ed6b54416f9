"""The data loader actor: prefetching never changes which batches come out, and resume stays exact."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest
import ray

from actors.data_loader import DataLoaderActor, PrefetchLoader
from megatrain.data import BatchLoader, DataConfig, DataError

CONFIG = dict(batch_size=2, seq_len=16, seed=3, eval_count=4, synthetic_docs=300)


def reference(n: int) -> list[dict[str, np.ndarray]]:
    ld = BatchLoader(DataConfig(**CONFIG))
    return [ld.next_batch() for _ in range(n)]


def assert_same(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g["input_ids"], w["input_ids"]) and np.array_equal(g["labels"], w["labels"])


def test_prefetch_state_is_the_last_batch_handed_out():
    ref = reference(10)
    ld = PrefetchLoader(DataConfig(**CONFIG), prefetch=3)
    assert_same([ld.next_batch() for _ in range(3)], ref[:3])
    time.sleep(0.05)  # let the producer run ahead: its position must not leak into state_dict
    state = ld.state_dict()
    assert state["batches"] == 3
    assert_same([ld.next_batch() for _ in range(4)], ref[3:7])
    ld.load_state_dict(state)  # rewind the same loader
    assert_same([ld.next_batch() for _ in range(4)], ref[3:7])
    with pytest.raises(DataError):  # a refused state leaves the loader where it was
        ld.load_state_dict({**state, "fingerprint": {**state["fingerprint"], "seq_len": 99}})
    assert_same([ld.next_batch()], ref[7:8])
    # a driver holding one batch ahead of the step it checkpoints asks for the position one call earlier
    assert_same([ld.next_batch()], ref[8:9])
    held = ld.state_dict(unconsumed=1)
    assert held["batches"] == 8 and ld.state_dict()["batches"] == 9
    ld.load_state_dict(held)
    assert_same([ld.next_batch()], ref[8:9])
    with pytest.raises(DataError, match="reaches back further"):
        ld.state_dict(unconsumed=5)
    ld.close()


def test_actor_prefetch_resume_eval_and_end(ray_session, tmp_path):
    ref = reference(10)
    actor = DataLoaderActor.remote(CONFIG, prefetch=3)
    assert_same([ray.get(actor.next_batch.remote()) for _ in range(3)], ref[:3])
    state = json.loads(json.dumps(ray.get(actor.state_dict.remote())))
    assert_same([ray.get(actor.next_batch.remote()) for _ in range(4)], ref[3:7])

    resumed = DataLoaderActor.remote(CONFIG, prefetch=2)
    ray.get(resumed.load_state_dict.remote(state))
    assert_same([ray.get(resumed.next_batch.remote()) for _ in range(4)], ref[3:7])
    held_out = list(BatchLoader(DataConfig(**CONFIG)).eval_batches())
    assert_same(ray.get(resumed.eval_batches.remote()), held_out)

    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "abc"}\n{"text": "de"}\n')
    config = {"source": str(src), "batch_size": 1, "seq_len": 4, "epochs": 1}
    finite = DataLoaderActor.remote(config, prefetch=2)
    batches = [ray.get(finite.next_batch.remote()) for _ in range(3)]  # 5 + 4 tokens with BOS/EOS, rows of 4
    assert batches[0]["input_ids"].tolist() == [[256, 97, 98, 99]]
    for _ in range(2):  # the end is reported every time it is asked for
        with pytest.raises(StopIteration):
            ray.get(finite.next_batch.remote())
    end = ray.get(finite.state_dict.remote())
    assert end["batches"] == 3 and ray.get(finite.state_dict.remote(unconsumed=2)) == end
    # tokenizing and packing need numpy alone: the loader's process never pays torch's import (a second, 300 MB)
    assert ray.get(finite.__ray_call__.remote(lambda self: sorted({"torch", "transformers"} & set(sys.modules)))) == []
    for a in (actor, resumed, finite):
        ray.kill(a)
