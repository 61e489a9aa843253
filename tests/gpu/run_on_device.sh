#!/usr/bin/env bash
# The whole GPU check of issue #33 on one CUDA machine, in under 8 minutes; results under $OUT.
#
#   OUT=/some/dir bash tests/gpu/run_on_device.sh      (from the repository root; OUT defaults to ./gpu-results)
#
# Uses the machine's own torch (never installs one): gradsync is imported from src/ through PYTHONPATH.
# Steps, each under its own timeout so that one hang cannot eat the others' time:
#   1. probe (<= 30 s): torch, CUDA, NCCL, the GPU, and that gradsync imports;
#   2. tests/gpu (<= 270 s; an estimated 150 s, not yet measured): pytest, a JUnit XML, torch DDP's control outcomes in
#      torch_ddp_control.json;
#   3. the GPT-2-small benchmark, benchmarks/studies/gpu_step.py (<= 150 s; an estimated 60 s): gpu_step.json
#      and its report.
# The timeouts add up to 450 s, so the whole check ends within 8 minutes even when a step hangs.
# At most 8 files land in $OUT (what the device tool brings back): probe.txt, tests.log, tests.xml,
# torch_ddp_control.json, bench.log, gpu_step.json, YYYY-MM-DD-gpu-step.md, summary.txt.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} GRADSYNC_GPU_OUT="$OUT"
start=$(date +%s)

timeout 30 "$PY" - >"$OUT/probe.txt" 2>&1 <<'EOF'
import platform
import torch
import torch.distributed as dist
import gradsync
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
print("cuda available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0))
    print("nccl", torch.cuda.nccl.version(), "| nccl available", dist.is_nccl_available())
    print("torch.cuda._sleep", hasattr(torch.cuda, "_sleep"), "| gloo", dist.is_gloo_available())
print("gradsync", gradsync.__version__, "from", gradsync.__file__)
EOF
probe=$?
cat "$OUT/probe.txt"

set -o pipefail
timeout 270 "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
tests=$?

timeout 150 "$PY" -m benchmarks.studies.gpu_step --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench=$?

{
  echo "probe exit $probe, tests exit $tests, benchmark exit $bench (124: timed out)"
  echo "wall $(( $(date +%s) - start )) s"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 1
} | tee "$OUT/summary.txt"
[ "$probe" -eq 0 ] && [ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
