#!/usr/bin/env bash
# Build the wheels benchmarks/gpu/run.py installs on the device machine (which has torch 2.11 with
# CUDA 13, Triton and numpy, but not DeepSpeed, and no network).  Run here, from the repo root:
#
#     bash benchmarks/gpu/build_wheels.sh            # -> benchmarks/gpu/wheels/ (git-ignored)
#
# then carry benchmarks/gpu/wheels to the device (the device tool's `carry`).  run.py installs
# from it with `pip install --no-index --find-links benchmarks/gpu/wheels <what is missing>`;
# pip resolves DeepSpeed's requirements from the folder, and whatever the image already has
# (torch, numpy, ...) satisfies its own.  DeepSpeed 0.19.8 is pure Python (ops build at run
# time); its requirements (with theirs: pydantic-core, msgpack and psutil are compiled) are
# and pytest (the CUDA tier) fetched as binary wheels for every CPython the image might run (3.10-3.13, manylinux x86-64),
# resolved together so pydantic and pydantic-core match.
set -euo pipefail
W="${1:-benchmarks/gpu/wheels}"
mkdir -p "$W"
pip wheel --no-deps -w "$W" deepspeed==0.19.8
REQS="hjson msgpack ninja py-cpuinfo psutil einops packaging tqdm pyyaml pydantic>=2 pytest"
for py in 3.10 3.11 3.12 3.13; do
  # shellcheck disable=SC2086
  pip download --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 --python-version "$py" -d "$W" $REQS
done
ls -la "$W"
du -sh "$W"
