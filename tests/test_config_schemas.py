"""Typed configs (issue 49): every config in configs/ and every group option composes against
its schema (paged_llm/config_schemas.py); a wrong type or an unknown key fails at composition,
naming the key's path; the schemas keep the fields of the dataclasses they type."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from paged_llm import config_schemas
from paged_llm.sim.settings import ServingSettings
from paged_llm.workloads.arrivals import WorkloadSpec
from paper_repro.common import CONFIG_DIR, compose

ROOT = Path(__file__).resolve().parents[1]
PRIMARY = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "engine_groups")
# A primary config that selects each group (its options are composed there).
GROUP_HOME = {
    "attention": "throughput", "cache": "throughput", "kv_cache_dtype": "throughput",
    "model": "throughput", "policy": "throughput", "quant": "throughput",
    "scheduler": "throughput", "scheduling": "throughput", "speculative": "throughput",
    "logger": "fig2", "hardware": "fig2", "model_shape": "fig2", "workload": "fig2",
    "executor": "fig2", "device": "fig12_real", "prices": "capacity_plan",
}  # fmt: skip
GROUPS = sorted(
    (d.name, p.stem) for d in CONFIG_DIR.iterdir() if d.is_dir() and d.name in GROUP_HOME
    for p in d.glob("*.yaml")
)  # fmt: skip
# A typed node of each schema, in a config that uses it.
TYPED = {"cache": ("throughput", "cache"), "scheduler": ("throughput", "scheduler"),
         "workload": ("fig2", "workload"), "serving_engine": ("fig2", "engine"),
         "throughput": ("throughput", "")}  # fmt: skip


def test_every_group_folder_has_a_home():
    folders = {d.name for d in CONFIG_DIR.iterdir() if d.is_dir()}
    assert folders - set(GROUP_HOME) == {"calibration", "hydra"}  # JSON files; launchers below


@pytest.mark.parametrize("name", PRIMARY)
def test_every_config_composes(name):
    cfg = compose(name)
    assert OmegaConf.to_container(cfg, resolve=False)  # composed, with its schemas' fields


@pytest.mark.parametrize("name", PRIMARY)
def test_no_own_key_is_named_like_a_config_group(name):
    """A plain key of the config's own that a group folder is also named after (model=, device=,
    policy=) could not be set from the command line: Hydra reads `device=cuda` as choosing a
    group option. (A mapping key such as `workload:` is set by its dotted keys, which works.)"""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        chosen = set(hydra_compose(name, return_hydra_config=True).hydra.runtime.choices)
    own = OmegaConf.load(CONFIG_DIR / f"{name}.yaml")
    plain = {k for k, v in own.items() if not OmegaConf.is_dict(v)} - {"defaults", "hydra"}
    folders = {d.name for d in CONFIG_DIR.iterdir() if d.is_dir()}
    assert not (plain & folders) - chosen


def test_a_renamed_key_is_set_from_the_command_line():
    """throughput's engine_device and fig15's kv_policy (once `device` and `policy`, which the
    command line could not set) take `key=value` overrides."""
    assert compose("throughput", ["engine_device=cuda"]).engine_device == "cuda"
    assert compose("fig15", ["kv_policy=orca_max"]).kv_policy == "orca_max"


@pytest.mark.parametrize(("group", "option"), GROUPS)
def test_every_group_option_composes(group, option):
    cfg = compose(GROUP_HOME[group], [f"{group}={option}"])
    node = OmegaConf.select(cfg, group)
    assert node is None or OmegaConf.is_config(node) or isinstance(node, str)


@pytest.mark.parametrize("schema", sorted(TYPED))
def test_schema_types_its_node_and_refuses_a_wrong_type_or_key(schema):
    config, path = TYPED[schema]
    cfg = compose(config)
    node = OmegaConf.select(cfg, path) if path else cfg
    cls = config_schemas.SCHEMAS[schema]
    assert OmegaConf.get_type(node) is cls
    prefix = f"{path}." if path else ""
    for f in dataclasses.fields(cls):
        if f.type in ("int", "int | None", "float", "float | None", "bool"):
            with pytest.raises(ConfigCompositionException) as err:
                compose(config, [f"{prefix}{f.name}=abc"])
            assert f"full_key: {prefix}{f.name}" in str(err.value.__cause__)
    with pytest.raises(ConfigCompositionException) as err:
        compose(config, [f"{prefix}no_such_key=1"])
    assert "no_such_key" in str(err.value.__cause__)


@pytest.mark.parametrize(
    ("schema", "source"), [(config_schemas.ServingEngineSchema, ServingSettings),
                           (config_schemas.WorkloadSchema, WorkloadSpec)]
)  # fmt: skip
def test_schemas_keep_the_fields_and_defaults_of_what_they_type(schema, source):
    theirs = {f.name: f.default for f in dataclasses.fields(source)}
    ours = {f.name: f.default for f in dataclasses.fields(schema)}
    assert ours == theirs


@pytest.mark.parametrize("launcher", ["parallel", "slurm", "submitit_local", "joblib"])
def test_launchers_compose(launcher):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose("fig2", [f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert "Launcher" in cfg.hydra.launcher._target_


def test_a_wrong_type_stops_a_sweep_before_any_job(tmp_path):
    cmd = [sys.executable, "-m", "paper_repro.fig2", "-m", "engine.max_num_seqs=16,abc",
           f"hydra.sweep.dir={tmp_path / 's'}"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "sweep stopped before any job ran; [engine.max_num_seqs=abc]" in out.stderr
    assert "full_key: engine.max_num_seqs" in out.stderr
    assert not (tmp_path / "s" / "0").exists()  # job 0 (16) never started


@pytest.mark.parametrize("name", [n for n in PRIMARY if n not in ("paper_base",)])
def test_every_entry_points_help_says_what_it_does_and_where_results_land(name):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose(name, return_hydra_config=True)
    help_cfg = OmegaConf.to_container(cfg.hydra.help)  # unresolved: no Hydra app is running
    assert "${entry_help:}" in help_cfg["header"] and "Where results land" in help_cfg["template"]


ENTRY_POINTS = [("paper_repro.fig2", "fig2"), ("experiments.throughput", "throughput")]


@pytest.mark.parametrize(("module", "config"), ENTRY_POINTS)
def test_help_prints_the_docstring_the_config_comment_and_the_result_dirs(module, config):
    import importlib

    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    doc = importlib.import_module(module).__doc__.strip().splitlines()[0]
    comment = (CONFIG_DIR / f"{config}.yaml").read_text().splitlines()[0].lstrip("# ")
    assert doc in out and comment in out
    assert "One run: outputs/" in out and "sweep_mean.csv" in out and "quant: " in out
