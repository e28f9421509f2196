#!/usr/bin/env bash
# Here (a machine that reaches PyPI): put into .gpu/ (git-ignored) what the GPU machine lacks — wheels of
# fedmosaic's dependencies its image does not hold (Python 3.12, manylinux x86-64) and the datasets the check reads.
# Then run benchmarks/gpu/check.sh there (docs/design.md "GPU"). Idempotent; about 35 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
data=${FEDMOSAIC_DATA:-../shared/data}
mkdir -p .gpu/whl .gpu/data/mnist .gpu/data/cifar-10-jpeg
# the image has numpy, scipy, pyyaml, matplotlib, tqdm, pillow, scikit-learn, typing-extensions and torch; not these
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
  "pydantic==2.14.4" "pydantic_core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5" \
  "typing-extensions==4.16.0"
cp -u "$data/mnist/mnist.npz" .gpu/data/mnist/
cp -u "$data/cifar-10-jpeg/cifar10_jpeg_q75.tar.gz" .gpu/data/cifar-10-jpeg/
du -sh .gpu
