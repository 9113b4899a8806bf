"""benchmarks/bench_scale.py's reading of its plans (no compile, no plugin): the check that a
plan's best is the fastest fitting program compiled for its row, and ZeRO++'s hpZ claim."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_scale  # noqa: E402

MiB = 2**20


def reading(name, step_ms, fits=True, cross=0.0):
  return {"name": name, "bytes": 1.0, "cross": cross, "intra": 0.0, "step": step_ms / 1e3,
          "compute": 0.0, "fits": fits}


def run(hosts, best, candidates, **extra):
  return {"model": "m", "hosts": hosts, "best": best, "closest": best,
          "candidates": candidates, **extra}


def test_the_best_that_is_the_fastest_fitting_program_passes():
  best = reading("ZeRO-3 hybrid prefetch 1 remat saving dots", 20.0)
  cands = [best, reading("ZeRO-3 hybrid prefetch 1 no remat", 26.0),
           reading("ZeRO-3 flat prefetch 1 no remat", 10.0, fits=False)]   # faster, too big
  r = run(2, best, cands, hpz=reading("ZeRO-3 hpZ prefetch 1 remat saving dots", 21.0),
          flat=cands[0])
  assert bench_scale.fastest_fitting(r) == "yes (3 of 4 fit)"


def test_a_faster_fitting_program_compiled_beside_the_plan_is_named():
  # The hpZ program compiled beside the plan (not among its candidates) fits and is
  # predicted faster than the plan's best: the plan missed it, and the row says so.
  best = reading("ZeRO-3 hybrid prefetch 1 remat saving dots", 20.0)
  r = run(2, best, [best], hpz=reading("ZeRO-3 hpZ prefetch 1 remat saving dots", 19.5),
          flat=reading("ZeRO-3 flat prefetch 1 remat saving dots", 30.0))
  assert bench_scale.fastest_fitting(r) == (
      "**no**: ZeRO-3 hpZ prefetch 1 remat saving dots (19.5 ms)")


def test_a_lower_ranked_layout_faster_at_the_best_policy_is_named():
  # The plan compiled its second layout without remat only; compiled beside it at the best's
  # policy (a "sibling"), it fits and is faster than the best.
  best = reading("ZeRO-3 hybrid gather_once prefetch 1 remat saving dots", 21.9)
  cands = [best, reading("ZeRO-3 hybrid prefetch 1 no remat", 27.2)]
  r = run(8, best, cands, siblings=[reading("ZeRO-3 hybrid prefetch 1 remat saving dots", 21.0)])
  assert bench_scale.fastest_fitting(r) == (
      "**no**: ZeRO-3 hybrid prefetch 1 remat saving dots (21.0 ms)")
  r["siblings"][0]["fits"] = False
  assert bench_scale.fastest_fitting(r) == "yes (2 of 3 fit)"


def test_nothing_fits_is_said_not_ranked():
  c = reading("ZeRO-3 flat prefetch 1 full remat", 5.0, fits=False)
  assert bench_scale.fastest_fitting(run(1, None, [c])) == "nothing fits (0 of 1)"


def test_the_hpz_claim_holds_for_a_flat_per_host_share_and_not_for_a_growing_one():
  def runs(per_host_share_at_32):
    # (h-1)/h of a share: 2 hosts send half of 60 MiB, 32 hosts 31/32 of the given share.
    two = run(2, None, [], hpz=reading("h", 1, cross=30 * MiB), flat=reading("f", 1, cross=600 * MiB))
    many = run(32, None, [], hpz=reading("h", 1, cross=31 / 32 * per_host_share_at_32 * MiB),
               flat=reading("f", 1, cross=630 * MiB))
    return [two, many]
  assert "The claim holds" in bench_scale.claim(runs(60.0))[0]
  assert "x1.000" in bench_scale.claim(runs(60.0))[0]
  assert "the claim does not hold" in bench_scale.claim(runs(66.0))[0]


def test_the_estimates_order_beside_the_compiled_one_names_a_reversal():
  # GPT-2 small on 4 x 8: hybrid first by estimate, flat compiled faster without remat.
  est = [{"name": "ZeRO-3 hybrid prefetch 1 no remat", "est": 10.84e-3},
         {"name": "ZeRO-3 flat prefetch 1 no remat", "est": 10.91e-3}]
  cands = [reading("ZeRO-3 hybrid prefetch 1 no remat", 27.4),
           reading("ZeRO-3 flat prefetch 1 no remat", 27.1),
           reading("ZeRO-3 flat prefetch 1 remat saving dots", 20.5)]
  row = bench_scale.ordering(run(4, cands[2], cands, estimated=est))
  assert row == ("| m | 4 x 8 | ZeRO-3 hybrid 10.84, ZeRO-3 flat 10.91 | ZeRO-3 flat 27.1, "
                 "ZeRO-3 hybrid 27.4 | no: 1 compiled faster than the estimate's first | "
                 "+0.6% |")
  cands[1]["step"] = 27.5e-3
  assert "| yes | - |" in bench_scale.ordering(run(4, cands[2], cands, estimated=est))
  assert bench_scale.ordering(run(4, cands[2], cands)).endswith("| - | - | - | - |")
