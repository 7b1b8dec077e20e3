#!/usr/bin/env bash
# The cuda tier (pytest -m cuda: tests/test_cuda.py) on this machine's GPU, and one JSON
# summary of it: bench/out/gpu_check.json (torch and CUDA versions, the device, each
# test's outcome and seconds, and the figures the tests recorded: CUDA peaks against the
# planner's estimate, parity errors). Made for one H100, in under 10 minutes.
#
#     bench/gpu_check.sh              # everything marked cuda
#     bench/gpu_check.sh -k memory    # more pytest options
#
# Runs on whatever torch the machine has: it installs zero_fx with --no-deps (and without
# build isolation, which would fetch setuptools), so pip touches neither torch nor anything
# else, and the JSON records the torch, CUDA and NCCL versions and the git commit. Its
# verdict is "passed" only when every test passed, "failed" when any failed or errored.
#
# Exits with pytest's status. Without a GPU every test is skipped, and the summary says so.
set -uo pipefail
cd "$(dirname "$0")/.."
out=bench/out
mkdir -p "$out"
torch_before=$(python -c "import torch; print(torch.__version__)")
python -m pip install -q --no-deps --no-build-isolation -e . || exit 1
torch_after=$(python -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
    echo "installing zero_fx changed torch from $torch_before to $torch_after" >&2
    exit 1
fi
commit=$(git rev-parse HEAD 2>/dev/null || echo "${ZERO_FX_COMMIT:-unknown}")
if [ "$commit" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    commit="$commit with uncommitted changes"
fi
figures="$out/gpu_check_figures.jsonl"
rm -f "$figures" "$out/gpu_check.xml"
start=$(date +%s)
# The limit only guards against a hang (a healthy run takes well under 10 minutes);
# GPU_CHECK_LIMIT_S lowers it. At the limit pytest is interrupted (SIGINT),
# so it still reports what ran and writes the XML the summary is read from.
ZERO_FX_GPU_FIGURES="$figures" timeout -s INT -k 60 "${GPU_CHECK_LIMIT_S:-1500}" python -m pytest -m cuda -q -rfEs \
    --junitxml="$out/gpu_check.xml" tests "$@"
status=$?
python -m bench.helpers.gpu_check_report --junit "$out/gpu_check.xml" --figures "$figures" \
    --status "$status" --seconds "$(( $(date +%s) - start ))" --commit "$commit" \
    --out "$out/gpu_check.json"
exit "$status"
