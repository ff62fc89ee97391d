# Sourced by tools/demo and tools/test: make sure .venv exists and has qcompile installed.
# torch is installed first, pinned to the CPU build this project is tested with, so pip
# never resolves `torch>=2.6` to a multi-GB CUDA build. Override with QCOMPILE_TORCH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QCOMPILE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_REQ="${QCOMPILE_TORCH:-torch==2.13.0}"
EXTRAS="${QCOMPILE_EXTRAS:-dev,demo,models,onnx,gguf,hf}"

say() { printf '[qcompile setup] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV ($("$PY" --version 2>&1))"
  "$PY" -m venv "$VENV"
fi
# Reinstall only when the project metadata changed since the last install.
stamp="$VENV/.qcompile-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1) $TORCH_REQ $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    say "installing $TORCH_REQ (CPU build)"
    "$VENV/bin/python" -m pip install --progress-bar off "$TORCH_REQ" 2>&1 | grep -v "^WARNING: Location" >&2
  fi
  say "installing qcompile[$EXTRAS] (editable) and its dependencies"
  "$VENV/bin/python" -m pip install --progress-bar off -e "$ROOT[$EXTRAS]" "$TORCH_REQ" 2>&1 \
    | grep -v "^WARNING: Location" | grep -v "^Requirement already satisfied" >&2 || true
  "$VENV/bin/python" -c "import qcompile, torch" || { say "install failed"; exit 1; }
  echo "$want" > "$stamp"
  say "ready: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')"
fi
# Build the fused fake-quant kernels (qcompile/runtime/csrc) once, so tests and the demo only load
# them; never fatal: without them qcompile runs its eager fake-quant (same results).
if kout="$("$VENV/bin/python" -m qcompile.runtime.kernels 2>&1)"; then
  say "${kout##*$'\n'}"
else
  say "fast fake-quant kernels unavailable, the eager fallback is used: ${kout##*$'\n'}"
fi
