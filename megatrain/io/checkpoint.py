"""Checkpoints: HF model directories in and out, and resumable training checkpoints.

Only safetensors and JSON are ever read: no pickles. Tensors are written straight from the arena with a
small safetensors writer (the format is an 8-byte header length, a JSON header, raw little-endian bytes),
so saving a 100 GB model needs no second copy of it in memory.

Every directory is written atomically: into `<dir>.tmp-<pid>`, then renamed over. Training checkpoints
end with a manifest (sizes and CRC32 of every file), written last; a checkpoint whose manifest is missing
or disagrees with the files is refused.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megatrain.config import ConfigError, MegatrainError, ModelConfig
from megatrain.io import mxfp4
from megatrain.io.slot_io import IN_PLACE, SlotIO
from megatrain.model.layout import ModelLayout, NodeShard

SHARD_BYTES = 4 * 2**30
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megatrain-checkpoint-v1"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}
# Buffers some exporters include that are not parameters (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(MegatrainError):
    pass


# ---- safetensors writing ----

def write_safetensors(path: Path, tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None,
                      io: SlotIO = IN_PLACE) -> None:
    items = [(name, t.detach().contiguous().cpu()) for name, t in tensors]
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in io.read_each([t for _, t in items if t.numel()]):  # read where it lives (io), the next ones ahead
            f.write(memoryview(t.view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def _shards(tensors: list[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    return shards


def write_sharded(directory: Path, stem: str, tensors: list[tuple[str, torch.Tensor]],
                  limit: int = SHARD_BYTES, io: SlotIO = IN_PLACE) -> None:
    """HF's layout: `<stem>.safetensors`, or numbered shards plus `<stem>.safetensors.index.json`."""
    shards = _shards(tensors, limit)
    if len(shards) == 1:
        write_safetensors(directory / f"{stem}.safetensors", shards[0], io=io)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / fname, shard, io=io)
        for name, t in shard:
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ---- safetensors reading ----

def weight_files(directory: Path, stem: str) -> list[Path]:
    single, index = directory / f"{stem}.safetensors", directory / f"{stem}.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not all(isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()):
                raise TypeError("shard names must be file names in the directory")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index} is not a valid safetensors index; re-export the checkpoint.") from None
        files = [directory / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{directory} is missing shard(s) {', '.join(missing)} listed in {index.name}; "
                                  "copy the complete checkpoint.")
        return files
    if single.is_file():
        return [single]
    pickles = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
    hint = (f" (found {', '.join(pickles)}: megatrain never loads pickles; convert them to safetensors first)"
            if pickles else "")
    raise CheckpointError(f"no {stem}.safetensors or {stem}.safetensors.index.json in {directory}{hint}.")


def iter_safetensors_lazy(files: list[Path]) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, read) for every tensor of `files`, where read() loads it: what reads a checkpoint can hold on to
    names without holding every tensor in memory."""
    for path in files:
        for name in _tensor_names(path):
            yield name, functools.partial(_read_tensor, path, name)


def check_readable(files: list[Path]) -> None:
    """Each file's header read (its tensors' names, shapes and where their bytes lie, checked against the file's
    size): a truncated or corrupt file is one sentence before a run starts anything, not once its arena is made."""
    for path in files:
        _tensor_names(path)


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _unreadable(path, e) from None


def _read_tensor(path: Path, name: str) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _unreadable(path, e) from None


def _unreadable(path: Path, e: BaseException) -> CheckpointError:
    detail = " ".join(str(e).split())  # the reader may quote the header, line breaks and all
    return CheckpointError(f"{path} is not a readable safetensors file ({detail}); it may be truncated or "
                           "corrupt, so copy it again.")


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, read in iter_safetensors_lazy(files):
        yield name, read()


def load_into(layout: ModelLayout, flat: torch.Tensor, files: list[Path], prefix: str = "", where: str = "",
              tensors: Iterable[tuple[str, torch.Tensor]] | None = None, shard: NodeShard | None = None,
              passthrough: dict[str, torch.Tensor] | None = None, io: SlotIO = IN_PLACE) -> None:
    """Copies tensors named `prefix + hf_name` into their slots of `flat`, checking names and shapes. `tensors`:
    the (name, tensor) pairs to load, if not those of `files` as stored. `shard`: `flat` holds only a node's part of
    each unit, packed (Adam moments on one of several nodes): each tensor's elements in that part are copied.
    `passthrough`: gets the layout's pass-through tensors (a vision tower), as stored; None: there are none to read."""
    slots = layout.slots_by_hf_name()
    names = set(layout.passthrough) if passthrough is not None else set()
    seen: set[str] = set()
    tied = layout.config.tie_embeddings
    tied_head = None
    for name, t in iter_safetensors(files) if tensors is None else tensors:
        if prefix and not name.startswith(prefix):
            continue
        hf_name = name[len(prefix):]
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        if tied and hf_name == "lm_head.weight":
            tied_head = t  # tied checkpoints may carry lm_head too: it must be the embedding
            continue
        if hf_name in names:
            passthrough[hf_name] = t  # type: ignore[index]
            continue
        if hf_name in seen:
            raise CheckpointError(f"{where or files[0].parent} holds tensor {hf_name} more than once, so "
                                  "which copy to load is ambiguous; re-export the checkpoint.")
        if hf_name not in slots:
            raise CheckpointError(f"{where or files[0].parent} has tensor {hf_name!r} that a "
                                  f"{layout.config.model_type} model of this config does not have; "
                                  "check that config.json matches the weights.")
        unit, slot = slots[hf_name]
        if tuple(t.shape) != slot.shape:
            raise CheckpointError(f"{where or files[0].parent}: tensor {hf_name} has shape {tuple(t.shape)} but the "
                                  f"config implies {slot.shape}; check that config.json matches the weights.")
        if not (t.is_floating_point()):
            raise CheckpointError(f"{where or files[0].parent}: tensor {hf_name} has dtype {t.dtype}, "
                                  "not a floating-point type; the file is not a model checkpoint.")
        if shard is None:
            start = unit.offset + slot.offset
            io.fill(flat[start : start + slot.numel].view(slot.shape), lambda dst, t=t: mxfp4.copy_into(dst, t))
        elif (mine := shard.overlap(unit, slot.offset, slot.offset + slot.numel)) is not None:
            part = mxfp4.dense(t).reshape(-1)[mine[0] - slot.offset : mine[1] - slot.offset]
            io.fill(shard.moments(unit, flat, *mine), lambda dst, part=part: dst.copy_(part))
        seen.add(hf_name)
    missing = sorted(set(slots) - seen) + sorted(names - set(passthrough or {}))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{where or files[0].parent} lacks tensor(s) {', '.join(missing[:3])}{more}; "
                              "the checkpoint is incomplete or its config.json describes another model.")
    if tied_head is not None:
        unit, slot = slots["model.embed_tokens.weight"]
        embed = io.read(flat[unit.offset + slot.offset : unit.offset + slot.offset + slot.numel].view(slot.shape))
        if not (tied_head.is_floating_point() and tuple(tied_head.shape) == slot.shape
                and torch.equal(tied_head.to(embed.dtype), embed)):
            # loading would silently drop a separately trained head (transformers keeps the two apart)
            raise CheckpointError(f"{where or files[0].parent}: config.json ties the embeddings "
                                  "(tie_word_embeddings) but lm_head.weight differs from model.embed_tokens.weight; "
                                  "set tie_word_embeddings to false if the head was trained on its own.")


# ---- HF directories ----

def read_hf_config(directory: Path) -> ModelConfig:
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; pass an HF model directory or a preset name.")
    return ModelConfig.from_hf(directory)


def load_hf_weights(directory: Path, layout: ModelLayout, params: torch.Tensor, io: SlotIO = IN_PLACE
                    ) -> dict[str, torch.Tensor]:
    """Loads the HF directory's weights into `params`; returns the pass-through tensors, as stored."""
    files = weight_files(directory, "model")
    tensors = None
    if layout.config.hf_config is not None:  # the generic path: names as the hub stores them, converted as
        from megatrain.model.hf_conversion import checkpoint_tensors  # transformers does

        stored = mxfp4.decoded(directory, iter_safetensors_lazy(files))  # GPT-OSS as published: MXFP4 experts
        tensors = checkpoint_tensors(layout.config.hf_config, stored)
    passthrough: dict[str, torch.Tensor] = {}
    load_into(layout, params, files, where=str(directory), tensors=tensors, passthrough=passthrough, io=io)
    return passthrough


def hf_tensors(layout: ModelLayout, flat: torch.Tensor, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    return [(prefix + name, t) for name, t in layout.hf_views(flat).items()]


def model_tensors(layout: ModelLayout, params: torch.Tensor, passthrough: dict[str, torch.Tensor] | None
                  ) -> list[tuple[str, torch.Tensor]]:
    """What a model's weight files hold: the trained weights and the pass-through tensors (a vision tower)."""
    return hf_tensors(layout, params) + sorted((passthrough or {}).items())


def is_weight_file(name: str, stem: str = "model") -> bool:
    """`<stem>.safetensors`, a numbered shard of it, or its index: what write_sharded(stem) writes."""
    return name.startswith(stem) and (name.endswith(".safetensors") or name == f"{stem}.safetensors.index.json")


def save_hf(directory: Path, layout: ModelLayout, params: torch.Tensor, extra_files: Iterable[Path] = (),
            shard_bytes: int = SHARD_BYTES, passthrough: dict[str, torch.Tensor] | None = None,
            tensors: list[tuple[str, torch.Tensor]] | None = None, io: SlotIO = IN_PLACE) -> Path:
    """Writes an HF directory (config.json, safetensors weights and the pass-through tensors, copies of
    extra_files) atomically. tensors: the weights to write by HF name, where they are not `params` (a LoRA run's
    base with its adapters merged in).

    Into an existing directory as transformers does: what this does not write (a tokenizer, a README) is kept,
    except earlier weight shards, which the new weights replace."""
    with atomic_directory(Path(directory), keep=lambda name: not is_weight_file(name)) as tmp:
        (tmp / "config.json").write_text(json.dumps(layout.config.to_hf(), indent=2))
        generation = {k: v for k, v in (("bos_token_id", layout.config.bos_token_id),
                                         ("eos_token_id", layout.config.eos_token_id)) if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        write_sharded(tmp, "model", tensors or model_tensors(layout, params, passthrough), shard_bytes, io)
        for f in extra_files:
            shutil.copy2(f, tmp / Path(f).name)
    return Path(os.path.abspath(directory))


# ---- Adam moments of a run on several nodes ----
# Each node writes its part of every unit's moments, packed, to optimizer-node{k}-of-{K}.safetensors: tensors
# "exp_avg.{unit}" and "exp_avg_sq.{unit}" and, in the metadata, the part's bounds. A store of any node count reads
# the elements of its own part from whichever files hold them (resharding).
PART_FORMAT = "megatrain-moments-part-v1"
MOMENTS = ("exp_avg", "exp_avg_sq")


def moment_part_name(node: int, nodes: int) -> str:
    return f"optimizer-node{node:03d}-of-{nodes:03d}.safetensors"


def write_moment_part(directory: Path, layout: ModelLayout, shard: NodeShard, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, io: SlotIO = IN_PLACE) -> None:
    tensors = [(f"{name}.{unit.index}", shard.moments(unit, flat, *shard.bounds[unit.index]))
               for name, flat in zip(MOMENTS, (exp_avg, exp_avg_sq), strict=True) for unit in layout.units]
    metadata = {"format": PART_FORMAT, "node": str(shard.node), "nodes": str(shard.nodes),
                "units": str(len(layout.units)), "bounds": json.dumps(shard.bounds)}
    write_safetensors(directory / moment_part_name(shard.node, shard.nodes), tensors, metadata, io)


def moment_parts(directory: Path, layout: ModelLayout) -> list[tuple[Path, list[tuple[int, int]]]]:
    """[(file, per unit [lo, hi))] of a checkpoint written by several nodes, checked to cover every unit exactly
    once; [] for a checkpoint of one node (its moments under HF names)."""
    files = sorted(directory.glob("optimizer-node*-of-*.safetensors"))
    if not files:
        return []
    parts, counts = [], set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            node, nodes = int(meta["node"]), int(meta["nodes"])
            bounds = [tuple(b) for b in json.loads(meta["bounds"])]
            ok = meta.get("format") == PART_FORMAT and path.name == moment_part_name(node, nodes)
        except (SafetensorError, OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is not a readable part of a checkpoint's optimizer state ({e}); copy "
                                  "the checkpoint again.") from None
        if not ok or len(bounds) != len(layout.units):
            raise CheckpointError(f"{path} is not a part of this model's optimizer state (wrong format or unit "
                                  "count); resume with the model the checkpoint was trained with.")
        parts.append((node, path, bounds))
        counts.add(nodes)
    if len(counts) != 1 or sorted(node for node, _, _ in parts) != list(range(next(iter(counts)))):
        raise CheckpointError(f"{directory} holds optimizer parts of {len(files)} node(s) that do not make one "
                              "whole (a part is missing, or parts of different runs were mixed); copy the "
                              "complete checkpoint.")
    parts.sort()  # by node: the parts' bounds in order along every unit
    for unit in layout.units:  # the parts must tile every unit
        edges = [b[unit.index] for _, _, b in parts]
        if edges[0][0] != 0 or edges[-1][1] != unit.numel or any(a[1] != b[0] for a, b in itertools.pairwise(edges)):
            raise CheckpointError(f"the optimizer parts in {directory} do not cover unit {unit.index} exactly; "
                                  "copy the complete checkpoint.")
    return [(path, bounds) for _, path, bounds in parts]


def load_moment_parts(parts: list[tuple[Path, list[tuple[int, int]]]], layout: ModelLayout, shard: NodeShard,
                      moments: dict[str, torch.Tensor], io: SlotIO = IN_PLACE) -> None:
    """Fills this node's part of each moment (name -> its packed flat segment) from the parts that hold it."""
    for path, bounds in parts:
        try:
            with safe_open(str(path), framework="pt") as f:
                for unit in layout.units:
                    src_lo, src_hi = bounds[unit.index]
                    if (mine := shard.overlap(unit, src_lo, src_hi)) is None:
                        continue
                    a, b = mine
                    for name, flat in moments.items():
                        piece = f.get_slice(f"{name}.{unit.index}")[a - src_lo : b - src_lo]
                        io.fill(shard.moments(unit, flat, a, b), lambda dst, piece=piece: dst.copy_(piece))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise _unreadable(path, e) from None


def checkpoint_target(directory: Path) -> Path:
    """`directory`, unless it holds files that are not a megatrain checkpoint (which saving would replace)."""
    if directory.is_dir() and any(directory.iterdir()) and not (directory / MANIFEST).is_file():
        raise CheckpointError(f"{directory} already holds files and is not a megatrain checkpoint, which "
                              "would replace them; save the checkpoint into a new directory.")
    return directory


def check_save_target(path: Path) -> None:
    """A directory can be written atomically (a new one swapped in) unless it is a file or holds the process's
    working directory, which would be left pointing at the deleted old directory."""
    path = Path(os.path.abspath(path))
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a directory; pass a directory path to save into.")
    real, cwd = path.resolve(), Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        raise CheckpointError(f"{path} is the working directory or holds it; save into a subdirectory instead.")


class atomic_directory:
    """`with atomic_directory(path) as tmp:` write into tmp; on success tmp replaces path, else it is removed.

    keep(name): entries of an existing `path` that tmp lacks and keep accepts are carried into the new
    directory (hard links, so no bytes are copied); by default the old directory is replaced whole."""

    def __init__(self, path: Path, keep: Callable[[str], bool] | None = None):
        check_save_target(path)
        self.path, self.keep = Path(os.path.abspath(path)), keep  # "out/.." has no name to put a tmp beside
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.keep is not None and self.path.is_dir():
            for entry in self.path.iterdir():
                if not (self.tmp / entry.name).exists() and self.keep(entry.name):
                    _link_tree(entry, self.tmp / entry.name)
        _fsync_dir(self.tmp)
        old = self.path.with_name(f".{self.path.name}.old-{os.getpid()}")
        if self.path.exists():
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        shutil.rmtree(old, ignore_errors=True)


def _link_tree(src: Path, dst: Path) -> None:
    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:  # another file system, or one without hard links
            shutil.copy2(a, b)

    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=link_or_copy)
    else:
        link_or_copy(str(src), str(dst))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- manifests ----

def file_crc32(path: Path, chunk: int = 64 * 2**20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def write_manifest(directory: Path) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "crc32": file_crc32(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=2))


def verify_manifest(directory: Path) -> None:
    """Raises CheckpointError unless every file the manifest lists is present with its size and CRC."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST}, so it was not completely written; "
                              "resume from an earlier checkpoint.")
    try:
        text = manifest.read_text()
        content = json.loads(text)
        files = content["files"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        files = content = None
    # The manifest guards itself too: exactly what write_manifest writes, byte for byte, or refused.
    if not (isinstance(files, dict) and content == {"format": MANIFEST_FORMAT, "files": files}
            and text == json.dumps(content, indent=2)
            and all(isinstance(meta, dict) and set(meta) == {"bytes", "crc32"}
                    and all(type(v) is int for v in meta.values()) for meta in files.values())):
        raise CheckpointError(f"{manifest} is corrupt; resume from an earlier checkpoint.")
    unlisted = sorted(p.name for p in directory.iterdir() if p.suffix in (".json", ".safetensors")
                      and p.name != MANIFEST and p.name not in files)
    if unlisted:
        raise CheckpointError(f"checkpoint {directory} holds {', '.join(unlisted)}, which its manifest does "
                              "not list, so it was changed after it was written; resume from an earlier "
                              "checkpoint.")
    for name, meta in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} lacks {name}, which its manifest lists; "
                                  "resume from an earlier checkpoint.")
        if path.stat().st_size != meta["bytes"] or file_crc32(path) != meta["crc32"]:
            raise CheckpointError(f"checkpoint file {path} does not match its manifest (size or checksum), so it was "
                                  "truncated or modified; resume from an earlier checkpoint.")


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON ({e}).") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{what} {path} must hold a JSON object.")
    return value


def check_config_matches(directory: Path, config: ModelConfig) -> None:
    saved = ModelConfig.from_hf(directory)
    if saved.to_dict() != config.to_dict():
        diff = [k for k, v in saved.to_dict().items() if config.to_dict().get(k) != v]
        raise ConfigError(f"checkpoint {directory} is of a different model (differs in {', '.join(diff)}); "
                          "resume with the model it was trained with.")
