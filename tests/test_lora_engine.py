"""LoRA through the Engine: a tiny Qwen2 (native: q/k/v biases, tied embeddings) and a tiny Mixtral (the generic
path: transformers' own layers, the router's auxiliary loss) whose frozen bases are kept in bf16 (the default) train
adapters started from a PEFT directory; their loss, every adapter gradient and three AdamW steps are held against
PEFT + transformers + torch.optim.AdamW on the same bf16-rounded base (fp32 within 1e-5; the steps judged against
fp64), the base stays bit for bit what was loaded, and what they write loads in PEFT (the adapter) and transformers
(the merged model). The store's side (checkpoint, merge) is checked without Ray; the memory plan's arithmetic for
the real 32B and 70B shapes; bad settings get one sentence; the native run's last step, redone from its checkpoint
with the optimizer worker killed, is recovered bit for bit. Random kills, resume in a new Engine, resident adapters,
micro-batches, several executors and the command line end to end are slow (several nodes: tests/test_nodes.py)."""

from __future__ import annotations

import copy
import os
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import peft
import pytest
import torch
from helpers import (
    FAMILIES,
    REL_TOL,
    SHAPE,
    THREE_STEPS_OPTIM,
    VOCAB,
    assert_one_sentence,
    build_hf_model,
    error,
    kill_once_updates_are_handed_out,
    max_rel,
    rel_err,
    run_cli,
    worker_pids,
)
from peft.utils import set_peft_model_state_dict
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig, get_cosine_schedule_with_warmup

import megatrain
from megatrain.config import ConfigError, EngineConfig, ModelConfig
from megatrain.lora import Adapters, LoraConfig, save_adapter
from megatrain.lora.layout import lora_layout
from megatrain.memory.arena import FROZEN_SEGMENT
from megatrain.memory.plan import plan_run
from megatrain.model.layout import ModelLayout
from megatrain.store import ParameterStore
from pipelines.finetune import LORA_LR, finetune_config
from pipelines.lora import as_lora_config, lora_settings

LORA = "r=4,alpha=16,targets=q_proj,v_proj,down_proj,rslora=true"
GENERIC_LORA = "r=4,alpha=8,targets=self_attn.q_proj,k_proj,v_proj,o_proj"
GiB = 2**30


def lora_batches(n: int = 3, rows: int = 2, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (rows, 16), generator=gen)
        labels = ids.clone()
        labels[0, :5] = -100
        batches.append((ids, labels))
    return batches


def make_lora_model(root: Path, config: PretrainedConfig, lora: str) -> tuple[torch.nn.Module, Path, Path, Adapters]:
    """The transformers model, its directory, and a PEFT adapter directory with B random (PEFT starts B at zero,
    which would leave A without a gradient at the first step)."""
    hf = build_hf_model(config, 0)
    hf.save_pretrained(root / "model")
    layout = ModelLayout.build(ModelConfig.from_hf(root / "model"))
    adapters = Adapters.init(layout, LoraConfig.parse(lora), seed=3)
    gen = torch.Generator().manual_seed(4)
    for name, t in adapters.tensors.items():
        if ".lora_B." in name:
            t.copy_(0.1 * torch.randn(t.shape, generator=gen))
    save_adapter(adapters, root / "adapter")
    return hf, root / "model", root / "adapter", adapters


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory) -> tuple[torch.nn.Module, Path, Path, Adapters]:
    return make_lora_model(tmp_path_factory.mktemp("lora"), FAMILIES["qwen2-tied"](), LORA)


@pytest.fixture(scope="module")
def generic_model(tmp_path_factory) -> tuple[torch.nn.Module, Path, Path, Adapters]:
    """Mixtral on the generic path (transformers' own layers): adapters on its attention, and the router's auxiliary
    loss, whose gradient reaches them through the layers' recompute."""
    config = MixtralConfig(**SHAPE, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                           num_experts_per_tok=2, router_aux_loss_coef=0.05, output_router_logits=True)
    return make_lora_model(tmp_path_factory.mktemp("generic"), config, GENERIC_LORA)


def peft_model(hf: torch.nn.Module, adapters: dict[str, torch.Tensor], lora: LoraConfig,
               dtype: torch.dtype = torch.float32, bf16_base: bool = True) -> torch.nn.Module:
    """PEFT's LoRA on `hf` (its weights rounded to bf16 first, as the run keeps its base) in `dtype`."""
    base = copy.deepcopy(hf)
    if bf16_base:
        for p in base.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    if dtype == torch.float64 and any(".experts." in n for n, _ in base.named_parameters()):
        base.set_experts_implementation("eager")  # torch's grouped matmul has no fp64 kernel
    model = peft.get_peft_model(base.to(dtype), peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), use_rslora=lora.use_rslora))
    assert not set_peft_model_state_dict(model, {n: t.to(dtype) for n, t in adapters.items()}).unexpected_keys
    return model


def peft_training(hf: torch.nn.Module, adapters: Adapters, batches: list, dtype: torch.dtype = torch.float32
                  ) -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(losses, each step's adapter gradients as clipped at 1, the adapters after the steps) of PEFT +
    torch.optim.AdamW (weight decay on the adapters, as on every trainable parameter) on HF's cosine schedule."""
    model = peft_model(hf, adapters.tensors, adapters.lora, dtype)
    named = [(n.replace(".default.", "."), p) for n, p in model.named_parameters() if p.requires_grad]
    o = THREE_STEPS_OPTIM
    opt = torch.optim.AdamW([p for _, p in named], lr=o["lr"], betas=o["betas"], eps=o["eps"],
                            weight_decay=o["weight_decay"])
    schedule = get_cosine_schedule_with_warmup(opt, o["warmup_steps"], o["total_steps"])
    losses, grads = [], []
    for ids, labels in batches:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)  # in place, as the optimizer does in the arena
        grads.append({n: p.grad.float().clone() for n, p in named})
        opt.step()
        schedule.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().float().clone() for n, p in named}


PeftRun = tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def peft_runs() -> Callable[[torch.nn.Module, Adapters, torch.dtype], PeftRun]:
    """peft_training on lora_batches() of a model (a module fixture's, with its adapters) in a dtype, run once per
    module: the loss and gradient test and every judgement against fp64 read the same fp32 run."""
    runs: dict[tuple[int, int, torch.dtype], tuple[torch.nn.Module, Adapters, PeftRun]] = {}

    def run(hf: torch.nn.Module, adapters: Adapters, dtype: torch.dtype = torch.float32) -> PeftRun:
        key = (id(hf), id(adapters), dtype)  # the entry holds both, so neither id is reused meanwhile
        if key not in runs:
            runs[key] = hf, adapters, peft_training(hf, adapters, lora_batches(), dtype)
        return runs[key][2]

    return run


ENGINE = dict(optimizer_workers=1, precision="fp32", device="cpu", max_grad_norm=1.0, **THREE_STEPS_OPTIM)


def train_lora(model_dir: Path, adapter_dir: Path, lora: str, out: Path, kill: bool = False) -> dict:
    """Three steps of the Engine with adapters: the losses, each step's adapter gradients (the arena's, which the
    optimizer clipped there in place: every step here clips, so the clip coefficient is checked too), a checkpoint
    after the second step, the adapters and the frozen segment after the third, the adapter it saved. With `kill`,
    then the third step again from that checkpoint, its optimizer worker killed (`redo_with_a_killed_worker`)."""
    losses, grads = [], []
    with megatrain.Engine(model_dir, lora=lora, adapter=adapter_dir, **ENGINE) as engine:
        assert engine.engine_config.lora_base_dtype == "bf16" and engine.grads == "arena"
        for step, (ids, labels) in enumerate(lora_batches()):
            losses.append(engine.step(ids, labels))
            engine.wait_for_updates()
            grads.append({n: g.clone() for n, g in engine.actors.layout.hf_views(engine.actors.arena.grads).items()})
            if step == 1:
                engine.save_checkpoint(out / "step-2")
        params = engine.parameters()
        segments = dict((name, numel) for name, _, numel in engine.handle.segments)
        frozen = engine.actors.arena.tensors[FROZEN_SEGMENT].clone()
        engine.save_pretrained(out / "final")
        redone = redo_with_a_killed_worker(engine, out / "step-2", lora_batches()[2]) if kill else None
    return dict(losses=losses, grads=grads, params=params, segments=segments, frozen=frozen, out=out, redone=redone)


def redo_with_a_killed_worker(engine: megatrain.Engine, checkpoint: Path, batch: tuple) -> dict:
    """Back to `checkpoint` and its next step again, the optimizer worker SIGKILLed as the step's update is handed out
    to it (the update in flight, perhaps half applied): the recovery replaces it, restores the checkpoint and replays
    the step. (The loss, the adapters after it, the deaths survived.)"""
    engine.load_checkpoint(checkpoint)
    kill_once_updates_are_handed_out(engine, worker_pids(engine)[0])
    loss = engine.step(*batch)
    return dict(loss=loss, params=engine.parameters(), restarts=engine.restarts)


@pytest.fixture(scope="module")
def trained(ray_session, lora_model, tmp_path_factory) -> dict:
    _, model_dir, adapter_dir, _ = lora_model
    return train_lora(model_dir, adapter_dir, LORA, tmp_path_factory.mktemp("trained"), kill=True)


@pytest.fixture(scope="module")
def generic_trained(ray_session, generic_model, tmp_path_factory) -> dict:
    _, model_dir, adapter_dir, _ = generic_model
    return train_lora(model_dir, adapter_dir, GENERIC_LORA, tmp_path_factory.mktemp("generic-trained"))


@pytest.fixture(params=["native", "generic"])
def run(request) -> tuple[tuple[torch.nn.Module, Path, Path, Adapters], dict]:
    """(the model, its Engine run) of the native Qwen2 and of the generic path's Mixtral."""
    if request.param == "native":
        return request.getfixturevalue("lora_model"), request.getfixturevalue("trained")
    return request.getfixturevalue("generic_model"), request.getfixturevalue("generic_trained")


def test_loss_and_every_adapter_gradient_match_peft(run, peft_runs) -> None:
    (hf, _, _, adapters), trained = run
    losses, grads, _ = peft_runs(hf, adapters)
    assert trained["losses"] == pytest.approx(losses, rel=REL_TOL)
    for step, want in enumerate(grads):
        assert set(trained["grads"][step]) == set(want) == set(adapters.tensors)
        errors = {n: rel_err(trained["grads"][step][n], g) for n, g in want.items()}
        assert max(errors.values()) <= REL_TOL, (step, errors)
        assert all(g.abs().max() > 0 for g in want.values())  # else a wrong value would go unseen


def assert_judged_against_fp64(params: dict[str, torch.Tensor], hf: torch.nn.Module, adapters: Adapters,
                               peft_runs: Callable[[torch.nn.Module, Adapters, torch.dtype], PeftRun]) -> None:
    """megatrain's distance to PEFT's fp64 run of lora_batches() within twice PEFT's fp32 distance (or 1e-5): helpers'
    house rule."""
    _, _, exact = peft_runs(hf, adapters, torch.float64)
    _, _, fp32 = peft_runs(hf, adapters, torch.float32)
    ours, theirs = max_rel(params, exact), max_rel(fp32, exact)
    too_far = {n: (e, theirs[n]) for n, e in ours.items() if e > max(1e-5, 2 * theirs[n])}
    assert not too_far, f"(megatrain, PEFT fp32) relative errors against fp64: {too_far}"
    assert all(not torch.equal(params[n], t) for n, t in adapters.tensors.items())  # they trained


def test_three_steps_match_peft_adamw_within_fp32_rounding(run, peft_runs) -> None:
    (hf, _, _, adapters), trained = run
    assert_judged_against_fp64(trained["params"], hf, adapters, peft_runs)


def test_the_base_is_frozen_bit_for_bit_with_no_gradient_or_moments(trained, lora_model) -> None:
    hf, model_dir, _, adapters = lora_model
    layout = lora_layout(ModelConfig.from_hf(model_dir), LoraConfig.parse(LORA))
    base = layout.frozen.hf_views(trained["frozen"])
    want = {n: t for n, t in hf.state_dict().items() if n != "lm_head.weight"}  # tied: the embedding's
    assert base.keys() == want.keys()
    assert all(torch.equal(base[n], t.to(torch.bfloat16)) for n, t in want.items())
    # the arena: the base once (bf16); gradients and Adam moments for the adapters alone
    segments = trained["segments"]
    assert segments[FROZEN_SEGMENT] == layout.frozen.numel
    assert segments["params"] == segments["grads"] == segments["exp_avg"] == segments["exp_avg_sq"] == layout.numel
    assert layout.adapter_numel() == adapters.numel()


def test_a_killed_optimizer_worker_recovers_exactly(trained) -> None:
    """The adapters are the arena's trainable part, updated by the pool: the third step again from the checkpoint
    after the second, its optimizer worker SIGKILLed during the update, is replaced, the arena restored and the step
    replayed: bit for bit the loss and adapters of the run that went on from that checkpoint without a kill."""
    redone = trained["redone"]
    assert redone["restarts"] == 1
    assert redone["loss"] == trained["losses"][2]
    assert redone["params"].keys() == trained["params"].keys()
    assert all(torch.equal(redone["params"][n], t) for n, t in trained["params"].items())


def test_the_saved_adapter_loads_in_peft_with_identical_logits(run) -> None:
    (hf, _, _, adapters), trained = run
    ids = lora_batches(1)[0][0]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), trained["out"] / "final").eval()
    with torch.no_grad():
        want = peft_model(hf, trained["params"], adapters.lora, bf16_base=False).eval()(input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids).logits, want)
    # a checkpoint of the run is a PEFT adapter directory too (its adapters as of step 2)
    checkpoint = peft.PeftModel.from_pretrained(copy.deepcopy(hf), trained["out"] / "step-2")
    lora_a = next(n for n in trained["params"] if ".lora_A." in n)
    state = {n.replace(".default.", "."): t for n, t in checkpoint.state_dict().items()}
    assert state[lora_a].shape == trained["params"][lora_a].shape


@pytest.mark.parametrize("model", ["lora_model", "generic_model"])
def test_store_merges_and_checkpoints_adapters(request, model: str, tmp_path) -> None:
    """Without Ray: a store with an fp32 base writes the merged model, which transformers loads with the logits of
    base + adapter (PEFT's), and its checkpoint of the adapters and their moments loads back bit for bit."""
    hf, model_dir, adapter_dir, adapters = request.getfixturevalue(model)
    lora = adapters.lora
    store = ParameterStore(model_dir, lora=lora, lora_base_dtype="fp32", adapter=adapter_dir, check_memory=False)
    try:
        for moment in store.layout.hf_views(store.arena.exp_avg).values():  # as if trained
            moment.normal_(generator=torch.Generator().manual_seed(0))
        store.save_pretrained(tmp_path / "merged", merge=True)
        store.save_checkpoint(tmp_path / "ckpt", {"steps_done": 1, "updates_applied": 1})
        saved = {n: t.clone() for n, t in store.arena.tensors.items()}
    finally:
        store.close()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = lora_batches(1)[0][0]
    with torch.no_grad():
        want = peft_model(hf, adapters.tensors, lora, bf16_base=False).eval()(input_ids=ids).logits
        assert rel_err(merged(input_ids=ids).logits, want) <= REL_TOL
    again = ParameterStore(model_dir, lora=lora, lora_base_dtype="fp32", check_memory=False, seed=1)
    try:
        assert again.load_checkpoint(tmp_path / "ckpt")["steps_done"] == 1
        for name in ("params", "exp_avg", "exp_avg_sq", FROZEN_SEGMENT):
            assert torch.equal(again.arena.tensors[name], saved[name]), name
        other = ParameterStore(model_dir, lora=LoraConfig.parse("r=2,alpha=4,targets=q_proj"), check_memory=False)
        try:
            assert_one_sentence(error(other.load_checkpoint, tmp_path / "ckpt"))
        finally:
            other.close()
    finally:
        again.close()


def test_bad_settings_are_refused_in_one_sentence(lora_model, tmp_path) -> None:
    _, model_dir, adapter_dir, _ = lora_model
    # ("r=4,alpha=8" alone is no longer refused: targets not given default to all-linear, tests/test_lora.py)
    for lora in ("r=0,alpha=8,targets=q_proj", "r=4,alpha=8,targets=qkv_proj", "r=4,alpha=oops", 7):
        assert_one_sentence(error(megatrain.Engine, model_dir, lora=lora, device="cpu"))  # before Ray starts
    assert "qkv_proj" in error(megatrain.Engine, model_dir, lora="r=4,alpha=8,targets=qkv_proj")
    for lora, settings in ((f"{LORA},dropout=0.1", dict(tile_tokens=512)), (LORA, dict(grads="device"))):
        assert_one_sentence(error(megatrain.Engine, model_dir, lora=lora, **settings))
    assert "rank" in error(megatrain.Engine, model_dir, lora="r=8,alpha=8,targets=q_proj,v_proj,down_proj",
                           adapter=adapter_dir)
    generic = ModelConfig.from_hf(Path(__file__).parent / "data" / "hf_configs" / "starcoder2-15b.json")
    targets = lora_settings("r=8,alpha=16,targets=v_proj,q_proj", None, generic, EngineConfig()).target_modules
    assert targets == ("q_proj", "v_proj")  # the generic path takes adapters, in its layers' order
    assert "c_fc" in error(lora_settings, LORA, None, generic, EngineConfig())  # its MLP has no down_proj
    with pytest.raises(ConfigError):
        EngineConfig(lora_base_dtype="fp16")
    run = run_cli("finetune", "--model", str(model_dir), "--data", str(tmp_path / "none.txt"), "--out",
                  str(tmp_path / "o"), "--lora", "r=0,alpha=8,targets=q_proj")
    assert run.returncode != 0 and "LoRA rank r must be a positive whole number" in run.output, run.output


def test_lora_from_a_toml_table_and_flags(lora_model, tmp_path) -> None:
    """A [lora] table in PEFT's spelling (or the flag's form, which overrides it) sets the run's adapters, and LoRA's
    learning rate where none is given; a bad key is one sentence."""
    _, model_dir, _, _ = lora_model
    data = tmp_path / "data.txt"
    data.write_text("some text to train on. " * 50)
    toml = tmp_path / "lora.toml"
    toml.write_text('steps = 5\n[lora]\nr = 8\nlora_alpha = 16\ntarget_modules = ["q_proj", "v_proj"]\n')
    byte = {"data.tokenizer": "byte"}  # (this model's vocabulary is too small for it: no batch is made here)
    cfg = finetune_config(model_dir, data, tmp_path / "out", toml, byte)
    assert as_lora_config(cfg.lora) == LoraConfig(8, 16, ("q_proj", "v_proj")) and cfg.lr == LORA_LR
    cfg = finetune_config(model_dir, data, tmp_path / "out", toml, {**byte, "lora": "r=2,alpha=4,targets=all-linear"})
    assert as_lora_config(cfg.lora).r == 2
    toml.write_text("[lora]\nr = 8\nalpha = 16\ntargets = ['q_proj']\nrank = 4\n")
    assert_one_sentence(error(finetune_config, model_dir, data, tmp_path / "out", toml, byte))


def test_plan_of_a_lora_run_for_the_32b_and_70b_shapes() -> None:
    """The arithmetic: the frozen base at 2 B a parameter (4 in fp32), the adapters at 16 B (fp32 weight, gradient, m,
    v), all resident on an 80 GB GPU; Qwen2.5-32B fits a 125 GiB host with a 1 x 4096 batch, Llama-3.1-70B does not
    (136 GiB), a 160 GiB one does."""
    lora = LoraConfig.parse("r=16,alpha=32,targets=q_proj,v_proj")
    gpu = dict(on_gpu=True, gpu_free=79 * GiB, resident="auto", lora=lora)
    for name, adapters in (("32b", 64 * 16 * (5120 + 5120 + 5120 + 1024)), ("70b", 80 * 16 * (8192 * 3 + 1024))):
        config = ModelConfig.from_name(name)
        plan = plan_run(config, 1, 4096, host_free=125 * GiB, **gpu)
        assert plan.adapter_params == adapters and plan.grads == "arena" and plan.tile_tokens is None
        assert plan.frozen_bytes == 2 * plan.arena_numel and plan.arena_numel >= config.num_params()
        assert plan.arena_bytes == plan.frozen_bytes + 16 * sum(plan.adapter_numels) and plan.bf16_copy_bytes == 0
        assert plan.resident_units == config.num_layers + 2 and plan.gpu_resident == 16 * sum(plan.adapter_numels)
        # the adapters' gradients never leave the GPU: only the loss (4 B, read each step) does
        assert plan.gpu_problem() is None and plan.d2h_bytes == 4
        fp32 = plan_run(config, 1, 4096, host_free=125 * GiB, lora_base_dtype="fp32", **gpu)
        assert fp32.frozen_bytes == 2 * plan.frozen_bytes
        if name == "32b":
            assert plan.host_problem() is None and 60 * GiB < plan.host_total < 70 * GiB
        else:
            assert plan.host_problem() is not None and 130 * GiB < plan.host_total < 140 * GiB
            assert plan_run(config, 1, 4096, host_free=160 * GiB, **gpu).host_problem() is None
    cpu = plan_run(ModelConfig.from_name("tiny"), 2, 64, lora=lora, resident="auto")
    assert cpu.resident_units == 0 and "CPU path" in cpu.resident_note
    run = run_cli("plan", "--model", "32b", "--lora", "r=16,alpha=32,targets=q_proj,v_proj", "--batch", "1",
                  "--seq", "4096", "--device", "cuda", "--gpu-gib", "79", "--host-gib", "125")
    assert run.returncode == 0 and "frozen base (bf16" in run.output and "fits: yes" in run.output, run.output
    # the fastest predicted settings are a whole model's update's: not a LoRA run's
    run = run_cli("plan", "--model", "32b", "--lora", "r=16,alpha=32,targets=q_proj,v_proj", "--optimizer-workers",
                  "auto", "--device", "cuda", "--gpu-gib", "79")
    assert run.returncode == 2 and "give --optimizer-workers a number with --lora" in run.output, run.output


# ---- slow: a second Engine each ----

@pytest.mark.slow
def test_resume_from_a_checkpoint_is_exact(ray_session, trained, lora_model) -> None:
    _, model_dir, _, _ = lora_model
    with megatrain.Engine(model_dir, lora=LORA, **ENGINE) as engine:
        assert engine.load_checkpoint(trained["out"] / "step-2")["steps_done"] == 2
        ids, labels = lora_batches()[2]
        assert engine.step(ids, labels) == trained["losses"][2]
        params = engine.parameters()
    assert all(torch.equal(params[n], t) for n, t in trained["params"].items())


@pytest.mark.slow
@pytest.mark.parametrize("settings", [dict(resident=4), dict(device="cpu-async:3"),
                                      dict(device="cpu-async:4", resident=4)])
def test_resident_adapters_and_simulated_streams_train_bit_for_bit_as_the_pool(ray_session, trained, lora_model,
                                                                                settings) -> None:
    """Every unit's adapters on the "device" with their Adam state, updated there (the GPU's default, here on the CPU
    path): the same fused AdamW as the optimizer pool's, so the same bits; and the GPU's way under simulated streams
    (the bf16 base cast on the device, the adapters copied in beside it, or resident)."""
    _, model_dir, adapter_dir, _ = lora_model
    with megatrain.Engine(model_dir, lora=LORA, adapter=adapter_dir, **{**ENGINE, **settings}) as engine:
        assert engine.engine_config.resident == settings.get("resident", 0)
        losses = [engine.step(ids, labels) for ids, labels in lora_batches()]
        params = engine.parameters()
    assert losses == trained["losses"]
    assert all(torch.equal(params[n], t) for n, t in trained["params"].items())


@pytest.mark.slow  # CI: micro-batches through the executor without Ray (tests/test_lora.py)
@pytest.mark.parametrize("schedule", ["layer-major", "per-micro-batch"])
def test_micro_batches_train_as_the_whole_batch(ray_session, trained, lora_model, peft_runs, schedule: str) -> None:
    """Each step's two rows as two micro-batches: the whole batch's losses and, fp32 rounding apart (the gradients are
    summed in another order), its adapters after three steps, judged against PEFT's fp64 run as the whole batch is."""
    hf, model_dir, adapter_dir, adapters = lora_model
    with megatrain.Engine(model_dir, lora=LORA, adapter=adapter_dir, micro_batches=2, schedule=schedule,
                          batch_size=1, seq_len=16, **ENGINE) as engine:
        losses = [engine.step(ids, labels) for ids, labels in lora_batches()]
        params = engine.parameters()
    assert losses == pytest.approx(trained["losses"], rel=1e-6)
    assert max(max_rel(params, trained["params"]).values()) <= REL_TOL
    assert_judged_against_fp64(params, hf, adapters, peft_runs)


@pytest.mark.slow  # CI: the tiled layers' gradients against PEFT without Ray (tests/test_lora_tiled.py)
def test_sequence_tiles_train_as_the_whole_sequence(ray_session, trained, lora_model, peft_runs) -> None:
    """tile_tokens 8 (four tiles of each 16-token row): the untiled run's losses and, fp32 rounding apart, its
    adapters after three steps, judged against PEFT's fp64 run."""
    hf, model_dir, adapter_dir, adapters = lora_model
    with megatrain.Engine(model_dir, lora=LORA, adapter=adapter_dir, tile_tokens=8, **ENGINE) as engine:
        assert engine.engine_config.tile_tokens == 8
        losses = [engine.step(ids, labels) for ids, labels in lora_batches()]
        params = engine.parameters()
    assert losses == pytest.approx(trained["losses"], rel=1e-6)
    assert max(max_rel(params, trained["params"]).values()) <= REL_TOL
    assert_judged_against_fp64(params, hf, adapters, peft_runs)


def train_with_kills(model_dir: Path, batches: list, kill: bool, **settings) -> tuple[list[float], dict]:
    rng = random.Random(0)
    losses = []
    with megatrain.Engine(model_dir, lora=LORA + ",dropout=0.1", **{**ENGINE, "optimizer_workers": 2,
                                                                    "total_steps": 8, **settings}) as engine:
        for step, (ids, labels) in enumerate(batches):
            killer = None
            if kill and step in (1, 4):
                killer = threading.Timer(rng.uniform(0.0, 0.1), os.kill, (rng.choice(worker_pids(engine)),
                                                                          signal.SIGKILL))
                killer.start()
            losses.append(engine.step(ids, labels))
            if killer is not None:
                killer.join()
        assert engine.restarts >= (2 if kill else 0)
        return losses, engine.parameters()


@pytest.mark.slow  # CI: one worker killed once, in the trained fixture's Engine (above)
def test_optimizer_workers_killed_at_random_moments_recover_exactly(ray_session, lora_model) -> None:
    """Two workers, one killed at a random moment of two steps: each is replaced, the arena restored and the steps
    replayed, dropout masks included (drawn from the step's number)."""
    _, model_dir, _, _ = lora_model
    batches = lora_batches(6, rows=4)
    want = train_with_kills(model_dir, batches, kill=False)
    got = train_with_kills(model_dir, batches, kill=True)
    assert got[0] == want[0]
    assert all(torch.equal(got[1][n], t) for n, t in want[1].items())


@pytest.mark.slow
def test_two_executors_train_as_one(ray_session, lora_model) -> None:
    """Data parallel: each executor's adapter gradients summed into the arena's slices, the pool updates them."""
    _, model_dir, adapter_dir, _ = lora_model
    runs = []
    for executors in (1, 2):
        with megatrain.Engine(model_dir, lora=LORA, adapter=adapter_dir, executors=executors,
                              **{**ENGINE, "optimizer_workers": 2}) as engine:
            losses = [engine.step(ids, labels) for ids, labels in lora_batches(3, rows=4)]
            runs.append((losses, engine.parameters()))
    assert runs[1][0] == pytest.approx(runs[0][0], rel=REL_TOL)
    assert max(max_rel(runs[1][1], runs[0][1]).values()) <= REL_TOL


@pytest.mark.slow
def test_finetune_with_lora_and_merge_on_the_command_line(ray_session, tmp_path) -> None:
    """`megatrain finetune --lora ... --merge`: OUT/final holds the adapter (PEFT loads it), OUT/merged the merged
    model (transformers loads it), both with the logits of base + adapter."""
    from transformers import LlamaConfig

    hf = build_hf_model(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    hf.save_pretrained(tmp_path / "model")
    (tmp_path / "data.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "out"
    run = run_cli("finetune", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.txt"), "--out",
                  str(out), "--lora", "r=4,alpha=8,targets=all-linear", "--lora-base-dtype", "fp32", "--merge",
                  "--steps", "3", "--device", "cpu", "--precision", "fp32", "--batch-size", "2", "--seq-len", "32",
                  "--optimizer-workers", "1", "--eval-every", "0", "--checkpoint-every", "0")
    assert run.returncode == 0, run.output
    assert "LoRA adapter written to" in run.output and "merged model written to" in run.output
    assert (out / "final" / "adapter_config.json").is_file() and not (out / "final" / "model.safetensors").exists()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(copy.deepcopy(hf), out / "final").eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()(input_ids=ids).logits
        base = hf(input_ids=ids).logits
    assert rel_err(merged, adapted) <= REL_TOL and not torch.equal(adapted, base)
