"""The model card publish_model.py puts beside an export: README.md and the training curve it shows.

Runs ON the TPU VM beside publish_model.py, with the MaxText venv's python: huggingface_hub's ModelCard and
ModelCardData write the card, matplotlib (a MaxText dependency) draws the curve.
"""

from __future__ import annotations

from pathlib import Path

CARD_FILE = "README.md"
CURVE_FILE = "training_curve.png"


def render_curve(facts: dict, path: Path) -> bool:
    """The training's loss per step as a PNG; False when the log gave no step to plot.

    For GRPO, also accuracy and mean reward before and after."""
    metrics = facts.get("metrics") or {}
    curve = [(step, loss) for step, loss in metrics.get("loss_curve") or [] if isinstance(loss, (int, float))]
    if not curve:
        return False
    try:
        import matplotlib
    except ImportError:  # a venv without MaxText's dependencies: the card goes without its picture
        print("publish_model: matplotlib is not installed; the model card has no training curve", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl_evaluations = [metrics.get("pre_rl"), metrics.get("post_rl")]
    rl = all(rl_evaluations)
    figure, axes = plt.subplots(1, 2 if rl else 1, figsize=(10 if rl else 6, 4), squeeze=False)
    loss_axis = axes[0][0]
    loss_axis.plot([step for step, _ in curve], [loss for _, loss in curve], marker="o", label="training loss")
    evaluations = [(step, loss) for step, loss in metrics.get("eval_losses") or [] if isinstance(loss, (int, float))]
    if evaluations:
        loss_axis.plot(
            [step for step, _ in evaluations], [loss for _, loss in evaluations], marker="s", label="eval loss"
        )
        loss_axis.legend()
    loss_axis.set(xlabel="step", ylabel="training loss", title=f"{facts.get('recipe') or 'Training'} loss")
    loss_axis.grid(alpha=0.3)
    if rl:
        rl_axis = axes[0][1]
        labels = ["accuracy (%)", "mean reward"]
        before = [rl_evaluations[0].get("accuracy", 0.0), rl_evaluations[0].get("mean_reward", 0.0)]
        after = [rl_evaluations[1].get("accuracy", 0.0), rl_evaluations[1].get("mean_reward", 0.0)]
        positions = range(len(labels))
        rl_axis.bar([x - 0.2 for x in positions], before, width=0.4, label="before")
        rl_axis.bar([x + 0.2 for x in positions], after, width=0.4, label="after")
        rl_axis.set(xticks=list(positions), xticklabels=labels, title="evaluation")
        rl_axis.legend()
    figure.tight_layout()
    figure.savefig(
        path, dpi=100, metadata={"Software": None}
    )  # no version stamp: a re-run writes the same bytes
    plt.close(figure)
    return True


def _change(before: object, after: object, unit: str = "") -> str:
    return f"{before}{unit} → {after}{unit}"


def _adapter(lora: dict) -> str:
    kind = f"QLoRA ({lora['weight_qtype']} base weights)" if lora.get("weight_qtype") else "LoRA"
    modules = f", modules `{lora['target_modules']}`" if lora.get("target_modules") else ""
    return f"{kind} adapter: rank {lora['rank']}, alpha {lora['alpha']}{modules}"


def _how_to_load(facts: dict) -> list[str]:
    """The card's section on loading the adapter onto its base model with PEFT."""
    hub = facts.get("hub") or {}
    repo = hub.get("repo_id") or "<this repo or folder>"
    branch = f', revision="{hub["revision"]}"' if hub.get("revision") else ""
    base_revision = f', revision="{facts["base_revision"]}"' if facts.get("base_revision") else ""
    return [
        "## Loading the adapter",
        "",
        "A PEFT LoRA adapter of the base model above (the base's weights are not here): load the base, then the "
        "adapter onto it.",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        "",
        f'base = AutoModelForCausalLM.from_pretrained("{facts["base_model"]}"{base_revision})',
        f'model = PeftModel.from_pretrained(base, "{repo}"{branch})',
        "model = model.merge_and_unload()  # optional: one model, for serving without PEFT",
        "```",
    ]


def write_card(model_dir: Path, facts: dict) -> None:
    """README.md: the model card's metadata from ModelCardData (base model, dataset, tags), then what was run."""
    from huggingface_hub import ModelCard, ModelCardData

    metrics = facts.get("metrics") or {}
    has_curve = render_curve(facts, model_dir / CURVE_FILE)
    recipe = facts.get("recipe") or "Post-training"
    lora = facts.get("lora")
    data = ModelCardData(
        base_model=facts["base_model"],
        datasets=[facts["dataset"]] if facts.get("dataset") else None,
        library_name="peft" if lora else "transformers",
        tags=["maxtext", "airflow-tpu-posttrain", recipe.lower(), *(["lora", "peft"] if lora else [])],
    )
    revision = facts.get("base_revision")
    rows = [
        ("base model", f"`{facts['base_model']}`" + (f" at revision `{revision}`" if revision else "")),
        ("dataset", f"`{facts['dataset']}`" if facts.get("dataset") else "local files"),
        ("recipe", f"{recipe}, {facts.get('steps')} steps" + (f", {_adapter(lora)}" if lora else "")),
        ("MaxText", f"{facts.get('maxtext_version')}"),
        ("accelerator", f"{facts.get('accelerator')}"),
        ("Airflow DAG run", f"`{facts.get('dag_id')}` / `{facts.get('run_id')}`"),
    ]
    if metrics.get("first_loss") is not None and metrics.get("last_loss") is not None:
        rows.append(
            ("training loss (first → last step)", _change(metrics["first_loss"], metrics["last_loss"]))
        )
    evaluation = facts.get("evaluation") or {}
    before, after = ((evaluation.get(which) or {}).get("eval_loss") for which in ("base", "trained"))
    if before is not None and after is not None:
        rows.append(("eval loss on held-out data (base → trained)", _change(before, after)))
    if facts.get("training_cost"):
        rows.append(("training VM, creation → end of training", facts["training_cost"]))
    if facts.get("fidelity"):  # export_fidelity.py: the export computes what MaxText trained
        rows.append(("export fidelity (MaxText → Hugging Face)", facts["fidelity"]))
    for key, label in (("accuracy", "accuracy"), ("mean_reward", "mean reward")):
        before, after = (metrics.get("pre_rl") or {}).get(key), (metrics.get("post_rl") or {}).get(key)
        if before is not None and after is not None:
            rows.append(
                (f"{label} (before → after)", _change(before, after, "%" if key == "accuracy" else ""))
            )
    body = [
        f"# {facts['base_model'].split('/')[-1]}, {recipe}",
        "",
        f"{recipe} of `{facts['base_model']}` with MaxText on a Cloud TPU VM, run by Airflow (airflow-tpu-posttrain).",
        "",
        "| | |",
        "| --- | --- |",
        *(f"| {name} | {value} |" for name, value in rows),
    ]
    if lora:
        body += ["", *_how_to_load(facts)]
    if has_curve:
        body += ["", f"![Training curve]({CURVE_FILE})"]
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n").save(model_dir / CARD_FILE)
