"""Config system: round trip, overrides, and every rejection path with its message."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

import pytest
import yaml

from megatron_rl import config as C
from megatron_rl.config import ConfigError
from megatron_rl.models.gpt import ModelConfig
from megatron_rl.parallel import ParallelConfig


class Color(Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Inner:
    """A nested section."""

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR schedule."""

    def validate(self):
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")


@dataclass
class Outer:
    """The top level."""

    name: str = "run"
    """Run name."""
    steps: int = 10
    """Training steps."""
    seed: int | None = None
    """Seed; None picks one."""
    tags: list[str] = field(default_factory=list)
    """Free-form tags."""
    weights: dict[str, float] = field(default_factory=dict)
    """Per-domain weights."""
    color: Color = Color.RED
    """An enum."""
    inner: Inner = field(default_factory=Inner)
    """Optimiser section."""


def test_round_trip_yaml(tmp_path):
    cfg = Outer(name="x", steps=3, seed=7, tags=["a"], weights={"math": 0.5}, color=Color.BLUE,
                inner=Inner(lr=2e-5, betas=(0.8, 0.9), schedule="cosine"))
    path = tmp_path / "c.yaml"
    path.write_text(C.dump_yaml(cfg))
    assert C.load(Outer, path) == cfg


def test_overrides_types_and_nesting(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"steps": 5, "inner": {"lr": 0.1}}))
    cfg = C.load(Outer, path, ["inner.lr=1e-6", "steps=9", "tags=[a, b]", "weights.code=2", "seed=null"])
    assert cfg.inner.lr == pytest.approx(1e-6) and isinstance(cfg.inner.lr, float)
    assert cfg.steps == 9 and cfg.tags == ["a", "b"] and cfg.weights == {"code": 2.0} and cfg.seed is None


def test_int_accepted_for_float_but_not_bool_for_int():
    assert C.from_dict(Inner, {"lr": 1}).lr == 1.0
    with pytest.raises(ConfigError, match=r"'steps': expected int, got bool True"):
        C.from_dict(Outer, {"steps": True})


@pytest.mark.parametrize("data, message", [
    ({"stepz": 3}, r"unknown config key 'stepz' \(did you mean 'steps'\?\); Outer accepts: "),
    ({"inner": {"lrr": 3}}, r"unknown config key 'inner.lrr' \(did you mean 'lr'\?\)"),
    ({"steps": "ten"}, r"config key 'steps': expected int, got str 'ten'"),
    ({"inner": {"schedule": "linear"}},
     r"config key 'inner.schedule': 'linear' is not one of \['constant', 'cosine'\]"),
    ({"inner": {"betas": [0.9]}}, r"config key 'inner.betas': expected 2 items, got 1"),
    ({"tags": "a"}, r"config key 'tags': expected a list"),
    ({"weights": {"m": "x"}}, r"config key 'weights.m': expected float"),
    ({"color": "green"}, r"config key 'color': 'green' is not one of \['red', 'blue'\]"),
    ({"inner": 3}, r"config key 'inner': expected a mapping for Inner"),
    ({"inner": {"lr": -1.0}}, r"config section 'inner': lr must be > 0, got -1.0"),
    ({"seed": 1.5}, r"config key 'seed': expected int or NoneType, got 1.5"),
])
def test_rejections_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        C.from_dict(Outer, data)


def test_bad_overrides_and_files(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'steps' must look like key.sub=value"):
        C.apply_overrides({}, ["steps"])
    with pytest.raises(ConfigError, match=r"'name' is a value, not a section"):
        C.apply_overrides({"name": "x"}, ["name.sub=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'inner.nope'"):
        C.load(Outer, None, ["inner.nope=1"])
    with pytest.raises(ConfigError, match=r"does not exist"):
        C.load(Outer, tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"must hold a mapping at the top level"):
        C.load(Outer, tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML"):
        C.load(Outer, tmp_path / "bad.yaml")


def test_field_docs_are_extracted_and_missing_ones_found():
    assert C.field_docs(Inner)["lr"] == "Learning rate."

    @dataclass
    class Undocumented:
        a: int = 1

    assert C.undocumented_fields(Undocumented) == ["Undocumented.a"]
    assert C.undocumented_fields(Outer) == []


def test_shipped_component_configs_document_every_field():
    for cls in (ParallelConfig, ModelConfig):
        assert C.undocumented_fields(cls) == [], cls


def test_parallel_validation_messages():
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel needs parallel.tp > 1"):
        C.from_dict(ParallelConfig, {"sequence_parallel": True})
    with pytest.raises(ConfigError, match=r"parallel.vpp > 1 needs parallel.pp > 1"):
        C.from_dict(ParallelConfig, {"vpp": 2})
    with pytest.raises(ConfigError, match=r"parallel.tp must be >= 1, got 0"):
        C.from_dict(ParallelConfig, {"tp": 0})
    with pytest.raises(ConfigError, match=r"unknown config key 'dp'"):  # derived, never set by hand
        C.from_dict(ParallelConfig, {"dp": 2})


def test_parallel_resolve_derives_dp_and_rejects_impossible_layouts():
    assert ParallelConfig(tp=2, pp=2).resolve(8).dp == 2
    assert ParallelConfig(tp=2, cp=2).resolve(4).dp == 1
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp\*cp\*pp = 2\*1\*2 = 4"):
        ParallelConfig(tp=2, pp=2).resolve(6)
    with pytest.raises(ConfigError, match=r"world size 4 is not divisible by etp\*ep\*pp = 1\*8\*1 = 8"):
        ParallelConfig(ep=8, etp=1).resolve(4)


def test_parallel_checks_against_the_model():
    model = ModelConfig(num_layers=4, num_attention_heads=4, num_query_groups=2, hidden_size=64)
    model.check_parallel(ParallelConfig(tp=2, pp=2))
    with pytest.raises(ConfigError, match=r"num_query_groups=2 is not divisible by parallel.tp=4"):
        model.check_parallel(ParallelConfig(tp=4))
    with pytest.raises(ConfigError, match=r"model.num_layers=4 is not divisible by parallel.pp\*vpp = 6"):
        model.check_parallel(ParallelConfig(pp=3, vpp=2))
    with pytest.raises(ConfigError, match=r"parallel.ep > 1 needs a MoE model"):
        model.check_parallel(ParallelConfig(ep=2))
    with pytest.raises(ConfigError, match=r"fp8 needs model.transformer_impl=transformer_engine"):
        C.from_dict(ModelConfig, {"fp8": "delayed"})


@dataclass
class Parent:
    """A parent whose nested section's defaults differ from the nested class's own."""

    inner: Inner = field(default_factory=lambda: Inner(lr=0.5, schedule="cosine"))
    """Section with parent-level defaults."""
    other: Inner = field(default_factory=Inner)
    """Section with the class defaults."""


def test_partial_nested_section_keeps_the_parents_defaults():
    cfg = C.from_dict(Parent, {"inner": {"betas": [0.8, 0.9]}})
    assert (cfg.inner.lr, cfg.inner.schedule, cfg.inner.betas) == (0.5, "cosine", (0.8, 0.9))
    cfg = C.load(Parent, None, ["inner.lr=0.25", "other.lr=0.1"])
    assert (cfg.inner.lr, cfg.inner.schedule) == (0.25, "cosine") and cfg.other.schedule == "constant"
    with pytest.raises(ConfigError, match=r"config section 'inner': lr must be > 0"):
        C.from_dict(Parent, {"inner": {"lr": -1.0}})


def test_yaml11_exponent_without_dot_is_a_float():
    """PyYAML (YAML 1.1) reads `1e-5` as a string; a float field takes it, anything else still fails."""
    from megatron_rl.config import ConfigError, from_dict
    from megatron_rl.models.gpt import ModelConfig

    assert from_dict(ModelConfig, {"norm_epsilon": "1e-05"}).norm_epsilon == 1e-5
    with pytest.raises(ConfigError, match="config key 'norm_epsilon': expected float, got str 'tiny'"):
        from_dict(ModelConfig, {"norm_epsilon": "tiny"})
