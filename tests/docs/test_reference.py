"""The generated reference pages and benchmark plots match what the generator makes now
(``tools/docs`` regenerates them), and say everything they promise."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from qcompile.tools import docs_gen

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_generated_pages_are_current(tmp_path: Path) -> None:
    docs_gen.generate(tmp_path, pages=True, docs=tmp_path)  # pages only: tmp has no data
    stale = [str(rel) for rel in docs_gen.PAGES
             if (tmp_path / rel).read_text() != (DOCS / rel).read_text()]
    assert not stale, f"out of date (run tools/docs): {stale}"


def test_plots_are_current_and_drawn_deterministically(tmp_path: Path) -> None:
    plots = docs_gen.plots()
    assert len(plots) == len(list((DOCS / "benchmarks" / "data").glob("*.json"))) >= 8
    stale = [str(rel) for rel, data in plots.items()
             if docs_gen.svg_stamp(DOCS / rel) != docs_gen._plot_stamp(data)]
    assert not stale, f"out of date (run tools/docs): {stale}"
    data_file = next(iter(plots.values()))
    data = json.loads(data_file.read_text())
    first, second = tmp_path / "a.svg", tmp_path / "b.svg"
    docs_gen._draw(data, first, "sha256:0")
    docs_gen._draw(data, second, "sha256:0")
    svg = first.read_text()
    assert svg == second.read_text()  # no date, fixed ids
    assert svg.lstrip().startswith("<?xml") and data["title"] in svg
    assert docs_gen.svg_stamp(first) == "sha256:0" and "Matplotlib v" not in svg


def test_a_changed_data_file_makes_its_plot_stale(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(DOCS / "benchmarks", docs / "benchmarks")
    name = "search-gap"
    data_file = docs / "benchmarks" / "data" / f"{name}.json"
    data = json.loads(data_file.read_text())
    data["series"]["perplexity"][0] += 0.001
    data_file.write_text(json.dumps(data))
    plots = docs_gen.plots(docs)
    stamp = docs_gen._plot_stamp(plots[Path("benchmarks") / f"{name}.svg"])
    assert stamp != docs_gen.svg_stamp(DOCS / "benchmarks" / f"{name}.svg")
    # an SVG whose data file is gone is reported for removal
    (docs / "benchmarks" / "data" / "fsdp2-memory.json").unlink()
    changed = docs_gen.generate(docs, check=True, docs=docs, pages=False)
    assert changed == [f"benchmarks/{name}.svg", "benchmarks/fsdp2-memory.svg (remove)"]


def _models() -> dict[str, type[BaseModel]]:
    """Every model reachable from CompileSpec, walked here independently of the generator."""
    from qcompile.specs import CompileSpec

    found: dict[str, type[BaseModel]] = {}

    def walk(tp: object) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp.__name__ not in found:
                found[tp.__name__] = tp
                for field in tp.model_fields.values():
                    walk(field.annotation)
            return
        for arg in typing.get_args(tp):
            walk(arg)

    walk(CompileSpec)
    return found


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {p.split(None, 1)[0]: p for p in parts}


def test_spec_reference_has_every_field_of_every_model() -> None:
    sections = _sections((DOCS / "reference" / "spec.md").read_text())
    models = _models()
    assert {"CompileSpec", "QuantSpec", "Scheme", "MinMaxObserver", "GPTQ", "AdapterSpec",
            "SearchSpec", "Budget", "DynamicDim"} <= set(models)
    for name, model in models.items():
        assert name in sections, f"no section for {name}"
        for field, info in model.model_fields.items():
            row = re.search(rf"^\| `{field}` \|(.*)$", sections[name], re.M)
            assert row, f"{name}.{field} missing"
            if info.description:  # as written, less the markdown escapes
                shown = row.group(1).replace("\\", "").replace("&lt;", "<")
                assert " ".join(info.description.split()) in shown, f"{name}.{field}"
    # constraints, defaults, discriminated kinds
    assert re.search(r"^\| `bins` \| int; >= 16, <= 65536 \| `2048` \|", sections[
        "HistogramObserver"], re.M)
    assert "`int2` ... `int16` \\| `uint2` ... `uint16` \\| `fp8_e4m3`" in sections["Scheme"]
    assert "[gptq](#gptq)" in sections["QuantSpec"]
    assert "Chosen by `kind: mse`" in sections["MseObserver"]
    assert "`quant.rules[].weight.observer`" in sections["PercentileObserver"]


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def test_cli_reference_has_every_subcommand_and_argument() -> None:
    from qcompile.tools import bench, inspect_cli

    text = (DOCS / "reference" / "cli.md").read_text()
    sections = re.split(r"^### ", text, flags=re.M)
    root = inspect_cli.parser()
    subs = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    assert {"validate", "show", "sqnr", "search"} <= set(subs.choices)
    for name, sub in subs.choices.items():
        body = next(s for s in sections if s.startswith(f"qcompile-inspect {name}\n"))
        for opt in _options(sub):
            assert f"| `{opt}" in body, f"qcompile-inspect {name} {opt} missing"
    suites = next(a for a in bench.parser()._actions if a.dest == "suite").choices
    for suite in suites:
        assert re.search(rf"^\| `{suite}` \| \S", text, re.M), f"suite {suite} undescribed"


def test_api_reference_lists_every_public_name() -> None:
    import qcompile
    import qcompile.distributed

    text = (DOCS / "reference" / "api.md").read_text()
    entries = re.findall(r"^::: (\S+)$", text, re.M)
    shown = {e.rsplit(".", 1)[-1] for e in entries}
    public = set(qcompile.__all__) - {"__version__", *qcompile._SUBMODULES}
    assert public <= shown
    assert set(qcompile.distributed.__all__) <= shown
    for entry in entries:  # each names the public object itself
        module, name = entry.rsplit(".", 1)
        obj = getattr(qcompile, name, None) or getattr(qcompile.distributed, name)
        assert getattr(importlib.import_module(module), name) is obj, entry


def test_api_source_tree_maps_the_packages_as_pyproject_does(tmp_path: Path) -> None:
    tomllib = pytest.importorskip("tomllib")
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    assert {f"qcompile.{k}": v for k, v in docs_gen.PACKAGE_DIRS.items()} == {
        k: v for k, v in dirs.items() if k != "qcompile"}
    pkg = docs_gen.api_source_tree(tmp_path) / "qcompile"
    assert (pkg / "specs" / "compile.py").resolve() == ROOT / "specs" / "compile.py"
    assert (pkg / "passes").resolve() == ROOT / "passes"
    assert (pkg / "api.py").resolve() == ROOT / "qcompile" / "api.py"


@pytest.mark.parametrize(("fence", "shown"), [
    ("```python no-run", "```python"), ("```bash run", "```bash"),
    ("  ~~~python  run ", "  ~~~python"), ("```python", "```python"),
    ("```text\nrun this", "```text\nrun this")])
def test_fence_words_for_the_code_block_test_are_dropped(fence: str, shown: str) -> None:
    assert docs_gen.strip_fence_options(f"{fence}\nx\n```") == f"{shown}\nx\n```"


def test_doctests_are_fenced_at_their_indentation() -> None:
    doc = "Text.\n\n    >>> f(1)\n    2\n\nMore: x[0][1]."
    assert docs_gen.fence_doctests(doc) == (
        "Text.\n\n    ```pycon\n    >>> f(1)\n    2\n    ```\n\nMore: x[0][1].")
    already = "```pycon\n>>> f(1)\n```"
    assert docs_gen.fence_doctests(already) == already


def test_remote_loads_are_found(tmp_path: Path) -> None:
    (tmp_path / "a.html").write_text('<a href="https://x.org">ok</a><script src="s.js">')
    assert docs_gen.remote_loads(tmp_path) == []
    (tmp_path / "b.html").write_text('<script src="https://unpkg.com/shim"></script>')
    (tmp_path / "c.css").write_text("@font-face{src:url(https://fonts.x/f.woff)}")
    assert [r.split(":")[0] for r in docs_gen.remote_loads(tmp_path)] == ["b.html", "c.css"]
