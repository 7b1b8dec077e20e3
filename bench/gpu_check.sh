#!/usr/bin/env bash
# The cuda tier (pytest -m cuda: tests/test_cuda.py) on this machine's GPU, and one JSON
# summary of it: bench/out/gpu_check.json (torch and CUDA versions, the device, each
# test's outcome and seconds, and the figures the tests recorded: CUDA peaks against the
# planner's estimate, parity errors). Made for one H100, in under 10 minutes.
#
#     bench/gpu_check.sh              # everything marked cuda
#     bench/gpu_check.sh -k memory    # more pytest options
#
# Exits with pytest's status. Without a GPU every test is skipped, and the summary says so.
set -uo pipefail
cd "$(dirname "$0")/.."
out=bench/out
mkdir -p "$out"
figures="$out/gpu_check_figures.jsonl"
rm -f "$figures" "$out/gpu_check.xml"
start=$(date +%s)
# The limit only guards against a hang (a healthy run takes well under 10 minutes);
# GPU_CHECK_LIMIT_S lowers it to fit a lease. At the limit pytest is interrupted (SIGINT),
# so it still reports what ran and writes the XML the summary is read from.
ZERO_FX_GPU_FIGURES="$figures" timeout -s INT -k 60 "${GPU_CHECK_LIMIT_S:-1500}" python -m pytest -m cuda -q -rfEs \
    --junitxml="$out/gpu_check.xml" tests "$@"
status=$?
python -m bench.gpu_check_report --junit "$out/gpu_check.xml" --figures "$figures" \
    --status "$status" --seconds "$(( $(date +%s) - start ))" --out "$out/gpu_check.json"
exit "$status"
