"""``schedule: on_change``: a pipeline scheduled on its inputs, the base model and the dataset, as Assets.

Each input is a Hub repo watched by :class:`HubRevisionTrigger` (Airflow's ``AssetWatcher``): a new revision of
either starts a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_tpu_posttrain.recipes.models import input_repos, model_profile

if TYPE_CHECKING:
    from airflow.sdk.definitions.asset import BaseAsset

    from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

ON_CHANGE = "on_change"


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
        for repo_id, repo_type in input_repos(model_profile(cfg.model), cfg.recipe, cfg.dataset)
    ]
    schedule = assets[0]
    for asset in assets[1:]:
        schedule = schedule | asset
    return schedule
