#!/usr/bin/env bash
# The GPU checks in one go, on a CUDA machine whose Python has torch but may lack Ray.
#
#   bash benchmarks/gpu_run.sh        # from the repository root; logs go to $OUT or ./gpu_out
#
# Where Ray is not installed, it travels as .whl/site.tar.xz (git-ignored): Ray 2.60's cp312
# wheel and what Ray Data needs beyond that machine's packages (pydantic, pydantic-core,
# annotated-types, typing-inspection, jsonschema, jsonschema-specifications, referencing,
# rpds-py), unzipped into one folder without ray/jars, rllib, serve, llm and tune, and packed
# with `tar cJf` (33 MB; docs/benchmarks.md, session 28). Each step has its own time limit and
# the script goes on after a failure, so one run reports every step.
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
if [ -f .whl/site.tar.xz ]; then
    mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0

step() {  # step NAME LIMIT_S COMMAND...: run, log to $out/NAME.log, print its exit status
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name: $*"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 15 "$out/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

nvidia-smi -L
python3 -c "import sys, torch, ray, pyarrow; print('python', sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, 'ray', ray.__version__, 'pyarrow',
pyarrow.__version__)"
df -h /dev/shm /tmp | tail -n 2
step gpu_check 240 python3 benchmarks/gpu_check.py --batches 200 --mb 8
step gpu_check_32mb 240 python3 benchmarks/gpu_check.py --batches 100 --mb 32
step gpu_frameworks 180 python3 benchmarks/gpu_frameworks.py
step train_ddp_map 120 torchrun --nproc_per_node=1 examples/train_ddp.py
step train_ddp_ray 120 torchrun --nproc_per_node=1 examples/train_ddp.py --source ray
step unit_device 90 python3 -m pytest -q -p no:cacheprovider tests/unit/test_pinned.py \
    tests/unit/test_stream.py
