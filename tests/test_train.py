"""`grpo-megatron train` and `sft` end to end: real megatron-core at EP2 on 2 processes, the embedded
transformers engine, the reward pool, checkpoints on disk, metrics.jsonl.

The runs use the demo's model and task (examples/demo.yaml) shrunk to a few prompts per iteration.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_megatron.logging_utils.metrics import read_jsonl
from tests.helpers.metrics import missing_required_keys
from tests.helpers.runs import SMALL, finish, launch

pytestmark = pytest.mark.launches  # every test here: a job, the real engine or ranks of their own

REPLAYED = (
    "loss/",
    "grad_norm",
    "lr",
    "kl",
    "clip_frac",
    "entropy",
    "reward/",
    "advantage/",
    "routing/",
    "response_len/",
    "batch/",
    "dynamic_sampling/",
    "mismatch/logprob",
    "tis/",
)
"""The metrics of an iteration that a replay of its dump gives again (not the evaluation, sync, probe,
offload or wall times: the replay has no engines)."""


def test_two_grpo_iterations_at_ep2_write_every_required_metric(tmp_path):
    # Every phase on: reference model (KL), old-logprob pass (two updates), TIS, DAPO dynamic sampling,
    # trainer offload around the engines, a checkpoint and the final HF export.
    run = tmp_path / "run"
    extra = [
        "algorithm.kl.beta=0.02",
        "train.updates_per_iteration=2",
        "algorithm.tis.enabled=true",
        "algorithm.dynamic_sampling.enabled=true",
        "algorithm.dynamic_sampling.max_tries=2",
        "train.eval_samples=2",
        "checkpoint.export_hf_dir=hf",
        "train.offload_trainer=true",  # the colocated memory swap (a round trip on CPU)
        "checkpoint.save_interval=2",  # a save while the trainer's state is offloaded
        "algorithm.routing_replay=r3",  # the engine's experts replayed in the ref, old and train passes
    ]
    dump = f"rollout.dump_dir={tmp_path / 'dump'}"  # each batch as trained: replayed below
    out = finish(launch("train", [*SMALL, *extra, "train.iterations=2", f"logging.run_dir={run}", dump]))
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [0, 1, 2]  # 0: the evaluation before training
    assert missing_required_keys(records) == []
    last = records[-1]
    assert last["time/ref_logprob"] > 0 and last["time/old_logprob"] > 0
    assert last["kl"] is not None and "dynamic_sampling/rounds" in last and "eval/mean@2" in last
    assert last["mismatch/probe_abs_diff_max"] < 1e-4  # engine and trainer agree after the sync
    # MoE routing: trainer vs engine experts (fp32: they agree), expert load, the probe under replay.
    assert 0 <= last["routing/disagreement"] < 0.05 and last["routing/load_max_over_mean"] >= 1
    assert "routing/load_cv/layer0" in last and last["mismatch/probe_replay_abs_diff_max"] < 1e-4
    assert (run / "hf" / "config.json").is_file() and (run / "hf" / "tokenizer.json").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip().endswith("2")
    assert last["offload/bytes_moved"] > 0
    # packed micro-batches (train.packing, the default) process no padding but the TP/placeholder kind
    assert 0 <= last["batch/padding_frac"] < 0.5 and last["batch/tokens_per_microbatch"] > 0
    assert "held-out accuracy" in out
    # the final report: the last evaluation and the best one, with their iterations
    summary = json.loads((run / "summary.json").read_text())
    evals = {r["iteration"]: r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None}
    assert (summary["after_iteration"], summary["after"], summary["before"]) == (2, evals[2], evals[0])
    assert summary["best"] == max(evals.values()) == evals[summary["best_iteration"]]
    assert (run / "plot.png").is_file()
    assert (run / "config.yaml").is_file()

    # Train-only replay of the dump (no engine starts): every loss, gradient norm and training metric
    # equals the original run's bit for bit, on the same layout and config.
    replay = tmp_path / "replay"
    out = finish(
        launch(
            "train",
            [
                *SMALL,
                *extra,
                "train.iterations=2",
                f"logging.run_dir={replay}",
                f"rollout.replay_dir={tmp_path / 'dump'}",  # no save or export: faster
                "checkpoint.save_interval=0",
                "checkpoint.export_hf_dir=",
            ],
        )
    )
    assert "[train] held-out accuracy nan%" in out  # no engines: nothing evaluated
    replayed = read_jsonl(replay / "metrics.jsonl")
    assert [r["iteration"] for r in replayed] == [0, 1, 2] and replayed[1]["time/sync"] < 0.05
    for got, want in zip(replayed[1:], records[1:], strict=True):
        trained = {k for k in want if k.startswith(REPLAYED) and "probe" not in k and want[k] is not None}
        assert {
            "loss/policy",
            "loss/kl",
            "grad_norm",
            "entropy",
            "reward/mean",
            "routing/disagreement",
        } <= trained
        assert {k: got[k] for k in trained} == {k: want[k] for k in trained}


# A job SIGKILLed after its checkpoint of iteration 2 and resumed equals an uninterrupted one bitwise:
# the first link of tests/test_preemption.py's chain of launches, which shares its uninterrupted run.


def test_sft_writes_a_hugging_face_checkpoint_that_train_starts_from_at_cp2(tmp_path):
    sft_dir, hf_dir = tmp_path / "sft", tmp_path / "sft" / "hf"
    finish(
        launch(
            "sft",
            [
                *SMALL,
                "sft.max_steps=4",
                "sft.eval_interval=2",
                "sft.batch_size=8",
                f"logging.run_dir={sft_dir}",
                f"sft.output_dir={hf_dir}",
            ],
        )
    )
    assert (hf_dir / "config.json").is_file() and (hf_dir / "tokenizer.json").is_file()
    assert list(Path(hf_dir).glob("*.safetensors"))
    summary = json.loads((sft_dir / "summary.json").read_text())  # which step was exported, and why
    assert (
        summary["steps"] == summary["last_step"] == 4
        and summary["kept_step"] in (0, 2, 4)
        and summary["reason"]
    )
    # GRPO from the SFT export, at CP2 x EP2 on 2 ranks (each expert on one CP rank): packed rows split
    # over the CP ranks, the weight sync gathers experts from both, and the trainer's probe logprobs
    # equal the engine's (one launch for both properties: the suite's time budget).
    grpo = tmp_path / "grpo"
    out = finish(
        launch(
            "train",
            [
                *SMALL,
                "parallel.cp=2",
                "train.iterations=1",
                f"model.hf_path={hf_dir}",
                f"logging.run_dir={grpo}",
            ],
        )
    )
    assert str(hf_dir) in out  # loaded the SFT weights, not a random initialisation
    last = read_jsonl(grpo / "metrics.jsonl")[-1]
    assert last["mismatch/probe_abs_diff_max"] < 1e-4 and last["mismatch/logprob_abs_diff"] < 1e-4
    assert last["batch/padding_frac"] == 0.0
