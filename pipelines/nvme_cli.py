"""The NVMe tier on the command line: `train`/`finetune`/`plan --nvme PATH --nvme-states ...`, `plan --nvme-gbps
READ,WRITE`, `calibrate --nvme PATH [--nvme-gib N]`, `doctor --nvme PATH`, `cleanup --nvme PATH`. add_nvme_flags puts
the flags on the commands' parsers and wraps the commands that do something of their own with them."""

from __future__ import annotations

import argparse
from typing import Any

from megatrain.config import ConfigError

NVME_HELP = "a directory on a local disk for the NVMe tier of the optimizer states (megatrain/memory/nvme.py)"
STATES_HELP = ("what lives on NVMe: auto (what the host needs, none where all fits) | all | a comma-separated list of "
               "master, moments, grads (a run places moments today; plan places any)")


def add_nvme_flags(sub: Any) -> None:
    """The flags on the parsers of `sub` (the CLI's subparsers), and calibrate and cleanup wrapped."""
    parsers = sub.choices
    for name in ("train", "finetune", "plan"):
        parsers[name].add_argument("--nvme", metavar="PATH", help=NVME_HELP)
        parsers[name].add_argument("--nvme-states", help=STATES_HELP)
    parsers["plan"].add_argument("--nvme-gbps", metavar="READ,WRITE", help="the NVMe disk's sequential GB/s "
                                 "(another machine's; default: what `megatrain calibrate --nvme` cached for --nvme)")
    parsers["doctor"].add_argument("--nvme", metavar="PATH", help="also check this directory for the NVMe tier: "
                                   "filesystem, direct I/O, alignment, free space, speed")
    calibrate = parsers["calibrate"]
    calibrate.add_argument("--nvme", metavar="PATH", help="measure only this directory's sequential direct I/O GB/s "
                           "for the NVMe tier (cached for `megatrain plan --nvme`)")
    calibrate.add_argument("--nvme-gib", type=float, default=4.0, help="the --nvme test file's size (default 4 GiB)")
    calibrate.set_defaults(func=_or_nvme(calibrate.get_default("func"), calibrate_nvme))
    cleanup = parsers["cleanup"]
    cleanup.add_argument("--nvme", metavar="PATH", help="also remove the NVMe tier's state directories under PATH")
    cleanup.set_defaults(func=_and_nvme(cleanup.get_default("func"), cleanup_nvme))


def _or_nvme(command: Any, nvme_command: Any) -> Any:
    return lambda args: nvme_command(args) if args.nvme else command(args)


def _and_nvme(command: Any, nvme_command: Any) -> Any:
    def both(args: argparse.Namespace) -> int:
        rc = command(args)
        return nvme_command(args) if args.nvme else rc
    return both


def calibrate_nvme(args: argparse.Namespace) -> int:
    from megatrain.perf.disk_rates import cache_path, calibrate_disk

    if not args.nvme_gib > 0:
        raise ConfigError(f"--nvme-gib must be a positive size, got {args.nvme_gib}.")
    entry = calibrate_disk(args.nvme, int(args.nvme_gib * 2**30))
    print(f"calibrated {args.nvme}: direct I/O read {entry['read_gbps']:.2f} GB/s, write {entry['write_gbps']:.2f} "
          f"GB/s ({args.nvme_gib:g} GiB, {entry['threads']} threads) -> {cache_path()}")
    return 0


def cleanup_nvme(args: argparse.Namespace) -> int:
    from megatrain.memory.nvme import list_state_dirs, remove_stale_state_dirs

    removed = remove_stale_state_dirs(args.nvme, everything=args.all)
    for path in removed:
        print(f"removed {path}")
    left = list_state_dirs(args.nvme)
    print(f"removed {len(removed)} NVMe state director{'y' if len(removed) == 1 else 'ies'}; {len(left)} belong to "
          "running processes" + (" (use --all to remove them too)" if left else ""))
    return 0


def nvme_rates(args: argparse.Namespace) -> tuple[float, float] | None:
    """--nvme-gbps READ,WRITE, else what `megatrain calibrate --nvme` cached for --nvme."""
    from megatrain.perf.disk_rates import disk_rates

    if getattr(args, "nvme_gbps", None):
        try:
            read, write = (float(x) for x in args.nvme_gbps.split(","))
        except ValueError:
            raise ConfigError(f"--nvme-gbps takes READ,WRITE in GB/s, got {args.nvme_gbps!r}.") from None
        if not (read > 0 and write > 0):
            raise ConfigError(f"--nvme-gbps must be positive GB/s, got {args.nvme_gbps!r}.")
        return read, write
    return disk_rates(args.nvme)
