"""Whether a run's layers and head run through torch.compile (EngineConfig.compile: on, off, auto), and the log's line
saying why; auto is eager on the CPU path and on the generic path, and on CUDA what the calibration measured faster
(docs/design.md#compile-choice).

    choice = compile_choice(engine.compile, engine.device, config, engine.precision)
    Executor(..., compile=choice.on); log.info(choice.why)"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config import ModelConfig, compile_setting
from megatrain.engine.streams import SIMULATED, resolve_device
from megatrain.perf.calibrate import Calibration, CompiledTiming, device_name, layer_key


@dataclass(frozen=True)
class CompileChoice:
    on: bool
    why: str  # one line for the log: compiled or not, and from what


def compile_choice(setting: str | bool, device: str, config: ModelConfig, precision: str) -> CompileChoice:
    """The compile setting resolved on the executor's device (on CUDA, from the cached calibration of its GPU)."""
    setting = compile_setting(setting)
    if setting != "auto":
        word = "compiled" if setting == "on" else "eager"
        return CompileChoice(setting == "on", f"layers {word}: compile = {setting}")
    if SIMULATED.fullmatch(device) or resolve_device(device).type != "cuda":
        return CompileChoice(False, "layers eager: compile = auto runs the CPU path eager (compile = on compiles it)")
    gpu = device_name(str(resolve_device(device)))
    return auto_on_gpu(gpu, Calibration.load(gpu), config, precision)


def auto_on_gpu(gpu: str, cal: Calibration | None, config: ModelConfig, precision: str) -> CompileChoice:
    """compile = auto on the CUDA GPU named `gpu`, whose calibration is `cal` (None: none recorded)."""
    if config.hf_config is not None:
        return CompileChoice(False, "layers eager: compile = auto runs the generic path's layers (transformers' own "
                                    "modules, which one full graph may not hold) eager; compile = on compiles them")
    found = None if cal is None else measured(cal, config, precision)
    if found is None:
        return CompileChoice(True, f"layers compiled: compile = auto, and no calibration of {gpu} timed this model's "
                                   f"layer compiled ({precision}; `megatrain calibrate --model ...` does): on a GPU it "
                                   "paid where measured (a 7B bf16 layer on the H100: 434 TFLOP/s compiled, 311 eager)")
    key, timing = found
    faster = timing.compiled_layer_s < timing.eager_layer_s
    return CompileChoice(faster, f"layers {'compiled' if faster else 'eager'}: compile = auto, from the calibration of "
                                 f"{gpu} ({key.split('|')[1]} tokens, {precision}: a layer "
                                 f"{1e3 * timing.compiled_layer_s:.1f} ms compiled, {1e3 * timing.eager_layer_s:.1f} "
                                 "ms eager)")


def measured(cal: Calibration, config: ModelConfig, precision: str) -> tuple[str, CompiledTiming] | None:
    """The calibration's eager-vs-compiled timing of this model's layer shape at this precision: of the micro-batch
    with the most tokens, where it timed several (key, timing); None where it timed none."""
    shape = layer_key(config, 1, 1, precision).split("|")[0]
    found = []
    for key, timing in cal.compiled.items():
        key_shape, micro_batch, key_precision = key.split("|")
        if key_shape == shape and key_precision == precision:
            rows, seq = (int(n) for n in micro_batch.split("x"))
            found.append((rows * seq, key, timing))
    return max(found)[1:] if found else None
