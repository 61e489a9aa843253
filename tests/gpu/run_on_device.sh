#!/usr/bin/env bash
# The whole GPU check of issues #33 and #45 on one CUDA machine, in under 8 minutes; results under $OUT.
#
#   OUT=/some/dir bash tests/gpu/run_on_device.sh      (from the repository root; OUT defaults to ./gpu-results)
#
# Uses the machine's own torch (never installs one): gradsync is imported from src/ through PYTHONPATH.
# Steps, each under its own timeout so that one hang cannot eat the others' time:
#   1. probe (<= 30 s): torch, CUDA, NCCL, the GPU, and that gradsync imports (into summary.txt);
#   2. the GPT-2-small benchmark, benchmarks/studies/gpu_step.py (<= 100 s; 80 s on an H200), 10 interleaved
#      rounds: gpu_step.json and its report (first: it is what only this machine can give);
#   3. where the host time goes at batch 1, benchmarks/studies/gpu_host_profile.py (<= 50 s; 40 s on an H200):
#      host_profile.json, host_profile.log;
#   4. DiLoCo on the GPU, benchmarks/studies/diloco_gpu.py (<= 110 s; not yet run on a GPU): a 1 B model, 2 rounds
#      of H = 100, its JSON lines appended to bench.log (no file of its own);
#   5. tests/gpu (<= 190 s, at most 90 s a test): tests.log, torch DDP's control outcomes in
#      torch_ddp_control.json.
# The timeouts add up to 480 s, so the whole check ends within 8 minutes even when a step hangs.
# Exactly 8 files land in $OUT (what the device tool brings back at most): summary.txt, bench.log,
# gpu_step.json, YYYY-MM-DD-gpu-step.md, host_profile.json, host_profile.log, tests.log, torch_ddp_control.json.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} GRADSYNC_GPU_OUT="$OUT"
start=$(date +%s)

timeout 30 "$PY" - >"$OUT/summary.txt" 2>&1 <<'EOF'
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
cat "$OUT/summary.txt"

set -o pipefail
timeout 100 "$PY" -m benchmarks.studies.gpu_step --rounds 10 --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench=$?

timeout 50 "$PY" -m benchmarks.studies.gpu_host_profile --out "$OUT" >"$OUT/host_profile.log" 2>&1
profile=$?
head -c 3000 "$OUT/host_profile.log"

timeout 110 "$PY" -m benchmarks.studies.diloco_gpu --rounds 2 2>&1 | tee -a "$OUT/bench.log"
diloco=$?

timeout 190 "$PY" -m pytest tests/gpu -q -rs --tb=short --timeout 90 -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
tests=$?

{
  echo "probe exit $probe, benchmark exit $bench, host profile exit $profile, diloco exit $diloco, tests exit $tests (124: timed out)"
  echo "wall $(( $(date +%s) - start )) s"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 1
} | tee -a "$OUT/summary.txt"
[ "$probe" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$profile" -eq 0 ] && [ "$diloco" -eq 0 ] && [ "$tests" -eq 0 ]
