"""Command line: `grpo-megatron <command> CONFIG [section.key=value ...]`, and `grpo-megatron convert ...`.

Importing this module and `--help` import neither torch nor megatron-core (each handler imports what
it needs), so the CLI answers instantly. A new subcommand is one `Command` entry in COMMANDS.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_megatron import __version__

if TYPE_CHECKING:
    from grpo_megatron.config import JobConfig

# Exit code for a bad config or command line (argparse uses the same).
EXIT_USAGE = 2
# Exit code for a job that failed after it started (one line on stderr; --debug for the traceback).
EXIT_FAILURE = 1
RANK0_GRACE_S = 5.0
PREFLIGHT_COMMANDS = ("check", "train", "sft")


@dataclass(frozen=True)
class Command:
    """One subcommand: most run on a job config; a few (convert) take only their own arguments."""

    name: str
    """Subcommand name, e.g. "check"."""
    help: str
    """One line for `grpo-megatron --help`."""
    run: Callable[..., int]
    """Handler: receives the loaded and validated config and the parsed arguments (only the arguments
    when `takes_config` is false); returns the exit code. Heavy imports go inside it."""
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    """Extra arguments beyond CONFIG and the overrides."""
    takes_config: bool = True
    """False: no CONFIG and no overrides (e.g. convert, which works on model directories)."""


def _world_size_from_env() -> int:
    # torchrun and our srun launcher export WORLD_SIZE; a plain `python -m` run is one process.
    return int(os.environ.get("WORLD_SIZE", "1"))


def _add_world_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of ranks to validate the layout for (default: $WORLD_SIZE, else 1)",
    )


def _run_check(cfg: JobConfig, args: argparse.Namespace) -> int:
    from grpo_megatron.rewards.pool import RewardStartupError, check_reward_imports

    print(f"# resolved config for world size {args.world_size}")
    print(cfg.resolve(args.world_size).to_yaml(), end="")
    try:  # in a throwaway sandboxed worker, as training will: never imports user code here
        check_reward_imports(cfg.reward, log=None)
    except RewardStartupError as e:
        print(f"grpo-megatron: error: {args.config}: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _run_sanity(cfg: JobConfig, args: argparse.Namespace) -> int:
    from grpo_megatron.training.sanity import main as sanity_main

    return sanity_main(cfg)


def _run_train(cfg: JobConfig, args: argparse.Namespace) -> int:
    from grpo_megatron.training.grpo import main as train_main

    return train_main(cfg)


def _run_sft(cfg: JobConfig, args: argparse.Namespace) -> int:
    from grpo_megatron.training.sft import main as sft_main

    return sft_main(cfg)


def _add_verify_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="largest allowed logit/logprob difference (default 1e-4, for fp32)",
    )


def _run_verify(cfg: JobConfig, args: argparse.Namespace) -> int:
    from grpo_megatron.commands.verify import main as verify_main

    return verify_main(cfg, args.tol)


def _add_plan_args(parser: argparse.ArgumentParser) -> None:
    from grpo_megatron.planner.command import add_arguments

    add_arguments(parser)


def _run_plan(cfg: JobConfig, args: argparse.Namespace) -> int:
    from grpo_megatron.planner.command import run

    return run(cfg, args)


def _add_convert_args(parser: argparse.ArgumentParser) -> None:
    from grpo_megatron.commands.convert import add_arguments  # standard library only at import

    add_arguments(parser)


def _run_convert(args: argparse.Namespace) -> int:
    from grpo_megatron.commands.convert import main as convert_main

    return convert_main(args)


COMMANDS: tuple[Command, ...] = (
    Command(
        "check",
        "validate a config, its data/model paths and output directories, import the rewards in a sandboxed "
        "worker; print it resolved for the world size",
        _run_check,
        _add_world_size,
    ),
    Command("sanity", "build the policy at the configured layout and run a few training steps", _run_sanity),
    Command(
        "train", "GRPO: rollout, rewards, advantages, policy updates, weight sync, checkpoints", _run_train
    ),
    Command(
        "sft", "supervised cold start on prompt/response pairs; writes a Hugging Face checkpoint", _run_sft
    ),
    Command(
        "verify",
        "load model.hf_path's safetensors at the configured layout; compare logits with transformers",
        _run_verify,
        _add_verify_args,
    ),
    Command(
        "plan",
        "per-GPU memory of the job on --nodes x --gpus-per-node GPUs; --dry-run checks the layout at full scale",
        _run_plan,
        _add_plan_args,
    ),
    Command(
        "convert",
        "hf-to-mcore / mcore-to-hf / mcore-to-peft: HF safetensors <-> megatron checkpoints; a LoRA run's PEFT adapter",
        _run_convert,
        _add_convert_args,
        takes_config=False,
    ),
)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-megatron",
        description="GRPO for Mixture-of-Experts language models on megatron-core.",
        epilog=(
            "examples:\n"
            "  grpo-megatron check examples/tiny_moe.yaml parallel.ep=2 --world-size 2\n"
            "  torchrun --nproc-per-node 2 -m grpo_megatron sanity examples/tiny_moe.yaml parallel.tp=2"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    debug_help = "on failure, show the full traceback instead of one line per failing rank"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
        if command.takes_config:
            p.add_argument("config", metavar="CONFIG", help="job config YAML file")
            p.add_argument(
                "overrides",
                nargs="*",
                metavar="section.key=value",
                help="override config values, e.g. train.lr=1e-5 model.hf_overrides.num_experts=8",
            )
        if command.add_arguments is not None:
            command.add_arguments(p)
        p.set_defaults(handler=command.run, takes_config=command.takes_config)
    return parser


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _let_rank0_speak() -> None:
    """A rank that stays quiet because rank 0 reports the same failure waits a moment before
    exiting: its exit makes the launcher kill rank 0, which must print first. (The launcher
    ends this wait as soon as rank 0 exits.)"""
    if _rank() != 0:
        time.sleep(RANK0_GRACE_S)


def report_failure(exc: BaseException) -> None:
    """One line on stderr for a failed job: rank 0's error, and another rank's only when it is its
    own (not rank 0's failure seen through a collective, which rank 0 already printed)."""
    from grpo_megatron.distributed.collectives import Rank0Failure

    rank = _rank()
    text = f"{type(exc).__name__}: {exc}".strip()
    if rank != 0 and isinstance(exc, Rank0Failure):
        _let_rank0_speak()
        return
    where = "" if rank == 0 else f" (rank {rank})"
    print(f"grpo-megatron: error{where}: {text}  [--debug shows the traceback]", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    from grpo_megatron.distributed.megatron_jit import skip_fuser_when_compile_disabled

    skip_fuser_when_compile_disabled()  # before anything imports megatron-core (about 3 s per process)
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if args.debug:
            raise
        report_failure(exc)
        return EXIT_FAILURE


def _dispatch(args: argparse.Namespace) -> int:
    if not args.takes_config:
        return args.handler(args)
    if getattr(args, "world_size", None) is None:
        args.world_size = _world_size_from_env()

    from grpo_megatron.config import ConfigError, load_config, preflight_errors, validate

    try:
        cfg = load_config(args.config, args.overrides)
        validate(cfg, args.world_size)
        # Jobs that read data and write outputs (plan, sanity and verify need neither).
        problems = preflight_errors(cfg, args.command) if args.command in PREFLIGHT_COMMANDS else []
        if problems:
            raise ConfigError(problems)
    except ConfigError as e:
        if _rank() == 0:  # every rank found the same problems: one report
            print(f"grpo-megatron: error: {args.config}: {e}", file=sys.stderr, flush=True)
        _let_rank0_speak()
        return EXIT_USAGE
    return args.handler(cfg, args)


if __name__ == "__main__":
    sys.exit(main())
