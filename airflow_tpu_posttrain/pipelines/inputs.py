"""``schedule: on_change``: a pipeline scheduled on its inputs, the base model and the dataset, as Assets.

Each input is a Hub repo watched by :class:`HubRevisionTrigger` (Airflow's ``AssetWatcher``): a new revision of
either starts a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_tpu_posttrain.recipes.models import GSM8K_REPO, model_profile

if TYPE_CHECKING:
    from airflow.sdk.definitions.asset import BaseAsset

    from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

ON_CHANGE = "on_change"


def watched_repos(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """``(repo_id, repo_type)`` of the entry's inputs on the Hub: its base model, and its dataset if it is one."""
    profile = model_profile(cfg.model)
    repos = [(profile.hf_source, "model")]
    if cfg.recipe == "sft":
        dataset = cfg.dataset or profile.sft_dataset.source_repo or profile.sft_dataset.hf_path
    else:
        dataset = profile.rl_dataset.source_repo or (None if profile.rl_dataset.train_files else GSM8K_REPO)
    if dataset and "/" in dataset:
        repos.append((dataset, "dataset"))
    return repos


def input_assets(cfg: PipelineConfig) -> BaseAsset:
    """The entry's inputs as Assets, any of which starts a run when the Hub shows a new revision of it."""
    from airflow.sdk import Asset, AssetWatcher

    from airflow_tpu_posttrain.triggers.hub_revision import HubRevisionTrigger

    assets = [
        Asset(
            name=f"hf-{repo_type}:{repo_id}",
            uri=f"hf://{repo_type}s/{repo_id}",
            watchers=[
                AssetWatcher(
                    name=f"hf-{repo_type}-{repo_id.replace('/', '-')}",
                    trigger=HubRevisionTrigger(
                        repo_id=repo_id,
                        repo_type=repo_type,
                        hf_conn_id=cfg.hf_conn_id,
                        poll_interval=cfg.watch_interval_s,
                    ),
                )
            ],
        )
        for repo_id, repo_type in watched_repos(cfg)
    ]
    schedule = assets[0]
    for asset in assets[1:]:
        schedule = schedule | asset
    return schedule
