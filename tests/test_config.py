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
