"""load_config: YAML file, then key.sub=value overrides, checked against the
dataclass's field types with errors that name the field."""

from __future__ import annotations

import pytest

from codefleet.config import ConfigError, from_dict, load_config, to_dict
from codefleet.sandbox import SandboxConfig


def _yaml(tmp_path, text):
    path = tmp_path / "sandbox.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_without_a_file():
    assert load_config(SandboxConfig) == SandboxConfig()


def test_yaml_file_then_overrides(tmp_path):
    path = _yaml(tmp_path, "memory_mb: 512\ntimeout_s: 5\nbackend: local\nenv:\n  A: one\n  B: 2\nro_binds: [/opt]\n")
    cfg = load_config(
        SandboxConfig,
        path,
        ["memory_mb=256", "env.C=three", "cpu_cores=0.5", "ro_binds=[/a, /b]", "state_dir=/var/tmp/x"],
    )
    assert cfg.memory_mb == 256
    assert cfg.timeout_s == 5.0 and isinstance(cfg.timeout_s, float)
    assert cfg.backend == "local"
    assert cfg.env == {"A": "one", "B": "2", "C": "three"}
    assert cfg.cpu_cores == 0.5
    assert cfg.ro_binds == ["/a", "/b"]
    assert cfg.state_dir == "/var/tmp/x"
    assert load_config(SandboxConfig, path, ["state_dir=null"]).state_dir is None


@pytest.mark.parametrize(
    "override, field",
    [
        ("memory_mb=lots", "memory_mb"),
        ("memory_mb=1.5", "memory_mb"),
        ("memory_mb=true", "memory_mb"),
        ("timeout_s=fast", "timeout_s"),
        ("timeout_s=yes", "timeout_s"),
        ("ro_binds=/opt", "ro_binds"),
        ("env=5", "env"),
        ("env.X=[1, 2]", "env.X"),
        ("memory_mb.sub=1", "memory_mb"),
    ],
)
def test_type_errors_name_the_field(override, field):
    with pytest.raises(ConfigError, match=f"^{field}: expected"):
        load_config(SandboxConfig, None, [override])


def test_exponents_are_floats_though_yaml_1_1_reads_them_as_text(tmp_path):
    assert load_config(SandboxConfig, None, ["timeout_s=1e-4"]).timeout_s == 1e-4
    assert load_config(SandboxConfig, _yaml(tmp_path, "timeout_s: 2E3\n")).timeout_s == 2000.0
    with pytest.raises(ConfigError, match="^timeout_s: expected float"):
        load_config(SandboxConfig, None, ["timeout_s=1e"])
    assert load_config(SandboxConfig, None, ["state_dir=1e3"]).state_dir == "1e3"  # text where text is meant


def test_an_unknown_key_is_one_sentence_naming_the_keys_it_may_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"^unknown config key 'memory': did you mean memory_mb\?$"):
        load_config(SandboxConfig, None, ["memory=512"])
    with pytest.raises(ConfigError, match=r"^unknown config key 'timeout': did you mean timeout_s\?$"):
        load_config(SandboxConfig, _yaml(tmp_path, "timeout: 3\n"))
    with pytest.raises(ConfigError, match=r"^unknown config key 'zzz': the keys here are backend, .*memory_mb"):
        load_config(SandboxConfig, None, ["zzz=1"])


@pytest.mark.parametrize("override", ["memory_mb", "=5", " =5"])
def test_malformed_overrides(override):
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(SandboxConfig, None, [override])


def test_an_override_that_is_not_yaml_says_how_to_quote_it():
    with pytest.raises(ConfigError, match="is not a YAML value; quote it"):
        load_config(SandboxConfig, None, ["env.X=[unclosed"])


def test_an_override_into_a_scalar_from_the_file(tmp_path):
    with pytest.raises(ConfigError, match="'memory_mb' is not a section"):
        load_config(SandboxConfig, _yaml(tmp_path, "memory_mb: 5\n"), ["memory_mb.x=1"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(SandboxConfig, str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(SandboxConfig, _yaml(tmp_path, "memory_mb: [1, 2\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(SandboxConfig, _yaml(tmp_path, "- memory_mb\n"))
    with pytest.raises(ConfigError, match="^memory_mb: expected int"):
        load_config(SandboxConfig, _yaml(tmp_path, "memory_mb: '512'\n"))


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_to_dict_round_trips():
    cfg = SandboxConfig(memory_mb=100, env={"A": "b"}, ro_binds=["/x"], timeout_s=2.5)
    assert from_dict(SandboxConfig, to_dict(cfg)) == cfg


def test_a_section_keeps_the_values_the_layer_beneath_gives_it(tmp_path):
    """Setting one field of a nested section leaves its other fields as the layer beneath (the recipe) has them,
    not as the section class's own defaults (an override of the reward once turned the run's costs_on back to
    "all")."""
    from codefleet.recipe.config import load_train_config

    path = tmp_path / "run.yaml"
    path.write_text("sandbox:\n  cpu_cores: 1\n")
    cfg = load_train_config(str(path), ["rl.reward.cost_per_turn=0.1", "rl.loss.kl_coef=0.01"])
    demo = load_train_config()
    assert cfg.rl.reward.cost_per_turn == 0.1
    assert cfg.rl.reward.costs_on == demo.rl.reward.costs_on == "solved"
    assert cfg.rl.reward.cost_per_tool_error == demo.rl.reward.cost_per_tool_error > 0
    assert cfg.rl.loss.kl_coef == 0.01 and cfg.rl.loss.off_policy == demo.rl.loss.off_policy == "tis"
    assert cfg.sandbox.cpu_cores == 1.0
    assert (cfg.sandbox.timeout_s, cfg.sandbox.memory_mb) == (demo.sandbox.timeout_s, demo.sandbox.memory_mb)
    assert (demo.sandbox.timeout_s, demo.sandbox.memory_mb) != (SandboxConfig().timeout_s, SandboxConfig().memory_mb)
    assert cfg.rl.steps == demo.rl.steps and cfg.tasks == demo.tasks
