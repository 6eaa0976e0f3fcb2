"""The rules `promtool check metrics` holds /metrics to, on plain text: each rule the checker in
tests/gateway/helpers.py holds (and CI runs, promtool or not) is shown catching an exposition
that breaks it, and with promtool on PATH, promtool refuses that exposition too. Real scrapes are
checked in tests/gateway/test_openai_api.py and tests/coordinator/test_paths_and_roles.py."""
import shutil

import pytest

from tests.gateway.helpers import exposition_problems, promtool_check

GOOD = """# HELP pdserve_x_total A counter
# TYPE pdserve_x_total counter
pdserve_x_total{model_name="m"} 1.0
# HELP pdserve_t_seconds A histogram
# TYPE pdserve_t_seconds histogram
pdserve_t_seconds_bucket{le="1.0"} 1.0
pdserve_t_seconds_bucket{le="+Inf"} 1.0
pdserve_t_seconds_count 1.0
pdserve_t_seconds_sum 0.5
# HELP pdserve_ttft_p99_seconds A percentile as its own gauge
# TYPE pdserve_ttft_p99_seconds gauge
pdserve_ttft_p99_seconds{priority="0"} 0.25
"""
BAD = """# HELP pdserve:x_total A counter under a colon
# TYPE pdserve:x_total counter
pdserve:x_total 1.0
# HELP pdserve_y_created When a counter was made
# TYPE pdserve_y_created gauge
pdserve_y_created 1.7e9
# HELP pdserve_ttft_seconds A percentile as a label
# TYPE pdserve_ttft_seconds gauge
pdserve_ttft_seconds{quantile="0.99"} 0.25
# TYPE pdserve_w gauge
pdserve_w 1.0
# HELP pdserve_u A gauge with an le
# TYPE pdserve_u gauge
pdserve_u{le="1.0"} 1.0
"""


def test_the_checker_passes_a_clean_exposition_and_names_each_broken_rule():
    assert exposition_problems(GOOD) == []
    found = "\n".join(exposition_problems(BAD))
    for why in ("pdserve:x_total: metric names should not contain ':'", "pdserve_y_created: a _created series",
                "pdserve_ttft_seconds: non-summary metrics should not have a quantile label", "pdserve_w: no HELP for its family",
                "pdserve_u: non-histogram metrics should not have an le label"):
        assert why in found, why
    assert exposition_problems(GOOD + "# HELP pdserve_c A counter\n# TYPE pdserve_c counter\npdserve_c 1.0\n") == \
        ["pdserve_c: counter not named _total"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not on PATH (Debian's prometheus package has it)")
def test_promtool_refuses_what_the_checker_refuses():
    assert promtool_check(GOOD) == (0, "")
    status, out = promtool_check(BAD)
    assert status != 0 and "should not contain ':'" in out and 'non-summary metrics should not have "quantile" label' in out
