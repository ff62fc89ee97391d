"""Reading specs from YAML / JSON files and the bundled presets.

Files are parsed with ``yaml.safe_load`` / ``json`` only: a spec never imports or runs code.

Example:
    >>> from qcompile.specs import load_spec, presets
    >>> "int8-qat" in presets()
    True
    >>> load_spec("int8-qat").quant.mode
    'qat'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from qcompile.errors import QCompileError
from qcompile.specs.compile import CompileSpec

PRESET_DIR = Path(__file__).resolve().parent / "presets"


def presets() -> dict[str, Path]:
    """Bundled preset names -> file paths."""
    return {p.stem: p for p in sorted(PRESET_DIR.glob("*.yaml"))}


def _read(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QCompileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})",
                            fix="save the spec file as UTF-8") from None
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise QCompileError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {e}",
                            fix="correct the syntax at the position shown") from None


def load_spec(path: str | Path) -> CompileSpec:
    """Load and validate a spec from a ``.yaml``/``.yml``/``.json`` file, or a preset name.

    Raises ``QCompileError`` for a missing or unparsable file and pydantic's
    ``ValidationError`` (naming the field path) for a file that parses but is not a spec.
    """
    p = Path(path)
    if p.is_dir():
        raise QCompileError(f"spec path {str(path)!r} is a directory",
                            fix="give the path of a .yaml/.json spec file inside it")
    if not p.is_file():
        known = presets()
        if str(path) in known:
            p = known[str(path)]
        else:
            raise QCompileError(
                f"spec file {str(path)!r} does not exist",
                fix=f"give a path to a .yaml/.json spec or a preset name: {', '.join(known)}",
            )
    data = _read(p)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise QCompileError(f"{p}: a spec is a mapping at the top level, got "
                            f"{type(data).__name__}", fix="start the file with `version: 1`")
    return CompileSpec.model_validate(data)


def dump_spec(spec: CompileSpec, path: str | Path) -> None:
    """Write a spec as YAML (``.yaml``/``.yml``) or JSON (anything else)."""
    p = Path(path)
    # A full dump: leaving defaults out would drop discriminators such as observer.kind.
    data = spec.model_dump(mode="json")
    if p.suffix.lower() in (".yaml", ".yml"):
        p.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    else:
        p.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


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
    if isinstance(spec, (str, Path)):
        return load_spec(spec)
    raise QCompileError(f"spec must be a CompileSpec, a dict or a path, got {type(spec).__name__}",
                        fix="pass qc.load_spec('file.yaml') or a preset name like 'int8-qat'")
