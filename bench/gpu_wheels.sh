#!/usr/bin/env bash
# Fetches, into .whl/ (git-ignored), the wheels bench/gpu_check.sh needs that the accelerator machine's image
# lacks (it has torch, triton, pyarrow, pyyaml, tqdm, pytest, hypothesis; not pydantic), built for its Python
# (3.12, x86-64). Run once here, where PyPI is reachable; the device tool then carries .whl (carry=[".whl"]).
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python3}
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl "pydantic>=2.6,<3"
ls -1 .whl
