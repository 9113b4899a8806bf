"""The planner's search space and fallbacks (`zero_jax.gpu.candidates`), without compiling."""

import jax
import pytest

from zero_jax.gpu import candidates as cands

DOTS, NOTHING = cands.POLICIES[1], cands.POLICIES[2]


def names(space):
  return [cands.describe(o) for o in space]


def test_a_plain_space_is_exact_and_quantize_search_adds_the_lossy_choices():
  plain = cands.search_space({}, hosts=2, per_host=8, takes_prefetch=True)
  assert {o["quantize"] for o in plain} == {None} and not any(map(cands.lossy, plain))
  searched = cands.search_space({"quantize": "search"}, hosts=2, per_host=8,
                                takes_prefetch=True)
  assert len(searched) == 3 * len(plain) and sum(map(cands.lossy, searched)) == 14
  assert [o for o in searched if not cands.lossy(o)] == plain


def test_a_loss_with_a_policy_keyword_starts_without_remat_and_has_it_as_a_fallback():
  def loss_fn(params, batch, *, prefetch=1, policy=None):
    return 0.0
  assert cands.takes_keyword(loss_fn, "policy") and not cands.takes_keyword(len, "policy")
  space = cands.search_space({}, hosts=1, per_host=8, takes_prefetch=True, takes_policy=True)
  assert all(o["policy"] is None for o in space)
  assert names(space)[0] == "ZeRO-2 flat prefetch 1 no remat"
  chain = [o for _, o in cands.fallbacks(space[0], 4, {})]
  assert {o["policy"] for o in chain} == {None, DOTS, NOTHING}
  assert "ZeRO-2 flat prefetch 1 remat saving dots" in names(chain)


def test_fallbacks_go_one_change_at_a_time_in_a_fixed_order_and_end_at_the_leanest():
  root = {"stage": 3, "axis_name": "data", "quantize": None, "prefetch": 1, "policy": None}
  chain = cands.fallbacks(root, 4, {})
  assert chain[0] == ((0, 0, 0, 0), root)
  assert names([o for _, o in chain[1:6]]) == [
      "ZeRO-3 flat prefetch 0 no remat", "ZeRO-3 flat prefetch 1 remat saving dots",
      "ZeRO-3 flat prefetch 1 no remat 2 micro-batches",
      "ZeRO-3 flat prefetch 1 no remat offload",      # offload keeps prefetch 1
      "ZeRO-3 flat prefetch 1 full remat"]
  assert chain[-1] == ((1, 2, 2, 1), {**root, "prefetch": 0, "policy": NOTHING,
                                      "grad_accum_steps": 4, "offload": "optimizer"})
  assert len(chain) == 2 * 3 * 3 * 2 and len({str(lv) for lv, _ in chain}) == len(chain)
  # The order only ever adds changes: every variant comes after those it is leaner than.
  for i, (lv, _) in enumerate(chain):
    assert all(not all(a <= b for a, b in zip(lv, later)) or lv == later
               for later, _ in chain[:i])


def test_fixed_options_and_indivisible_rows_are_not_varied():
  root = {"stage": 3, "axis_name": "data", "prefetch": None}
  assert cands.fallbacks(root, 3, {"offload": None}) == [((0, 0, 0, 0), root)]
  chain = cands.fallbacks(root, 6, {})   # 2 divides 6 rows, 4 does not
  assert names([o for _, o in chain]) == ["ZeRO-3 flat", "ZeRO-3 flat 2 micro-batches",
                                          "ZeRO-3 flat offload",
                                          "ZeRO-3 flat 2 micro-batches offload"]


@pytest.mark.parametrize("opts, fixed, hosts, per_host, says", [
    ({"stage": 3, "hpz_axis": "data"}, {}, 2, 1, "hpZ within a host of 1 GPU"),
    ({"stage": 2, "replica_axis": "hosts"}, {}, 2, 1, "hybrid sharding with 1 GPU per host"),
    ({"stage": 3}, {}, 1, 1, "one GPU: nothing to split"),
    ({"stage": 3, "hpz_axis": "data"}, {"hpz_axis": "data"}, 2, 1, None),  # the user's choice
    ({"stage": 3, "hpz_axis": "data"}, {}, 2, 8, None),
])
def test_a_cluster_shape_that_makes_an_option_useless_says_why(opts, fixed, hosts, per_host, says):
  why = cands.pointless(opts, fixed, hosts=hosts, per_host=per_host)
  assert (why is None) if says is None else (says in why)


def test_policies_run_from_keeping_everything_to_saving_nothing():
  assert cands.POLICIES[0] is None
  assert DOTS is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  assert NOTHING is jax.checkpoint_policies.nothing_saveable


def test_with_a_policy_loss_the_budget_compares_every_policy_of_the_fastest_layout_first():
  # Before: only "no remat" was compiled unless nothing fitted, so GPT-2 small's plan returned
  # no remat at 47.4 ms where its own model predicted 29.1 ms with full remat (issue 46).
  lays = [{"stage": s, "axis_name": "data", "prefetch": 1, "policy": None} for s in (3, 2)]
  done, left = cands.compile_order(lays, 4)
  assert names(done) == ["ZeRO-3 flat prefetch 1 no remat", "ZeRO-3 flat prefetch 1 remat "
                         "saving dots", "ZeRO-3 flat prefetch 1 full remat",
                         "ZeRO-2 flat prefetch 1 no remat"]
  assert names(left) == ["ZeRO-2 flat prefetch 1 remat saving dots",
                         "ZeRO-2 flat prefetch 1 full remat"]
  assert [cands.layouts_to_compile(k, lays[0]) for k in (1, 3, 4, 6, 7)] == [1, 1, 2, 2, 3]
  assert cands.compile_order(lays, 1)[0] == [lays[0]]
  # Without a policy keyword, one compile per layout, as before.
  plain = [{k: v for k, v in o.items() if k != "policy"} for o in lays]
  assert cands.compile_order(plain, 4) == (plain, [])
  assert cands.layouts_to_compile(4, plain[0]) == 4


class FakeSearch:
  """What `search._policy_jobs` uses of a `search.Search`: prepare, lower, skipped."""

  def __init__(self):
    self.skipped, self.lowered = [], []

  def prepare(self, opts):
    return ("step", opts), 7

  def lower(self, step):
    self.lowered.append(step[1])
    return ("lowered", step[1]["policy"])

  def out_of_time(self, left):
    return False


def test_the_ranked_layout_keeps_its_lowered_program_and_the_variants_past_the_budget_are_said():
  from zero_jax.gpu import search
  root = {"stage": 3, "axis_name": "data", "prefetch": 1, "policy": None}
  other = {**root, "stage": 2}
  s = FakeSearch()
  jobs = search._policy_jobs(s, [(1e-3, root, "root's program", 5),
                                 (2e-3, other, "other's program", 6)], 4)
  assert [(cands.describe(o), low, host) for o, low, host in jobs] == [
      ("ZeRO-3 flat prefetch 1 no remat", "root's program", 5),
      ("ZeRO-3 flat prefetch 1 remat saving dots", ("lowered", DOTS), 7),
      ("ZeRO-3 flat prefetch 1 full remat", ("lowered", NOTHING), 7),
      ("ZeRO-2 flat prefetch 1 no remat", "other's program", 6)]
  assert [o["policy"] for o in s.lowered] == [DOTS, NOTHING]   # the roots are not lowered again
  assert names([o for o, _ in s.skipped]) == ["ZeRO-2 flat prefetch 1 remat saving dots",
                                              "ZeRO-2 flat prefetch 1 full remat"]
  assert all("max_compiles=4 went to layouts ranked faster" in why for _, why in s.skipped)


def _layout(stage):
  return [{"stage": stage, "axis_name": "data", "prefetch": 1, "policy": p}
          for p in cands.POLICIES]


def test_a_layout_that_compiled_faster_than_ranked_gets_its_other_policies():
  # bench_scale, GPT-2 small on 32 x 8 H100: the second layout, compiled without remat only,
  # beat the first without remat; the first's best (saving dots) was then 9% slower than the
  # second under saving dots, which the plan never compiled.
  a, b = _layout(3), _layout(2)
  done = [(a[0], 0.050), (a[1], 0.040), (a[2], 0.045), (b[0], 0.048)]
  assert names(cands.reversed_layouts(done)) == names(b[1:])
  assert cands.reversed_layouts(done[:3] + [(b[0], 0.050)]) == []  # a tie is no reversal
  assert cands.reversed_layouts(done[:3] + [(b[0], 0.052)]) == []
  assert cands.reversed_layouts(done + [(b[1], 0.030), (b[2], 0.031)]) == []  # all compiled
  # Only layouts whose every policy was compiled are the yardstick; without one, nothing.
  assert cands.reversed_layouts([(a[0], 0.05), (b[0], 0.01)]) == []
  # A loss without a policy keyword: no variants to add.
  plain = [({"stage": s, "axis_name": "data"}, t) for s, t in ((3, 0.05), (2, 0.01))]
  assert cands.reversed_layouts(plain) == []


class FakeCompiles(FakeSearch):
  """`search.reversed_policies`' use of a `search.Search`: compile with made-up times."""

  def __init__(self, times, refuse=()):
    super().__init__()
    self.times, self.refuse, self.compiled = times, refuse, []

  def prepare(self, opts):
    return None if cands.describe(opts) in self.refuse else super().prepare(opts)

  def compile(self, jobs, workers):
    import types
    out = [(o, types.SimpleNamespace(step_time_s=self.times[cands.describe(o)], fits=True))
           for o, _, _ in jobs]
    self.compiled += [cands.describe(o) for o, _ in out]
    return out


def test_reversed_policies_compiles_until_no_layout_beats_a_whole_one():
  from zero_jax.gpu import search
  a, b, c = _layout(3), _layout(2), _layout(1)
  t = {**{cands.describe(o): x for o, x in zip(a, (0.050, 0.040, 0.045))},
       **{cands.describe(o): x for o, x in zip(b, (0.048, 0.036, 0.039))},
       **{cands.describe(o): x for o, x in zip(c, (0.049, 0.035, 0.030))}}
  made = [a[0], a[1], a[2], b[0]]
  s = FakeCompiles(t)
  s.skipped = [(b[1], "not compiled: max_compiles=4 ...")]
  done = [types_ns(t[cands.describe(o)]) for o in made]
  search.reversed_policies(s, done, made, workers=2)
  assert s.compiled == names(b[1:])          # c was never compiled: nothing to compare
  assert names(made) == names(a + b) and s.skipped == []   # compiled: no longer "skipped"
  # c compiled without remat beats b's (whole now) -> c's other policies, then nothing more.
  s2 = FakeCompiles(t)
  made2 = list(a) + list(b) + [c[0]]
  done2 = [types_ns(t[cands.describe(o)]) for o in made2]
  done2[-1] = types_ns(0.047)  # c without remat: faster than b's 0.048
  search.reversed_policies(s2, done2, made2, workers=2)
  assert s2.compiled == names(c[1:])
  # A variant that cannot be built ends the refinement (never retried forever).
  s3 = FakeCompiles(t, refuse=(cands.describe(b[1]),))
  made3, done3 = [a[0], a[1], a[2], b[0]], [types_ns(x) for x in (0.05, 0.04, 0.045, 0.048)]
  search.reversed_policies(s3, done3, made3, workers=2)
  assert s3.compiled == [cands.describe(b[2])]


def test_each_compiled_layout_is_compiled_at_the_best_policy_too():
  # bench_scale, GPT-2 small on 4 x 8 H100: flat ZeRO-3 (b), a near tie compiled without remat
  # only, was slower there than flat ZeRO-3 gather_once (a, every policy compiled): 26.0 vs
  # 25.8 ms, so no reversal; saving dots it was faster, 19.7 vs 20.0 ms, never compiled.
  from zero_jax.gpu import search
  a, b = _layout(3), _layout(2)
  t = {**{cands.describe(o): x for o, x in zip(a, (0.0258, 0.0200, 0.0210))},
       **{cands.describe(o): x for o, x in zip(b, (0.0260, 0.0197, 0.0205))}}
  made = [a[0], a[1], a[2], b[0]]
  assert cands.reversed_layouts([(o, t[cands.describe(o)]) for o in made]) == []
  assert names(cands.at_policy(made, a[1]["policy"])) == names([b[1]])
  s = FakeCompiles(t)
  done = [types_ns(t[cands.describe(o)]) for o in made]
  search.reversed_policies(s, done, made, workers=2)
  # b under the best's policy; faster there than a, so its remaining policy too
  assert s.compiled == names([b[1], b[2]])
  best = min(zip(done, made), key=lambda x: x[0].step_time_s)[1]
  assert cands.describe(best) == cands.describe(b[1])
  # a candidate that does not fit does not set the policy: the fastest fitting one does
  s2 = FakeCompiles(t)
  made2 = [a[0], a[1], a[2], b[0]]
  done2 = [types_ns(t[cands.describe(o)]) for o in made2]
  done2[1].fits = False  # a saving dots: too big
  search.reversed_policies(s2, done2, made2, workers=2)
  # at a's fastest fitting policy, full remat; faster there than a, so b's other one too
  assert s2.compiled == names([b[2], b[1]])


def types_ns(step_time_s):
  import types
  return types.SimpleNamespace(step_time_s=step_time_s, fits=True)


def test_near_ties_are_the_exact_candidates_the_estimate_cannot_order():
  a, b, c = ({"stage": s, "axis_name": "data", "quantize": None} for s in (3, 2, 1))
  lossy = {**a, "quantize": cands.QUANTIZE[1]}
  tie = cands.NEAR_TIE
  # Within NEAR_TIE of the fastest exact estimate (inclusive), and no further.
  got = cands.near_ties([(1.0, a), (1.0 + 0.99 * tie, b), (1.0 + 1.01 * tie, c)])
  assert got == [a, b]
  # The yardstick is the fastest EXACT estimate: a lossy one faster still is no yardstick and
  # no tie (its estimate leaves quantization's work out).
  got = cands.near_ties([(0.5, lossy), (1.0, a), (1.0 + 0.99 * tie, b)])
  assert got == [a, b]
  assert cands.near_ties([(0.5, lossy)]) == [] and cands.near_ties([]) == []
  assert cands.near_ties([(1.0, a), (1.03, b)], within=0.02) == [a]


class FakeRank(FakeCompiles):
  """`search.rank`'s use of a `search.Search`, with made-up estimates and predictions."""

  def __init__(self, times):
    super().__init__(times)
    self.fixed, self.pruned, self.device, self.target = {}, [], None, None
    self.estimated = []

  def prepare(self, opts, prune=True):
    return ("step", opts), 0

  def lower(self, step):
    return ("lowered", step[1])

  def compile(self, jobs, workers):
    import types
    out = [(o, types.SimpleNamespace(step_time_s=self.times[cands.describe(o)], fits=True,
                                     bytes_per_device=1)) for o, _, _ in jobs]
    self.compiled += [cands.describe(o) for o, _ in out]
    return out


def _plan_of(space, estimates, times, monkeypatch, max_compiles=4):
  """The plan's best (name) and what it compiled (names, in order), on made-up estimates of
  the lowered ``space`` and made-up predictions of the compiled programs."""
  from zero_jax.gpu import measure, plan, search
  monkeypatch.setattr(measure, "estimate",
                      lambda low, device, prefetch: estimates[cands.describe(low[1])])
  s = FakeRank(times)
  done, made, _ = search.rank(s, space, max_compiles, workers=2)
  search.reversed_policies(s, done, made, workers=2)
  best = plan.ranked(done)[0]
  return cands.describe(made[[id(c) for c in done].index(id(best))]), s.compiled


def test_a_near_tie_by_the_estimate_is_compiled_and_the_faster_returned(monkeypatch):
  # bench_scale, GPT-2 small on 4 x 8 H100s: hybrid was estimated 2% faster than flat ZeRO-3
  # (the estimate has no memory-bound work, where hybrid does 0.3 ms more) and got every
  # policy; flat was never compiled, and the plan returned hybrid saving dots at 20.8 ms
  # where flat saving dots compiles to 20.5 ms.
  hyb, once, flat, two = (
      [{"stage": st, "axis_name": ax, **extra, "quantize": None, "prefetch": 1, "policy": p}
       for p in cands.POLICIES]
      for st, ax, extra in ((3, "data", {"replica_axis": "hosts"}),
                            (3, "data", {"replica_axis": "hosts", "gather_once": True}),
                            (3, ("hosts", "data"), {}), (2, ("hosts", "data"), {})))
  estimates = {cands.describe(hyb[0]): 11.05e-3, cands.describe(once[0]): 11.10e-3,
               cands.describe(flat[0]): 11.28e-3,            # 2.1%: a near tie
               cands.describe(two[0]): 11.05e-3 * (1 + 1.5 * cands.NEAR_TIE)}  # no tie
  compiled = ((hyb, (27.4e-3, 20.8e-3, 21.7e-3)), (once, (27.3e-3, 20.9e-3, 21.3e-3)),
              (flat, (27.1e-3, 20.5e-3, 21.0e-3)), (two, (9e-3, 9e-3, 9e-3)))
  times = {cands.describe(o): t for lay, ts in compiled for o, t in zip(lay, ts)}
  best, done = _plan_of([two[0], hyb[0], flat[0], once[0]], estimates, times, monkeypatch)
  assert best == "ZeRO-3 flat prefetch 1 remat saving dots"
  # The budget: hybrid with every policy, gather_once without remat. Beyond it the near tie,
  # under the policy of the fastest so far (hybrid saving dots); it beat hybrid there, so its
  # other policies follow (and gather_once's, which beat hybrid without remat).
  assert done[:5] == names(hyb) + names(once[:1]) + names(flat[1:2])
  assert set(done[5:]) == set(names(flat[::2] + once[1:]))
  assert not any(n.startswith("ZeRO-2") for n in done)   # 7.5% slower by estimate: not a tie
  # A near tie slower where it is asked costs one compile, nothing more.
  times[cands.describe(flat[1])] = 21.0e-3
  best, done = _plan_of([two[0], hyb[0], flat[0], once[0]], estimates, times, monkeypatch)
  assert best == "ZeRO-3 hybrid prefetch 1 remat saving dots"
  assert [n for n in done if "flat" in n] == names(flat[1:2])
