"""tools/check_links.py, the link check CI runs on the built docs site, on a small made-up site."""

import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_links", ROOT / "tools" / "check_links.py")
check_links = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_links)


def _site(tmp_path, links):
  (tmp_path / "guides").mkdir(parents=True)
  (tmp_path / "_static").mkdir()
  (tmp_path / "_static" / "style.css").write_text("")
  (tmp_path / "_static" / "macros.html").write_text('<a href="{{ pathto(x) }}">theme</a>')
  (tmp_path / "index.html").write_text(
      '<h1 id="top">t</h1><a name="old"></a><link rel="stylesheet" href="_static/style.css">'
      + "".join(f'<a href="{l}">x</a>' for l in links))
  (tmp_path / "api.html").write_text('<dt id="zero_jax.gather">gather</dt><p id="réf"></p>',
                                     encoding="utf-8")
  (tmp_path / "guides" / "index.html").write_text('<a href="../api.html#zero_jax.gather">g</a>')
  return tmp_path


def test_links_that_lead_somewhere_pass(tmp_path):
  good = ["api.html", "api.html#zero_jax.gather", "#top", "#old", "guides/", "guides/index.html",
          "./api.html?x=1#zero_jax.gather", "api.html#r%C3%A9f", "https://example.org/x.html#y",
          "mailto:a@b.c", "//cdn.example/x.js", "data:image/png;base64,AA=="]
  assert check_links.broken_links(_site(tmp_path, good)) == []


def test_each_missing_file_and_anchor_is_reported_with_its_page_and_why(tmp_path):
  site = _site(tmp_path, ["api.html#zero_jax.hlo.collectives", "nothere.html", "#nowhere",
                          "guides/missing/", "../outside.html"])
  (site / "guides" / "index.html").write_text('<img src="../_images/plot.png">')
  broken = check_links.broken_links(site)
  assert broken == [
      "guides/index.html:1: ../_images/plot.png (no file _images/plot.png)",
      "index.html:1: api.html#zero_jax.hlo.collectives "
      "(no anchor #zero_jax.hlo.collectives in api.html)",
      "index.html:1: nothere.html (no file nothere.html)",
      "index.html:1: #nowhere (no anchor #nowhere in index.html)",
      "index.html:1: guides/missing/ (no file guides/missing/index.html)",
      "index.html:1: ../outside.html (outside the site)"]


def test_the_command_line_exits_1_on_a_broken_link_and_0_on_none(tmp_path):
  run = lambda site: subprocess.run([sys.executable, str(ROOT / "tools" / "check_links.py"),
                                     str(site)], capture_output=True, text=True, timeout=60)
  ok = run(_site(tmp_path / "ok", ["api.html"]))
  assert ok.returncode == 0 and ok.stdout == "", ok.stdout + ok.stderr
  bad = run(_site(tmp_path / "bad", ["api.html#gone"]))
  assert bad.returncode == 1 and "no anchor #gone in api.html" in bad.stdout
  assert run(tmp_path / "nosite").returncode == 2


def test_the_api_page_gives_every_object_its_anchor():
  """``:no-index:`` leaves an object without an anchor: its "[docs]" link and every
  cross-reference to it lead nowhere (the link check of the built site catches that in CI)."""
  text = (ROOT / "docs" / "api.md").read_text()
  assert ":no-index:" not in text and ":noindex:" not in text
