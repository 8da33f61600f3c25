#!/usr/bin/env bash
# Install the wheels carried in .carry/wheels on the (offline) device machine. Idempotent and
# fast: about 10 s the first time, nothing after (a stamp names the wheels installed).
#
#   bash benchmarks/setup_device.sh
#
# RoundPipe 0.1.1 needs transformers 4.57 (its model presets call the 4.x masking API), while
# rpcompile, eager and FSDP2 use the machine's own transformers 5.x. So RoundPipe, its
# dependencies (beartype, py-cpuinfo, ninja) and transformers 4.57 / huggingface-hub 0.36 /
# tokenizers 0.22 (+ requests, which hub 0.36 imports) go into one separate --target directory,
# RP_SITE, that the harness puts first on PYTHONPATH (and its bin/ first on PATH, for ninja) in
# the RoundPipe child only. Nothing is installed into the machine's site-packages.
#
# RP_SITE defaults to ~/.cache/rpcompile-bench/rp_site: outside the repository, so it never
# travels with the working tree, and it survives between calls while the machine stays warm.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.carry/wheels}
RP_SITE=${RP_SITE:-$HOME/.cache/rpcompile-bench/rp_site}
PY=${PYTHON:-python}
PKGS=("roundpipe==0.1.1" beartype py-cpuinfo ninja "transformers==4.57.*" "huggingface-hub==0.36.*"
      "tokenizers==0.22.*" requests urllib3 idna certifi charset-normalizer)

if [ ! -d "$WHEELS" ]; then
  echo "setup_device: $WHEELS is missing (carry .carry with the working tree; see benchmarks/README.md)" >&2
  exit 1
fi
stamp="$RP_SITE/.installed-$( (ls "$WHEELS"; echo "${PKGS[*]}") | sha1sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  echo "setup_device: $RP_SITE is up to date"
else
  t0=$(date +%s)
  rm -rf "$RP_SITE"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$WHEELS" --no-deps \
      --target "$RP_SITE" "${PKGS[@]}"
  touch "$stamp"
  echo "setup_device: installed ${#PKGS[@]} packages into $RP_SITE in $(( $(date +%s) - t0 )) s"
fi

# What RoundPipe will find. Warnings only: the harness records whatever happens.
PYTHONPATH="$RP_SITE" PATH="$RP_SITE/bin:$PATH" "$PY" - <<'PYEOF' || echo "setup_device: WARNING: the RoundPipe environment does not import (see above)" >&2
import os, shutil, subprocess, sysconfig
import transformers, huggingface_hub, tokenizers, beartype, cpuinfo
print(f"setup_device: RoundPipe env: transformers {transformers.__version__}, huggingface-hub "
      f"{huggingface_hub.__version__}, tokenizers {tokenizers.__version__}, beartype {beartype.__version__}")
assert transformers.__version__.startswith("4.57"), transformers.__version__
for tool in ("ninja", os.environ.get("CXX", "c++")):
    if shutil.which(tool) is None:
        print(f"setup_device: WARNING: no {tool} on PATH: roundpipe.optim.Adam cannot compile its C++ kernel "
              "(the runner then falls back to torch.optim.Adam(fused=True) and says so in the table)")
if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
    print("setup_device: WARNING: Python.h is missing: torch.utils.cpp_extension cannot build RoundPipe's Adam")
PYEOF
