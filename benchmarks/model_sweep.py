"""The model-type sweep: every causal-LM model type of the installed transformers, trained by megatrain or not.

For each model type: transformers' default config, shrunk by megatrain.model.tiny_config (same options, tiny widths,
at least one layer of every structure); the HF model built from it in fp32 with a fixed seed (eager attention where
the model has it), every parameter moved off its init value, saved with save_pretrained; then loaded as
megatrain.from_pretrained(dir, device="cpu") loads it, less the self-check (which would refuse what differs: the
sweep classifies megatrain's path itself), and the loss and every gradient of one random batch compared with
transformers' own (megatrain/self_check.py: the comparison the self-check makes). Each type is classified:

  exact        loss and every gradient within 1e-5 relative (max |ours - theirs| / max |theirs| per tensor)
  wrong        megatrain trains it and the numbers differ: the largest error and its tensor
  crash        megatrain raised something that is no MegatrainError: the exception and where
  refused      megatrain's one-sentence MegatrainError (ConfigError)
  unbuildable  the tiny HF model cannot be made, or transformers' own forward fails on a text batch: why

Types run in a worker process (one at a time, 1 torch thread), each under a timeout: a hang or a dead process
costs one row (crash), and the sweep goes on in a new worker. The table goes to docs/model_types.md and
docs/model_types.json.

    python benchmarks/model_sweep.py                      # every type; writes docs/model_types.{md,json}
    python benchmarks/model_sweep.py --types llama,gpt2   # some; prints the table, writes nothing unless --out
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository's packages by name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, pythonpath_with_repo
from megatrain.self_check import (
    REL_TOL,
    WITHIN_ROUNDING,
    NoReference,
    Reference,
    compare,
    first_line,
    fp64_verdict,
    reference,
    verify,
)

OUTCOMES = ("exact", "wrong", "crash", "refused", "unbuildable")
# Qwen4-Exp's indexer sizes are all None (budget // ratio fails); its head must hold the rotary dimensions
QWEN4_INDEXER = {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 256, "indexer_budget": 64,
                 "indexer_compress_ratio": 4}
# where transformers' default config of a type cannot run at all, the least change that lets it (the row says so)
DEFAULT_FIXES: dict[str, dict[str, Any]] = {
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # rope_theta is read by the attention and no field of its config; clip_qkv None fails torch.clamp
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "deepseek_v2": {"num_experts_per_tok": 6},  # None: topk(k=None)
    # the experts read num_local_experts (the config has n_routed_experts); top-k and shared experts None
    "dots1": {"num_local_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["conv", "conv", "full_attention", "conv"] * 8},  # None: no layer types at all
    "qwen4_exp": {"text_config": QWEN4_INDEXER},
    "qwen4_exp_text": QWEN4_INDEXER,
    "reformer": {"is_decoder": True},  # its causal LM asserts it
}
DOCS_MD, DOCS_JSON = REPO / "docs" / "model_types.md", REPO / "docs" / "model_types.json"


@dataclass
class Result:
    model_type: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    layers: int | None = None  # of the tiny model
    params: int | None = None  # of the tiny model
    max_rel_err: float | None = None  # over the loss and every gradient, where both ran


def where(e: BaseException) -> str:
    """Where the exception was raised, and the innermost frame of megatrain it passed through if that is another:
    file:line in function."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "?"

    def shown(f: traceback.FrameSummary) -> str:
        path = Path(f.filename)
        name = path.relative_to(REPO) if path.is_relative_to(REPO) else Path(*path.parts[-3:])
        return f"{name}:{f.lineno} in {f.name}"

    ours = [f for f in frames if f"{os.sep}megatrain{os.sep}" in f.filename]
    if not ours or ours[-1] is frames[-1]:
        return shown(frames[-1])
    return f"{shown(frames[-1])}, from {shown(ours[-1])}"


def hf_side(tiny: Any, directory: Path) -> Reference:
    """transformers' side of the comparison (megatrain/self_check.py: reference), the model saved to `directory` and
    loaded back by transformers; NoReference where any of that fails."""
    import torch

    try:
        ref = reference(tiny)
    except NoReference as e:  # where its forward failed
        raise NoReference(f"{e} ({where(e.__cause__)})" if e.__cause__ is not None else str(e)) from None
    try:
        ref.model.save_pretrained(directory)
        type(ref.model).from_pretrained(directory, dtype=torch.float32)
    except Exception as e:
        raise NoReference(f"transformers cannot load its own save_pretrained: {first_line(e)} ({where(e)})") from None
    return ref


def config_refusal(config: Any, directory: Path) -> str | None:
    """megatrain's refusal of the config.json of `config` alone (None: it reads it)."""
    import megatrain

    config.save_pretrained(directory)
    try:
        megatrain.ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    except megatrain.MegatrainError as e:
        return str(e)
    except Exception as e:
        return f"(crashes) {first_line(e)} ({where(e)})"
    return None


def check_model_type(model_type: str, workdir: Path) -> Result:
    """One model type through the whole comparison (see the module docstring); where DEFAULT_FIXES changes the
    default config, the detail says so first."""
    result = _check(model_type, workdir)
    fix = DEFAULT_FIXES.get(model_type)
    if fix:
        result.detail = f"(default config with {', '.join(sorted(fix))} set) {result.detail}".rstrip()
    return result


def _check(model_type: str, workdir: Path) -> Result:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import megatrain
    from megatrain.api import Model
    from megatrain.model.tiny_config import text_config, tiny_config
    from megatrain.self_check import DROPOUT_SEED
    from megatrain.store import ParameterStore

    try:
        base = AutoConfig.for_model(model_type, **DEFAULT_FIXES.get(model_type, {}))
    except Exception as e:
        return Result(model_type, "unbuildable", f"transformers' default config fails: {first_line(e)}")
    directory = workdir / model_type
    tiny, problem = None, None
    try:
        tiny = tiny_config(base)
        ref = hf_side(tiny, directory)
    except NoReference as e:
        problem = str(e)
    except Exception as e:
        problem = f"{'tiny config' if tiny is None else 'tiny model'}: {first_line(e)} ({where(e)})"
    if problem is not None:
        try:  # the plainer reason, where it is the one
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(base)
        except Exception as e:
            problem = f"transformers cannot build its own default config: {first_line(e)} ({where(e)})"
        refusal = config_refusal(tiny or base, directory / "config-only")
        return Result(model_type, "unbuildable", problem + (f" [megatrain: {refusal}]" if refusal else ""))
    layers = getattr(text_config(tiny), "num_hidden_layers", None)
    shape = dict(layers=layers if isinstance(layers, int) else None,
                 params=sum(p.numel() for p in ref.model.parameters()))
    try:  # megatrain's path as it is, without the self-check (which would refuse what differs)
        with Model(ParameterStore(directory, verify=False), device="cpu") as model:
            torch.manual_seed(DROPOUT_SEED)  # the same dropout masks as transformers' run
            loss, grads = model.loss_and_grads(ref.input_ids, ref.labels)
            ours = (loss, {n: g.clone() for n, g in grads.items()})
    except megatrain.MegatrainError as e:
        return Result(model_type, "refused", str(e).replace(str(directory), "<dir>"), **shape)
    except Exception as e:
        return Result(model_type, "crash", f"{first_line(e)} ({where(e)})", **shape)
    error, worst = compare(ours, ref.result)
    if error <= REL_TOL:
        return Result(model_type, "exact", "", max_rel_err=error, **shape)
    verdict = fp64_verdict(ref, ours) if error < float("inf") else ""
    measured = f"max rel err {error:.2g} at {worst}" + (f"; {verdict}" if verdict else "")
    if verdict.startswith(WITHIN_ROUNDING):  # rule 3: judged against fp64, as transformers' own fp32 is
        return Result(model_type, "exact", measured, max_rel_err=error, **shape)
    try:  # what a user meets: the self-check refuses the model before anything is allocated
        verify(megatrain.ModelConfig.from_hf(directory))
    except megatrain.MegatrainError as e:
        return Result(model_type, "refused", f"self-check: {first_line(e)} [{measured}]", max_rel_err=error, **shape)
    return Result(model_type, "wrong", measured, max_rel_err=error, **shape)


# ---- the worker: model types one after another, each result a JSON line ----

def run_worker(model_types: list[str], result_file: Path) -> None:
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with open(result_file, "a") as out, tempfile.TemporaryDirectory(prefix="mtsweep-") as scratch:
        for model_type in model_types:
            out.write(json.dumps({"start": model_type}) + "\n")
            out.flush()
            start = time.monotonic()
            try:
                result = check_model_type(model_type, Path(scratch))
            except Exception as e:  # the harness itself: reported, never silent
                result = Result(model_type, "crash", f"sweep harness: {first_line(e)} ({where(e)})")
            result.seconds = round(time.monotonic() - start, 1)
            out.write(json.dumps({"result": asdict(result)}) + "\n")
            out.flush()


# ---- the parent: workers under a per-type timeout ----

def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep(model_types: list[str], timeout: float, log_dir: Path, progress: bool = True) -> list[Result]:
    """Every type in a worker process; a type that hangs past `timeout` seconds or kills its worker is a crash, and
    a new worker goes on with the rest."""
    from megatrain.memory.arena import remove_stale_segments

    results: dict[str, Result] = {}
    todo = list(model_types)
    env = {**os.environ, "PYTHONPATH": pythonpath_with_repo(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    log_dir.mkdir(parents=True, exist_ok=True)
    while todo:
        result_file = log_dir / f"worker-{len(results)}.jsonl"
        result_file.write_text("")
        with open(log_dir / f"worker-{len(results)}.log", "w") as log:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--result-file",
                                     str(result_file), *todo], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=REPO, start_new_session=True)
        current, started, seen = None, time.monotonic(), 0
        while True:
            lines = result_file.read_text().splitlines()
            for line in lines[seen:]:
                if not line.endswith("}"):
                    break  # half written: read again next time
                seen += 1
                event = json.loads(line)
                if "start" in event:
                    current, started = event["start"], time.monotonic()
                else:
                    result = Result(**event["result"])
                    results[result.model_type] = result
                    todo.remove(result.model_type)
                    current = None
                    if progress:
                        print(f"[{len(results)}/{len(model_types)}] {result.model_type}: {result.outcome} "
                              f"({result.seconds:.0f}s) {result.detail[:150]}", flush=True)
            if proc.poll() is not None and seen == len(result_file.read_text().splitlines()):
                break
            if current is not None and time.monotonic() - started > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.2)
        code = proc.wait()
        remove_stale_segments()  # a worker killed before its store unlinked the arena
        if current is not None:  # it hung, or its process died under it
            cause = f"timed out after {timeout:.0f}s" if code == -signal.SIGKILL else f"the process died (exit {code})"
            results[current] = Result(current, "crash", cause, seconds=round(time.monotonic() - started, 1))
            todo.remove(current)
            if progress:
                print(f"[{len(results)}/{len(model_types)}] {current}: crash: {cause}", flush=True)
        elif todo and code != 0:
            raise RuntimeError(f"the sweep's worker failed before any model type (exit {code}); see {log_dir}")
    return [results[t] for t in model_types]


# ---- the table ----

def summary(results: list[Result]) -> dict[str, int]:
    return {outcome: sum(r.outcome == outcome for r in results) for outcome in OUTCOMES}


def not_decoder_only(model_type: str) -> bool:
    """An encoder or an encoder-decoder model that transformers registers as a causal LM (BERT, BART, Whisper)."""
    from megatrain.model.hf_config import encoder_decoder_types, encoder_types

    return model_type in encoder_types() | encoder_decoder_types()


def decoder_only_share(results: list[Result]) -> tuple[int, int]:
    """(exact, all) among the decoder-only types."""
    decoders = [r for r in results if not not_decoder_only(r.model_type)]
    return sum(r.outcome == "exact" for r in decoders), len(decoders)


def counts_line(results: list[Result]) -> str:
    exact, decoders = decoder_only_share(results)
    counts = ", ".join(f"{n} {outcome}" for outcome, n in summary(results).items())
    return (f"{counts}; of the {decoders} decoder-only types (the others are encoders or encoder-decoder models "
            f"registered as causal LMs), {exact} exact ({100 * exact / max(decoders, 1):.1f}%)")


def markdown(results: list[Result], transformers_version: str) -> str:
    counts = counts_line(results)
    lines = [
        "# Causal-LM model types of transformers and megatrain",
        "",
        f"Written by `python benchmarks/model_sweep.py` on transformers {transformers_version}: for every causal-LM "
        "model type, a tiny random model of transformers' default config (`megatrain/model/tiny_config.py`), its "
        "loss and every gradient from `megatrain.from_pretrained(dir, device=\"cpu\")` against transformers' own "
        f"(fp32, exact = within {REL_TOL:g} relative). {len(results)} types: {counts}.",
        "",
        "| model_type | outcome | detail |",
        "|---|---|---|",
    ]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.model_type} | {r.outcome} | {detail} |")
    return "\n".join(lines) + "\n"


def write_table(results: list[Result], md_path: Path, json_path: Path) -> None:
    import transformers

    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(results, transformers.__version__))
    json_path.write_text(json.dumps({"transformers": transformers.__version__, "summary": summary(results),
                                     "results": [asdict(r) for r in results]}, indent=1) + "\n")


def read_table(json_path: Path = DOCS_JSON) -> tuple[str, list[Result]]:
    data = json.loads(json_path.read_text())
    return data["transformers"], [Result(**r) for r in data["results"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one model type may take")
    parser.add_argument("--out", help="directory for model_types.md and model_types.json (default: docs/ when "
                                      "every type runs, nowhere otherwise)")
    parser.add_argument("--log-dir", help="the workers' logs (default: a temporary directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("model_types", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.model_types, Path(args.result_file))
        return 0
    model_types = args.types.split(",") if args.types else causal_lm_types()
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="mtsweep-logs-"))
    start = time.monotonic()
    results = sweep(model_types, args.timeout, log_dir)
    counts = counts_line(results)
    print(f"\n{len(results)} model types in {time.monotonic() - start:.0f}s: {counts} (logs: {log_dir})")
    out = Path(args.out) if args.out else (DOCS_MD.parent if not args.types else None)
    if out is not None:
        write_table(results, out / DOCS_MD.name, out / DOCS_JSON.name)
        print(f"wrote {out / DOCS_MD.name} and {out / DOCS_JSON.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
