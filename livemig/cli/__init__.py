"""`livemig` command line: one module per command (run, status, inject, migrate, stop and drain, etcd),
the benchmarks' table, and `main`, the entry point. A command's module is imported only
to build its parser, so `livemig bench --help` never imports torch."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable, Sequence

from livemig import logs
from livemig.config import make_interruptible
from livemig.errors import LivemigError
from livemig.rdzv.security import apply_arguments as apply_security_arguments

# name, help, module under livemig/bench, argument adder, runner
BENCHES = [
    ("etcd", "latency of put, generation CAS commit, watch delivery", "etcd_bench", "add_arguments", "run"),
    ("transfer", "state transfer throughput next to the raw zmq link", "transfer_bench", "add_arguments", "run"),
    ("downtime", "downtime next to checkpoint-restart, plain DDP, fault-free", "by_sharding",
     "add_downtime_arguments", "run_downtime"),
    ("overhead", "steady-state step time of livemig vs plain DDP", "by_sharding", "add_overhead_arguments",
     "run_overhead"),
    ("checkpoint", "step-time cost of background checkpoints next to DDP + torch.save", "checkpoint_bench",
     "add_arguments", "run"),
    ("scale", "coordinator recovery time with N simulated members on real etcd", "scale_bench", "add_arguments",
     "run"),
    ("footprint", "the job's keys and bytes in etcd after many steps and recoveries", "footprint_bench",
     "add_arguments", "run"),
    ("faults", "the reliability matrix: one row per fault case", "faults_bench", "add_arguments", "run_matrix"),
    ("startup", "launch to first step and last step to exit, next to torchrun", "startup_bench", "add_arguments",
     "run"),
    ("warmup", "activation of a warm spare next to a cold process started at the failure", "warmup_bench",
     "add_arguments", "run_warmup"),
    ("comm", "the two communicators (LIVEMIG_COMM swap, reconfigure) forming generations and in a kill",
     "comm_bench", "add_arguments", "run_comm"),
]  # fmt: skip


def build_parser(with_benches: bool | str = True) -> argparse.ArgumentParser:
    """with_benches: True imports every bench's arguments, a name only that bench's, False
    none (each costs `import torch`: `livemig bench --help` must answer at once)."""
    p = argparse.ArgumentParser(
        prog="livemig",
        description="Live-migration recovery with hot spares for PyTorch training.",
    )
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default; or $LIVEMIG_LOG_LEVEL)")
    sub = p.add_subparsers(dest="command", required=True)

    from livemig.cli.status import add_parser as add_status

    add_status(sub)

    b = sub.add_parser("bench", help="benchmarks: figures measured side by side in one run")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, help_text, module, add, run in BENCHES:
        bp = bsub.add_parser(name, help=help_text)
        if with_benches is True or with_benches == name:  # importing one costs `import torch`
            mod = importlib.import_module(f"livemig.bench.{module}")
            getattr(mod, add)(bp)
            bp.set_defaults(fn=getattr(mod, run))

    for register in _EXTRA_COMMANDS:
        register(sub)
    for name, sp in sub.choices.items():  # `livemig run --log-level INFO` as well as `livemig --log-level INFO run`
        if name != "bench":
            sp.add_argument("--log-level", dest="command_log_level", default=None, help=argparse.SUPPRESS)
    return p


def _run_parser(sub: argparse._SubParsersAction) -> None:
    from livemig.cli.run import add_parser

    add_parser(sub)


def _inject_parser(sub: argparse._SubParsersAction) -> None:
    from livemig.cli.inject import add_parser

    add_parser(sub)


def _migrate_parser(sub: argparse._SubParsersAction) -> None:
    from livemig.cli.migrate import add_parser

    add_parser(sub)


def _stop_parsers(sub: argparse._SubParsersAction) -> None:
    from livemig.cli.stop import add_parsers

    add_parsers(sub)


def _etcd_parser(sub: argparse._SubParsersAction) -> None:
    from livemig.cli.etcd import add_parser

    add_parser(sub)


def _report_parser(sub: argparse._SubParsersAction) -> None:
    from livemig.cli.show_report import add_parser

    add_parser(sub)


# Commands defined in other modules (keeps this file small).
_EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_run_parser, _inject_parser, _migrate_parser,
                                                                       _stop_parsers, _etcd_parser,
                                                                       _report_parser]  # fmt: skip


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt()


def main(argv: Sequence[str] | None = None) -> int:
    make_interruptible()  # Ctrl-C / kill -INT stop it, even started as a background job
    args = list(sys.argv[1:] if argv is None else argv)
    named = args[args.index("bench") + 1 :] if "bench" in args else []
    parser = build_parser(with_benches=next((x for x in named if x in {b[0] for b in BENCHES}), False))
    a = parser.parse_args(args)
    logs.setup(getattr(a, "command_log_level", None) or a.log_level, role="cli")
    if a.command == "bench":  # SIGTERM as Ctrl-C: the finally blocks stop the baselines it started (torchrun)
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        apply_security_arguments(a)  # flags -> environment: every process started from here inherits them
        return int(a.fn(a) or 0)
    except LivemigError as exc:
        print(f"livemig: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("livemig: interrupted", file=sys.stderr)
        return 130
