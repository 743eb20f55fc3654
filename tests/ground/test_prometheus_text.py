"""The one Prometheus text renderer (megatron_rl.prometheus_text): TYPE lines, names, labels, values."""
from __future__ import annotations

import pytest

from megatron_rl.prometheus_text import Sample, metric_name, render


def test_counters_and_gauges_are_typed_once_per_family_with_their_samples_together():
    text = render([Sample("reqs_total", 3, {"code": "200"}), Sample("queue", 2.5),
                   Sample("reqs_total", 1, {"code": "500"}), Sample("blocks_total", 256, kind="gauge")])
    assert text == ("# TYPE reqs_total counter\nreqs_total{code=\"200\"} 3\nreqs_total{code=\"500\"} 1\n"
                    "# TYPE queue gauge\nqueue 2.5\n"
                    "# TYPE blocks_total gauge\nblocks_total 256\n")


def test_label_values_are_escaped_and_names_sanitised():
    text = render([Sample("rl/reward-mean", 1.0, {"rule": 'a"b\\c\nd', "bad-name": "x"})])
    assert text == '# TYPE rl_reward_mean gauge\nrl_reward_mean{rule="a\\"b\\\\c\\nd",bad_name="x"} 1.0\n'
    assert metric_name("9lives") == "_9lives" and metric_name("a:b c") == "a:b_c"


def test_values_print_nan_and_infinities_the_prometheus_way():
    text = render([Sample("a", float("nan")), Sample("b", float("inf")), Sample("c", float("-inf")),
                   Sample("d", True), Sample("e", 7)])
    assert [line.split()[-1] for line in text.splitlines() if line[0] != "#"] == ["NaN", "+Inf", "-Inf", "1", "7"]


def test_a_family_typed_two_ways_or_an_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="x_total is both a counter and a gauge"):
        render([Sample("x_total", 1), Sample("x_total", 2, {"l": "v"}, kind="gauge")])
    with pytest.raises(ValueError, match="'histogram' is not one of"):
        render([Sample("h", 1, kind="histogram")])
