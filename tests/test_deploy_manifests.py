"""The KubeRay manifests in deploy/kuberay/: they are what deploy/render.py makes from deploy/values.yaml, they
validate against KubeRay's own CRD schemas (deploy/crds/, v1.7.0) the way the API server checks them (unknown
fields refused), Ray's autoscaler reads the logical resources the groups advertise, and the RayJob's
`codefleet train` asks for exactly those. No cluster and no Ray session: the schemas, the renderer, Ray's
autoscaler config parser and codefleet's own config loader run as they are."""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import os
import shlex

import jsonschema
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
VALUES = os.path.join(DEPLOY, "values.yaml")
GPU_VALUES = os.path.join(DEPLOY, "values-gpu.yaml")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _load_render():
    spec = importlib.util.spec_from_file_location("codefleet_deploy_render", os.path.join(DEPLOY, "render.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


def _strict(schema):
    """A CRD's structural schema as the API server applies it with strict field validation (kubectl's default):
    an object that lists its properties refuses any other, unless it preserves unknown fields. x-kubernetes-*
    keys are dropped (jsonschema would ignore them anyway; CEL rules are not evaluated)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: _strict(v) if k in ("properties", "items", "additionalProperties", "anyOf", "allOf", "oneOf", "not") else v
        for k, v in schema.items()
        if not k.startswith("x-kubernetes-")
    }
    if "properties" in out:
        out["properties"] = {name: _strict(s) for name, s in schema["properties"].items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def validator(kind: str) -> jsonschema.Draft7Validator:
    path = os.path.join(DEPLOY, "crds", f"ray.io_{kind.lower()}s.yaml")
    crd = yaml.load(_read(path), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 2.3 MB: the C loader
    assert crd["spec"]["names"]["kind"] == kind
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def errors(manifest) -> list[str]:
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(manifest["kind"]).iter_errors(manifest)
    ]


def committed(name: str):
    return yaml.safe_load(_read(os.path.join(DEPLOY, "kuberay", name)))


def test_committed_manifests_are_a_fresh_render_of_values_yaml():
    texts = render.render([VALUES])
    assert sorted(texts) == ["raycluster.yaml", "rayjob.yaml", "run-volume.yaml"]
    for name, text in texts.items():
        with open(os.path.join(DEPLOY, "kuberay", name)) as f:
            assert f.read() == text, (
                f"deploy/kuberay/{name} is stale: run .venv/bin/python deploy/render.py "
                "deploy/values.yaml --out deploy/kuberay/"
            )


@pytest.mark.parametrize("values", [[VALUES], [VALUES, GPU_VALUES]], ids=["cpu", "gpu"])
def test_manifests_validate_against_the_kuberay_crds(values):
    texts = render.render(values)
    for name in ("raycluster.yaml", "rayjob.yaml"):
        manifest = yaml.safe_load(texts[name])
        assert errors(manifest) == [], name


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda m: m["spec"]["workerGroupSpecs"][0].update(replicas="two"), "'two' is not of type 'integer'"),
        (lambda m: m["spec"]["workerGroupSpecs"][0].update(minReplica=1), "'minReplica' was unexpected"),
        (
            lambda m: m["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["securityContext"].update(
                previleged=True
            ),
            "'previleged' was unexpected",
        ),
        (lambda m: m["spec"]["workerGroupSpecs"][1].pop("groupName"), "'groupName' is a required property"),
        (
            lambda m: m["spec"]["workerGroupSpecs"][2]["rayStartParams"].update(resources={"trainer_node": 1}),
            "is not of type 'string'",
        ),
    ],
    ids=["wrong-type", "typo", "typo-in-pod-template", "missing-required", "resources-not-a-string"],
)
def test_a_broken_manifest_fails_validation(breakage, expected):
    manifest = copy.deepcopy(committed("raycluster.yaml"))
    assert errors(manifest) == []
    breakage(manifest)
    found = errors(manifest)
    assert any(expected in e for e in found), found


def test_sandbox_capacity_formula():
    # min(cores x per-core, (memory - reserved) / per-sandbox), floored
    assert render.sandbox_capacity(16, 64, 2, 1024, 8) == 32  # cores decide
    assert render.sandbox_capacity(16, 24, 2, 1024, 8) == 16  # memory decides: 16 GiB / 1 GiB
    assert render.sandbox_capacity(4, 10, 4, 1536, 2) == 5  # 8 GiB / 1.5 GiB = 5.33
    assert render.sandbox_capacity(2, 4, 2, 1024, 8) == 0  # the reserve eats it all
    s = yaml.safe_load(_read(VALUES))["sandbox"]
    want = min(
        math.floor(s["cpu"] * s["sandboxesPerCpu"]),
        math.floor((s["memoryGi"] - s["reservedMemoryGi"]) * 1024 / s["memoryPerSandboxMb"]),
    )
    assert render.group_resources(render.load_values([VALUES]))["sandbox"]["sandbox"] == want


def _autoscaler_view(raycluster) -> dict[str, dict]:
    """What Ray's autoscaler makes of the RayCluster: node type -> {resources, min_workers, max_workers}."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    config = _derive_autoscaling_config_from_ray_cr(
        {**raycluster, "metadata": {**raycluster["metadata"], "namespace": "default"}}
    )
    return config["available_node_types"]


def _train_config(rayjob):
    from codefleet.recipe.config import load_train_config

    args = shlex.split(rayjob["spec"]["entrypoint"])
    assert args[:2] == ["codefleet", "train"]
    return args, load_train_config(None, [a for a in args if "=" in a and not a.startswith("--")])


@pytest.mark.parametrize("values", [[VALUES], [VALUES, GPU_VALUES]], ids=["cpu", "gpu"])
def test_the_rayjob_asks_for_the_resources_the_groups_advertise(values):
    """Parsed by Ray's own autoscaler config and codefleet's own config loader: every logical resource a role
    asks for is advertised by a group whose bounds hold all of that role's actors, GPUs included."""
    from codefleet.fleet.sandbox_host import RESOURCE

    texts = render.render(values)
    cluster, job = yaml.safe_load(texts["raycluster.yaml"]), yaml.safe_load(texts["rayjob.yaml"])
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    types = _autoscaler_view(cluster)
    assert types["sandbox"]["resources"][RESOURCE] >= 1  # the sandbox hosts' resource, by codefleet's own name
    args, config = _train_config(job)
    roles = [
        ("rollout", config.rollouts.workers, config.rollouts.resources, 0.0),
        ("engine", config.engine.count, config.engine.resources, config.engine.gpus),
        ("trainer", config.trainer.workers, config.trainer.resources, config.trainer.gpus),
    ]
    for role, actors, resources, gpus in roles:
        assert resources, f"{role}s are not pinned to a group"
        hosts = [name for name, t in types.items() if all(t["resources"].get(k, 0) >= v for k, v in resources.items())]
        assert len(hosts) == 1 and hosts[0] != "headgroup", (role, hosts)
        t = types[hosts[0]]
        per_pod = min(t["resources"][k] // v for k, v in resources.items())
        if gpus:
            per_pod = min(per_pod, t["resources"].get("GPU", 0) // gpus)
        assert actors <= per_pod * t["max_workers"], (role, actors, per_pod, t["max_workers"])
    assert config.placement.wait_s >= 600  # time for the autoscaler to start pods
    run_dir = args[args.index("--out") + 1]
    mount = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]
    assert run_dir.startswith(mount + "/")
    # the run volume is mounted at that same path in every pod
    templates = [cluster["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["spec"]["workerGroupSpecs"]
    ]
    for t in templates:
        claim = {v["name"]: v for v in t["spec"]["volumes"]}["runs"]["persistentVolumeClaim"]["claimName"]
        assert claim == yaml.safe_load(texts["run-volume.yaml"])["metadata"]["name"]
        assert {"name": "runs", "mountPath": mount} in t["spec"]["containers"][0]["volumeMounts"]


def test_values_overrides_change_the_rendered_output(tmp_path):
    cpu, gpu = render.render([VALUES]), render.render([VALUES, GPU_VALUES])
    base_types = _autoscaler_view(yaml.safe_load(cpu["raycluster.yaml"]))
    gpu_cluster = yaml.safe_load(gpu["raycluster.yaml"])
    gpu_types = _autoscaler_view(gpu_cluster)
    overlay = yaml.safe_load(_read(GPU_VALUES))
    assert base_types["engine"]["resources"].get("GPU", 0) == 0
    assert gpu_types["engine"]["resources"]["GPU"] == overlay["engine"]["gpus"]
    assert gpu_types["trainer"]["resources"]["GPU"] == overlay["trainer"]["gpus"]
    engine_pod = gpu_cluster["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]
    assert (
        engine_pod["image"]
        == render.load_values([VALUES, GPU_VALUES])["gpuImage"]
        != yaml.safe_load(_read(VALUES))["image"]
    )
    _, config = _train_config(yaml.safe_load(gpu["rayjob.yaml"]))
    assert (config.engine.backend, config.engine.gpus) == ("vllm", overlay["train"]["engineGpus"])
    # a values file of one's own: sandbox pods twice as big hold twice the sandboxes, and the userns profile
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "sandbox: {cpu: 32, memoryGi: 128, reservedMemoryGi: 16}\nsandboxProfile: userns\n"
        "train: {overrides: [rl.steps=48]}\n"
    )
    texts = render.render([VALUES, str(mine)])
    cluster = yaml.safe_load(texts["raycluster.yaml"])
    assert errors(cluster) == []
    assert (
        _autoscaler_view(cluster)["sandbox"]["resources"]["sandbox"]
        == 2 * base_types["sandbox"]["resources"]["sandbox"]
    )
    pod = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert pod["hostUsers"] is False and pod["containers"][0]["securityContext"]["procMount"] == "Unmasked"
    args, config = _train_config(yaml.safe_load(texts["rayjob.yaml"]))
    assert args[-1] == "rl.steps=48" and config.rl.steps == 48


def test_sandbox_pods_run_as_a_user_and_only_they_get_the_sandbox_profile():
    cluster = committed("raycluster.yaml")
    pods = {"head": cluster["spec"]["headGroupSpec"]["template"]["spec"]}
    pods.update({g["groupName"]: g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]})
    for name, pod in pods.items():
        security = pod["containers"][0]["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] > 0, name
        if name in ("head", "sandbox"):  # the driver runs demonstrations and evaluations in its own sandboxes
            assert security.get("privileged") or security.get("procMount") == "Unmasked", name
        else:
            assert not security.get("privileged") and security["capabilities"] == {"drop": ["ALL"]}, name
            assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name


@pytest.mark.parametrize(
    "change, message",
    [
        ({"train": {"engines": 9}}, "do not fit the engine group"),
        ({"train": {"engineGpus": 1}}, "needs train.engineBackend vllm"),
        ({"train": {"rolloutWorkers": 1000}}, "exceeds what the sandbox group can hold"),
        ({"sandbox": {"memoryGi": 8}}, "holds no sandbox"),
        ({"engine": {"minReplicas": 3}}, "minReplicas <= maxReplicas"),
        ({"sandboxProfile": "root"}, "choose privileged or userns"),
    ],
    ids=["engines", "gpu-engine-without-vllm", "rollout-workers", "no-sandbox", "bounds", "profile"],
)
def test_values_that_cannot_work_are_refused(tmp_path, change, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(change))
    with pytest.raises(ValueError, match=message):
        render.render([VALUES, str(bad)])
    assert render.main([VALUES, str(bad), "--out", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()


def test_the_images_ray_matches_the_manifests():
    values = yaml.safe_load(_read(VALUES))
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        text = _read(os.path.join(DEPLOY, dockerfile))
        assert f"ARG RAY_VERSION={values['rayVersion']}\n" in text, dockerfile
        assert f"--uid {values['runAsUser']}" in text, dockerfile
