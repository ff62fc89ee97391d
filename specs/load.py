"""Reading specs from YAML / JSON files and the bundled presets.

Files are parsed with a safe YAML loader (``yaml.SafeLoader`` that also refuses duplicate
keys) or ``json``: a spec never imports or runs code. A key given twice, an empty file and
a mistyped preset name are errors, never a silently different spec.

Example:
    >>> from qcompile.specs import load_spec, presets
    >>> "int8-qat" in presets()
    True
    >>> load_spec("int8-qat").quant.mode
    'qat'
    >>> load_spec("int8-qta")
    Traceback (most recent call last):
    ...
    qcompile.errors.QCompileError: spec file 'int8-qta' does not exist ... 'int8-qat'?
      fix: give a path to a .yaml/.json spec or a preset name: 8da4w-qat, gguf-q4_0-qat, ...
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

import yaml

from qcompile.errors import QCompileError
from qcompile.files import write_atomically
from qcompile.specs.compile import CompileSpec

PRESET_DIR = Path(__file__).resolve().parent / "presets"
_MERGE_TAG = "tag:yaml.org,2002:merge"


def presets() -> dict[str, Path]:
    """Bundled preset names -> file paths."""
    return {p.stem: p for p in sorted(PRESET_DIR.glob("*.yaml"))}


class _DuplicateKey(ValueError):
    """A mapping in a spec file gives the same key twice (``path`` is e.g. ``quant.mode``)."""

    def __init__(self, key: object, parent: str, line: int | None,
                 first_line: int | None) -> None:
        self.key, self.parent, self.line, self.first_line = key, parent, line, first_line
        self.path = _key(parent, key)
        super().__init__(f"duplicate key {key!r} at {self.path}")


def _key(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _index(path: str, i: int) -> str:
    return f"{path}[{i}]"


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping giving the same key twice.

    Plain YAML keeps the last value, so a second ``mode: none`` under ``quant:`` would
    silently turn a quantized spec into a float one. The check walks the composed node
    tree before anything is constructed (the tree still has every key with its line, and
    the path to it), then construction is SafeLoader's own: no Python object is ever made.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_unique(node, "", set())
        return super().construct_document(node)

    def _check_unique(self, node: yaml.Node, path: str, seen: set[int]) -> None:
        # An alias is the same node object again: checked once (also guards alias cycles
        # and alias bombs, which would otherwise be walked exponentially often).
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_unique(item, _index(path, i), seen)
        elif isinstance(node, yaml.MappingNode):
            first: dict[object, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:  # `<<: *base`: explicit keys override it
                    self._check_unique(value_node, path, seen)
                    continue
                key: object = None
                if isinstance(key_node, yaml.ScalarNode):
                    key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key is not None:
                    try:
                        if key in first:
                            raise _DuplicateKey(key, path, line, first[key])
                        first[key] = line
                    except TypeError:  # unhashable key: SafeLoader reports it itself
                        pass
                self._check_unique(value_node, _key(path, key), seen)


class _Duplicates(dict):
    """A JSON object that repeated a key (``json`` hands the pairs over, then we know)."""

    duplicate: object = None


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            dup = _Duplicates(out)
            dup.duplicate = k
            return dup
        out[k] = v
    return out


def _json_duplicate(data: Any, path: str = "") -> tuple[str, object] | None:
    """Where the first ``_Duplicates`` object sits in decoded JSON: (its path, the key)."""
    if isinstance(data, _Duplicates):
        return path, data.duplicate
    if isinstance(data, dict):
        children = [(_key(path, k), v) for k, v in data.items()]
    elif isinstance(data, list):
        children = [(_index(path, i), v) for i, v in enumerate(data)]
    else:
        return None
    for child, v in children:
        found = _json_duplicate(v, child)
        if found:
            return found
    return None


def _load_json(text: str) -> Any:
    data = json.loads(text, object_pairs_hook=_json_pairs)
    found = _json_duplicate(data)
    if found is None:
        return data
    parent, key = found
    # json gives no positions; valid JSON nearly always composes as YAML, which has lines.
    try:
        yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        if e.path == _key(parent, key):
            raise
    except yaml.YAMLError:
        pass
    raise _DuplicateKey(key, parent, None, None)


def _empty_error(path: Path) -> QCompileError:
    names = ", ".join(presets())
    return QCompileError(
        f"spec file {str(path)!r} is empty: it would mean quant.mode none, a float graph",
        fix=f"start from a preset: load_spec('<name>') or copy specs/presets/<name>.yaml "
        f"(presets: {names}); for a float graph write `quant: {{mode: none}}`")


def _read(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QCompileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})",
                            fix="save the spec file as UTF-8") from None
    if path.suffix.lower() == ".json" and not text.strip():  # YAML: a None document, below
        raise _empty_error(path)
    try:
        if path.suffix.lower() == ".json":
            data = _load_json(text)
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no objects
    except _DuplicateKey as e:
        where = f"line {e.line}" if e.line is not None else "the file"
        first = f" (first given at line {e.first_line})" if e.first_line is not None else ""
        under = f"under `{e.parent}:`" if e.parent else "at the top level"
        raise QCompileError(
            f"{path}: duplicate key {e.key!r} at {e.path}, {where}{first}: the later value "
            "would silently replace the earlier one",
            fix=f"keep one `{e.key}:` {under} and delete the other") from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise QCompileError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {e}",
                            fix="correct the syntax at the position shown") from None
    if data is None:  # an empty document, only comments, `---` or `null`
        raise _empty_error(path)
    return data


_ACCEPTS = ("a spec file path (str or pathlib.Path), a preset name, a dict or a "
            "CompileSpec")


def load_spec(path: str | os.PathLike[str] | dict[str, Any] | CompileSpec) -> CompileSpec:
    """Load and validate a spec from a ``.yaml``/``.yml``/``.json`` file, or a preset name
    (a dict is validated, a ``CompileSpec`` returned as it is).

    Raises ``QCompileError`` for a missing, empty or unparsable file (or a key given twice)
    and pydantic's ``ValidationError`` (naming the field path) for a file that parses but
    is not a spec.
    """
    if isinstance(path, CompileSpec):
        return path
    if isinstance(path, dict):
        return CompileSpec.model_validate(path)
    if not isinstance(path, (str, os.PathLike)):
        raise QCompileError(f"load_spec takes {_ACCEPTS}; got {type(path).__name__}",
                            fix="pass e.g. qc.load_spec('spec.yaml') or qc.load_spec('int8-qat')")
    if isinstance(path, str) and not path.strip():
        raise QCompileError("load_spec: the spec path is an empty string",
                            fix=f"give a path to a .yaml/.json spec or a preset name: "
                            f"{', '.join(presets())}")
    p = Path(path)
    if p.is_dir():
        raise QCompileError(f"spec path {str(path)!r} is a directory",
                            fix="give the path of a .yaml/.json spec file inside it")
    if not p.is_file():
        known = presets()
        if str(path) in known:
            p = known[str(path)]
        else:
            near = difflib.get_close_matches(str(path), list(known), n=1)
            hint = f" and is not a preset name; did you mean {near[0]!r}?" if near else ""
            raise QCompileError(
                f"spec file {str(path)!r} does not exist{hint}",
                fix=f"give a path to a .yaml/.json spec or a preset name: {', '.join(known)}",
            )
    data = _read(p)
    if not isinstance(data, dict):
        raise QCompileError(f"{p}: a spec is a mapping at the top level, got "
                            f"{type(data).__name__}", fix="start the file with `version: 1`")
    return CompileSpec.model_validate(data)


def _target(path: str | os.PathLike[str], writer: str) -> Path:
    """``path`` as a spec file to write, refused before anything is written when it is a
    folder or its folder does not exist (as export_onnx and export_encodings refuse it)."""
    if not isinstance(path, (str, os.PathLike)):
        raise QCompileError(f"{writer}: the path is a {type(path).__name__}",
                            fix="give a file path, e.g. 'spec.yaml'")
    p = Path(path)
    if p.is_dir():
        raise QCompileError(f"{writer}: {str(path)!r} is a folder",
                            fix=f"give a file path, e.g. {str(p / 'spec.yaml')!r}")
    if not p.parent.is_dir():
        raise QCompileError(f"{writer}: the folder {str(p.parent)!r} of {str(path)!r} does "
                            "not exist", fix=f"create it first (os.makedirs({str(p.parent)!r}))"
                            " or write into an existing folder")
    return p


def dump_spec(spec: CompileSpec, path: str | os.PathLike[str]) -> None:
    """Write a spec as YAML (``.yaml``/``.yml``) or JSON (anything else), whole or not at
    all (``qcompile.files``)."""
    p = _target(path, "dump_spec")
    # A full dump: leaving defaults out would drop discriminators such as observer.kind.
    data = spec.model_dump(mode="json")
    if p.suffix.lower() in (".yaml", ".yml"):
        write_atomically(p, yaml.safe_dump(data, sort_keys=False))
    else:
        write_atomically(p, json.dumps(data, indent=2) + "\n")


def _compact(spec: CompileSpec) -> dict[str, Any]:
    """The fields the spec was given (what a hand-written file says), if they read back as
    the same spec; else the full dump (a discriminator such as ``observer.kind`` left at
    its default would otherwise be dropped)."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    try:
        if CompileSpec.model_validate(data) == spec:
            return data
    except ValueError:
        pass
    return spec.model_dump(mode="json")


class _SpecDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` writing lists of plain values on one line (``[Linear, Conv1D]``),
    as hand-written specs do."""


def _list(dumper: yaml.SafeDumper, value: list[Any]) -> yaml.Node:
    flat = all(isinstance(v, (str, int, float, bool)) or v is None for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flat)


_SpecDumper.add_representer(list, _list)


def _yaml(value: Any, indent: int) -> str:
    text = yaml.dump(value, Dumper=_SpecDumper, sort_keys=False, default_flow_style=False,
                     width=100)
    pad = " " * indent
    return "".join(pad + line if line.strip() else line
                   for line in text.splitlines(keepends=True))


def _comment(text: str, indent: int) -> str:
    return "".join(f"{' ' * indent}# {line}".rstrip() + "\n" for line in text.splitlines())


def save_spec(spec: CompileSpec | dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``spec`` as YAML that ``load_spec(path)`` reads back to an equal spec (JSON
    for a ``.json`` path). Only the fields the spec was given are written (a full dump
    where that would not read back equal). A rule's ``note`` (``qc.search`` writes the
    measured sensitivity per candidate there) is also written as comment lines above it.

    The file is written whole or not at all (a temporary beside it, fsynced, then moved into
    place, with the mode a new file gets under the user's umask): an interrupted save leaves
    the previous file. A folder that does not exist is refused (``QCompileError``), before
    anything is written.

    Example:
        >>> import tempfile, os
        >>> from qcompile.specs import load_spec
        >>> spec = load_spec("int8-qat")
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_spec(spec, os.path.join(d, "spec.yaml"))
        ...     load_spec(os.path.join(d, "spec.yaml")) == spec
        True
    """
    if isinstance(spec, dict):
        spec = CompileSpec.model_validate(spec)
    if not isinstance(spec, CompileSpec):
        raise QCompileError(f"save_spec takes a CompileSpec (or a dict), got "
                            f"{type(spec).__name__}",
                            fix="pass the spec qc.search or qc.load_spec returned")
    p = _target(path, "save_spec")
    data = _compact(spec)
    if p.suffix.lower() == ".json":
        write_atomically(p, json.dumps(data, indent=2) + "\n")
        return
    parts = []
    for key, value in data.items():
        if key != "quant" or not isinstance(value, dict) or not value.get("rules"):
            parts.append(_yaml({key: value}, 0))
            continue
        parts.append("quant:\n")
        for qkey, qvalue in value.items():
            if qkey != "rules":
                parts.append(_yaml({qkey: qvalue}, 2))
                continue
            parts.append("  rules:\n")
            for rule in qvalue:
                if rule.get("note"):
                    parts.append(_comment(rule["note"], 4))
                parts.append(_yaml([rule], 4))
    write_atomically(p, "".join(parts))


def as_spec(spec: Any) -> CompileSpec:
    """``spec`` as a ``CompileSpec``: one already, a dict, a file path or a preset name.

    Example:
        >>> as_spec({"quant": {"mode": "dynamic"}}).quant.mode
        'dynamic'
    """
    if isinstance(spec, CompileSpec):
        return spec
    if isinstance(spec, dict):
        return CompileSpec.model_validate(spec)
    if isinstance(spec, (str, os.PathLike)):
        return load_spec(spec)
    raise QCompileError(f"spec must be a CompileSpec, a dict or a path, got {type(spec).__name__}",
                        fix="pass qc.load_spec('file.yaml') or a preset name like 'int8-qat'")
