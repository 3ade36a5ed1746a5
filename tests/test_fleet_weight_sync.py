"""Bucketed weight sync (fleet.weight_sync): buckets round-trip exactly, a bucketed update is the same update
as the whole state dict (through the object store and over gloo groups), a version lands whole or not at all,
and the driver only ever holds references."""

from __future__ import annotations

import pickle

import pytest
import ray
import torch
from test_rl_trainer import _cfg

from codefleet.chat.tokenizer import default_tokenizer
from codefleet.fleet import TrainerGroup
from codefleet.fleet.inference import broadcast_weights, start_engines
from codefleet.fleet.weight_sync import (
    BucketReceiver,
    Buckets,
    BucketSender,
    GroupSync,
    GroupSyncError,
    from_wire,
    plan_buckets,
    specs_of,
    split_names,
    to_wire,
)
from codefleet.inference.sampling import SamplingParams
from codefleet.model import checkpoint
from codefleet.model.transformer import Transformer
from codefleet.rl.trainer import TrainConfig

VOCAB = default_tokenizer().vocab_size  # an engine checks its checkpoint against the tokenizer


def _mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(70, 33, generator=g),  # 9240 bytes: spans several 2 KiB buckets
        "half": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "steps": torch.arange(300, dtype=torch.int64),
        "small": torch.randn(3, generator=g),
        "fp16": torch.randn(1000, generator=g).to(torch.float16),
        "transposed": torch.randn(40, 9, generator=g).t(),  # not contiguous
    }


def _sender(state, bucket_mb):
    sender = BucketSender(lambda: state)
    sender.plan(None, bucket_mb)
    return sender


def _through(state, plans, senders) -> dict[str, torch.Tensor]:
    receiver = BucketReceiver()
    receiver.begin(plans)
    for plan, sender in zip(plans, senders):
        for i, bucket in enumerate(plan.buckets):
            assert not receiver.complete
            wire = pickle.loads(pickle.dumps(sender.bucket(i)))  # as it travels
            receiver.add(bucket, wire)
    return receiver.state_dict()


def test_buckets_round_trip_exactly_with_mixed_dtypes_and_tensors_larger_than_a_bucket():
    state = _mixed_state()
    bucket_mb = 2048 / 2**20
    plan = plan_buckets(specs_of(state), bucket_mb)
    assert {b.dtype for b in plan.buckets} == {"float32", "bfloat16", "int64", "float16"}
    assert all(b.nbytes <= 2048 for b in plan.buckets)
    for dtype in {b.dtype for b in plan.buckets}:  # full buckets but the last of each dtype
        assert all(b.nbytes == 2048 for b in [b for b in plan.buckets if b.dtype == dtype][:-1])
    assert len({p.name for b in plan.buckets for p in b.pieces if p.name == "big"}) == 1
    assert sum(1 for b in plan.buckets for p in b.pieces if p.name == "big") >= 5  # one tensor, many buckets
    assert plan.nbytes == sum(t.numel() * t.element_size() for t in state.values())

    out = _through(state, [plan], [_sender(state, bucket_mb)])
    assert list(out) == list(state)
    for k, v in state.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v), k

    one = plan_buckets(specs_of(state), 64)  # one bucket per dtype when everything fits
    assert len(one.buckets) == 4 and torch.equal(_through(state, [one], [_sender(state, 64)])["big"], state["big"])


def test_two_senders_split_the_tensors_by_bytes_and_the_receiver_assembles_both():
    state = _mixed_state()
    shares = split_names(specs_of(state), 2)
    assert sorted(shares[0] + shares[1]) == sorted(state) and not set(shares[0]) & set(shares[1])
    senders = [BucketSender(lambda: state) for _ in shares]
    plans = [s.plan(share, 2048 / 2**20) for s, share in zip(senders, shares)]
    out = _through(state, plans, senders)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="disjoint"):
        BucketReceiver().begin([plans[0], plans[0]])


def test_an_incomplete_sync_is_refused_and_bfloat16_travels_as_integers():
    state = _mixed_state()
    plan = plan_buckets(specs_of(state), 2048 / 2**20)
    receiver = BucketReceiver()
    receiver.begin([plan])
    sender = _sender(state, 2048 / 2**20)
    for i, bucket in enumerate(plan.buckets[:-1]):
        receiver.add(bucket, sender.bucket(i))
    with pytest.raises(RuntimeError, match="incomplete"):
        receiver.state_dict()
    half = next(i for i, b in enumerate(plan.buckets) if b.dtype == "bfloat16")
    wire = sender.bucket(half)[0]  # one piece: the bfloat16 tensor
    assert str(wire.dtype) == "int16" and from_wire(wire, "bfloat16").dtype == torch.bfloat16
    assert torch.equal(from_wire(to_wire(state["half"].reshape(-1)), "bfloat16"), state["half"].reshape(-1))


# ---- on Ray: trainer ranks -> engine actors ---------------------------------------------------


@pytest.fixture(scope="module")
def fleet(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_sync")
    config = TrainConfig(lr=3e-3, micro_batch_tokens=40)
    group = TrainerGroup(2, model_config=_cfg(vocab_size=VOCAB), config=config, num_cpus_per_worker=0.25)
    torch.manual_seed(5)
    checkpoint.save(Transformer(_cfg(vocab_size=VOCAB)), str(root / "ckpt"))  # different weights until an update
    engines = start_engines(str(root / "ckpt"), 2, num_cpus=0, max_batch=2, max_seq_len=64)
    yield group, engines
    group.shutdown()
    for e in engines:
        ray.kill(e)


def _greedy(engine, prompt=(5, 17, 33, 2)) -> tuple[list[int], list[float], list[int]]:
    r = ray.get(engine.generate.remote(list(prompt), SamplingParams(max_tokens=6, temperature=0.0)))
    return r.token_ids, r.logprobs, r.versions


def test_engines_updated_through_buckets_equal_one_updated_with_the_whole_state_dict(fleet):
    group, engines = fleet
    buckets = group.publish_buckets(bucket_mb=0.05)  # many buckets from both ranks
    assert len(buckets.plans) == 2 and all(len(r) >= 2 for r in buckets.refs)
    serving, away = broadcast_weights(engines[:1], buckets, 4)
    assert serving == engines[:1] and away == {}
    ref, _ = group.publish()
    broadcast_weights(engines[1:], ref, 4)
    by_buckets, whole = _greedy(engines[0]), _greedy(engines[1])
    assert by_buckets == whole and by_buckets[2] == [4] * len(by_buckets[0])


def test_the_driver_holds_only_references(fleet):
    group, _ = fleet
    buckets = group.publish_buckets(bucket_mb=0.05)
    assert isinstance(buckets, Buckets)
    assert all(isinstance(r, ray.ObjectRef) for refs in buckets.refs for r in refs)
    metadata = len(pickle.dumps(buckets.plans))
    assert buckets.nbytes > 20 * metadata  # names, shapes and offsets only: no tensor data on the driver


def test_a_version_lands_whole_or_not_at_all(fleet):
    group, engines = fleet
    buckets = group.publish_buckets(bucket_mb=0.05)
    broadcast_weights(engines[:1], buckets, 6)
    before = _greedy(engines[0])

    @ray.remote(num_cpus=0)
    def lost():
        raise RuntimeError("a bucket never arrived")

    bad_refs = [list(r) for r in buckets.refs]
    bad_refs[1][-1] = lost.remote()
    zeros = [[ray.put(torch.zeros(b.numel).numpy()) for b in p.buckets] for p in buckets.plans]
    with pytest.raises(ray.exceptions.RayTaskError, match="never arrived"):
        ray.get(engines[0].receive_buckets.remote(buckets.plans, [zeros[0], bad_refs[1]], 7))
    assert ray.get(engines[0].info.remote())["version"] == 6
    assert _greedy(engines[0]) == before  # the buckets that did arrive were not applied
    assert ray.get(engines[0].receive_buckets.remote(buckets.plans, buckets.refs, 5)) == 6  # older: ignored


def test_buckets_broadcast_over_gloo_groups_are_the_same_update_as_the_whole_state_dict(fleet):
    group, engines = fleet
    group.sft_step([([5, 17, 33, 2, 9, 11, 4], [0, 1, 1, 1, 1, 1, 1])])  # weights the engines do not have yet
    before = _greedy(engines[0])
    sync = GroupSync(group.workers, engines, timeout_s=60)
    assert sync.backend == "gloo"
    for version in (10, 11):  # the groups and the engines' receive buffers serve every version
        sync.send(group.bucket_plans(bucket_mb=0.05), version)
    assert [i["version"] for i in ray.get([e.info.remote() for e in engines])] == [11, 11]
    over_gloo = _greedy(engines[0])
    ref, _ = group.publish()
    broadcast_weights(engines[1:], ref, 12)
    assert over_gloo[:2] == _greedy(engines[1])[:2] and over_gloo[1] != before[1]


def test_a_dead_engine_fails_a_group_sync_in_one_error_and_the_object_store_still_delivers(fleet, tmp_path):
    group, engines = fleet
    checkpoint.save(Transformer(_cfg(vocab_size=VOCAB)), str(tmp_path / "ckpt"))
    doomed = start_engines(str(tmp_path / "ckpt"), 1, num_cpus=0, max_batch=2, max_seq_len=64)[0]
    sync = GroupSync(group.workers, [engines[0], doomed], timeout_s=60)
    ray.kill(doomed, no_restart=True)
    with pytest.raises(GroupSyncError, match="weight sync over gloo failed"):
        sync.send(group.bucket_plans(bucket_mb=0.05), 20)
    serving, _ = broadcast_weights(engines[:1], group.publish_buckets(bucket_mb=0.05), 21)
    assert serving == engines[:1] and ray.get(engines[0].info.remote())["version"] == 21
