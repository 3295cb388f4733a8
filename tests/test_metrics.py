"""The trainer-log parser: pure, no Airflow, no MaxText."""

from __future__ import annotations

import json
import math
import re

import pytest

from airflow_tpu_posttrain.recipes.metrics import LOG_FILTER, TrainingMetrics, parse_lines

AIRFLOW = "[2025-11-29T15:29:33.081+0000] {ssh.py:120} INFO - [remote] "

SFT_RESUMED_LOG = f"""\
{AIRFLOW}I1129 15:29:20.001000 140 checkpoint_manager.py:101] Found 1 checkpoint steps in /tmp/run/checkpoints
{AIRFLOW}I1129 15:29:20.208000 140 peft_trainer.py:301] Restored params from step: 1 in 0.207 seconds
{AIRFLOW}I1129 15:29:33.081234 140 peft_trainer.py:488] Train step 2 training loss: 6.275753  - training perplexity: 531.526489
{AIRFLOW}completed step: 2, seconds: 43.755, TFLOP/s/device: 0.000, Tokens/s/device: 2.925, total_weights: 32, loss: 6.276, lm_loss: 0.000, perplexity: 531.526
{AIRFLOW}W1129 15:29:34.000000 140 peft_trainer.py:512] some warning with loss: 99.0 in it
{AIRFLOW}I1129 15:29:35.081234 140 peft_trainer.py:488] Train step 3 training loss: 6.260000  - training perplexity: 523.400000
{AIRFLOW}completed step: 3, seconds: 0.812, TFLOP/s/device: 0.000, Tokens/s/device: 157.600, total_weights: 32, loss: 6.260, lm_loss: 0.000, perplexity: 523.400
{AIRFLOW}INFO:absl:Train step 4 training loss: 6.240000  - training perplexity: 512.900000
{AIRFLOW}INFO:absl:completed step: 4, seconds: 0.790, TFLOP/s/device: 0.000, Tokens/s/device: 162.000, total_weights: 32, loss: 6.240, lm_loss: 0.000, perplexity: 512.900
{AIRFLOW}I1129 15:30:19.600000 140 peft_trainer.py:530] Train loop finished in: 46.5141 seconds
{AIRFLOW}I1129 15:30:19.700000 140 peft_trainer.py:488] Train step 5 training loss: 6.223000  - training perplexity: 505.612000
{AIRFLOW}completed step: 5, seconds: 0.801, TFLOP/s/device: 0.000, Tokens/s/device: 160.100, total_weights: 32, loss: 6.223, lm_loss: 0.000, perplexity: 505.612
""".splitlines()

SFT_FRESH_LOG = """\
I1129 15:29:20.001000 140 checkpoint_manager.py:101] Found 0 checkpoint steps in /tmp/run/checkpoints
\x1b[32mI1129 15:29:33.081234 140 peft_trainer.py:488] Train step 1 training loss: 6.275753  - training perplexity: 531.526489\x1b[0m
completed step: 1, seconds: 43.755, TFLOP/s/device: 0.000, Tokens/s/device: 2.925, total_weights: 32, loss: 6.276, lm_loss: 0.000, perplexity: 531.526
I1129 15:29:35.081234 140 peft_trainer.py:488] Train step 2 training loss: 6.250000  - training perplexity: 518.010000
completed step: 2, seconds: 0.800, TFLOP/s/device: 0.000, Tokens/s/device: 160.000, total_weights: 32, loss: 6.250, lm_loss: 0.000, perplexity: 518.010
I1129 15:29:36.000000 140 peft_trainer.py:530] Train loop finished in: 46.5141 seconds
""".splitlines()

RL_LOG = f"""\
{AIRFLOW}I1129 16:00:01.000000 140 train_rl.py:700] Pre RL Training: corr=0, total=2, accuracy=0.0%, partial_accuracy=0.0%, format_accuracy=0.0%, mean_reward=0.0000
{AIRFLOW}W1129 16:00:02.000000 140 train_rl.py:743] \x1b[1;33mGeneration took longer than expected\x1b[0m
{AIRFLOW}I1129 16:05:01.000000 140 train_rl.py:760] RL Training Completed Successfully!
{AIRFLOW}I1129 16:06:01.000000 140 train_rl.py:780] Post RL Training: corr=1, total=2, accuracy=50.0%, partial_accuracy=50.0%, format_accuracy=100.0%, mean_reward=1.2500
""".splitlines()

# Captured from real runs of the tiny model (maxtext 0.2.5, google-tunix 0.1.7, CPU): the lines the log filter keeps,
# as the training task reads them back from the VM, in the order they were logged.
SFT_TINY_REAL_LOG = """\
I1130 12:02:24.837229 140217502825344 peft_trainer.py:488] Train step 1 training loss: 6.275753  - training perplexity: 531.526489
I1130 12:02:25.253213 140217502825344 metric_logger.py:265] completed step: 1, seconds: 42.905, TFLOP/s/device: 0.000, Tokens/s/device: 2.983, total_weights: 32, loss: 6.276, lm_loss: 0.000, perplexity: 531.526
I1130 12:02:25.938371 140217502825344 peft_trainer.py:488] Train step 2 training loss: 6.292087  - training perplexity: 540.279541
I1130 12:02:25.945953 140217502825344 metric_logger.py:265] completed step: 2, seconds: 1.104, TFLOP/s/device: 0.000, Tokens/s/device: 115.913, total_weights: 16, loss: 6.292, lm_loss: 0.000, perplexity: 535.885
I1130 12:02:25.995357 140217502825344 peft_trainer.py:488] Train step 3 training loss: 6.206674  - training perplexity: 496.048676
I1130 12:02:26.014632 140217502825344 metric_logger.py:265] completed step: 3, seconds: 0.069, TFLOP/s/device: 0.001, Tokens/s/device: 1864.830, total_weights: 32, loss: 6.207, lm_loss: 0.000, perplexity: 522.263
I1130 12:02:26.492290 140217502825344 peft_trainer.py:488] Train step 4 training loss: 6.276697  - training perplexity: 532.028564
I1130 12:02:26.495972 140217502825344 metric_logger.py:265] completed step: 4, seconds: 0.482, TFLOP/s/device: 0.000, Tokens/s/device: 265.645, total_weights: 19, loss: 6.277, lm_loss: 0.000, perplexity: 524.687
I1130 12:02:29.784106 140217502825344 peft_trainer.py:748] Train loop finished in: 47.8477 seconds
I1130 12:02:29.795633 140217502825344 peft_trainer.py:488] Train step 5 training loss: 6.223117  - training perplexity: 504.272552
I1130 12:02:29.801588 140217502825344 metric_logger.py:265] completed step: 5, seconds: 3.301, TFLOP/s/device: 0.000, Tokens/s/device: 38.775, total_weights: 30, loss: 6.223, lm_loss: 0.000, perplexity: 520.539
""".splitlines()

GRPO_TINY_REAL_LOG = """\
W1130 16:20:44.970310 140686168148864 train_rl.py:743] Pre RL Training: corr=0, total=2, accuracy=0.0%, partial_accuracy=0.0%, format_accuracy=0.0%, mean_reward=0.0000
I1130 16:20:52.705280 140686168148864 peft_trainer.py:748] Train loop finished in: 5.1119 seconds
I1130 16:20:53.009215 140686168148864 peft_trainer.py:488] Train step 1 training loss: 0.000000  - training perplexity: 1.000000
I1130 16:20:53.010911 140686168148864 peft_trainer.py:748] Train loop finished in: 0.0396 seconds
I1130 16:20:53.015988 140686168148864 peft_trainer.py:488] Train step 2 training loss: 0.000008  - training perplexity: 1.000008
W1130 16:20:53.265758 140686168148864 train_rl.py:768] RL Training Completed Successfully!
W1130 16:20:53.476274 140686168148864 train_rl.py:781] Post RL Training: corr=0, total=2, accuracy=0.0%, partial_accuracy=0.0%, format_accuracy=0.0%, mean_reward=0.0000
""".splitlines()

# The converted checkpoint's load in a real tiny SFT run (gs:// storage on the local GCS server), then the
# export's load of the trained step; orbax logs its write throughput the same way.
CHECKPOINT_LOADS_REAL_LOG = """\
I1201 07:26:40.131751 139680197487488 checkpointer.py:368] Restoring checkpoint from gs://local-posttrain/airflow-tpu-posttrain/conversions/tiny-llama/mt0.2.5-945b0065341078c7/0/items.
I1201 07:26:40.192218 139680197487488 jax_array_handlers.py:273] [process=0] /jax/orbax/read/worker/io/requested throughput: 16.847 MiB/s (total gbytes: 545.2 KiB) (time elapsed: 0.03160572052001953 s) (per-host)
I1201 07:26:40.193649 139680197487488 event_tracking.py:184] [process=0] [sync] Finished load in 0.07 seconds @ gs://local-posttrain/airflow-tpu-posttrain/conversions/tiny-llama/mt0.2.5-945b0065341078c7/0/items
I1201 08:46:03.061812 140295065458368 jax_array_handlers.py:273] [process=0] /jax/orbax/write/worker/io/requested throughput: 2.219 MiB/s (total gbytes: 545.3 KiB) (time elapsed: 0.2400200366973877 s) (per-host)
I1201 07:27:39.213248 139950501600128 jax_array_handlers.py:273] [process=0] /jax/orbax/read/worker/io/requested throughput: 5.111 MiB/s (total gbytes: 272.7 KiB) (time elapsed: 0.05211067199707031 s) (per-host)
I1201 07:27:39.215530 139950501600128 event_tracking.py:184] [process=0] [sync] Finished load in 0.10 seconds @ gs://local-posttrain/airflow-tpu-posttrain/post-train/posttrain-sft-tiny-llama-2026-12-01-07-24-39-7da1830bbc/checkpoints/5/model_params
""".splitlines()

CONVERSION_LOG = """\
[remote] INFO:absl:Loading HF checkpoint from /dev/shm/x/hf
[remote] INFO:absl:Conversion complete. Checkpoint saved to /dev/shm/x/mt-format
[remote] INFO:absl:Peak Memory: 0.52 GB
""".splitlines()

EXPORT_LOG = """\
[remote] I1129 17:00:00.000000 140 to_huggingface.py:300] Saving model
[remote] I1129 17:00:05.000000 140 to_huggingface.py:310] ✅ MaxText model successfully saved in HuggingFace format at /out/dir
""".splitlines()

GARBAGE = [
    "",
    "   ",
    "Traceback (most recent call last):",
    "completed step: x, loss: 1.0",
    "Train step  training loss: ",
    "Pre RL Training:",
    "Peak Memory: lots GB",
    "\x1b[31m\x1b[0m",
    "\x00\xff binary \ufffd",
    "loss: 3.0, perplexity: 20.0",
]


def test_real_sft_log_every_field():
    """Each field against the real lines: the last step's loss and perplexity are that step's own.

    The perplexity is exp(6.223117) = 504.27, not the running geometric mean the "completed step" line carries
    (520.539)."""
    metrics = parse_lines(SFT_TINY_REAL_LOG)

    assert metrics == TrainingMetrics(
        steps_completed=5,
        first_loss=6.275753,
        last_loss=6.223,
        last_perplexity=504.272552,
        tokens_per_s_per_device=38.775,
        train_loop_s=47.8477,
        loss_curve=[(1, 6.275753), (2, 6.292087), (3, 6.206674), (4, 6.276697), (5, 6.223117)],
    )
    assert math.isclose(math.exp(6.223117), metrics.last_perplexity, rel_tol=1e-5)
    assert metrics.summary("SFT") == "SFT: 5 steps, loss 6.276 → 6.223, perplexity 504.3, train loop 47.8 s"


def test_real_grpo_log_every_field():
    """The training loop's time is the sum of both calls of the trainer's loop, not the last one.

    The RL learner runs the trainer's loop once per batch; the last call read "train loop 0.0 s"."""
    metrics = parse_lines(GRPO_TINY_REAL_LOG)
    evaluation = {
        "corr": 0, "total": 2, "accuracy": 0.0, "partial_accuracy": 0.0, "format_accuracy": 0.0, "mean_reward": 0.0
    }

    assert metrics == TrainingMetrics(
        steps_completed=2,
        first_loss=0.0,
        last_loss=0.000008,
        last_perplexity=1.000008,
        train_loop_s=5.1119 + 0.0396,
        pre_rl=evaluation,
        post_rl=evaluation,
        rl_completed=True,
        loss_curve=[(1, 0.0), (2, 0.000008)],
    )
    assert "train loop 5.2 s" in metrics.summary("GRPO")


def test_sft_resumed_run():
    metrics = parse_lines(SFT_RESUMED_LOG)

    assert metrics == TrainingMetrics(
        steps_completed=5,
        first_loss=6.275753,
        last_loss=6.223,
        last_perplexity=505.612,
        tokens_per_s_per_device=160.1,
        train_loop_s=46.5141,
        resumed_from_step=1,
        loss_curve=[(2, 6.275753), (3, 6.26), (4, 6.24), (5, 6.223)],
    )
    assert metrics.summary("SFT") == (
        "SFT: 5 steps (resumed from 1), loss 6.276 → 6.223, perplexity 505.6, train loop 46.5 s"
    )


def test_sft_fresh_run_with_ansi_colours_is_not_resumed():
    metrics = parse_lines(SFT_FRESH_LOG)

    assert metrics.resumed_from_step is None
    assert metrics.steps_completed == 2
    assert metrics.first_loss == 6.275753
    assert metrics.last_loss == 6.25
    assert metrics.summary("SFT") == "SFT: 2 steps, loss 6.276 → 6.250, perplexity 518.0, train loop 46.5 s"


def test_last_loss_belongs_to_the_highest_step_even_if_logged_earlier():
    metrics = parse_lines(
        [
            "completed step: 3, Tokens/s/device: 9.0, loss: 2.000, lm_loss: 0.0, perplexity: 7.389",
            "completed step: 2, Tokens/s/device: 8.0, loss: 3.000, lm_loss: 0.0, perplexity: 20.08",
        ]
    )

    assert (metrics.steps_completed, metrics.last_loss, metrics.tokens_per_s_per_device) == (3, 2.0, 9.0)


def test_lm_loss_is_not_read_as_loss():
    metrics = parse_lines(
        ["completed step: 1, seconds: 1.0, Tokens/s/device: 1.0, lm_loss: 9.999, perplexity: 2.0"]
    )

    assert metrics.first_loss is None and metrics.last_loss is None
    # That line's perplexity is the run's running geometric mean, not the step's: it is not read.
    assert metrics.last_perplexity is None


def test_rl_run():
    metrics = parse_lines(RL_LOG)

    assert metrics.pre_rl == {
        "corr": 0,
        "total": 2,
        "accuracy": 0.0,
        "partial_accuracy": 0.0,
        "format_accuracy": 0.0,
        "mean_reward": 0.0,
    }
    assert metrics.post_rl == {
        "corr": 1,
        "total": 2,
        "accuracy": 50.0,
        "partial_accuracy": 50.0,
        "format_accuracy": 100.0,
        "mean_reward": 1.25,
    }
    assert isinstance(metrics.post_rl["corr"], int)
    assert metrics.rl_completed is True
    assert metrics.steps_completed is None
    assert metrics.summary("GRPO") == "GRPO: accuracy 0.0% → 50.0%, mean reward 0.0000 → 1.2500"


def test_rl_run_that_did_not_complete_says_so():
    metrics = parse_lines(RL_LOG[:2])

    assert metrics.summary("GRPO") == "GRPO: accuracy 0.0%, mean reward 0.0000, RL training not completed"


def test_checkpoint_loads_their_seconds_and_bytes():
    loads = parse_lines(CHECKPOINT_LOADS_REAL_LOG).checkpoint_loads

    assert loads == [
        {
            "bytes": round(545.2 * 1024),
            "uri": "gs://local-posttrain/airflow-tpu-posttrain/conversions/tiny-llama/mt0.2.5-945b0065341078c7/0/items",
            "seconds": 0.07,
        },
        {
            "bytes": round(272.7 * 1024),
            "uri": "gs://local-posttrain/airflow-tpu-posttrain/post-train/posttrain-sft-tiny-llama-2026-12-01-07-24-39"
            "-7da1830bbc/checkpoints/5/model_params",
            "seconds": 0.10,
        },
    ]
    assert parse_lines(["[sync] Finished load in 1.5 seconds @ /dev/shm/c/0/items"]).checkpoint_loads == [
        {"uri": "/dev/shm/c/0/items", "seconds": 1.5}  # no byte count logged before it
    ]


def test_conversion():
    metrics = parse_lines(CONVERSION_LOG)

    assert metrics == TrainingMetrics(output_path="/dev/shm/x/mt-format", peak_memory_gb=0.52)
    assert metrics.summary("convert") == "convert: saved to /dev/shm/x/mt-format, peak memory 0.52 GB"


def test_export():
    metrics = parse_lines(EXPORT_LOG)

    assert metrics == TrainingMetrics(output_path="/out/dir")
    assert metrics.as_xcom() == {"output_path": "/out/dir"}
    assert metrics.summary("export") == "export: saved to /out/dir"


@pytest.mark.parametrize("log", [SFT_RESUMED_LOG, SFT_FRESH_LOG, RL_LOG, CONVERSION_LOG + EXPORT_LOG])
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5])
def test_chunked_feeding_equals_one_shot(log, chunk_size):
    metrics = TrainingMetrics()
    for start in range(0, len(log), chunk_size):
        returned = parse_lines(log[start : start + chunk_size], into=metrics)
        assert returned is metrics

    assert metrics == parse_lines(log)


def test_garbage_is_ignored():
    assert parse_lines(GARBAGE) == TrainingMetrics()
    assert parse_lines(GARBAGE + SFT_RESUMED_LOG + GARBAGE) == parse_lines(SFT_RESUMED_LOG)
    assert parse_lines(GARBAGE).as_xcom() == {}
    assert parse_lines(GARBAGE).summary("SFT") == "SFT: no metrics in the log"


def test_nan_loss_flags_divergence_and_stays_json_safe():
    metrics = parse_lines(
        SFT_FRESH_LOG[:3]
        + [
            "Train step 2 training loss: nan  - training perplexity: nan",
            "completed step: 2, Tokens/s/device: 160.0, loss: nan, lm_loss: 0.0, perplexity: nan",
        ]
    )

    assert metrics.diverged is True
    assert math.isnan(metrics.last_loss) and math.isnan(metrics.last_perplexity)
    xcom = metrics.as_xcom()
    assert xcom["last_loss"] == "nan" and xcom["last_perplexity"] == "nan"
    assert xcom["diverged"] is True
    json.dumps(xcom, allow_nan=False)
    assert metrics.summary("SFT") == "SFT: 2 steps, loss 6.276 → nan, DIVERGED, perplexity nan"


def test_as_xcom_holds_only_seen_fields_and_is_json_serialisable():
    sft = parse_lines(SFT_RESUMED_LOG).as_xcom()
    rl = parse_lines(RL_LOG).as_xcom()

    assert sft == {
        "steps_completed": 5,
        "first_loss": 6.275753,
        "last_loss": 6.223,
        "last_perplexity": 505.612,
        "tokens_per_s_per_device": 160.1,
        "train_loop_s": 46.5141,
        "resumed_from_step": 1,
        "loss_curve": [[2, 6.275753], [3, 6.26], [4, 6.24], [5, 6.223]],
    }
    assert set(rl) == {"pre_rl", "post_rl", "rl_completed"}
    for xcom in (sft, rl):
        assert json.loads(json.dumps(xcom, allow_nan=False)) == xcom


def test_non_finite_rl_reward_is_json_safe():
    xcom = parse_lines(["Post RL Training: corr=0, total=2, accuracy=0.0%, mean_reward=nan"]).as_xcom()

    assert xcom["post_rl"]["mean_reward"] == "nan"
    json.dumps(xcom, allow_nan=False)


@pytest.mark.parametrize(
    "log", [SFT_RESUMED_LOG, SFT_FRESH_LOG, RL_LOG, CONVERSION_LOG, EXPORT_LOG, CHECKPOINT_LOADS_REAL_LOG]
)
def test_the_log_filter_keeps_every_line_the_parser_reads(log):
    """Only the lines matching LOG_FILTER are read back from a VM: parsing them alone gives the same metrics."""
    kept = [line for line in log if re.search(LOG_FILTER, line)]
    assert parse_lines(kept).as_xcom() == parse_lines(log).as_xcom()


# A real tiny SFT run with the quality gate's evaluation (eval_interval=4 eval_steps=2, maxtext 0.2.5, CPU).
# Tunix's "eval loss" is the mean over every evaluation of the process so far (6.293824 = (6.297 + 6.291) / 2);
# MaxText's "Completed eval" line carries the evaluation's own.
SFT_EVAL_REAL_LOG = """\
I1201 13:47:53.381533 140346362755968 peft_trainer.py:840] Train step 0 eval loss: 6.296944 - eval perplexity: 542.910034
I1201 13:47:53.402319 140346362755968 metric_logger.py:302] Completed eval after train step 0, loss=6.297, perplexity=542.910, total_weights=28.0, avg_z_loss=0.000
I1201 13:48:20.178704 140346362755968 peft_trainer.py:488] Train step 1 training loss: 6.275753  - training perplexity: 531.526489
I1201 13:48:20.558562 140346362755968 peft_trainer.py:488] Train step 3 training loss: 6.207013  - training perplexity: 496.216888
I1201 13:48:48.435482 140346362755968 peft_trainer.py:840] Train step 4 eval loss: 6.293824 - eval perplexity: 541.219116
I1201 13:48:48.436670 140346362755968 metric_logger.py:302] Completed eval after train step 4, loss=6.291, perplexity=541.219, total_weights=28.0, avg_z_loss=0.000
I1201 13:48:48.441590 140346362755968 peft_trainer.py:748] Train loop finished in: 54.9567 seconds
I1201 13:48:48.443719 140346362755968 peft_trainer.py:488] Train step 4 training loss: 6.277575  - training perplexity: 532.495789
""".splitlines()


def test_real_sft_evaluations_are_each_evaluations_own():
    metrics = parse_lines(SFT_EVAL_REAL_LOG)
    assert metrics.eval_losses == [(0, 6.297), (4, 6.291)]  # not Tunix's running mean 6.293824
    assert metrics.base_evaluation() == {"eval_loss": 6.297}
    assert metrics.trained_evaluation() == {"eval_loss": 6.291}
    assert "eval loss 6.297 (step 0) → 6.291 (step 4)" in metrics.summary("SFT")
    # The training loss lines are still the steps' own, not the evaluations'.
    assert metrics.loss_curve == [(1, 6.275753), (3, 6.207013), (4, 6.277575)]


# The SFT twin's run on MaxText 0.2.2 (tiny Gemma 3, CPU; the evaluation after step 5 is logged before the step's
# training line): its evaluation line is metric_logger's "eval metrics
# after step"; Tunix's 6.196593 is the mean of the step 0 and step 5 evaluations.
SFT_EVAL_REAL_LOG_0_2_2 = """\
I1203 03:13:32.249369 140359477468032 peft_trainer.py:840] Train step 0 eval loss: 6.213040 - eval perplexity: 499.216705
I1203 03:14:10.092379 140359477468032 peft_trainer.py:488] Train step 4 training loss: 6.169139  - training perplexity: 477.774475
I1203 03:14:10.096206 140359477468032 metric_logger.py:196] completed step: 4, seconds: 4.424, TFLOP/s/device: 0.000, Tokens/s/device: 28.932, total_weights: 30, loss: 6.169, lm_loss: 0.000, perplexity: 0.000
I1203 03:14:22.975094 140359477468032 peft_trainer.py:840] Train step 5 eval loss: 6.196593 - eval perplexity: 491.073212
I1203 03:14:22.976382 140359477468032 metric_logger.py:216] eval metrics after step: 5, loss=6.180, perplexity=483.063, total_weights=63.0
I1203 03:14:37.557792 140359477468032 peft_trainer.py:488] Train step 5 training loss: 6.213147  - training perplexity: 499.270081
I1203 03:14:37.563482 140359477468032 metric_logger.py:196] completed step: 5, seconds: 27.465, TFLOP/s/device: 0.000, Tokens/s/device: 4.660, total_weights: 33, loss: 6.213, lm_loss: 0.000, perplexity: 0.000
""".splitlines()


def test_maxtext_0_2_2_evaluations_are_read_too():
    metrics = parse_lines(SFT_EVAL_REAL_LOG_0_2_2)
    assert metrics.eval_losses == [(5, 6.18)]  # not Tunix's running mean 6.196593
    assert metrics.trained_evaluation() == {"eval_loss": 6.18}
    kept = [line for line in SFT_EVAL_REAL_LOG_0_2_2 if re.search(LOG_FILTER, line)]
    assert parse_lines(kept).as_xcom() == metrics.as_xcom()  # the lines kept with the job's output suffice


def test_a_resumed_process_has_no_base_evaluation():
    """Its first evaluation is of the checkpoint it resumed from, a trained model."""
    resumed = [
        "I1201 peft_trainer.py] Restored params from step: 2 in 0.1 seconds",
        "I1201 metric_logger.py:302] Completed eval after train step 2, loss=6.293, perplexity=541.0",
        "I1201 metric_logger.py:302] Completed eval after train step 4, loss=6.291, perplexity=541.2",
        "I1201 peft_trainer.py:488] Train step 4 training loss: 6.277575  - training perplexity: 532.495789",
    ]
    metrics = parse_lines(resumed)
    assert metrics.base_evaluation() is None
    assert metrics.trained_evaluation() == {"eval_loss": 6.291}
    grpo = parse_lines([resumed[0], *GRPO_TINY_REAL_LOG])
    assert grpo.base_evaluation() is None and grpo.trained_evaluation()["accuracy"] == 0.0


def test_grpo_evaluations_are_pre_and_post_rl():
    metrics = parse_lines(GRPO_TINY_REAL_LOG)
    assert metrics.base_evaluation() == metrics.pre_rl and metrics.base_evaluation()["total"] == 2
    assert metrics.trained_evaluation() == metrics.post_rl


def test_no_final_evaluation_is_no_trained_evaluation():
    """A log cut before the last step's evaluation (or a run without evaluations) gives the gate nothing."""
    assert parse_lines(SFT_EVAL_REAL_LOG[:4]).trained_evaluation() is None
    assert parse_lines(SFT_TINY_REAL_LOG).base_evaluation() is None


def test_the_kept_base_evaluation_beats_a_resumed_grpo_processs_own(tmp_path):
    """The numbers the run's first process kept beside the checkpoints are the base model's.

    A resumed GRPO process logs "Pre RL Training" for the partly trained model it resumed, and its log need not
    say it resumed."""
    import logging
    import subprocess
    from types import SimpleNamespace

    from airflow_tpu_posttrain.operators.evaluation import BASE_EVALUATION_FILE, EvaluationMixin

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = "Pre RL Training: corr=0, total=2, accuracy=0.0%, partial_accuracy=0.0%, format_accuracy=0.0%, mean_reward=0.0000"
    (run_dir / BASE_EVALUATION_FILE).write_text(first + "\n")
    resumed = parse_lines(line.replace("corr=0", "corr=1").replace("accuracy=0.0%", "accuracy=50.0%") for line in RL_LOG)
    assert resumed.base_evaluation()["accuracy"] == 50.0  # what the resumed process's own log says

    class Grpo(EvaluationMixin):
        log, step_title, storage_tool = logging.getLogger("test"), "GRPO", None

        def _vm(self):
            raise AssertionError("the kept evaluation is there: nothing is written")

    spec = SimpleNamespace(layout=SimpleNamespace(checkpoints_dir=str(run_dir / "checkpoints")))
    reported = subprocess.run(Grpo().kept_base_evaluation_command(spec), shell=True, capture_output=True, text=True)
    evaluation = Grpo().evaluation(spec, resumed, str(tmp_path / "job.log"), reported.stdout)
    assert evaluation["base"]["accuracy"] == 0.0 and evaluation["trained"]["accuracy"] == 50.0
