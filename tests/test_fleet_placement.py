"""Engines and trainer workers placed in Ray placement groups (fleet.placement): disaggregated in groups of
their own, colocated in shared bundles with the engines asleep while the trainer steps, and a cluster without
room refused in one sentence with nothing left reserved."""

from __future__ import annotations

import time

import pytest
import ray
import torch
from ray.util import placement_group_table
from test_rl_trainer import _cfg

from codefleet.chat.tokenizer import default_tokenizer
from codefleet.fleet import TrainerGroup
from codefleet.fleet.inference import start_engines
from codefleet.fleet.placement import Placement, Role
from codefleet.inference.sampling import SamplingParams
from codefleet.model import checkpoint
from codefleet.model.transformer import Transformer
from codefleet.recipe.config import TrainRunConfig
from codefleet.recipe.config_check import check_config
from codefleet.recipe.run_dir import RunError
from codefleet.rl.trainer import TrainConfig

VOCAB = default_tokenizer().vocab_size
SMALL = Role(0.1)


@pytest.fixture(scope="module")
def ckpt(ray_session, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("placement") / "ckpt")
    torch.manual_seed(0)
    checkpoint.save(Transformer(_cfg(vocab_size=VOCAB)), path)
    return path


def _state(placement: Placement) -> list[str]:
    return [placement_group_table(g)["state"] for g in placement.groups]


def test_disaggregated_engines_and_trainer_ranks_run_in_groups_of_their_own(ckpt):
    placement = Placement.reserve(1, 2, SMALL, SMALL, timeout_s=60)
    try:
        assert len(placement.groups) == 2 and _state(placement) == ["CREATED", "CREATED"]
        trainer_pg, engine_pg = (g.id.hex() for g in placement.groups)
        engines = start_engines(ckpt, 1, num_cpus=0.1, max_batch=2, max_seq_len=64, placement=placement.engines)
        group = TrainerGroup(
            2, checkpoint=ckpt, config=TrainConfig(), num_cpus_per_worker=0.1, placement=placement.trainer
        )
        assert ray.get(engines[0].info.remote())["placement_group"] == engine_pg
        assert [ray.get(w.where.remote())["placement_group"] for w in group.workers] == [trainer_pg] * 2
    finally:
        placement.remove()
    with pytest.raises(ray.exceptions.RayActorError):  # removing the groups ends the actors placed in them
        deadline = time.monotonic() + 30  # Ray removes a group, and kills its actors, asynchronously
        while time.monotonic() < deadline:
            ray.get(engines[0].info.remote(), timeout=30)
            time.sleep(0.1)


def test_colocated_pairs_share_bundles_and_a_sleeping_engine_holds_requests_until_it_wakes(ckpt):
    placement = Placement.reserve(1, 1, SMALL, SMALL, colocated=True, timeout_s=60)
    try:
        assert len(placement.groups) == 1
        assert placement_group_table(placement.groups[0])["bundles"] == {0: {"CPU": 0.2}}
        engine = start_engines(ckpt, 1, num_cpus=0.1, max_batch=2, max_seq_len=64, placement=placement.engines)[0]
        group = TrainerGroup(
            1, checkpoint=ckpt, config=TrainConfig(), num_cpus_per_worker=0.1, placement=placement.trainer
        )
        pg = placement.groups[0].id.hex()
        assert (
            ray.get(engine.info.remote())["placement_group"]
            == ray.get(group.workers[0].where.remote())["placement_group"]
            == pg
        )
        ray.get(engine.sleep.remote())
        request = engine.generate.remote([5, 17, 33, 2], SamplingParams(max_tokens=4, temperature=0.0))
        time.sleep(1.0)
        assert not ray.wait([request], timeout=0)[0]  # asleep: no step runs
        ref, version = group.publish()
        ray.get(engine.update_weights.remote([ref], 3))  # weights still land while it sleeps
        engine.wake.remote()
        assert ray.get(request, timeout=60).versions == [3] * 4
    finally:
        placement.remove()


def test_a_cluster_without_room_is_refused_in_one_sentence_and_nothing_stays_reserved(ray_session):
    before = {g for g, info in placement_group_table().items() if info["state"] != "REMOVED"}
    with pytest.raises(ValueError, match=r"Ray could not place 2 trainer workers of \{'CPU': 64\} within 1 s"):
        Placement.reserve(1, 2, SMALL, Role(64), timeout_s=1)
    with pytest.raises(ValueError, match="could not place 1 engines"):
        Placement.reserve(1, 1, Role(64), SMALL, timeout_s=1)
    # an earlier test's group may finish its removal meanwhile: what matters is that none was added
    assert {g for g, info in placement_group_table().items() if info["state"] != "REMOVED"} <= before


def test_colocated_needs_as_many_engines_as_trainer_workers():
    config = TrainRunConfig()
    config.placement.layout, config.engine.count, config.trainer.workers = "colocated", 1, 2
    with pytest.raises(RunError, match="colocated pairs each engine with a trainer worker"):
        check_config(config)
    with pytest.raises(ValueError, match="1 engines and 2 trainer workers"):
        Placement.reserve(1, 2, SMALL, SMALL, colocated=True)
    config.placement.layout = "packed"
    with pytest.raises(RunError, match="placement.layout must be one of disaggregated, colocated"):
        check_config(config)


def test_trainer_ranks_that_could_share_a_gpu_are_refused_before_anything_is_reserved():
    for colocated, engine_gpus in ((False, 0.0), (True, 0.25)):
        with pytest.raises(ValueError, match="NCCL refuses two ranks on one"):
            Placement.reserve(2, 2, Role(0.1, engine_gpus), Role(0.1, 0.5), colocated=colocated, timeout_s=1)
