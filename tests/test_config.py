import os

import pytest

import sfmonitor
from sfmonitor.config import MonitorConfig, describe


def test_defaults_and_dict_round_trip():
    cfg = MonitorConfig()
    again = MonitorConfig.from_dict(cfg.to_dict())
    assert again == cfg


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"nope": 1}, r"unknown config key nope; allowed keys: .*strict"),
        ({"stats": {"nope": 1}}, r"unknown config key stats\.nope; allowed keys under stats: "),
        ({"stats": {"update_ratio_every": -1}}, r"stats\.update_ratio_every: -1 is out of range; allowed: \[0, inf\]"),
        ({"stats": {"update_ratio_every": 1.5}}, r"stats\.update_ratio_every: expected an integer"),
        ({"strict": "yes"}, r"strict: expected true or false"),
        ({"stats": {"loss_ratio_pairs": [["a", "a"]]}}, r"stats\.loss_ratio_pairs\[0\]"),
        ({"stats": 3}, r"stats: expected a mapping"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(bad, match):
    with pytest.raises(sfmonitor.ConfigError, match=match):
        MonitorConfig.from_any(bad)


def test_yaml_file(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("strict: true\nstats:\n  update_ratio_every: 5\n")
    cfg = MonitorConfig.from_any(str(p))
    assert cfg.strict and cfg.stats.update_ratio_every == 5
    p.write_text("stats: [1, 2\n")
    with pytest.raises(sfmonitor.ConfigError, match="not valid YAML"):
        MonitorConfig.from_any(str(p))
    with pytest.raises(sfmonitor.ConfigError, match="does not exist"):
        MonitorConfig.from_any(str(tmp_path / "missing.yaml"))
    with pytest.raises(sfmonitor.ConfigError, match="must be a MonitorConfig"):
        MonitorConfig.from_any(42)


def test_monitor_rejects_bad_config_before_touching_anything():
    with pytest.raises(sfmonitor.ConfigError, match="stats.grad_ratio_every"):
        sfmonitor.Monitor(config={"stats": {"grad_ratio_every": -3}})


def test_every_field_is_documented():
    rows = describe()
    assert rows and all(doc for _, _, doc in rows)


# --------------------------------------------------------------------------------------------
# Bad input: every mistake is a ConfigError naming the key (and the line, for YAML)
# --------------------------------------------------------------------------------------------

import dataclasses  # noqa: E402
import math  # noqa: E402

import yaml  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sfmonitor.errors import ConfigError  # noqa: E402
from sfmonitor.schema import Section, option  # noqa: E402


def _yaml(tmp_path, text, name="m.yaml"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


def test_a_binary_file_or_a_folder_as_config_path(tmp_path):
    p = tmp_path / "model.pt"
    p.write_bytes(b"\x80\x02PK\x03\x04\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="model.pt.*not a UTF-8 text file"):
        MonitorConfig.from_any(str(p))
    with pytest.raises(ConfigError, match="is a folder"):
        MonitorConfig.from_any(str(tmp_path))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        MonitorConfig.from_any(_yaml(tmp_path, "- 1\n- 2\n"))


def test_a_float_written_without_a_dot_is_a_float(tmp_path):
    # PyYAML (YAML 1.1) reads 1e-6 as the string "1e-6"; a float option takes it.
    cfg = MonitorConfig.from_any(
        _yaml(tmp_path, "detectors:\n  loss_spike:\n    min_sigma: 1e-6\nactions:\n  lr_drop:\n    min_lr: 3E-7\n")
    )
    assert cfg.detectors.loss_spike.min_sigma == 1e-6 and cfg.actions.lr_drop.min_lr == 3e-7
    for bad in ('"abc"', '"1e"', '"nan"', '"inf"', '"0x10"', '"1_0"'):
        with pytest.raises(ConfigError, match="detectors.loss_spike.min_sigma: expected a number"):
            MonitorConfig.from_any(_yaml(tmp_path, f"detectors:\n  loss_spike:\n    min_sigma: {bad}\n"))
    with pytest.raises(ConfigError, match="expected an integer"):  # only float options
        MonitorConfig.from_any(_yaml(tmp_path, "stats:\n  update_ratio_every: 1e3\n"))


def test_duplicate_yaml_keys_name_the_key_and_the_line(tmp_path):
    with pytest.raises(ConfigError, match=r"duplicate key 'strict' at line 3 \(first at line 1\)"):
        MonitorConfig.from_any(_yaml(tmp_path, "strict: true\nconsole: false\nstrict: false\n"))
    with pytest.raises(ConfigError, match=r"duplicate key 'z' at line 4"):
        MonitorConfig.from_any(_yaml(tmp_path, "detectors:\n  loss_spike:\n    z: 4\n    z: 5\n"))
    # a merge key is an override, not a duplicate
    text = "base: &b {z: 4.0}\n"
    assert yaml.safe_load(text + "x:\n  <<: *b\n  z: 5.0\n")["x"]["z"] == 5.0  # PyYAML itself
    cfg = MonitorConfig.from_any(
        _yaml(tmp_path, "detectors:\n  loss_spike: &b {z: 4.0}\n  grad_spike:\n    <<: *b\n    z: 5.0\n")
    )
    assert cfg.detectors.grad_spike.z == 5.0


@pytest.mark.parametrize(
    "text, match",
    [
        ("detectors:\n  loss_spike:\n    z: .inf\n", r"detectors\.loss_spike\.z: inf is not allowed"),
        ("detectors:\n  grad_spike:\n    alpha: .nan\n", r"detectors\.grad_spike\.alpha: nan is not allowed"),
        ("detectors:\n  accuracy_collapse:\n    chance: .nan\n", r"accuracy_collapse\.chance: nan"),
        ("bundle:\n  max_mb: .inf\n", r"bundle\.max_mb: inf is not allowed"),
        ("actions:\n  clip:\n    max_grad_norm: -.inf\n", r"max_grad_norm: -inf is not allowed"),
    ],
)
def test_non_finite_values_are_refused_for_float_options(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        MonitorConfig.from_any(_yaml(tmp_path, text))


@dataclasses.dataclass
class _Opts(Section):
    """A section of the test's own, for options no built-in section has."""

    limit: float = option(1.0, "may be inf", lo=0.0, allow_inf=True)
    finite: float = option(1.0, "may not")
    weights: dict[str, float] = option({}, "floats in a mapping")
    kinds: list[str] = option([], "names from a fixed set", choices=("a", "b"))


def test_allow_inf_and_nested_floats_and_list_choices():
    assert _Opts.from_dict({"limit": math.inf}).limit == math.inf
    with pytest.raises(ConfigError, match="limit: nan is not allowed"):
        _Opts.from_dict({"limit": math.nan})
    with pytest.raises(ConfigError, match="finite: inf is not allowed"):
        _Opts(finite=math.inf)
    with pytest.raises(ConfigError, match=r"weights\.a: inf is not allowed"):
        _Opts.from_dict({"weights": {"a": math.inf}})
    assert _Opts.from_dict({"kinds": ["a", "b"]}).kinds == ["a", "b"]
    with pytest.raises(ConfigError, match=r"kinds\[1\]: 'c' is not allowed; choose one of 'a', 'b'"):
        _Opts.from_dict({"kinds": ["a", "c"]})


@pytest.mark.parametrize("subdir", ["/tmp/ckpt", "../outside", "a/../../b", "", "a\\..\\..\\b"])
def test_checkpoint_subdir_stays_inside_run_dir(subdir):
    with pytest.raises(ConfigError, match="actions.checkpoint.subdir"):
        MonitorConfig.from_any({"actions": {"checkpoint": {"subdir": subdir}}})
    assert MonitorConfig.from_any({"actions": {"checkpoint": {"subdir": "ckpt/emergency"}}})


def test_graceful_kinds_are_event_kinds():
    from sfmonitor.events import EVENT_KINDS

    cfg = MonitorConfig.from_any({"actions": {"stop": {"graceful_kinds": ["plateau", "loss_spike"]}}})
    assert cfg.actions.stop.graceful_kinds == ["plateau", "loss_spike"]
    with pytest.raises(
        ConfigError,
        match=r"actions\.stop\.graceful_kinds\[1\]: 'platoe' is not an "
        r"event kind; known kinds: .*plateau",
    ):
        MonitorConfig.from_any({"actions": {"stop": {"graceful_kinds": ["loss_spike", "platoe"]}}})
    assert "plateau" in EVENT_KINDS


def test_keys_of_mixed_types_are_a_config_error():
    with pytest.raises(ConfigError, match="unknown config key 1"):
        MonitorConfig.from_any({1: 2, "zzz": 3})
    with pytest.raises(ConfigError, match="unknown config key"):
        MonitorConfig.from_any({None: 1})


_FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def _config_or_config_error(path):
    try:
        return MonitorConfig.from_any(path)
    except ConfigError:
        return None


@_FUZZ
@given(text=st.text(max_size=300))
@example(text="a: " + "1" * 5000)  # an int Python refuses to parse
@example(text="when: 2020-13-45")  # a timestamp with month 13
@example(text="[" * 2000)  # nested deeper than the parser's recursion
@example(text="!!python/object:os.system {}")  # not safe YAML
@example(text="? [a, b]\n: 1\n")  # an unhashable key
@example(text="1: a\nb: c\n")  # keys of mixed types
@example(text="\x00")
def test_any_yaml_text_gives_a_config_or_a_config_error(tmp_path, text):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    _config_or_config_error(str(path))


@_FUZZ
@given(data=st.binary(max_size=300))
def test_any_bytes_give_a_config_or_a_config_error(tmp_path, data):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    _config_or_config_error(str(path))


def _known_keys(section, prefix=""):
    return [k for k, _, _ in describe(section, prefix)]


_KEYS = sorted({k for k in _known_keys(MonitorConfig)})
_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-10, 10**6)
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(["1e-6", "2E3", ".5e1", "plateau", "loss_spike", "skip_step", "clip", "/abs", "../up"])
)
_VALUES = st.recursive(
    _LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def _nest(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else {}
        node[leaf] = value
    return out


@_FUZZ
@given(flat=st.dictionaries(st.sampled_from(_KEYS), _VALUES, min_size=1, max_size=5))
def test_any_values_for_the_real_keys_give_a_config_or_a_config_error(tmp_path, flat):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(_nest(flat)), encoding="utf-8")
    cfg = _config_or_config_error(str(path))
    if cfg is not None:  # what loads is finite and round-trips
        assert MonitorConfig.from_dict(cfg.to_dict()) == cfg


def test_the_configuration_page_lists_every_key_as_the_code_has_it():
    """docs/config.md is ``sfmonitor.config.reference()``: every key with its default and doc, so
    a key added, renamed or given a new default shows there (a newcomer's audit found keys no page
    named)."""
    from sfmonitor.config import describe, reference

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    page = open(os.path.join(root, "docs", "config.md"), encoding="utf-8").read()
    assert page == reference(), (
        "docs/config.md is stale: python -c \"import sfmonitor.config as c; print(c.reference(), end='')\" "
        "> docs/config.md"
    )
    keys = [k for k, _, _ in describe()]
    assert len(keys) > 100 and all(f"| `{k}` |" in page for k in keys)
    assert "| `policy.budget` | `10` |" in page and "| `actions.lr_drop.min_lr` | `0.0` |" in page
