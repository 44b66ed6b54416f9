"""Models named as the Hugging Face Hub names them (`org/name`, `org/name@revision`), read from a hub cache built
offline as huggingface_hub lays it (tests/hub_cache.py) with HF_HUB_OFFLINE=1: `megatrain plan` (config.json alone),
`train`, `finetune` (with `--lora` and nothing else: the default adapters), `Engine` (what train and finetune run) and
`from_pretrained`; a name that does not resolve is one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_cli
from hub_cache import cache_directory, cache_repo, offline_hub  # noqa: F401 (a fixture)
from test_finetune import make_chats, save_model, save_tokenizer

import megatrain
from megatrain.config import ConfigError, is_hub_name
from megatrain.lora.config import LoraConfig
from megatrain.store import resolve_model

REPO = "tiny-org/tiny-qwen2"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    vocab = save_tokenizer(directory, make_chats(300))
    save_model(directory, 64 * -(-vocab // 64))
    return directory


@pytest.fixture
def hub(offline_hub, model_dir) -> dict[str, str]:  # noqa: F811
    """The tiny model as REPO's main, and its config alone as the revision "config-only"."""
    main = cache_directory(offline_hub, REPO, model_dir)
    config_only = cache_repo(offline_hub, "tiny-org/config-only", {"config.json": model_dir / "config.json"})
    return {"main": main, "config_only": config_only}


def test_hub_names_are_told_from_paths_and_presets(tmp_path):
    assert is_hub_name("Qwen/Qwen2.5-7B") and is_hub_name("org/name@v1.0") and is_hub_name("org/name@a1b2c3")
    assert not is_hub_name("tiny") and not is_hub_name("runs/x/final") and not is_hub_name("./org/name")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_name(str(tmp_path / "org" / "name"))


def test_resolve_reads_the_cache_offline(hub, model_dir):
    config, directory, name = resolve_model(REPO, verify=False)
    assert name == REPO and directory.parent.name == "snapshots" and directory.name == hub["main"]
    assert config == resolve_model(model_dir, verify=False)[0]
    assert resolve_model(f"{REPO}@{hub['main']}", verify=False)[1] == directory  # a commit as the revision
    # a plan reads config.json alone: a repository holding nothing else resolves for it
    assert resolve_model("tiny-org/config-only", verify=False)[0].hidden_size == 64


@pytest.mark.parametrize("name, said", [
    ("tiny-org/missing", "is not in the Hugging Face cache and the Hub cannot be reached"),
    (f"{REPO}@v9", "is not in the Hugging Face cache and the Hub cannot be reached"),
])
def test_a_name_that_does_not_resolve_is_one_sentence(hub, name, said):
    with pytest.raises(ConfigError) as e:
        resolve_model(name)
    message = str(e.value)
    assert said in message and message.count(". ") == 0 and message.endswith("."), message
    out = run_cli("plan", "--model", name, "--device", "cpu")
    assert out.returncode == 2 and said in out.output and len(out.output.strip().splitlines()) == 1, out.output
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        megatrain.from_pretrained(name)


def test_errors_from_the_hub_are_one_sentence():
    from huggingface_hub import errors
    from huggingface_hub.errors import HfHubHTTPError

    from megatrain.io.hub import unresolved

    class Response:  # what the hub's HTTP errors carry
        status_code, headers, url, request = 401, {}, "https://huggingface.co/api/models/x/y", None

    for kind, said in ((errors.GatedRepoError, "is gated"), (errors.RepositoryNotFoundError, "is not on the Hugging"),
                       (errors.RevisionNotFoundError, "no such revision")):
        error = kind.__new__(kind)
        HfHubHTTPError.__init__(error, "401", response=Response())
        assert said in unresolved("x/y", error)


def test_plan_takes_a_hub_name(hub):
    for name in ("tiny-org/config-only", f"{REPO}@{hub['main']}"):
        out = run_cli("plan", "--model", name, "--device", "cpu", "--batch", "2", "--seq", "64")
        assert out.returncode == 0 and "host" in out.output, out.output


def test_from_pretrained_takes_a_hub_name_and_keeps_the_tokenizer(hub, model_dir, tmp_path):
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with megatrain.from_pretrained(model_dir) as local:
        want, _ = local.loss_and_grads(ids)
    with megatrain.from_pretrained(f"{REPO}@main") as m:
        got, grads = m.loss_and_grads(ids)
        assert got == want and grads
        out = m.save_pretrained(tmp_path / "saved")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file(), name


def test_train_and_finetune_with_lora_alone_take_a_hub_name(ray_session, hub, offline_hub, tmp_path):  # noqa: F811
    """`megatrain train` on a Hub data set by name and `megatrain finetune --lora` (no settings: r 16, alpha 32,
    all-linear) on a save_to_disk directory run on the cached model by name; the adapter loads with peft beside the
    base from the same cache. (tests/test_datasets.py: the data sets' rows as the loader reads them.)"""
    import datasets

    texts = tmp_path / "texts"
    (texts / "data").mkdir(parents=True)
    datasets.Dataset.from_list([{"text": f"document {i}"} for i in range(20)]).to_parquet(
        str(texts / "data" / "train-00000-of-00001.parquet"))
    cache_directory(offline_hub, "org/texts", texts, kind="dataset")
    chats = tmp_path / "chats"
    datasets.Dataset.from_list([{"messages": c} for c in make_chats(40)]).save_to_disk(str(chats))
    common = ["--device", "cpu", "--precision", "fp32", "--batch-size", "2", "--seq-len", "32", "--steps", "2",
              "--optimizer-workers", "1", "--log-every", "1"]
    out = run_cli("train", "--model", REPO, "--data", "org/texts", "--out", str(tmp_path / "train"), "--tokenizer",
                  "byte", *common)
    assert out.returncode == 0 and "trained 2 steps" in out.output, out.output
    assert (tmp_path / "train" / "final" / "tokenizer.json").is_file()  # the model's tokenizer kept beside it

    out = run_cli("finetune", "--model", REPO, "--data", str(chats), "--out", str(tmp_path / "sft"), "--lora",
                  "--eval-every", "0", "--checkpoint-every", "0", *common)
    assert out.returncode == 0, out.output
    assert "r, alpha, targets not given" in out.output and "rank 16, alpha 32" in out.output, out.output
    final = tmp_path / "sft" / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32
    assert set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"}
    assert (final / "tokenizer.json").is_file()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(resolve_model(REPO)[1])
    PeftModel.from_pretrained(base, final)  # loads: names and shapes as peft writes them


def test_lora_defaults():
    assert LoraConfig.parse("defaults") == LoraConfig(16, 32.0, ("all-linear",))
    assert LoraConfig.parse("defaults").defaulted == ("r", "alpha", "targets")
    assert LoraConfig.parse("r=8") == LoraConfig(8, 16.0, ("all-linear",))  # alpha twice the r given
    assert LoraConfig.from_dict({"alpha": 8, "targets": "q_proj"}) == LoraConfig(16, 8.0, ("q_proj",))
