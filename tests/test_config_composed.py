"""A run's configuration is composed of the components' own configs, each setting declared once with one default:
no two config classes of a run declare the same setting (nor a config class the run builds from its settings, such
as the trainer's `TrainConfig`), every component field is settable from the command line, a setting named by its
old place says its new one, and loading a configuration imports neither torch nor Ray."""

from __future__ import annotations

import ast
import dataclasses
import glob
import os
import subprocess
import sys
import typing

import pytest

from codefleet.config import ConfigError, dotted_keys
from codefleet.fleet.controller_api import ControllerConfig
from codefleet.fleet.fleet_config import (
    EngineConfig,
    PlacementConfig,
    RayClusterConfig,
    RolloutWorkersConfig,
    TrainerWorkersConfig,
    WeightSyncConfig,
)
from codefleet.recipe.config import MOVED, TrainRunConfig, load_train_config
from codefleet.recipe.eval_config import EvalConfig
from codefleet.rl.trainer import TrainConfig

FLEET = {
    "cluster": RayClusterConfig,
    "engine": EngineConfig,
    "trainer": TrainerWorkersConfig,
    "weight_sync": WeightSyncConfig,
    "rollouts": RolloutWorkersConfig,
    "placement": PlacementConfig,
}
RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "codefleet", "recipe")

# The rule: a field name may be declared by one config class reachable from TrainRunConfig only (a class reached
# along two paths is still one class). A name two classes declare is one setting with two defaults, unless the two
# are different settings of different stages, listed here with the exact classes and why; a third class declaring
# one of these names fails too.
SAME_NAME_DIFFERENT_SETTING = {
    "seed": ({"TasksSection", "ModelSection"}, "the task generator's seed and the model's initialisation seed"),
    "lr": ({"SFTSection", "RLSection"}, "each training stage has its own learning rate"),
    "temperature": ({"RLSection", "EvalConfig"}, "RL's rollouts sample to explore, an evaluation may be greedy"),
    "max_tokens": ({"RLSection", "EvalConfig"}, "per turn of RL's rollouts and of the evaluations"),
    "threads": (
        {"SFTSection", "EvalConfig", "EngineConfig"},
        "torch threads of SFT's workers, of the evaluation's engine and of RL's engines",
    ),
    "workers": (
        {"SFTSection", "TrainerWorkersConfig", "RolloutWorkersConfig"},
        "SFT's trainer workers, RL's trainer workers and RL's rollout workers",
    ),
    # what one actor of a kind takes and runs: each kind of the fleet's actors has its own
    "backend": (
        {"EngineConfig", "TrainerWorkersConfig", "SandboxConfig"},
        "the engine's, the trainer's and the sandbox's implementation, each from its own registry",
    ),
    "cpus": ({"TrainerWorkersConfig", "RolloutWorkersConfig"}, "logical CPUs per trainer worker, per rollout worker"),
    "gpus": ({"EngineConfig", "TrainerWorkersConfig"}, "GPUs per engine, per trainer worker"),
    "resources": (
        {"EngineConfig", "TrainerWorkersConfig", "RolloutWorkersConfig"},
        "logical resources per engine, per trainer worker, per rollout worker",
    ),
    "wait_s": (
        {"EngineConfig", "PlacementConfig"},
        "how long a weight broadcast waits for an engine; how long the placement waits for room on the cluster",
    ),
}

# Config classes the run builds from its settings instead of holding them (one per training stage). A field such a
# class shares with a setting of the run is one setting only if the recipe passes it: then the built class's
# default never applies to a run. Which fields the recipe passes is read from its source (every call of the class
# in codefleet/recipe/), so a field it stops passing, or a new field named like a run setting, fails the rule.
BUILT = (TrainConfig,)


def declarations(cls: type, found: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """{field name: the names of the config classes reachable from `cls` that declare it}."""
    found = {} if found is None else found
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        found.setdefault(f.name, set()).add(cls.__name__)
        if dataclasses.is_dataclass(hints[f.name]):
            declarations(hints[f.name], found)
    return found


def passed_by_the_recipe(cls: type) -> set[str]:
    """The keyword arguments of every call `cls(...)` in the recipe's source."""
    passed = set()
    for path in glob.glob(os.path.join(RECIPE, "**", "*.py"), recursive=True):
        with open(path) as f:
            for node in ast.walk(ast.parse(f.read())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == cls.__name__:
                    passed |= {k.arg for k in node.keywords if k.arg}
    return passed


def run_declarations(run: type, built: dict[type, set[str]]) -> dict[str, set[str]]:
    """`declarations(run)` and those of the `built` classes, each but for the fields the recipe passes it."""
    found = declarations(run)
    for cls, passed in built.items():
        for name, classes in declarations(cls).items():
            if name in passed:
                classes = classes - {cls.__name__}
            found.setdefault(name, set()).update(classes)
    return found


def test_no_two_config_classes_of_a_run_declare_the_same_setting():
    built = {cls: passed_by_the_recipe(cls) for cls in BUILT}
    assert {"lr", "seed", "loss", "routing_replay", "warmup_steps"} <= built[TrainConfig]  # the source was read
    shared = {name: classes for name, classes in run_declarations(TrainRunConfig, built).items() if len(classes) > 1}
    unexplained = {
        name: sorted(classes)
        for name, classes in shared.items()
        if SAME_NAME_DIFFERENT_SETTING.get(name, (set(),))[0] != classes
    }
    assert not unexplained, (
        f"settings declared by more than one config class: {unexplained}; declare each once, "
        "next to its component, or add it to SAME_NAME_DIFFERENT_SETTING with why they differ"
    )
    stale = set(SAME_NAME_DIFFERENT_SETTING) - set(shared)
    assert not stale, f"SAME_NAME_DIFFERENT_SETTING lists names no longer shared: {sorted(stale)}; remove them"


@dataclasses.dataclass
class _Section:
    rollout_slots: int = 16  # a run repeating the controller's field


@dataclasses.dataclass
class _Run:
    rl: _Section = dataclasses.field(default_factory=_Section)
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)


@dataclasses.dataclass
class _Built:
    lr: float = 1e-3  # passed by the recipe: the run's value
    backend: str = "dp"  # not passed: a second declaration of the trainer's backend


def test_the_rule_catches_a_setting_declared_twice():
    assert declarations(_Run)["rollout_slots"] == {"_Section", "ControllerConfig"}
    found = run_declarations(TrainRunConfig, {_Built: {"lr"}})
    assert "_Built" not in found["lr"] and "_Built" in found["backend"]


def test_the_run_holds_the_components_configs_and_the_demo_sets_its_own_values_in_its_recipe():
    bare, demo = load_train_config(None, ["recipe="]), load_train_config()
    assert type(demo.controller) is ControllerConfig and type(demo.eval) is EvalConfig
    assert bare.controller == ControllerConfig() and bare.eval == EvalConfig()  # one default: the component's
    assert (demo.controller.rollout_slots, demo.controller.batch_groups, demo.controller.rollout_timeout_s) == (
        16,
        4,
        120.0,
    )
    assert (demo.eval.attempts, demo.eval.temperature, demo.eval.max_tokens, demo.eval.jobs) == (8, 1.0, 256, 10)
    for section, cls in FLEET.items():  # the fleet's actors: the components' defaults, in the demo too
        assert type(getattr(demo, section)) is cls and getattr(bare, section) == getattr(demo, section) == cls()


def test_every_field_of_every_component_is_settable_from_the_command_line():
    keys = dotted_keys(TrainRunConfig)
    assert {
        "controller.max_infra_retries",
        "controller.retry_backoff_s",
        "controller.retry_backoff_max_s",
        "controller.max_abandoned_in_a_row",
        "eval.threads",
        "eval.exact_tokens",
        "rl.loss.kl_coef",
        "model.copy.head",
        "sandbox.memory_mb",
        "engine.count",
        "trainer.backend",
        "weight_sync.bucket_mb",
        "rollouts.workers",
        "placement.layout",
        "cluster.address",
    } <= set(keys)
    config = load_train_config(
        None,
        [
            "controller.max_infra_retries=5",
            "controller.retry_backoff_s=0.5",
            "controller.retry_backoff_max_s=4",
            "eval.exact_tokens=true",
            "engine.count=3",
            "trainer.backend=fsdp2",
            "weight_sync.method=buckets",
            "placement.layout=colocated",
        ],
    )
    assert (
        config.controller.max_infra_retries,
        config.controller.retry_backoff_s,
        config.controller.retry_backoff_max_s,
        config.eval.exact_tokens,
    ) == (5, 0.5, 4.0, True)
    assert (config.engine.count, config.trainer.backend, config.weight_sync.method, config.placement.layout) == (
        3,
        "fsdp2",
        "buckets",
        "colocated",
    )


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "controller.max_infra_retry=5",
            r"^unknown config key 'controller.max_infra_retry': did you mean "
            r"controller.max_infra_retries\?$",
        ),
        (
            "rl.max_infra_retries=5",
            r"^unknown config key 'rl.max_infra_retries': did you mean "
            r"controller.max_infra_retries\?$",
        ),  # in the wrong section
        ("rl.rollout_slots=4", r"^rl.rollout_slots is now controller.rollout_slots; rename it in the command line$"),
        ("cluster.engines=2", r"^cluster.engines is now engine.count; rename it in the command line$"),
        (
            "cluster.weight_sync=buckets",
            r"^cluster.weight_sync is now weight_sync.method; rename it in the command line$",
        ),
        ("controller.rollout_timeout_s=0", r"^controller: rollout_timeout_s=0.0 must be > 0$"),
    ],
)
def test_a_wrong_key_or_value_is_one_sentence_saying_what_to_write(override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, [override])


def test_an_old_key_in_a_file_or_a_recipe_says_its_new_name(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("rl:\n  eta: 2\n")
    with pytest.raises(ConfigError, match=f"^rl.eta is now controller.eta; rename it in {path} or the command line"):
        load_train_config(str(path))
    with pytest.raises(ConfigError, match=f"^rl.eta is now controller.eta; rename it in the recipe {path}$"):
        load_train_config(None, [f"recipe={path}"])
    path.write_text("cluster:\n  num_cpus: 8\n  trainer_workers: 1\n")  # num_cpus stayed; trainer_workers moved
    with pytest.raises(ConfigError, match="^cluster.trainer_workers is now trainer.workers; rename it in "):
        load_train_config(str(path))
    assert set(MOVED.values()) <= set(dotted_keys(TrainRunConfig))
    assert not set(MOVED) & set(dotted_keys(TrainRunConfig))


def test_loading_a_run_configuration_imports_neither_torch_nor_ray(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rl:\n  steps: 3\ncontroller:\n  eta: 2\n")
    code = (
        "import sys; import codefleet.recipe.config as c; "
        f"cfg = c.load_train_config({str(path)!r}, ['eval.attempts=2', 'model.copy.head=false']); "
        "assert (cfg.rl.steps, cfg.controller.eta, cfg.eval.attempts) == (3, 2, 2), cfg; "
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": src}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"loading a configuration imported {out.stdout.strip()}"
