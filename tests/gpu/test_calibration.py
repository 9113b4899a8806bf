"""benchmarks/bench_calibration.py's step lowers for compile-only H100s (BENCHMARKS.md
"calibration"): the script builds its step beside `benchmarks/_lm.py`'s loss, which reads the
embedding with `zj.take`, so a change there that the script does not follow (a table not
marked ``lookup=``) fails here rather than at the next rerun."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_calibration  # noqa: E402  pylint: disable=wrong-import-position


def test_each_published_run_lowers_at_a_small_shape():
  for run in bench_calibration.RUNS:
    tiny = run.shape._replace(vocab=512, d_model=256, layers=2, heads=4, kv_heads=2, mlp=512,
                              seq_len=256)
    lowered = bench_calibration.lower(run._replace(shape=tiny), bench_calibration.zj.gpu.H100)
    assert "all-gather" in lowered.as_text() or "all_gather" in lowered.as_text()
